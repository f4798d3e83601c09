import unittest

import colors


class TestColors(unittest.TestCase):
    def test_1(self):
        self.assertEqual(colors.to_hex(255, 0, 128), "#ff0080")
