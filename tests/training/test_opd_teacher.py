"""The distillation teacher against real SQL, real checkpoints and a real embedded engine server:
scores stored and cached by (chain hash, teacher version), re-scoring an old episode bit-exact,
tool-output tokens at 0, unscored chains never trained, and bad teachers refused naming the cause."""
from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from sqlalchemy import select
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.api.dashboard.charts import step_charts

from app.db import session_scope
from app.engines.modeling import build_tiny_model, load_tokenizer, save_weights
from app.paths import RunPaths
from app.runconfig import RunConfig, TeacherChoice
from app.tables import Completion, Episode, Group, Run, TaskInstance, TeacherScore, TrainingStep
from app.training import steps, teacher, teacher_scorers
from app.training.opd import OPDSequence, TeacherScoresMissing
from app.training.teacher_check import check_teacher
from support import reply_json, served_embedded_engine


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def opd_run(data, engine_urls, teacher_cfg, algorithm="opd", **training) -> int:
    return data.run(engine_urls, {"algorithm": algorithm, "teacher": teacher_cfg, "learning_rate": 1e-5, **training})


def two_turn_episode(run_id: int) -> tuple[int, dict]:
    """One episode of two model calls with a tool result between them: (episode id, the id ranges)."""
    prompt, first, tool, second = [1, 100, 200, 2, 1], [300, 301, 302, 2], [1, 400, 401, 402, 2, 1], [303, 304, 2]
    with session_scope() as s:
        inst = TaskInstance(task_set="t", instance_id="demo__two", repo="demo/demo", record={})
        s.add(inst)
        s.flush()
        s.add(Group(run_id=run_id, group_index=0, instance_id=inst.id, status="trained"))
        ep = Episode(run_id=run_id, instance_id=inst.id, group_index=0, sample_index=0, status="completed",
                     reward=0.0, resolved=False, policy_version=0)
        s.add(ep)
        s.flush()
        calls = [(prompt, first), (prompt + first + tool, second)]
        for seq, (p, sampled) in enumerate(calls):
            s.add(Completion(episode_id=ep.id, seq=seq, request_key=f"{ep.id}-{seq}", api="chat", raw_request={},
                             prompt_ids=p, sampled_ids=sampled, logprobs=[-1.0] * len(sampled),
                             finish_reason="stop", policy_version=0))
        n = len(prompt)
        return ep.id, {"prompt": range(0, n), "first": range(n, n + 4), "tool": range(n + 4, n + 10),
                       "second": range(n + 10, n + 13)}


def test_scores_are_stored_cached_and_rescoring_an_old_episode_is_bit_exact(var_dir, data, teacher_dir):
    run_id = opd_run(data, [], {"checkpoint": teacher_dir})
    episodes = data.group(run_id, 0, [1.0, 0.0], seed=1)
    first = teacher.score_episodes(run_id, episodes)
    assert (first.scored, first.cached) == (2, 0)
    again = teacher.score_episodes(run_id, episodes)
    assert (again.scored, again.cached) == (0, 2)  # cached by (chain hash, teacher version)
    with session_scope() as s:
        rows = list(s.scalars(select(TeacherScore)))
        assert len(rows) == 2 and all(r.teacher_version.startswith("ckpt:") for r in rows)
        assert all(all(v <= 0 for v in r.logprobs) and r.tokens == 18 for r in rows)
    for episode_id in episodes:
        checks = teacher.rescore_episode(episode_id)
        assert checks and all(c["stored"] and c["bit_exact"] and c["max_abs_diff"] == 0.0 for c in checks)
        # Another teacher's scores are not the stored ones (the comparison can fail).
        other = teacher.rescore_episode(episode_id, scorer=teacher_scorers.LocalScorer("tiny"))
        assert not any(c["bit_exact"] for c in other)


def test_tool_output_tokens_get_zero_and_unscored_chains_are_never_trained(var_dir, data, teacher_dir):
    run_id = opd_run(data, [], {"checkpoint": teacher_dir})
    episode_id, where = two_turn_episode(run_id)
    with session_scope() as s:
        config = s.get(Run, run_id).run_config().training
    sequences, metrics = steps.step_sequences(run_id, [episode_id], config, 49152)
    assert sequences == [] and metrics["opd"]["chains_unscored_fraction"] == 1.0  # not scored yet: not trained

    teacher.score_episodes(run_id, [episode_id])
    sequences, metrics = steps.step_sequences(run_id, [episode_id], config, 49152)
    (seq,) = sequences
    assert isinstance(seq, OPDSequence)
    adv = seq.token_advantages
    for context in ("prompt", "tool"):
        assert all(adv[i] == 0.0 for i in where[context]), context
    for sampled in ("first", "second"):
        assert all(adv[i] != 0.0 for i in where[sampled]), sampled
    with session_scope() as s:
        (score,) = s.scalars(select(TeacherScore))
        assert all(score.logprobs[i] == 0.0 for i in list(where["prompt"]) + list(where["tool"]))
    opd = metrics["opd"]
    assert opd["tokens_scored"] == 7 and opd["chains_unscored_fraction"] == 0.0 and opd["chains"] == 1
    # reverse KL per token = mean(rollout - teacher) over sampled tokens; per turn = the sum per call, averaged
    gaps = {k: [-1.0 - score.logprobs[i] for i in where[k]] for k in ("first", "second")}
    assert opd["reverse_kl_per_token"] == pytest.approx(sum(gaps["first"] + gaps["second"]) / 7, rel=1e-5)
    assert opd["reverse_kl_per_turn"] == pytest.approx((sum(gaps["first"]) + sum(gaps["second"])) / 2, rel=1e-5)


def test_a_train_step_waits_for_teacher_scores_and_reports_the_distillation_metrics(var_dir, engine, data, teacher_dir):
    run_id = opd_run(data, [engine.url], {"checkpoint": teacher_dir, "timeout_s": 0.5}, algorithm="grpo+opd")
    episodes = data.group(run_id, 0, [1.0, 0.0], seed=1) + data.group(run_id, 1, [0.0, 0.0], seed=2)
    teacher.score_episodes(run_id, episodes[:2])
    with pytest.raises(TeacherScoresMissing, match="2 of 4 chains of step 0 have no teacher score"):
        steps.train_step(run_id, 0, episodes)

    teacher.score_episodes(run_id, episodes[2:])
    metrics = steps.train_step(run_id, 0, episodes)  # resumes the step
    opd = metrics["opd"]
    assert opd["chains_unscored_fraction"] == 0.0 and opd["chains"] == 4
    assert opd["tokens_scored"] == metrics["merge"]["trainable_tokens"] == metrics["tokens_trained"]
    assert opd["reverse_kl_per_token"] > 0 and opd["teacher_seconds_per_chain"] > 0
    with session_scope() as s:
        row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id))
        assert row.status == "completed" and row.metrics["opd"]["tokens_scored"] == opd["tokens_scored"]
        charts, _missing = step_charts([row], s.get(Run, run_id).config)
    kl = next(c for c in charts if c["title"] == "reverse KL to the teacher (nats)")  # the run page's curve
    assert kl["series"][0]["values"] == [pytest.approx(opd["reverse_kl_per_token"])]
    events = EventAccumulator(str(RunPaths(run_id).tensorboard))
    events.Reload()
    tags = set(events.Tags().get("scalars", [])) | set(events.Tags().get("tensors", []))
    assert {"train/opd/reverse_kl_per_token", "train/opd/chains_unscored_fraction"} <= tags


def tokenizer_copy(tmp_path, edit) -> str:
    """A teacher folder: tiny weights plus a copy of the student's tokenizer files changed by `edit`."""
    load_tokenizer()  # writes the shared tokenizer cache the student uses
    from app.training.tokenizer_match import tokenizer_dir

    folder = save_weights(build_tiny_model(seed=1), tmp_path / "other")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_dir("tiny") / name).is_file():
            shutil.copy(tokenizer_dir("tiny") / name, folder / name)
    edit(folder)
    return str(folder)


def opd_config(teacher_cfg) -> RunConfig:
    return RunConfig.model_validate({"model": {"name": "tiny"}, "training": {"algorithm": "opd", "teacher": teacher_cfg}})


def test_a_tokenizer_mismatch_is_refused_with_the_first_mismatching_ids(var_dir, tmp_path):
    def swap(folder):
        data = json.loads((folder / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        a, b = (next(t for t, i in vocab.items() if i == k) for k in (1000, 1001))
        vocab[a], vocab[b] = 1001, 1000
        (folder / "tokenizer.json").write_text(json.dumps(data))

    field, message = check_teacher(opd_config({"checkpoint": tokenizer_copy(tmp_path / "a", swap)}))
    assert field == "training.teacher"
    assert "differs from the student's" in message and "is id 1000 in the student's tokenizer but id 1001" in message

    def template(folder):
        path = folder / "chat_template.jinja"
        if path.is_file():
            path.write_text("{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}")
        else:
            config = json.loads((folder / "tokenizer_config.json").read_text())
            config["chat_template"] = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
            (folder / "tokenizer_config.json").write_text(json.dumps(config))

    field, message = check_teacher(opd_config({"checkpoint": tokenizer_copy(tmp_path / "b", template)}))
    assert "chat template family differs: chatml (student) vs llama2 (teacher)" in message
    # The same files unchanged are accepted.
    assert check_teacher(opd_config({"checkpoint": tokenizer_copy(tmp_path / "c", lambda folder: None)})) is None


class NoPromptLogprobs(BaseHTTPRequestHandler):
    """An OpenAI-style server whose /v1/completions answers without prompt logprobs."""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        reply_json(self, {"object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    def log_message(self, *args):
        pass


def test_bad_teachers_are_refused_at_creation_or_fail_the_run_naming_the_cause(var_dir, data, tmp_path):
    field, message = check_teacher(opd_config({"checkpoint": str(tmp_path / "nowhere")}))
    assert field == "training.teacher" and "cannot be loaded" in message and "nowhere" in message
    field, message = check_teacher(opd_config({"name": "no-such-model"}))
    assert "cannot be loaded" in message and "no-such-model" in message

    server = ThreadingHTTPServer(("127.0.0.1", 0), NoPromptLogprobs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        field, message = check_teacher(opd_config({"name": "served", "engine_urls": [url]}))
        assert field == "training.teacher.engine_urls" and "does not return prompt logprobs" in message
    finally:
        server.shutdown()
        server.server_close()

    broken = build_tiny_model(seed=1)
    with torch.no_grad():
        broken.model.norm.weight[0] = float("nan")
    folder = save_weights(broken, tmp_path / "nan")
    run_id = opd_run(data, [], {"checkpoint": str(folder)})
    episodes = data.group(run_id, 0, [1.0, 0.0], seed=1)
    with session_scope() as s:
        s.add(TrainingStep(run_id=run_id, step=0, status="pending", episode_ids=episodes))
    result = teacher.score_step(run_id, 0)
    assert "not a finite value" in result["error"] and "nan" in result["error"]
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run.status == "failed" and run.error.startswith("teacher: ") and "nan" in run.error
        assert s.scalar(select(TeacherScore.id)) is None  # nothing stored for NaN scores


def test_the_embedded_engine_serves_prompt_logprobs_equal_to_the_local_scorer(var_dir):
    with served_embedded_engine("tiny") as url:
        choice = TeacherChoice(name="tiny", engine_urls=[url])
        assert check_teacher(opd_config(choice.model_dump())) is None
        ids = [1, 100, 200, 2, 1, 300, 301, 302, 2, 1, 400, 2, 303, 304]
        mask = [0] * 5 + [1] * 4 + [0] * 3 + [1] * 2
        remote = teacher_scorers.RemoteScorer(choice).score(ids, mask)
        local = teacher_scorers.LocalScorer("tiny").score(ids, mask)
        assert [v == 0.0 for v in remote] == [m == 0 for m in mask]
        assert remote == pytest.approx(local, abs=1e-4)


def test_the_step_mean_baseline_centres_the_sampled_tokens_advantages_and_leaves_context_at_zero(var_dir, data,
                                                                                                  teacher_dir):
    plain_run = opd_run(data, [], {"checkpoint": teacher_dir})
    centred_run = opd_run(data, [], {"checkpoint": teacher_dir}, opd_baseline="step_mean", opd_coef=0.5)
    episodes = {r: data.group(r, 0, [1.0, 0.0], seed=1) for r in (plain_run, centred_run)}
    out = {}
    for run_id, episode_ids in episodes.items():
        teacher.score_episodes(run_id, episode_ids)
        with session_scope() as s:
            config = s.get(Run, run_id).run_config().training
        out[run_id] = steps.step_sequences(run_id, episode_ids, config, 49152)
    (plain, plain_metrics), (centred, centred_metrics) = out[plain_run], out[centred_run]
    assert plain_metrics["opd"]["baseline"] == 0.0
    sampled = [a for seq in plain for a, m in zip(seq.token_advantages, seq.loss_mask) if m]
    assert sum(sampled) / len(sampled) < -0.1  # a random teacher: d_t is negative on average (the test can fail)
    b = centred_metrics["opd"]["baseline"]
    # b = opd_coef * mean d_t over the step's sampled tokens = -opd_coef * reverse KL per token
    assert b == pytest.approx(-0.5 * centred_metrics["opd"]["reverse_kl_per_token"], rel=1e-6)
    assert b == pytest.approx(0.5 * sum(sampled) / len(sampled), rel=1e-5)  # same chains, same teacher
    total, count = 0.0, 0
    for p, c in zip(plain, centred):
        assert c.token_ids == p.token_ids
        for a_plain, a_centred, m in zip(p.token_advantages, c.token_advantages, c.loss_mask):
            if m:
                assert a_centred == pytest.approx(0.5 * a_plain - b, abs=1e-5)
                total, count = total + a_centred, count + 1
            else:
                assert a_centred == 0.0  # prompt and tool tokens stay out of the loss
    assert abs(total / count) < 1e-5  # centred over the step


def test_a_distillation_baseline_without_distillation_is_refused():
    with pytest.raises(ValueError, match="opd_baseline"):
        RunConfig.model_validate({"kind": "train", "training": {"opd_baseline": "step_mean"}})
    with pytest.raises(ValueError, match="opd_baseline"):
        RunConfig.model_validate({"kind": "train", "training": {"algorithm": "opd", "teacher": {"name": "tiny"},
                                                               "opd_baseline": "mean"}})
