"""Small arithmetic helpers."""


def add(a, b):
    """Return the sum of a and b."""
    return a + b


def subtract(a, b):
    """Return a minus b."""
    return a - b


def multiply(a, b):
    """Return the product of a and b."""
    return a * b


def square(x):
    """Return x squared."""
    return x ** 2


def average(values):
    """Return the mean of a non-empty list of numbers."""
    return sum(values) / len(values)


def is_even(n):
    """Return True when n is even."""
    return n % 2 == 0


def clamp(x, low, high):
    """Return x limited to the range [low, high]."""
    return max(low, min(x, high))
