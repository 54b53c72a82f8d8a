"""The non-stream gateway of two checkouts side by side in one run: before and after a change.

`bench/gateway.py` measures one checkout; between two of its runs minutes apart the box's speed
can move by 2x, more than most changes.  Here both checkouts' gateways (gunicorn, one worker
each, recording every call into one SQLite file) and the floor app (`bench/gateway_floor.py`:
the same stack answering a constant) run at once beside one scripted engine, and every round
calls the engine directly, then each gateway, then the floor, so a change in the box's load
falls on all of them alike.  Per checkout: p50 wall time added to the direct call, the part
beyond the floor's, and CPU per call of its gunicorn processes (their threads' run time from /proc, `gateway.cpu_seconds`)
beside the floor's.

Usage: `.venv/bin/python bench/gateway_ab.py OLD_CHECKOUT NEW_CHECKOUT [--n 600]
[--worker-class gevent]`, e.g. with `git worktree add /tmp/before <commit>`.  Each gateway
runs this venv's gunicorn with its checkout as the working directory (gunicorn puts it first on
`sys.path`, so each imports its own `app`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from app.conformance.scripted import directive  # noqa: E402
from app.engines.client import EngineClient  # noqa: E402
from gateway import cpu_seconds, direct_body, free_port, gunicorn_pids, make_sessions, stop, wait  # noqa: E402

REPLY = "The quick brown fox jumps over it."
WARMUP = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkouts", nargs=2, help="two project checkouts: before, after")
    ap.add_argument("--n", type=int, default=600, help="calls per side (after a 30-call warm-up)")
    ap.add_argument("--worker-class", default="gevent", choices=["gevent", "gthread"])
    args = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in args.checkouts]
    tmp = tempfile.mkdtemp(prefix="gwab-")
    os.environ["DATABASE_URL"] = f"sqlite:///{tmp}/bench.db"
    token = make_sessions(1)[0]
    eport = free_port()
    env = dict(os.environ, TURNSTILE_ENGINE_URLS=f"http://127.0.0.1:{eport}", TURNSTILE_LOG_LEVEL="warning",
               TURNSTILE_GATEWAY_WORKERS="1", TURNSTILE_GATEWAY_THREADS="16",
               TURNSTILE_GATEWAY_WORKER_CLASS=args.worker_class)
    procs = [subprocess.Popen([sys.executable, "-m", "app.conformance.scripted", "--port", str(eport)], cwd=ROOT,
                              stdout=subprocess.DEVNULL)]
    sides: dict[str, tuple[str, subprocess.Popen]] = {}
    try:
        for name, cwd, app in [*((t, t, "app.proxy:create_gateway_app()") for t in trees),
                               ("floor", str(ROOT), "bench.gateway_floor:create_app()")]:
            port = free_port()
            proc = subprocess.Popen([str(ROOT / ".venv/bin/gunicorn"), "-c", "workers/gateway_conf.py", app], cwd=cwd,
                                    env=dict(env, TURNSTILE_GATEWAY_BIND=f"127.0.0.1:{port}"),
                                    stderr=open(f"{tmp}/{len(sides)}.log", "wb"))
            procs.append(proc)
            sides[name] = (f"http://127.0.0.1:{port}", proc)
        wait(f"http://127.0.0.1:{eport}")
        for url, _ in sides.values():
            wait(url)
        direct = EngineClient(f"http://127.0.0.1:{eport}")
        model = direct.models()[0]["id"]
        clients = {name: EngineClient(url) for name, (url, _) in sides.items()}
        pids = {name: gunicorn_pids(proc.pid) for name, (_, proc) in sides.items()}
        wall: dict[str, list[float]] = {name: [] for name in ["direct", *sides]}
        cpu = dict.fromkeys(sides, 0.0)
        headers = {"authorization": f"Bearer {token}"}
        for i in range(args.n + WARMUP):
            text = f"ab {i} " + directive({"text": REPLY})
            t0 = time.perf_counter()
            direct.complete(direct_body(text, False, model))
            if i >= WARMUP:
                wall["direct"].append(time.perf_counter() - t0)
            body = {"model": "gpt-bench", "messages": [{"role": "user", "content": text}], "max_tokens": 64}
            for name, client in clients.items():
                c0, t0 = cpu_seconds(pids[name]), time.perf_counter()
                client.complete(body, headers=headers)
                if i >= WARMUP:
                    wall[name].append(time.perf_counter() - t0)
                    cpu[name] += cpu_seconds(pids[name]) - c0
        p50 = {name: statistics.median(v) * 1e3 for name, v in wall.items()}
        print(f"gateway_ab: {args.n} non-stream calls per side, gunicorn {args.worker_class}, one worker each, "
              f"cores={os.cpu_count()}; p50 ms: direct {p50['direct']:.2f}, floor {p50['floor']:.2f}")
        print(f"{'checkout':<40}{'added p50 ms':>14}{'beyond floor':>14}{'CPU ms/call':>13}{'floor CPU':>11}")
        for tree in trees:
            added = p50[tree] - p50["direct"]
            print(f"{tree[-40:]:<40}{added:>14.2f}{added - p50['floor']:>14.2f}{cpu[tree] * 1e3 / args.n:>13.2f}"
                  f"{cpu['floor'] * 1e3 / args.n:>11.2f}")
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
