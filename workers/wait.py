"""`python -m workers.wait NAME=URL …`: wait until every health URL answers 200 (used by scripts/with_stack.sh)."""
from __future__ import annotations

import argparse
import sys
import time

import httpx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("targets", nargs="+", metavar="NAME=URL")
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args(argv)
    pending = dict(t.split("=", 1) for t in args.targets)
    deadline = time.monotonic() + args.timeout
    while pending and time.monotonic() < deadline:
        for name, url in list(pending.items()):
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    print(f"{name}: up ({url})")
                    del pending[name]
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    if pending:
        print(f"not up after {args.timeout:.0f} s: {', '.join(pending)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
