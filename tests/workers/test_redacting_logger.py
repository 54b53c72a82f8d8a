"""The gateway's access log (gunicorn, TURNSTILE_GATEWAY_ACCESS_LOG) never shows a session key."""
from __future__ import annotations

import pytest

from workers.redacting_logger import redact_query


@pytest.mark.parametrize("raw, redacted", [
    ("key=abc", "key=<redacted>"),
    ("alt=sse&key=abc&x=1", "alt=sse&key=<redacted>&x=1"),
    ("POST /v1beta/models/m:generateContent?key=s3cr3t HTTP/1.1",
     "POST /v1beta/models/m:generateContent?key=<redacted> HTTP/1.1"),
    ("monkey=1&KEY=abc", "monkey=1&KEY=<redacted>"),
    ("", ""),
])
def test_query_credentials_are_redacted(raw, redacted):
    assert redact_query(raw) == redacted
