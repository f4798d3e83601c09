import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import accounts


class TestAccounts(unittest.TestCase):
    def test_1(self):
        self.assertEqual(accounts.display_name("ada"), "ada <ada@example.com>")

    def test_2(self):
        self.assertEqual(accounts.display_name("linus"), "linus <linus@example.com>")

    def test_3(self):
        self.assertEqual(accounts.display_name("bob"), "unknown")
