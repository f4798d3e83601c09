import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import ages


class TestAges(unittest.TestCase):
    def test_1(self):
        self.assertTrue(ages.is_adult(18))

    def test_2(self):
        self.assertTrue(ages.is_adult(30))

    def test_3(self):
        self.assertFalse(ages.is_adult(17))
