import unittest

import medians


class TestMedians(unittest.TestCase):
    def test_1(self):
        self.assertEqual(medians.median([1, 2, 3, 4]), 2.5)

    def test_2(self):
        self.assertEqual(medians.median([3, 1, 2]), 2)
