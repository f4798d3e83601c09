import unittest

import csvlite


class TestCsvlite(unittest.TestCase):
    def test_1(self):
        self.assertEqual(csvlite.split_row("a, b, c"), ["a", "b", "c"])

    def test_2(self):
        self.assertEqual(csvlite.join_row([1, 2]), "1,2")
