import unittest

import appconf


class TestAppconf(unittest.TestCase):
    def test_1(self):
        self.assertEqual(appconf.timeout(appconf.load()), 30)

    def test_2(self):
        self.assertEqual(appconf.load()["retries"], 2)
