import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import colors


class TestColors(unittest.TestCase):
    def test_1(self):
        self.assertEqual(colors.to_hex(255, 0, 128), "#ff0080")

    def test_2(self):
        self.assertEqual(colors.to_hex(0, 0, 0), "#000000")

    def test_3(self):
        self.assertEqual(colors.to_hex(16, 32, 48), "#102030")
