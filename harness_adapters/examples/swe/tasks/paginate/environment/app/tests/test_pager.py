import unittest

import pager


class TestPager(unittest.TestCase):
    def test_1(self):
        self.assertEqual(pager.page_count(11, 5), 3)

    def test_2(self):
        self.assertEqual(pager.page([1, 2, 3], 2, 2), [3])
