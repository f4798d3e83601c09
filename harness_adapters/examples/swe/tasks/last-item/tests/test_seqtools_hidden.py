import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import seqtools


class TestSeqtools(unittest.TestCase):
    def test_1(self):
        self.assertEqual(seqtools.last([1, 2, 3]), 3)

    def test_2(self):
        self.assertEqual(seqtools.last(["a"]), "a")

    def test_3(self):
        self.assertIsNone(seqtools.last([]))

    def test_4(self):
        self.assertIsNone(seqtools.first([]))
