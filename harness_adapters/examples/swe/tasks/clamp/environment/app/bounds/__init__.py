from bounds.limits import clamp

__all__ = ["clamp"]
