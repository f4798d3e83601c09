import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import shapes


class TestShapes(unittest.TestCase):
    def test_1(self):
        self.assertEqual(shapes.rectangle_area(3, 4), 12)

    def test_2(self):
        self.assertEqual(shapes.rectangle_area(2, 5), 10)

    def test_3(self):
        self.assertEqual(shapes.rectangle_area(0, 7), 0)

    def test_4(self):
        self.assertEqual(shapes.square_area(3), 9)
