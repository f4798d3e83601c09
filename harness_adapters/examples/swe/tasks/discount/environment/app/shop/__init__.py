from shop.prices import discounted

__all__ = ["discounted"]
