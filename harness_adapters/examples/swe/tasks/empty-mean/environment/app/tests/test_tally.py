import unittest

import tally


class TestTally(unittest.TestCase):
    def test_1(self):
        self.assertEqual(tally.mean([]), 0.0)

    def test_2(self):
        self.assertEqual(tally.mean([2, 4]), 3)
