import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import medians


class TestMedians(unittest.TestCase):
    def test_1(self):
        self.assertEqual(medians.median([1, 2, 3, 4]), 2.5)

    def test_2(self):
        self.assertEqual(medians.median([3, 1, 2]), 2)

    def test_3(self):
        self.assertEqual(medians.median([5]), 5)

    def test_4(self):
        self.assertEqual(medians.median([4, 1]), 2.5)
