"""A real embedded-engine subprocess for tests (any packaged model: tiny, tiny-moe, smollm2)."""
from __future__ import annotations

import os
import subprocess
import sys

from app.config import ROOT
from app.engines.client import EngineClient
from support import free_port


class EngineProcess:
    """``python -m app.engines.embedded.server`` in a subprocess; ``client`` talks to it."""

    def __init__(self, model: str = "tiny", *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"engine-{self.port}.log"), "w+")
        self.proc = subprocess.Popen(
            # One torch thread: on a shared 2-core box OpenMP's spinning barriers make
            # 2 threads up to 20x slower whenever another process holds a core.
            [sys.executable, "-m", "app.engines.embedded.server", "--model", model, "--port", str(self.port),
             "--threads", "1", *extra],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.client = EngineClient(self.url, timeout=120)
        try:
            self.client.health(wait_s=120)
        except TimeoutError:
            self.stop()
            self.log.seek(0)
            raise RuntimeError(f"engine did not start:\n{self.log.read()[-3000:]}")

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


def draw_routed(proc: EngineProcess, prompts: list[str], tokens: int) -> list[dict]:
    """One chat completion per prompt from `proc`, all at once (decoded in one batch), seed = its
    index, `tokens` sampled tokens each, with logprobs, token ids and routed experts: dicts of
    `ids` (prompt + sampled token ids), `p` (prompt length), `logprobs` (float array, one per sampled
    token) and `routes` (int16 [P + S - 1, layers, top_k], or None when the engine sent none)."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> dict:
        out = proc.client.chat([{"role": "user", "content": prompts[i]}], max_tokens=tokens, seed=i,
                               ignore_eos=True, logprobs=True, return_token_ids=True, return_routed_experts=True)
        choice = out["choices"][0]
        return {"ids": out["prompt_token_ids"] + choice["token_ids"], "p": len(out["prompt_token_ids"]),
                "logprobs": np.array([c["logprob"] for c in choice["logprobs"]["content"]]),
                "routes": np.array(out["routed_experts"], dtype=np.int16) if "routed_experts" in out else None}

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))
