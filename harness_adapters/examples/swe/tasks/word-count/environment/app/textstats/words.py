def count_words(text):
    """How many words `text` holds (separated by any whitespace)."""
    return len(text.split(" "))


def longest_word(text):
    """The longest word (the first, on a tie); "" for none."""
    words = text.split()
    return max(words, key=len) if words else ""
