from tags.store import add_tag

__all__ = ["add_tag"]
