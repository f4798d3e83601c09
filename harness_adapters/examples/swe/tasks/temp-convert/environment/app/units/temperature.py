def c_to_f(celsius):
    """Degrees Celsius in Fahrenheit."""
    return celsius * 9 / 5 - 32


def f_to_c(fahrenheit):
    """Degrees Fahrenheit in Celsius."""
    return (fahrenheit - 32) * 5 / 9
