"""Small string helpers."""


def shout(text):
    """Return text in upper case followed by an exclamation mark."""
    return text.upper() + "!"


def whisper(text):
    """Return text in lower case followed by three dots."""
    return text.lower() + "..."


def greet(name):
    """Return a greeting for name."""
    return "Hello, " + name


def initials(name):
    """Return the upper-case initials of a full name."""
    return "".join(part[0] for part in name.split()).upper()


def count_words(text):
    """Return the number of words in text."""
    return len(text.split())


def reverse(text):
    """Return text reversed."""
    return text[::-1]
