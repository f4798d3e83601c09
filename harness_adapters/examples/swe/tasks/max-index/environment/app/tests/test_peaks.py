import unittest

import peaks


class TestPeaks(unittest.TestCase):
    def test_1(self):
        self.assertEqual(peaks.argmax([1, 2, 9]), 2)
