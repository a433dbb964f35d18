"""TALE toolkit."""
