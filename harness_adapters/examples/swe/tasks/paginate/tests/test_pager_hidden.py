import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import pager


class TestPager(unittest.TestCase):
    def test_1(self):
        self.assertEqual(pager.page_count(11, 5), 3)

    def test_2(self):
        self.assertEqual(pager.page_count(10, 5), 2)

    def test_3(self):
        self.assertEqual(pager.page_count(0, 5), 0)

    def test_4(self):
        self.assertEqual(pager.page_count(1, 5), 1)

    def test_5(self):
        self.assertEqual(pager.page(list(range(11)), 3, 5), [10])
