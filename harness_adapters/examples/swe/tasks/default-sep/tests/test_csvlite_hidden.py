import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import csvlite


class TestCsvlite(unittest.TestCase):
    def test_1(self):
        self.assertEqual(csvlite.split_row("a, b,c"), ["a", "b", "c"])

    def test_2(self):
        self.assertEqual(csvlite.split_row("x;y", sep=";"), ["x", "y"])

    def test_3(self):
        self.assertEqual(csvlite.split_row(csvlite.join_row([1, 2])), ["1", "2"])
