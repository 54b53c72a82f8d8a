"""Real SDKs -> gateway (gunicorn) -> the embedded engine (`app.engines.server`, tiny model).

Greedy decoding makes the engine deterministic, so the same request sent straight to the
engine must give the same ids, logprobs and text as the call through the gateway; the record's
prompt ids must equal the engine's own /tokenize of the request the gateway sent.
"""
from __future__ import annotations

import httpx
import pytest
from gateway_support import completions, make_episode

pytestmark = pytest.mark.slow


def test_sdks_through_gateway_match_the_engine_token_for_token(gw, real):
    from gateway_support import SDKs
    engine, gateway = real
    ep, token = make_episode()
    sdks = SDKs(gateway)
    try:
        msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
        out = sdks.openai(token).chat.completions.create(model="gpt-x", messages=msgs, max_tokens=8, temperature=0)
        with sdks.anthropic(token).messages.stream(model="claude-x", max_tokens=8, extra_body={"temperature": 0},
                                                   system="You are terse.",
                                                   messages=[{"role": "user", "content": "Say hello."}]) as s:
            amsg = s.get_final_message()
        assert [api for api, _ in sdks.validated()] == ["anthropic"]
    finally:
        sdks.http.close()
    chat_rec, anth_rec = completions(ep)
    version = httpx.get(f"{engine}/v1/policy_version").json()["policy_version"]
    for rec in (chat_rec, anth_rec):
        sent = rec.normalized_request
        tok = {k: sent[k] for k in ("messages", "tools", "chat_template_kwargs") if k in sent}
        ids = httpx.post(f"{engine}/tokenize", json={**tok, "add_generation_prompt": True}).json()["tokens"]
        assert rec.prompt_ids == ids
        direct = httpx.post(f"{engine}/v1/chat/completions", timeout=120, json={
            k: v for k, v in sent.items() if k not in ("stream", "stream_options")}).json()
        choice = direct["choices"][0]
        assert rec.sampled_ids == choice["token_ids"] and rec.prompt_ids == direct["prompt_token_ids"]
        assert rec.logprobs == pytest.approx([e["logprob"] for e in choice["logprobs"]["content"]], abs=1e-4)
        assert rec.policy_version == version and rec.engine_id == engine
        text = choice["message"]["content"] or ""
        if rec.api == "chat":
            assert (out.choices[0].message.content or "") == text
            assert out.usage.completion_tokens == len(rec.sampled_ids)
        else:
            assert "".join(b.text for b in amsg.content if b.type == "text") == text
            assert amsg.usage.output_tokens == len(rec.sampled_ids)
            assert amsg.usage.input_tokens == len(rec.prompt_ids)
