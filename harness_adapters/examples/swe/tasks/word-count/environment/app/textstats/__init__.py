from textstats.words import count_words, longest_word

__all__ = ["count_words", "longest_word"]
