import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import series


class TestSeries(unittest.TestCase):
    def test_1(self):
        self.assertEqual(series.total(4), 10)

    def test_2(self):
        self.assertEqual(series.total(1), 1)

    def test_3(self):
        self.assertEqual(series.total(0), 0)

    def test_4(self):
        self.assertEqual(series.total(100), 5050)

    def test_5(self):
        self.assertEqual(series.total_squares(3), 14)
