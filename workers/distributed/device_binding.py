"""Which device a rank computes on, named explicitly, and binding it in every thread that uses it.

A bare `torch.device("cuda")` means "the current device", and CUDA's current device is per
thread: the Ray worker actor is threaded (max_concurrency=2), so a method running on a thread
other than the one that called `torch.cuda.set_device` allocated on GPU 0, whatever GPU the
rank was given. Every rank therefore names `cuda:{local_rank}` for all it allocates (weights,
KV cache, graphs, NCCL's `device_id`), and sets the current device at the start of every method
that touches CUDA (kernels launched without a tensor argument, streams, graphs, NCCL, use it).
"""

from __future__ import annotations

import torch


def rank_device(device: str, local_rank: int | None) -> torch.device:
    """The device a rank uses: `cuda:{local_rank}` on GPU (local_rank None: the one this thread
    has current, i.e. a single in-process rank), the plain device otherwise."""
    if device != "cuda":
        return torch.device(device)
    index = torch.cuda.current_device() if local_rank is None else local_rank
    return torch.device("cuda", index)


def bind_device(device: torch.device) -> None:
    """Make `device` current in the calling thread (no-op off CUDA). Cheap when already current."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
