"""Supervised warm start ("cold start") before GRPO: teach the policy the harness's action format.

GRPO learns only from groups whose rewards differ (the group-relative advantage of Shao et al.
2024, arXiv:2402.03300 §4.1.2, is 0 when every episode of a group gets the same reward).  A
policy that never emits an action the harness can run gets reward 0 everywhere and learns
nothing, however long it trains; SmolLM2-135M-Instruct answers mini-swe-agent in prose (0 tool
calls in 76 calls, measured).  DeepSeek-R1 (arXiv:2501.12948 §2.3.1) starts RL from a small
supervised "cold start" for the same reason.  Here the demonstrations are the *train*
instances' own fixes, written as the harness's actions on exactly the prompt the harness
sends: turn 1 a one-line `sed -i` edit derived from the instance's gold patch, turn 2 the
harness's submit command (with `read_file`, an issue that does not say the fix first gets a
turn that `cat`s the file, so the skill of finding the fix by reading is demonstrated too).
Held-out instances are never seen.

`warm_start` fine-tunes LoRA adapters (peft) on those turns with next-token cross-entropy on the
assistant tokens only, merges them into the weights, and writes a model folder (the
`save_weights` layout) that a run loads with `model.checkpoint`.  The folder is keyed by a hash
of everything that determines it, so a second call with the same inputs reuses it.
`warm_start_folder` runs it for a run config's `warm_start` section (what `make demo` and
`make learn` call) in a child process of its own.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

# Bump when the demonstrations or the training loop change, so a cached folder is not reused.
FORMAT_VERSION = 1
# Characters with a meaning in a sed basic regular expression (POSIX BRE) or as its delimiter.
_BRE_SPECIAL = set("[]/.*^$\\")
# Characters with a meaning in sed's replacement text: the delimiter, `&` (the match), `\\`.
_REPLACEMENT_SPECIAL = set("/&\\")


@dataclass(frozen=True)
class WarmStartConfig:
    """Hyperparameters of the supervised warm start.

    `epochs` passes over the demonstrations (batch of one sequence), AdamW at a constant
    `learning_rate`, LoRA rank `lora_r` and scale `lora_alpha` on every projection, `seed` for
    the adapter initialisation and the order of the demonstrations.
    """

    epochs: int = 3
    learning_rate: float = 1e-3
    lora_r: int = 16
    lora_alpha: int = 32
    seed: int = 0
    # Instances whose issue names the suspicious line but not the fix (`difficulty` ending in
    # "-line") get a first turn that reads the file (`cat`), so the fix is found by reading it.
    read_file: bool = False

    @classmethod
    def from_dict(cls, data: dict | None) -> "WarmStartConfig":
        """Build from a JSON object; unknown keys raise ValueError naming them."""
        data = dict(data or {})
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"warm_start: unknown setting(s) {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**data)


def _escape(text: str, special: set[str]) -> str:
    return "".join("\\" + c if c in special else c for c in text)


def fix_command(patch: str) -> str:
    """A `sed -i 's/OLD/NEW/' FILE` command that applies a patch of one-line replacements.

    Each hunk must replace lines one for one (k removed lines followed by k added lines); each
    pair becomes one substitution of the stripped old line by the stripped new line, joined
    with `&&`.  OLD is escaped for a POSIX basic regular expression, NEW for sed's replacement
    text, and the whole expression is single-quoted for bash.
    Raises ValueError for any other shape of patch (added or removed lines without a partner).
    """
    from unidiff import PatchSet

    commands = []
    for patched in PatchSet(patch):
        for hunk in patched:
            removed = [line.value.rstrip("\n") for line in hunk if line.is_removed]
            added = [line.value.rstrip("\n") for line in hunk if line.is_added]
            if not removed or len(removed) != len(added):
                raise ValueError(f"{patched.path}: the warm start writes one-line replacements only "
                                 f"({len(removed)} line(s) removed, {len(added)} added)")
            for old, new in zip(removed, added):
                expression = f"s/{_escape(old.strip(), _BRE_SPECIAL)}/{_escape(new.strip(), _REPLACEMENT_SPECIAL)}/"
                commands.append("sed -i '" + expression.replace("'", "'\\''") + "' " + patched.path)
    if not commands:
        raise ValueError("the patch changes no file")
    return " && ".join(commands)


def _call(command: str, index: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"call_{index}", "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]}


def buggy_file(record) -> tuple[str, str]:
    """`(path, text)` of the file the gold patch of `record` fixes, as the agent finds it (the bug in
    place): the inline source's clean file with each added line of the patch replaced by its removed one.

    Raises ValueError for a record without an inline source, or a patch of more than one file.
    """
    from unidiff import PatchSet

    source = getattr(record, "source", None)
    files = getattr(source, "files", None) if source is not None else None
    patched = list(PatchSet(record.patch))
    if not files or len(patched) != 1 or patched[0].path not in files:
        raise ValueError(f"{record.instance_id}: reading the file needs an inline source and a one-file patch")
    text = files[patched[0].path]
    for hunk in patched[0]:
        removed = [line.value for line in hunk if line.is_removed]
        added = [line.value for line in hunk if line.is_added]
        for bad, good in zip(removed, added):
            text = text.replace(good, bad, 1)
    return patched[0].path, text


def demonstration(tokenizer, harness, problem_statement: str, command: str,
                  read: tuple[str, str] | None = None) -> tuple[list[int], list[int]]:
    """`(input_ids, loss_mask)` of one two-turn demonstration (three with `read`), both `list[int]` of one length.

    The conversation is the harness's first request for `problem_statement`, with `read=(path,
    text)` a `cat path` tool call and its result (`text`), the fix `command` as a `bash` tool
    call, its tool result (return code 0, no output), and the harness's submit command.
    `loss_mask` is 1 on the assistant turns (end-of-turn token included) and 0 on everything
    the harness and the chat template write.
    Raises ValueError when a rendered prefix is not a prefix of the whole (a template that
    rewrites earlier turns cannot be trained this way).
    """
    from app.engines.embedded.templates import render_prompt

    messages, tools = harness.first_messages(problem_statement)
    turns = []
    if read is not None:
        turns += [_call(f"cat {read[0]}", 9), {"role": "tool", "tool_call_id": "call_9",
                                              "content": harness.observation(0, read[1])}]
    turns += [_call(command, 0), {"role": "tool", "tool_call_id": "call_0", "content": harness.observation(0, "")},
              _call(harness.submit_command, 1)]
    ids: list[int] = []
    mask: list[int] = []
    history = list(messages)
    for turn in turns:
        trained = turn["role"] == "assistant"
        before = render_prompt(tokenizer, history, tools, add_generation_prompt=trained)
        history.append(turn)
        after = render_prompt(tokenizer, history, tools, add_generation_prompt=False)
        if after[:len(before)] != before or before[:len(ids)] != ids:
            raise ValueError("the chat template does not render the conversation as a growing prefix")
        mask += [0] * (len(before) - len(ids)) + [int(trained)] * (len(after) - len(before))
        ids = after
    return ids, mask


def cache_key(base: str, harness, demos: Sequence[tuple[str, str, str]], config: WarmStartConfig) -> str:
    """16 hex digits of sha256 over the base model, the harness and its version, the
    demonstrations `(instance_id, problem_statement, command)` and the hyperparameters."""
    blob = json.dumps({"format": FORMAT_VERSION, "base": base, "harness": [harness.name, harness.version],
                       "demos": list(demos), "config": asdict(config)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def to_stderr(line: str) -> None:
    """Progress goes to stderr: stdout carries only the result, so `$(turnstile warm-start ...)`
    captures the model folder and nothing else."""
    print(line, file=sys.stderr, flush=True)


def warm_start(base: str, harness, records: Sequence, config: WarmStartConfig, out_root: Path,
               progress: Callable[[str], None] = to_stderr) -> Path:
    """Fine-tune `base` on demonstrations of `records` and return the merged model folder.

    Args:
        base: model spec for `app.engines.modeling.load_model` ("smollm2", "tiny", a folder).
        harness: a harness preset with `first_messages`, `observation` and `submit_command`.
        records: task records with `instance_id`, `problem_statement` and a one-line-fix `patch`.
        config: the hyperparameters.
        out_root: the folder is `<out_root>/warmstart-<cache_key>/`; an existing one is reused.
        progress: called with one line per epoch (default: printed on stderr).

    Returns the folder (`config.json`, `model.safetensors`, `turnstile.json` with
    `policy_version` 0 and what produced it).  Raises ValueError for a record whose patch is
    not a one-line replacement, NotImplementedError for a harness without `first_messages`.
    """
    from app.engines import modeling
    from app.training import policy

    if not hasattr(harness, "first_messages"):
        raise NotImplementedError(f"warm start: harness {harness.name!r} does not describe its first request")
    reads = {r.instance_id: buggy_file(r) for r in records
             if config.read_file and str(getattr(r, "difficulty", "") or "").endswith("-line")}
    demos = [(r.instance_id, r.problem_statement, fix_command(r.patch)) for r in records]
    folder = (Path(out_root) / f"warmstart-{cache_key(base, harness, demos, config)}").resolve()
    if (folder / "config.json").is_file():
        progress(f"warm start: reusing {folder}")
        return folder
    torch.manual_seed(config.seed)
    model, tokenizer = modeling.load_model(base, torch.float32)
    sequences = [demonstration(tokenizer, harness, statement, command, reads.get(name))
                 for name, statement, command in demos]
    model = policy.add_lora(model, config.lora_r, config.lora_alpha, 0.0)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    order = random.Random(config.seed)
    started = time.monotonic()
    for epoch in range(config.epochs):
        losses = []
        for index in order.sample(range(len(sequences)), len(sequences)):
            ids, mask = (torch.tensor(x) for x in sequences[index])
            logits = model(input_ids=ids[None]).logits[0, :-1].float()
            targets = mask[1:].bool()  # position t predicts token t+1
            loss = torch.nn.functional.cross_entropy(logits[targets], ids[1:][targets])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        progress(f"warm start: epoch {epoch + 1}/{config.epochs}, mean loss {sum(losses) / len(losses):.4f}, "
                 f"{time.monotonic() - started:.0f} s")
    merged = model.merge_and_unload().eval()
    meta = {"policy_version": 0, "warm_start": {"base": base, "harness": harness.name, "config": asdict(config),
                                                "instances": [d[0] for d in demos], "format": FORMAT_VERSION}}
    return modeling.save_weights(merged, folder, metadata=meta)


def section_problems(config: Mapping, section: Mapping, default_instances: str | Sequence[str]) -> list[tuple[str, str]]:
    """Every `(field, message)` that would make `warm_start_folder(config, section, ...)` fail on its inputs,
    [] when none: unknown settings, an instance spec that names nothing, ids the run's task set lacks.

    Cheap (no model is loaded), so a caller checks it before the minutes of fine-tuning.  Fields
    are dotted under `warm_start.`.  A task set that does not load is not repeated here: the run
    config's own check names it.
    """
    import difflib

    from app.tasksets import load_task_set
    from app.tasksets.starter import instance_ids

    settings = dict(section)
    problems: list[tuple[str, str]] = []
    spec = settings.pop("instances", default_instances)
    try:
        WarmStartConfig.from_dict(settings)
    except (TypeError, ValueError) as exc:
        problems.append(("warm_start", str(exc)))
    try:
        task_set = load_task_set(config.get("task_set", "synthetic"))
    except (FileNotFoundError, ValueError):
        return problems
    try:
        names = instance_ids(spec)
    except (FileNotFoundError, ValueError) as exc:
        return problems + [("warm_start.instances", str(exc))]
    known = [r.instance_id for r in task_set.instances]
    for name in [n for n in names if n not in set(known)]:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append(("warm_start.instances", f"task set {task_set.name!r} has no instance {name!r}{hint}"))
    return problems


def warm_start_folder(config: Mapping, section: Mapping, default_instances: str | Sequence[str]) -> Path:
    """Run (or reuse) the supervised warm start described by `section`; its model folder.

    `config` is a run config (`task_set`, `harness`, optional `model.name`, default "smollm2"):
    its base model and harness are the warm start's.  `section` holds `WarmStartConfig` fields
    and optionally `instances` (ids, or a split such as "starter:train"; default
    `default_instances`), the task set's instances whose fixes are demonstrated.  The folder is
    `<var_dir>/models/warmstart-<cache_key>/`.

    The training runs in a spawned child process: the model, its gradients and AdamW state
    (~4 GB for SmolLM2) go back to the OS when it exits, instead of staying in the calling
    process (the CLI, which then follows runs for an hour).  Raises ValueError for unknown
    settings or instances, and what `warm_start` raises.
    """
    from app.config import get_settings
    from app.harnesses import get_preset
    from app.tasksets import load_task_set
    from app.tasksets.starter import instance_ids

    settings = dict(section)
    names = instance_ids(settings.pop("instances", default_instances))
    task_set = load_task_set(config["task_set"])
    records = [task_set.get(name) for name in names]
    base = (config.get("model") or {}).get("name", "smollm2")
    args = (base, get_preset(config["harness"]), records, WarmStartConfig.from_dict(settings), get_settings().var_dir / "models")
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(warm_start, *args).result()
