"""Chat-template rendering for the embedded engine: OpenAI messages → prompt token ids.

The model's own chat template is used whenever it can express the conversation.
SmolLM2's packaged template is plain ChatML without tools, so when a request carries
``tools`` (or the history holds tool calls / tool results) and the model's template does
not mention ``tools``, the engine renders with ``TOOL_CHAT_TEMPLATE`` below: ChatML in the
Hermes / Qwen2.5 function-calling style (tool signatures inside ``<tools></tools>`` in the
system turn, calls as ``<tool_call>{"name": …, "arguments": …}</tool_call>`` in assistant
turns, results as their own ``tool`` turns wrapped in ``<tool_response>``).  The format is
the one vLLM's ``hermes`` tool parser reads
(https://docs.vllm.ai/en/latest/features/tool_calling/#hermes-models-hermes), and
``app.engines.embedded.toolparse`` parses it back into OpenAI ``tool_calls``.

Rendering always goes through ``tokenizer.apply_chat_template`` so that a caller holding
the same tokenizer gets the same ids (the token-exact invariant).
"""
from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Jinja template (our own wording of the Hermes/Qwen ChatML function-calling layout).
# `default_system` is passed as a template variable so the tool template keeps the
# model's default system prompt when the conversation has none.
TOOL_CHAT_TEMPLATE = (
    "{%- set ns = namespace(system=default_system | default('You are a helpful assistant.')) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set rest = messages -%}{%- endif -%}"
    "{{- '<|im_start|>system\\n' + ns.system -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments'"
    " + ' within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in rest -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + message['content'] -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] -%}"
    "{%- if (loop.first and message['content']) or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class TemplateError(ValueError):
    """The messages cannot be rendered (bad shape or the template raised); maps to HTTP 400."""


def _content_text(content: Any, where: str) -> str:
    """Flatten OpenAI message content (string, null, or list of parts) to text.

    Text parts are joined with newlines, as vLLM does for string-content templates.
    Non-text parts (images, audio) are rejected: the embedded models are text-only.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TemplateError(f"{where}: content part of type {kind!r} is not supported by this text-only model")
        return "\n".join(texts)
    raise TemplateError(f"{where}: content must be a string, null or a list of parts")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and return plain dicts the templates can render.

    * ``developer`` becomes ``system`` (ChatML templates know no developer role).
    * content lists are flattened to text; ``None`` content becomes ``""``.
    * assistant ``tool_calls`` are kept as ``{"id", "type", "function": {"name", "arguments"}}``;
      ``arguments`` stays the JSON string the client sent, so the model sees its own bytes back.

    Raises:
        TemplateError: messages is not a non-empty list of objects with a known ``role``.
    """
    if not isinstance(messages, list) or not messages:
        raise TemplateError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise TemplateError(f"{where} must be an object")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise TemplateError(f"{where}.role must be one of system, developer, user, assistant, tool (got {role!r})")
        item: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise TemplateError(f"{where}.tool_calls must be a list")
            item["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise TemplateError(f"{where}.tool_calls[{j}].function.name is required")
                args = fn.get("arguments", "{}")
                if not isinstance(args, str):
                    args = json.dumps(args, ensure_ascii=False)
                item["tool_calls"].append({"id": call.get("id"), "type": "function",
                                           "function": {"name": fn["name"], "arguments": args}})
        if role == "tool" and message.get("tool_call_id") is not None:
            item["tool_call_id"] = message["tool_call_id"]
        out.append(item)
    return out


def template_supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the tokenizer's own chat template renders a ``tools`` variable."""
    return "tools" in (tokenizer.chat_template or "")


def needs_tool_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list | None) -> bool:
    """Whether rendering must fall back to ``TOOL_CHAT_TEMPLATE`` for this conversation."""
    uses_tools = bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    return uses_tools and not template_supports_tools(tokenizer)


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Any,
    tools: list | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """Render OpenAI chat ``messages`` (+ ``tools``) to prompt token ids (``list[int]``).

    Uses the tokenizer's own template unless ``needs_tool_template`` says otherwise.  With
    plain messages the result equals
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)``.

    ``continue_final_message``: the prompt ends inside the last (assistant) message, so the
    model continues it (a prefill), as vLLM's field of the same name; no generation prompt.

    Raises:
        TemplateError: invalid messages/tools, or the template itself raised.
    """
    normalized = normalize_messages(messages)
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise TemplateError("'tools' must be a list of objects")
    kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
    if needs_tool_template(tokenizer, normalized, tools):
        kwargs["chat_template"] = TOOL_CHAT_TEMPLATE
        kwargs.setdefault("default_system", SMOLLM2_DEFAULT_SYSTEM)
    try:
        ids = tokenizer.apply_chat_template(
            normalized, tools=tools or None,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, tokenize=True, return_dict=False, **kwargs)
    except TemplateError:
        raise
    except Exception as exc:  # jinja2 errors, TypeError from odd message shapes
        raise TemplateError(f"chat template failed: {exc}") from exc
    return list(ids)
