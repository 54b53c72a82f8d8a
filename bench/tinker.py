"""Tinker ops through the SDK against the same ops called directly: what the service costs.

Starts a real deployment on a private SQLite file and the local Redis (`--redis`, a database of
its own, flushed): the Tinker service (`app.tinker:create_tinker_app()` under gunicorn,
workers/tinker_conf.py) and the gpu worker (`workers.gpu_worker`), then times `--iters` rounds of
`forward_backward(batch, loss)` + `optim_step(AdamParams)` through the unmodified tinker SDK
(protobuf request, Celery message, SQL future, polling), after one warm-up round (the model
load).  The direct arm runs the same rounds on the same batch with `app.training.tinker_ops` on a
TenantPool in this process (same model, LoRA rank, seed and torch thread count as the worker).
Prints per-round wall time of each op in both arms side by side and the ratio SDK / direct.

    .venv/bin/python bench/tinker.py [--model tiny] [--rank 8] [--batch 8] [--seq 128] [--iters 5]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This file's folder first on sys.path would make `import tinker` import this script, not the SDK.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def _batch(args, vocab: int) -> list[dict]:
    """`--batch` datums of `--seq` random tokens, cross_entropy on the second half (JSON)."""
    rng = random.Random(0)
    out = []
    for _ in range(args.batch):
        tokens = [rng.randrange(3, vocab) for _ in range(args.seq + 1)]
        weights = [float(i >= args.seq // 2) for i in range(args.seq)]
        out.append({"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
                    "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [args.seq]},
                                       "weights": {"data": weights, "dtype": "float32", "shape": [args.seq]}}})
    return out


def _start(args, tmp: Path) -> tuple[str, str, list[subprocess.Popen]]:
    """Environment of the stack in os.environ, the service and the gpu worker started; (url, key, procs)."""
    port = _free_port()
    os.environ.update({
        "DATABASE_URL": f"sqlite:///{tmp / 'bench.db'}", "REDIS_URL": args.redis, "TURNSTILE_VAR_DIR": str(tmp / "var"),
        "TURNSTILE_TINKER_KEYS": json.dumps({"bench": {}}), "TURNSTILE_TINKER_BIND": f"127.0.0.1:{port}",
        "TURNSTILE_TINKER_WORKERS": "1", "TURNSTILE_API_TOKEN": os.environ.get(
            "TURNSTILE_API_TOKEN", "turnstile-bench-api-token-0123456789"), "TINKER_TELEMETRY": "0"})
    import redis

    from app import db
    from app.tables import Base
    from app.tinker.keys import key_for

    redis.Redis.from_url(args.redis).flushdb()
    Base.metadata.create_all(db.get_engine())
    gunicorn = os.path.join(os.path.dirname(sys.executable), "gunicorn")
    procs = []
    for name, cmd in (("tinker", [gunicorn, "-c", "workers/tinker_conf.py", "app.tinker:create_tinker_app()"]),
                      ("gpu", [sys.executable, "-m", "workers.gpu_worker", "--loglevel", "INFO", "-n",
                               f"bench-gpu-{port}@%h"])):
        log = open(tmp / f"{name}.log", "wb")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        import httpx

        try:
            return httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    _wait(up, 60, f"the Tinker service (log: {tmp / 'tinker.log'})")
    return url, key_for("bench"), procs


def _sdk_arm(args, url: str, key: str, data: list[dict]) -> tuple[list[float], list[float], float]:
    """(forward_backward seconds per round, optim_step seconds per round, last loss:sum)."""
    import logging

    import tinker
    from tinker import types

    logging.getLogger("tinker").setLevel(logging.WARNING)  # one "Retrying ... try_again" line per poll
    tc = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
        base_model=args.model, rank=args.rank, seed=args.seed).result(timeout=120)
    datums = [types.Datum(model_input=types.ModelInput.from_ints(d["model_input"]["chunks"][0]["tokens"]),
                          loss_fn_inputs={k: types.TensorData(**v) for k, v in d["loss_fn_inputs"].items()})
              for d in data]
    fb, opt, loss = [], [], 0.0
    for i in range(args.iters + 1):
        start = time.perf_counter()
        out = tc.forward_backward(datums, "cross_entropy").result(timeout=600)
        mid = time.perf_counter()
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=600)
        end = time.perf_counter()
        loss = out.metrics["loss:sum"]
        if i:  # round 0 loads the model
            fb.append(mid - start)
            opt.append(end - mid)
    return fb, opt, loss


def _direct_arm(args, data: list[dict]) -> tuple[list[float], list[float], float]:
    from app.runconfig import RunConfig
    from app.training import tinker_ops
    from app.training.tenants import TenantPool
    from app.training.threads import apply_cpu_threads
    from app.training.trainer import Trainer

    apply_cpu_threads()
    training = RunConfig.model_validate({"kind": "tinker", "model": {"name": args.model}, "steps": 0, "training": {
        "lora": True, "lora_r": args.rank, "seed": args.seed,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}}).training
    pool = TenantPool(Trainer.from_spec(training, args.model), args.model)
    pool.activate(1, training)
    state = tinker_ops.TinkerState()
    payload = {"data": data, "loss_fn": "cross_entropy", "loss_fn_config": None}
    fb, opt, loss = [], [], 0.0
    for i in range(args.iters + 1):
        start = time.perf_counter()
        loss = tinker_ops.forward_backward(pool, state, payload)["metrics"]["loss:sum"]
        mid = time.perf_counter()
        tinker_ops.optim_step(pool, state, {"adam_params": {"learning_rate": 1e-4}})
        if pool.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        end = time.perf_counter()
        if i:
            fb.append(mid - start)
            opt.append(end - mid)
    return fb, opt, loss


def _trainer_seconds(log: str) -> dict[str, list[float]]:
    """Seconds each op spent in the gpu task's execute (its "on the trainer" log lines), warm-up dropped."""
    import re

    out: dict[str, list[float]] = {}
    for op, seconds in re.findall(r"\((\w+)\): ([0-9.]+) s on the trainer", log):
        out.setdefault(op, []).append(float(seconds))
    return {op: values[1:] for op, values in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tinker-") as tmp_name:
        tmp = Path(tmp_name)
        url, key, procs = _start(args, tmp)
        try:
            from app.engines.modeling import tiny_config

            vocab = tiny_config().vocab_size  # tiny and SmolLM2 share the vocabulary
            data = _batch(args, vocab)
            sdk_fb, sdk_opt, sdk_loss = _sdk_arm(args, url, key, data)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=30)
        trainer_s = _trainer_seconds((tmp / "gpu.log").read_text(errors="replace"))
        direct_fb, direct_opt, direct_loss = _direct_arm(args, data)

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    print(f"model {args.model}, LoRA r {args.rank}, batch {args.batch} x {args.seq} tokens, {args.iters} rounds "
          f"after one warm-up (median s per round)")
    print(f"{'op':<18}{'sdk_s':>10}{'in_task_s':>11}{'direct_s':>10}{'ratio':>8}")
    for name, a, b in (("forward_backward", sdk_fb, direct_fb), ("optim_step", sdk_opt, direct_opt),
                       ("round", [x + y for x, y in zip(sdk_fb, sdk_opt)],
                        [x + y for x, y in zip(direct_fb, direct_opt)])):
        task = trainer_s.get(name)
        in_task = f"{med(task):>11.4f}" if task else f"{'':>11}"
        print(f"{name:<18}{med(a):>10.4f}{in_task}{med(b):>10.4f}{med(a) / med(b):>8.2f}")
    print("in_task_s: the op's time inside the gpu task (state restore, compute, persist); sdk_s less that is "
          "the service's share (HTTP, protobuf, SQL future, Celery message, polling)")
    print(f"loss:sum of the last round: sdk {sdk_loss:.4f}, direct {direct_loss:.4f}")


if __name__ == "__main__":
    main()
