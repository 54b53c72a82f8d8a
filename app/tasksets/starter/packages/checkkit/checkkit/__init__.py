"""Small predicates."""
from checkkit.checks import both, either, is_blank, is_negative, is_positive
