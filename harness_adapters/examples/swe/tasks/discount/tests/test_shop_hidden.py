import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import shop


class TestShop(unittest.TestCase):
    def test_1(self):
        self.assertEqual(shop.discounted(200), 180.0)

    def test_2(self):
        self.assertEqual(shop.discounted(50, 20), 40.0)

    def test_3(self):
        self.assertEqual(shop.discounted(80, 0), 80)
