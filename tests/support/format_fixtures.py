"""The published-format fixture rows (tests/fixtures/formats/), copied with their image and base commit filled in.

The rows name the CI fixture image (psf/requests 2.27 at /testbed, `scripts/build_fixture_image.sh`),
whose reference (a loopback registry on a free port, or an OCI layout) and commit are known only
when a test runs: the files hold `@FIXTURE_IMAGE@` and `@FIXTURE_BASE_COMMIT@` in their place, and the
R2E-Gym row `@FIXTURE_R2E_IMAGE@` (the fixture plus R2E-Gym's hidden tests, `registry.r2e_fixture_layout`).
"""
from __future__ import annotations

import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "formats"


def format_fixtures(dst: Path, image: str = "oci:/nonexistent-layout:fixture",
                    base_commit: str = "0123456789abcdef0123456789abcdef01234567", r2e_image: str | None = None) -> Path:
    """Copy the fixture folder to `dst` with `image`, `base_commit` and `r2e_image` (default: `image`)
    filled in; returns `dst`."""
    shutil.copytree(FIXTURES, dst, dirs_exist_ok=True)
    for p in dst.rglob("*"):
        if p.is_file() and not p.is_symlink():
            text = p.read_text(encoding="utf-8")
            p.write_text(text.replace("@FIXTURE_R2E_IMAGE@", r2e_image or image).replace("@FIXTURE_IMAGE@", image).replace("@FIXTURE_BASE_COMMIT@", base_commit),
                         encoding="utf-8")
    return dst
