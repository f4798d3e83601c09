import unittest

import shop


class TestShop(unittest.TestCase):
    def test_1(self):
        self.assertEqual(shop.discounted(200), 180.0)
