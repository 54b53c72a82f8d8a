"""Small list helpers."""
from listkit.items import first, largest, last, smallest, total, unique
