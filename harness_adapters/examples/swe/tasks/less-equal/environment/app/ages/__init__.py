from ages.rules import is_adult

__all__ = ["is_adult"]
