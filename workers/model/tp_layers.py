"""Tensor-parallel layers that own their shard (Megatron-style).

Each layer computes its local sizes in the constructor and carries a `weight_loader` that copies
its slice out of a full checkpoint tensor. The checkpoint tensor may be a safetensors slice
object: indexing it reads only the requested rows/columns from disk, so a rank holds ~1/N of the
sharded weights and never the whole matrix.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.cpu.linear import linear
from workers.distributed.parallel_state import TPGroup
from scheduler.math_utils import cdiv


def _as_tensor(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def local_attention_heads(num_heads: int, num_kv_heads: int, world_size: int) -> tuple[int, int]:
    """(query heads, KV heads) on each of `world_size` ranks: query heads split evenly; KV heads
    split evenly, or one a rank where there are fewer KV heads than ranks (each then replicated)."""
    local_heads = divide(num_heads, world_size, "num_attention_heads")
    if num_kv_heads >= world_size:
        return local_heads, divide(num_kv_heads, world_size, "num_key_value_heads")
    return local_heads, 1


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns (output features).

        A = [A_0 | A_1 | ... | A_{N-1}]      rank r holds A_r and computes Y_r = X A_r
    The output stays sharded; the next layer is row-parallel and consumes it as is.
    """

    def __init__(self, input_size: int, output_sizes: list[int], tp: TPGroup, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp = tp
        # Sub-matrices stacked along the output dim (gate and up, say), each split across ranks.
        self.output_sizes = output_sizes
        self.local_sizes = [divide(s, tp.world_size, "output features") for s in output_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(sum(self.local_sizes), dtype=dtype), requires_grad=False) if bias else None
        # The weight prepacked for oneDNN on CPU (workers/cpu/linear.py); None = F.linear.
        self.packed_weight: torch.Tensor | None = None
        # Batches of up to this many rows take a small-batch kernel on small_batch_weight (0 = never).
        self.small_batch_rows = 0
        # The weight as that kernel reads it (workers/cpu/linear.py): the plain one, a panel or an AMX copy.
        self.small_batch_weight: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int = 0) -> None:
        local = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        start = self.tp.rank * local
        param.data[offset : offset + local].copy_(_as_tensor(loaded[start : start + local]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight, self.small_batch_rows, self.small_batch_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; heads split across ranks.

        Q heads: [q_0 .. q_{H-1}]   rank r takes H/N consecutive heads
        K/V heads: KV/N per rank; when KV < N each KV head is replicated on N/KV ranks
                   (rank r uses KV head r * KV // N), as vLLM does.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TPGroup,
                 bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        n = tp.world_size
        self.num_local_heads, self.num_local_kv_heads = local_attention_heads(num_heads, num_kv_heads, n)
        self.kv_replicas = 1 if num_kv_heads >= n else divide(n, num_kv_heads,
                                                               "tensor_parallel_size over num_key_value_heads")
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        super().__init__(hidden_size, [num_heads * head_dim], tp, bias, dtype)
        q_local = self.num_local_heads * head_dim
        kv_local = self.num_local_kv_heads * head_dim
        self.local_sizes = [q_local, kv_local, kv_local]
        self.weight = nn.Parameter(torch.empty(q_local + 2 * kv_local, hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(q_local + 2 * kv_local, dtype=dtype), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int = 0) -> None:
        # shard_id 0 = q, 1 = k, 2 = v
        local = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        head_index = self.tp.rank if shard_id == 0 else self.tp.rank // self.kv_replicas
        start = head_index * local
        param.data[offset : offset + local].copy_(_as_tensor(loaded[start : start + local]))


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows (input features); partial sums are all-reduced.

        A = [A_0; A_1; ...; A_{N-1}]   X = [X_0 | ... | X_{N-1}]   Y = Σ_r X_r A_r
    The bias is added after the reduction (held on every rank, applied once).
    """

    def __init__(self, input_size: int, output_size: int, tp: TPGroup, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp = tp
        self.local_input = divide(input_size, tp.world_size, "input features")
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False) if bias else None
        # The weight prepacked for oneDNN on CPU (workers/cpu/linear.py); None = F.linear.
        self.packed_weight: torch.Tensor | None = None
        # Batches of up to this many rows take a small-batch kernel on small_batch_weight (0 = never).
        self.small_batch_rows = 0
        # The weight as that kernel reads it (workers/cpu/linear.py): the plain one, a panel or an AMX copy.
        self.small_batch_weight: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int = 0) -> None:
        if param is self.bias:
            param.data.copy_(_as_tensor(loaded))
            return
        start = self.tp.rank * self.local_input
        param.data.copy_(_as_tensor(loaded[:, start : start + self.local_input]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed_weight, self.small_batch_rows, self.small_batch_weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank embeds the ids it owns, zeros the
    rest, and an all-reduce assembles the result.

        rows [r*V/N, (r+1)*V/N) live on rank r   (V padded up to a multiple of N)
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = cdiv(vocab_size, tp.world_size)
        self.vocab_start = tp.rank * self.local_vocab
        self.vocab_end = min(self.vocab_start + self.local_vocab, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden_size, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int = 0) -> None:
        rows = self.vocab_end - self.vocab_start
        if rows > 0:
            param.data[:rows].copy_(_as_tensor(loaded[self.vocab_start : self.vocab_end]))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection split by vocabulary rows like the embedding; logits shards are
    gathered on rank 0 (the only rank that samples), padding columns cut off."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(vocab_size, hidden_size, tp, dtype)
        # The weight prepacked for oneDNN on CPU (workers/cpu/linear.py); None = F.linear.
        self.packed_weight: torch.Tensor | None = None
        # Batches of up to this many rows take a small-batch kernel on small_batch_weight (0 = never).
        self.small_batch_rows = 0
        # The weight as that kernel reads it (workers/cpu/linear.py): the plain one, a panel or an AMX copy.
        self.small_batch_weight: torch.Tensor | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local_logits = linear(hidden, self.weight, None, self.packed_weight, self.small_batch_rows, self.small_batch_weight)
        logits = self.tp.gather_last_dim_to_first_rank(local_logits)
        if logits is None:
            return None
        return logits[..., : self.vocab_size]
