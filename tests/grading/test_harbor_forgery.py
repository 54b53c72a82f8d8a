"""A Harbor reward is the verifier's alone: the agent's patched library, run by `tests/test.sh`,
cannot pay itself while the verifier runs.

On the CI fixture image (real skopeo, umoci, bubblewrap; psf/requests 2.27 at /testbed) with the
fixture Harbor task, whose test.sh imports `requests.structures`: the agent's patch appends code
to that module which attacks the verifier from inside it.  Before, writing reward.txt = 1 and
then killing the shell (exit 137), or making the file read-only so the shell's own write failed,
graded 1.0; so did a write after the shell's, and a line appended to the test.sh bash was reading.
Now each is a verifier error (masked, never a reward) or the shell's own 0.
"""
from __future__ import annotations

import shutil
import textwrap

import pytest

from app.config import get_settings
from app.grading.grader import grade
from app.grading.harbor import VERIFIER_SHELL, verifier_shell
from app.grading.verifier import VerifierError
from app.runtimes.oci import OciRuntime
from app.runtimes.sandbox import Mount
from app.tasksets.loader import load_published
from support.format_fixtures import format_fixtures
from support.registry import fixture_layout

pytestmark = pytest.mark.slow

GUARD = "import os as _o, time as _t\nif _o.path.isdir('/logs/verifier'):\n"
REWARD = "/logs/verifier/reward.txt"
ATTACKS = {
    # Write the reward, then kill the shell before it writes its own.
    "kill": f"    open('{REWARD}', 'w').write('1\\n')\n    _o.kill(_o.getppid(), 9)\n",
    # Write the reward and make it read-only: the shell's `echo 0 >` fails.
    "read-only": f"    open('{REWARD}', 'w').write('1\\n')\n    _o.chmod('{REWARD}', 0o444)\n",
    # A daemon that waits for the shell's 0 and writes 1 over it.
    "after": ("    if _o.fork() == 0:\n        _o.setsid()\n        for _ in range(3000):\n"
              f"            if open('{REWARD}').read().strip() == '0':\n"
              f"                open('{REWARD}', 'w').write('1\\n')\n                break\n"
              "            _t.sleep(0.001)\n        _o._exit(0)\n"),
    # The same through a descriptor opened before the shell's write.
    "kept-descriptor": (f"    _fd = _o.open('{REWARD}', _o.O_RDWR)\n    if _o.fork() == 0:\n        _o.setsid()\n"
                        "        for _ in range(3000):\n            if _o.pread(_fd, 8, 0).strip() == b'0':\n"
                        "                _o.ftruncate(_fd, 0)\n                _o.pwrite(_fd, b'1\\n', 0)\n"
                        "                break\n            _t.sleep(0.001)\n        _o._exit(0)\n"),
    # Append a line to the script the shell is reading: it runs after the shell's own write.
    "rewrite-test-sh": (f"    try:\n        open('/tests/test.sh', 'a').write('\\necho 1 > {REWARD}\\n')\n"
                        "    except OSError:\n        pass\n"),
}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(the fixture Harbor record, its task folder, a folder for variants)."""
    base = tmp_path_factory.mktemp("forgery")
    rows = format_fixtures(base / "rows", image=f"oci:{fixture_layout()}:fixture")
    return load_published(rows / "harbor")[0][0], rows / "harbor", base


def attack_patch(rec, attack: str) -> str:
    with OciRuntime.prepare(rec, purpose="episode") as rt:
        code = GUARD + ATTACKS[attack]
        with open(rt.workspace / "requests" / "structures.py", "a") as fh:
            fh.write("\n\n" + code)
        return rt.patch()


def variant(task, name: str, tail: str):
    """The fixture task with `tail` appended to its test.sh (a verifier that does more after its
    write: `exit 0`, a cleanup that sleeps)."""
    rec, folder, base = task
    dest = base / f"task-{name}"
    if not dest.exists():
        shutil.copytree(folder, dest)
        sh = next(dest.glob("*/tests/test.sh"))
        sh.write_text(sh.read_text() + tail)
    return load_published(dest)[0][0]


@pytest.mark.parametrize("attack, tail", [
    ("kill", ""), ("read-only", ""), ("read-only", "exit 0\n"),
    ("after", "sleep 2\n"), ("kept-descriptor", "sleep 2\n"),
])
def test_a_reward_the_tested_code_wrote_is_a_verifier_error(task, attack, tail):
    rec = variant(task, f"{attack}-{len(tail)}", tail) if tail else task[0]
    patch = attack_patch(rec, attack)
    assert "_o.getppid" in patch or "reward.txt" in patch
    with pytest.raises(VerifierError) as info:
        grade(rec, patch, use_cache=False, timeout_s=300)
    assert info.value.stage == "verifier_error" and rec.instance_id in str(info.value)
    expected = {"kill": "was killed by SIGKILL", "read-only": "mode was changed" if tail else "exited 1",
                "after": "written more than once", "kept-descriptor": "not written once"}[attack]
    assert expected in str(info.value)


def test_a_line_appended_to_test_sh_never_runs(task):
    rec = task[0]
    result = grade(rec, attack_patch(rec, "rewrite-test-sh"), use_cache=False, timeout_s=300)
    assert (result.resolved, result.reward) == (False, 0.0), result.log_path


def test_the_shell_cannot_be_traced_by_what_it_runs(task):
    """The execute-only copy of the image's bash is non-dumpable: a child cannot open its
    /proc/PID/mem (where it could rewrite the shell) or read its environment."""
    rec = task[0]
    with OciRuntime.prepare(rec, purpose="grade") as rt:
        shell = verifier_shell(rt.rootfs, rt.root / "shell")
        probe = textwrap.dedent("""\
            import os
            for name in ("mem", "environ"):
                try:
                    open(f"/proc/{os.getppid()}/{name}", "rb").close()
                    print(name, "open")
                except OSError as exc:
                    print(name, type(exc).__name__)
            """)
        res = rt.run([VERIFIER_SHELL, "-c", f"python3 -c '{probe}'; true"], extra_mounts=[Mount(shell, VERIFIER_SHELL)])
        plain = rt.run(["bash", "-c", f"python3 -c '{probe}'; true"])
    assert res.ok, res.stderr
    assert res.stdout.split() == ["mem", "PermissionError", "environ", "PermissionError"]
    # The image's own bash, as the old grade ran it: its memory opened on a quiet box; under a loaded
    # parallel run the control was seen to fail with a bare OSError instead, so only its running is asserted.
    print("control (image's bash):", plain.stdout.split())
    assert plain.stdout.split()[:1] == ["mem"]


def test_the_gold_patch_still_resolves_and_empty_still_fails(task):
    from app.grading.harbor import oracle_patch

    rec = task[0]
    gold = oracle_patch(rec, settings=get_settings())
    assert grade(rec, gold, use_cache=False, timeout_s=300).reward == 1.0
    assert grade(rec, "", use_cache=False, timeout_s=300).reward == 0.0
