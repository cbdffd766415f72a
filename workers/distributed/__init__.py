"""Tensor-parallel plumbing: the TP group and its collectives, the control channel, placement and ports."""
