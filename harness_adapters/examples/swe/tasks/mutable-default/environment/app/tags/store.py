def add_tag(tag, tags=[]):
    """`tags` with `tag` added (a new list when none is given)."""
    tags.append(tag)
    return tags
