import sys
import unittest

sys.path.append("/app")  # after the standard library, which -I keeps first
import games


class TestGames(unittest.TestCase):
    def test_1(self):
        self.assertEqual(games.fizzbuzz(15), "FizzBuzz")

    def test_2(self):
        self.assertEqual(games.fizzbuzz(30), "FizzBuzz")

    def test_3(self):
        self.assertEqual(games.fizzbuzz(9), "Fizz")

    def test_4(self):
        self.assertEqual(games.fizzbuzz(10), "Buzz")

    def test_5(self):
        self.assertEqual(games.fizzbuzz(7), "7")
