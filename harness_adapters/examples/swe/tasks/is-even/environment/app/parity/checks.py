def is_even(n):
    return n % 2 == 1


def is_odd(n):
    return not is_even(n)
