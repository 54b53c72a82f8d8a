from tempkit import celsius_to_fahrenheit, celsius_to_kelvin, fahrenheit_to_celsius, is_freezing


def test_celsius_to_fahrenheit():
    assert celsius_to_fahrenheit(100) == 212
    assert celsius_to_fahrenheit(0) == 32


def test_fahrenheit_to_celsius():
    assert fahrenheit_to_celsius(212) == 100


def test_celsius_to_kelvin():
    assert celsius_to_kelvin(0) == 273.15


def test_is_freezing():
    assert is_freezing(0) is True
    assert is_freezing(-5) is True
    assert is_freezing(3) is False
