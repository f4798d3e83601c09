def split_row(line, sep=";"):
    """The fields of one comma-separated line, stripped of spaces."""
    return [field.strip() for field in line.split(sep)]


def join_row(fields, sep=","):
    """One comma-separated line from fields."""
    return sep.join(str(field) for field in fields)
