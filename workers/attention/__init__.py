"""Paged attention over the KV cache: the mixed-batch path, the graph-safe decode backends and the Triton kernel."""
