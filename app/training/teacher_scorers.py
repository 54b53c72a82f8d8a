"""How the distillation teacher scores one chain: the two scorers and the checks of their values.

A scorer's `score(token_ids, loss_mask)` is the teacher's logprob (nats) of every token with
mask 1, 0.0 elsewhere: floats [T]; `score_top(token_ids, loss_mask, k)` adds the teacher's k
likeliest tokens at each such position (`ChainScore`).  `LocalScorer` loads the teacher's
weights in this process with the embedded engine's model code (`app.engines.modeling.load_model`)
and runs one fp32 forward per chain (`score_with_model`, `top_with_model`): deterministic on CPU,
so re-scoring reproduces stored values bit for bit.  `RemoteScorer` asks engines for vLLM's
`prompt_logprobs` on `POST /v1/completions` with the chain as a token-id prompt
(https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html; the embedded engine serves the
same field).  Every value passes `check_scores` / `check_top`: a NaN or positive logprob or a
length mismatch is a `TeacherError`.  What is scored, cached and stored is `app.training.teacher`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from app.runconfig import TeacherChoice
from app.training.teacher_check import TeacherError, parse_prompt_logprobs, parse_prompt_top


def teacher_spec(teacher: TeacherChoice) -> str:
    """The model spec the teacher's weights load from: its checkpoint folder, else its name.

    Raises `TeacherError` for a checkpoint that does not exist.
    """
    if teacher.checkpoint:
        from app.training.checkpoints import resolve_checkpoint

        try:
            return str(resolve_checkpoint(teacher.checkpoint)[0])
        except FileNotFoundError as exc:
            raise TeacherError(f"teacher cannot be loaded: {exc}") from exc
    return str(teacher.name)


@dataclass
class ChainScore:
    """A teacher's scores of one chain of T tokens: `logprobs` floats [T] (the sampled tokens',
    0.0 at loss-mask-0 positions); with k > 0 also `top_ids` ints [T][k] and `top_logprobs`
    floats [T][k] (nats, descending; zeros at loss-mask-0 positions), else both empty."""

    logprobs: list[float]
    top_ids: list[list[int]] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[float]] = dataclasses.field(default_factory=list)

    @property
    def top(self) -> int:
        return len(self.top_ids[0]) if self.top_ids else 0


def check_top(ids, values, token_ids, loss_mask, top: int, where: str) -> tuple[list[list[int]], list[list[float]]]:
    """`ids` [T][k] and `values` [T][k] checked: k per position, values finite logprobs <= 0
    (float32-rounded), zeros at loss-mask-0 positions.  Raises `TeacherError` otherwise."""
    if len(ids) != len(token_ids) or len(values) != len(token_ids):
        raise TeacherError(f"{where}: top-{top} teacher tokens for {len(ids)} positions, the chain has {len(token_ids)}")
    out_ids: list[list[int]] = []
    out_values: list[list[float]] = []
    for t, (row_ids, row_values, mask) in enumerate(zip(ids, values, loss_mask)):
        if not mask or t == 0:
            out_ids.append([0] * top)
            out_values.append([0.0] * top)
            continue
        if len(row_ids) != top or len(row_values) != top:
            raise TeacherError(f"{where}: {len(row_ids)} teacher tokens at position {t}, not the {top} asked for")
        row = np.asarray(row_values, dtype=np.float32).tolist()
        if not all(math.isfinite(v) and v <= 1e-4 for v in row):
            raise TeacherError(f"{where}: a top-{top} teacher logprob at position {t} is not a finite value <= 0: {row}")
        out_ids.append([int(i) for i in row_ids])
        out_values.append(row)
    return out_ids, out_values


def check_scores(values, token_ids, loss_mask, where: str) -> list[float]:
    """`values` as float32-rounded floats [T]; raises `TeacherError` when the length differs
    from `token_ids` or a scored value is not a finite logprob <= 0 (NaN included)."""
    if len(values) != len(token_ids):
        raise TeacherError(f"{where}: {len(values)} teacher logprobs for a chain of {len(token_ids)} tokens")
    out = np.asarray(values, dtype=np.float32)
    for i, (value, mask) in enumerate(zip(out.tolist(), loss_mask)):
        if mask and not (math.isfinite(value) and value <= 1e-4):
            raise TeacherError(f"{where}: the teacher's logprob of token {i} (id {token_ids[i]}) is {value!r}, "
                               f"not a finite value <= 0")
    return [v if m else 0.0 for v, m in zip(out.tolist(), loss_mask)]


class LocalScorer:
    """The teacher's weights in this process (fp32, CPU or CUDA): one forward per chain."""

    def __init__(self, spec: str, device=None):
        import torch

        from app.engines.modeling import load_model

        try:
            model, _tokenizer = load_model(spec)
        except (OSError, ValueError, RuntimeError) as exc:
            raise TeacherError(f"teacher {spec!r} cannot be loaded: {exc}") from exc
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # on the CPU it shares the box with the engine and the trainer: the cores they leave
        from app.training.threads import apply_cpu_threads

        apply_cpu_threads(device=self.device)
        self.model = model.to(self.device).eval()
        self.spec = spec
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])

    def score(self, token_ids, loss_mask) -> list[float]:
        """The teacher's logprob (nats) of every token with mask 1, 0.0 elsewhere: floats [T].

        Raises `TeacherError` for ids outside the teacher's vocabulary and bad values."""
        return check_scores(score_with_model(self.model, token_ids, loss_mask, self.device), token_ids, loss_mask,
                            f"teacher {self.spec}")

    def score_top(self, token_ids, loss_mask, top: int) -> ChainScore:
        """`score` and the teacher's `top` likeliest tokens at each mask-1 position (`ChainScore`).

        Raises `TeacherError` as `score`."""
        where = f"teacher {self.spec}"
        if any(not 0 <= int(i) < self.vocab_size for i in token_ids):
            raise TeacherError(f"{where}: a token id is outside the teacher's vocabulary of {self.vocab_size}")
        values, ids, top_values = top_with_model(self.model, token_ids, loss_mask, top, self.device)
        top_ids, top_values = check_top(ids, top_values, token_ids, loss_mask, top, where)
        return ChainScore(check_scores(values, token_ids, loss_mask, where), top_ids, top_values)


def score_with_model(model, token_ids, loss_mask, device=None) -> list[float]:
    """One fp32 prefill pass of a causal LM over `token_ids` (int [T]): log p(token_t | tokens_<t)
    at every position with `loss_mask` 1, 0.0 elsewhere (position 0 has no context: 0.0)."""
    import torch

    from app.training.policy import token_logprobs

    device = device or next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    positions = torch.tensor([i for i, m in enumerate(loss_mask) if m and i > 0], dtype=torch.long, device=device)
    out = [0.0] * len(token_ids)
    if positions.numel() == 0:
        return out
    with torch.no_grad():
        values = token_logprobs(model, ids, torch.ones_like(ids), torch.zeros_like(positions), positions - 1,
                                ids[0, positions]).float().cpu().tolist()
    for p, v in zip(positions.tolist(), values):
        out[p] = v
    return out


def top_with_model(model, token_ids, loss_mask, top: int, device=None, chunk: int = 256):
    """One fp32 prefill pass of a causal LM over `token_ids` (int [T]) giving, at every position
    with `loss_mask` 1 (but 0), log p(token_t | tokens_<t) and the `top` likeliest tokens there
    with their logprobs: (floats [T], ints [T][top], floats [T][top]), zeros elsewhere.  The LM
    head runs `chunk` positions at a time, so no [T, vocab] tensor exists."""
    import torch

    from app.training.policy import causal_lm

    device = device or next(model.parameters()).device
    lm = causal_lm(model)
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    positions = [i for i, m in enumerate(loss_mask) if m and i > 0]
    values = [0.0] * len(token_ids)
    top_ids = [[0] * top for _ in token_ids]
    top_values = [[0.0] * top for _ in token_ids]
    if not positions:
        return values, top_ids, top_values
    with torch.no_grad():
        hidden = lm.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        for start in range(0, len(positions), chunk):
            where = torch.tensor(positions[start:start + chunk], dtype=torch.long, device=device)
            logp = torch.log_softmax(lm.lm_head(hidden[where - 1]).float(), dim=-1)
            chosen = logp.gather(1, ids[0, where].unsqueeze(-1))[:, 0].cpu().tolist()
            best = logp.topk(top, dim=-1)
            for p, v, i, b in zip(where.tolist(), chosen, best.indices.cpu().tolist(), best.values.cpu().tolist()):
                # ties ordered as `parse_prompt_top` orders an engine's: by logprob, then id, descending
                ranked = sorted(zip(b, i), reverse=True)
                values[p], top_ids[p], top_values[p] = v, [x for _, x in ranked], [y for y, _ in ranked]
    return values, top_ids, top_values


class RemoteScorer:
    """Engines serving the teacher: `prompt_logprobs` of a token-id prompt (vLLM's shape:
    `choices[0].prompt_logprobs[t]` maps `str(id)` to `{"logprob", ...}`, None at t = 0)."""

    def __init__(self, teacher: TeacherChoice):
        from app.engines.client import EngineClient

        self.name = teacher.name
        self.clients = [EngineClient(url, timeout=teacher.timeout_s) for url in teacher.engine_urls]
        self.next = 0

    def score(self, token_ids, loss_mask) -> list[float]:
        from app.engines.errors import EngineCallError

        client = self.clients[self.next % len(self.clients)]
        self.next += 1
        body = {"model": self.name, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0}
        try:
            answer = client.request("POST", "/v1/completions", body)
        except EngineCallError as exc:
            raise TeacherError(f"teacher engine {client.base_url} cannot score: {exc}") from exc
        return check_scores(parse_prompt_logprobs(answer, token_ids, client.base_url), token_ids, loss_mask,
                            f"teacher engine {client.base_url}")

    def score_top(self, token_ids, loss_mask, top: int) -> ChainScore:
        """`score` with `prompt_logprobs: top`, keeping the `top` likeliest tokens per position
        (`ChainScore`).  Raises `TeacherError` as `score`, and when an engine returns fewer."""
        from app.engines.errors import EngineCallError

        client = self.clients[self.next % len(self.clients)]
        self.next += 1
        where = f"teacher engine {client.base_url}"
        body = {"model": self.name, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": top}
        try:
            answer = client.request("POST", "/v1/completions", body)
        except EngineCallError as exc:
            raise TeacherError(f"teacher engine {client.base_url} cannot score: {exc}") from exc
        values = parse_prompt_logprobs(answer, token_ids, client.base_url)
        ids, top_values = parse_prompt_top(answer, token_ids, loss_mask, top, client.base_url)
        ids, top_values = check_top(ids, top_values, token_ids, loss_mask, top, where)
        return ChainScore(check_scores(values, token_ids, loss_mask, where), ids, top_values)


_SCORERS: dict[tuple, object] = {}


def scorer_for(teacher: TeacherChoice):
    """The (process-resident) scorer of `teacher`: remote with `engine_urls`, else local."""
    key = (teacher.name, teacher.checkpoint, tuple(teacher.engine_urls))
    if key not in _SCORERS:
        _SCORERS.clear()  # one teacher resident at a time
        _SCORERS[key] = RemoteScorer(teacher) if teacher.engine_urls else LocalScorer(teacher_spec(teacher))
    return _SCORERS[key]
