"""Bunshin-Shell-v0: a terminal workspace; actions are shell commands."""
