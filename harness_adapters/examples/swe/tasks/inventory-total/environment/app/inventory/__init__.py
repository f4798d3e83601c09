from inventory.items import ITEMS
from inventory.report import stock_value

__all__ = ["ITEMS", "stock_value"]
