import unittest

import shapes


class TestShapes(unittest.TestCase):
    def test_1(self):
        self.assertEqual(shapes.rectangle_area(3, 4), 12)

    def test_2(self):
        self.assertAlmostEqual(shapes.circle_area(1), 3.14159, places=4)
