"""Pull images into this node's cache with a progress line per image: shared by `images pull` and
`tasks prefetch` (as `client` and `report` are shared, no command module imports another).

The work is `app.runtimes.images.pull_image`; this only shows its events.  On a terminal each
image is one live rich line (resolving, pulling, unpacking, then done with digest and size or
failed); in a pipe or a log each stage is printed as its own line, so the log says how far a
pull got.  An error is printed in full, in skopeo's or umoci's words.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console
from rich.markup import escape


def human_bytes(n: int | None) -> str:
    """`n` bytes as "12.3 MiB" (binary units, one decimal); "-" for None."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # unreachable: the loop returns at GiB


def _done_text(event, short: bool = False) -> str:
    digest = event.digest[:19] if short else event.digest  # short: sha256: and 12 hex digits, as `docker images`
    return f"done {digest} {human_bytes(event.size_bytes)}{' (in the cache already)' if event.cached else ''}"


def pull_all(refs: list[str], console: Console, jobs: int = 2) -> int:
    """Pull every reference of `refs` (duplicates once, in order) into this node's image cache,
    `jobs` at a time (threads: the work is skopeo and umoci processes), printing progress on
    `console`.  Returns how many images failed, counting images the cache evicted again before the
    last pull ended (its cap, TURNSTILE_IMAGE_CACHE_BYTES, cannot hold them all)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Column

    from app.runtimes.errors import RuntimeSetupError
    from app.runtimes.images import ImageCache, pull_image

    refs = list(dict.fromkeys(r.strip() for r in refs if r.strip()))
    cache = ImageCache()
    results: dict[str, object] = {}  # ref -> its last PullEvent
    lock = threading.Lock()
    live = console.is_terminal
    progress = Progress(SpinnerColumn(finished_text="·"),  # a long reference wraps, never cut: it names the image
                        TextColumn("{task.description}", table_column=Column(overflow="fold", ratio=3)),
                        TextColumn("{task.fields[stage]}", table_column=Column(overflow="fold", ratio=2)),
                        TimeElapsedColumn(), console=console, transient=False)
    rows = {ref: progress.add_task(escape(ref), total=1, stage="waiting") for ref in refs} if live else {}

    def show(event) -> None:
        with lock:
            results[event.ref] = event
            text = _done_text(event, short=live) if event.stage == "done" else event.stage
            if live:
                progress.update(rows[event.ref], stage=escape(text),
                                completed=1 if event.stage in ("done", "failed") else 0)
                if event.stage == "failed":
                    progress.console.print(f"error: {event.ref}: {event.error}", markup=False, highlight=False,
                                           soft_wrap=True)
            else:
                line = f"{event.ref}: {text}" + (f": {event.error}" if event.stage == "failed" else "")
                console.print(line, markup=False, highlight=False, soft_wrap=True)

    def one(ref: str) -> None:
        try:
            pull_image(ref, cache, on_event=show)
        except RuntimeSetupError:
            pass  # reported by its "failed" event

    if live:
        progress.start()
    try:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            list(pool.map(one, refs))
    finally:
        if live:
            progress.stop()
    done = [r for r in refs if getattr(results.get(r), "stage", None) == "done"]
    evicted = [r for r in done if cache.cached(r) is None]
    for ref in evicted:
        console.print(f"error: {ref}: evicted again before the last pull ended: the cache cannot hold every image "
                      f"(TURNSTILE_IMAGE_CACHE_BYTES={cache.cap_bytes})", markup=False, highlight=False)
    hits = sum(1 for r in done if results[r].cached)
    failed = len(refs) - len(done) + len(evicted)
    console.print(f"{len(done) - hits} pulled, {hits} in the cache already, {failed} failed or evicted "
                  f"(cache {cache.root}: {human_bytes(cache.total_bytes())} of {human_bytes(cache.cap_bytes)})",
                  markup=False, highlight=False)
    return failed


def positive(text: str) -> int:
    """argparse `type` of a count such as `--jobs`: a whole number >= 1.
    Raises argparse.ArgumentTypeError otherwise (argparse prints it as a usage error)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value
