"""SWE-smith rows: the bug patch is applied at prepare, its reverse is the gold fix."""

from app.tasksets.formats.patchtext import reverse_patch
from app.tasksets.loader import load_published
from support.format_fixtures import format_fixtures


def test_row_becomes_bug_patch_plus_reversed_gold(tmp_path):
    rec = load_published(format_fixtures(tmp_path / "f") / "swesmith.jsonl")[0][0]
    assert rec.bug_patch.startswith("diff --git a/requests/structures.py")
    assert rec.patch == reverse_patch(rec.bug_patch)
    assert "-            (keyval[0], keyval[1])\n" in rec.patch and "+            (lowerkey, keyval[1])\n" in rec.patch
    assert rec.image == "oci:/nonexistent-layout:fixture" and rec.log_parser == "parse_log_pytest_v2"
    assert "pytest --disable-warnings --color=no --tb=no --verbose tests/test_structures.py" in rec.eval_script
    assert "git checkout HEAD -- tests/test_structures.py" in rec.eval_script
