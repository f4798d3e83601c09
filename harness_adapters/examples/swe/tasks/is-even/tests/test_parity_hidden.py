import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import parity


class TestParity(unittest.TestCase):
    def test_1(self):
        self.assertTrue(parity.is_even(4))

    def test_2(self):
        self.assertFalse(parity.is_even(3))

    def test_3(self):
        self.assertTrue(parity.is_even(0))

    def test_4(self):
        self.assertTrue(parity.is_odd(7))

    def test_5(self):
        self.assertTrue(parity.is_even(-2))
