import unittest

import bounds


class TestBounds(unittest.TestCase):
    def test_1(self):
        self.assertEqual(bounds.clamp(5, 0, 10), 5)
