from cart.checkout import total

__all__ = ["total"]
