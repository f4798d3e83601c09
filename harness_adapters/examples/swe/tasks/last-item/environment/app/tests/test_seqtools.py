import unittest

import seqtools


class TestSeqtools(unittest.TestCase):
    def test_1(self):
        self.assertEqual(seqtools.last([1, 2, 3]), 3)

    def test_2(self):
        self.assertEqual(seqtools.first([1, 2, 3]), 1)
