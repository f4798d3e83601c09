from shapes.area import circle_area, rectangle_area, square_area

__all__ = ["circle_area", "rectangle_area", "square_area"]
