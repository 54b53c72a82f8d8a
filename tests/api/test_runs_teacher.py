"""POST /api/runs with on-policy distillation: a bad teacher is a 400 naming the field, and nothing is written."""
from __future__ import annotations

import json
import shutil

import pytest
from sqlalchemy import func, select

from app import create_app
from app.db import session_scope
from app.engines.modeling import build_tiny_model, load_tokenizer, save_weights
from app.tables import Run
from app.training.tokenizer_match import tokenizer_dir
from support import api_client
from support.training import var_dir  # noqa: F401 (fixture: the shared tokenizer cache)

REDIS_DB = 10


@pytest.fixture
def client(var_dir, redis_db):  # noqa: F811
    return api_client(create_app({"TESTING": True}))


def _runs() -> int:
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(Run))


@pytest.mark.parametrize("training, words", [
    ({"algorithm": "opd"}, "needs a teacher"),
    ({"algorithm": "grpo", "teacher": {"name": "tiny"}}, "only with algorithm"),
    ({"algorithm": "opd", "teacher": {}}, "checkpoint folder or a model name"),
    ({"algorithm": "opd", "teacher": {"name": "tiny"}, "opd_coef": 0}, "opd_coef"),
    ({"algorithm": "distill", "teacher": {"name": "tiny"}}, "algorithm"),
    ({"opd_baseline": "step_mean"}, "distillation baseline is used only"),
    ({"algorithm": "opd", "teacher": {"name": "tiny"}, "opd_baseline": "median"}, "opd_baseline"),
    ({"opd_divergence": "topk_forward_kl"}, "distillation divergence is used only"),
    ({"algorithm": "opd", "teacher": {"name": "tiny"}, "opd_divergence": "topk_forward_kl", "opd_topk": 21},
     "opd_topk"),
    ({"algorithm": "opd", "teacher": {"name": "tiny"}, "opd_divergence": "topk_forward_kl",
      "opd_baseline": "step_mean"}, "no advantage to centre"),
])
def test_bad_distillation_settings_are_400(client, training, words):
    resp = client.post("/api/runs", json={"harness": "mini-swe-agent", "model": {"name": "tiny"}, "training": training})
    assert resp.status_code == 400, resp.get_json()
    assert words in json.dumps(resp.get_json())
    assert _runs() == 0


def test_a_teacher_with_another_tokenizer_is_400_naming_the_first_mismatching_ids(client, tmp_path):
    load_tokenizer()
    folder = save_weights(build_tiny_model(seed=1), tmp_path / "teacher")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_dir("tiny") / name).is_file():
            shutil.copy(tokenizer_dir("tiny") / name, folder / name)
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == k) for k in (500, 501))
    vocab[a], vocab[b] = 501, 500
    (folder / "tokenizer.json").write_text(json.dumps(data))
    resp = client.post("/api/runs", json={"harness": "mini-swe-agent", "model": {"name": "tiny"},
                                          "training": {"algorithm": "opd", "teacher": {"checkpoint": str(folder)}}})
    assert resp.status_code == 400, resp.get_json()
    err = resp.get_json()["error"]
    assert err["field"] == "training.teacher"
    assert f"token {a!r} is id 500 in the student's tokenizer but id 501 in the teacher's" in err["message"]
    assert _runs() == 0


def test_dynamic_sampling_is_refused_with_distillation(client):
    resp = client.post("/api/runs", json={"harness": "mini-swe-agent", "model": {"name": "tiny"},
                                          "scheduling": {"dynamic_sampling": True},
                                          "training": {"algorithm": "grpo+opd", "teacher": {"name": "tiny"}}})
    assert resp.status_code == 400, resp.get_json()
    assert "dynamic_sampling" in json.dumps(resp.get_json()) and _runs() == 0
