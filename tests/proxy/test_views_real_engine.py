"""Real SDKs -> gateway (gunicorn) -> the embedded engine (`app.engines.embedded.server`, tiny model).

Greedy decoding makes the engine deterministic, so the same request sent straight to the
engine must give the same ids, logprobs and text as the call through the gateway; the record's
prompt ids must equal the engine's own /tokenize of the request the gateway sent.
"""
from __future__ import annotations

import httpx
import pytest
from support.gateway import completions, make_episode

pytestmark = pytest.mark.slow


def test_sdks_through_gateway_match_the_engine_token_for_token(gw, real):
    from support.gateway import SDKs
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


def test_spliced_prompts_merge_and_keep_the_trainer_logprob_gap_small(gw, real):
    """A harness that trims the model's answers (here: surrounding whitespace) would make every
    call a new chain when rendered from text; spliced from the sampled ids, the session is one
    chain, and the trainer's logprobs over it equal the engine's within 1e-4."""
    from app.engines.modeling import build_tiny_model
    from app.runconfig import TrainingConfig
    from app.training.batching import StepSequence
    from app.training.trainer import Trainer
    from app.training.trajectories import CompletionRecord, prefix_merging

    _, gateway = real
    ep, token = make_episode()
    messages = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix issue 7."}]
    for turn in range(2):
        r = httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {token}"}, timeout=120,
                       json={"model": "m", "messages": messages, "max_tokens": 6, "temperature": 1.0, "seed": turn})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"] or ""
        messages += [{"role": "assistant", "content": text.strip()},
                     {"role": "user", "content": f"Still failing {turn}."}]
    rows = completions(ep)
    assert [bool(r.raw_request["splice"].get("completion")) for r in rows] == [False, True]
    built = prefix_merging([CompletionRecord(r.seq, r.prompt_ids, r.sampled_ids, r.logprobs, r.finish_reason, r.id)
                            for r in rows])
    assert (built.report["chains"], built.report["completions_merged"]) == (1, 1)
    (chain,) = built.sequences
    trainer = Trainer(TrainingConfig(), build_tiny_model(0))
    values = trainer.logprobs([StepSequence(chain.token_ids, chain.loss_mask, chain.logprobs, 0.0)])[0].tolist()
    recorded = [lp for lp, m in zip(chain.logprobs, chain.loss_mask) if m]
    assert len(values) == len(recorded) == sum(len(r.sampled_ids) for r in rows)
    assert max(abs(a - b) for a, b in zip(values, recorded)) < 1e-4
