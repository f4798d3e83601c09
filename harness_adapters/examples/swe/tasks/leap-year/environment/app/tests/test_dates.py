import unittest

import dates


class TestDates(unittest.TestCase):
    def test_1(self):
        self.assertTrue(dates.is_leap(2000))

    def test_2(self):
        self.assertFalse(dates.is_leap(1900))
