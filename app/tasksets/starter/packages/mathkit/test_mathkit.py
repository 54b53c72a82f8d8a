from mathkit import add, average, clamp, is_even, multiply, square, subtract


def test_add():
    assert add(2, 3) == 5
    assert add(-1, 1) == 0


def test_subtract():
    assert subtract(5, 3) == 2


def test_multiply():
    assert multiply(4, 3) == 12
    assert multiply(0, 7) == 0


def test_square():
    assert square(3) == 9
    assert square(-2) == 4


def test_average():
    assert average([2, 4, 6]) == 4
    assert average([5]) == 5


def test_is_even():
    assert is_even(4) is True
    assert is_even(7) is False


def test_clamp():
    assert clamp(5, 0, 10) == 5
    assert clamp(-3, 0, 10) == 0
    assert clamp(42, 0, 10) == 10
