from cart.config import TAX_PERCENT


def total(prices):
    """The sum of the prices with sales tax added, rounded to cents."""
    subtotal = sum(prices)
    return round(subtotal * (1 + TAX_PERCENT), 2)
