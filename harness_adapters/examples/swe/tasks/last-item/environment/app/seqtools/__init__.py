from seqtools.ends import first, last

__all__ = ["first", "last"]
