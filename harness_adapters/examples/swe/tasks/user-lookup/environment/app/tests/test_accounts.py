import unittest

import accounts


class TestAccounts(unittest.TestCase):
    def test_1(self):
        self.assertEqual(accounts.display_name("ada"), "ada <ada@example.com>")
