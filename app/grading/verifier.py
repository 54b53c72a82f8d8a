"""The pure parts of grading inside an image: what the image must have, reading rewards, matching statuses.

`VerifierError` is how a grade says "this could not be judged" (the image lacks a tool the
grader needs, the verifier wrote no reward): it is a `RuntimeSetupError`, so the episode's
grade stage fails the episode (`app.control.episodes.grade` → `fail`) and its reward stays
unset, which `app.training.grpo.group_advantages` masks out of the group (None, not 0).  A
missing tool is the image's fault, not the policy's; scoring it 0 would train on it (NeMo Gym's
Harbor loader masks such samples as `verifier_error` for the same reason).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from app.runtimes.errors import RuntimeSetupError

# The tools each grader runs inside the image (besides what the task's own scripts need).  A
# tuple is a choice: the apply chain (`patching.apply_script`) tries `git apply`, then
# `patch --batch --forward --fuzz=5`, which only GNU patch takes (busybox's rejects --batch), so
# an image with neither git nor GNU patch fails every patch: a verifier error, not a score of 0.
# Harbor's test.sh is run by the image's bash directly (`app.grading.harbor`), no `timeout`.
APPLIERS = ("git", "gnu-patch")
TOOL_PATH = (  # the folders a tool is looked for in, as a default PATH has them
    "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
REQUIRED_TOOLS: dict[str, tuple[str | tuple[str, ...], ...]] = {
    "swebench": ("bash", "git"),
    "rebench": ("bash", "git"),
    "r2egym": ("bash", "git"),
    "harbor": ("bash", APPLIERS),
}
class VerifierError(RuntimeSetupError):
    """The grade could not be judged (`verifier_error`): never a reward of 0; the episode is masked."""

    def __init__(self, message: str):
        super().__init__("verifier_error", message)


def missing_tools(resolve: Callable[[str], Path | None], tools: Sequence[str | tuple[str, ...]],
                  path: Sequence[str] = TOOL_PATH) -> list[str]:
    """The requirements in `tools` that no file in the `path` folders of an image meets, as words
    ("git", "git or GNU patch").  A tuple is met by any one of its tools; "gnu-patch" is a `patch`
    whose binary is GNU patch's (`is_gnu_patch`), not busybox's or another that rejects `--batch`.

    `resolve(inside_path)` gives the host path of an image path (links resolved inside the
    rootfs, e.g. `rootfs.resolve_inside` bound to one rootfs) or None.
    """
    def found(tool: str) -> bool:
        name = "patch" if tool == "gnu-patch" else tool
        hits = [h for d in path if (h := resolve(f"{d}/{name}")) is not None and h.is_file()]
        return any(is_gnu_patch(h) for h in hits) if tool == "gnu-patch" else bool(hits)

    out = []
    for need in tools:
        choice = (need,) if isinstance(need, str) else need
        if not any(found(t) for t in choice):
            out.append(" or ".join("GNU patch" if t == "gnu-patch" else t for t in choice))
    return out


def is_gnu_patch(binary: Path) -> bool:
    """True when the executable `binary` (a host path inside a rootfs) is GNU patch: its
    `--version` banner "GNU patch" is in the file (busybox's applet has no such string)."""
    try:
        return b"GNU patch" in binary.read_bytes()
    except OSError:
        return False


def read_reward(verifier_dir: Path, name: str | None = None) -> tuple[float, dict[str, Any]]:
    """(reward, details) from a Harbor verifier's `reward.txt` (a number) or `reward.json`; with
    `name`, from that one only (the file the verifier was seen writing).

    `reward.json` is `{"reward": x}` or several named rewards (harbor-rewardkit): the one named
    `reward` is used, or the only one.  Raises `VerifierError` when neither file exists, when
    it is not a plain file, or when it holds no finite number (a verifier that crashed).
    Source: https://harborframework.com/docs/tasks (reward contract).
    """
    txt, js = verifier_dir / "reward.txt", verifier_dir / "reward.json"
    for f in (txt, js):
        if f.is_symlink() or (f.exists() and not f.is_file()):
            raise VerifierError(f"{f.name} in the verifier's output is not a plain file")
    if name not in (None, "reward.txt", "reward.json"):
        raise ValueError(f"no reward file is named {name!r}")
    if txt.is_file() and name in (None, "reward.txt"):
        text = txt.read_text(encoding="utf-8", errors="replace").strip()
        try:
            value = float(text)
        except ValueError:
            raise VerifierError(f"reward.txt holds {text[:80]!r}, not a number") from None
        details: dict[str, Any] = {"file": "reward.txt"}
    elif js.is_file() and name in (None, "reward.json"):
        try:
            data = json.loads(js.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise VerifierError(f"reward.json is not JSON: {exc}") from None
        if isinstance(data, (int, float)):
            data = {"reward": data}
        if not isinstance(data, dict) or not data:
            raise VerifierError("reward.json must be an object of named rewards")
        if "reward" in data:
            value = data["reward"]
        elif len(data) == 1:
            value = next(iter(data.values()))
        else:
            raise VerifierError(f"reward.json has {len(data)} named rewards and none named 'reward'")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise VerifierError(f"reward.json's reward is {value!r}, not a number")
        details = {"file": "reward.json", "rewards": data}
    else:
        raise VerifierError("the verifier wrote no /logs/verifier/reward.txt or reward.json")
    value = float(value)
    if not math.isfinite(value):
        raise VerifierError(f"reward {value} is not finite")
    return value, details


def r2e_test_id(test_id: str) -> str:
    """A test id in R2E-Gym's form: its parser keys `path::Class::test` as `Class.test`
    (`".".join(line.split("::")[1:])`) and cuts a failure message at " - "."""
    test_id = test_id.split(" - ")[0]
    return ".".join(test_id.split("::")[1:]) if "::" in test_id else test_id


def r2e_match(parsed: dict[str, str], expected: dict[str, str]) -> tuple[bool, dict[str, Any]]:
    """R2E-Gym's rule (`_calculate_reward_r2e`): ids in R2E-Gym's form on both sides
    (`r2e_test_id`: swebench's parser keeps the file part, R2E-Gym's drops it), the same ids,
    equal statuses.  Returns (matched, {"missing", "unexpected", "different"}) for the report."""
    got = {r2e_test_id(k): v for k, v in parsed.items() if k}
    want = {r2e_test_id(k): v for k, v in expected.items()}
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    different = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    return not (missing or unexpected or different), {"missing": missing, "unexpected": unexpected,
                                                      "different": different}


def rebench_match(status: dict[str, str], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]) -> bool:
    """SWE-rebench V2's rule (`scripts/eval.py`, `passed_match`): the PASSED tests are exactly
    FAIL_TO_PASS ∪ PASS_TO_PASS (as sorted lists, so an id listed twice must pass twice)."""
    passed = sorted(k for k, v in status.items() if v == "PASSED")
    return passed == sorted([*pass_to_pass, *fail_to_pass])
