"""Size caps on what the gateway decodes from a request (app/proxy/limits.py) and the reasoning
signatures that use them (app/proxy/common.py), in process."""
from __future__ import annotations

import base64
import zlib

import pytest

from app.proxy import common, limits, settings as gateway
from app.proxy.common import reasoning_from_signature, reasoning_signature, reasoning_signature_bytes
from app.proxy.errors import GatewayError

CAP = 64 * 1024


@pytest.fixture(autouse=True)
def small_caps(monkeypatch):
    monkeypatch.setattr(gateway, "_settings", gateway.GatewaySettings(max_decoded_bytes=CAP, max_prompt_bytes=4 * CAP))


def forged(n: int, form: str = "text") -> str:
    """A signature in the gateway's own format whose reasoning is `n` spaces (a compression bomb)."""
    packed = zlib.compress(b" " * n, 9)
    if form == "text":
        return common.SIGNATURE_PREFIX + base64.urlsafe_b64encode(packed).decode()
    return base64.urlsafe_b64encode(common.SIGNATURE_PREFIX.encode() + packed).decode()


@pytest.mark.parametrize("make", [reasoning_signature, reasoning_signature_bytes])
def test_a_signature_round_trips_its_reasoning(make):
    text = "Let me think — ü ✓ " * 50
    assert reasoning_from_signature(make(text)) == text


def test_the_bytes_form_survives_either_base64_alphabet_with_or_without_padding():
    """google-genai re-encodes bytes URL-safe; other clients may send standard base64."""
    text = "x" * 1000 + "\u00ff" * 333
    sig = reasoning_signature_bytes(text)
    std = base64.b64encode(base64.urlsafe_b64decode(sig)).decode()
    assert reasoning_from_signature(std) == text and reasoning_from_signature(sig.rstrip("=")) == text


def _text_form(payload: bytes) -> str:
    return common.SIGNATURE_PREFIX + base64.urlsafe_b64encode(payload).decode()


@pytest.mark.parametrize("sig", [None, "", 7, "foreign-opaque", "skip_thought_signature_validator", "tsr1.!!!",
                                 _text_form(b"not zlib"), reasoning_signature("ok")[:-6],  # truncated stream
                                 _text_form(zlib.compress(b"a") + b"trailing"), _text_form(zlib.compress(b"\xff\xfe"))])
def test_foreign_or_damaged_signatures_are_unknown(sig):
    assert reasoning_from_signature(sig) is None


@pytest.mark.parametrize("form", ["text", "bytes"])
def test_a_bomb_stops_at_the_cap_with_a_413(form):
    sig = forged(64 * 1024 * 1024, form)  # 64 MiB of reasoning in about 64 KiB
    assert len(sig) < 100 * 1024
    with pytest.raises(GatewayError) as exc:
        reasoning_from_signature(sig, "messages.1.content.0.signature")
    assert exc.value.kind == "too_large" and exc.value.status == 413
    assert exc.value.param == "messages.1.content.0.signature" and str(CAP) in exc.value.message
    assert reasoning_from_signature(forged(CAP, form)) == " " * CAP  # the cap itself is allowed


def test_decoded_values_of_one_request_share_one_budget():
    """Each value under the per-value cap, together past the request's total: the value that
    crosses it is refused, and decompression stops at the room left."""
    sig = forged(CAP - 10)
    with limits.decoding(3 * CAP):
        for _ in range(3):
            assert reasoning_from_signature(sig) is not None
        with pytest.raises(GatewayError, match="for all decoded values of one request") as exc:
            reasoning_from_signature(sig)
    assert exc.value.status == 413
    assert reasoning_from_signature(sig) is not None  # outside a request's scope: the per-value cap only


def test_inflate_never_holds_more_than_the_room():
    with limits.decoding(100):
        with pytest.raises(GatewayError):
            limits.inflate(zlib.compress(b"a" * 10**7), "v")
        assert limits.inflate(zlib.compress(b"a" * 100), "v") == b"a" * 100
        with pytest.raises(GatewayError):
            limits.inflate(zlib.compress(b"a"), "v")  # the budget is spent


def test_check_prompt_measures_utf8_bytes():
    chat = {"messages": [{"role": "user", "content": "é" * 1000}]}
    utf8 = len('{"messages":[{"role":"user","content":""}]}') + 2000
    assert limits.check_prompt(chat, 10_000) >= utf8  # far from the limit: a cheap upper bound
    assert limits.check_prompt(chat, utf8) == utf8  # near it: exact
    with pytest.raises(GatewayError) as exc:
        limits.check_prompt(chat, utf8 - 1)
    assert exc.value.status == 413 and "TURNSTILE_GATEWAY_MAX_PROMPT_BYTES" in exc.value.message
