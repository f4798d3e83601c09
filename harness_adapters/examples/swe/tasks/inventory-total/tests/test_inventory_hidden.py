import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import inventory


class TestInventory(unittest.TestCase):
    def test_1(self):
        self.assertEqual(inventory.stock_value(), 28.0)

    def test_2(self):
        inventory.ITEMS["cup"] = {"price_cents": 99, "count": 1}
        try:
            self.assertAlmostEqual(inventory.stock_value(), 28.99)
        finally:
            del inventory.ITEMS["cup"]
