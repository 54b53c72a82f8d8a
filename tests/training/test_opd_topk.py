"""On-policy distillation by forward KL to the teacher's top-k (`training.opd_divergence: topk_forward_kl`):
the fused head scoring k tokens per position, the coarse-grained KL and its gradient, a teacher token
the student never samples rising, the teacher's top-k stored, cached apart and re-scored bit-exactly in
real SQL, served by a real embedded engine, and bad settings refused.  Tiny random-init models, CPU."""
from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from sqlalchemy import select

from app.db import session_scope
from app.engines.modeling import build_tiny_model
from app.runconfig import RunConfig, TeacherChoice, TrainingConfig
from app.api.dashboard.charts import step_charts
from app.tables import Run, TeacherScore, TrainingStep
from app.training import steps, teacher, teacher_scorers
from app.training.batching import make_micro_batches
from app.training.head import fused_token_logprobs
from app.training.opd import OPDSequence, apply_token_advantages, topk_forward_kl
from app.training.policy import token_logprobs
from app.training.teacher_scorers import score_with_model, top_with_model
from app.training.teacher_check import TeacherError, check_teacher, parse_prompt_top
from app.training.trainer import Trainer
from support import reply_json, served_embedded_engine

PROMPT = [1, 100, 200, 2, 1]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_the_fused_head_scores_k_tokens_per_position_as_the_plain_log_softmax_does():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (7, 3), generator=gen)
    upstream = torch.randn(7, 3, generator=gen)
    fused = fused_token_logprobs(hidden, weight, targets, chunk=2)
    (fused * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    plain = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets)
    (plain * upstream).sum().backward()
    assert fused.shape == (7, 3)
    assert torch.allclose(fused, plain, atol=1e-5)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-5) and torch.allclose(grads[1], weight.grad, atol=1e-5)
    # one target per position is the [N] form, unchanged
    assert torch.equal(fused_token_logprobs(hidden, weight, targets[:, 0], chunk=2), fused[:, 0].detach())
    with pytest.raises(ValueError, match="without a sampling transform"):
        fused_token_logprobs(hidden, weight, targets, temperature=torch.ones(7))


def test_the_mass_outside_the_set_is_exact_and_differentiable_even_when_it_vanishes():
    """log r, r the softmax mass outside targets[:, 1:], against float64 autograd, on rows where
    r is ~1e-2 and ~1e-12 (far below what 1 - sum p resolves in fp32)."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 8, generator=gen, dtype=torch.float64)
    hidden = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    hidden[1] = 0.0
    hidden[1, 0] = 1.0
    weight[5, 0] = 32.0  # row 1 is sure of token 5: logit 32 against ~N(0, 1) for the rest
    targets = torch.tensor([[1, 2, 3, 4], [9, 5, 6, 7], [5, 5, 0, 1]])  # duplicates in a set are fine
    upstream_out, upstream_rest = torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)

    def grads(fn, dtype):
        h = hidden.to(dtype).clone().requires_grad_(True)
        w = weight.to(dtype).clone().requires_grad_(True)
        out, rest = fn(h, w)
        ((out * upstream_out.to(dtype)).sum() + (rest * upstream_rest.to(dtype)).sum()).backward()
        return out.detach().double(), rest.detach().double(), h.grad.double(), w.grad.double()

    def reference(h, w):
        logp = torch.log_softmax(h @ w.T, -1)
        return logp.gather(-1, targets), torch.logsumexp(logp.scatter(-1, targets[:, 1:], float("-inf")), -1)

    fused = grads(lambda h, w: fused_token_logprobs(h, w, targets, chunk=2, rest_from=1), torch.float32)
    exact = grads(reference, torch.float64)
    assert exact[1][1] < -25  # r ~ 1e-12 on the sure row
    assert torch.allclose(fused[1], exact[1], rtol=1e-4, atol=1e-4)
    for got, want in zip(fused[::2] + fused[3:], exact[::2] + exact[3:]):
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-4)


def test_extra_targets_agree_between_the_fused_and_the_plain_head_with_and_without_a_transform():
    model = build_tiny_model(0)
    ids = PROMPT + [300, 301, 302, 2]
    mb = make_micro_batches([OPDSequence(ids, [0] * 5 + [1] * 4, [0.0] * 9, 0.0, 0)], 1024, "token")[0]
    extra = torch.tensor([[300, 6, 7], [8, 9, 10], [5, 11, 12], [2, 13, 14]])  # row 0 holds its sampled id
    for transform in ({}, {"temperature": torch.full((4,), 0.7), "support": torch.zeros(4, dtype=torch.long)}):
        out = {head: token_logprobs(model, mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets, head=head,
                                    extra_targets=extra, **transform) for head in ("fused", "plain")}
        for fused, plain in zip(out["fused"], out["plain"]):  # sampled, extra, log mass outside extra
            assert torch.allclose(fused, plain, atol=1e-5)
        grads = {}
        for head, parts in out.items():
            model.zero_grad()
            sum(part.sum() for part in parts).backward()
            grads[head] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        assert torch.allclose(grads["fused"], grads["plain"], atol=1e-4)
        # the extra tokens are scored untransformed even when the sampled ones are not
        plain_sampled = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets)
        assert torch.allclose(out["fused"][1][0, 0], plain_sampled[0], atol=1e-5)
    with pytest.raises(ValueError, match="checkpointed"):
        token_logprobs(model, mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets, head="checkpointed",
                       extra_targets=extra)


def test_the_coarse_grained_kl_is_zero_at_the_teacher_has_no_gradient_there_and_bounds_below_the_full_kl():
    gen = torch.Generator().manual_seed(1)
    teacher_logits = 3 * torch.randn(4, 30, generator=gen)
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    top = teacher_lp.topk(5, -1).indices
    rows = torch.tensor([True, True, True, False])

    def kl_of(logits):
        logp = torch.log_softmax(logits, -1)
        rest = torch.logsumexp(logp.scatter(-1, top, float("-inf")), -1)
        return topk_forward_kl(logp.gather(-1, top), rest, teacher_lp.gather(-1, top), rows)

    same = teacher_logits.clone().requires_grad_(True)
    zero = kl_of(same)
    zero.sum().backward()
    assert zero.abs().max() < 1e-5 and same.grad.abs().max() < 1e-5
    student = torch.randn(4, 30, generator=gen).requires_grad_(True)
    kl = kl_of(student)
    full = (teacher_lp.exp() * (teacher_lp - torch.log_softmax(student, -1))).sum(-1)
    assert kl[3] == 0.0  # a position without teacher tokens
    assert (kl[:3] > 1e-3).all() and (kl[:3] <= full[:3] + 1e-5).all()
    kl.sum().backward()
    assert student.grad.abs().max() > 1e-2 and student.grad[3].abs().max() == 0.0
    # Exactly the KL between the two distributions coarse-grained to the k tokens and one "rest" bucket.
    p, q = teacher_lp.exp()[0], torch.softmax(student.detach(), -1)[0]
    pk, qk = p[top[0]], q[top[0]]
    coarse_p, coarse_q = torch.cat([pk, (1 - pk.sum()).view(1)]), torch.cat([qk, (1 - qk.sum()).view(1)])
    assert float(kl[0].detach()) == pytest.approx(float((coarse_p * (coarse_p / coarse_q).log()).sum()), rel=1e-4)
    # A student that left almost no mass outside K (r_S ~ 1e-9) while the teacher leaves some:
    # the gradient still raises the tokens outside K (it would push them down if r_S were
    # clamped or read off 1 - sum p in fp32).
    sure = teacher_logits.clone()
    sure[0, top[0]] += 25.0
    sure.requires_grad_(True)
    kl_of(sure).sum().backward()
    outside = torch.ones(30, dtype=torch.bool)
    outside[top[0]] = False
    assert float(1 - teacher_lp.exp()[0, top[0]].sum()) > 1e-3
    assert (sure.grad[0, outside] < 0).all()  # descent raises them

def top_sequence(student, teacher_model, sampled, k=4):
    """An OPDSequence of PROMPT + sampled carrying `teacher_model`'s top-k (advantages 0, as for `opd`)."""
    ids, mask = PROMPT + list(sampled), [0] * len(PROMPT) + [1] * len(sampled)
    rollout = score_with_model(student, ids, mask)
    _values, top_ids, top_values = top_with_model(teacher_model, ids, mask, k)
    return OPDSequence(ids, mask, rollout, 0.0, 0, token_advantages=[0.0] * len(ids), top_ids=top_ids,
                       top_logprobs=top_values)


def test_top_with_model_gives_the_teachers_k_likeliest_tokens_at_sampled_positions_only():
    model = build_tiny_model(1)
    ids, mask = PROMPT + [300, 301, 302], [0] * 5 + [1] * 3
    values, top_ids, top_values = top_with_model(model, ids, mask, 4, chunk=2)
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    for t in range(len(ids)):
        if not mask[t]:
            assert top_ids[t] == [0] * 4 and top_values[t] == [0.0] * 4 and values[t] == 0.0
            continue
        best = full[t - 1].topk(4)
        assert top_ids[t] == best.indices.tolist()
        assert top_values[t] == pytest.approx(best.values.tolist(), abs=1e-5)
        assert values[t] == pytest.approx(float(full[t - 1, ids[t]]), abs=1e-5)


def test_a_teacher_token_the_student_never_samples_rises_and_the_kl_falls():
    student = build_tiny_model(0)
    with torch.no_grad():
        student.model.norm.weight.mul_(8.0)  # a peaked next-token distribution, as a trained model's
    with torch.no_grad():
        start = torch.log_softmax(student(input_ids=torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    first = int(start.argmax())
    x = int(start.argsort()[len(start) // 2])  # a token of median probability: never sampled in practice
    teacher_model = copy.deepcopy(student)
    head = torch.nn.Linear(student.lm_head.in_features, student.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(student.lm_head.weight)
        head.bias.zero_()
        head.bias[x] = float(start.max() - start[x]) + 6.0  # the teacher is sure of X
    teacher_model.lm_head = head
    trainer = Trainer(TrainingConfig(algorithm="opd", teacher={"name": "tiny"}, opd_divergence="topk_forward_kl",
                                     opd_topk=4, learning_rate=1e-3), student)
    kls = []
    for _step in range(20):
        # the student's own greedy answer: X is never the sampled token
        sequences = [top_sequence(student, teacher_model, [first])]
        assert sequences[0].token_ids[-1] != x
        metrics = trainer.update(sequences)
        kls.append(metrics["topk_forward_kl"])
    with torch.no_grad():
        end = torch.log_softmax(student(input_ids=torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    assert float(start[x].exp()) < 1e-3 and float(end[x].exp()) > 0.5, (float(start[x].exp()), float(end[x].exp()))
    assert kls[-1] < 0.2 * kls[0], kls


def test_a_teacher_equal_to_the_student_moves_nothing_through_the_top_k_term():
    student = build_tiny_model(0)
    sequences = [top_sequence(student, student, [300 + i, 301, 2]) for i in range(2)]
    mb = apply_token_advantages(make_micro_batches(sequences, 1024, "token"), sequences)[0]
    assert mb.teacher_top_ids.shape == (6, 4) and bool(mb.teacher_top_rows.all())

    def grad_norm(seqs):
        student.zero_grad()
        batch = apply_token_advantages(make_micro_batches(seqs, 1024, "token"), seqs)[0]
        _lp, top, rest = token_logprobs(student, batch.input_ids, batch.attention_mask, batch.rows, batch.cols,
                                        batch.targets, extra_targets=batch.teacher_top_ids)
        topk_forward_kl(top, rest, batch.teacher_top_logprobs, batch.teacher_top_rows).sum().backward()
        return float(torch.sqrt(sum((p.grad ** 2).sum() for p in student.parameters() if p.grad is not None)))

    assert grad_norm(sequences) < 1e-4
    other = [top_sequence(student, build_tiny_model(1), [300 + i, 301, 2]) for i in range(2)]
    assert grad_norm(other) > 1e-2  # the check can fail


# --- the stored scores, in real SQL ---------------------------------------------------------


def topk_run(data, teacher_dir, k=4, algorithm="opd") -> int:
    return data.run([], {"algorithm": algorithm, "teacher": {"checkpoint": teacher_dir}, "learning_rate": 1e-5,
                         "opd_divergence": "topk_forward_kl", "opd_topk": k})


def test_top_k_scores_are_stored_apart_from_sampled_scores_and_rescore_bit_exactly(var_dir, data, teacher_dir):
    run_id = topk_run(data, teacher_dir)
    sampled_run = data.run([], {"algorithm": "opd", "teacher": {"checkpoint": teacher_dir}, "learning_rate": 1e-5})
    episodes = data.group(run_id, 0, [1.0, 0.0], seed=1)
    assert teacher.score_episodes(sampled_run, data.group(sampled_run, 0, [1.0, 0.0], seed=1)).scored == 2
    # the same chains under the sampled-token key are not top-k scores: scored again, under their own key
    report = teacher.score_episodes(run_id, episodes)
    assert (report.scored, report.cached) == (2, 0)
    assert teacher.score_episodes(run_id, episodes).cached == 2
    with session_scope() as s:
        rows = list(s.scalars(select(TeacherScore).where(TeacherScore.top_k == 4)))
        assert len(rows) == 2 and all(r.teacher_version.endswith("|top4") for r in rows)
        for r in rows:
            assert len(r.top_ids) == len(r.top_logprobs) == 4 * len(r.logprobs)
            assert all(v <= 0 for v in r.top_logprobs)
        config = s.get(Run, run_id).run_config().training
    for episode_id in episodes:
        checks = teacher.rescore_episode(episode_id)
        assert checks and all(c["stored"] and c["bit_exact"] and c["top_ids_equal"] for c in checks)
        other = teacher.rescore_episode(episode_id, scorer=teacher_scorers.LocalScorer("tiny"))
        assert not any(c["bit_exact"] for c in other)  # the comparison can fail
    sequences, metrics = steps.step_sequences(run_id, episodes, config, 49152)
    assert len(sequences) == 2 and metrics["opd"]["chains_unscored_fraction"] == 0.0
    for seq in sequences:
        assert all(a == 0.0 for a in seq.token_advantages)  # opd: no sampled-token advantage
        for row, m in zip(seq.top_ids, seq.loss_mask):
            assert (row == [0] * 4) == (not m)


def test_a_train_step_trains_on_the_teachers_top_k_and_reports_the_kl(var_dir, engine, data, teacher_dir):
    run_id = data.run([engine.url], {"algorithm": "opd", "teacher": {"checkpoint": teacher_dir}, "learning_rate": 1e-3,
                                     "opd_divergence": "topk_forward_kl", "opd_topk": 4})
    episodes = data.group(run_id, 0, [0.0, 0.0], seed=1)
    teacher.score_episodes(run_id, episodes)
    metrics = steps.train_step(run_id, 0, episodes)
    assert metrics["topk_forward_kl"] > 0 and metrics["micro_batches_zero_advantage"] == 0
    assert metrics["opd"]["tokens_scored"] == metrics["tokens_trained"] > 0
    with session_scope() as s:
        row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
        charts, _missing = step_charts([row], s.get(Run, run_id).config)
    chart = next(c for c in charts if c["title"].startswith("forward KL to the teacher's top-k"))  # the run page
    assert chart["series"][0]["values"] == [pytest.approx(metrics["topk_forward_kl"])]


def test_the_embedded_engine_serves_the_same_top_k_as_the_local_scorer(var_dir):
    with served_embedded_engine("tiny") as url:
        ids = [1, 100, 200, 2, 1, 300, 301, 302, 2, 1, 400, 2, 303, 304]
        mask = [0] * 5 + [1] * 4 + [0] * 3 + [1] * 2
        remote = teacher_scorers.RemoteScorer(TeacherChoice(name="tiny", engine_urls=[url])).score_top(ids, mask, 5)
        local = teacher_scorers.LocalScorer("tiny").score_top(ids, mask, 5)
        assert remote.top_ids == local.top_ids and remote.top == 5
        assert [v for row in remote.top_logprobs for v in row] == pytest.approx(
            [v for row in local.top_logprobs for v in row], abs=1e-4)
        assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-4)
        with pytest.raises(TeacherError, match="fewer than prompt_logprobs 21"):
            # the engine returns at most 20 alternatives: asking the parser for more is refused by name
            answer = {"choices": [{"prompt_logprobs": [None] + [{"5": {"logprob": -1.0}}] * 13}]}
            parse_prompt_top(answer, ids, mask, 21, url)


def test_top_k_settings_are_checked_at_creation():
    base = {"algorithm": "opd", "teacher": {"name": "tiny"}, "opd_divergence": "topk_forward_kl"}
    assert RunConfig.model_validate({"kind": "train", "training": base}).training.opd_top == 8
    for bad, field in (({"opd_topk": 21}, "opd_topk"), ({"opd_topk": 0}, "opd_topk"),
                       ({"opd_baseline": "step_mean"}, "opd_baseline"), ({"opd_divergence": "forward"}, "opd_divergence")):
        with pytest.raises(ValueError, match=field):
            RunConfig.model_validate({"kind": "train", "training": {**base, **bad}})
    with pytest.raises(ValueError, match="opd_divergence"):
        RunConfig.model_validate({"kind": "train", "training": {"opd_divergence": "topk_forward_kl"}})
    with pytest.raises(ValueError, match="opd_topk: the teacher's top-k is used only"):  # never silently ignored
        RunConfig.model_validate({"kind": "train", "training": {**base, "opd_divergence": "sampled_reverse_kl",
                                                                "opd_topk": 16}})
    assert RunConfig.model_validate({"kind": "train", "training": {**base, "opd_divergence": "sampled_reverse_kl"}}
                                    ).training.opd_top == 0


class OnlyPromptTokens(BaseHTTPRequestHandler):
    """Stands in for an engine that ignores `prompt_logprobs`' k (docker-free, no such engine here):
    it answers each prompt token's own logprob and no alternatives."""

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        entries = [None] + [{str(i): {"logprob": -1.0, "rank": 1}} for i in body["prompt"][1:]]
        reply_json(self, {"object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": "length",
                                                                     "prompt_logprobs": entries}]})

    def log_message(self, *args):
        pass


def test_an_engine_without_the_top_k_is_refused_at_creation(var_dir):
    server = ThreadingHTTPServer(("127.0.0.1", 0), OnlyPromptTokens)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        teacher_cfg = {"name": "served", "engine_urls": [url]}
        topk = RunConfig.model_validate({"model": {"name": "tiny"}, "training": {
            "algorithm": "opd", "teacher": teacher_cfg, "opd_divergence": "topk_forward_kl", "opd_topk": 4}})
        field, message = check_teacher(topk)
        assert field == "training.teacher.engine_urls" and "fewer than prompt_logprobs 4" in message
        # the same engine passes the probe of a sampled-token run, which needs no alternatives (it then
        # fails on the tokenizer comparison, a later check): the top-k probe is what refused it above
        sampled = RunConfig.model_validate({"model": {"name": "tiny"}, "training": {"algorithm": "opd",
                                                                                    "teacher": teacher_cfg}})
        assert "prompt_logprobs" not in (check_teacher(sampled) or ("", ""))[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_teacher_token_outside_the_students_vocabulary_is_refused_by_name():
    student = build_tiny_model(0)
    seq = top_sequence(student, student, [300, 301, 2])
    vocab = student.lm_head.out_features
    seq.top_ids[len(PROMPT)][1] = vocab  # a teacher with a larger LM head
    trainer = Trainer(TrainingConfig(algorithm="opd", teacher={"name": "tiny"}, opd_divergence="topk_forward_kl",
                                     opd_topk=4), student)
    with pytest.raises(ValueError, match=f"token id {vocab}, outside the student's vocabulary of {vocab}"):
        trainer.update([seq])
