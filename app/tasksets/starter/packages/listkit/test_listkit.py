from listkit import first, largest, last, smallest, total, unique


def test_first():
    assert first([7, 8, 9]) == 7


def test_last():
    assert last([7, 8, 9]) == 9


def test_total():
    assert total([1, 2, 3]) == 6
    assert total([]) == 0


def test_largest():
    assert largest([3, 9, 4]) == 9


def test_smallest():
    assert smallest([3, 9, 4]) == 3


def test_unique():
    assert unique([3, 1, 3, 2]) == [1, 2, 3]
