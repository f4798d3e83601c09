import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import netretry


class TestNetretry(unittest.TestCase):
    def test_1(self):
        failures = iter([1, 1, 1])

        def action():
            if next(failures, None):
                raise OSError("down")
            return "up"

        self.assertEqual(netretry.call_with_retries(action), "up")

    def test_2(self):
        failures = iter([1, 1, 1, 1])

        def action():
            if next(failures, None):
                raise OSError("down")
            return "up"

        with self.assertRaises(OSError):
            netretry.call_with_retries(action)

    def test_3(self):
        failures = iter([1])

        def action():
            if next(failures, None):
                raise OSError("down")
            return "up"

        with self.assertRaises(OSError):
            netretry.call_with_retries(action, retries=0)
