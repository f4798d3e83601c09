import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import textstats


class TestTextstats(unittest.TestCase):
    def test_1(self):
        self.assertEqual(textstats.count_words("two  spaces"), 2)

    def test_2(self):
        self.assertEqual(textstats.count_words(""), 0)

    def test_3(self):
        self.assertEqual(textstats.count_words("a\tb\nc"), 3)

    def test_4(self):
        self.assertEqual(textstats.longest_word("a bbb cc"), "bbb")
