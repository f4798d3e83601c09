from games.fizz import fizzbuzz

__all__ = ["fizzbuzz"]
