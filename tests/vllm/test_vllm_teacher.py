"""A distillation teacher served by vLLM (its CPU build, SmolLM2, fp32): accepted at run creation
by the same checks as any served teacher (its tokenizer over ``/tokenize``, a ``prompt_logprobs``
probe), and its scores of a chain equal the local teacher's (one fp32 transformers prefill) on
the sampled tokens, 0 elsewhere.

vLLM answers ``prompt_logprobs`` from the raw logits whatever ``--logprobs-mode`` says (the
teacher is scored untransformed, as ``app.training.opd`` requires).  The two sides are different
kernels: they agree to vLLM's own CPU-vs-transformers floor (about 3e-5 per token, measured in
``test_vllm_sampling_transform.py``), so the bound here is 1e-4.
"""
from __future__ import annotations

import pytest

from app.engines.modeling import load_tokenizer
from app.runconfig import RunConfig, TeacherChoice
from app.training import teacher_scorers
from app.training.teacher_check import check_teacher

pytestmark = pytest.mark.slow


def chain(tokenizer) -> tuple[list[int], list[int]]:
    """A two-turn chain as prefix merging builds it: prompt, answer, tool output, answer (mask 1
    on the two answers only)."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    parts = [(ids("<|im_start|>user\nFix the bug in calc.py<|im_end|>\n<|im_start|>assistant\n"), 0),
             (ids("I will look at the file first.<|im_end|>"), 1),
             (ids("\n<|im_start|>user\ndef add(a, b):\n    return a - b<|im_end|>\n<|im_start|>assistant\n"), 0),
             (ids("The sign is wrong: it should be a + b.<|im_end|>"), 1)]
    return [t for p, _ in parts for t in p], [m for p, m in parts for _ in p]


def test_a_vllm_teacher_is_accepted_and_scores_as_the_local_teacher(vllm_server, var_dir):
    choice = TeacherChoice(name="policy", engine_urls=[vllm_server.url])  # vLLM's --served-model-name
    config = RunConfig.model_validate({"model": {"name": "smollm2"},
                                       "training": {"algorithm": "opd", "teacher": choice.model_dump()}})
    assert check_teacher(config) is None

    ids, mask = chain(load_tokenizer())
    remote = teacher_scorers.RemoteScorer(choice).score(ids, mask)
    local = teacher_scorers.LocalScorer("smollm2").score(ids, mask)
    assert len(remote) == len(ids) and sum(mask) > 20
    assert [v == 0.0 for v in remote] == [m == 0 for m in mask]  # only sampled tokens are scored
    gaps = [abs(a - b) for a, b, m in zip(remote, local, mask) if m]
    print(f"vLLM teacher vs local teacher: max gap {max(gaps):.2e} over {len(gaps)} tokens")
    assert max(gaps) <= 1e-4
    assert all(v < 0.0 for v, m in zip(remote, mask) if m)  # real logprobs, not zeros passed through
