from slugs.make import slugify

__all__ = ["slugify"]
