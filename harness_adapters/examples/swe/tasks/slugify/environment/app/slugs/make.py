import re


def slugify(title):
    """A URL slug: lower case, words joined by single hyphens, nothing but a-z and 0-9."""
    words = re.findall(r"[A-Za-z0-9]+", title)
    return "-".join(words)
