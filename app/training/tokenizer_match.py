"""Whether a distillation teacher shares the student's tokenizer, read from the tokenizer files.

On-policy distillation scores the exact token ids the student sampled with the teacher
(`app.training.teacher`): the teacher's logprob of id k is only the logprob of the same text
when id k means the same token to both.  Three things must agree:

* the token -> id map (`tokenizer.json`: `model.vocab` plus `added_tokens`);
* the special ids (bos, eos, pad, unk in `tokenizer_config.json`, and every added special token);
* the chat template family (ChatML, Llama 3, Llama 2 / Mistral, Gemma ...): the same ids must
  mean the same turn structure.

Only JSON is read (no torch, no transformers): the API checks a run at creation with it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from app.config import get_settings

# The embedded models' shared tokenizer cache (written by `app.engines.modeling.load_tokenizer`).
BUILTIN_TOKENIZER_DIR = "smollm2-135m-instruct-tokenizer"
BUILTIN_MODELS = ("tiny", "smollm2")
SPECIAL_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")

# Markers of chat template families, most specific first.
TEMPLATE_FAMILIES = (
    ("llama3", "<|start_header_id|>"),
    ("chatml", "<|im_start|>"),
    ("gemma", "<start_of_turn>"),
    ("llama2", "[INST]"),
)


class TokenizerFilesMissing(FileNotFoundError):
    """The folder holds no `tokenizer.json` (nothing to compare)."""


@dataclass(frozen=True)
class TokenizerFacts:
    """What two tokenizers must share: `vocab` token -> id, `specials` field -> id (None when
    unset), `template_family` (a `TEMPLATE_FAMILIES` name, `none`, or `other:<sha>` for an
    unknown template), `source` the folder read."""

    vocab: dict[str, int]
    specials: dict[str, int | None]
    template_family: str
    source: Path


def tokenizer_dir(spec: str) -> Path:
    """The folder of the tokenizer files of model `spec` ('tiny', 'smollm2' or a model folder).

    A model folder without `tokenizer.json` uses the embedded models' tokenizer, as
    `app.engines.modeling.load_model` does.  Raises `TokenizerFilesMissing` when the files
    are not there (the shared cache is written the first time an engine or trainer loads it).
    """
    folder = Path(spec)
    if spec not in BUILTIN_MODELS and (folder / "tokenizer.json").is_file():
        return folder
    if spec not in BUILTIN_MODELS and not folder.is_dir():
        raise TokenizerFilesMissing(f"{spec!r} is not 'tiny', 'smollm2' or a model folder")
    cache = get_settings().var_dir / "models" / BUILTIN_TOKENIZER_DIR
    if not (cache / "tokenizer.json").is_file():
        raise TokenizerFilesMissing(f"the embedded models' tokenizer cache {cache} is not written yet")
    return cache


def read_facts(folder: Path) -> TokenizerFacts:
    """Read the token map, special ids and template family from a tokenizer folder.

    Raises `TokenizerFilesMissing` without `tokenizer.json`, ValueError for unreadable JSON.
    """
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise TokenizerFilesMissing(f"{folder} has no tokenizer.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder}: unreadable tokenizer files: {exc}") from exc
    vocab = dict((data.get("model") or {}).get("vocab") or {})
    if isinstance(vocab, list):  # unigram models list [piece, score] pairs: the id is the index
        vocab = {piece: i for i, (piece, _score) in enumerate(vocab)}
    specials: dict[str, int | None] = {}
    for token in data.get("added_tokens") or []:
        vocab[token["content"]] = int(token["id"])
        if token.get("special"):
            specials[f"special {token['content']!r}"] = int(token["id"])
    for name in SPECIAL_FIELDS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        specials[name] = vocab.get(value) if isinstance(value, str) else None
    template = config.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return TokenizerFacts(vocab, specials, template_family(template), folder)


def template_family(template: str | None) -> str:
    """The family of a chat template's text (see `TEMPLATE_FAMILIES`)."""
    if not template:
        return "none"
    for name, marker in TEMPLATE_FAMILIES:
        if marker in template:
            return name
    return "other:" + hashlib.sha256(template.encode()).hexdigest()[:12]


def mismatch(student: TokenizerFacts, teacher: TokenizerFacts) -> str | None:
    """A readable sentence naming the first difference between two tokenizers, or None.

    Checked in order: the token -> id map (first token by the student's id order whose id
    differs or that the teacher lacks, then the first token only the teacher has), the special
    ids, the chat template family.
    """
    for token, sid in sorted(student.vocab.items(), key=lambda item: item[1]):
        tid = teacher.vocab.get(token)
        if tid != sid:
            where = f"id {tid}" if tid is not None else "absent"
            return (f"token {token!r} is id {sid} in the student's tokenizer but {where} in the teacher's "
                    f"({len(student.vocab)} vs {len(teacher.vocab)} tokens); the teacher must share the "
                    f"student's tokenizer")
    extra = sorted((tid, token) for token, tid in teacher.vocab.items() if token not in student.vocab)
    if extra:
        tid, token = extra[0]
        return (f"token {token!r} (id {tid}) is in the teacher's tokenizer but not the student's "
                f"({len(student.vocab)} vs {len(teacher.vocab)} tokens)")
    for name in sorted(set(student.specials) | set(teacher.specials)):
        sid, tid = student.specials.get(name), teacher.specials.get(name)
        if sid != tid:
            return f"special token {name}: id {sid} in the student's tokenizer, id {tid} in the teacher's"
    if student.template_family != teacher.template_family:
        return (f"chat template family differs: {student.template_family} (student) vs "
                f"{teacher.template_family} (teacher)")
    return None


def compare(student_spec: str, teacher_spec: str) -> str | None:
    """`mismatch` of the tokenizers of two model specs (see `tokenizer_dir`); None when equal.

    Raises `TokenizerFilesMissing` when either has no tokenizer files to read.
    """
    student_dir, teacher_dir = tokenizer_dir(student_spec), tokenizer_dir(teacher_spec)
    if student_dir.resolve() == teacher_dir.resolve():
        return None
    return mismatch(read_facts(student_dir), read_facts(teacher_dir))
