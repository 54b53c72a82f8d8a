"""The policy trained is the one that sampled, on the embedded engine (tiny model, fp32).

A harness's temperature 0.7, top-p 0.9 and top-k 20 go to the engine; its answer is recorded
as the gateway records it (`app.proxy.sampling`), built into a chain (`prefix_merging`,
`sequence_transform`) and scored by the `Trainer` under the recorded transform.  The gap between
the engine's logprobs and the trainer's must be <= 1e-5; the same trainer ignoring the
transform is far off (so the check can fail), and greedy / T=1 answers train as before.
"""
from __future__ import annotations

import pytest
import torch

from app.engines.modeling import build_tiny_model
from app.proxy.sampling import sampling_record
from app.runconfig import TrainingConfig
from app.training.batching import StepSequence
from app.training.trainer import Trainer
from app.training.trajectories import CompletionRecord, prefix_merging, sequence_transform

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
TRANSFORM = dict(temperature=0.7, top_p=0.9, top_k=20)
GAP = 1e-5


@pytest.fixture(scope="module")
def trainer():
    return Trainer(TrainingConfig(), build_tiny_model(0))


def capture(engine, stream: bool = False, **sampling) -> CompletionRecord:
    """One chat answer of `engine`, recorded as the gateway records it."""
    request = dict(max_tokens=32, seed=11, logprobs=True, return_token_ids=True, ignore_eos=True, **sampling)
    if stream:
        chunks = list(engine.client.chat(MESSAGES, stream=True, **request))
        prompt = chunks[0]["prompt_token_ids"]
        ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
        entries = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    else:
        out = engine.client.chat(MESSAGES, **request)
        prompt, ids = out["prompt_token_ids"], out["choices"][0]["token_ids"]
        entries = out["choices"][0]["logprobs"]["content"]
    return CompletionRecord(seq=0, prompt_ids=prompt, sampled_ids=ids, logprobs=[e["logprob"] for e in entries],
                            sampling=sampling_record(request, entries, len(ids)))


def gap(trainer: Trainer, record: CompletionRecord, ignore_transform: bool = False) -> float:
    """max |trainer - engine| over the sampled tokens, the chain built as for a training step."""
    built = prefix_merging([record], vocab_size=trainer.model.config.vocab_size)
    assert not built.rejected, built.rejected
    chain = built.sequences[0]
    transform = None if ignore_transform else sequence_transform(len(chain.token_ids), chain.spans, chain.sampling)
    sequence = StepSequence(chain.token_ids, chain.loss_mask, chain.logprobs, 1.0, 0, transform)
    recomputed = trainer.logprobs([sequence])[0]
    return float((recomputed - torch.tensor(record.logprobs)).abs().max())


@pytest.mark.parametrize("stream", [False, True])
def test_trainer_scores_under_the_engines_transform(engine, trainer, stream):
    record = capture(engine, stream, **TRANSFORM)
    sampling = record.sampling
    assert sampling["temperature"] == 0.7 and sampling["top_p"] == 0.9 and sampling["top_k"] == 20
    assert all(1 <= s <= 20 and 0 <= r < s for s, r in zip(sampling["support"], sampling["rank"]))
    matched, ignored = gap(trainer, record), gap(trainer, record, ignore_transform=True)
    print(f"embedded engine, T=0.7 top-p 0.9 top-k 20 ({'stream' if stream else 'non-stream'}): "
          f"gap {matched:.2e} with the transform, {ignored:.2e} without")
    assert matched <= GAP
    assert ignored > 0.1  # the untransformed policy is another one: the check above can fail


def test_a_recorded_support_holds_when_the_trainers_own_top_p_set_would_differ(engine, trainer):
    """Scored with the support the engine reported, not one re-derived by the trainer: with the
    trainer's support sizes shifted by one the gap opens, so the recorded sizes are what count."""
    record = capture(engine, **TRANSFORM)
    shifted = dict(record.sampling, support=[s + 1 for s in record.sampling["support"]])
    assert gap(trainer, CompletionRecord(**{**record.__dict__, "sampling": shifted})) > GAP
    unreported = dict(record.sampling, support=[None] * len(record.sampled_ids), rank=[None] * len(record.sampled_ids))
    assert gap(trainer, CompletionRecord(**{**record.__dict__, "sampling": unreported})) <= GAP  # derived


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_p=1.0)])
def test_greedy_and_the_identity_train_as_before(engine, trainer, sampling):
    record = capture(engine, **sampling)
    assert record.sampling is None  # nothing recorded: the plain log softmax, as before
    assert gap(trainer, record) <= GAP
