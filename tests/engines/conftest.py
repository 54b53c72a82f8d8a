"""Fixtures of the engine tests: a real engine subprocess serving the tiny model.

The subprocess is started with the repository's var dir so the cached SmolLM2 tokenizer
(created on first use from the packaged GGUF) is shared with the rest of the suite.
"""
from __future__ import annotations

import pytest

from app.conformance import scripted
from support.engine_process import EngineProcess


@pytest.fixture(scope="module")
def engine():
    """A running tiny-model engine for the whole test module."""
    proc = EngineProcess("tiny")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def scripted_engine():
    """The scripted engine (`app.conformance.scripted`) in this process; yields its base URL."""
    server = scripted.serve(0)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
