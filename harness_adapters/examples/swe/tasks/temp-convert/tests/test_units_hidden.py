import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import units


class TestUnits(unittest.TestCase):
    def test_1(self):
        self.assertEqual(units.c_to_f(100), 212.0)

    def test_2(self):
        self.assertEqual(units.c_to_f(0), 32.0)

    def test_3(self):
        self.assertEqual(units.c_to_f(-40), -40.0)

    def test_4(self):
        self.assertAlmostEqual(units.f_to_c(units.c_to_f(37)), 37.0)
