"""`turnstile images pull REF...`: fill this node's image cache before a run (from a registry, a
`docker save` tarball or an OCI layout); `turnstile images list`: what the cache holds.

Both act on the cache of the machine they run on (`<TURNSTILE_CACHE_DIR>/images`, the one the
workers' `oci` runtimes read), never through the API: run them on each node, as the user the
workers run as, with the same settings.
"""
from __future__ import annotations

import datetime as dt

from app.cli import pulls


def cmd_pull(args) -> int:
    from app.cli.pulls import pull_all
    from app.cli.report import make_console

    return 1 if pull_all(args.refs, make_console(), jobs=args.jobs) else 0


def cmd_list(args) -> int:
    from rich.table import Table

    from app.cli.pulls import human_bytes
    from app.cli.report import make_console
    from app.runtimes.images import ImageCache

    console = make_console()
    cache = ImageCache()
    images = cache.listing()
    table = Table()
    for col in ("ref", "digest", "size", "last used", "in use"):
        table.add_column(col, overflow="fold")
    for image in images:
        last = dt.datetime.fromtimestamp(image.last_used).astimezone().isoformat(timespec="seconds")
        table.add_row("\n".join(image.refs) or "-", image.digest, human_bytes(image.size_bytes), last,
                      "yes" if image.in_use else "no")
    console.print(table)
    console.print(f"image cache {cache.root}: {len(images)} image(s), {human_bytes(sum(i.size_bytes for i in images))} "
                  f"of {human_bytes(cache.cap_bytes)} (TURNSTILE_IMAGE_CACHE_BYTES)", markup=False, highlight=False)
    return 0


def register(sub) -> None:
    p = sub.add_parser("images", help="this node's image cache: pre-pull images, list them")
    isub = p.add_subparsers(dest="images_command", required=True)
    pull = isub.add_parser("pull", help="pull and unpack images into this node's cache (exit 1 if any failed)",
                           description="REF: docker://host[:port]/name:tag (a registry), docker-archive:/path.tar "
                                       "(a `docker save` tarball), oci:/path/layout[:tag], oci-archive:/path.tar, "
                                       "or a bare name[:tag] (Docker Hub, or the mirror registries.conf names)")
    pull.add_argument("refs", metavar="REF", nargs="+", help="an image reference")
    pull.add_argument("--jobs", type=pulls.positive, default=2, help="images pulled at once (default 2)")
    pull.set_defaults(handler=cmd_pull)
    ls = isub.add_parser("list", help="the cached images: references, digest, size, last use, in use")
    ls.set_defaults(handler=cmd_list)
