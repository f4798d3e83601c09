import unittest

import slugs


class TestSlugs(unittest.TestCase):
    def test_1(self):
        self.assertEqual(slugs.slugify("Hello World"), "hello-world")
