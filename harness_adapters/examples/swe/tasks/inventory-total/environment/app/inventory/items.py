# Prices are kept in cents, to add them up exactly.
ITEMS = {
    "pen": {"price_cents": 150, "count": 10},
    "notebook": {"price_cents": 325, "count": 4},
}


def item_value_cents(name):
    item = ITEMS[name]
    return item["price_cents"] * item["count"]
