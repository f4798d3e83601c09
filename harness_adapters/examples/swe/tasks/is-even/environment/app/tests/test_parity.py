import unittest

import parity


class TestParity(unittest.TestCase):
    def test_1(self):
        self.assertTrue(parity.is_even(4))
