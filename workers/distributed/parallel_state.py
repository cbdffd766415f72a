"""The tensor-parallel group a layer belongs to: rank, size and the collectives layers use.

Passed explicitly to every layer's constructor (no module globals). With world_size 1 every
collective is the identity, so the same model code serves one rank and N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    # This process's rank within the tensor-parallel group.
    rank: int = 0
    # Ranks in the group.
    world_size: int = 1
    # The torch.distributed process group (None for a single rank).
    group: Any = None

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim_to_first_rank(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's shard along the last dim on rank 0; other ranks get None."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        shards = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, shards, dst=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return torch.cat(shards, dim=-1) if self.rank == 0 else None


SINGLE_RANK = TPGroup()


# NCCL settings for ranks that capture all-reduces in CUDA graphs, unless the user set them.
# NCCL_CUMEM_ENABLE=0: with NCCL's cuMem allocator, captured collectives can take 1-2 GiB per
# GPU that the KV budget never saw (vLLM sets the same).
NCCL_DEFAULTS = {"NCCL_CUMEM_ENABLE": "0"}


def nccl_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL variables to set: the defaults the environment does not already choose."""
    return {name: value for name, value in NCCL_DEFAULTS.items() if name not in environ}


def local_device_assignment(ranks: list[tuple[str, list[str]]]) -> list[tuple[list[str], int]]:
    """Per rank, from its (node id, GPU ids Ray gave it): the GPUs it should see (every GPU held
    by a rank on its node, in id order) and the index of its own among them (its local rank)."""
    by_node: dict[str, set[str]] = {}
    for node, gpus in ranks:
        if len(gpus) != 1:
            raise ValueError(f"each tensor-parallel rank needs exactly one GPU, got {gpus} on node {node}")
        by_node.setdefault(node, set()).update(gpus)
    visible = {node: sorted(gpus, key=lambda g: (len(g), g)) for node, gpus in by_node.items()}
    return [(visible[node], visible[node].index(gpus[0])) for node, gpus in ranks]
