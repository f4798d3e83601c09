import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import dates


class TestDates(unittest.TestCase):
    def test_1(self):
        self.assertTrue(dates.is_leap(2000))

    def test_2(self):
        self.assertFalse(dates.is_leap(1900))

    def test_3(self):
        self.assertTrue(dates.is_leap(2024))

    def test_4(self):
        self.assertFalse(dates.is_leap(2023))

    def test_5(self):
        self.assertEqual(dates.days_in_year(2000), 366)
