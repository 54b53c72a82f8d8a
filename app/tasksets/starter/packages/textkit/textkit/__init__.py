"""Small string helpers."""
from textkit.strings import count_words, greet, initials, reverse, shout, whisper
