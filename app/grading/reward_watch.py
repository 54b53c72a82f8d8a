"""Who wrote the Harbor reward: the verifier's one write, or nothing the grader will read.

`RewardWatch(folder)` makes `reward.txt` and `reward.json` (empty) in a host folder of ours; the
grade binds each one over `/logs/verifier/<name>` (`mounts()`), so inside the sandbox neither can
be unlinked, renamed, hard-linked elsewhere or replaced by a link, folder or FIFO (a mount point:
EBUSY, EXDEV).  An inotify watch on each file's inode (inotify(7)), read by a thread while the
verifier runs, records every open, write, close and change of mode, by any process and any path.

`verdict()` accepts a reward only from a file whose events are one write session and reads:
`(open close-nowrite)* open modify+ close-write (open close-nowrite)*`, the other file only
read or untouched.  Anything else is a `VerifierError`: two writes (the tested code's and the
shell's, in either order, also from a file descriptor opened before the shell's), a mode change
(a read-only reward that makes the shell's own write fail), a write to the other file, a lost
event (queue overflow).  A verifier that writes its reward twice (0 first, then the result) is
refused the same way: no grader can tell its second write from the tested code's.

What stays possible (stated in `app.grading.harbor`): inotify merges an event identical to the
one still unread before it, so a write squeezed between the shell's own write and its close,
from a descriptor opened in the instant before the shell's, is one session to this watch.
"""
from __future__ import annotations

import ctypes
import os
import re
import select
import struct
import threading
from pathlib import Path

from app.grading.verifier import VerifierError
from app.runtimes.sandbox import Mount

NAMES = ("reward.txt", "reward.json")
# inotify(7) masks
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE, IN_CLOSE_NOWRITE, IN_OPEN = 0x2, 0x4, 0x8, 0x10, 0x20
IN_MOVE_SELF, IN_DELETE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x800, 0x400, 0x4000, 0x8000
_LETTERS = ((IN_OPEN, "o"), (IN_MODIFY, "m"), (IN_ATTRIB, "a"), (IN_CLOSE_WRITE, "w"), (IN_CLOSE_NOWRITE, "r"),
            (IN_MOVE_SELF, "x"), (IN_DELETE_SELF, "x"))
_WATCHED = IN_OPEN | IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_CLOSE_NOWRITE | IN_MOVE_SELF | IN_DELETE_SELF
WRITTEN_ONCE = re.compile(r"(or)*om+w(or)*")
READ_ONLY = re.compile(r"(or)*")
_EVENT = struct.Struct("iIII")


class RewardWatch:
    """The reward files of one verifier run and their inotify record (a context manager).

    `folder`: an empty host folder of ours, not mounted into the sandbox itself.  Raises
    `OSError` when inotify is not available."""

    def __init__(self, folder: Path, inside: str = "/logs/verifier"):
        self.folder, self.inside = Path(folder), inside
        self.events: dict[str, list[str]] = {n: [] for n in NAMES}
        self.overflow = False
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wds: dict[int, str] = {}

    def __enter__(self) -> "RewardWatch":
        self.folder.mkdir(parents=True, exist_ok=False)
        for name in NAMES:
            (self.folder / name).touch(mode=0o644)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        for name in NAMES:
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(self.folder / name), _WATCHED)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {name} failed")
            self._wds[wd] = name
        self._thread = threading.Thread(target=self._read_loop, name="reward-watch", daemon=True)
        self._thread.start()
        return self

    def mounts(self) -> list[Mount]:
        """The two files bound read-write over `<inside>/reward.txt` and `<inside>/reward.json`
        (after the mount of `inside` itself)."""
        return [Mount(self.folder / name, f"{self.inside}/{name}", True) for name in NAMES]

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            select.select([self._fd], [], [], 0.05)
            self._drain()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                return
            at = 0
            while at < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, at)
                at += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    self.overflow = True
                name = self._wds.get(wd)
                if name is not None:
                    self.events[name] += [letter for bit, letter in _LETTERS if mask & bit]

    def stop(self) -> None:
        """Stop the thread, read what is left (call once the sandbox has exited: every
        descriptor of it is closed by then) and close the inotify descriptor.  Idempotent."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._fd >= 0:
            self._drain()
            os.close(self._fd)
            self._fd = -1

    def __exit__(self, *exc) -> None:
        self.stop()

    def verdict(self) -> str:
        """The name of the one reward file the verifier wrote, once (module docstring); raises
        `VerifierError` saying what was seen otherwise."""
        self.stop()
        if self.overflow:
            raise VerifierError("events on the reward files were lost (inotify queue overflow): "
                                "who wrote the reward cannot be told")
        seen = {n: "".join(e) for n, e in self.events.items()}
        written = [n for n, e in seen.items() if not READ_ONLY.fullmatch(e)]
        if not written:
            raise VerifierError(f"the verifier wrote no {self.inside}/reward.txt or reward.json")
        if len(written) > 1:
            raise VerifierError(f"both {self.inside}/reward.txt and reward.json were written: "
                                "the tested code can write either, so neither is the verifier's alone")
        name = written[0]
        if not WRITTEN_ONCE.fullmatch(seen[name]):
            why = ("its mode was changed" if "a" in seen[name] else
                   "it was written more than once" if seen[name].count("w") > 1 else
                   "it was open for writing beside the write")
            raise VerifierError(f"{self.inside}/{name} was not written once by the verifier alone: {why} "
                                f"(events {describe(seen[name])})")
        return name


def describe(letters: str) -> str:
    """Events as words: `omw` -> "open modify close-write"."""
    words = {"o": "open", "m": "modify", "a": "attrib", "w": "close-write", "r": "close-nowrite", "x": "moved/deleted"}
    return " ".join(words[c] for c in letters)
