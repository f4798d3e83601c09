def discounted(price, percent=10):
    """The price after a discount of `percent` per cent (10 unless given)."""
    return price - price * percent
