from textkit import count_words, greet, initials, reverse, shout, whisper


def test_shout():
    assert shout("hi") == "HI!"


def test_whisper():
    assert whisper("Quiet") == "quiet..."


def test_greet():
    assert greet("Ada") == "Hello, Ada"


def test_initials():
    assert initials("ada lovelace") == "AL"


def test_count_words():
    assert count_words("one two three") == 3
    assert count_words("") == 0


def test_reverse():
    assert reverse("abc") == "cba"
