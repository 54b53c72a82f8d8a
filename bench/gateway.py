"""Gateway overhead benchmark: the gateway (gunicorn, recording every call) vs the engine directly.

Both sides run in this one invocation against the same fast scripted engine, so the ratios are
measured side by side, each called through the project's engine client (`app.engines.client`;
the gateway serves the same Chat Completions protocol):

* added latency of a non-stream call (p50 / p95 / p99) and of time-to-first-token of a stream;
* the floor: the same non-stream call answered by a constant-answer app on the gateway's own
  server stack (`bench/gateway_floor.py`: the gateway's gunicorn worker class + Flask, no engine
  call, no record), i.e. the least any gateway on that stack adds, in wall time and in CPU per call
  (the gateway's and the floor's processes, from /proc);
* throughput (calls/s) at 1, 8 and 32 concurrent sessions, with the engine simulating decode
  time (`--token-delay` per token) so that capacity, not the load generator, is measured.

Usage: `.venv/bin/python bench/gateway.py [--n 300] [--seconds 6] [--database-url URL]`
(default database: a temporary SQLite file, WAL, like a single-box deployment).
Goal: < 2 ms p50 added per call, no throughput loss at 32 sessions on 2 cores.

Token-rate mode (`--token-rate`): a paced engine (`bench/token_stream.py`, `--rate` tokens/s per
stream, `--tokens` per answer) streams through ONE gateway worker process at each of
`--sessions` (1,16,64,256) concurrent sessions on each of `--apis` (chat, anthropic, responses,
gemini), side by side with the same load sent to the engine directly and, in Chat's shape, to the
floor (`bench/gateway_floor.py`: the gateway's stack relaying the engine's bytes unparsed, unrecorded,
unpaced; rows `floor/CLASS`).  Per setting: the gateway's
CPU per streamed token (µs: run time of the gunicorn master's and worker's threads, `cpu_seconds`, over the
tokens the clients received), aggregate streamed tokens/s and its ratio to direct, the added
inter-token latency (gateway gap percentile minus direct, p50 and p99) and the added time to first
token (p50).  `--stream-interval-ms 0,2` measures the gateway at each stream interval in turn
(0: every engine read written at once).  Then 256 sessions over 2 workers (`--scale-workers`), the
gateway's share-nothing scale-out.  The load client and the engine share the box with the gateway: their CPU is printed
too, so a row where they, not the gateway, ran out of cores reads as such.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.engines.client import EngineClient  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(url: str) -> None:
    with EngineClient(url) as client:
        try:
            client.health(wait_s=60)
        except TimeoutError:
            raise SystemExit(f"{url} did not start") from None


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def make_sessions(n: int) -> list[str]:
    from app.db import get_engine, session_scope
    from app.tables import Base, Episode, Run, TaskInstance
    from app.proxy.sessions import issue_session
    Base.metadata.create_all(get_engine())
    tokens = []
    with session_scope() as s:
        run = Run(kind="collect", config={})
        s.add(run)
        s.flush()
        for i in range(n):
            ti = TaskInstance(task_set="bench", instance_id=f"b{time.time_ns()}{i}", repo="r", record={})
            s.add(ti)
            s.flush()
            ep = Episode(run_id=run.id, instance_id=ti.id, group_index=i, sample_index=0, status="running")
            s.add(ep)
            s.flush()
            tokens.append(issue_session(s, ep.id))
    return tokens


def direct_body(text: str, stream: bool, model: str) -> dict:
    # What the gateway sends upstream for the same chat call.
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 64,
            "return_token_ids": True, "logprobs": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def timed_call(client: EngineClient, body: dict, headers: dict, stream: bool) -> tuple[float, float]:
    """(total seconds, seconds to the first content token)."""
    t0 = time.perf_counter()
    if not stream:
        client.complete(body, headers=headers)
        dt = time.perf_counter() - t0
        return dt, dt
    first = None
    with client.open_stream(body, headers=headers) as chunks:
        for chunk in chunks:
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices") or []):
                first = time.perf_counter() - t0
    return time.perf_counter() - t0, first if first is not None else time.perf_counter() - t0


def latency(n: int, engine: str, gateway: str, token: str, model: str, reply: str, floor: str,
            gw_pids: list[int], floor_pids: list[int]) -> dict:
    """Per series (non-stream, ttft): seconds per call, direct and through the gateway, interleaved;
    the non-stream series also times the floor app (`bench/gateway_floor.py`) with the same body,
    and sums the CPU seconds the gateway's and the floor's processes spent on their calls
    (`cpu_gateway`, `cpu_floor`: CPU is less shaken than wall time by the box's other load)."""
    from app.conformance.scripted import directive
    out = {}
    for stream in (False, True):
        res = {"direct": [], "gateway": [], "floor": [], "cpu_gateway": 0.0, "cpu_floor": 0.0}
        cd, cg, cf = (EngineClient(u, timeout=30) for u in (engine, gateway, floor))
        for i in range(n + 20):
            text = f"bench {i} {stream} " + directive({"text": reply})
            d = timed_call(cd, direct_body(text, stream, model), {}, stream)
            body = {"model": "gpt-bench", "messages": [{"role": "user", "content": text}], "max_tokens": 64,
                    "stream": stream}
            c0 = cpu_seconds(gw_pids)
            g = timed_call(cg, body, {"authorization": f"Bearer {token}"}, stream)
            c1, f0 = cpu_seconds(gw_pids), cpu_seconds(floor_pids)
            f = None if stream else timed_call(cf, body, {"authorization": f"Bearer {token}"}, False)
            f1 = cpu_seconds(floor_pids)
            if i >= 20:  # warm-up excluded
                res["direct"].append(d[1] if stream else d[0])
                res["gateway"].append(g[1] if stream else g[0])
                res["cpu_gateway"] += c1 - c0
                if f is not None:
                    res["floor"].append(f[0])
                    res["cpu_floor"] += f1 - f0
        for c in (cd, cg, cf):
            c.close()
        out["ttft" if stream else "non-stream"] = res
    return out


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds the processes' threads have run (Linux: the nanosecond `/proc/PID/task/TID/schedstat`
    run time; `/proc/PID/stat`'s utime + stime, in 10 ms ticks, where schedstat is missing).  At 200
    tokens/s through one session a tick is 12 µs per token over a 4 s point, too coarse to read a
    per-token cost; a thread that exits between two readings takes its time with it (the gateway's
    workers keep theirs)."""
    total = 0.0
    for pid in pids:
        try:
            total += sum(int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
                         for tid in os.listdir(f"/proc/{pid}/task")) / 1e9
            continue
        except (OSError, IndexError, ValueError):
            pass
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError):
            pass
    return total


def gunicorn_pids(master: int) -> list[int]:
    kids = open(f"/proc/{master}/task/{master}/children").read().split()
    return [master, *map(int, kids)]


def throughput(sessions: int, seconds: float, url: str, headers_for, body_for) -> float:
    stop = time.monotonic() + seconds
    counts = [0] * sessions

    def worker(k: int) -> None:
        with EngineClient(url, timeout=60) as c:
            i = 0
            while time.monotonic() < stop:
                with c.open_stream(body_for(k, i), headers=headers_for(k)) as chunks:
                    for _ in chunks:
                        pass
                counts[k] += 1
                i += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(sessions)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - t0)


def start_gateway(env: dict, workers: int, threads: int, log_path: str,
                  worker_class: str = "gthread", interval_ms: str | None = None,
                  app: str = "app.proxy:create_gateway_app()") -> subprocess.Popen:
    """gunicorn serving `app` (the gateway, or `bench.gateway_floor:create_app()`) with the gateway's config."""
    extra = {} if interval_ms is None else {"TURNSTILE_GATEWAY_STREAM_INTERVAL_MS": interval_ms}
    return subprocess.Popen([str(ROOT / ".venv/bin/gunicorn"), "-c", "workers/gateway_conf.py", app], cwd=ROOT,
                            env=dict(env, TURNSTILE_GATEWAY_WORKERS=str(workers), TURNSTILE_GATEWAY_THREADS=str(threads),
                                     TURNSTILE_GATEWAY_WORKER_CLASS=worker_class, **extra),
                            stderr=open(log_path, "ab"))


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def token_rate(args, env: dict, tmp: str) -> None:
    """The token-rate mode (module docstring)."""
    import resource

    sys.path.insert(0, str(ROOT / "bench"))
    import token_stream as ts

    eport, gport = free_port(), free_port()
    engine, gateway = f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}"
    env = dict(env, TURNSTILE_ENGINE_URLS=engine, TURNSTILE_GATEWAY_BIND=f"127.0.0.1:{gport}")
    sessions = [int(x) for x in args.sessions.split(",")]
    apis = args.apis.split(",")
    procs = [subprocess.Popen([sys.executable, str(ROOT / "bench/token_stream.py"), "engine", "--port", str(eport),
                               "--rate", str(args.rate), "--tokens", str(args.tokens)], cwd=ROOT)]
    # Each gateway variant: (worker class, stream interval in ms or None for the configured default).
    intervals = args.stream_interval_ms.split(",") if args.stream_interval_ms else [None]
    variants = [(wc, ms) for wc in args.worker_class.split(",") for ms in intervals]
    classes = [wc if ms is None else f"{wc}/{ms}" for wc, ms in variants]
    try:
        wait(engine)
        tokens = make_sessions(max(sessions))
        eng_pids = [procs[0].pid]

        def maker(api: str, direct: bool):
            def make(k: int, call: int):
                return ts.request_for(api, "tok-engine", args.tokens + 50, tokens[k], direct, call)
            make.marker = ts.MARKERS["chat" if direct else api]
            return make

        def client_cpu() -> float:
            ru = resource.getrusage(resource.RUSAGE_SELF)
            return ru.ru_utime + ru.ru_stime

        def measure(url: str, n: int, make, pids: list[int], profile: str | None = None):
            spy = None
            if profile:  # py-spy (requirements-dev.txt) samples the worker while the load runs
                spy = subprocess.Popen([str(ROOT / ".venv/bin/py-spy"), "record", "--gil", "--format", "raw",
                                        "-r", "250", "-d", str(max(1, int(args.seconds) - 1)), "-p", str(pids[-1]),
                                        "-o", profile], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            c0, e0, l0 = cpu_seconds(pids), cpu_seconds(eng_pids), client_cpu()
            load = ts.run_load(url, n, args.seconds, make)
            if spy is not None:
                spy.wait(30)
            return load, cpu_seconds(pids) - c0, cpu_seconds(eng_pids) - e0, client_cpu() - l0

        print(f"token rate: engine {args.rate:.0f} tokens/s per stream, {args.tokens} tokens per answer, "
              f"{args.seconds:.0f} s per point; one gateway worker (gunicorn class[/stream interval ms]: "
              f"{' and '.join(classes)}); cores={os.cpu_count()}")
        head = (f"{'class':<14}{'api':<10}{'sess':>5}{'direct tok/s':>13}{'gw tok/s':>10}{'ratio':>7}{'gw µs/tok':>10}"
                f"{'ITL+ p50 ms':>12}{'ITL+ p99 ms':>12}{'TTFT+ p50':>10}{'eng µs/tok':>11}{'cli µs/tok':>11}{'err':>5}")
        print(head)
        rows = []

        def row(wc, api, n, d, g, gcpu, ecpu, ccpu):
            dr, gr = d.tokens / d.seconds, g.tokens / g.seconds
            itl50 = (pct(g.gaps, 50) - pct(d.gaps, 50)) * 1e3 if g.gaps and d.gaps else float("nan")
            itl99 = (pct(g.gaps, 99) - pct(d.gaps, 99)) * 1e3 if g.gaps and d.gaps else float("nan")
            ttft = (pct(g.ttft, 50) - pct(d.ttft, 50)) * 1e3 if g.ttft and d.ttft else float("nan")
            us = gcpu * 1e6 / max(1, g.tokens)
            line = (f"{wc:<14}{api:<10}{n:>5}{dr:>13.0f}{gr:>10.0f}{gr / dr if dr else 0:>7.2f}{us:>10.1f}{itl50:>12.2f}"
                    f"{itl99:>12.2f}{ttft:>10.2f}{ecpu * 1e6 / max(1, g.tokens):>11.1f}"
                    f"{ccpu * 1e6 / max(1, g.tokens):>11.1f}{g.errors:>5}")
            print(line, flush=True)
            rows.append(line)

        def restart(workers: int, wc: str, ms: str | None, app: str = "app.proxy:create_gateway_app()") -> list[int]:
            stop(procs[1:])
            del procs[1:]
            procs.append(start_gateway(env, workers, max(sessions) + 8, f"{tmp}/gateway.log", wc, ms, app))
            wait(gateway)
            return gunicorn_pids(procs[1].pid)

        # Direct once per setting; the floor (the same stack relaying the engine's bytes, Chat
        # shape) once per worker class; then each gateway variant in turn over every setting.
        direct = {n: measure(engine, n, maker("chat", True), [])[0] for n in sessions}
        if args.floor:
            for wc in dict.fromkeys(wc for wc, _ in variants):
                floor_pids = restart(1, wc, None, "bench.gateway_floor:create_app()")
                for n in sessions:
                    row(f"floor/{wc}", "chat", n, direct[n], *measure(gateway, n, maker("chat", False), floor_pids))
        for (wc, ms), label in zip(variants, classes):
            gw_pids = restart(1, wc, ms)
            for n in sessions:
                for api in apis:
                    prof = (f"{args.profile}-{label.replace('/', '-')}-{api}-{n}.raw"
                            if args.profile and n == args.profile_sessions else None)
                    g, gcpu, ecpu, ccpu = measure(gateway, n, maker(api, False), gw_pids, prof)
                    row(label, api, n, direct[n], g, gcpu, ecpu, ccpu)
        if args.scale_workers:
            n = max(sessions)
            print(f"scale-out: {args.scale_workers} gateway workers, {n} sessions (chat)")
            for (wc, ms), label in zip(variants, classes):
                gw_pids = restart(args.scale_workers, wc, ms)
                g, gcpu, ecpu, ccpu = measure(gateway, n, maker("chat", False), gw_pids)
                row(label, "chat", n, direct[n], g, gcpu, ecpu, ccpu)
    finally:
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="calls per latency series")
    ap.add_argument("--seconds", type=float, default=6.0, help="duration of each throughput run")
    ap.add_argument("--token-delay", type=float, default=0.02,
                    help="engine decode time per token (s); 20 ms = 50 tokens/s, a typical GPU decode rate")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per throughput point (best kept)")
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--workers", default="2")
    ap.add_argument("--threads", default="64")
    ap.add_argument("--token-rate", action="store_true", help="the token-rate mode (module docstring)")
    ap.add_argument("--rate", type=float, default=2000.0, help="token-rate mode: engine tokens/s per stream")
    ap.add_argument("--tokens", type=int, default=200, help="token-rate mode: tokens per answer")
    ap.add_argument("--sessions", default="1,16,64,256", help="token-rate mode: concurrent sessions")
    ap.add_argument("--apis", default="chat,anthropic,responses,gemini", help="token-rate mode: client APIs")
    ap.add_argument("--worker-class", default="gthread,gevent",
                    help="token-rate mode: gunicorn worker classes of the gateway, measured in turn")
    ap.add_argument("--stream-interval-ms", default=None,
                    help="token-rate mode: gateway stream intervals (TURNSTILE_GATEWAY_STREAM_INTERVAL_MS), "
                         "comma-separated, each measured in turn with each worker class (default: the "
                         "configured one)")
    ap.add_argument("--profile", default=None,
                    help="token-rate mode: py-spy stacks of the worker at --profile-sessions sessions "
                         "to PREFIX-CLASS-API-N.raw")
    ap.add_argument("--profile-sessions", type=int, default=64,
                    help="token-rate mode: the session count --profile samples at")
    ap.add_argument("--no-floor", dest="floor", action="store_false",
                    help="token-rate mode: skip the floor rows (bench/gateway_floor.py relaying the engine's bytes)")
    ap.add_argument("--scale-workers", type=int, default=2,
                    help="token-rate mode: then 256 sessions over this many workers (0: skip)")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="gwbench-")
    db_url = args.database_url or f"sqlite:///{tmp}/bench.db"
    os.environ["DATABASE_URL"] = db_url
    eport, gport, fport = free_port(), free_port(), free_port()
    engine, gateway, floor = (f"http://127.0.0.1:{p}" for p in (eport, gport, fport))
    env = dict(os.environ, TURNSTILE_ENGINE_URLS=engine, TURNSTILE_GATEWAY_BIND=f"127.0.0.1:{gport}",
               TURNSTILE_GATEWAY_WORKERS=args.workers, TURNSTILE_GATEWAY_THREADS=args.threads,
               TURNSTILE_LOG_LEVEL="warning")
    if args.token_rate:
        if args.seconds == ap.get_default("seconds"):
            args.seconds = 3.0
        return token_rate(args, env, tmp)
    procs = [subprocess.Popen([sys.executable, "-m", "app.conformance.scripted", "--port", str(eport)], cwd=ROOT)]
    try:
        wait(engine)
        tokens = make_sessions(33)
        procs.append(subprocess.Popen([str(ROOT / ".venv/bin/gunicorn"), "-c", "workers/gateway_conf.py",
                                       "app.proxy:create_gateway_app()"], cwd=ROOT, env=env,
                                      stderr=open(f"{tmp}/gateway.log", "wb")))
        procs.append(subprocess.Popen([str(ROOT / ".venv/bin/gunicorn"), "-c", "workers/gateway_conf.py",
                                       "bench.gateway_floor:create_app()"], cwd=ROOT,
                                      env=dict(env, TURNSTILE_GATEWAY_BIND=f"127.0.0.1:{fport}"),
                                      stderr=open(f"{tmp}/floor.log", "wb")))
        wait(gateway)
        wait(floor)
        with EngineClient(engine) as client:
            model = client.models()[0]["id"]
        from app.conformance.scripted import directive

        print(f"gateway: gunicorn {os.environ.get('TURNSTILE_GATEWAY_WORKER_CLASS', 'gevent')} "
              f"workers={args.workers} threads={args.threads}; db={db_url.split(':')[0]}; "
              f"cores={os.cpu_count()}")
        lat = latency(args.n, engine, gateway, tokens[32], model, "The quick brown fox jumps over it.", floor,
                      gunicorn_pids(procs[1].pid), gunicorn_pids(procs[2].pid))
        print(f"\n{'latency (ms)':<12}" + "".join(f"{'direct p' + p:>11}{'gw p' + p:>9}{'added p' + p:>11}"
                                                    for p in ("50", "95", "99")) + f"{'ratio p50':>11}")
        for name, res in lat.items():
            cells = ""
            for p in (50, 95, 99):
                d, g = pct(res["direct"], p) * 1e3, pct(res["gateway"], p) * 1e3
                cells += f"{d:>11.2f}{g:>9.2f}{g - d:>11.2f}"
            print(f"{name:<12}{cells}{pct(res['gateway'], 50) / pct(res['direct'], 50):>11.2f}")
        fl = lat["non-stream"]["floor"]
        print(f"floor: a constant answer from the gateway's stack (gunicorn + Flask; no engine call, no "
              f"record): p50 {pct(fl, 50) * 1e3:.2f} ms, p95 {pct(fl, 95) * 1e3:.2f} ms: the least that a gateway on "
              f"this stack adds per call here; the gateway's own work adds "
              f"{(pct(lat['non-stream']['gateway'], 50) - pct(lat['non-stream']['direct'], 50) - pct(fl, 50)) * 1e3:.2f}"
              f" ms p50 beyond it")
        ns = lat["non-stream"]
        print(f"CPU per non-stream call: gateway {ns['cpu_gateway'] * 1e3 / args.n:.2f} ms, floor app "
              f"{ns['cpu_floor'] * 1e3 / args.n:.2f} ms: the gateway's own work costs "
              f"{(ns['cpu_gateway'] - ns['cpu_floor']) * 1e3 / args.n:.2f} ms of CPU beyond the floor")

        reply = {"text": "x" * 24, "token_delay": args.token_delay}
        print(f"\nthroughput (calls/s; engine decode {args.token_delay * 1e3:.1f} ms/token x 24 tokens, streamed)")
        print(f"{'sessions':<10}{'direct':>10}{'gateway':>10}{'ratio':>8}{'gw CPU ms/call':>16}")
        gw_pids = gunicorn_pids(procs[1].pid)
        for sessions in (1, 8, 32):
            def body_direct(k, i):
                return direct_body(f"s{k} {i} " + directive(reply), True, model)

            def body_gw(k, i):
                return {"model": "gpt-bench", "stream": True, "max_tokens": 64,
                        "messages": [{"role": "user", "content": f"s{k} {i} " + directive(reply)}]}
            # Alternate direct and gateway runs and keep each side's best: the box is shared, and a
            # transient load spike should not be mistaken for gateway overhead (or hide it).
            ds, gs, cpu = [], [], []
            for _ in range(args.rounds):
                ds.append(throughput(sessions, args.seconds, engine, lambda k: {}, body_direct))
                cpu0 = cpu_seconds(gw_pids)
                gs.append(throughput(sessions, args.seconds, gateway,
                                     lambda k: {"authorization": f"Bearer {tokens[k]}"}, body_gw))
                cpu.append((cpu_seconds(gw_pids) - cpu0) * 1e3 / max(1.0, gs[-1] * args.seconds))
            d, g, cpu_ms = max(ds), max(gs), min(cpu)
            print(f"{sessions:<10}{d:>10.1f}{g:>10.1f}{g / d:>8.2f}{cpu_ms:>16.2f}")
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
