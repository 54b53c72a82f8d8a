"""`turnstile token`: print the API token (for curl, scripts and the dashboard's sign-in page).

The token is created on first use when neither `TURNSTILE_API_TOKEN` nor `var/api_token` holds one
(`app.auth` states the rules).  `--header` prints a ready `Authorization: Bearer …` header line.
`--tinker NAME` prints the Tinker API key of key name NAME (`TURNSTILE_TINKER_KEYS`), the SDK's
`api_key` for the Tinker service (`app.tinker.keys` derives it from the API token).
"""
from __future__ import annotations


def cmd_token(args) -> int:
    from app.auth import api_token

    if args.tinker:
        from app.tinker.keys import key_for

        try:
            print(key_for(args.tinker))
        except ValueError as exc:
            print(f"turnstile token: {exc}")
            return 2
        return 0
    token = api_token()
    print(f"Authorization: Bearer {token}" if args.header else token)
    return 0


def register(sub) -> None:
    p = sub.add_parser("token", help="print the API token (REST API, dashboard sign-in, engine admin routes)")
    p.add_argument("--header", action="store_true", help="print it as an Authorization header line")
    p.add_argument("--tinker", metavar="NAME", help="print the Tinker API key of key name NAME (TURNSTILE_TINKER_KEYS)")
    p.set_defaults(handler=cmd_token)
