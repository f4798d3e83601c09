import unittest

import textstats


class TestTextstats(unittest.TestCase):
    def test_1(self):
        self.assertEqual(textstats.count_words("two  spaces"), 2)

    def test_2(self):
        self.assertEqual(textstats.longest_word("a bbb cc"), "bbb")
