"""Diff text a published row does not carry as such: the reverse of a bug patch, R2E-Gym's parsed commit."""
from __future__ import annotations

import unidiff


def reverse_patch(patch: str) -> str:
    """The unified diff that undoes `patch` (old and new sides swapped; `-`/`+` lines swapped).

    SWE-smith's `patch` *creates* the bug, so its reverse is the gold fix.  Raises
    `unidiff.UnidiffParseError` for text that is not a unified diff.
    """
    out: list[str] = []
    for pf in unidiff.PatchSet(patch):
        path = pf.path
        # An added file's reverse deletes it, and a removed file's reverse adds it back.
        src = f"a/{path}" if not pf.is_removed_file else "/dev/null"
        dst = f"b/{path}" if not pf.is_added_file else "/dev/null"
        out.append(f"diff --git a/{path} b/{path}\n")
        if pf.is_added_file:
            out.append("deleted file mode 100644\n")
        elif pf.is_removed_file:
            out.append("new file mode 100644\n")
        out.append(f"--- {src}\n+++ {dst}\n")
        for h in pf:
            out.append(f"@@ -{h.target_start},{h.target_length} +{h.source_start},{h.source_length} @@"
                       f"{(' ' + h.section_header) if h.section_header else ''}\n")
            for line in h:
                tag = {"+": "-", "-": "+"}.get(line.line_type, line.line_type)
                text = line.value if line.value.endswith("\n") else line.value + "\n"
                out.append(tag + text)
                if not line.value.endswith("\n") and line.line_type != "\\":
                    out.append("\\ No newline at end of file\n")
    return "".join(out)


def r2e_commit_patch(parsed: dict, *, test_files: bool) -> str:
    """Diff text of R2E-Gym's `parsed_commit_content` (`ParsedCommit.file_diffs`), test files or the rest.

    Rendered as R2E-Gym's `FileDiff.get_patch` renders it: per hunk, pre-context, removed
    (`left_lines`), added (`right_lines`), post-context.  `test_files`: keep only files whose
    path names a test (R2E-Gym's `is_test_file`: a `test`/`tests` folder or a `test_` name),
    else only the others.  Raises KeyError/TypeError on a shape that is not a parsed commit.
    """
    out: list[str] = []
    for fd in parsed["file_diffs"]:
        old = (fd.get("old_file") or {}).get("path") or fd["header"]["file"]["path"]
        new = (fd.get("new_file") or {}).get("path") or old
        parts = new.split("/")
        is_test = any(p in ("test", "tests") for p in parts[:-1]) or parts[-1].startswith("test_")
        if is_test != test_files:
            continue
        out.append(f"diff --git a/{old} b/{new}\n--- a/{old}\n+++ b/{new}\n")
        for hunk in fd["hunks"]:
            d = hunk["descriptor"]
            section = d.get("section") or ""
            out.append(f"@@ -{d['old_range']['start']},{d['old_range'].get('length', 1)} "
                       f"+{d['new_range']['start']},{d['new_range'].get('length', 1)} @@{' ' + section if section else ''}\n")
            g = hunk["line_group"]
            for key, tag in (("pre_context_lines", " "), ("left_lines", "-"), ("right_lines", "+"),
                             ("post_context_lines", " ")):
                for line in g.get(key) or []:
                    out.append(f"{tag}{line['content']}\n")
    return "".join(out)
