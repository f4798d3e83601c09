import unittest

import cart


class TestCart(unittest.TestCase):
    def test_1(self):
        self.assertEqual(cart.total([10.0, 15.0]), 27.0)
