"""`turnstile model warm [SPEC]`: build the model cache once (SmolLM2: GGUF -> safetensors under var/)."""
from __future__ import annotations


def cmd_warm(args) -> int:
    from app.engines.modeling import timed_load

    _model, tokenizer, seconds = timed_load(args.spec)
    print(f"model {args.spec}: loaded in {seconds:.1f} s (vocab {len(tokenizer)}); cache ready")
    _model, _tok, again = timed_load(args.spec)
    print(f"model {args.spec}: second load from the cache {again:.1f} s")
    return 0


def register(sub) -> None:
    p = sub.add_parser("model", help="model cache commands")
    msub = p.add_subparsers(dest="model_command", required=True)
    w = msub.add_parser("warm", help="build the cached weights and tokenizer (first run dequantizes the GGUF)")
    w.add_argument("spec", nargs="?", default="smollm2", help="smollm2 | tiny | tiny-moe | tiny-moe-wide")
    w.set_defaults(handler=cmd_warm)
