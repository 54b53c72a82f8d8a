"""vLLM's routed experts in the embedded engine's shape, so the gateway reads both engines alike.

The embedded engine answers a chat completion that asked ``"return_routed_experts": true`` with a
top-level ``routed_experts``: a JSON list ``[tokens][layers][top_k]`` of expert ids for the
prompt and every sampled token but the last (``app.engines.embedded.generate.routed_experts``).

vLLM 0.32 (``vllm serve --enable-return-routed-experts``; source:
``vllm/entrypoints/openai/chat_completion/protocol.py`` ``ChatCompletionResponseChoice`` and
``serving.py`` ``chat_completion_full_generator``, ``vllm/config/aux_output.py``,
``vllm/distributed/aux_output_connector/``) answers differently:

* the switch is server-wide: every request to such a server gets routes, asked for or not
  (there is no request field; vLLM ignores ``return_routed_experts`` as an unknown extra field);
* the routes sit in each **choice**, ``choices[i].routed_experts``: a base64 string of a ``.npy``
  file (``vllm.utils.serial_utils.numpy2base64``, ``np.save(allow_pickle=False)``) holding
  ``[prompt + completion - 1 - routed_experts_prompt_start, layers, top_k]`` expert ids,
  dtype ``uint8`` for up to 256 experts, else ``uint16`` (``RoutedExpertsCapturer``);
  ``num_tokens - 1`` because the last sampled token was never forwarded, as in the embedded
  engine; the request field ``routed_experts_prompt_start`` (default 0) drops that many prompt
  tokens from the front (the embedded engine has no such field: it always returns all);
* routes are stored per KV-cache hash block (prefix caching is required), so a prefix-cache hit
  still returns the cached tokens' routes; ``None`` when the request was aborted before any
  forward;
* non-stream answers only: the streaming generator sends no routes (the embedded engine sends
  them in one chunk after the last token's);
* it needs Model Runner V2 (``VllmConfig._verify_aux_output_compatibility``), which needs
  Triton with a backend for the device; vLLM's CPU build with PyPI's ``triton`` (NVIDIA and AMD
  backends only, no ``triton-cpu``) refuses to start with the flag (see docs/moe.md).

``normalize_routed_experts`` rewrites a vLLM answer in place to the embedded engine's shape.
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


def decode_vllm_routes(encoded: str) -> "np.ndarray":
    """vLLM's base64 ``.npy`` routes -> int16 ``[tokens, layers, top_k]`` (``app.engines.routing``'s dtype).

    Raises:
        ValueError: not base64, not a ``.npy`` payload without pickles, not 3-D, not an
            integer dtype, or an id outside int16.
    """
    import numpy as np  # here, not at import: the gateway imports this module and never numpy otherwise

    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise ValueError(f"routed_experts is not a base64 .npy array: {exc}") from exc
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(f"routed_experts must be integer [tokens, layers, top_k]; got {array.dtype} {array.shape}")
    if array.size and int(array.max()) > np.iinfo(np.int16).max:
        raise ValueError(f"routed_experts holds expert id {int(array.max())}, beyond int16")
    return array.astype(np.int16)


def normalize_routed_experts(answer: object, asked: bool) -> object:
    """Make a vLLM chat completion's routes look like the embedded engine's (in place; returns it).

    For an answer (dict) whose choices carry vLLM's base64 ``routed_experts``: each is decoded
    (``decode_vllm_routes``) and removed from its choice; when ``asked`` (the request said
    ``"return_routed_experts": true``) the first choice's routes become the top-level
    ``routed_experts`` list ``[tokens][layers][top_k]``, otherwise they are dropped, as the
    embedded engine sends none unasked.  Answers without such choices (the embedded engine's,
    errors, non-JSON text) come back unchanged.

    Raises:
        ValueError: a choice's ``routed_experts`` string does not decode.
    """
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return answer
    routes = None
    for choice in answer["choices"]:
        if isinstance(choice, dict) and isinstance(choice.get("routed_experts"), str):
            decoded = decode_vllm_routes(choice.pop("routed_experts"))
            if routes is None:
                routes = decoded
        elif isinstance(choice, dict) and "routed_experts" in choice and choice["routed_experts"] is None:
            del choice["routed_experts"]   # vLLM's null (server switch off, or aborted before a forward)
    if asked and routes is not None and "routed_experts" not in answer:
        answer["routed_experts"] = routes.tolist()
    return answer
