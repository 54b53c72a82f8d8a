"""HTTP server of the embedded CPU engine: a vLLM-compatible subset of the OpenAI API.

Run:  ``python -m app.engines.embedded.server --model smollm2 --port 8200``  (``tiny`` or a checkpoint dir also work)
or under gunicorn (one process owns the model; threads serve the streams)::

    TURNSTILE_ENGINE_MODEL=smollm2 gunicorn -w 1 -k gthread --threads 64 -b :8200 \\
        'app.engines.embedded.server:create_engine_app()'

Routes (shapes follow vLLM's OpenAI server, https://docs.vllm.ai/en/latest/serving/openai_compatible_server/):

* ``POST /v1/chat/completions``: stream and non-stream; ``prompt_token_ids`` (a prompt given as ids,
  used instead of rendering ``messages``); vLLM extensions ``return_token_ids``,
  ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
  ``return_tokens_as_token_ids``, ``chat_template_kwargs``; Turnstile adds ``policy_version`` and
  ``engine_id`` to every response and chunk.  ``n`` must be 1.  ``presence_penalty``,
  ``frequency_penalty``, ``logit_bias`` and ``response_format`` are accepted and ignored.
* ``POST /v1/completions``: legacy completions with ``prompt`` as a string or a list of token ids
  (the "tokens in, tokens out" path: the caller renders the template, no re-tokenization);
  with vLLM's ``prompt_logprobs`` a prefill-only scoring pass (``app.engines.embedded.scoring``).
* ``POST /tokenize`` / ``POST /detokenize``, ``GET /v1/models``, ``GET /health``.  The model card
  carries ``route_shape``: ``[layers, top_k, experts]`` of an MoE model (whose answers give
  ``routed_experts`` when asked, ``return_routed_experts``), null for a dense one; and ``dtype``,
  the parameter dtype served (``--dtype``, default ``TURNSTILE_ENGINE_DTYPE``, float32: logprob
  parity with the trainer is specified in fp32; ``bfloat16`` casts every weight load into bf16
  and returns fp32 logprobs of the bf16 logits).
* ``POST /v1/load_weights {"path", "policy_version", "weights", "mode", "recompute_kv"}`` →
  ``{"policy_version", "weights"}`` and ``GET /v1/policy_version`` → ``{"policy_version", "engine_id",
  "weights"}``: ``mode`` is the weight update mode (``keep`` | ``wait`` | ``abort``, default the
  engine's ``--weight-update-mode``; an unknown one is a 400 naming ``mode``), see
  ``BatchScheduler.reload`` for what each does with running requests.  Under ``keep`` every
  chunk's ``policy_version`` is the version that sampled its token (``kv_version`` is added
  where the token attended to KV of older weights), and a non-stream answer carries
  ``policy_versions`` runs ``[[first token index, version], ...]``.  ``weights`` names what is served
  (``app.engines.client.weights_label``: the caller's name, else the folder's real path; the
  start spec's after a start or ``{"base": true}``).  Loading
  weights is an admin route: it needs ``Authorization: Bearer <API token>`` (``app.auth``; 401
  otherwise), which ``EngineClient.reload`` / ``reset_to_base`` send.
* ``PUT /v1/checkpoints/<version>/<file>`` and ``POST /v1/checkpoints/<version>/load``: a
  checkpoint sent over HTTP with SHA-256 digests, for an engine that shares no disk with the
  trainer (``app.engines.embedded.uploads``; admin routes too).
* ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, ``GET /v1/lora_adapters``: LoRA
  adapters that generation requests name in ``model`` (``app.engines.embedded.adapters``; admin).

The generation routes are ``app.engines.embedded.generate``'s; this module holds the app factory,
the token, model, health and weight routes, and the CLI.

Errors use vLLM's body ``{"error": {"message", "type", "param", "code"}}``; a context overflow
uses vLLM's wording ("This model's maximum context length is 8192 tokens. However, you
requested N tokens (P in the messages, M in the completion). …") so harnesses recognise it.
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import socket
import time

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

from app.engines.embedded import generate, scoring
from app.engines.embedded import adapters, uploads
from app.engines.embedded.engine import DEFAULT_MAX_MODEL_LEN, DTYPES, Engine, build_engine
from app.runconfig import WEIGHT_UPDATE_MODES
from app.engines.embedded.validation import EngineError, get_field, json_body, update_mode_fields, weights_name
from app.engines.client import weights_label
from app.engines.modeling import load_model, read_state_dict
from app.engines.routing import route_shape

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- app factory
def create_engine_app(model_spec: str | None = None, engine: Engine | None = None, *,
                      admin_token: str | None = None, **engine_kwargs) -> Flask:
    """Flask app serving one engine.  Loads ``model_spec`` (default: the ``TURNSTILE_ENGINE_MODEL``
    setting, ``smollm2``) unless a ready ``engine`` is given.  ``admin_token`` guards the admin
    routes (default: the deployment's API token, ``app.auth.api_token()``)."""
    from app import auth

    if engine is None:
        from app.config import get_settings

        engine = build_engine(model_spec or get_settings().engine_model, **engine_kwargs)
    token = admin_token or auth.api_token()
    app = Flask("turnstile-engine")
    app.config["ENGINE"] = engine

    def require_admin() -> None:
        """Raise a 401 unless the request carries the API token as a bearer credential."""
        if not auth.same(auth.bearer(request.headers.get("Authorization")), token):
            raise EngineError("loading weights needs the API token (Authorization: Bearer <token>)", 401)

    @app.errorhandler(EngineError)
    def _engine_error(exc: EngineError):
        return jsonify(exc.body()), exc.status

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        return jsonify(EngineError(exc.description or exc.name, exc.code or 500).body()), exc.code or 500

    @app.errorhandler(Exception)
    def _internal_error(exc: Exception):
        log.exception("unhandled engine error")
        return jsonify(EngineError(f"internal engine error: {exc}", 500).body()), 500

    @app.post("/v1/chat/completions")
    def chat_completions():
        return generate.chat(engine)

    @app.post("/v1/completions")
    def completions():
        if scoring.wants_prompt_logprobs(json_body()):  # a teacher scoring a chain (prefill only)
            return scoring.completions_with_prompt_logprobs(engine)
        return generate.completions(engine)

    @app.post("/tokenize")
    def tokenize():
        body = json_body()
        if "messages" in body:
            ids = generate.render(engine, body)
        elif isinstance(body.get("prompt"), str):
            with engine.tokenizer_lock:
                ids = engine.tokenizer(body["prompt"], add_special_tokens=get_field(body, "add_special_tokens", bool, True))["input_ids"]
        else:
            raise EngineError("give 'messages' or a string 'prompt'")
        out = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids)}
        if get_field(body, "return_token_strs", bool, False):
            with engine.tokenizer_lock:
                out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(list(ids))
        return jsonify(out)

    @app.post("/detokenize")
    def detokenize():
        tokens = get_field(json_body(), "tokens", list)
        if tokens is None or not all(isinstance(t, int) and 0 <= t < len(engine.tokenizer) for t in tokens):
            raise EngineError("'tokens' must be a list of token ids", param="tokens")
        with engine.tokenizer_lock:
            return jsonify({"prompt": engine.tokenizer.decode(tokens)})

    shape = route_shape(engine.model)  # weight loads keep the architecture
    moe_shape = list(shape) if shape is not None else None

    @app.get("/v1/models")
    def models():
        return jsonify({"object": "list", "data": [{
            "id": engine.served_model_name, "object": "model", "created": 0, "owned_by": "turnstile",
            "root": engine.model_spec, "max_model_len": engine.max_model_len,
            "policy_version": engine.scheduler.policy_version, "route_shape": moe_shape,
            "dtype": engine.dtype}]})

    @app.get("/health")
    def health():
        return jsonify({"status": "ok", "engine_id": engine.engine_id, **engine.scheduler.load()})

    @app.get("/v1/policy_version")
    def policy_version():
        version, weights = engine.scheduler.serving()
        return jsonify({"policy_version": version, "engine_id": engine.engine_id, "weights": weights})

    @app.post("/v1/load_weights")
    def load_weights():
        require_admin()
        body = json_body()
        update = update_mode_fields(body)  # a bad mode is refused before any file is read
        started = time.perf_counter()
        if get_field(body, "base", bool, False):
            # Back to the weights this engine was started with (a run that starts from the base
            # model must not sample from a previous run's trained weights).
            path = engine.model_spec
            version = get_field(body, "policy_version", int, 0)
            weights = weights_label(engine.model_spec)
            state = load_model(engine.model_spec, dtype=DTYPES[engine.dtype])[0].state_dict()
        else:
            path = get_field(body, "path", str)
            if not path or not os.path.isdir(path):
                raise EngineError(f"checkpoint directory {path!r} does not exist", param="path")
            version = get_field(body, "policy_version", int, engine.scheduler.policy_version + 1)
            weights = weights_name(body, weights_label(path))
            try:
                state = read_state_dict(path)  # disk I/O here, not on the scheduler thread
            except Exception as exc:  # safetensors raises its own SafetensorError on corrupt files
                raise EngineError(f"cannot read checkpoint {path}: {exc}", param="path") from exc
        try:
            new_version = engine.scheduler.reload(state, version, weights, **update)
        except (ValueError, RuntimeError) as exc:
            raise EngineError(f"checkpoint does not fit the served model: {exc}", param="path") from exc
        return jsonify({"policy_version": new_version, "path": path, "engine_id": engine.engine_id,
                        "weights": weights, "load_s": round(time.perf_counter() - started, 3)})

    # The same swap for a checkpoint sent over HTTP (SHA-256 checked): an engine on another machine.
    uploads.register(app, engine, require_admin)
    adapters.register(app, engine, require_admin)  # LoRA adapters requests name in `model`
    return app


def main(argv: list[str] | None = None) -> None:
    from app.config import get_settings

    settings = get_settings()
    parser = argparse.ArgumentParser(description="Turnstile embedded CPU inference engine")
    parser.add_argument("--model", default=settings.engine_model,
                        help="tiny | smollm2 | checkpoint directory (default: TURNSTILE_ENGINE_MODEL, smollm2)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=settings.engine_port, help="default: TURNSTILE_ENGINE_PORT, 8200")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--prefix-cache-tokens", type=int, default=16384, help="prefix cache budget (0: off)")
    parser.add_argument("--served-model-name")
    parser.add_argument("--engine-id")
    parser.add_argument("--policy-version", type=int)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: TURNSTILE_ENGINE_THREADS, 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=settings.engine_dtype,
                        help="parameter dtype served; weight loads are cast into it (default: "
                             "TURNSTILE_ENGINE_DTYPE, float32, the trainer's numerics)")
    parser.add_argument("--weight-update-mode", choices=WEIGHT_UPDATE_MODES, default="keep",
                        help="what a weight load that names no mode does with running requests (default: keep)")
    parser.add_argument("--no-recompute-kv", action="store_true",
                        help="keep updates leave running requests' KV cache as the old weights computed it")
    args = parser.parse_args(argv)
    faulthandler.enable()  # a hard crash (signal) leaves a traceback of every thread in the log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_engine_app(args.model, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                            max_model_len=args.max_model_len, served_model_name=args.served_model_name,
                            engine_id=args.engine_id or f"embedded-{socket.gethostname()}-{args.port}",
                            policy_version=args.policy_version, threads=args.threads,
                            prefix_cache_tokens=args.prefix_cache_tokens, update_mode=args.weight_update_mode,
                            recompute_kv=not args.no_recompute_kv, dtype=args.dtype)
    from werkzeug.serving import make_server

    server = make_server(args.host, args.port, app, threaded=True)
    log.info("engine %s serving %s (%s) on http://%s:%d", app.config["ENGINE"].engine_id, args.model, args.dtype,
             args.host, args.port)
    server.serve_forever()


if __name__ == "__main__":
    main()
