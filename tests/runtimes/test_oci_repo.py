"""The repository folder of an image runtime on the real fixture images (skopeo, umoci, bubblewrap):
SWE-smith's bug patch committed at prepare, R2E-Gym's hidden tests absent from an episode and present
in a grade, and a repository folder the image lacks named at prepare.

The fixture (scripts/build_fixture_image.sh) stands in for a SWE-smith per-repo image (psf/requests at
/testbed, a `testbed` env); `r2e_fixture_layout()` adds R2E-Gym's `/r2e_tests` and
`/testbed/run_tests.sh` to it, standing in for an R2E-Gym per-commit image.
"""
from __future__ import annotations

import pytest

from app.runtimes import RuntimeSetupError
from app.runtimes.images import remove_tree
from app.runtimes.oci import OciRuntime
from app.runtimes.paths import RuntimePaths
from app.tasksets.loader import load_published
from support.format_fixtures import format_fixtures
from support.registry import fixture_layout, r2e_fixture_layout

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(fixture rows with the images filled in, RuntimePaths with a cache shared by this module)."""
    base = tmp_path_factory.mktemp("ocirepo")
    rows = format_fixtures(base / "rows", image=f"oci:{fixture_layout()}:fixture",
                           r2e_image=f"oci:{r2e_fixture_layout()}:fixture")
    yield rows, RuntimePaths(base / "var", base / "cache")
    remove_tree(base)


def test_swesmith_bug_patch_is_the_base_of_episode_and_grade(env):
    rows, paths = env
    rec = load_published(rows / "swesmith.jsonl")[0][0]
    with OciRuntime.prepare(rec, paths=paths) as episode, OciRuntime.prepare(rec, paths=paths, purpose="grade") as grade:
        for rt in (episode, grade):
            res = rt.run("git log --format=%s -2 && git status --porcelain --untracked-files=no && grep -c 'keyval\\[0\\], keyval\\[1\\]' "
                         "requests/structures.py")
            assert res.ok, res.stderr
            assert res.stdout.splitlines() == ["Bug Patch", "requests 2.27.1 (PyPI sdist)", "1"]  # committed, clean
            assert rt.patch() == ""  # the bug is the base, not the agent's change
            assert rt.run("git rev-parse HEAD").stdout.strip() == rt.base_commit
        assert episode.base_commit == grade.base_commit  # one fixed identity: the same bug commit everywhere
        # The image's shared repository is untouched: the bug lives in each runtime's copy.
        assert "(lowerkey, keyval[1])" in (episode.rootfs / "testbed" / "requests" / "structures.py").read_text()
        assert episode.run("git apply -", stdin=rec.patch).ok  # the gold fix (the reverse) applies on top
        assert episode.patch().count("+            (lowerkey, keyval[1])") == 1


def test_a_bug_patch_that_does_not_apply_is_named(env):
    rows, paths = env
    rec = load_published(rows / "swesmith.jsonl")[0][0]
    bad = rec.model_copy(update={"bug_patch": rec.bug_patch.replace("(lowerkey, keyval[1])", "(nothing, like[this])")})
    with pytest.raises(RuntimeSetupError) as info:
        OciRuntime.prepare(bad, paths=paths)
    assert info.value.stage == "bug_patch" and rec.instance_id in str(info.value)
    assert not any(p.name.startswith("episo") for p in paths.runtimes.iterdir())  # nothing left behind


def test_r2egym_hidden_tests_are_absent_in_an_episode_and_present_in_a_grade(env):
    rows, paths = env
    rec = load_published(rows / "r2egym.jsonl")[0][0]
    probe = "for p in /r2e_tests /r2e_tests/test_structures.py /testbed/run_tests.sh; do test -e $p && echo $p; done; ls /"
    with OciRuntime.prepare(rec, paths=paths) as episode:
        seen = episode.run(probe)
        assert seen.ok and "r2e_tests" not in seen.stdout and "run_tests.sh" not in seen.stdout, seen.stdout
        assert "testbed" in seen.stdout.split()  # the rest of / is there
        assert episode.patch() == ""  # hiding the runner is not a change of the agent's
    with OciRuntime.prepare(rec, paths=paths, purpose="grade") as grade:
        seen = grade.run(probe)
        assert seen.stdout.split()[:3] == ["/r2e_tests", "/r2e_tests/test_structures.py", "/testbed/run_tests.sh"]


def test_a_repository_folder_the_image_lacks_is_named_at_prepare(env):
    rows, paths = env
    rec = load_published(rows / "swebench_verified.jsonl")[0][0]
    with pytest.raises(RuntimeSetupError) as info:
        OciRuntime.prepare(rec.model_copy(update={"repo_dir": "/workspace/requests"}), paths=paths)
    assert info.value.stage == "repository"
    assert "/workspace/requests" in str(info.value) and rec.image in str(info.value)
