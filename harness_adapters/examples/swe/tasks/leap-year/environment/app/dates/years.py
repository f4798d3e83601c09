def is_leap(year):
    """Gregorian leap years: every 4th, except centuries, except every 400th."""
    return year % 4 == 0 and year % 100 != 0


def days_in_year(year):
    return 366 if is_leap(year) else 365
