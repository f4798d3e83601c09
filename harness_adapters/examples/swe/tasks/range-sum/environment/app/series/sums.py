def total(n):
    """1 + 2 + ... + n."""
    return sum(range(1, n))


def total_squares(n):
    """1 + 4 + ... + n * n."""
    return sum(i * i for i in range(1, n + 1))
