"""The tensor-parallel group a layer belongs to: rank, size and the collectives layers use.

Passed explicitly to every layer's constructor (no module globals). With world_size 1 every
collective is the identity, so the same model code serves one rank and N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
