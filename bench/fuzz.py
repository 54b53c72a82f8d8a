"""Fuzz the REST API and the gateway with 2,000 hostile bodies each; print status counts and every 5xx.

    .venv/bin/python bench/fuzz.py [--n 2000] [--database postgresql+psycopg://postgres@127.0.0.1:5432/postgres]

The bodies are `tests/support/fuzz_corpus.py`'s (nesting 5,000 deep, NUL, NaN/Infinity, ids past 2**31,
`?status=%00`, 1 MiB strings, wrong types, raw bytes), sent through the in-process apps (Flask test
clients) on a fresh PostgreSQL database, the gateway in front of the scripted engine.  Exit status 1
when any answer is a 5xx or an error outside the caller's API shape.  `tests/e2e/test_fuzz.py`
runs a 400-body sample of the same corpus.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2000, help="bodies per server (the gateway's split over 4 APIs)")
    parser.add_argument("--database", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
                        help="admin URL of a PostgreSQL server (a scratch database is created and dropped)")
    args = parser.parse_args()
    from sqlalchemy import create_engine, text

    from support import free_port

    name = f"turnstile_fuzz_{uuid.uuid4().hex[:8]}"
    admin = create_engine(args.database, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    port = free_port()
    engine_proc = subprocess.Popen([sys.executable, "-m", "app.conformance.scripted", "--port", str(port)], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(DATABASE_URL=args.database.rsplit("/", 1)[0] + f"/{name}",
                      TURNSTILE_ENGINE_URLS=f"http://127.0.0.1:{port}", TURNSTILE_GATEWAY_KEEPALIVE_S="0.3",
                      TURNSTILE_API_TOKEN=os.environ.get("TURNSTILE_API_TOKEN", "fuzz-bench-token-0123456789"),
                      REDIS_URL=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14"))
    failures = 0
    try:
        failures = _run(args.n, port)
    finally:
        engine_proc.terminate()
        engine_proc.wait(timeout=10)
        from app import db

        db.dispose_engine()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    return 1 if failures else 0


def _run(n: int, engine_port: int) -> int:
    import httpx

    from app import create_app, db
    from app.auth import auth_header
    from app.tables import Base
    from app.proxy import create_gateway_app
    from support.fuzz_corpus import rest_cases, rest_shape, run_cases
    from support.fuzz_run import GATEWAY_APIS, fuzz_gateway_api

    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    Base.metadata.create_all(db.get_engine())
    failures = 0
    t0 = time.monotonic()
    report = run_cases(create_app().test_client(), rest_cases(n), rest_shape, auth_header())
    print(f"REST API: {n} bodies in {time.monotonic() - t0:.1f} s; statuses {dict(sorted(report['statuses'].items()))}; "
          f"5xx or off-shape: {len(report['bad'])}")
    failures += len(report["bad"])
    for case in report["bad"][:10]:
        print("  ", case)
    gateway = create_gateway_app().test_client()
    for api in GATEWAY_APIS:
        t0 = time.monotonic()
        report = fuzz_gateway_api(gateway, api, n // 4).report
        print(f"gateway {api}: {n // 4} bodies in {time.monotonic() - t0:.1f} s; "
              f"statuses {dict(sorted(report['statuses'].items()))}; 5xx or off-shape: {len(report['bad'])}")
        failures += len(report["bad"])
        for case in report["bad"][:10]:
            print("  ", case)
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
