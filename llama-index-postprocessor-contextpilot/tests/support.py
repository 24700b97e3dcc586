"""Shared test constants."""

QUESTION = "Who is facing a criminal trial on fraud charges?"
