"""The functions the `family` packages are generated from: one `return` line each, with the calls that test it.

Each `Func` is a pure function of one expression (`body`, the text after `return`), a one-line
docstring, and the argument tuples its tests call it with.  The expected values in the
generated tests are computed by running the clean function, never written by hand, so a
table entry cannot disagree with its own test.  Every function is used by exactly one package
(`app.tasksets.family.generate`), so no two packages share a line.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Func:
    """`def name(params): return body`, documented by `doc`; `calls` are the argument tuples of its tests."""

    name: str
    params: str
    body: str
    doc: str
    calls: tuple[tuple, ...]

    @property
    def line(self) -> str:
        """The function's one code line as it appears in the module (without indentation)."""
        return f"return {self.body}"


POOL: tuple[Func, ...] = (
    Func("add_tax", "price, rate", "price + price * rate / 100", "Return price with rate percent added.",
         ((100, 20), (50, 10))),
    Func("floor_at", "x, low", "max(x, low)", "Return x, but never less than low.", ((3, 5), (9, 5))),
    Func("cap_at", "x, high", "min(x, high)", "Return x, but never more than high.", ((3, 5), (9, 5))),
    Func("midpoint", "a, b", "(a + b) / 2", "Return the number halfway between a and b.", ((2, 8), (-4, 4))),
    Func("difference", "a, b", "a - b", "Return a minus b.", ((10, 4), (3, 7))),
    Func("ratio", "a, b", "a / b", "Return a divided by b.", ((9, 3), (1, 4))),
    Func("remainder", "a, b", "a % b", "Return the remainder of a divided by b.", ((17, 5), (20, 6))),
    Func("half_down", "n", "n // 2", "Return n halved, rounded down.", ((9,), (10,))),
    Func("is_adult", "age", "age >= 18", "Return True when age is 18 or more.", ((18,), (17,), (40,))),
    Func("is_teen", "age", "age >= 13 and age <= 19", "Return True for ages 13 to 19.",
         ((13,), (19,), (12,), (20,))),
    Func("is_zero", "x", "x == 0", "Return True when x is zero.", ((0,), (5,))),
    Func("in_range", "x, low, high", "low <= x and x < high", "Return True when low <= x < high.",
         ((3, 3, 6), (6, 3, 6), (2, 3, 6))),
    Func("first_item", "items", "items[0]", "Return the first item.", (([7, 8, 9],), (["a", "b"],))),
    Func("last_item", "items", "items[-1]", "Return the last item.", (([7, 8, 9],), (["a", "b"],))),
    Func("rest", "items", "items[1:]", "Return every item but the first.", (([7, 8, 9],), ([1, 2],))),
    Func("all_but_last", "items", "items[:-1]", "Return every item but the last.", (([7, 8, 9],), ([1, 2],))),
    Func("backwards", "text", "text[::-1]", "Return text reversed.", (("abc",), ("racecar!",))),
    Func("total", "values", "sum(values)", "Return the sum of values.", (([1, 2, 3],), ([5],))),
    Func("largest", "values", "max(values)", "Return the largest value.", (([3, 9, 4],), ([-2, -7],))),
    Func("smallest", "values", "min(values)", "Return the smallest value.", (([3, 9, 4],), ([-2, -7],))),
    Func("count_positive", "values", "len([v for v in values if v > 0])", "Return how many values are above zero.",
         (([1, -2, 3, 0],), ([0, 0],))),
    Func("any_negative", "values", "any(v < 0 for v in values)", "Return True when some value is below zero.",
         (([1, -2, 3],), ([0, 4],))),
    Func("all_even", "values", "all(v % 2 == 0 for v in values)", "Return True when every value is even.",
         (([2, 4, 6],), ([2, 3],))),
    Func("shout", "text", "text.upper() + \"!\"", "Return text in capitals with an exclamation mark.",
         (("hi",), ("Go",))),
    Func("whisper", "text", "text.lower() + \"...\"", "Return text in small letters, trailing off.",
         (("HI",), ("Go",))),
    Func("has_prefix", "text, prefix", "text.startswith(prefix)", "Return True when text begins with prefix.",
         (("unzip", "un"), ("zipper", "un"))),
    Func("has_suffix", "text, suffix", "text.endswith(suffix)", "Return True when text ends with suffix.",
         (("walked", "ed"), ("edit", "ed"))),
    Func("trim_left", "text", "text.lstrip(\" \")", "Return text without its leading spaces.",
         (("  hi  ",), (" a",))),
    Func("initials", "first, last", "first[0] + last[0]", "Return the initials of a first and last name.",
         (("Ada", "Lovelace"), ("Alan", "Turing"))),
    Func("repeat", "text, times", "text * times", "Return text repeated times times.", (("ab", 3), ("x", 1))),
    Func("distance", "a, b", "abs(a - b)", "Return how far apart a and b are.", ((3, 10), (10, 3))),
    Func("to_cents", "amount", "int(amount * 100)", "Return an amount of money in whole cents.",
         ((2.5,), (0.25,))),
    Func("percent", "part, whole", "round(part / whole * 100, 1)", "Return part as a percentage of whole.",
         ((1, 3), (1, 8))),
    Func("word_count", "text", "len(text.split())", "Return the number of words in text.",
         (("one two three",), ("solo",))),
    Func("unique_count", "items", "len(set(items))", "Return how many different items there are.",
         (([1, 1, 2, 3],), (["a", "a"],))),
    Func("in_order", "items", "sorted(items)", "Return the items sorted, as a new list.",
         (([3, 1, 2],), (["b", "a"],))),
    Func("is_empty", "items", "not items", "Return True when there are no items.", (([],), ([0],))),
    Func("either", "a, b", "bool(a or b)", "Return True when a or b is true.", ((True, False), (False, False))),
    Func("both", "a, b", "bool(a and b)", "Return True when a and b are both true.",
         ((True, False), (True, True))),
    Func("square", "x", "x * x", "Return x squared.", ((3,), (-4,))),
    Func("cube", "x", "x ** 3", "Return x cubed.", ((2,), (-3,))),
    Func("next_even", "n", "n + 2 - n % 2", "Return the smallest even number above n.", ((3,), (4,))),
    Func("scale", "values, k", "[v * k for v in values]", "Return every value multiplied by k.",
         (([1, 2, 3], 2), ([4], 5))),
    Func("pad_number", "n, width", "str(n).zfill(width)", "Return n as text, zero-padded to width.",
         ((7, 3), (42, 4))),
    Func("to_fahrenheit", "c", "c * 9 / 5 + 32", "Return Celsius c in Fahrenheit.", ((100,), (0,))),
    Func("area", "w, h", "w * h", "Return the area of a w by h rectangle.", ((3, 4), (5, 2))),
    Func("perimeter", "w, h", "2 * (w + h)", "Return the perimeter of a w by h rectangle.", ((3, 4), (1, 1))),
    Func("average", "values", "sum(values) / len(values)", "Return the mean of a non-empty list.",
         (([2, 4, 6],), ([5],))),
    Func("is_long", "text, limit", "len(text) > limit", "Return True when text is longer than limit.",
         (("hello", 5), ("hello!", 5))),
    Func("count_of", "items, item", "items.count(item)", "Return how many times item occurs in items.",
         (([1, 2, 1, 1], 1), (["a"], "b"))),
    Func("seconds", "minutes", "minutes * 60", "Return minutes as seconds.", ((2,), (0.5,))),
    Func("kilometres", "metres", "metres / 1000", "Return metres as kilometres.", ((2500,), (1000,))),
    Func("discount", "price, off", "price - price * off / 100", "Return price with off percent taken away.",
         ((200, 25), (80, 50))),
    Func("is_multiple", "n, k", "n % k == 0", "Return True when n is a multiple of k.", ((12, 4), (13, 4))),
    Func("sign", "x", "(x > 0) - (x < 0)", "Return 1, 0 or -1: the sign of x.", ((5,), (-3,), (0,))),
    Func("join_words", "words", "\" \".join(words)", "Return the words joined by single spaces.",
         ((["a", "b", "c"],), (["solo"],))),
    Func("second_item", "items", "items[1]", "Return the second item.", (([7, 8, 9],), (["a", "b"],))),
    Func("first_two", "items", "items[:2]", "Return the first two items.", (([7, 8, 9],), ([1, 2, 3, 4],))),
    Func("last_char", "text", "text[-1]", "Return the last character of text.", (("abc",), ("xy",))),
    Func("is_weekend", "day", "day == \"Sat\" or day == \"Sun\"", "Return True for Sat and Sun.",
         (("Sat",), ("Sun",), ("Mon",))),
    Func("is_vowel", "ch", "ch.lower() in \"aeiou\"", "Return True when ch is a vowel.", (("A",), ("b",))),
    Func("not_blank", "text", "not text.strip() == \"\"", "Return True when text has a non-space character.",
         (("  ",), (" a ",))),
    Func("is_leap", "year", "year % 4 == 0 and year % 100 != 0 or year % 400 == 0",
         "Return True for a leap year of the Gregorian calendar.", ((2024,), (1900,), (2000,), (2023,))),
    Func("in_stock", "count, reserved", "count - reserved > 0", "Return True when some items are not reserved.",
         ((5, 2), (3, 3))),
    Func("passing", "score, mark", "score >= mark and score <= 100", "Return True for a valid passing score.",
         ((50, 50), (100, 50), (49, 50), (101, 50))),
    Func("fits", "size, limit", "size <= limit", "Return True when size does not exceed limit.",
         ((10, 10), (11, 10))),
    Func("middle", "items", "items[len(items) // 2]", "Return the middle item of a list.",
         (([1, 2, 3],), ([4, 5, 6, 7, 8],))),
    Func("odd_positions", "items", "items[1::2]", "Return the items at odd positions.",
         (([0, 1, 2, 3, 4],), (["a", "b"],))),
    Func("neither", "a, b", "not a and not b", "Return True when a and b are both false.",
         ((False, False), (True, False), (False, True))),
    Func("tail_words", "text", "text.split()[1:]", "Return every word of text but the first.",
         (("a b c",), ("solo two",))),
)
