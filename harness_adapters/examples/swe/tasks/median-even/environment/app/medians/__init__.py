from medians.middle import median

__all__ = ["median"]
