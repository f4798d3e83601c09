def page_count(total, per_page):
    """How many pages `total` items fill, `per_page` to a page."""
    return total // per_page


def page(items, number, per_page):
    """The items of page `number` (1 is the first)."""
    start = (number - 1) * per_page
    return items[start : start + per_page]
