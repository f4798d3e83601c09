from inventory.items import ITEMS, item_value_cents


def stock_value():
    """The value of everything in stock, in dollars."""
    return sum(item_value_cents(name) for name in ITEMS) / 10
