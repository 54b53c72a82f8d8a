"""Temperature conversions."""


def celsius_to_fahrenheit(c):
    """Degrees Celsius to degrees Fahrenheit."""
    return c * 9 / 5 + 32


def fahrenheit_to_celsius(f):
    """Degrees Fahrenheit to degrees Celsius."""
    return (f - 32) * 5 / 9


def celsius_to_kelvin(c):
    """Degrees Celsius to kelvin."""
    return c + 273.15


def is_freezing(c):
    """True when water freezes at c degrees Celsius (0 or below)."""
    return c <= 0
