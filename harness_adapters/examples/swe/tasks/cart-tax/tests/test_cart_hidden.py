import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import cart


class TestCart(unittest.TestCase):
    def test_1(self):
        self.assertEqual(cart.total([10.0, 15.0]), 27.0)

    def test_2(self):
        self.assertEqual(cart.total([]), 0)

    def test_3(self):
        self.assertEqual(cart.total([100]), 108.0)
