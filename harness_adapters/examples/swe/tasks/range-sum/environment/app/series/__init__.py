from series.sums import total, total_squares

__all__ = ["total", "total_squares"]
