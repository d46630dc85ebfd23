"""Capacity planning: fit tables, frontiers found by search, serving (KV cache) tables."""
