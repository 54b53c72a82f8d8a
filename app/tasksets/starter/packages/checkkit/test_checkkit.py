from checkkit import both, either, is_blank, is_negative, is_positive


def test_is_positive():
    assert is_positive(3) is True
    assert is_positive(0) is False


def test_is_negative():
    assert is_negative(-3) is True
    assert is_negative(0) is False


def test_is_blank():
    assert is_blank("   ") is True
    assert is_blank("x") is False


def test_both():
    assert both(True, False) is False
    assert both(True, True) is True


def test_either():
    assert either(False, True) is True
