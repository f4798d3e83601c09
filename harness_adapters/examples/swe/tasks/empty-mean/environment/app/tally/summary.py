def mean(values):
    """The arithmetic mean; 0.0 for no values."""
    return sum(values) / len(values)


def spread(values):
    """The largest value minus the smallest; 0 for no values."""
    if not values:
        return 0
    return max(values) - min(values)
