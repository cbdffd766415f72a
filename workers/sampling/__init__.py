"""Logits to tokens: the batched sampler, its filters, penalties and per-request rows."""
