"""Whether a teacher served at another URL shares the student's tokenizer, asked over HTTP.

A teacher given by `teacher.engine_urls` has no tokenizer files here, so its engine is asked:
`POST /tokenize` (vLLM's endpoint, which the embedded engine serves too) with
`{"prompt": text, "add_special_tokens": false, "return_token_strs": true}` answers
`{"tokens": [ids], "token_strs": [pieces]}`: which piece of the teacher's vocabulary each id
is; with `"messages"` instead of `"prompt"` the engine renders its own chat template.
(https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html#tokenizer-api.)

Against the student's tokenizer files (`app.training.tokenizer_match.TokenizerFacts`), in order:

* token -> id: the probe texts are the student's whole vocabulary, each piece decoded to text
  (byte-level BPE pieces through GPT-2's byte <-> unicode table, SentencePiece's U+2581 as a
  space) one piece per line, in chunks of `CHUNK_PIECES`, plus prose and code; every
  (piece, id) the teacher returns must be (piece, same id) in the student's map.  A piece whose
  bytes are not valid UTF-8 on their own (part of a multi-byte character) cannot be sent as text
  and is left out: the check covers the ids the teacher's tokenizer produces for the rest;
* special ids: each of the student's special tokens, sent as text, must come back as one token
  with the student's id;
* chat template family: the pieces of a rendered two-message chat, joined, must show the same
  family markers as the student's template (`tokenizer_match.template_family`).

When the student has no tokenizer files here (a model its own engines serve), the same probe
texts (prose, code, a chat) are tokenized by both engines and must give the same ids and pieces.
Only JSON over HTTP: the API runs this at run creation without torch or transformers.
"""
from __future__ import annotations

from typing import Iterable

from app.training.tokenizer_match import TokenizerFacts, template_family

CHUNK_PIECES = 2048  # pieces per /tokenize request (about as many tokens: well inside any context)
PROSE = ("def add(a, b):\n    \"\"\"Return the sum.\"\"\"\n    return a + b  # 1234567890\n\n"
         "The quick brown fox jumps over the lazy dog. Naïve café, Straße, 数字, русский, ελληνικά, עברית 🙂\n"
         "if x != y and z >= 0: print(f'{x!r}') else: raise ValueError(\"bad\")\n\t<tag attr=\"v\">&amp;</tag>\n")
PROBE_CHAT = [{"role": "system", "content": "You are a probe."}, {"role": "user", "content": "Say ok."}]


class TokenizerProbeError(RuntimeError):
    """The engine cannot be asked: no `/tokenize`, or an answer without `tokens` and `token_strs`."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet reversed: the printable character that stands for each
    byte -> the byte (Radford et al. 2019, openai/gpt-2 `encoder.py` `bytes_to_unicode`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_DECODER = _byte_decoder()


def piece_text(piece: str) -> str | None:
    """The text a vocabulary piece stands for, or None when it cannot be sent as text.

    Byte-level pieces (every character in GPT-2's alphabet) map back to bytes, which must be
    valid UTF-8; other pieces (SentencePiece) have U+2581 as a space, and their byte-fallback
    pieces `<0xNN>` are left out."""
    if all(ch in BYTE_DECODER for ch in piece):
        try:
            return bytes(BYTE_DECODER[ch] for ch in piece).decode("utf-8")
        except UnicodeDecodeError:
            return None
    if piece.startswith("<0x") and piece.endswith(">"):
        return None
    return piece.replace("\u2581", " ")


def vocabulary_texts(facts: TokenizerFacts, chunk: int = CHUNK_PIECES) -> list[str]:
    """The student's vocabulary (special pieces excluded) as probe texts, one piece per line,
    `chunk` pieces a text, in id order."""
    special = set(special_pieces(facts))
    lines = [text for piece, _id in sorted(facts.vocab.items(), key=lambda item: item[1])
             if piece not in special and (text := piece_text(piece)) and "\n" not in text]
    return ["\n".join(lines[i:i + chunk]) for i in range(0, len(lines), chunk)]


def special_pieces(facts: TokenizerFacts) -> dict[str, int]:
    """The student's special tokens: content -> id (added tokens marked special, and the
    bos / eos / pad / unk tokens)."""
    inverse = {tid: piece for piece, tid in facts.vocab.items()}
    return {inverse[tid]: tid for tid in sorted({t for t in facts.specials.values() if t is not None}) if tid in inverse}


class EngineTokenizer:
    """The tokenizer of the model an engine at `url` serves, through its `/tokenize`."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 30.0, role: str = "teacher"):
        self.url, self.model, self.timeout, self.role = url, model, timeout, role

    def tokenize(self, text: str | None = None, messages: list[dict] | None = None) -> tuple[list[int], list[str]]:
        """(ids, pieces) of `text` (no special tokens added) or of `messages` rendered with the
        engine's chat template and its generation prompt.  Raises `TokenizerProbeError`."""
        from app.engines.client import EngineClient
        from app.engines.errors import EngineCallError

        body: dict = {"return_token_strs": True}
        if self.model:
            body["model"] = self.model
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=True)
        else:
            body.update(prompt=text, add_special_tokens=False)
        try:
            with EngineClient(self.url, timeout=self.timeout) as client:
                answer = client.request("POST", "/tokenize", body)
        except EngineCallError as exc:
            raise TokenizerProbeError(f"{self.role} engine {self.url} cannot tokenize a probe text (POST /tokenize): "
                                      f"{exc}; the tokenizers cannot be compared") from exc
        ids = answer.get("tokens") if isinstance(answer, dict) else None
        pieces = answer.get("token_strs") if isinstance(answer, dict) else None
        if not (isinstance(ids, list) and isinstance(pieces, list) and len(ids) == len(pieces)
                and all(isinstance(i, int) for i in ids) and all(isinstance(p, str) for p in pieces)):
            raise TokenizerProbeError(f"{self.role} engine {self.url} answered POST /tokenize without matching 'tokens' and "
                                      f"'token_strs' lists (return_token_strs); the tokenizers cannot be compared")
        return ids, pieces


def _first_unknown_pair(facts: TokenizerFacts, ids: Iterable[int], pieces: Iterable[str], url: str) -> str | None:
    for tid, piece in zip(ids, pieces):
        sid = facts.vocab.get(piece)
        if sid != tid:
            where = f"id {sid}" if sid is not None else "absent"
            return (f"token {piece!r} is {where} in the student's tokenizer but id {tid} in the teacher's "
                    f"(the teacher engine {url} tokenized a probe text)")
    return None


def mismatch_with_files(student: TokenizerFacts, teacher: EngineTokenizer) -> str | None:
    """A sentence naming the first difference between the student's tokenizer files and the
    teacher engine's tokenizer, or None.  Raises `TokenizerProbeError`."""
    for text in [PROSE, *vocabulary_texts(student)]:
        problem = _first_unknown_pair(student, *teacher.tokenize(text), teacher.url)
        if problem:
            return problem
    specials = special_pieces(student)
    if specials:
        ids, pieces = teacher.tokenize(" ".join(specials))
        problem = _first_unknown_pair(student, ids, pieces, teacher.url)
        if problem:
            return problem
        for piece, sid in specials.items():
            if sid not in ids:
                return (f"special token {piece!r} (id {sid} in the student's tokenizer) is not one token in the "
                        f"teacher's: {teacher.url} splits it into {ids_of(teacher, piece)}")
    if student.template_family != "none":
        _ids, pieces = teacher.tokenize(messages=PROBE_CHAT)
        family = template_family("".join(pieces))
        if family != student.template_family and not (family.startswith("other:")
                                                      and student.template_family.startswith("other:")):
            return (f"chat template family differs: {student.template_family} (student) vs {family} (what the "
                    f"teacher engine {teacher.url} renders)")
    return None


def ids_of(engine: EngineTokenizer, text: str) -> list[int]:
    """The ids `engine` gives `text` (for messages)."""
    return engine.tokenize(text)[0]


def mismatch_between_engines(student: EngineTokenizer, teacher: EngineTokenizer) -> str | None:
    """A sentence naming the first position where two engines tokenize a probe differently, or None.

    Raises `TokenizerProbeError`."""
    for text, messages in ((PROSE, None), (None, PROBE_CHAT)):
        (sids, spieces), (tids, tpieces) = (e.tokenize(text, messages) for e in (student, teacher))
        for i, (s, t) in enumerate(zip(zip(sids, spieces), zip(tids, tpieces))):
            if s != t:
                return (f"token {i} of a probe {'chat' if messages else 'text'} is id {s[0]} ({s[1]!r}) in the "
                        f"student's tokenizer ({student.url}) but id {t[0]} ({t[1]!r}) in the teacher's ({teacher.url})")
        if len(sids) != len(tids):
            return (f"a probe {'chat' if messages else 'text'} is {len(sids)} tokens in the student's tokenizer "
                    f"({student.url}) but {len(tids)} in the teacher's ({teacher.url})")
    return None
