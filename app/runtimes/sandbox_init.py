"""In-sandbox entry point: a TCP listener that forwards to a Unix socket, then the command.

Runs *inside* bubblewrap with only the standard library (it is bind-mounted
read-only and started with `python -I`).  The sandbox has its own network
namespace whose only interface is loopback, so nothing can leave it, except
through a Unix socket that the host bound into the sandbox.  This script
listens on `--listen HOST:PORT` (e.g. 127.0.0.1:8100, the gateway's port) and
pipes every connection to `--unix PATH`; the host end of that socket connects
to the gateway and nowhere else (`app.runtimes.bridge`).  The same pattern
(unshare the network, bridge one socket) is what Codex's and Claude Code's
sandboxes use for their proxies.

The listener is bound *before* the command starts, so the first request never
races it.  Exit status is the command's (128+N when killed by signal N).

Usage: python -I sandbox_init.py --listen 127.0.0.1:8100 --unix /run/turnstile/gateway.sock -- CMD...
"""
import os
import signal
import socket
import subprocess
import sys
import threading


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def _serve(listener: socket.socket, unix_path: str) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(unix_path)
        except OSError:
            client.close()
            upstream.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: sandbox_init.py --listen HOST:PORT --unix PATH -- CMD...", file=sys.stderr)
        return 2
    split = argv.index("--")
    opts, cmd = argv[:split], argv[split + 1 :]
    listen = opts[opts.index("--listen") + 1]
    unix_path = opts[opts.index("--unix") + 1]
    host, port = listen.rsplit(":", 1)
    # `lo` exists but is down in a fresh network namespace until something brings
    # it up; bwrap brings it up for us (--unshare-net configures loopback).
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, int(port)))
    listener.listen(64)
    threading.Thread(target=_serve, args=(listener, unix_path), daemon=True).start()

    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main(sys.argv[1:]))
