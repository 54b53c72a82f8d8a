"""Per-token policy versions through trajectory building: a chain whose completions cross an
in-flight weight update keeps each token's version, and the step's lags are per token."""
from __future__ import annotations

from types import SimpleNamespace

from app import versions
from app.training.steps import policy_lag, token_lags
from app.training.trajectories import CompletionRecord, prefix_merging


def _meta(seq) -> dict:
    """The trajectory meta `app.training.store` writes for a built sequence."""
    meta = {"spans": [list(s) for s in seq.spans], "policy_versions": seq.policy_versions}
    if any(seq.version_runs):
        meta["version_runs"] = seq.version_runs
    return meta


def test_a_chain_across_an_update_carries_every_tokens_version_and_lag():
    first = CompletionRecord(seq=0, prompt_ids=[1, 2, 3], sampled_ids=[10, 11, 12, 13], logprobs=[-0.1] * 4,
                             policy_version=4, policy_versions=[[0, 4], [2, 5]])   # update after 2 tokens
    second = CompletionRecord(seq=1, prompt_ids=[1, 2, 3, 10, 11, 12, 13, 7, 8], sampled_ids=[20, 21],
                              logprobs=[-0.2] * 2, policy_version=5, policy_versions=[[0, 5]])
    seq = prefix_merging([first, second]).sequences[0]
    assert seq.spans == [(3, 7), (9, 11)] and seq.version_runs == [[[0, 4], [2, 5]], None]
    row = SimpleNamespace(token_ids=seq.token_ids, meta=_meta(seq))
    lags = token_lags(row, 6)
    #            prompt     first's 4 tokens  glue  second's 2
    assert lags == [0, 0, 0, 2, 2, 1, 1, 0, 0, 1, 1]
    assert policy_lag(row, 6) == 2  # staleness: the oldest token the chain trains on


def test_chains_of_one_version_keep_the_sequence_lag_and_old_rows_read_as_before():
    record = CompletionRecord(seq=0, prompt_ids=[1], sampled_ids=[5, 6], logprobs=[-1.0, -1.0], policy_version=3,
                              policy_versions=[[0, 3]])
    seq = prefix_merging([record]).sequences[0]
    row = SimpleNamespace(token_ids=seq.token_ids, meta=_meta(seq))
    assert "version_runs" not in row.meta and token_lags(row, 5) is None and policy_lag(row, 5) == 2
    old = SimpleNamespace(token_ids=[1, 5, 6], meta={"spans": [[1, 3]], "policy_versions": [3]})  # stored before
    assert token_lags(old, 5) is None and policy_lag(old, 5) == 2


def test_run_length_encoding_round_trips_and_rejects_malformed_runs():
    per_token = [0, 0, 1, 1, 1, 3]
    runs = versions.encode(per_token)
    assert runs == [[0, 0], [2, 1], [5, 3]] and versions.expand(runs, 6, None) == per_token
    assert versions.valid(runs, 6) and not versions.valid(runs, 5)   # a run starting past the end
    for bad in ([], [[1, 0]], [[0, 0], [0, 1]], [[0, -1]], [[0, True]], "x", [[0, 1, 2]]):
        assert not versions.valid(bad, 6), bad
    assert versions.expand(None, 3, 7) == [7, 7, 7] and versions.oldest(runs, None) == 0
    # vLLM: chunks stamped by arrival against the recorded pauses' split times
    arrivals = [(0, 10.0), (1, 11.0), (2, 13.0), (3, 14.0)]
    assert versions.from_arrivals(arrivals, 5, [(1, 5.0), (2, 12.0)], 0) == [[0, 1], [2, 2]]
    assert versions.from_arrivals(arrivals, 5, [], 9) == [[0, 9]]
