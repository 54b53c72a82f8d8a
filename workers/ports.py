"""`python -m workers.ports`: are the ports of this deployment's processes free? (used by `make up`).

Exit status 0 when every TCP port the Procfile's servers bind (API, gateway, engine, Flower,
TensorBoard; from the same settings they read) is free; otherwise one line naming the ports
in use and status 1.
"""
from __future__ import annotations

import socket
import sys

from app.config import Settings, get_settings


def _port_of_bind(bind: str) -> int | None:
    """The TCP port of a gunicorn bind string (`host:port`); None for `unix:` sockets."""
    if bind.startswith("unix:"):
        return None
    return int(bind.rsplit(":", 1)[1])


def server_ports(settings: Settings) -> dict[str, int]:
    """{process name: TCP port} of the Procfile's servers, from `settings`."""
    ports = {"api": _port_of_bind(settings.api_bind), "gateway": _port_of_bind(settings.gateway_bind),
             "tinker": _port_of_bind(settings.tinker_bind),
             "engine": settings.engine_port, "flower": settings.flower_port, "tensorboard": settings.tensorboard_port}
    return {name: port for name, port in ports.items() if port is not None}


def in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts connections on `host:port`."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def main() -> int:
    busy = {name: port for name, port in server_ports(get_settings()).items() if in_use(port)}
    if busy:
        listed = ", ".join(f"{name} :{port}" for name, port in busy.items())
        print(f"Turnstile (or something else) is already running here: {listed} in use. "
              "Stop it first (Ctrl-C in the terminal of `make up`), or set other ports in .env.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
