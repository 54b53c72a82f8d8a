"""A teacher served at another URL: its tokenizer is compared with the student's over the engine's
`/tokenize` (real embedded engine servers over HTTP), and a different one is refused at creation
with a message naming the first mismatching ids."""
from __future__ import annotations

import json
import re
import shutil
import threading

import pytest

from app.engines.modeling import build_tiny_model, load_tokenizer, save_weights
from app.runconfig import RunConfig
from app.training import tokenizer_remote
from app.training.teacher_check import check_teacher
from app.training.tokenizer_match import read_facts, tokenizer_dir
from support import served_embedded_engine

WORD = re.compile(r"^\u0120?[a-z]{4,}$")  # a byte-level piece that is a plain lower-case word


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def teacher_folder(tmp_path, edit) -> str:
    """Tiny weights plus a copy of the student's tokenizer files changed by `edit(tokenizer_json)`."""
    load_tokenizer()
    folder = save_weights(build_tiny_model(seed=1), tmp_path / "teacher")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_dir("tiny") / name).is_file():
            shutil.copy(tokenizer_dir("tiny") / name, folder / name)
    data = json.loads((folder / "tokenizer.json").read_text())
    edit(data)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return str(folder)


def remote_config(url: str, model: dict | None = None) -> RunConfig:
    return RunConfig.model_validate({"model": model or {"name": "tiny"},
                                     "training": {"algorithm": "opd", "teacher": {"name": "served", "engine_urls": [url]}}})


def test_a_remote_teacher_with_swapped_ids_is_refused_naming_them(var_dir, tmp_path):
    swapped = {}

    def swap(data):
        vocab = data["model"]["vocab"]
        words = sorted((i, t) for t, i in vocab.items() if i >= 2000 and WORD.match(t))[:2]
        (ia, a), (ib, b) = words
        vocab[a], vocab[b] = ib, ia
        swapped.update(a=a, ia=ia, ib=ib)

    with served_embedded_engine(teacher_folder(tmp_path, swap)) as url:
        field, message = check_teacher(remote_config(url))
    assert field == "training.teacher.engine_urls"
    assert message.startswith("the teacher's tokenizer differs from the student's: ")
    a, ia, ib = swapped["a"], swapped["ia"], swapped["ib"]
    assert f"token {a!r} is id {ia} in the student's tokenizer but id {ib} in the teacher's" in message
    assert url in message


def test_a_remote_teacher_with_the_same_tokenizer_is_accepted(var_dir):
    with served_embedded_engine("tiny") as url:
        assert check_teacher(remote_config(url)) is None
        # The probe covers the student's vocabulary, not a handful of ids.
        facts = read_facts(tokenizer_dir("tiny"))
        seen = set()
        for text in tokenizer_remote.vocabulary_texts(facts):
            seen.update(tokenizer_remote.EngineTokenizer(url).tokenize(text)[0])
    assert len(seen) > 0.9 * len(facts.vocab), (len(seen), len(facts.vocab))


def test_a_remote_teacher_whose_special_token_is_split_is_refused(var_dir, tmp_path):
    def drop_im_end(data):
        data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|im_end|>"]
        data["model"]["vocab"].pop("<|im_end|>", None)

    with served_embedded_engine(teacher_folder(tmp_path, drop_im_end)) as url:
        field, message = check_teacher(remote_config(url))
    assert field == "training.teacher.engine_urls"
    assert "'<|im_end|>'" in message and "student's tokenizer" in message


def test_an_engine_without_tokenize_is_refused_not_trusted(var_dir):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class PromptLogprobsOnly(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            entries = [None] + [{str(t): {"logprob": -1.0}} for t in body["prompt"][1:]]
            out = json.dumps({"choices": [{"index": 0, "text": "", "prompt_logprobs": entries}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), PromptLogprobsOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        field, message = check_teacher(remote_config(url))
    finally:
        server.shutdown()
        server.server_close()
    assert field == "training.teacher.engine_urls"
    assert "cannot tokenize a probe text (POST /tokenize)" in message and url in message


def test_without_student_files_the_two_engines_are_compared(var_dir, tmp_path):
    def swap_first_word(data):
        vocab = data["model"]["vocab"]
        (ia, a), (ib, b) = sorted((i, t) for t, i in vocab.items() if t in ("\u0120return", "\u0120the"))
        vocab[a], vocab[b] = ib, ia

    with served_embedded_engine("tiny") as student_url, served_embedded_engine(teacher_folder(tmp_path, swap_first_word)) as teacher_url:
        student = {"name": "served-student", "engine": "vllm", "engine_urls": [student_url]}
        cfg = remote_config(teacher_url, student)
        field, message = check_teacher(cfg)
        assert field == "training.teacher.engine_urls"
        assert "in the student's tokenizer" in message and student_url in message and teacher_url in message
        with served_embedded_engine("tiny") as same_url:
            assert check_teacher(remote_config(same_url, student)) is None
