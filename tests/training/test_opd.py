"""On-policy distillation's loss path with tiny random-init models sharing one tokenizer (CPU, seconds):
teacher = student gives no update, a teacher preferring a token pulls the student toward it and
the reverse KL falls, A_t depends on the sampled token, carries no gradient, and the sign is right."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from app.engines.modeling import build_tiny_model
from app.runconfig import TrainingConfig
from app.training.batching import make_micro_batches
from app.training.grpo import policy_loss
from app.training.opd import OPDSequence, apply_token_advantages, token_advantages
from app.training.teacher_scorers import score_with_model
from app.training.trainer import Trainer

PROMPT = [1, 100, 200, 2, 1]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def state(model) -> dict[str, bytes]:
    return {k: v.detach().cpu().numpy().tobytes() for k, v in model.state_dict().items()}


def chain(model, sampled, prompt=PROMPT):
    """(ids, mask, the model's own logprobs as rollout logprobs) of prompt + sampled."""
    ids = list(prompt) + list(sampled)
    mask = [0] * len(prompt) + [1] * len(sampled)
    return ids, mask, score_with_model(model, ids, mask)


def opd_sequence(student, teacher, sampled, coef=1.0, grpo=0.0, include_grpo=False):
    ids, mask, rollout = chain(student, sampled)
    teacher_lp = score_with_model(teacher, ids, mask)
    adv = token_advantages(grpo, teacher_lp, rollout, mask, coef, include_grpo)
    return OPDSequence(ids, mask, rollout, grpo if include_grpo else 0.0, 0, token_advantages=adv.tolist())


def biased_teacher(student, token: int, bias: float):
    """The student with a bias of `bias` nats on `token`'s logit: a teacher that prefers `token`."""
    teacher = copy.deepcopy(student)
    head = torch.nn.Linear(student.lm_head.in_features, student.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(student.lm_head.weight)
        head.bias.zero_()
        head.bias[token] = bias
    teacher.lm_head = head
    return teacher.eval()


def next_token_logprobs(model, prompt=PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)


def test_teacher_equal_to_student_gives_a_zero_update():
    student = build_tiny_model(0)
    teacher = build_tiny_model(0)
    sequences = [opd_sequence(student, teacher, [300 + i, 301, 302 + i, 2]) for i in range(3)]
    assert all(a == 0.0 for s in sequences for a in s.token_advantages)
    trainer = Trainer(TrainingConfig(learning_rate=1e-2), student)
    before = state(student)
    metrics = trainer.update(sequences)
    assert state(student) == before  # byte-identical
    assert metrics["micro_batches_zero_advantage"] == metrics["micro_batches"]
    # The same step with a teacher that differs does move the weights (the check can fail).
    other = opd_sequence(student, build_tiny_model(1), [300, 301, 302, 2])
    trainer.update([other])
    assert state(student) != before


def test_a_teacher_that_prefers_a_token_pulls_the_student_toward_it_and_the_reverse_kl_falls():
    student = build_tiny_model(0)
    with torch.no_grad():
        student.model.norm.weight.mul_(8.0)  # a peaked next-token distribution, as a trained model's
    start = next_token_logprobs(student)
    top, x = (int(i) for i in torch.argsort(start, descending=True)[:2])
    # The teacher moves 2 nats of logit onto X and takes the same mass off the student's top token,
    # so its normaliser is unchanged and every other token's A_t is ~0.
    bias = 2.0
    px, ptop = float(start[x].exp()), float(start[top].exp())
    teacher = biased_teacher(student, x, bias)
    with torch.no_grad():
        teacher.lm_head.bias[top] = math.log(1 - px * (math.exp(bias) - 1) / ptop)
    teacher_lp = next_token_logprobs(teacher)

    def reverse_kl(model):
        lp = next_token_logprobs(model)
        return float((lp.exp() * (lp - teacher_lp)).sum())

    kl_start = reverse_kl(student)
    trainer = Trainer(TrainingConfig(learning_rate=1e-5), student)
    gen = torch.Generator().manual_seed(0)
    for _step in range(20):
        student_lp = next_token_logprobs(student)  # the rollout logprobs of this step's samples
        samples = torch.multinomial(student_lp.exp(), 8, replacement=True, generator=gen).tolist()
        sequences = []
        for t in samples:
            ids, mask = PROMPT + [t], [0] * len(PROMPT) + [1]
            rollout = [0.0] * len(PROMPT) + [float(student_lp[t])]
            teacher_chain = [0.0] * len(PROMPT) + [float(teacher_lp[t])]
            adv = token_advantages(0.0, teacher_chain, rollout, mask, 1.0, False)
            sequences.append(OPDSequence(ids, mask, rollout, 0.0, 0, token_advantages=adv.tolist()))
        trainer.update(sequences)
    px_end = float(next_token_logprobs(student)[x].exp())
    assert px_end > 2 * px, (px, px_end)
    assert reverse_kl(student) < 0.5 * kl_start, (kl_start, reverse_kl(student))


def test_the_advantage_depends_on_the_sampled_token():
    student, teacher = build_tiny_model(0), build_tiny_model(1)
    a = opd_sequence(student, teacher, [300, 301, 302, 303])
    b = opd_sequence(student, teacher, [300, 301, 4000, 303])  # one sampled token changed
    k = len(PROMPT) + 2
    assert a.token_advantages[k] != b.token_advantages[k]
    assert a.token_advantages[: k] == b.token_advantages[: k]  # causal: earlier tokens unchanged
    # Sign: A_t = log pi_T - log pi_S at each sampled token.
    ids, mask, rollout = chain(student, [300, 301, 302, 303])
    teacher_lp = score_with_model(teacher, ids, mask)
    assert a.token_advantages[k] == pytest.approx(teacher_lp[k] - rollout[k], abs=1e-6)


def test_the_advantage_carries_no_gradient():
    student, teacher = build_tiny_model(0), build_tiny_model(1)
    ids, mask, _ = chain(student, [300, 301, 302, 303])
    seq = OPDSequence(ids, mask, [0.0] * len(ids), 0.0, 0, token_advantages=[0.0] * len(ids))
    mb = make_micro_batches([seq], 1024, "token")[0]
    from app.training.policy import token_logprobs

    live = token_logprobs(student, mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets)  # with grad
    teacher_lp = torch.tensor(score_with_model(teacher, ids, mask))[torch.tensor(mask).bool()]
    adv = token_advantages(0.0, teacher_lp, live, torch.ones_like(live), 1.0, False)
    assert adv.grad_fn is None and not adv.requires_grad  # stop-gradient
    logprobs = live.detach().clone().requires_grad_(True)
    weights = torch.full_like(logprobs, 1.0 / logprobs.numel())
    loss, _ = policy_loss(logprobs, logprobs.detach(), logprobs.detach(), adv, weights, clip_low=0.2, clip_high=0.28,
                          tis_cap=2.0)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # On policy (ratio 1, TIS 1) d loss / d logp_t = -w_t A_t: nothing flows through A_t.
    torch.testing.assert_close(grad, -weights * adv)


def test_per_token_advantages_reach_the_micro_batches_in_order_and_only_on_sampled_tokens():
    student, teacher = build_tiny_model(0), build_tiny_model(1)
    seqs = [opd_sequence(student, teacher, [300 + i, 301, 302, 2 + i]) for i in range(3)]
    for packing in (False, True):
        batches = apply_token_advantages(make_micro_batches(seqs, 12, "token", packing=packing), seqs)
        for mb in batches:
            for i in mb.sequence_index.unique().tolist():
                mask = torch.tensor(seqs[i].loss_mask).bool()
                expected = torch.tensor(seqs[i].token_advantages)[mask]
                torch.testing.assert_close(mb.advantages[mb.sequence_index == i], expected)
        assert sum(int(mb.targets.numel()) for mb in batches) == sum(s.trainable for s in seqs)
