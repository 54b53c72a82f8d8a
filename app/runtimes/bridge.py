"""Host end of the sandbox's only way out: a Unix socket that connects to the gateway, nothing else.

`GatewayBridge(unix_path, host, port)` listens on `unix_path` (a file in the
runtime's private folder, bind-mounted into the sandbox) and pipes each
connection to the fixed TCP address `host:port`.  The destination is chosen
here, on the host, so code in the sandbox cannot pick another one.  Threads,
not processes: it lives exactly as long as one `LocalRuntime.run(...)` call.
"""
from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit



def gateway_port(gateway_url: str) -> int:
    """The gateway's TCP port on the host (the URL's, else 443 for https and 80 for http)."""
    url = urlsplit(gateway_url)
    return url.port or (443 if url.scheme == "https" else 80)


def inside_port(gateway_url: str) -> int:
    """The port a sandbox reaches the gateway at: the gateway's own, or 18100 when that is below
    1024 (without capabilities the sandbox cannot bind it)."""
    port = gateway_port(gateway_url)
    return port if port >= 1024 else 18100


def inside_gateway_url(gateway_url: str) -> str:
    """The gateway's URL as a sandbox sees it: http://127.0.0.1:<inside_port><path>.  The bridge
    forwards raw TCP, so a plain-HTTP gateway is assumed (an https one would need its TLS name to
    be 127.0.0.1)."""
    url = urlsplit(gateway_url)
    return urlunsplit(("http", f"127.0.0.1:{inside_port(gateway_url)}", url.path, url.query, ""))

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


class GatewayBridge:
    """Context manager: serve `unix_path` → TCP `host:port` until exit; removes the socket file."""

    def __init__(self, unix_path: Path, host: str, port: int):
        self.unix_path, self.host, self.port = Path(unix_path), host, port
        self._sock: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def __enter__(self) -> "GatewayBridge":
        self.unix_path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.unix_path))
        os.chmod(self.unix_path, 0o600)
        self._sock.listen(64)
        threading.Thread(target=self._accept, daemon=True, name="gateway-bridge").start()
        return self

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((self.host, self.port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def __exit__(self, *exc) -> None:
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            for s in self._conns:
                try:
                    s.close()
                except OSError:
                    pass
            self._conns.clear()
        self.unix_path.unlink(missing_ok=True)
