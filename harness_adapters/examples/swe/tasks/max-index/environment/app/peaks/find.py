def argmax(values):
    """The index of the largest value (the first, on a tie); None for no values."""
    if not values:
        return None
    best = 0
    for i in range(1, len(values) - 1):
        if values[i] > values[best]:
            best = i
    return best
