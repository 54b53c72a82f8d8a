"""In-flight weight updates on the embedded engine's scheduler (in process, tiny model).

Each test runs real forward passes: a request is streaming when new weights arrive, and the
recorded logprob of every token is checked against a fresh recompute under the weights its
event names.  Where the update lands (after which token) is up to the scheduler thread; the
checks hold wherever it lands, and each test asserts that it landed inside the request.
"""
from __future__ import annotations

import queue
import threading

import pytest
import torch

from app.engines.embedded.batching import BatchScheduler
from app.engines.embedded.events import Aborted, GenerationRequest, Started, TokenEvent
from app.engines.embedded.sampling import SamplingParams
from app.engines.modeling import build_tiny_model

PROMPT = [1, 17, 42, 99, 7, 300, 12]
LONG = 1500  # tokens: the update lands long before a request this long ends


def perturbed(seed: int):
    model = build_tiny_model(0)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def logprobs_under(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | prompt + ids[:t]) under `model`, one full forward (fresh KV)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(ids)[:, None])[:, 0]


def events_of(request: GenerationRequest, timeout: float = 300.0) -> list:
    out = []
    while True:
        event = request.events.get(timeout=timeout)
        out.append(event)
        if isinstance(event, Aborted) or (isinstance(event, TokenEvent) and event.finish_reason is not None):
            return out


@pytest.fixture()
def scheduler():
    sched = BatchScheduler(build_tiny_model(0), max_batch=4, prefill_chunk=64, prefix_cache_tokens=0).start()
    yield sched
    sched.stop()


def submit(sched: BatchScheduler, max_tokens: int = LONG, seed: int = 3) -> GenerationRequest:
    return sched.submit(GenerationRequest(list(PROMPT), max_tokens, SamplingParams(temperature=1.0, seed=seed)))


def first_token(request: GenerationRequest) -> list:
    """Events up to and including the first token (the request is running then)."""
    seen = []
    while not seen or not isinstance(seen[-1], TokenEvent):
        seen.append(request.events.get(timeout=300))
    return seen


def split(events: list) -> tuple[list[int], list[float], list[int], list[int]]:
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    return ([e.sample.token_id for e in tokens], [e.sample.logprob for e in tokens],
            [e.policy_version for e in tokens], [e.kv_version for e in tokens])


def test_keep_update_lands_between_decode_steps_and_each_token_is_sampled_by_its_version(scheduler):
    """`keep` with recompute_kv: the running request is not drained; tokens before the update
    carry version 0 and match the old weights, tokens after carry 1 and match the new weights
    over the whole context (the KV was recomputed), to float rounding."""
    new = perturbed(11)
    req = submit(scheduler)
    head = first_token(req)
    assert scheduler.reload(new.state_dict(), 1, mode="keep", recompute_kv=True) == 1
    events = head + events_of(req)
    ids, lps, versions, kvs = split(events)
    assert isinstance(events[0], Started) and events[0].policy_version == 0
    switch = versions.index(1)
    assert 0 < switch < len(ids), "the update did not land inside the request"
    assert versions == [0] * switch + [1] * (len(ids) - switch)   # one switch, never back
    assert kvs == versions                                         # KV recomputed: same version
    assert events[-1].finish_reason == "length" and len(ids) == LONG  # not cut, not drained early
    lps = torch.tensor(lps)
    old_gap = (logprobs_under(build_tiny_model(0), PROMPT, ids[:switch]) - lps[:switch]).abs().max().item()
    new_gap = (logprobs_under(new, PROMPT, ids)[switch:] - lps[switch:]).abs().max().item()
    stale_gap = (logprobs_under(build_tiny_model(0), PROMPT, ids)[switch:] - lps[switch:]).abs().max().item()
    print(f"keep+recompute at token {switch}: |old| {old_gap:.2e}, |new| {new_gap:.2e}, new vs old weights {stale_gap:.2e}")
    assert old_gap < 1e-4 and new_gap < 1e-4
    assert stale_gap > 1e-2  # the perturbation shows, so the checks above can fail
    assert scheduler.load()["reloads_keep"] == 1 and scheduler.stats["recompute_tokens"] >= len(PROMPT) + switch - 1


def test_keep_without_recompute_keeps_the_stale_kv_and_says_so(scheduler):
    """`keep` with recompute_kv false: tokens after the update are sampled by version 1 but
    attended to KV that version 0 computed: their kv_version stays 0, and their logprobs are not
    those of the new weights over a fresh context."""
    new = perturbed(12)
    req = submit(scheduler)
    head = first_token(req)
    scheduler.reload(new.state_dict(), 1, mode="keep", recompute_kv=False)
    ids, lps, versions, kvs = split(head + events_of(req))
    switch = versions.index(1)
    assert 0 < switch < len(ids)
    assert kvs == [0] * len(ids)
    assert scheduler.stats["recompute_tokens"] == 0
    fresh = (logprobs_under(new, PROMPT, ids)[switch:] - torch.tensor(lps[switch:])).abs().max().item()
    assert fresh > 1e-3, "a stale KV cache should move the logprobs away from a fresh recompute"


def test_wait_update_drains_first_and_abort_ends_running_requests(scheduler):
    """`wait`: the running request ends on version 0 before the weights change. `abort`: the
    running request ends now with an Aborted event after the tokens it had; the next request is
    served by the new version."""
    req = submit(scheduler, max_tokens=200)
    head = first_token(req)
    done = threading.Thread(target=lambda: scheduler.reload(perturbed(13).state_dict(), 1, mode="wait"))
    done.start()
    events = head + events_of(req)
    done.join(300)
    assert set(split(events)[2]) == {0} and len(split(events)[0]) == 200
    assert scheduler.policy_version == 1

    req = submit(scheduler)
    head = first_token(req)
    scheduler.reload(perturbed(14).state_dict(), 2, mode="abort")
    events = head + events_of(req)
    assert isinstance(events[-1], Aborted) and events[-1].policy_version == 2
    sampled = split(events)[0]
    assert 1 <= len(sampled) < LONG and set(split(events)[2]) == {1}
    assert scheduler.stats["aborted_requests"] == 1
    after = events_of(submit(scheduler, max_tokens=3))
    assert split(after)[2] == [2, 2, 2]


def test_failed_load_under_keep_leaves_the_old_weights_serving(scheduler):
    """A state dict that does not fit raises to the caller; the running request goes on, all of
    it on version 0, matching the old weights."""
    req = submit(scheduler, max_tokens=300)
    head = first_token(req)
    bad = {k: torch.zeros(3) for k in build_tiny_model(0).state_dict()}
    with pytest.raises(Exception):
        scheduler.reload(bad, 1, mode="keep")
    ids, lps, versions, _ = split(head + events_of(req))
    assert set(versions) == {0} and len(ids) == 300 and scheduler.policy_version == 0
    assert (logprobs_under(build_tiny_model(0), PROMPT, ids) - torch.tensor(lps)).abs().max().item() < 1e-4


def test_unknown_update_mode_is_refused_before_anything_changes(scheduler):
    with pytest.raises(ValueError, match="unknown weight update mode 'pause'"):
        scheduler.reload(perturbed(15).state_dict(), 1, mode="pause")
    assert scheduler.policy_version == 0 and scheduler.stats["reloads"] == 0
    with pytest.raises(ValueError, match="keep, wait, abort"):
        BatchScheduler(build_tiny_model(0), update_mode="later")


def test_keep_update_with_a_full_batch_and_a_queue_resumes_every_request(scheduler):
    """Four running requests (the batch is full) and two waiting: after a `keep` update each
    running one continues to its end with one version switch, the waiting ones start on the new
    version, and nothing is lost."""
    new = perturbed(16)
    running = [submit(scheduler, max_tokens=400, seed=s) for s in range(4)]
    heads = [first_token(r) for r in running]
    waiting = [submit(scheduler, max_tokens=20, seed=10 + s) for s in range(2)]
    scheduler.reload(new.state_dict(), 1, mode="keep")
    for req, head in zip(running, heads):
        ids, lps, versions, _ = split(head + events_of(req))
        assert len(ids) == 400 and versions == sorted(versions) and versions[0] == 0
        switch = versions.index(1) if 1 in versions else len(ids)
        assert (logprobs_under(new, PROMPT, ids)[switch:] - torch.tensor(lps[switch:])).abs().max().item() < 1e-4
    for req in waiting:
        ids, _, versions, _ = split(events_of(req))
        assert len(ids) == 20 and set(versions) == {1}
    with pytest.raises(queue.Empty):
        running[0].events.get_nowait()
