import unittest

import series


class TestSeries(unittest.TestCase):
    def test_1(self):
        self.assertEqual(series.total(4), 10)

    def test_2(self):
        self.assertEqual(series.total_squares(3), 14)
