from accounts.service import display_name, find

__all__ = ["display_name", "find"]
