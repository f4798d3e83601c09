ADULT_AGE = 18


def is_adult(age):
    """True from the age of 18."""
    return age > ADULT_AGE
