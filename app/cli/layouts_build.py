"""Build the `layouts` records (SWE-bench format) from `app.tasksets.layouts.SPECS`; write data/tasks/layouts.jsonl.

    python -m app.cli.layouts_build            # needs PyPI; builds each instance's runtime
    python -m app.cli.layouts_build --check    # exit 1 when the bundled file differs from what it would write

It lives above the runtimes (the task-set layer may not import them) because the outcomes are
read in the instance's own runtime.

Per spec: the sdist is fetched by hash (`app.runtimes.sdist`, cached), the bug is a one-place
text change of the spec's library file (`bug_patch`, its reverse the gold `patch`), and
FAIL_TO_PASS / PASS_TO_PASS are read from the spec's test files run in the real runtime (the
instance's venv, confined when bubblewrap exists) on the clean and the buggy tree: failing with
the bug and passing without it, and passing both ways (an even sample of at most 50).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from app.config import get_settings
from app.runtimes import LocalRuntime
from app.runtimes.paths import RuntimePaths
from app.runtimes.sdist import fetch_sdist, unpack_sdist
from app.tasksets.layouts import SPECS, Spec
from app.tasksets.schema import InstanceRecord, PypiSdistSource
from app.tasksets.starter.generate import _diff, test_scripts

OUT = Path(__file__).resolve().parents[2] / "data" / "tasks" / "layouts.jsonl"
P2P_MAX = 50


def _replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise ValueError(f"{where}: the text to change occurs {text.count(old)} times, not once")
    return text.replace(old, new)


def outcomes(record: InstanceRecord) -> dict[str, str]:
    """{test id: PASSED|FAILED|ERROR|SKIPPED} of `record.test_cmd` in a fresh runtime of `record`."""
    with LocalRuntime.prepare(record, purpose="grade") as rt:
        res = rt.run(record.test_cmd, timeout_s=900)
    out = {}
    for line in res.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR", "SKIPPED") and "::" in rest:
            out[rest.split(" - ")[0].strip()] = word
    if not out:
        raise RuntimeError(f"{record.instance_id}: pytest reported no test outcome:\n{res.stdout[-3000:]}")
    return out


def build_record(spec: Spec) -> dict:
    source = PypiSdistSource(kind="pypi_sdist", name=spec.name, version=spec.version, sha256=spec.sha256)
    archive = fetch_sdist(source, RuntimePaths.from_settings(get_settings()))
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        unpack_sdist(archive, tree)
        clean = (tree / spec.target).read_text()
        helper_text = (tree / spec.helper[0]).read_text() if spec.helper else None
    buggy = _replace_once(clean, spec.old, spec.new, spec.target)
    test_cmd, eval_script = test_scripts(" ".join(spec.test_files))
    record = {
        "instance_id": spec.instance_id, "repo": f"pypi/{spec.name}", "base_commit": "",
        "patch": _diff({spec.target: buggy}, {spec.target: clean}), "test_patch": "",
        "problem_statement": spec.problem + "\n", "hints_text": "", "created_at": "2026-12-07T00:00:00+00:00",
        "version": spec.version, "FAIL_TO_PASS": "[]", "PASS_TO_PASS": "[]", "environment_setup_commit": "",
        "image": "", "eval_script": eval_script, "log_parser": "parse_log_pytest_v2", "eval_type": "pass_and_fail",
        "source": {"kind": "pypi_sdist", "name": spec.name, "version": spec.version, "sha256": spec.sha256,
                   "filename": archive.name},
        "bug_patch": _diff({spec.target: clean}, {spec.target: buggy}), "install": list(spec.install),
        "test_cmd": test_cmd, "test_files": list(spec.test_files), "python": "3.11",
        "layout_file": spec.target,
        "provenance": (f"{spec.name} {spec.version} sdist; a bug planted in library code at a test-looking path "
                       f"({spec.target}), caught by the package's own tests; written by python -m app.cli.layouts_build"),
    }
    if spec.helper:
        path, old, new = spec.helper
        record["helper_edit"] = _diff({path: helper_text}, {path: _replace_once(helper_text, old, new, path)})
    # (The records the outcomes are read with need some FAIL_TO_PASS id; the tests' own run picks the real ones.)
    probe = record | {"FAIL_TO_PASS": json.dumps([f"{spec.test_files[0]}::outcomes_not_read_yet"])}
    with_bug = outcomes(InstanceRecord.model_validate(probe))
    without = outcomes(InstanceRecord.model_validate(probe | {"bug_patch": "", "instance_id": spec.instance_id + "-clean"}))
    f2p = sorted(t for t, s in with_bug.items() if s in ("FAILED", "ERROR") and without.get(t) == "PASSED")
    p2p = sorted(t for t, s in with_bug.items() if s == "PASSED" and without.get(t) == "PASSED")
    if not f2p:
        raise RuntimeError(f"{spec.instance_id}: the package's tests do not catch the bug")
    step = max(1, len(p2p) // P2P_MAX)
    record["FAIL_TO_PASS"], record["PASS_TO_PASS"] = json.dumps(f2p), json.dumps(p2p[::step][:P2P_MAX])
    with LocalRuntime.prepare(InstanceRecord.model_validate(record)) as rt:
        record["base_commit"] = record["environment_setup_commit"] = record["sdist_base_commit"] = rt.base_commit
    return record


def render(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.cli.layouts_build", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="exit 1 when --out differs from what would be written")
    parser.add_argument("--only", default="", help="comma-separated package names to build (others are kept)")
    args = parser.parse_args(argv)
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    kept = {}
    if only and args.out.exists():
        kept = {json.loads(line)["instance_id"]: json.loads(line) for line in args.out.read_text().splitlines() if line}
    records, failed = [], []
    for spec in SPECS:
        if only and spec.name not in only and spec.instance_id in kept:
            records.append(kept[spec.instance_id])
            continue
        try:
            records.append(build_record(spec))
        except (RuntimeError, ValueError) as exc:  # every spec is tried; the file is written only when all build
            failed.append(f"{spec.instance_id}: {exc}")
            print(f"FAILED {failed[-1]}", flush=True)
            continue
        print(f"{spec.instance_id}: {len(json.loads(records[-1]['FAIL_TO_PASS']))} FAIL_TO_PASS, "
              f"{len(json.loads(records[-1]['PASS_TO_PASS']))} PASS_TO_PASS", flush=True)
    if failed:
        print(f"{len(failed)} spec(s) failed; nothing written")
        return 1
    text = render(records)
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'current' if same else 'differs from what would be written'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
