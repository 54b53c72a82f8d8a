"""Weight update modes side by side on the embedded engine: keep, wait and abort in one run.

Load: ``--streams`` clients (16), each sending one generation of ``--tokens`` (1024, ignore EOS)
after another, started staggered so their ends are spread like a long tail; a "trainer" thread
pushes new weights every ``--push-every`` seconds (20).  Each mode runs the same load on the
same engine loop (``BatchScheduler``, the code the engine server runs, in process) for
``--duration`` seconds.  Printed per mode:

* tokens/s: sampled tokens kept (an aborted answer's tokens are discarded: a harness retries
  the call) over the wall time;
* idle s/update: engine slot-seconds lost per update, ``sum over the update of (free batch slots
  / batch size) * dt``, from when the push was asked until new requests are admitted again,
  plus the load itself;
* added latency p50/p99: time to first token of calls that arrived while an update was pending,
  minus the median time to first token of calls that arrived outside updates;
* tokens discarded, and the share of completions that span two or more versions.

Goals (issue): keep >= 1.5 x wait tokens/s; no call held longer than load + one decode step;
0 tokens discarded under keep.  Run: ``.venv/bin/python bench/inflight_updates.py [--model smollm2]``.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from app.engines.embedded.batching import BatchScheduler
from app.engines.embedded.events import Aborted, GenerationRequest, TokenEvent
from app.engines.embedded.sampling import SamplingParams
from app.engines.modeling import load_model


def _perturbed_states(model, count: int) -> list[dict]:
    base = {k: v.clone() for k, v in model.state_dict().items()}
    out = []
    for seed in range(count):
        gen = torch.Generator().manual_seed(seed)
        out.append({k: v + 0.01 * torch.randn(v.shape, generator=gen) * (v.std() if v.numel() > 1 else 1.0)
                    if v.is_floating_point() else v for k, v in base.items()})
    return out


class Arm:
    """One mode's run: clients, the pusher and the slot monitor around one scheduler."""

    def __init__(self, model, states, mode: str, args) -> None:
        self.sched = BatchScheduler(model, max_batch=args.streams, prefill_chunk=512, prefix_cache_tokens=0,
                                    update_mode=mode).start()
        self.mode, self.args, self.states = mode, args, states
        self.kept = self.discarded = self.spanning = self.completions = 0
        self.ttft_in: list[float] = []
        self.ttft_out: list[float] = []
        self.idle_s = 0.0
        self.updates = 0
        self.lock = threading.Lock()
        self.stop_at = 0.0
        self.updating = threading.Event()

    def client(self, index: int) -> None:
        time.sleep(index * self.args.stagger)
        prompt = [1, 100 + index, 7, 42, 300, 12, 9]
        while time.monotonic() < self.stop_at:
            asked, during = time.perf_counter(), self.updating.is_set()
            req = self.sched.submit(GenerationRequest(prompt, self.args.tokens, SamplingParams(seed=index),
                                                      frozenset()))
            first, versions, count, aborted = None, set(), 0, False
            while True:
                event = req.events.get(timeout=600)
                if isinstance(event, TokenEvent):
                    if first is None:
                        first = time.perf_counter() - asked
                        during = during or self.updating.is_set()
                    versions.add(event.policy_version)
                    count += 1
                    if event.finish_reason is not None:
                        break
                elif isinstance(event, Aborted):
                    aborted = True
                    break
            with self.lock:
                self.completions += 1
                self.spanning += len(versions) > 1
                if aborted:
                    self.discarded += count
                else:
                    self.kept += count
                if first is not None:
                    (self.ttft_in if during else self.ttft_out).append(first)

    def pusher(self) -> None:
        version = 0
        while True:
            deadline = time.monotonic() + self.args.push_every
            while time.monotonic() < deadline:
                if time.monotonic() >= self.stop_at:
                    return
                time.sleep(0.05)
            version += 1
            self.updating.set()
            monitor = threading.Thread(target=self._watch)
            monitor.start()
            self.sched.reload(self.states[version % len(self.states)], version)
            self.updating.clear()
            monitor.join()
            self.updates += 1

    def _watch(self) -> None:
        """Integrate free batch slots while the update is pending (admission stopped or loading)."""
        last = time.perf_counter()
        while self.updating.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            load = self.sched.load()
            busy = load["running"] + load["prefilling"]
            self.idle_s += (now - last) * (1.0 - min(busy, self.args.streams) / self.args.streams)
            last = now

    def run(self) -> dict:
        start = time.monotonic()
        self.stop_at = start + self.args.duration
        threads = [threading.Thread(target=self.client, args=(i,)) for i in range(self.args.streams)]
        threads.append(threading.Thread(target=self.pusher))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - start
        stats = dict(self.sched.stats)
        self.sched.stop()
        base = statistics.median(self.ttft_out) if self.ttft_out else 0.0
        added = sorted(max(0.0, t - base) for t in self.ttft_in)

        def q(p: float) -> float:
            return added[min(len(added) - 1, int(p * len(added)))] if added else float("nan")

        return {"mode": self.mode, "tokens_s": self.kept / wall, "updates": self.updates,
                "idle_s": self.idle_s / max(self.updates, 1) + stats["reload_load_s"] / max(stats["reloads"], 1),
                "load_s": stats["reload_load_s"] / max(stats["reloads"], 1),
                "p50": q(0.5), "p99": q(0.99), "arrived_during": len(added), "discarded": self.discarded,
                "spanning": self.spanning / max(self.completions, 1), "completions": self.completions,
                "recompute_tokens": stats["recompute_tokens"],
                "decode_step_s": wall / max(stats["decode_steps"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny | smollm2 | a checkpoint folder")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--push-every", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds per mode")
    parser.add_argument("--stagger", type=float, default=0.5, help="seconds between the clients' first calls")
    parser.add_argument("--modes", default="wait,keep,abort")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    model.eval()
    states = _perturbed_states(model, 2)
    print(f"model {args.model}, {args.streams} streams x {args.tokens} tokens, push every {args.push_every:g} s, "
          f"{args.duration:g} s per mode, torch threads {args.threads}")
    report([Arm(model, states, mode, args).run() for mode in args.modes.split(",")])


def report(rows: list[dict]) -> None:
    """Print the side-by-side table of `Arm.run` rows, then the goals met or missed."""
    head = (f"{'mode':10} {'tokens/s':>9} {'updates':>7} {'idle s/upd':>10} {'load s':>7} {'added p50':>9} "
            f"{'added p99':>9} {'n during':>8} {'discarded':>9} {'spanning':>8}")
    print(head)
    for r in rows:
        print(f"{r['mode']:10} {r['tokens_s']:9.1f} {r['updates']:7d} {r['idle_s']:10.2f} {r['load_s']:7.3f} "
              f"{r['p50']:9.3f} {r['p99']:9.3f} {r['arrived_during']:8d} {r['discarded']:9d} {r['spanning']:8.2f}")
    by = {r["mode"]: r for r in rows}
    for name in ("keep", "keep-stale"):
        if name not in by or "wait" not in by or by["wait"]["tokens_s"] <= 0:
            continue
        ratio = by[name]["tokens_s"] / by["wait"]["tokens_s"]
        print(f"{name} / wait tokens/s: {ratio:.2f} (goal >= 1.5: {'met' if ratio >= 1.5 else 'missed'}); "
              f"updates landed {by[name]['updates']} vs {by['wait']['updates']}")
        k = by[name]
        bound = k["load_s"] + k["decode_step_s"]
        if k["arrived_during"]:
            held = f"added latency p99 {k['p99']:.3f} s vs load + one decode step {bound:.3f} s: " \
                   f"{'met' if k['p99'] <= bound else 'missed'}"
        else:
            held = f"no call arrived inside an update (each held the engine {k['load_s']:.3f} s, under load + one " \
                   f"decode step {bound:.3f} s)"
        print(f"{name} {held}; tokens discarded {k['discarded']} ({'met' if k['discarded'] == 0 else 'missed'})")


if __name__ == "__main__":
    main()
