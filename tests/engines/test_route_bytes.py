"""The routes codec (torch-free; `app.engines.routing` uses the same one) writes little-endian int16 and refuses bad answers."""
from __future__ import annotations

import numpy as np
import pytest

from app.engines.route_bytes import from_bytes, routes_from_answer, to_bytes, unrouted


def test_little_endian_int16_row_major_round_trip():
    # Expert 258 = 0x0102: low byte first, tokens then layers then top_k.
    assert to_bytes(np.array([[[258, 1]]], dtype=np.int16)) == b"\x02\x01\x01\x00"
    routes = np.random.default_rng(0).integers(0, 32, size=(17, 3, 4)).astype(np.int16)
    assert len(to_bytes(routes)) == 17 * 2 * 3 * 4
    back = from_bytes(to_bytes(routes), 3, 4)
    assert back.dtype == np.int16 and back.flags.writeable
    np.testing.assert_array_equal(back, routes)


def test_answer_list_to_int16():
    routes = routes_from_answer([[[0, 5], [7, 1]], [[2, 3], [4, 6]]])
    assert routes.dtype == np.int16 and routes.shape == (2, 2, 2) and routes[1, 1, 0] == 4


@pytest.mark.parametrize("value, match", [
    ([[0, 1], [2, 3]], "integer \\[tokens, layers, top_k\\]"),
    ([[[0.5, 1.0]]], "integer"),
    ([[[0, 1]], [[2]]], "list|integer"),
    ([[[-1, 1]]], "outside"),
    ([[[40000, 1]]], "outside"),
    ([], "integer"),
    ("AAAA", "integer"),
])
def test_bad_answers_are_refused(value, match):
    with pytest.raises(ValueError, match=match):
        routes_from_answer(value)


def test_bytes_of_a_partial_token_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        from_bytes(b"\x00" * 10, 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        from_bytes(b"", 0, 2)


def test_unrouted_rows():
    rows = unrouted(2, 3, 4)
    assert rows.shape == (2, 3, 4) and rows.dtype == np.int16 and (rows == -1).all()
