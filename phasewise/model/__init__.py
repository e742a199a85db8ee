"""Checkpoint loading and the transformer forward pass over a paged KV cache."""
