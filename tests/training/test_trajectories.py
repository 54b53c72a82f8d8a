"""Trajectory builders on hand-made completion sequences: exact ids, masks and logprobs."""
from __future__ import annotations

import pytest

from app.training.trajectories import CompletionRecord, build, per_request, prefix_merging, validate_completion

EOT, NL, BOS = 2, 10, 1  # end-of-turn, newline, start-of-turn in these hand-made ids
SYSTEM = [BOS, 50, 51, EOT, NL]
USER = [BOS, 52, 53, EOT, NL]


def rec(seq, prompt, sampled, logprobs, finish="stop", cid=None):
    return CompletionRecord(seq=seq, prompt_ids=prompt, sampled_ids=sampled, logprobs=logprobs,
                            finish_reason=finish, completion_id=cid if cid is not None else 100 + seq)


def tool_turn(*ids):
    """Template glue + a tool result: what the harness adds between two model calls."""
    return [EOT, NL, BOS, *ids, EOT, NL, BOS, 54] if ids else []


def three_turns():
    """Three calls; the engine includes EOT in call 1, stops without it in 2 (length) and 3."""
    p1 = SYSTEM + USER + [BOS, 54]
    s1, l1 = [60, 61, EOT], [-0.1, -0.2, -0.3]
    p2 = p1 + s1 + [NL, BOS, 70, 71, EOT, NL, BOS, 54]
    s2, l2 = [62, 63], [-0.4, -0.5]
    # Call 2 stopped on `length`: the template closes the turn with an EOT the engine never sampled.
    p3 = p2 + s2 + [EOT, NL, BOS, 72, EOT, NL, BOS, 54]
    s3, l3 = [64, EOT], [-0.6, -0.7]
    return [rec(1, p1, s1, l1), rec(2, p2, s2, l2, finish="length"), rec(3, p3, s3, l3)]


def test_prefix_merging_three_turns_exact_stream_mask_and_logprobs():
    records = three_turns()
    result = prefix_merging(records)
    assert len(result.sequences) == 1
    seq = result.sequences[0]
    p3, s3 = records[2].prompt_ids, records[2].sampled_ids
    assert seq.token_ids == p3 + s3  # exactly the last prompt + its sampled ids: nothing re-tokenized
    ctx = len(SYSTEM + USER) + 2
    expected_mask = [0] * ctx + [1, 1, 1] + [0] * 8 + [1, 1] + [0] * 8 + [1, 1]
    assert seq.loss_mask == expected_mask
    expected_lp = [0.0] * ctx + [-0.1, -0.2, -0.3] + [0.0] * 8 + [-0.4, -0.5] + [0.0] * 8 + [-0.6, -0.7]
    assert seq.logprobs == pytest.approx(expected_lp)
    # The EOT after the `length`-truncated call is template glue: mask 0, not a fake sampled token.
    first_glue_after_s2 = ctx + 3 + 8 + 2
    assert seq.token_ids[first_glue_after_s2] == EOT and seq.loss_mask[first_glue_after_s2] == 0
    assert seq.spans == [(ctx, ctx + 3), (ctx + 11, ctx + 13), (ctx + 21, ctx + 23)]
    assert seq.completions == [101, 102, 103]
    assert seq.finish_reasons == ["stop", "length", "stop"]
    r = result.report
    assert (r["completions"], r["chains"], r["completions_merged"], r["chains_cut"], r["rejected"]) == (3, 1, 2, 0, 0)
    assert r["tokens"] == len(p3) + 2 and r["trainable_tokens"] == 7


def test_per_request_same_calls_one_sequence_each():
    records = three_turns()
    result = per_request(records)
    assert [s.token_ids for s in result.sequences] == [list(r.prompt_ids) + list(r.sampled_ids) for r in records]
    assert result.sequences[1].loss_mask == [0] * len(records[1].prompt_ids) + [1, 1]
    assert result.sequences[1].logprobs == pytest.approx([0.0] * len(records[1].prompt_ids) + [-0.4, -0.5])
    assert result.report["chains"] == 3 and result.report["completions_merged"] == 0
    # The point of merging: the merged chain is far shorter than the per-request total.
    assert prefix_merging(records).report["tokens"] < result.report["tokens"]
    assert prefix_merging(records).report["trainable_tokens"] == result.report["trainable_tokens"]


def test_non_prefix_turn_rerendered_assistant_starts_new_chain():
    p1 = SYSTEM + USER
    r1 = rec(1, p1, [60, 61, 62], [-1.0, -1.1, -1.2], finish="length")
    # The harness re-sent call 1's text, which re-tokenized as [60, 99] instead of [60, 61, 62].
    p2 = p1 + [60, 99] + tool_turn(70)
    r2 = rec(2, p2, [63, EOT], [-2.0, -2.1])
    p3 = p2 + [63, EOT] + [NL, BOS, 71, EOT, NL, BOS, 54]
    r3 = rec(3, p3, [64], [-3.0])
    result = prefix_merging([r1, r2, r3])
    a, b = result.sequences
    assert a.token_ids == p1 + [60, 61, 62] and a.loss_mask == [0] * len(p1) + [1, 1, 1]
    assert b.token_ids == p3 + [64]
    assert b.loss_mask == [0] * len(p2) + [1, 1] + [0] * 7 + [1]
    assert b.logprobs == pytest.approx([0.0] * len(p2) + [-2.0, -2.1] + [0.0] * 7 + [-3.0])
    assert b.completions == [102, 103]
    r = result.report
    assert r["chains"] == 2 and r["completions_merged"] == 1 and r["chains_cut"] == 1
    assert r["cut_reasons"] == {"assistant_turn_rerendered": 1}
    assert r["new_chains"] == [{"completion": 102, "reason": "assistant_turn_rerendered",
                                "closest_chain": 0, "diverged_at": len(p1) + 1}]


def test_compaction_starts_new_chain_that_later_calls_extend():
    p1 = SYSTEM + USER
    r1 = rec(1, p1, [60, EOT], [-0.1, -0.2])
    p2 = p1 + [60, EOT] + [NL, BOS, 70, EOT, NL, BOS, 54]
    r2 = rec(2, p2, [61, EOT], [-0.3, -0.4])
    # Compaction: the history after the system prompt is replaced by a summary.
    p3 = SYSTEM + [BOS, 52, 80, 81, EOT, NL, BOS, 54]
    r3 = rec(3, p3, [62, EOT], [-0.5, -0.6])
    p4 = p3 + [62, EOT] + [NL, BOS, 71, EOT, NL, BOS, 54]
    r4 = rec(4, p4, [63, EOT], [-0.7, -0.8])
    result = prefix_merging([r1, r2, r3, r4])
    first, second = result.sequences
    assert first.token_ids == p2 + [61, EOT] and first.completions == [101, 102]
    assert second.token_ids == p4 + [63, EOT] and second.completions == [103, 104]
    assert second.loss_mask == [0] * len(p3) + [1, 1] + [0] * 7 + [1, 1]
    assert second.logprobs == pytest.approx([0.0] * len(p3) + [-0.5, -0.6] + [0.0] * 7 + [-0.7, -0.8])
    assert result.report["cut_reasons"] == {"context_diverged": 1}
    assert result.report["new_chains"][0]["diverged_at"] == len(SYSTEM) + 2  # [BOS, 52] still agree


def test_sub_agent_interleaved_with_parent_gives_two_chains():
    parent_sys = SYSTEM + USER
    sub_sys = [BOS, 90, 91, EOT, NL, BOS, 92, EOT, NL]
    P1 = rec(1, parent_sys, [60, EOT], [-0.1, -0.2])
    S1 = rec(2, sub_sys, [65, EOT], [-1.1, -1.2])
    p_p2 = parent_sys + [60, EOT] + [NL, BOS, 70, EOT, NL, BOS, 54]
    P2 = rec(3, p_p2, [61, EOT], [-0.3, -0.4])
    p_s2 = sub_sys + [65, EOT] + [NL, BOS, 95, EOT, NL, BOS, 54]
    S2 = rec(4, p_s2, [66], [-1.3], finish="length")
    p_p3 = p_p2 + [61, EOT] + [NL, BOS, 71, 72, EOT, NL, BOS, 54]  # sub-agent's answer as a tool result
    P3 = rec(5, p_p3, [62, EOT], [-0.5, -0.6])
    result = prefix_merging([P1, S1, P2, S2, P3])
    parent, sub = result.sequences
    assert parent.completions == [101, 103, 105] and sub.completions == [102, 104]
    assert parent.token_ids == p_p3 + [62, EOT]
    assert parent.loss_mask == [0] * len(parent_sys) + [1, 1] + [0] * 7 + [1, 1] + [0] * 8 + [1, 1]
    assert sub.token_ids == p_s2 + [66]
    assert sub.loss_mask == [0] * len(sub_sys) + [1, 1] + [0] * 7 + [1]
    assert sub.logprobs == pytest.approx([0.0] * len(sub_sys) + [-1.1, -1.2] + [0.0] * 7 + [-1.3])
    r = result.report
    assert (r["chains"], r["completions_merged"], r["chains_cut"]) == (2, 3, 1)
    assert r["cut_reasons"] == {"context_diverged": 1} and r["new_chains"][0]["diverged_at"] == 1


def test_retry_branches_and_longest_stream_wins():
    p1 = SYSTEM + USER
    r1 = rec(1, p1, [60, 61], [-0.1, -0.2], finish="length")
    # The harness retried the same prompt with a larger max_tokens; the sample is longer.
    r2 = rec(2, p1, [60, 61, 62, EOT], [-0.1, -0.2, -0.3, -0.4])
    p3 = p1 + [60, 61, 62, EOT] + [NL, BOS, 70, EOT, NL, BOS, 54]
    r3 = rec(3, p3, [63], [-0.5])
    result = prefix_merging([r1, r2, r3])
    short, long = result.sequences
    assert short.completions == [101] and long.completions == [102, 103]
    assert long.token_ids == p3 + [63]
    assert result.report["cut_reasons"] == {"branched": 1}


def test_rejected_captures_are_counted_and_their_tokens_become_context():
    p1 = SYSTEM + USER
    r1 = rec(1, p1, [60, EOT], [-0.1, -0.2])
    p2 = p1 + [60, EOT] + [NL, BOS, 70, EOT, NL, BOS, 54]
    r2 = rec(2, p2, [61, EOT], None)  # logprobs were not captured
    p3 = p2 + [61, EOT] + [NL, BOS, 71, EOT, NL, BOS, 54]
    r3 = rec(3, p3, [62, EOT], [-0.5, -0.6])
    bad = [
        rec(4, [], [1], [-0.1]),
        rec(5, p1, [], []),
        rec(6, p1, [60, 61], [-0.1]),
        rec(7, p1, [60, 500], [-0.1, -0.2]),
        rec(8, p1, [60], [float("nan")]),
    ]
    result = prefix_merging([r1, r2, r3, *bad], vocab_size=100)
    (seq,) = result.sequences
    assert seq.completions == [101, 103]
    # Call 2's sampled ids stay in the stream (call 3 saw them) but carry no loss or logprob.
    assert seq.loss_mask == [0] * len(p1) + [1, 1] + [0] * (7 + 2 + 7) + [1, 1]
    assert seq.logprobs == pytest.approx([0.0] * len(p1) + [-0.1, -0.2] + [0.0] * 16 + [-0.5, -0.6])
    r = result.report
    assert (r["completions"], r["accepted"], r["rejected"]) == (8, 2, 6)
    assert r["rejected_reasons"] == {
        "missing_logprobs": 1, "missing_prompt_ids": 1, "empty_sampled_ids": 1,
        "logprobs_length_mismatch": 1, "token_id_out_of_vocab": 1, "invalid_logprob": 1,
    }
    assert sorted(result.rejected) == [1, 3, 4, 5, 6, 7]
    assert result.rejected[5] == "logprobs_length_mismatch: len(logprobs)=1 != len(sampled_ids)=2"


def test_validate_accepts_good_capture_and_build_rejects_unknown_builder():
    assert validate_completion(rec(1, [1, 2], [3], [-0.5]), vocab_size=10) is None
    assert validate_completion(rec(1, [1, 2], [3], [0.7])).startswith("invalid_logprob")
    with pytest.raises(ValueError, match="unknown trajectory builder 'tree'"):
        build("tree", [])
