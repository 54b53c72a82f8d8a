"""Temperature conversions."""
from tempkit.convert import celsius_to_fahrenheit, celsius_to_kelvin, fahrenheit_to_celsius, is_freezing
