"""The run page's per-step curves: which metrics of `TrainingStep.metrics` are charted, and how.

A chart is {id, title, x: [step], series: [{label, values}], band, range, not_computed}.
`values` hold None where a step has no value: the metric is absent (never recorded) or was
not computed (KL with `kl_coef` 0, the importance-weight terms without a weight, every loss term of a
step whose batches held no trainable token).  The browser shows None as "not computed",
never as a measured 0: the trainer writes 0.0 for such terms, so the zero is replaced here.
`range` [0, 1] pins the y axis of rates and rewards, so a 4% dip does not fill the chart.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from app.tables import TrainingStep

Metrics = dict[str, Any]
RATE = (0.0, 1.0)

# Metrics the trainer's update computes (`Trainer.update`): none of them exists for a step whose
# batches held no trainable token (`optimizer_updates` 0; the trainer still writes loss 0.0).
OFF_POLICY = ("tokens_masked_fraction", "sequences_masked_fraction", "ratio_min", "ratio_p01", "ratio_p50",
              "ratio_p99", "ratio_max", "weight_ess_fraction", "logprob_gap_lag0_mean_abs",
              "logprob_gap_lag1_mean_abs", "logprob_gap_lag2plus_mean_abs")
UPDATE_METRICS = {"loss", "kl", "clip_fraction", "grad_norm", "tis_weight_mean", "tis_truncated_fraction",
                  "ratio_mean", "logprob_gap_max_abs", "logprob_gap_mean_abs", "logprob_gap_stale_max_abs",
                  *(f"off_policy.{name}" for name in OFF_POLICY)}


def metric(m: Metrics | None, path: str) -> float | None:
    """`m[a][b]` for path `a.b` as a float; None when absent, not a number (bools are not numbers) or
    not finite: a NaN loss is not a value to draw, and NaN is not JSON (the page's chart data would not parse)."""
    node: Any = m or {}
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if not isinstance(node, (int, float)) or isinstance(node, bool) or not math.isfinite(node):
        return None
    return float(node)


def not_computed(config: dict, path: str) -> str | None:
    """Why the run never computes metric `path` (its config turns the term off), or None."""
    training = (config or {}).get("training") or {}
    if path == "kl" and not training.get("kl_coef"):
        return "kl_coef is 0"
    if path in ("tis_weight_mean", "tis_truncated_fraction", "off_policy.weight_ess_fraction"):
        chosen = training.get("off_policy_correction") or ["token_tis"]  # runs stored before it: token TIS
        if "seq_tis" not in chosen and ("token_tis" not in chosen or training.get("tis_cap", 2.0) is None):
            return "no importance weight (off_policy_correction has no token_tis or seq_tis, or tis_cap is unset)"
    return None


def _staleness_mean(m: Metrics | None) -> float | None:
    hist = ((m or {}).get("scheduling") or {}).get("staleness_hist") or {}
    n = sum(hist.values())
    return sum(int(k) * v for k, v in hist.items()) / n if n else None


def _reward_edge(sign: int) -> Callable[[Metrics | None], float | None]:
    """mean ± std of the step's rewards, kept inside [0, 1] (rewards of binary tests cannot leave it)."""
    def edge(m: Metrics | None) -> float | None:
        mean, std = metric(m, "reward_mean"), metric(m, "reward_std")
        return None if mean is None or std is None else min(1.0, max(0.0, mean + sign * std))
    return edge


def _per_episode(path: str) -> Callable[[Metrics | None], float | None]:
    def value(m: Metrics | None) -> float | None:
        total, episodes = metric(m, path), metric(m, "episodes")
        return total / episodes if total is not None and episodes else None
    return value


Series = list[tuple[str, str | Callable[[Metrics | None], float | None]]]

# (title, series, options): `band` shades between series 2 and 3; `range` pins the y axis.
CHARTS: list[tuple[str, Series, dict]] = [
    ("reward (mean ± std)", [("mean", "reward_mean"), ("mean - std", _reward_edge(-1)),
                             ("mean + std", _reward_edge(1))], {"band": True, "range": RATE}),
    ("resolved rate", [("resolved", "resolved_rate")], {"range": RATE}),
    ("groups with no signal (fraction)", [("zero advantage", "zero_advantage_group_fraction")], {"range": RATE}),
    ("advantages", [("mean", "advantage_mean"), ("std", "advantage_std"), ("min", "advantage_min"),
                    ("max", "advantage_max")], {}),
    ("loss", [("loss", "loss")], {}),
    ("KL", [("kl", "kl")], {}),
    ("clip fraction", [("clip fraction", "clip_fraction")], {"range": RATE}),
    ("grad norm (before clipping)", [("grad norm", "grad_norm")], {}),
    ("TIS truncated fraction", [("truncated", "tis_truncated_fraction")], {"range": RATE}),
    ("TIS weight / PPO ratio (mean)", [("TIS weight", "tis_weight_mean"), ("ratio", "ratio_mean")], {}),
    ("trainer vs rollout logprob gap (nats)", [("max |Δ| on-policy", "logprob_gap_max_abs"),
                                               ("mean |Δ| on-policy", "logprob_gap_mean_abs"),
                                               ("max |Δ| older weights", "logprob_gap_stale_max_abs")], {}),
    # Off-policy correction (training.off_policy_correction; app.training.correction), always measured.
    ("off-policy masked (fraction)", [("tokens", "off_policy.tokens_masked_fraction"),
                                      ("chains", "off_policy.sequences_masked_fraction")], {"range": RATE}),
    ("off-policy ratio exp(old - rollout)", [("min", "off_policy.ratio_min"), ("p01", "off_policy.ratio_p01"),
                                             ("p50", "off_policy.ratio_p50"), ("p99", "off_policy.ratio_p99"),
                                             ("max", "off_policy.ratio_max")], {}),
    ("off-policy weights: effective sample size (fraction)", [("ESS", "off_policy.weight_ess_fraction")],
     {"range": RATE}),
    ("logprob gap by lag (mean |Δ|, nats)", [("lag 0", "off_policy.logprob_gap_lag0_mean_abs"),
                                             ("lag 1", "off_policy.logprob_gap_lag1_mean_abs"),
                                             ("lag 2+", "off_policy.logprob_gap_lag2plus_mean_abs")], {}),
    ("response length (sampled tokens per episode)", [("sampled", _per_episode("merge.trainable_tokens"))], {}),
    ("entropy", [("entropy", "entropy")], {}),
    ("tokens trained", [("trained", "tokens_trained"), ("processed", "tokens_processed")], {}),
    ("step time (s)", [("step", "step_time_s"), ("update", "update_time_s"), ("checkpoint", "checkpoint_time_s"),
                       ("engine sync", "engine_sync_time_s")], {}),
    ("prefix merging", [("completions", "merge.completions"), ("merged", "merge.completions_merged"),
                        ("chains", "merge.chains"), ("cut", "merge.chains_cut"), ("rejected", "merge.rejected")], {}),
    ("trainer busy / rollout slots", [("trainer busy", "scheduling.trainer_busy_fraction"),
                                      ("slot occupancy", "scheduling.rollout_slot_occupancy")], {"range": RATE}),
    ("queue waits (s)", [("READY p50", "scheduling.ready_wait_s.p50"), ("READY max", "scheduling.ready_wait_s.max"),
                         ("gpu queue", "scheduling.gpu_queue_wait_s")], {}),
    ("staleness (policy versions)", [("mean", _staleness_mean)], {}),
    # On-policy distillation (training.algorithm opd / grpo+opd; app.training.opd).
    ("reverse KL to the teacher (nats)", [("per token", "opd.reverse_kl_per_token"),
                                          ("per turn", "opd.reverse_kl_per_turn")], {}),
    ("forward KL to the teacher's top-k (nats; opd_divergence topk_forward_kl)",
     [("per token", "topk_forward_kl")], {}),
    ("teacher: tokens scored", [("scored", "opd.tokens_scored")], {}),
    ("teacher: seconds per chain", [("scoring", "opd.teacher_seconds_per_chain"), ("step wait", "opd.teacher_wait_s")],
     {}),
    ("chains without teacher scores (fraction, must be 0)", [("unscored", "opd.chains_unscored_fraction")],
     {"range": RATE}),
]


def _value(m: Metrics | None, how, config: dict) -> float | None:
    if callable(how):
        return how(m)
    if not_computed(config, how) is not None:
        return None
    if how in UPDATE_METRICS and metric(m, "optimizer_updates") == 0:
        return None
    return metric(m, how)


def step_charts(steps: list[TrainingStep], config: dict | None = None) -> tuple[list[dict], list[str]]:
    """Per-step curves of the completed steps: (charts, titles of metrics this run never recorded).

    A chart whose series are all None because the config turns the metric off is still shown,
    with `not_computed` saying why, so a reader never takes its absence for a zero.
    """
    config = config or {}
    done = [st for st in steps if st.status == "completed"]
    x = [st.step for st in done]
    charts, missing = [], []
    for index, (title, spec, opts) in enumerate(CHARTS):
        series, reasons = [], []
        for label, how in spec:
            values = [_value(st.metrics, how, config) for st in done]
            reason = None if callable(how) else not_computed(config, how)
            if reason:
                reasons.append(reason)
            if any(v is not None for v in values) or reason:
                series.append({"label": label, "values": values})
        if not series or not done:
            missing.append(title)
            continue
        empty = all(v is None for s in series for v in s["values"])
        pinned = opts.get("range")
        if pinned and any(v is not None and not pinned[0] <= v <= pinned[1] for s in series for v in s["values"]):
            pinned = None  # a reward outside [0, 1] (a verifier's own scale): let the axis fit it
        charts.append({"id": f"chart-{index}", "title": title, "x": x, "series": series,
                       "band": bool(opts.get("band")) and len(series) == 3,
                       "range": list(pinned) if pinned else None,
                       "not_computed": "; ".join(sorted(set(reasons))) if empty and reasons else None})
    return charts, missing
