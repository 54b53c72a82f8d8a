"""Small predicates."""


def is_positive(n):
    """True when n is greater than zero."""
    return n > 0


def is_negative(n):
    """True when n is less than zero."""
    return n < 0


def is_blank(text):
    """True when text is empty or only whitespace."""
    return text.strip() == ""


def both(a, b):
    """True when a and b are both true."""
    return bool(a and b)


def either(a, b):
    """True when a or b is true."""
    return bool(a or b)
