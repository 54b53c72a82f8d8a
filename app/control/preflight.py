"""Checks a run config against this installation before the run is created.

Kept apart from the pydantic schema because the answers depend on the machine (is the
harness installed? does the task set exist?), not on the request alone.  Imports nothing
heavy (no torch), so the API process runs it on every `POST /api/runs`.
"""
from __future__ import annotations

from app.runconfig import RunConfig

EMBEDDED_MODELS = ("smollm2", "tiny", "tiny-moe", "tiny-moe-wide")  # app.engines.modeling's built-ins
# Context window (prompt + sampled tokens) of the embedded engine: its `--max-model-len`
# default, `app.engines.embedded.engine.DEFAULT_MAX_MODEL_LEN` (SmolLM2's 8192 positions; the tiny model
# shares SmolLM2's tokenizer and window).  Not imported from there: that module loads torch.
# tests/control/test_real_stages.py checks the two agree.
EMBEDDED_CONTEXT = 8192


def model_context(cfg: RunConfig) -> int | None:
    """The run's model context window in tokens, or None where this installation does not know it.

    Embedded engines: `EMBEDDED_CONTEXT`.  vLLM engines: unknown (set by `--max-model-len`
    on the GPU box), so the prompt-fit check is skipped.
    """
    return EMBEDDED_CONTEXT if cfg.model.engine == "embedded" else None


def check_prompt_fits(cfg: RunConfig) -> tuple[str, str] | None:
    """`("harness", message)` when the harness's measured minimum prompt does not fit the model's context.

    Rule: the harness's first agent call must leave at least one token of the context to
    sample into; a harness whose prompt alone fills it can only fail on its first call (the
    gateway answers with a context-length error and no episode can ever be graded on what the
    policy did).  The message names both numbers and the harnesses that do fit.
    """
    from app.harnesses import PRESETS, get_preset

    context = model_context(cfg)
    need = get_preset(cfg.harness).min_prompt_tokens
    if context is None or need is None or need < context:
        return None
    fitting = [f"{p.name} ({p.min_prompt_tokens})" for p in PRESETS.values()
               if p.min_prompt_tokens is not None and p.min_prompt_tokens < context]
    return "harness", (f"harness {cfg.harness!r} sends a first prompt of at least {need} tokens (measured with a "
                       f"one-line task), which does not fit the {context}-token context of model {cfg.model.name}; "
                       f"harnesses that fit (minimum prompt tokens): {', '.join(fitting) or 'none'}")


PROBE_TIMEOUT_S = 5.0  # run creation waits at most this per engine for its answer


def check_pause_support(cfg: RunConfig) -> tuple[str, str] | None:
    """`("model.weight_update_mode", message)` when a full-weights train run asks for `keep` on a vLLM
    server that cannot pause, or None.

    `keep` needs the server's `POST /pause?mode=keep` (vLLM's RL routes, registered only with
    `VLLM_SERVER_DEV_MODE=1`: https://docs.vllm.ai/en/latest/training/async_rl/): it freezes the
    running requests, and the recorded pause is where the gateway splits their per-token versions.
    Without it the reloader loads between two decode steps with no boundary anyone can see
    (`app.engines.vllm.reload`).  Asked with `GET /is_paused`, a route of the same set that changes
    nothing: 404/405 is a server without them.  A server that does not answer is not judged here
    (the run's start, and its first weight sync, name it).  LoRA runs load adapters, which never
    pause, and eval runs load no step's weights: neither is checked.
    """
    if cfg.kind != "train" or cfg.model.engine != "vllm" or cfg.model.weight_update_mode != "keep" or cfg.training.lora:
        return None
    from app.config import get_settings
    from app.engines.client import EngineCallError, EngineClient, EngineHTTPError

    for url in cfg.model.engine_urls or get_settings().engine_urls:
        try:
            with EngineClient(url, timeout=PROBE_TIMEOUT_S, connect_timeout=PROBE_TIMEOUT_S) as client:
                client.request("GET", "/is_paused")
        except EngineHTTPError as exc:
            if exc.status in (404, 405):
                return "model.weight_update_mode", (
                    f"'keep' needs the engine's /pause, and vLLM server {url} has none (GET /is_paused answered "
                    f"{exc.status}): start `vllm serve` with VLLM_SERVER_DEV_MODE=1 (vLLM's pause routes), or train "
                    "LoRA adapters (training.lora: true), whose loads never pause")
        except EngineCallError:
            continue
    return None


def check_routing_replay(cfg: RunConfig, uses_engines: bool = True) -> tuple[str, str] | None:
    """`("training.routing_replay", message)` when a train run asks for routing replay that cannot
    apply, or None: the policy is dense (`app.engines.moe_config.moe_shape` of the checkpoint or
    model name: no torch), or a vLLM engine answers without routed experts (`vllm serve
    --enable-return-routed-experts` is server-wide; asked with a one-token completion).  The
    embedded engine returns routes for every MoE model it serves.  A model only an external
    engine knows is judged by that engine's answer; a server that does not answer is not judged
    here (the run's start names it).  `uses_engines` False (simulated stages): the model alone.
    """
    if cfg.kind != "train" or not cfg.training.routing_replay:
        return None
    from app.engines.moe_config import moe_shape

    spec = cfg.model.name
    if cfg.model.checkpoint:
        from app.training.checkpoints import resolve_checkpoint

        try:
            spec = str(resolve_checkpoint(cfg.model.checkpoint)[0])
        except FileNotFoundError:
            return None  # model.checkpoint's own problem says so
    try:
        shape = moe_shape(spec)
    except LookupError:
        shape = "unknown"
    if shape is None:
        return "training.routing_replay", (
            f"model {spec!r} is dense (no mixture-of-experts layers), so it has no routes to replay: use an MoE "
            "model (e.g. tiny-moe) or set training.routing_replay false")
    if not uses_engines or cfg.model.engine != "vllm":
        return None
    from app.config import get_settings
    from app.engines.client import EngineCallError, EngineClient

    for url in cfg.model.engine_urls or get_settings().engine_urls:
        try:
            with EngineClient(url, timeout=PROBE_TIMEOUT_S, connect_timeout=PROBE_TIMEOUT_S) as client:
                served = [m.get("id") for m in client.models(timeout=PROBE_TIMEOUT_S)]
                answer = client.request("POST", "/v1/completions", {
                    "model": served[0] if served else cfg.model.name, "prompt": "a", "max_tokens": 1,
                    "return_routed_experts": True})
        except EngineCallError:
            continue
        choices = answer.get("choices") if isinstance(answer, dict) else None
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        if not (answer.get("routed_experts") if isinstance(answer, dict) else None) and not first.get("routed_experts"):
            return "training.routing_replay", (
                f"vLLM server {url} returns no routed experts (a dense model, or `vllm serve` started without "
                "--enable-return-routed-experts), so the trainer has no routes to replay")
    return None


def _short(message: str, limit: int = 400) -> str:
    """First lines of a long error (a bad file's records must not be echoed whole)."""
    return message if len(message) <= limit else message[:limit] + " …"


def _closest(name: str, known: list[str]) -> str:
    """`; did you mean 'starter'?` for the closest of `known` to `name` (difflib's ratio, cutoff 0.6, as
    Python's own suggestions), else ""."""
    import difflib

    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_installation(cfg: RunConfig) -> tuple[str, str] | None:
    """`(field, message)` of the first choice the real stages cannot serve here, or None
    (the first of `installation_problems`)."""
    problems = installation_problems(cfg)
    return problems[0] if problems else None


def installation_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Every `(field, message)` the real stages cannot serve here, in field order; [] when none.

    Checks the checkpoint, the task set and its instances, the embedded model, whether the
    harness's minimum prompt fits the model's context (`check_prompt_fits`), whether the vLLM
    servers can pause for a `keep` weight update (`check_pause_support`), whether the harness is
    installed, and the cached images.  All of them are reported at once (a user
    fixes them in one go, not one per round trip); a check that needs an earlier answer (the
    instances need the task set) is skipped when that one failed.
    """
    problems: list[tuple[str, str]] = []
    if cfg.model.checkpoint:
        from app.training.checkpoints import resolve_checkpoint

        try:
            resolve_checkpoint(cfg.model.checkpoint)
        except FileNotFoundError as exc:
            problems.append(("model.checkpoint", str(exc)))
    from app.tasksets import load_task_set

    task_set = None
    try:
        task_set = load_task_set(cfg.task_set)
    except (FileNotFoundError, ValueError) as exc:
        from app.tasksets.loader import NAMED_SETS

        problems.append(("task_set", _short(str(exc)) + _closest(cfg.task_set, list(NAMED_SETS))))
    if task_set is not None:
        known = [r.instance_id for r in task_set.instances]
        missing = [name for name in cfg.instances or [] if name not in set(known)]
        if missing:
            hints = "".join(_closest(name, known) for name in missing[:10])
            problems.append(("instances", f"task set {task_set.name!r} has no instance(s) {missing}{hints}"))
    if cfg.model.engine == "embedded" and cfg.model.name not in EMBEDDED_MODELS:
        problems.append(("model.name", (f"the embedded engine serves {' or '.join(EMBEDDED_MODELS)}, not "
                                        f"{cfg.model.name!r}; use model.engine=vllm with model.engine_urls for "
                                        "other models")))
    fit = check_prompt_fits(cfg)
    if fit is not None:
        problems.append(fit)
    pause = check_pause_support(cfg)
    if pause is not None:
        problems.append(pause)
    from app.training.teacher_check import check_teacher

    teacher = check_teacher(cfg)  # on-policy distillation: loadable, same tokenizer, prompt logprobs
    if teacher is not None:
        problems.append(teacher)
    from app.harnesses import get_preset

    preset = get_preset(cfg.harness)
    if not preset.is_installed():
        problems.append(("harness", (f"harness {cfg.harness!r} is not installed; run `make harnesses` (or "
                                     f"`turnstile harness install {cfg.harness}`) first")))
    elif task_set is not None:
        image = check_images(cfg, task_set.instances)
        if image is not None:
            problems.append(image)
    return problems


def check_images(cfg: RunConfig, records: list) -> tuple[str, str] | None:
    """`("harness", message)` naming the first image the run's harness cannot run in, or None.

    Only images this node has unpacked already (`ImageCache.cached`) are checked here, at run
    creation: pulling an image here would hold the request for minutes.  An image not yet
    pulled is checked when an episode's prepare pulls it (`OciRuntime.prepare` raises
    `RuntimeSetupError("harness")` naming the image, and that episode fails with it).  The
    check is `rootfs.libc_check` of the harness's mounted programs (a musl image, an older
    glibc, a missing system library).
    """
    from app.runtimes.choice import record_image, runtime_kind

    chosen = [r for r in records if not cfg.instances or r.instance_id in cfg.instances]
    by_image: dict[str, str] = {}
    for r in chosen:
        if runtime_kind(cfg.runtime, r) == "oci":
            by_image.setdefault(record_image(r), r.instance_id)
    if not by_image:
        return None
    from app.harnesses import get_preset
    from app.runtimes.images import ImageCache
    from app.runtimes.oci import harness_check

    programs = get_preset(cfg.harness).image_programs()
    cache = ImageCache()
    for ref, instance in sorted(by_image.items()):
        img = cache.cached(ref)
        why = harness_check(img, programs) if img is not None and programs else None
        if why:
            return "harness", f"harness {cfg.harness!r} cannot run in image {ref} (instance {instance}): {why}"
    return None
