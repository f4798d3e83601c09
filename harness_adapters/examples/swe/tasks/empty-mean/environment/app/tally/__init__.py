from tally.summary import mean, spread

__all__ = ["mean", "spread"]
