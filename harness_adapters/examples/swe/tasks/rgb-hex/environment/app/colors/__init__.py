from colors.hexcode import to_hex

__all__ = ["to_hex"]
