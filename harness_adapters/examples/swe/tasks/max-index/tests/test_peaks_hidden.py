import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import peaks


class TestPeaks(unittest.TestCase):
    def test_1(self):
        self.assertEqual(peaks.argmax([1, 2, 9]), 2)

    def test_2(self):
        self.assertEqual(peaks.argmax([9, 1]), 0)

    def test_3(self):
        self.assertEqual(peaks.argmax([3, 3]), 0)

    def test_4(self):
        self.assertIsNone(peaks.argmax([]))

    def test_5(self):
        self.assertEqual(peaks.argmax([1, 5, 2]), 1)
