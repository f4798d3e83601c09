import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import bounds


class TestBounds(unittest.TestCase):
    def test_1(self):
        self.assertEqual(bounds.clamp(5, 0, 10), 5)

    def test_2(self):
        self.assertEqual(bounds.clamp(-3, 0, 10), 0)

    def test_3(self):
        self.assertEqual(bounds.clamp(12, 0, 10), 10)

    def test_4(self):
        self.assertEqual(bounds.clamp(0, 0, 0), 0)
