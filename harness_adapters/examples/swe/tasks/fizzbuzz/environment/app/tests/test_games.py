import unittest

import games


class TestGames(unittest.TestCase):
    def test_1(self):
        self.assertEqual(games.fizzbuzz(15), "FizzBuzz")
