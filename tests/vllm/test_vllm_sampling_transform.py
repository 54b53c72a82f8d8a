"""The policy trained is the one that sampled, on vLLM's CPU build (SmolLM2, fp32).

vLLM is served with ``--logprobs-mode processed_logprobs`` (``app.engines.vllm.serve``): each
sampled token's logprob is under temperature, top-k and top-p.  The answer is recorded as the
gateway records it (``app.proxy.sampling``: the support read off the processed ``top_logprobs``),
built into a chain and scored by the ``Trainer`` under the recorded transform (one fp32
transformers forward pass in Turnstile's venv).

Two gaps are told apart:

* the transform itself: ``app.engines.transform`` applied to vLLM's *own* untransformed logits
  (its raw ``prompt_logprobs`` of the same ids, top 20, which hold every kept token when top-k
  is 20) must give vLLM's processed logprobs and supports, <= 1e-5, or within vLLM's own
  decode-vs-prefill drift divided by T where that is larger: those raw logits come from a second,
  prefill, forward pass, and a greedy answer in the same run measures how far such a pass lands
  from the decode that sampled (untransformed on both sides);
* the trainer's: its own fp32 forward differs from vLLM's CPU kernels already without any
  transform (the identity floor, measured on the same tokens, ~2-3e-5); under T the transform
  divides that rounding by T, so the trainer's gap is bounded by the floor / T, not by 1e-5.

Figures are printed (``-s``).
"""
from __future__ import annotations

import pytest
import torch

from app.engines.modeling import load_model
from app.engines.transform import derived_support, processed_logprobs
from app.proxy.sampling import sampling_record
from app.runconfig import TrainingConfig
from app.training.batching import StepSequence
from app.training.trainer import Trainer
from app.training.trajectories import CompletionRecord, prefix_merging, sequence_transform

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
TRANSFORM = dict(temperature=0.7, top_p=0.9, top_k=20)
GAP = 1e-5


@pytest.fixture(scope="module")
def trainer():
    model, _tokenizer = load_model("smollm2")
    return Trainer(TrainingConfig(), model)


def capture(server, **fields) -> CompletionRecord:
    request = dict(model="policy", max_tokens=24, seed=5, logprobs=True, return_token_ids=True, ignore_eos=True,
                   **fields)
    out = server.client.chat(MESSAGES, **request)
    choice = out["choices"][0]
    entries = choice["logprobs"]["content"]
    return CompletionRecord(seq=0, prompt_ids=out["prompt_token_ids"], sampled_ids=choice["token_ids"],
                            logprobs=[e["logprob"] for e in entries],
                            sampling=sampling_record(request, entries, len(choice["token_ids"])))


def trainer_logprobs(trainer: Trainer, record: CompletionRecord, ignore_transform: bool = False) -> torch.Tensor:
    """The trainer's logprobs of the sampled ids, the chain built as for a training step."""
    built = prefix_merging([record], vocab_size=trainer.model.config.vocab_size)
    assert not built.rejected, built.rejected
    chain = built.sequences[0]
    transform = None if ignore_transform else sequence_transform(len(chain.token_ids), chain.spans, chain.sampling)
    return trainer.logprobs([StepSequence(chain.token_ids, chain.loss_mask, chain.logprobs, 1.0, 0, transform)])[0]


def vllm_raw_top(server, record: CompletionRecord, vocab: int) -> torch.Tensor:
    """vLLM's untransformed logprobs at each sampled position as a [S, vocab] row of its top 20
    (the rest -1e30): ``prompt_logprobs`` of prompt + sampled ids (always raw in vLLM)."""
    ids = list(record.prompt_ids) + list(record.sampled_ids)
    out = server.client.request("POST", "/v1/completions", {"model": "policy", "prompt": ids, "max_tokens": 1,
                                                            "temperature": 0.0, "prompt_logprobs": 20})
    positions = out["choices"][0]["prompt_logprobs"][len(record.prompt_ids):]
    rows = torch.full((len(positions), vocab), -1e30)
    for row, entry in enumerate(positions):
        for token, item in entry.items():
            rows[row, int(token)] = item["logprob"]
    return rows


@pytest.mark.vllm_alone  # its bounds are drift-sized (1e-5): other requests in a batch move them
def test_trainer_scores_under_vllms_processed_logprobs(vllm_server, trainer):
    record = capture(vllm_server, top_logprobs=20, **TRANSFORM)
    vocab = trainer.model.config.vocab_size
    support, n = record.sampling["support"], len(record.sampled_ids)
    assert all(isinstance(s, int) and 1 <= s <= 20 for s in support), support   # read off the -9999.0 entries
    assert all(0 <= r < s for s, r in zip(support, record.sampling["rank"]))
    engine = torch.tensor(record.logprobs)
    targets = torch.tensor(record.sampled_ids)

    # The transform is vLLM's: applied to vLLM's own raw logits it gives vLLM's supports and logprobs.
    raw = vllm_raw_top(vllm_server, record, vocab)
    temperature = torch.full((n,), 0.7)
    supports = derived_support(raw / temperature[:, None], torch.full((n,), 20), torch.full((n,), 0.9))
    own = (processed_logprobs(raw, targets, temperature, torch.tensor(support)) - engine).abs().max().item()
    assert supports.tolist() == support
    greedy = capture(vllm_server, temperature=0.0)
    greedy_ids = torch.tensor(greedy.sampled_ids)
    drift = (vllm_raw_top(vllm_server, greedy, vocab).gather(1, greedy_ids[:, None])[:, 0]
             - torch.tensor(greedy.logprobs)).abs().max().item()

    # The trainer: under the recorded transform, with the support derived, ignoring the transform.
    matched = (trainer_logprobs(trainer, record) - engine).abs().max().item()
    unreported = dict(record.sampling, support=[None] * n, rank=[None] * n)
    derived = (trainer_logprobs(trainer, CompletionRecord(**{**record.__dict__, "sampling": unreported}))
               - engine).abs().max().item()
    untransformed = trainer_logprobs(trainer, record, ignore_transform=True)
    ignored = (untransformed - engine).abs().max().item()
    floor = (untransformed - raw.gather(1, targets[:, None])[:, 0]).abs().max().item()   # same tokens, no transform
    print(f"\nvLLM (CPU, fp32), T=0.7 top-p 0.9 top-k 20, {n} tokens, supports {support}:\n"
          f"  the transform on vLLM's own raw logits vs its processed logprobs: {own:.2e} "
          f"(vLLM's decode-vs-prefill drift, greedy: {drift:.2e})\n"
          f"  trainer vs vLLM: {matched:.2e} with the recorded support, {derived:.2e} with the support derived, "
          f"{ignored:.2e} ignoring the transform; identity floor on the same tokens {floor:.2e}")
    assert own <= max(GAP, 1.5 * drift / 0.7)
    assert matched <= max(GAP, 1.5 * floor / 0.7) and abs(derived - matched) <= 1e-6
    assert ignored > 0.1   # the untransformed policy is another one: the checks above can fail


def test_greedy_answers_train_as_before(vllm_server, trainer):
    record = capture(vllm_server, temperature=0.0)
    assert record.sampling is None
    gap = (trainer_logprobs(trainer, record) - torch.tensor(record.logprobs)).abs().max().item()
    print(f"\nvLLM (CPU, fp32) greedy: trainer gap {gap:.2e} (untransformed, as before)")
    assert gap < 1e-3   # the engine contract's goal for vLLM's CPU kernels (test_vllm_contract)
