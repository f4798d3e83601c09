from csvlite.rows import join_row, split_row

__all__ = ["join_row", "split_row"]
