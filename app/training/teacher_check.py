"""Checks of a run's distillation teacher at creation (no torch, no transformers: the API runs them).

`check_teacher(cfg)` returns `(field, message)` for the first problem, which the API answers
with a 400: a teacher whose weights cannot be found, a tokenizer that differs from the
student's (`app.training.tokenizer_match`, naming the first mismatching ids; for a teacher
served at other URLs, asked over `/tokenize`: `app.training.tokenizer_remote`), or engines that
do not return prompt logprobs for a probe prompt.  `parse_prompt_logprobs` reads vLLM's
`prompt_logprobs` answer shape; the teacher worker uses it too.
"""
from __future__ import annotations

from pathlib import Path

from app.runconfig import RunConfig, TeacherChoice
from app.training import tokenizer_match

BUILTIN = ("tiny", "smollm2")


class TeacherError(RuntimeError):
    """The teacher cannot score: it cannot be loaded, its engine returns no prompt logprobs,
    or its logprobs are not finite values <= 0."""


def parse_prompt_logprobs(answer, token_ids, where: str) -> list[float]:
    """The prompt tokens' own logprobs from a `/v1/completions` answer with `prompt_logprobs`
    (vLLM's shape: `choices[0].prompt_logprobs[t]` maps `str(id)` to `{"logprob", …}`, None
    at t = 0), as floats [T] with 0.0 for the first token.

    Raises `TeacherError` when the answer has no `prompt_logprobs` (the engine does not return
    them), has another length, or lacks an entry for a prompt token."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    entries = choices[0].get("prompt_logprobs") if choices and isinstance(choices[0], dict) else None
    if not isinstance(entries, list):
        raise TeacherError(f"teacher engine {where} does not return prompt logprobs (no choices[0].prompt_logprobs "
                           f"in its /v1/completions answer); serve the teacher with vLLM or the embedded engine")
    if len(entries) != len(token_ids):
        raise TeacherError(f"teacher engine {where} returned {len(entries)} prompt logprobs for {len(token_ids)} ids")
    out = [0.0]
    for t, entry in enumerate(entries[1:], start=1):
        item = entry.get(str(token_ids[t])) if isinstance(entry, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("logprob"), (int, float)):
            raise TeacherError(f"teacher engine {where}: no prompt logprob for token {t} (id {token_ids[t]})")
        out.append(float(item["logprob"]))
    return out


def parse_prompt_top(answer, token_ids, loss_mask, top: int, where: str) -> tuple[list[list[int]], list[list[float]]]:
    """The `top` likeliest tokens at each loss-mask-1 prompt position of a `/v1/completions`
    answer asked with `prompt_logprobs: top`: (ids [T][top], logprobs [T][top]), descending,
    empty rows at position 0 and mask-0 positions.  An entry holds the prompt token and the
    `top` likeliest (vLLM's shape; the prompt token is among them or one more), so the `top`
    highest logprobs of an entry are the teacher's top.  Raises `TeacherError` when an entry
    has fewer than `top` tokens or a malformed one."""
    entries = answer["choices"][0]["prompt_logprobs"]  # parse_prompt_logprobs checked the shape
    ids: list[list[int]] = [[]]
    values: list[list[float]] = [[]]
    for t, entry in enumerate(entries[1:], start=1):
        if not loss_mask[t]:
            ids.append([])
            values.append([])
            continue
        try:
            items = sorted(((float(item["logprob"]), int(key)) for key, item in entry.items()), reverse=True)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise TeacherError(f"teacher engine {where}: a malformed prompt logprob entry at position {t}") from exc
        if len(items) < top:
            raise TeacherError(f"teacher engine {where} returned {len(items)} tokens at position {t}, fewer than "
                               f"prompt_logprobs {top} asks for (vLLM caps them at its --max-logprobs)")
        ids.append([i for _v, i in items[:top]])
        values.append([v for v, _i in items[:top]])
    return ids, values


def probe_engine(url: str, name: str, timeout: float = 30.0, top: int = 0) -> str | None:
    """Ask the engine at `url` for the prompt logprobs of a 4-id prompt, with `top` alternatives
    per token (a top-k distillation teacher's k); the problem, or None."""
    from app.engines.client import EngineClient
    from app.engines.errors import EngineCallError

    ids = [1, 2, 3, 4]  # small ids exist in every vocabulary
    body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top}
    try:
        with EngineClient(url, timeout=timeout) as client:
            answer = client.request("POST", "/v1/completions", body)
            parse_prompt_logprobs(answer, ids, url)
            if top:
                parse_prompt_top(answer, ids, [1] * len(ids), top, url)
    except EngineCallError as exc:
        return f"teacher engine {url} cannot score a probe prompt: {exc}"
    except TeacherError as exc:
        return str(exc)
    return None


def teacher_source(teacher: TeacherChoice) -> str | None:
    """The local model spec of the teacher ('tiny', 'smollm2', a model folder), None when engines serve it.

    Raises FileNotFoundError when its checkpoint or name names no model here."""
    if teacher.engine_urls:
        return None
    if teacher.checkpoint:
        from app.training.checkpoints import resolve_checkpoint

        folder = resolve_checkpoint(teacher.checkpoint)[0]
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"teacher checkpoint {folder} has no config.json (not a model folder)")
        return str(folder)
    if teacher.name in BUILTIN:
        return teacher.name
    if (Path(teacher.name) / "config.json").is_file():
        return teacher.name
    raise FileNotFoundError(f"teacher {teacher.name!r} is not 'tiny', 'smollm2' or a model folder; give "
                            f"teacher.engine_urls for a model served by engines")


def student_source(cfg: RunConfig) -> str:
    """The model spec of the student (its start checkpoint folder, else its name)."""
    if cfg.model.checkpoint and not cfg.model.checkpoint.startswith("run:"):
        return cfg.model.checkpoint
    return cfg.model.name


def check_teacher(cfg: RunConfig) -> tuple[str, str] | None:
    """`(field, message)` of the first problem with `cfg`'s distillation teacher, or None
    (also None for a run without one).  Tokenizers that cannot be read here (a shared cache not
    yet written) are compared by the teacher worker instead, which fails the run on a mismatch."""
    teacher = cfg.training.teacher
    if cfg.training.algorithm == "grpo" or teacher is None:
        return None
    try:
        source = teacher_source(teacher)
    except FileNotFoundError as exc:
        return "training.teacher", f"the teacher cannot be loaded: {exc}"
    if source is None:
        for url in teacher.engine_urls:
            problem = (probe_engine(url, teacher.name or "", top=cfg.training.opd_top)
                       or remote_tokenizer_problem(cfg, url))
            if problem:
                return "training.teacher.engine_urls", problem
        return None
    try:
        problem = tokenizer_match.compare(student_source(cfg), source)
    except tokenizer_match.TokenizerFilesMissing:
        return None
    except ValueError as exc:
        return "training.teacher", str(exc)
    if problem:
        return "training.teacher", f"the teacher's tokenizer differs from the student's: {problem}"
    return None


def remote_tokenizer_problem(cfg: RunConfig, url: str) -> str | None:
    """Why the teacher engine at `url` does not share the student's tokenizer, or None.

    Compared with the student's tokenizer files when they are here, else with the student's own
    engines (`model.engine_urls`, else the deployment's) over `/tokenize`
    (`app.training.tokenizer_remote`).  An engine that cannot be asked is a problem too: a
    teacher whose tokenizer cannot be compared is refused, never trusted."""
    from app.config import get_settings
    from app.training import tokenizer_remote

    teacher = tokenizer_remote.EngineTokenizer(url, cfg.training.teacher.name)
    try:
        try:
            facts = tokenizer_match.read_facts(tokenizer_match.tokenizer_dir(student_source(cfg)))
        except tokenizer_match.TokenizerFilesMissing:
            student_urls = cfg.model.engine_urls or get_settings().engine_urls
            student = tokenizer_remote.EngineTokenizer(student_urls[0], cfg.model.name, role="student")
            problem = tokenizer_remote.mismatch_between_engines(student, teacher)
        else:
            problem = tokenizer_remote.mismatch_with_files(facts, teacher)
    except (tokenizer_remote.TokenizerProbeError, ValueError) as exc:
        return str(exc)
    return f"the teacher's tokenizer differs from the student's: {problem}" if problem else None


def check_local_tokenizer(student_spec: str, teacher_spec: str) -> None:
    """Raise `TeacherError` when the two local models' tokenizers differ (the teacher worker's check)."""
    try:
        problem = tokenizer_match.compare(student_spec, teacher_spec)
    except (tokenizer_match.TokenizerFilesMissing, ValueError) as exc:
        raise TeacherError(f"cannot compare the teacher's tokenizer with the student's: {exc}") from exc
    if problem:
        raise TeacherError(f"the teacher's tokenizer differs from the student's: {problem}")
