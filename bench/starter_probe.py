"""How often does SmolLM2 fix a starter instance in its first turn?  Offline, no stack needed.

    .venv/bin/python bench/starter_probe.py --samples 4 --temperature 1.0 --max-tokens 160 \
        --instances starter__mathkit-1,starter__textkit-2 [--prompt toolcall|textbased|short] [--hint-command] \
        [--model var/models/warmstart-<key>]

For each instance: render mini-swe-agent's first request (its own `mini.yaml` system and
instance templates with the `bash` tool, or `mini_textbased.yaml`, or a ~190-token prompt),
sample N completions with `model.generate` (the embedded engine's model and chat template),
take the command the harness would run (a Hermes `<tool_call>` for `toolcall`; exactly one
fenced block for the others, as mini-swe-agent's text mode requires), run it on the buggy tree
and run the instance's tests.  Prints per-sample commands and the totals.  `--hint-command`
appends "This command fixes it for me: sed -i ..." to the problem statement (the easiest
form of the task).  This measures the ceiling of one turn cheaply; `make learn` measures the
real pipeline.
"""
from __future__ import annotations

import argparse
import glob
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHORT_SYSTEM = ("You fix bugs in a Python repository by running bash commands. "
                "Answer with exactly one bash command in a ```bash code block.")
FENCE = re.compile(r"```(?:mswea_bash_command|bash|sh|shell)?[ \t]*\n(.*?)\n```", re.DOTALL)


def mini_config(name: str) -> dict:
    import yaml

    found = glob.glob(str(ROOT / "var/tools/mini-swe-agent/venv/lib/python3*/site-packages/minisweagent/config" / name))
    if not found:
        raise SystemExit(f"{name} not found: install the harness first (python -m app harness install mini-swe-agent)")
    return yaml.safe_load(open(found[0], encoding="utf-8"))


def with_command_hint(record) -> str:
    from app.training.warmstart import fix_command

    return record.problem_statement + f"\nThis command fixes it for me:\n\n```bash\n{fix_command(record.patch)}\n```\n"


def messages(kind: str, task: str) -> tuple[list[dict], list | None]:
    import jinja2

    if kind == "short":
        return [{"role": "system", "content": SHORT_SYSTEM},
                {"role": "user", "content": task + "\nReply with one bash command (in a ```bash code block) that fixes "
                                                   "this issue in the repository."}], None
    if kind == "toolcall":  # exactly the agent's first request (its templates rendered with this machine's uname)
        from app.harnesses import get_preset

        return get_preset("mini-swe-agent").first_messages(task)
    cfg = mini_config("mini_textbased.yaml")
    inst = jinja2.Template(cfg["agent"]["instance_template"]).render(task=task, system="Linux", release="6", version="1",
                                                                     machine="x86_64")
    return [{"role": "system", "content": cfg["agent"]["system_template"]}, {"role": "user", "content": inst}], None


def commands_of(kind: str, text: str) -> list[str]:
    from app.engines.embedded.toolparse import parse_tool_calls

    if kind == "toolcall":
        out = []
        for event in parse_tool_calls(text)[1]:
            try:
                out.append(json.loads(event.arguments)["command"])
            except (ValueError, KeyError, TypeError):
                pass
        return out
    found = FENCE.findall(text)
    return [found[0].strip()] if len(found) == 1 else []


def solves(record, command: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        for rel, body in record.source.files.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_text(body)
        subprocess.run(["git", "init", "-q"], cwd=tmp)
        subprocess.run(["git", "apply", "-"], input=record.bug_patch, text=True, cwd=tmp, check=True)
        try:
            subprocess.run(["bash", "-c", command], cwd=tmp, capture_output=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *record.test_files],
                              cwd=tmp, capture_output=True, text=True)
        return proc.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--instances", default="all", help="comma-separated ids (default: all 18)")
    parser.add_argument("--prompt", choices=("toolcall", "textbased", "short"), default="toolcall")
    parser.add_argument("--hint-command", action="store_true")
    parser.add_argument("--model", default="smollm2", help="model spec or folder (a warm start, a checkpoint's model/)")
    args = parser.parse_args()

    import torch

    from app.engines.modeling import load_model
    from app.engines.embedded.templates import render_prompt
    from app.tasksets import load_task_set

    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    records = load_task_set("starter").instances
    if args.instances != "all":
        wanted = set(args.instances.split(","))
        records = [r for r in records if r.instance_id in wanted]
    total = with_command = solved = 0
    for record in records:
        task = with_command_hint(record) if args.hint_command else record.problem_statement
        msgs, tools = messages(args.prompt, task)
        ids = torch.tensor([render_prompt(tok, msgs, tools)])
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(ids.repeat(args.samples, 1), attention_mask=torch.ones_like(ids).repeat(args.samples, 1),
                                 do_sample=args.temperature > 0, temperature=args.temperature or None, top_p=1.0,
                                 max_new_tokens=args.max_tokens, pad_token_id=tok.eos_token_id)
        rows = []
        for row in out[:, ids.shape[1]:]:
            text = tok.decode(row, skip_special_tokens=True)
            cmds = commands_of(args.prompt, text)
            ok = bool(cmds) and solves(record, cmds[0])
            total, with_command, solved = total + 1, with_command + bool(cmds), solved + ok
            rows.append((ok, cmds[:1], " | ".join(text.splitlines())[:160]))
        print(f"== {record.instance_id}: prompt {ids.shape[1]} tokens, {time.time() - t0:.0f} s, "
              f"solved {sum(r[0] for r in rows)}/{len(rows)}", flush=True)
        for ok, cmds, text in rows:
            print(f"   {'SOLVED' if ok else 'no    '} command={cmds} :: {text}", flush=True)
    print(f"TOTAL {args.prompt}{' +command hint' if args.hint_command else ''} T={args.temperature} "
          f"max_tokens={args.max_tokens}: a runnable command in {with_command}/{total}, solved {solved}/{total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
