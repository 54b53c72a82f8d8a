"""Small arithmetic helpers."""
from mathkit.ops import add, average, clamp, is_even, multiply, square, subtract
