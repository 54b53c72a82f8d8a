"""Separate "machines" on one box for multi-host tests: Linux network namespaces on a bridge.

`Network()` makes a bridge in the test's own namespace (address `<subnet>.254`, so the test
process reaches every host like a user's laptop would) and `add_host(name)` one network
namespace per machine, joined to the bridge by a veth pair, with its own address
`<subnet>.<n>/24`.  A host's loopback device is up (Linux delivers a machine's traffic to its
own address through it) but holds no 127.0.0.1 or ::1 unless asked for, so a process in it that
binds 127.0.0.1 ("Cannot assign requested address") or dials it ("Network is unreachable")
fails at once instead of silently talking to something on the same box.  `host.cmd(argv)` wraps a command to run inside the namespace
(`ip netns exec`).  Names carry a random id, so parallel test processes never meet; `close()`
deletes the namespaces and the bridge.

Needs root (CAP_NET_ADMIN) and iproute2; `available()` says whether this machine has them.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def available() -> str | None:
    """None when network namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tsprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return str(exc)
    _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    name: str
    netns: str
    address: str

    def cmd(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


class Network:
    """A bridge with hosts on it; a context manager (`close()` on exit)."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(3)
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.bridge = f"tsb{self.id}"
        self.hosts: dict[str, Host] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.gateway_address = f"{self.subnet}.254"

    def add_host(self, name: str, *, loopback: bool = False) -> Host:
        """A new machine `name` on the bridge (address `<subnet>.<n>`, n = 1, 2, ...)."""
        n = len(self.hosts) + 1
        netns, outside, inside = f"ts{self.id}{name}", f"tsv{self.id}{n}", f"tsi{self.id}{n}"
        _ip("netns", "add", netns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", netns)
        _ip("-n", netns, "link", "set", inside, "name", "eth0")
        _ip("-n", netns, "addr", "add", f"{self.subnet}.{n}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")  # the kernel adds 127.0.0.1/8 and ::1 here
        if not loopback:
            _ip("-n", netns, "addr", "del", "127.0.0.1/8", "dev", "lo")
            _ip("-n", netns, "addr", "del", "::1/128", "dev", "lo")
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        host = Host(name, netns, f"{self.subnet}.{n}")
        self.hosts[name] = host
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
