import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import tags


class TestTags(unittest.TestCase):
    def test_1(self):
        self.assertEqual(tags.add_tag("a"), ["a"])
        self.assertEqual(tags.add_tag("b"), ["b"])

    def test_2(self):
        given = ["x"]
        self.assertIs(tags.add_tag("y", given), given)
        self.assertEqual(given, ["x", "y"])
