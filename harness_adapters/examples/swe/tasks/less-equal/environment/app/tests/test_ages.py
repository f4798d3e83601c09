import unittest

import ages


class TestAges(unittest.TestCase):
    def test_1(self):
        self.assertTrue(ages.is_adult(18))
