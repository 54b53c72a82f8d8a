"""Continuous-batching scheduler of the embedded engine (one background thread owns the model).

Requests are admitted into a running batch at token boundaries (continuous batching,
Orca, Yu et al. OSDI'22, https://www.usenix.org/conference/osdi22/presentation/yu).  Each new
request is prefilled alone in chunks of ``prefill_chunk`` tokens (one chunk per scheduler
iteration, interleaved with decode steps so running requests keep streaming), then its
KV cache is left-padded and concatenated onto the batch cache.  Every decode step runs
one forward pass for all running rows with a 2-D padding mask and explicit per-row
position ids, so a row's numbers do not depend on its neighbours beyond float rounding.
Finished or cancelled rows are removed with ``index_select`` and all-padding columns on
the left are trimmed.

Weight reload (``reload``), in one of three weight update modes:

* ``keep`` (in-flight update): the new state dict is copied in at the top of the next loop
  iteration, i.e. between two decode steps, and the version bumped.  Running requests keep
  their place and sample their next tokens from the new weights.  With ``recompute_kv`` their
  context (prompt + tokens sampled so far) is prefilled again under the new weights before they
  decode on (their KV then matches the weights that sample); without it their KV cache stays as
  the old weights computed it (a partial rollout: each token then records the oldest version of
  the KV it attended to, ``TokenEvent.kv_version``).  Requests still prefilling restart their
  prefill under the new weights (with ``recompute_kv``) or continue it.  New requests wait only
  for the copy itself.  This is vLLM's ``pause_generation(mode="keep")``
  (https://docs.vllm.ai/en/latest/training/async_rl/), done inside the engine loop.
* ``wait`` (drain): new admissions stop, running requests finish on the old weights, then the
  weights are copied in; requests that arrived meanwhile run on the new weights.
* ``abort``: running and prefilling requests end now with what they sampled so far
  (``Aborted``, finish_reason "abort" on the wire, as vLLM's ``mode=abort``), then the weights are
  copied in.

Every ``TokenEvent`` carries the policy version of the weights that sampled it, so a completion
that spans an update is stamped per token, never from timestamps.

What a caller submits (``GenerationRequest``) and the events it gets back are
``app.engines.embedded.events``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from app.engines.embedded import adapters
from app.engines.modeling import load_state_into
from app.engines.embedded.events import Aborted, Failed, GenerationRequest, Started, TokenEvent
from app.engines.embedded.prefix_cache import PrefixCache
from app.engines.embedded.routes import RouteTap, joined
from app.engines.embedded.sampling import TokenSample, sample_batch
from app.runconfig import WEIGHT_UPDATE_MODES

log = logging.getLogger(__name__)


def check_update_mode(mode: str) -> str:
    """``mode`` if it is a weight update mode (``WEIGHT_UPDATE_MODES``); else ValueError naming them."""
    if mode not in WEIGHT_UPDATE_MODES:
        raise ValueError(f"unknown weight update mode {mode!r}; choose one of {', '.join(WEIGHT_UPDATE_MODES)}")
    return mode


@dataclass(eq=False)
class _Reload:
    """A reload asked for and not yet applied (``BatchScheduler.reload``)."""

    state: dict
    policy_version: int
    weights: str | None
    mode: str
    recompute_kv: bool
    done: threading.Event
    box: dict
    asked: float  # perf_counter when asked


@dataclass(eq=False)
class _Row:
    request: GenerationRequest
    cache: DynamicCache | None = None  # own cache while prefilling
    prefilled: int = 0                 # prompt tokens already in the KV cache (while prefilling)
    num_tokens: int = 0                # real tokens in the KV cache once running
    last_token: int = -1               # sampled, not yet in the cache
    generated: int = 0
    tokens: list[int] = field(default_factory=list)  # prompt + sampled ids (for the prefix cache)
    context: list[int] | None = None   # ids to prefill: the prompt (None), or, when a `keep` update
                                       # recomputes a running row's KV, its tokens already in the cache
    kv_version: int = 0                # oldest policy version among the KV entries of this row
    routes: list = field(default_factory=list)  # MoE: [n, layers, top_k] blocks, one per cached token

    @property
    def resuming(self) -> bool:
        """A running row whose KV is being prefilled again after a weight update (no new sample)."""
        return self.context is not None


class BatchScheduler:
    """Owns ``model`` and runs all forward passes on one daemon thread.

    Args:
        model: a causal LM in eval mode (fp32 recommended: logprob parity is specified in fp32).
        max_batch: most requests decoded together; more wait in FIFO order.
        prefill_chunk: prompt tokens per prefill forward pass (bounds attention memory).
        policy_version: version stamped on requests until the first reload.
        prefix_cache_tokens: token budget of the prefix cache (0 disables it).
        weights: the name of the weights ``model`` holds (``app.engines.client.weights_label``),
            reported with the version until a reload names others.
        update_mode: the weight update mode of a reload that names none ("keep", "wait", "abort").
        recompute_kv: whether a ``keep`` reload that does not say re-prefills running requests.

    Raises ValueError for an unknown ``update_mode``.
    """

    def __init__(self, model: PreTrainedModel, max_batch: int = 8, prefill_chunk: int = 512,
                 policy_version: int = 0, prefix_cache_tokens: int = 16384, weights: str = "",
                 update_mode: str = "keep", recompute_kv: bool = True) -> None:
        self.update_mode = check_update_mode(update_mode)
        self.recompute_kv = bool(recompute_kv)
        self.model = model
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.policy_version = policy_version
        self.weights = weights
        self._cond = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._prefilling: list[_Row] = []
        self._active: list[_Row] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None      # [B, L] long, 0 = left padding
        self._pending_reload: tuple | None = None
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self._routes = RouteTap(model)
        self.adapters = adapters.AdapterSet(model)  # LoRA adapters requests may name
        self._reload_lock = threading.Lock()
        self._running = False
        self._thread: threading.Thread | None = None
        self.stats = {"decode_steps": 0, "generated_tokens": 0, "prefill_tokens": 0, "reloads": 0,
                      "prefix_hit_tokens": 0, "recompute_tokens": 0, "aborted_requests": 0,
                      "reload_drain_s": 0.0, "reload_load_s": 0.0, "reloads_keep": 0, "reloads_wait": 0,
                      "reloads_abort": 0}

    # ------------------------------------------------------------------ public API
    def start(self) -> "BatchScheduler":
        with self._cond:
            if self._running:
                return self
            self._running = True
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> GenerationRequest:
        """Queue a request; its events arrive on ``request.events``."""
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        with self._cond:
            self._waiting.append(request)
            self._cond.notify_all()
        return request

    def reload(self, state: dict[str, torch.Tensor], policy_version: int, weights: str | None = None, *,
               mode: str | None = None, recompute_kv: bool | None = None) -> int:
        """Load ``state`` (a full state dict) in weight update ``mode``; return the new version.

        ``mode`` None uses the scheduler's ``update_mode``; ``recompute_kv`` None its
        ``recompute_kv`` (module docstring: what each mode does with running requests).
        ``weights`` names them (kept when None); name and version change together (``serving``).
        Blocks the caller until the weights are in place.  Raises ValueError for an unknown mode,
        and whatever ``load_state_into`` raises (the old weights, name and version then stay
        active and running requests go on as they were).
        """
        mode = check_update_mode(mode or self.update_mode)
        recompute = self.recompute_kv if recompute_kv is None else bool(recompute_kv)
        with self._reload_lock:
            done = threading.Event()
            box: dict = {}
            with self._cond:
                self._pending_reload = _Reload(state, int(policy_version), weights, mode, recompute, done, box,
                                               time.perf_counter())
                self._cond.notify_all()
            done.wait()
            if "error" in box:
                raise box["error"]
            return self.policy_version

    def serving(self) -> tuple[int, str]:
        """``(policy version, weights name)`` of what is served now, read together."""
        with self._cond:
            return self.policy_version, self.weights

    def weights_pinned(self):
        """A context in which no reload starts (a scoring pass outside the loop reads stable weights)."""
        return self._reload_lock

    def load(self) -> dict:
        """Queue sizes and counters (for /health and logs)."""
        with self._cond:
            return {"waiting": len(self._waiting), "prefilling": len(self._prefilling),
                    "running": len(self._active), "reload_pending": self._pending_reload is not None,
                    "policy_version": self.policy_version, **self.stats}

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is thread-local
        while True:
            with self._cond:
                if not self._running:
                    return
                self._apply_reload_if_ready()
                self._admit()
                if not self._active and not self._prefilling:
                    self._cond.wait(0.5)
                    continue
            try:
                with torch.inference_mode():
                    if self._prefilling:
                        self._prefill_step(self._prefilling[0])
                    if self._active:
                        self._decode_step()
            except Exception as exc:  # keep serving: fail only the requests in flight
                log.exception("engine step failed")
                for row in self._prefilling + self._active:
                    row.request.events.put(Failed(f"engine error: {exc}"))
                with self._cond:
                    self._prefilling, self._active = [], []
                    self._cache, self._mask = None, None

    def _apply_reload_if_ready(self) -> None:
        """Apply a pending reload now if its mode allows it (``wait``: only once drained)."""
        pending = self._pending_reload
        if pending is None or (pending.mode == "wait" and (self._active or self._prefilling)):
            return
        drained = time.perf_counter()
        try:
            load_state_into(self.model, pending.state)
        except Exception as exc:  # noqa: BLE001 (handed to the waiting reload request, which raises it)
            pending.box["error"] = exc  # nothing was changed for the running requests
        else:
            self.prefix_cache.clear()  # cached KV was computed by the old weights
            self.policy_version = pending.policy_version
            if pending.weights is not None:
                self.weights = pending.weights
            if pending.mode == "abort":
                self._abort_all()
            elif pending.mode == "keep" and pending.recompute_kv:
                self._recompute_all()
            loaded = time.perf_counter()
            self.stats["reloads"] += 1
            self.stats[f"reloads_{pending.mode}"] += 1
            self.stats["reload_drain_s"] += drained - pending.asked
            self.stats["reload_load_s"] += loaded - drained
            log.info("loaded weights for policy version %d in %.2fs (mode %s, %.2fs after the request)",
                     pending.policy_version, loaded - drained, pending.mode, loaded - pending.asked)
        finally:
            self._pending_reload = None
            pending.done.set()

    def _abort_all(self) -> None:
        """End every running and prefilling request with the tokens it has (mode ``abort``)."""
        for row in self._prefilling + self._active:
            row.request.events.put(Aborted(self.policy_version))
            self.stats["aborted_requests"] += 1
        self._prefilling, self._active = [], []
        self._cache, self._mask = None, None

    def _recompute_all(self) -> None:
        """Send every running row back to prefill its cached tokens under the new weights
        (``keep`` with ``recompute_kv``); rows mid-prefill start their prefill again."""
        for row in self._prefilling:
            row.cache, row.prefilled, row.routes = DynamicCache(), 0, []
            row.kv_version = self._version_of(row.request)
        resumed = []
        for row in self._active:
            resumed.append(_Row(row.request, cache=DynamicCache(), last_token=row.last_token,
                                generated=row.generated, tokens=row.tokens, context=row.tokens[:row.num_tokens],
                                kv_version=self._version_of(row.request)))
        # Running rows go first: they hold a harness's open stream, new prompts have not started one.
        self._prefilling = resumed + self._prefilling
        self._active, self._cache, self._mask = [], None, None

    def _version_of(self, request: GenerationRequest) -> int:
        """The version that samples ``request``'s next token: its adapter's, or the base weights'."""
        return request.adapter.policy_version if request.adapter is not None else self.policy_version

    def _admit(self) -> None:
        while (self._waiting and self._pending_reload is None
               and len(self._active) + len(self._prefilling) < self.max_batch):
            request = self._waiting.popleft()
            if request.cancelled.is_set():
                continue
            # An adapter request is answered by that adapter's version (its run's policy version).
            request.policy_version = self._version_of(request)
            request.events.put(Started(request.policy_version))
            self._prefilling.append(_Row(request, cache=DynamicCache(), tokens=list(request.prompt_ids),
                                         kv_version=request.policy_version))

    # ------------------------------------------------------------------ model steps
    def _prefill_step(self, row: _Row) -> None:
        request = row.request
        if request.cancelled.is_set():
            self._prefilling.remove(row)
            return
        context = request.prompt_ids if row.context is None else row.context
        if row.prefilled == 0:
            hit = self.prefix_cache.lookup(context, request.cache_key)
            if hit is not None:
                row.cache = DynamicCache(ddp_cache_data=hit.layers)
                row.prefilled = hit.length
                row.routes = [] if hit.routes is None else [hit.routes]
                self.stats["prefix_hit_tokens"] += hit.length
        start = row.prefilled
        chunk = context[start:start + self.prefill_chunk]
        ids = torch.tensor([chunk], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(chunk), dtype=torch.long, device=self.device).unsqueeze(0)
        with adapters.rows([request.adapter], self.device):
            out = self.model(input_ids=ids, position_ids=positions, past_key_values=row.cache,
                             use_cache=True, logits_to_keep=1)
        self._routes.deal([row.routes])
        row.prefilled += len(chunk)
        self.stats["recompute_tokens" if row.resuming else "prefill_tokens"] += len(chunk)
        if row.prefilled < len(context):
            return
        row.num_tokens = row.prefilled
        if row.resuming:  # its next input is the token it sampled before the update: decode on
            row.context = None
            self._join_batch(row)
        else:
            sample = sample_batch(out.logits[:, -1, :].cpu(), [request.params])[0]
            if not self._emit(row, sample):
                self._join_batch(row)
        # Removed only now, so load() never sees an in-flight request in neither list.
        self._prefilling.remove(row)

    def _decode_step(self) -> None:
        self._drop_rows([r for r in self._active if r.request.cancelled.is_set()])
        if not self._active:
            return
        rows = self._active
        ids = torch.tensor([[r.last_token] for r in rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([[r.num_tokens] for r in rows], dtype=torch.long, device=self.device)
        mask = torch.cat([self._mask, torch.ones(len(rows), 1, dtype=torch.long, device=self.device)], dim=1)
        with adapters.rows([r.request.adapter for r in rows], self.device):  # mixed adapters share the batch
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                             past_key_values=self._cache, use_cache=True)
        self._routes.deal([r.routes for r in rows])
        self._mask = mask
        self._cache = out.past_key_values
        for row in rows:
            row.num_tokens += 1
        # Sampling runs on CPU: per-request torch.Generator objects live there.
        samples = sample_batch(out.logits[:, -1, :].cpu(), [r.request.params for r in rows])
        self.stats["decode_steps"] += 1
        finished = [row for row, sample in zip(rows, samples) if self._emit(row, sample)]
        self._drop_rows(finished, keep_prefix=True)

    def _emit(self, row: _Row, sample: TokenSample) -> bool:
        """Send one token event; return True when the row is finished."""
        request = row.request
        row.generated += 1
        row.last_token = sample.token_id
        row.tokens.append(sample.token_id)
        self.stats["generated_tokens"] += 1
        finish, stop_token = None, None
        if sample.token_id in request.stop_token_ids:
            finish, stop_token = "stop", sample.token_id
        elif row.generated >= request.max_tokens:
            finish = "length"
        routes = row.routes if self._routes.routers else None  # the live list (see routes.routes_of)
        request.events.put(TokenEvent(sample, finish, stop_token, self._version_of(request), row.kv_version, routes))
        return finish is not None

    # ------------------------------------------------------------------ batch KV cache
    def _join_batch(self, row: _Row) -> None:
        """Left-pad ``row``'s own cache and the batch cache to one length and stack them."""
        new_layers = [(layer.keys, layer.values) for layer in row.cache.layers]
        new_len = row.num_tokens
        row.cache = None
        if not self._active:
            self._cache = DynamicCache(ddp_cache_data=new_layers)
            self._mask = torch.ones(1, new_len, dtype=torch.long, device=self.device)
            self._active = [row]
            return
        old_len = self._mask.shape[1]
        total = max(old_len, new_len)

        def pad(x: torch.Tensor, n: int) -> torch.Tensor:  # left-pad dim -2 of [B, H, L, D]
            return F.pad(x, (0, 0, n, 0)) if n else x

        layers = []
        for layer, (k, v) in zip(self._cache.layers, new_layers):
            layers.append((torch.cat([pad(layer.keys, total - old_len), pad(k, total - new_len)]),
                           torch.cat([pad(layer.values, total - old_len), pad(v, total - new_len)])))
        self._cache = DynamicCache(ddp_cache_data=layers)
        self._mask = torch.cat([F.pad(self._mask, (total - old_len, 0)),
                                F.pad(torch.ones(1, new_len, dtype=torch.long, device=self.device), (total - new_len, 0))])
        self._active.append(row)

    def _drop_rows(self, rows: list[_Row], keep_prefix: bool = False) -> None:
        if not rows:
            return
        if keep_prefix and self.prefix_cache.max_tokens:
            # KV computed by older weights (a `keep` update without recompute) is not reused.
            for row in (r for r in rows if r.kv_version == self._version_of(r.request)):  # the row's real tokens are its last num_tokens cache columns
                i, n = self._active.index(row), row.num_tokens
                self.prefix_cache.store(row.tokens[:n], [
                    (layer.keys[i:i + 1, :, -n:].clone(), layer.values[i:i + 1, :, -n:].clone())
                    for layer in self._cache.layers], row.request.cache_key, joined(row.routes))
        keep = [i for i, r in enumerate(self._active) if r not in rows]
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, index)
        start = int(mask.any(dim=0).long().argmax())  # first column any row still uses
        self._mask = mask[:, start:]
        self._cache = DynamicCache(ddp_cache_data=[
            (layer.keys.index_select(0, index)[:, :, start:], layer.values.index_select(0, index)[:, :, start:])
            for layer in self._cache.layers])
