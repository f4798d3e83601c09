import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import slugs


class TestSlugs(unittest.TestCase):
    def test_1(self):
        self.assertEqual(slugs.slugify("Hello World"), "hello-world")

    def test_2(self):
        self.assertEqual(slugs.slugify("  Rust & Python 3 "), "rust-python-3")

    def test_3(self):
        self.assertEqual(slugs.slugify(""), "")
