"""The decoder-only model: its config, layers, tensor-parallel shards, weight loading and the embedded default model."""
