import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import tally


class TestTally(unittest.TestCase):
    def test_1(self):
        self.assertEqual(tally.mean([]), 0.0)

    def test_2(self):
        self.assertEqual(tally.mean([2, 4]), 3)

    def test_3(self):
        self.assertEqual(tally.mean([5]), 5)

    def test_4(self):
        self.assertEqual(tally.spread([]), 0)

    def test_5(self):
        self.assertEqual(tally.spread([1, 4]), 3)
