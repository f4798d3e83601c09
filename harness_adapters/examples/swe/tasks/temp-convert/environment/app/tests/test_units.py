import unittest

import units


class TestUnits(unittest.TestCase):
    def test_1(self):
        self.assertEqual(units.c_to_f(100), 212.0)

    def test_2(self):
        self.assertEqual(units.f_to_c(212), 100.0)
