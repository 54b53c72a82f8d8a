"""Tinker API keys: derived from the API token per key name, checked in constant time."""
from __future__ import annotations

import subprocess
import sys

import pytest

from app.tinker.keys import key_for, name_of
from support import ROOT


def test_keys_name_their_owner_and_nothing_else(tinker_env):
    alice, bob = key_for("alice"), key_for("bob")
    assert alice.startswith("tml-alice-") and alice != bob  # the SDK refuses a key without 'tml-'
    assert name_of(alice) == "alice" and name_of(bob) == "bob"
    assert name_of(alice.replace("tml-alice-", "tml-bob-")) is None  # alice's secret is not bob's
    assert name_of(alice[:-1] + ("A" if alice[-1] != "A" else "B")) is None
    assert name_of(None) is None and name_of("tml-") is None and name_of("Bearer x") is None
    with pytest.raises(ValueError, match="not a Tinker key name"):
        key_for("carol")


def test_cli_prints_the_key(tinker_env):
    out = subprocess.run([sys.executable, "-m", "app", "token", "--tinker", "bob"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == key_for("bob")
