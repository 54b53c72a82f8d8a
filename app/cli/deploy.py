"""`turnstile deploy render --config deploy.yaml --out DIR`: Kubernetes manifests of a deployment.

Reads a deploy spec (`app.deploy.spec`; examples in deploy/examples/), writes one YAML file per
object into DIR (`app.deploy.render`) and prints their names.  Works offline: it talks to no
cluster and no API.  A bad spec prints every problem, each naming its field, and exits 1 with
nothing written.
"""
from __future__ import annotations

import sys


def cmd_render(args) -> int:
    from app.deploy.render import write
    from app.deploy.spec import SpecError, load_spec

    try:
        spec = load_spec(args.config)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in write(spec, args.out):
        print(path)
    return 0


def register(sub) -> None:
    p = sub.add_parser("deploy", help="Kubernetes manifests of a deployment")
    deploy_sub = p.add_subparsers(dest="deploy_command", required=True)
    r = deploy_sub.add_parser("render", help="render the manifests of a deploy spec into a folder")
    r.add_argument("--config", required=True, help="deploy spec (YAML or JSON), e.g. deploy/examples/small.yaml")
    r.add_argument("--out", required=True, help="folder for the manifests (created)")
    r.set_defaults(handler=cmd_render)
