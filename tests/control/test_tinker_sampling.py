"""Tinker `sample` requests answered by a real embedded engine (tiny model, its own process):
num_samples and seeds, logprobs, stop tokens, prompt logprobs, and the same under a LoRA
adapter, where a sequence's sampled logprobs must equal the adapter's own prompt scoring of it."""
from __future__ import annotations

import pytest
import torch

from app.control.tinker_sampling import SampleError, completion_body, parse_request, sample
from app.engines.embedded.adapters import TARGETS, save_adapter
from app.engines.lora_format import adapter_name
from support.engine_process import EngineProcess

PROMPT = [19556, 665, 28, 638, 359, 1250, 314]


@pytest.fixture(scope="module")
def engine():
    proc = EngineProcess("tiny")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def adapter(engine, tmp_path_factory):
    """A random rank-4 adapter on every projection of the tiny model, served by the engine."""
    from app.engines.modeling import load_model

    model = load_model("tiny")[0]
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(4, m.in_features, generator=gen) * 0.3, torch.randn(m.out_features, 4, generator=gen) * 0.3)
               for name, m in model.named_modules()
               if name.rsplit(".", 1)[-1] in TARGETS and isinstance(m, torch.nn.Linear)}
    folder = tmp_path_factory.mktemp("adapter")
    save_adapter(folder, weights, r=4, alpha=8, policy_version=0)
    name = adapter_name("run-1", folder)
    engine.client.load_lora_adapter(name, str(folder))
    return name


def _request(**fields) -> dict:
    params = {"max_tokens": 6, "temperature": 1.0, "seed": 7, **fields.pop("sampling_params", {})}
    return {"prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}, "num_samples": 1,
            "sampling_params": params, **fields}


def test_samples_are_seeded_distinct_and_carry_their_logprobs(engine):
    job = parse_request(_request(num_samples=3))
    first = sample(engine.client, job, None)
    again = sample(engine.client, job, None)
    assert [s["tokens"] for s in first["sequences"]] == [s["tokens"] for s in again["sequences"]]
    assert len(first["sequences"]) == 3
    assert len({tuple(s["tokens"]) for s in first["sequences"]}) > 1  # seed + i: not three copies of one draw
    for seq in first["sequences"]:
        assert len(seq["tokens"]) == len(seq["logprobs"]) == 6
        assert seq["stop_reason"] == "length"
        assert all(lp <= 0.0 for lp in seq["logprobs"])
    assert first["prompt_logprobs"] is None


def test_a_stop_token_ends_the_sequence_and_is_kept(engine):
    greedy = {"temperature": 0.0, "max_tokens": 6}
    free = sample(engine.client, parse_request(_request(sampling_params=greedy)), None)["sequences"][0]["tokens"]
    stop_at = free[2]
    cut = free.index(stop_at)
    stopped = sample(engine.client, parse_request(_request(sampling_params={**greedy, "stop": [stop_at]})), None)
    seq = stopped["sequences"][0]
    assert seq["tokens"] == free[:cut + 1]
    assert seq["stop_reason"] == "stop"


def test_prompt_logprobs_and_last_n(engine):
    job = parse_request(_request(prompt_logprobs=True))
    out = sample(engine.client, job, None)
    lps = out["prompt_logprobs"]
    assert len(lps) == len(PROMPT) and lps[0] is None and all(isinstance(v, float) and v < 0 for v in lps[1:])
    tail = sample(engine.client, parse_request(_request(prompt_logprobs=True, prompt_logprobs_last_n=2)), None)
    assert tail["prompt_logprobs"][:-2] == [None] * (len(PROMPT) - 2)
    assert tail["prompt_logprobs"][-2:] == pytest.approx(lps[-2:], abs=1e-6)


def test_the_adapter_changes_samples_and_scores_its_own_tokens(engine, adapter):
    greedy = {"temperature": 0.0, "max_tokens": 8}
    base = sample(engine.client, parse_request(_request(sampling_params=greedy)), None)["sequences"][0]
    tuned = sample(engine.client, parse_request(_request(sampling_params=greedy)), adapter)["sequences"][0]
    assert base["tokens"] != tuned["tokens"]
    # At temperature 1 (no truncation) a sampled token's logprob is the policy's: scoring prompt +
    # sampled tokens under the same adapter must give the same numbers (prefill vs decode, fp32).
    drawn = sample(engine.client, parse_request(_request(sampling_params={"max_tokens": 8})), adapter)["sequences"][0]
    scored = sample(engine.client, parse_request({**_request(prompt_logprobs=True),
                                                  "prompt": {"chunks": [{"type": "encoded_text",
                                                                         "tokens": PROMPT + drawn["tokens"]}]}}),
                    adapter)["prompt_logprobs"][len(PROMPT):]
    assert scored == pytest.approx(drawn["logprobs"], abs=1e-4)
    on_base = sample(engine.client, parse_request({**_request(prompt_logprobs=True),
                                                   "prompt": {"chunks": [{"type": "encoded_text",
                                                                          "tokens": PROMPT + drawn["tokens"]}]}}),
                     None)["prompt_logprobs"][len(PROMPT):]
    assert max(abs(a - b) for a, b in zip(on_base, scored)) > 1e-2  # scoring did run under the adapter


def test_an_unknown_adapter_is_the_engines_404(engine):
    from app.engines.client import EngineHTTPError

    with pytest.raises(EngineHTTPError) as caught:
        sample(engine.client, parse_request(_request()), "run-99@0123456789ab")
    assert caught.value.status == 404


@pytest.mark.parametrize("change, words", [
    ({"prompt": {"chunks": [{"type": "image", "data": "x", "format": "png"}]}}, "image chunk"),
    ({"prompt": {"chunks": []}}, "no tokens"),
    ({"num_samples": 0}, "num_samples"),
    ({"topk_prompt_logprobs": 3}, "topk_prompt_logprobs is not supported"),
    ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k is not supported"),
    ({"sampling_params": {"max_tokens": 0}}, "max_tokens"),
    ({"sampling_params": {"top_p": 0}}, "top_p"),
    ({"sampling_params": {"stop": [1, "x"]}}, "stop"),
    ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),
])
def test_refused_requests_name_the_field(change, words):
    with pytest.raises(SampleError, match=words):
        parse_request({**_request(), **change})


def test_completion_body_maps_the_sdks_stop_rules():
    assert completion_body(parse_request(_request(sampling_params={"stop": []})), 0, None)["ignore_eos"] is True
    body = completion_body(parse_request(_request(sampling_params={"stop": ["\n\n"], "top_k": -1})), 2, "a@b")
    assert body["stop"] == ["\n\n"] and body["top_k"] == 0 and body["seed"] == 9 and body["model"] == "a@b"
    assert "ignore_eos" not in completion_body(parse_request(_request()), 0, None)
