"""Where and how the ranks compute: dtype, device, CPU threads, and the executor for a TP degree.

These are the factories the engine calls at start; they live with the workers because they only
need the workers' own knowledge (the CPU's flags, CUDA, the cluster's resources, the executors).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from scheduler.config import GPU_MAX_NUM_SEQS
from workers.cpu.kernels import cpu_flags
from workers.executors.executor import Executor
from workers.model.config import ModelConfig
from workers.worker import WorkerConfig

logger = logging.getLogger(__name__)


def cpu_has_fast_bf16(cpuinfo_path: str = "/proc/cpuinfo",
                      bf16_panels: Callable[[], bool] = lambda: True) -> bool:
    """Whether bf16 serves faster than float32 on this CPU. AVX512-BF16 or AMX: bf16 matmuls run
    ~2x faster than fp32 (measured 0.63 vs 1.43 ms for a 32 x 576 x 3072 linear on a Xeon, one
    thread). AVX2 + FMA without AVX-512: the avx2 kernel build's bf16 panels, float32 FMAs on
    weights widened in registers, read half the bytes a token (a 2-core Zen 3, the default model in
    process: decode steps 1.65x / 1.24x / 1.19x float32's at 1 / 16 / 64 requests, prefill even).
    There only where `bf16_panels()` says the panels serve (asked only on that path): torch's own
    bf16 GEMM there is emulated, ~9x slower. Not AVX-512 without AVX512-BF16 (Skylake-SP to Ice
    Lake): its 512-bit build has no bf16 panels, so bf16 would fall back to slower GEMMs there.
    No cpuinfo: False."""
    flags = cpu_flags(cpuinfo_path)
    if {"avx512_bf16", "amx_bf16"} & flags:
        return True
    return {"avx2", "fma"} <= flags and "avx512f" not in flags and bf16_panels()


def kernels_serve_bf16(cpu_kernels: str) -> bool:
    """Whether tpserve's CPU kernels load in this process under the config's `cpu_kernels`
    (building this CPU's variant if it is missing; a rank loads the same one) with bf16 panels.
    A failed build under "auto" logs why and answers False; under "on" it raises
    kernels.KernelsUnavailable, as the rank would."""
    from workers.cpu import kernels

    if kernels.load(cpu_kernels) and kernels.ops().panel_linear_bf16_available():
        return True
    if cpu_kernels != "off":
        logger.warning("dtype auto: float32, since tpserve's bf16 CPU kernels did not load (torch's bf16 GEMM "
                       "on this CPU is emulated)")
    return False


def resolve_dtype(name: str, device: str, cpu_kernels: str = "auto") -> torch.dtype:
    """"auto": bfloat16 on GPU and on CPUs where it serves faster than float32 (cpu_has_fast_bf16,
    with the kernels loaded under the config's cpu_kernels where that depends on them), else
    float32. float16 is refused on CPU: its kernels and oneDNN paths take float32 or bfloat16."""
    if name == "float16" and device == "cpu":
        raise ValueError("dtype: float16 is not supported on CPU; use bfloat16, float32 or auto")
    if name == "auto":
        fast_bf16 = device == "cuda" or cpu_has_fast_bf16("/proc/cpuinfo", lambda: kernels_serve_bf16(cpu_kernels))
        return torch.bfloat16 if fast_bf16 else torch.float32
    return getattr(torch, name)


def worker_device(tensor_parallel_size: int) -> str:
    """Where the ranks run. With TP > 1 the replica holds no GPU itself (its workers do), so the
    cluster is asked rather than this process."""
    if tensor_parallel_size > 1:
        from workers.distributed.placement import cluster_has_gpus

        return "cuda" if cluster_has_gpus() else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def set_cpu_threads(cpu_threads: int | None) -> None:
    """torch's intra-op threads: as asked, else every core this process may run on."""
    torch.set_num_threads(cpu_threads or len(os.sched_getaffinity(0)))


def make_executor(worker_config: WorkerConfig, tensor_parallel_size: int, placement_strategy: str,
                  step_timeout_s: float, cpu_threads: int | None) -> Executor:
    """In-process for TP=1 (no actor hop per step); one Ray actor per rank otherwise."""
    if tensor_parallel_size == 1:
        from workers.executors.executor import InProcessExecutor

        return InProcessExecutor(worker_config)
    from workers.executors.ray_executor import RayExecutor

    return RayExecutor(worker_config, tensor_parallel_size, placement_strategy,
                       step_timeout_s=step_timeout_s, num_threads_per_rank=cpu_threads)


# ---- step sizes on a GPU -----------------------------------------------------------------------
# The step fields `gpu_step_defaults` derives when the device is CUDA and the user left them unset.
# On CPU the configured defaults stand exactly as they are (64 / 2048 / 256 / 2048).
STEP_SIZE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "max_cuda_graph_batch_size", "max_cuda_graph_tokens")
# vLLM's defaults on large GPUs (H100/H200 class, its OpenAI server): 256 sequences (GPU_MAX_NUM_SEQS,
# scheduler/config.py), 8192 tokens.
GPU_MAX_BATCHED_TOKENS = 8192
# Fewest sequences and tokens a GPU default goes down to (a GPU barely larger than the weights).
GPU_MIN_NUM_SEQS = 16
GPU_MIN_BATCHED_TOKENS = 2048
# Tokens of KV cache each running sequence should find on average, for max_num_seqs to be worth
# its graphs and sampler rows: fewer and the scheduler preempts instead of running them.
KV_TOKENS_PER_SEQ = 1024
# Share of the KV room the worst step's activations (max_num_batched_tokens of them) may take.
STEP_ACTIVATION_SHARE = 0.05
# Token-row graphs (workers/runner/cuda_graph.py) replay steps of up to this many tokens; larger
# steps run eagerly. Their pool grows with rows, so it stays at the tested 2048 on every GPU.
GPU_MAX_GRAPH_TOKENS = 2048


@dataclass(frozen=True)
class StepSizes:
    # Most requests running at once (WorkerConfig / SchedulerConfig max_num_seqs).
    max_num_seqs: int
    # The scheduler's step token budget (prefill chunks + decodes).
    max_num_batched_tokens: int
    # Largest decode batch captured in a CUDA graph.
    max_cuda_graph_batch_size: int
    # Largest step (tokens) replayed through token-row graphs.
    max_cuda_graph_tokens: int
    # How they were derived, for the startup log.
    note: str = ""


def weight_bytes_per_rank(cfg: ModelConfig, dtype_bytes: int, tensor_parallel_size: int) -> int:
    """Parameter bytes one rank holds (embeddings, untied head, attention, MLP; norms are noise)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    vocab = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_hidden_layers * per_layer + vocab) * dtype_bytes // tensor_parallel_size


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, tensor_parallel_size: int) -> int:
    """K and V of one token in every layer, on one rank (KV heads split over ranks, at least one)."""
    heads = max(1, cfg.num_key_value_heads // tensor_parallel_size)
    return 2 * cfg.num_hidden_layers * heads * cfg.head_dim * dtype_bytes


def step_activation_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, tensor_parallel_size: int) -> int:
    """Live activations per token of a step at the MLP, the widest point: the residual and normed
    hidden states, q/k/v, and gate+up plus their product, on one rank (one layer at a time)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sharded = (q + 2 * kv + 3 * cfg.intermediate_size) // tensor_parallel_size
    return (3 * cfg.hidden_size + sharded) * dtype_bytes


def gpu_step_defaults(free_bytes: int | None, cfg: ModelConfig, dtype_bytes: int, tensor_parallel_size: int,
                      gpu_memory_utilization: float) -> StepSizes:
    """Step sizes for a GPU with `free_bytes` free on each rank (None: unknown, e.g. ranks on
    other nodes: vLLM's large-GPU defaults).

    KV room = utilization x free - weights. max_num_seqs: the largest power of two up to 256
    whose sequences find KV_TOKENS_PER_SEQ tokens of room each (at least 16). The step budget:
    the largest of 8192, 4096, 2048 whose activations take at most 5% of the room, and at least
    max_num_seqs (every running sequence decodes in one step). Graphs capture up to max_num_seqs
    rows, and token-row graphs up to min(2048, budget) tokens. Pure: tested on CPU.
    """
    if free_bytes is None:
        return StepSizes(GPU_MAX_NUM_SEQS, GPU_MAX_BATCHED_TOKENS, GPU_MAX_NUM_SEQS, GPU_MAX_GRAPH_TOKENS,
                         "free GPU memory unknown here: vLLM's large-GPU defaults")
    room = max(0, int(gpu_memory_utilization * free_bytes) - weight_bytes_per_rank(cfg, dtype_bytes,
                                                                                   tensor_parallel_size))
    room_tokens = room // kv_bytes_per_token(cfg, dtype_bytes, tensor_parallel_size)
    seqs = GPU_MAX_NUM_SEQS
    while seqs > GPU_MIN_NUM_SEQS and seqs * KV_TOKENS_PER_SEQ > room_tokens:
        seqs //= 2
    per_token = step_activation_bytes_per_token(cfg, dtype_bytes, tensor_parallel_size)
    budget = GPU_MAX_BATCHED_TOKENS
    while budget > GPU_MIN_BATCHED_TOKENS and budget * per_token > STEP_ACTIVATION_SHARE * room:
        budget //= 2
    budget = max(budget, seqs)
    note = (f"{gpu_memory_utilization:.2f} x {free_bytes / (1 << 30):.1f} GiB free - weights "
            f"{weight_bytes_per_rank(cfg, dtype_bytes, tensor_parallel_size) / (1 << 30):.1f} GiB leaves KV room "
            f"for {room_tokens} tokens")
    return StepSizes(seqs, budget, seqs, min(GPU_MAX_GRAPH_TOKENS, budget), note)


def resolve_step_sizes(configured: StepSizes, user_set: set[str] | frozenset[str], device: str,
                       derive: Callable[[], StepSizes]) -> StepSizes:
    """The step sizes a server runs with: on GPU, what `derive()` gives for every field the user
    left unset (derive is called only then); on CPU, or where the user set a field, the
    configured value. Logs the GPU derivation once."""
    unset = [f for f in STEP_SIZE_FIELDS if f not in user_set]
    if device != "cuda" or not unset:
        return configured
    derived = derive()
    values = {f: getattr(derived if f in unset else configured, f) for f in STEP_SIZE_FIELDS}
    # A user's budget below the derived max_num_seqs still has to fit every decode of a step.
    if "max_num_seqs" in unset and "max_num_batched_tokens" not in unset:
        values["max_num_seqs"] = min(values["max_num_seqs"], values["max_num_batched_tokens"])
    values["max_cuda_graph_tokens"] = min(values["max_cuda_graph_tokens"], values["max_num_batched_tokens"])
    resolved = StepSizes(**values, note=derived.note)
    logger.info("GPU step sizes (%s derived: %s): max_num_seqs %d, max_num_batched_tokens %d, "
                "max_cuda_graph_batch_size %d, max_cuda_graph_tokens %d", ", ".join(unset), derived.note,
                resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.max_cuda_graph_batch_size,
                resolved.max_cuda_graph_tokens)
    return resolved
