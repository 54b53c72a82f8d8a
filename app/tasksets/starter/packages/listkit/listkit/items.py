"""Small list helpers."""


def first(items):
    """Return the first item of a non-empty list."""
    return items[0]


def last(items):
    """Return the last item of a non-empty list."""
    return items[-1]


def total(items):
    """Return the sum of the items."""
    return sum(items)


def largest(items):
    """Return the largest item."""
    return max(items)


def smallest(items):
    """Return the smallest item."""
    return min(items)


def unique(items):
    """Return the distinct items, sorted."""
    return sorted(set(items))
