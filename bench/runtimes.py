"""Runtimes side by side: local (working copy + venv) and oci (the task's image, rootless), and
docker / podman where one can start a container.

For each kind: cold prepare (local: the first prepare with today's caches; oci: pull from a
real `docker-registry` on loopback + unpack into an empty cache), warm prepare (median of
`--repeat`), episode start (the first command in a fresh runtime: `true` in the sandbox), and
disk per episode (bytes of the runtime's own folder: the shared image and env caches are not
counted).  Then a group of 8 concurrent prepares on an image new to the node: wall time and how
many times umoci unpacked it.  Goal: warm oci prepare <= 0.1 s on the fixture image; the group
unpacks once.

    .venv/bin/python bench/runtimes.py [--repeat 10]

Needs skopeo, umoci, docker-registry, bubblewrap; builds the test fixture image on first use
(scripts/build_fixture_image.sh, a few minutes, cached under var/cache/images/).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _record(image: str = "") -> dict:
    return {"instance_id": "psf__requests-fixture", "repo": "psf/requests", "version": "2.27", "patch": "x",
            "problem_statement": "p", "FAIL_TO_PASS": ["tests/test_utils.py::test_x"], "PASS_TO_PASS": [],
            "base_commit": "abcdef1", "test_cmd": "pytest", "image": image}


def _measure(prepare, repeat: int) -> dict:
    from app.runtimes.sandbox import disk_usage_bytes

    t = time.monotonic()
    rt = prepare()
    cold = time.monotonic() - t
    t = time.monotonic()
    res = rt.run("true")
    start = time.monotonic() - t
    assert res.ok, res.stderr
    disk = disk_usage_bytes([rt.root])
    rt.close()
    warm = []
    for _ in range(repeat):
        t = time.monotonic()
        rt = prepare()
        warm.append(time.monotonic() - t)
        rt.close()
    return {"cold_s": cold, "warm_s": statistics.median(warm), "start_s": start, "disk_mb": disk / 2 ** 20}


def _engine_probe(engine: str, layout: Path) -> str:
    """One line: why `engine` is not measured here, or the time of one container start of the fixture."""
    import subprocess

    from app.runtimes import docker_available

    if not docker_available(engine):
        return f"not measured: `{engine} info` does not answer here"
    t = time.monotonic()
    proc = subprocess.run([engine, "run", "--rm", "--network", "none", f"oci:{layout}:fixture", "true"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return f"not measured: `{engine} run` fails here: {proc.stderr.strip().splitlines()[-1][:160]}"
    return f"one container start of the fixture image: {time.monotonic() - t:.2f} s (pull included)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()

    from app.config import get_settings
    from app.runtimes import LocalRuntime, OciRuntime
    from app.runtimes.images import ImageCache
    from app.runtimes.paths import RuntimePaths
    from app.tasksets import load_task_set
    from support.registry import Registry, fixture_layout

    settings = get_settings()
    rows: dict[str, dict] = {}
    local_record = load_task_set("synthetic").get("synthetic__inflection-1")
    rows["local"] = _measure(lambda: LocalRuntime.prepare(local_record), args.repeat)

    layout = fixture_layout()
    tmp = Path(tempfile.mkdtemp(prefix="bench-runtimes-"))
    try:
        with Registry(tmp / "registry") as reg:
            ref = reg.push(f"oci:{layout}:fixture", "swe/requests:2.27")
            paths = RuntimePaths(tmp / "var", tmp / "cache")
            rows["oci"] = _measure(lambda: OciRuntime.prepare(_record(ref), paths=paths), args.repeat)

            # A group of 8 on an image new to this node (empty cache), counting real umoci unpacks.
            shims = tmp / "shims"
            shims.mkdir()
            (shims / "umoci").write_text(f"#!/bin/sh\necho \"$1\" >> {tmp}/umoci.calls\nexec {shutil.which('umoci')} \"$@\"\n")
            (shims / "umoci").chmod(0o755)
            os.environ["PATH"] = f"{shims}:{os.environ['PATH']}"
            group_paths = RuntimePaths(tmp / "var", tmp / "group-cache")
            cache = ImageCache(settings, group_paths)
            runtimes, errors = [], []

            def one():
                try:
                    runtimes.append(OciRuntime.prepare(_record(ref), paths=group_paths, cache=cache))
                except Exception as exc:  # noqa: BLE001 - printed below
                    errors.append(exc)

            t = time.monotonic()
            threads = [threading.Thread(target=one) for _ in range(8)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            group_s = time.monotonic() - t
            for rt in runtimes:
                rt.close()
            calls = (tmp / "umoci.calls").read_text().split() if (tmp / "umoci.calls").exists() else []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{'runtime':<8} {'cold prepare':>13} {'warm prepare':>13} {'episode start':>14} {'disk/episode':>13}")
    for kind, r in rows.items():
        print(f"{kind:<8} {r['cold_s']:>12.2f}s {r['warm_s']:>12.3f}s {r['start_s']:>13.3f}s {r['disk_mb']:>10.1f} MiB")
    for engine in ("docker", "podman"):
        print(f"{engine:<8} {_engine_probe(engine, layout)}")
    warm_ok = rows["oci"]["warm_s"] <= 0.1
    print(f"\noci warm prepare {rows['oci']['warm_s'] * 1000:.0f} ms (goal <= 100 ms): {'met' if warm_ok else 'MISSED'}")
    print(f"group of 8 on a new image: {group_s:.1f} s wall, umoci unpacks: {calls.count('unpack')} (goal 1), "
          f"errors: {len(errors)}" + (f" ({errors[0]})" if errors else ""))
    return 0 if warm_ok and calls.count("unpack") == 1 and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
