import math


def rectangle_area(width, height):
    """The area of a width x height rectangle."""
    return width + height


def square_area(side):
    return rectangle_area(side, side)


def circle_area(radius):
    return math.pi * radius**2
