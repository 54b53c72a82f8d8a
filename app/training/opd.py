"""On-policy distillation (OPD): a dense, per-token advantage from a teacher's logprobs.

The student samples with the unmodified harness through the gateway; the teacher prefill-scores
the exact ids it sampled (`app.training.teacher`).  Per sampled token t of a chain of episode i
(loss mask 1; prompt, tool-output, observation and template tokens have mask 0 and get 0):

    d_t = log pi_T(y_t | y_<t) - log pi_S,rollout(y_t | y_<t)          teacher - student (rollout)
    A_t = [algorithm has grpo] * A_i  +  opd_coef * sg(d_t)             sg = stop-gradient

A_t replaces the episode's single advantage A_i in the GRPO loss of `app.training.grpo`
(`policy_loss`: PPO ratio, clip-higher, TIS against the rollout logprobs) unchanged.  On policy
(ratio 1) the loss gradient is -sum_t w_t A_t grad log pi_S(y_t): with A_GRPO = 0 this is a
descent step on the per-token reverse KL, since
E_{y~pi_S}[(log pi_S(y) - log pi_T(y)) grad log pi_S(y)] = grad KL(pi_S || pi_T), the score-function
form of the reverse-KL gradient (per token, without the effect of a token on later tokens' terms).
Sign: a token the teacher likes more than the student did (d_t > 0) is pushed up.

* Thinking Machines Lab, "On-Policy Distillation" (Lu et al., 2025,
  https://thinkingmachines.ai/blog/on-policy-distillation/): per-token reverse KL to the
  teacher as the advantage of an importance-sampled policy-gradient loss, the teacher scoring
  the student's own samples.
* Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
  Mistakes" (GKD, arXiv:2306.13649): distillation on student-generated sequences, with the
  reverse KL among the divergences (§3, eq. 2-4).

d_t uses the *rollout* logprob (the engine's, recorded by the gateway), not the trainer's: the
advantage is a constant of the sampled data (its gradient is exactly 0), and it depends on the
sampled token y_t through both logprobs.  The reported reverse KL per token is the mean of
-d_t over the step's sampled tokens (the k1 estimate of KL(pi_S || pi_T) under the student's own
samples; Schulman 2020, joschu.net/blog/kl-approx.html); per turn it is the sum over one
completion's sampled tokens, averaged over completions.

pi_S is the policy that sampled: under a caller's sampling transform (temperature, top-k, top-p)
the recorded logprob is that of the transformed student (`app.engines.transform`), which is also
what the trainer's ratio and TIS score, while the teacher is scored untransformed.  The estimate
is then of KL(transformed student || teacher): at T < 1 a student whose sharpened samples match
the teacher is itself flatter than the teacher.  mini-swe-agent sends no temperature (T = 1, no
truncation), where the two coincide.

`opd_baseline: step_mean` subtracts b = opd_coef * mean_t(d_t), the mean over all the step's
sampled tokens, from every sampled token's A_t.  A baseline that does not depend on the sampled
token leaves the expected gradient unchanged, since E_{y~pi_S}[grad log pi_S(y)] = 0 (Williams
1992, "Simple statistical gradient-following algorithms", Machine Learning 8, §4; the KL-penalty
advantage of Thinking Machines' tinker-cookbook, `incorporate_kl_penalty`, is centred the same
way), but not its variance.  Why it matters here: a student far from its teacher has d_t < 0 on
nearly every token it samples, so without a baseline each step pushes down nearly every sampled
token and Adam's normalised step moves the mass onto tokens nobody sampled.  With the baseline,
tokens the teacher likes better than the step's average are pushed up, the rest down.  b is
computed from the step's own tokens (a bias of order 1/tokens, as in a group mean).  What it
does not do: give the student a token it never samples.  With b far below 0 the largest
advantages go to tokens both models are already sure of (copied text, repetition); on the CPU
demonstration (SmolLM2 student, warm-start teacher, docs/distill.md) the student collapsed onto
newlines within five steps at learning rate 1e-3 with the baseline, as it collapsed onto the
teacher's `<tool_call>` opening without it.

`opd_divergence: topk_forward_kl` (k = `opd_topk`) gives the student the teacher's distribution
at each sampled position instead of one number.  The teacher stores its k likeliest tokens
K_t with their logprobs; with p_T, p_S the teacher's and the student's full-vocabulary
probabilities and r = 1 - sum_{v in K_t} p(v) the mass each puts outside K_t, the loss adds,
per sampled position (loss mask 1, the student's own states),

    L_t = opd_coef * [ sum_{v in K_t} p_T(v) (log p_T(v) - log p_S(v))  +  r_T (log r_T - log r_S) ]

the forward KL(teacher || student) between the two distributions coarse-grained to the k
tokens and one bucket for the rest.  It is 0 exactly when the student matches the teacher on
K_t (then on the rest's total too), and never more than the full forward KL (the
data-processing inequality; Cover & Thomas, "Elements of Information Theory", §2.8), so a
teacher equal to the student gives no gradient, where a KL to the teacher renormalised over
K_t would sharpen the student onto K_t.  log p_S is the full log softmax of the student's
logits (`app.training.policy.token_logprobs`' `extra_targets`).  L_t is weighted by the
step's aggregation weights like the policy-gradient term, without PPO clipping or TIS (a
supervised term on states the student itself visited).  Its gradient raises every token of
K_t the student gives less than the teacher does, whether or not the student ever sampled
it, which the sampled-token estimator cannot: at a position where the teacher puts all its
mass on one token the student never samples, that estimator only pushes down what was
sampled.  A_t is then the GRPO part alone (0 for `opd`).  Sources: GKD (Agarwal et al. 2024,
arXiv:2306.13649, §3: on-policy data with a token-level divergence between the full
distributions, the forward KL among them); Hinton et al. 2015, "Distilling the Knowledge in
a Neural Network" (arXiv:1503.02531) for the teacher's distribution as the target.  The
stored score keeps k ids and logprobs per token (vLLM's `prompt_logprobs: k`).  The metric
`topk_forward_kl` (trainer) is the mean of L_t / opd_coef over the step's scored tokens.

A chain without a stored teacher score is never trained: `StepDistillation.sequence` drops it
and the share of such chains is a step metric (`opd.chains_unscored_fraction`, 0 in a healthy run).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from app.db import session_scope
from app.runconfig import TrainingConfig
from app.tables import Run, Trajectory
from app.training.batching import MicroBatch, StepSequence
from app.training.store import build_episode_trajectories
from app.training.teacher import chain_hash, score_key, stored_scores

log = logging.getLogger(__name__)


@dataclass
class OPDSequence(StepSequence):
    """A `StepSequence` whose advantage varies per token: `token_advantages` float [T], the
    A_t of the module docstring at loss-mask-1 positions and 0.0 elsewhere.  `advantage` holds
    the part that came from GRPO (for reports).  Under topk_forward_kl also `top_ids` int [T][k]
    and `top_logprobs` float [T][k], the teacher's k likeliest tokens at each position (empty
    otherwise)."""

    token_advantages: Sequence[float] = ()
    top_ids: Sequence[Sequence[int]] = ()
    top_logprobs: Sequence[Sequence[float]] = ()


def topk_forward_kl(student_logprobs: torch.Tensor, student_log_rest: torch.Tensor, teacher_logprobs: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor:
    """L_t / opd_coef of the module docstring per position: float32 [N] (nats, >= 0 up to rounding).

    `student_logprobs`: the student's full-vocabulary logprobs of the teacher's k tokens, float
    [N, k] (with grad); `student_log_rest`: log r_S, the log of the student's mass outside those
    k tokens, float [N] (with grad), computed from the logits (`token_logprobs`' third output),
    not as log(1 - sum p), which fp32 cannot resolve once r_S is below ~1e-7;
    `teacher_logprobs`: the teacher's logprobs of the same tokens, float [N, k] (detached
    here; r_T = 1 - their mass, clamped at 0 against rounding); `rows`: bool [N], False for
    positions without teacher tokens (they give 0).
    """
    teacher = teacher_logprobs.detach().float()
    inside = (teacher.exp() * (teacher - student_logprobs.float())).sum(-1)
    rest_teacher = (1.0 - teacher.exp().sum(-1)).clamp(min=0.0)
    rest = torch.special.xlogy(rest_teacher, rest_teacher) - rest_teacher * student_log_rest.float()
    return torch.where(rows, inside + rest, torch.zeros_like(inside))


def token_advantages(
    grpo_advantage: float,
    teacher_logprobs: Sequence[float] | torch.Tensor,
    rollout_logprobs: Sequence[float] | torch.Tensor,
    loss_mask: Sequence[int] | torch.Tensor,
    coef: float,
    include_grpo: bool,
) -> torch.Tensor:
    """A_t (float32 [T]) of one chain: see the module docstring.

    `teacher_logprobs`, `rollout_logprobs`: nats [T] (values at mask-0 positions are ignored);
    `loss_mask`: 0/1 [T].  The logprobs are detached (stop-gradient) even when they carry
    gradients.  Raises ValueError when the lengths differ.
    """
    teacher = torch.as_tensor(teacher_logprobs, dtype=torch.float32).detach()
    rollout = torch.as_tensor(rollout_logprobs, dtype=torch.float32).detach()
    mask = torch.as_tensor(loss_mask).bool()
    if not teacher.shape == rollout.shape == mask.shape:
        raise ValueError(f"teacher {tuple(teacher.shape)}, rollout {tuple(rollout.shape)} and mask "
                         f"{tuple(mask.shape)} logprobs must have one length")
    values = coef * (teacher - rollout)
    if include_grpo:
        values = values + float(grpo_advantage)
    return torch.where(mask, values, torch.zeros_like(values))


def subtract_baseline(sequences: Sequence[StepSequence], baseline: float) -> list[StepSequence]:
    """`sequences` with `baseline` (nats) taken off every `OPDSequence`'s advantage at its
    loss-mask-1 positions (mask-0 positions stay 0.0); other sequences are returned as they are.
    See the module docstring for why a constant baseline keeps the expected gradient."""
    if baseline == 0.0:
        return list(sequences)
    out: list[StepSequence] = []
    for seq in sequences:
        if isinstance(seq, OPDSequence):
            adv = [a - baseline if m else 0.0 for a, m in zip(seq.token_advantages, seq.loss_mask)]
            seq = dataclasses.replace(seq, token_advantages=adv)
        out.append(seq)
    return out


def apply_token_advantages(batches: list[MicroBatch], sequences: Sequence[StepSequence]) -> list[MicroBatch]:
    """Put each `OPDSequence`'s per-token advantages into the micro-batches built from `sequences`.

    A micro-batch holds, per sequence, its trainable tokens in position order (`sequence_index`
    says whose); those entries of `advantages` become the sequence's `token_advantages` at its
    loss-mask-1 positions.  Other sequences keep their episode advantage.  When a sequence has
    the teacher's top-k tokens, the micro-batch gets `teacher_top_ids` int64 [N, k],
    `teacher_top_logprobs` float32 [N, k] and `teacher_top_rows` bool [N] (False, with zero
    rows, for other sequences' tokens).  Raises ValueError when a
    micro-batch's targets are not the sequence's sampled ids in that order, or when its
    sequences carry different k.
    """
    for mb in batches:
        top_parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for i in mb.sequence_index.unique().tolist():
            seq = sequences[i]
            if not isinstance(seq, OPDSequence):
                continue
            mask = torch.as_tensor(list(seq.loss_mask)).bool()
            where = mb.sequence_index == i
            ids = torch.as_tensor(list(seq.token_ids), dtype=torch.long)[mask]
            if not torch.equal(mb.targets[where].cpu(), ids):
                raise ValueError(f"micro-batch targets of sequence {i} are not its sampled ids in order")
            mb.advantages[where] = torch.as_tensor(list(seq.token_advantages), dtype=torch.float32)[mask].to(
                mb.advantages.device)
            if seq.top_ids:
                top_parts.append((where.cpu(), torch.as_tensor([list(r) for r in seq.top_ids], dtype=torch.long)[mask],
                                  torch.as_tensor([list(r) for r in seq.top_logprobs], dtype=torch.float32)[mask]))
        if top_parts:
            ks = {part[1].shape[1] for part in top_parts}
            if len(ks) != 1:
                raise ValueError(f"sequences of one micro-batch carry different teacher top-k: {sorted(ks)}")
            n, k = mb.targets.numel(), ks.pop()
            top_ids = torch.zeros(n, k, dtype=torch.long)
            top_values = torch.zeros(n, k, dtype=torch.float32)
            rows = torch.zeros(n, dtype=torch.bool)
            for where, part_ids, part_values in top_parts:
                top_ids[where], top_values[where], rows[where] = part_ids, part_values, True
            device = mb.targets.device
            mb.teacher_top_ids = top_ids.to(device)
            mb.teacher_top_logprobs, mb.teacher_top_rows = top_values.to(device), rows.to(device)
    return batches


class StepDistillation:
    """The distillation part of one step's data: per chain, its teacher score -> `OPDSequence`.

    Built inside `step_sequences`' session with the run's `TrainingConfig`; `sequence` turns a
    chain's `StepSequence` into an `OPDSequence` (None when the chain has no teacher score: it
    is dropped), `metrics` reports the step's distillation figures.
    """

    def __init__(self, session, config: TrainingConfig):
        self.session = session
        self.config = config
        self.top = config.opd_top
        self.version = score_key(config.teacher, self.top)
        self.chains = 0
        self.unscored = 0
        self.tokens = 0
        self.gap_sum = 0.0  # sum of (rollout - teacher) over sampled tokens
        self.turn_kl: list[float] = []
        self.seconds: list[float] = []

    def sequence(self, row: Trajectory, base: StepSequence) -> OPDSequence | None:
        """`base` with per-token advantages from `row`'s teacher score, or None without one."""
        if not any(row.loss_mask):
            return None
        self.chains += 1
        score = stored_scores(self.session, [row], self.version).get(chain_hash(row.token_ids, row.loss_mask))
        if score is None:
            self.unscored += 1
            return None
        include = self.config.algorithm == "grpo+opd"
        teacher = torch.as_tensor(score.logprobs, dtype=torch.float32)
        rollout = torch.as_tensor(row.logprobs, dtype=torch.float32)
        mask = torch.as_tensor(row.loss_mask).bool()
        top_ids: list = []
        top_logprobs: list = []
        if self.top:  # forward KL to the teacher's top-k: A_t is the GRPO part alone
            if score.top_k != self.top or score.top_ids is None or score.top_logprobs is None:
                self.unscored += 1
                return None
            grpo = base.advantage if include else 0.0
            adv = torch.where(mask, torch.full_like(teacher, grpo), torch.zeros_like(teacher))
            top_ids = torch.as_tensor(list(score.top_ids), dtype=torch.long).view(-1, self.top).tolist()
            top_logprobs = torch.as_tensor(list(score.top_logprobs), dtype=torch.float32).view(-1, self.top).tolist()
        else:
            adv = token_advantages(base.advantage, score.logprobs, row.logprobs, row.loss_mask,
                                   self.config.opd_coef, include)
        gap = torch.where(mask, rollout - teacher, torch.zeros_like(rollout))
        self.tokens += int(mask.sum())
        self.gap_sum += float(gap.sum())
        for start, end in (row.meta or {}).get("spans") or [(0, len(row.token_ids))]:
            self.turn_kl.append(float(gap[start:end].sum()))
        self.seconds.append(float(score.seconds))
        return OPDSequence(base.token_ids, base.loss_mask, base.logprobs, base.advantage if include else 0.0,
                           base.episode_id, base.transform, policy_lag=base.policy_lag, token_lags=base.token_lags,
                           token_advantages=adv.tolist(), top_ids=top_ids, top_logprobs=top_logprobs)

    def baseline(self) -> float:
        """b of the module docstring (nats, times opd_coef): 0.0 unless `opd_baseline` is `step_mean`."""
        if self.config.opd_baseline != "step_mean" or not self.tokens:
            return 0.0
        return -self.config.opd_coef * self.gap_sum / self.tokens

    def finish(self, sequences: list[StepSequence]) -> list[StepSequence]:
        """`sequences` with the step's baseline taken off every `OPDSequence`'s sampled-token
        advantages (unchanged when `opd_baseline` is `none`).  Call once, after every chain went
        through `sequence`."""
        return subtract_baseline(sequences, self.baseline())

    def metrics(self) -> dict:
        """`reverse_kl_per_token`, `reverse_kl_per_turn` (nats), `tokens_scored`,
        `teacher_seconds_per_chain`, `chains_unscored_fraction`, `chains`, `teacher_version`,
        `baseline` (b, 0.0 without one)."""
        return {
            "baseline": self.baseline(),
            "reverse_kl_per_token": self.gap_sum / self.tokens if self.tokens else 0.0,
            "reverse_kl_per_turn": sum(self.turn_kl) / len(self.turn_kl) if self.turn_kl else 0.0,
            "tokens_scored": self.tokens,
            "teacher_seconds_per_chain": sum(self.seconds) / len(self.seconds) if self.seconds else 0.0,
            "chains_unscored_fraction": self.unscored / self.chains if self.chains else 0.0,
            "chains": self.chains,
            "teacher_version": self.version,
        }


class TeacherScoresMissing(RuntimeError):
    """A step's chains still lack teacher scores after `teacher.timeout_s`, or the run failed
    (a teacher error fails the run with its cause)."""


def wait_for_scores(run_id: int, step: int, episode_ids: list[int], config: TrainingConfig, vocab_size: int,
                    poll_s: float = 0.5) -> float:
    """Block until every trainable chain of `episode_ids` has a teacher score; return the seconds waited.

    The `teacher` worker writes the scores (`app.tasks.teacher`, sent with the training step).
    Raises `TeacherScoresMissing` naming the count after `config.teacher.timeout_s`, or with the
    run's error as soon as the run is no longer running.
    """
    started = time.monotonic()
    version = score_key(config.teacher, config.opd_top)
    while True:
        with session_scope() as s:
            missing, total = 0, 0
            for episode_id in episode_ids:
                rows, _ = build_episode_trajectories(s, episode_id, config.builder, vocab_size)
                rows = [r for r in rows if any(r.loss_mask)]
                total += len(rows)
                missing += len(rows) - len(stored_scores(s, rows, version))
            run = s.get(Run, run_id)
            status, error = run.status, run.error
        waited = time.monotonic() - started
        if not missing:
            return waited
        if status != "running":
            raise TeacherScoresMissing(f"run {run_id} is {status} while step {step} waited for teacher scores: {error}")
        if waited >= config.teacher.timeout_s:
            raise TeacherScoresMissing(
                f"{missing} of {total} chains of step {step} have no teacher score after {waited:.0f}s "
                f"(teacher {version}); is a `teacher` worker running (Procfile `teacher`, queue 'teacher')?")
        log.info("run=%s step=%s waiting for teacher scores: %s of %s chains", run_id, step, missing, total)
        time.sleep(poll_s)
