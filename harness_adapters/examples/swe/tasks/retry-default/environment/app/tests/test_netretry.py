import unittest

import netretry


class TestNetretry(unittest.TestCase):
    def test_1(self):
        failures = iter([1])

        def action():
            if next(failures, None):
                raise OSError("down")
            return "up"

        self.assertEqual(netretry.call_with_retries(action), "up")
