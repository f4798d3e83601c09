import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import appconf


class TestAppconf(unittest.TestCase):
    def test_1(self):
        self.assertEqual(appconf.timeout(appconf.load()), 30)

    def test_2(self):
        self.assertEqual(appconf.timeout(appconf.load({"timeout": 5})), 5)

    def test_3(self):
        self.assertEqual(appconf.load({"retries": 4})["retries"], 4)
