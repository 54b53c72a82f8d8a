"""Reading an image's rootfs on the host: paths resolve as after a chroot, never outside it."""
from __future__ import annotations

import os

from app.runtimes.rootfs import is_musl, layout_args, libc_check, resolve_inside


def test_links_resolve_inside_the_rootfs(tmp_path):
    root = tmp_path / "rootfs"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "usr" / "lib" / "libc.so.6").write_text("x")
    os.symlink("usr/lib", root / "lib")
    os.symlink("/etc", root / "abs")            # absolute: the image's /etc, not the host's
    os.symlink("../../../../..", root / "up")   # climbing stops at the rootfs
    os.symlink("loop", root / "loop")
    assert resolve_inside(root, "/lib/libc.so.6") == root / "usr" / "lib" / "libc.so.6"
    assert resolve_inside(root, "/abs/passwd") is None  # the host has /etc/passwd; the image has no /etc
    assert resolve_inside(root, "/up") == root and resolve_inside(root, "/up/usr/lib") == root / "usr" / "lib"
    assert resolve_inside(root, "/loop") is None


def test_layout_binds_real_entries_and_recreates_links(tmp_path):
    root = tmp_path / "rootfs"
    (root / "usr").mkdir(parents=True)
    (root / "home" / "someone").mkdir(parents=True)
    (root / "proc").mkdir()
    os.symlink("usr/bin", root / "bin")
    args = layout_args(root, ["/testbed", "/home/agent"])
    assert ["--symlink", "usr/bin", "/bin"] == args[args.index("/bin") - 2:args.index("/bin") + 1]
    assert ["--ro-bind", str(root / "usr"), "/usr"] == args[args.index("/usr") - 2:args.index("/usr") + 1]
    # /home lacks the mount point /home/agent: rebuilt one level down, its entries bound one by one.
    assert "--dir" in args and "/home" in args and str(root / "home" / "someone") in args
    assert "/proc" not in args and str(root / "home") not in args


def test_a_musl_rootfs_is_named(tmp_path):
    root = tmp_path / "rootfs"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "ld-musl-x86_64.so.1").write_text("")
    assert is_musl(root) == "ld-musl-x86_64.so.1"
    assert "musl" in libc_check(root, [])


def test_an_older_glibc_or_a_missing_library_is_named(tmp_path):
    root = tmp_path / "rootfs"
    (root / "lib64").mkdir(parents=True)
    (root / "lib" / "x86_64-linux-gnu").mkdir(parents=True)
    (root / "lib64" / "ld-linux-x86-64.so.2").write_text("")
    (root / "lib" / "x86_64-linux-gnu" / "libc.so.6").write_bytes(b"\0GLIBC_2.2.5\0GLIBC_2.17\0")
    python = os.path.realpath("/proc/self/exe")  # this interpreter: needs a newer glibc than 2.17
    why = libc_check(root, [python])
    assert why is not None and "needs glibc 2." in why and "image has glibc 2.17" in why
