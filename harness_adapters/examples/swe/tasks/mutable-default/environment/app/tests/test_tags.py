import unittest

import tags


class TestTags(unittest.TestCase):
    def test_1(self):
        self.assertEqual(tags.add_tag("a"), ["a"])
        self.assertEqual(tags.add_tag("b"), ["b"])
