"""A gunicorn logger whose access log never shows a credential.

Harnesses send their session key in headers (`Authorization: Bearer`, `x-api-key`,
`x-goog-api-key`) or, Gemini-style, in the query string (`?key=…`,
https://ai.google.dev/api/rest#api-key).  The request line and query string atoms
(`%(r)s`, `%(q)s`) get such query values replaced, and a custom access-log format that names
a credential header (`%({authorization}i)s`) gets `<redacted>`.
"""
from __future__ import annotations

import re

from gunicorn.glogging import Logger

SECRET_PARAMS = ("key", "api_key", "apikey", "access_token", "token")
SECRET_HEADERS = ("authorization", "x-api-key", "x-goog-api-key", "proxy-authorization", "cookie")
_PARAM = re.compile(r"(?i)(^|[?&;])(" + "|".join(SECRET_PARAMS) + r")=[^&;\s#]*")


def redact_query(text: str | None) -> str | None:
    """`text` (a query string or request line) with the values of credential parameters hidden."""
    if not text:
        return text
    return _PARAM.sub(lambda m: f"{m.group(1)}{m.group(2)}=<redacted>", text)


class RedactingLogger(Logger):
    """gunicorn's `Logger` with credentials removed from every access-log atom."""

    def atoms(self, resp, req, environ, request_time):
        atoms = super().atoms(resp, req, environ, request_time)
        for name in ("r", "q"):
            atoms[name] = redact_query(atoms.get(name))
        for header in SECRET_HEADERS:
            key = "{%s}i" % header
            if key in atoms and atoms[key] != "-":
                atoms[key] = "<redacted>"
        return atoms
