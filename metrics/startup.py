"""The startup lines of METRICS.md section 6 (KV cache sizing), as pure formatting functions.

    Rank 0/2: model weights loaded: 0.26 GiB in 1.84 s
    Rank 0/2: memory budget 0.90 x 139.80 GiB = 125.82 GiB: weights 0.26 GiB + activation peak 1.10 GiB + KV cache 124.00 GiB + unassigned 0.46 GiB
    KV cache: 7936 blocks x 16 tokens = 126976 tokens (124.00 GiB per rank)
    Maximum concurrency for 8192 tokens per request: 15.50x

and the labels of the info gauge `tpserve_cache_config_info`.
"""

from __future__ import annotations

GIB = 1024**3


def bytes_to_gib(num_bytes: float) -> float:
    """Bytes in GiB (2**30)."""
    return num_bytes / GIB


def _rank_prefix(rank: int, tensor_parallel_size: int) -> str:
    return f"Rank {rank}/{tensor_parallel_size}"


def format_weights_loaded(weights_bytes: int, load_time: float, rank: int, tensor_parallel_size: int) -> str:
    """`Rank r/N: model weights loaded: S GiB in T s` (the size of this rank's shard)."""
    return (
        f"{_rank_prefix(rank, tensor_parallel_size)}: model weights loaded: "
        f"{bytes_to_gib(weights_bytes):.2f} GiB in {load_time:.2f} s"
    )


def format_memory_budget(
    total_bytes: int,
    memory_utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    kv_cache_bytes: int,
    rank: int,
    tensor_parallel_size: int,
) -> str:
    """How one rank's memory budget (utilization x total memory) was split.

    unassigned = budget - weights - activation peak - KV cache (negative means over budget).
    """
    budget_bytes = memory_utilization * total_bytes
    unassigned_bytes = budget_bytes - weights_bytes - activation_peak_bytes - kv_cache_bytes
    return (
        f"{_rank_prefix(rank, tensor_parallel_size)}: memory budget {memory_utilization:.2f} x "
        f"{bytes_to_gib(total_bytes):.2f} GiB = {bytes_to_gib(budget_bytes):.2f} GiB: "
        f"weights {bytes_to_gib(weights_bytes):.2f} GiB + "
        f"activation peak {bytes_to_gib(activation_peak_bytes):.2f} GiB + "
        f"KV cache {bytes_to_gib(kv_cache_bytes):.2f} GiB + "
        f"unassigned {bytes_to_gib(unassigned_bytes):.2f} GiB"
    )


def format_kv_cache(num_blocks: int, block_size: int, kv_cache_bytes_per_rank: int) -> str:
    """`KV cache: N blocks x B tokens = T tokens (G GiB per rank)`."""
    return (
        f"KV cache: {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens "
        f"({bytes_to_gib(kv_cache_bytes_per_rank):.2f} GiB per rank)"
    )


def max_concurrency(capacity_tokens: int, tokens_per_request: int) -> float:
    """How many requests of `tokens_per_request` tokens fit in the cache at once: capacity / L."""
    return capacity_tokens / tokens_per_request if tokens_per_request > 0 else 0.0


def format_max_concurrency(capacity_tokens: int, tokens_per_request: int) -> str:
    """`Maximum concurrency for L tokens per request: X.XXx` with X = capacity tokens / L."""
    return (
        f"Maximum concurrency for {tokens_per_request} tokens per request: "
        f"{max_concurrency(capacity_tokens, tokens_per_request):.2f}x"
    )


def cache_config_info(
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    tensor_parallel_size: int,
    enable_prefix_caching: bool,
    dtype: object,
) -> dict[str, str]:
    """The labels of `tpserve_cache_config_info` (all strings, keys as in METRICS.md).

    capacity_tokens = num_blocks x block_size; max_concurrency = capacity / max_model_len with
    two decimals; booleans are "true"/"false"; a torch dtype loses its "torch." prefix.
    num_gpu_blocks repeats num_blocks under the label name the Gateway API Inference Extension's
    endpoint picker reads (model-server protocol: blocks of the accelerator's KV cache, here the
    blocks usable by requests on whatever device the cache lives).
    """
    capacity_tokens = num_blocks * block_size
    return {
        "block_size": str(block_size),
        "num_blocks": str(num_blocks),
        "capacity_tokens": str(capacity_tokens),
        "max_model_len": str(max_model_len),
        "max_concurrency": f"{max_concurrency(capacity_tokens, max_model_len):.2f}",
        "tensor_parallel_size": str(tensor_parallel_size),
        "enable_prefix_caching": "true" if enable_prefix_caching else "false",
        "dtype": str(dtype).removeprefix("torch."),
        "num_gpu_blocks": str(num_blocks),
    }
