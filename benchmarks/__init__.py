"""Benchmarks and the soak: `make bench`, `make soak` and the named targets; each prints a table."""
