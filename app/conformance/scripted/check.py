"""The engine behind the conformance checks: the scripted engine, answering by the conversation's state.

`app.conformance.scripted` answers from a per-episode list consumed in order, which
breaks for harnesses that make auxiliary calls (OpenCode's title generator, Qwen's
memory agent, Gemini's router).  This subclass picks the reply from the request
itself, so it is deterministic however many side calls a harness makes:

* a request without the harness's edit tool among its `tools`, or asking for
  JSON output, is an auxiliary call: it gets the scripted engine's default
  (schema-valid JSON when JSON is requested, else the text "ok");
* otherwise reply number k of the preset's `check_script()`, where k is the number
  of tool calls the assistant already made in the conversation (capped at the last).

Replies use the scripted engine's reply format ({"text", "tool_calls": [{"name", "arguments"}]}),
and token ids / logprobs come from the scripted engine unchanged.

Run: `python -m app.conformance.scripted.check --harness NAME|auto --port N [--max-model-len L]`
(`auto`: the script of the harness named in the calling episode's run config, read
from the database at DATABASE_URL).
"""
from __future__ import annotations

import argparse

from app.conformance.scripted.replies import MODEL, Scripted
from app.conformance.scripted.server import ScriptedServer
from app.harnesses import PRESETS, get_preset
from app.harnesses.base import ScriptedTurn


def scripted_reply(turn: ScriptedTurn) -> dict:
    """A `ScriptedTurn` in the scripted engine's reply format."""
    reply: dict = {}
    if turn.text is not None:
        reply["text"] = turn.text
    if turn.tool is not None:
        reply["tool_calls"] = [{"name": turn.tool, "arguments": turn.arguments or {}}]
    return reply


def choose_reply(turns: list[ScriptedTurn], body: dict) -> dict:
    """The reply for one Chat Completions `body` (see the module docstring); {} = engine default."""
    tools = {(t.get("function") or {}).get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
    wanted = next((t.tool for t in turns if t.tool), None)
    if body.get("response_format") or (wanted is not None and wanted not in tools):
        return {}
    made = sum(len(m.get("tool_calls") or []) for m in body.get("messages") or []
               if isinstance(m, dict) and m.get("role") == "assistant")
    return scripted_reply(turns[min(made, len(turns) - 1)])


def harness_of_episode(episode_id: int) -> str | None:
    """The harness named in the run config of `episode_id` (read from SQL via DATABASE_URL)."""
    from app.db import session_scope
    from app.tables import Episode, Run

    with session_scope() as s:
        ep = s.get(Episode, episode_id)
        run = s.get(Run, ep.run_id) if ep is not None else None
        return (run.config or {}).get("harness") if run is not None else None


class CheckScripted(Scripted):
    """Scripted engine state whose replies follow `choose_reply`.

    `turns` fixes one harness's script; with `turns=None` the script is chosen per
    call from the episode's run config (the gateway names the episode in the
    `x-turnstile-episode` header), so one engine serves checks of every harness.
    """

    def __init__(self, turns: list[ScriptedTurn] | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.turns = list(turns) if turns is not None else None
        self._by_episode: dict[str, list[ScriptedTurn]] = {}

    def turns_for(self, episode: str | None) -> list[ScriptedTurn] | None:
        """The script for calls of `episode` (an episode id as text); None when no harness is known for it."""
        if self.turns is not None:
            return self.turns
        if not episode or not episode.isdigit():
            return None
        if episode not in self._by_episode:
            name = harness_of_episode(int(episode))
            if name not in PRESETS:
                return None
            with self.lock:
                self._by_episode[episode] = PRESETS[name].check_script()
        return self._by_episode[episode]

    def reply_for(self, body: dict, episode: str | None) -> dict:
        """The reply to one Chat Completions `body` of `episode`; {} = the scripted engine's default."""
        turns = self.turns_for(episode)
        return choose_reply(turns, body) if turns else {}


def main(argv: list[str] | None = None) -> None:
    """Serve the scripted engine for `--harness` on `--host:--port` until interrupted; returns None."""
    ap = argparse.ArgumentParser(description="Scripted engine answering a harness's check script")
    ap.add_argument("--harness", required=True, help="a preset name, or 'auto' (by the episode's run config)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    # Scripted token ids are bytes, so real harness prompts (20-60 KB) need a large window.
    ap.add_argument("--max-model-len", type=int, default=4_000_000)
    ap.add_argument("--model", default=MODEL)
    args = ap.parse_args(argv)
    turns = None if args.harness == "auto" else get_preset(args.harness).check_script()
    state = CheckScripted(turns, max_model_len=args.max_model_len,
                          model=args.model)
    srv = ScriptedServer((args.host, args.port), state)
    print(f"scripted engine for {args.harness} on http://{args.host}:{args.port}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
