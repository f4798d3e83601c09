def first(items):
    """The first item, or None for an empty list."""
    return items[0] if items else None


def last(items):
    """The last item, or None for an empty list."""
    return items[len(items)] if items else None
