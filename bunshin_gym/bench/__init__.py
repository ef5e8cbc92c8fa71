"""Benchmarks: each prints a table and writes JSON (``bunshin bench NAME --json PATH``)."""
