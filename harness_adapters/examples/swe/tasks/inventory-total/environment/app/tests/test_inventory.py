import unittest

import inventory


class TestInventory(unittest.TestCase):
    def test_1(self):
        self.assertEqual(inventory.stock_value(), 28.0)
