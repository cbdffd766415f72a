"""One rank's lifecycle: device, weights shard, KV sizing, KV allocation, step execution.

`WorkerCore` is plain Python; the in-process executor calls it directly and the Ray worker
actor (tensor parallelism) wraps it, so one rank behaves the same either way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.cpu import kernels
from workers.cpu.linear import (LAYOUT_AMX, LAYOUT_PAIRS, LAYOUT_PANEL, LAYOUT_PLAIN, PANEL_ALL_ROWS,
                                calibrate_panel_rows, needs_onednn,
                                can_prepack, packable_in_sixteens, pair_panels_win, prepack_linears)
from workers.runner.cuda_graph import CudaGraphRunner, make_graph_runner
from workers.runner.kv_cache import (GiB, KVCacheSpec, allocate_kv_cache, gpu_kv_budget, kv_spec_for,
                                     max_model_len_for_blocks, num_blocks_for_budget)
from workers.model.backend import TORCH, TorchBackend, select_backend
from workers.model.decoder import DecoderForCausalLM, build_model
from workers.model.config import ModelConfig
from workers.model.tp_layers import local_attention_heads
from workers.runner.model_runner import ModelRunner
from workers.distributed.device_binding import bind_device, rank_device
from workers.distributed.parallel_state import TPGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    # HF model folder.
    model_path: str
    # Weights and KV dtype.
    dtype: torch.dtype
    # Tokens per KV block.
    block_size: int
    # Longest sequence (sizes the RoPE table).
    max_model_len: int
    # KV cache budget per rank on CPU, GiB.
    kv_cache_memory_gib: float
    # Fraction of GPU memory to use on GPU.
    gpu_memory_utilization: float
    # "cpu" or "cuda".
    device: str
    # GPU only: run decode eagerly instead of replaying CUDA graphs.
    enforce_eager: bool = False
    # Most requests running at once, and the cap on the largest captured decode batch.
    max_num_seqs: int = 64
    # The scheduler's step token budget (prefill chunks + decodes): GPU memory is profiled for a
    # step of this many prefill tokens at the deepest context plus max_num_seqs decodes.
    max_num_batched_tokens: int = 2048
    # "auto": the *.safetensors in model_path; "dummy": random weights from config.json alone
    # (workers/model/dummy_weights.py), for benchmarks at any architecture's shapes.
    load_format: str = "auto"
    # Seed of the dummy weights.
    dummy_seed: int = 0
    max_cuda_graph_batch_size: int = 256
    # GPU only: steps with prefill tokens of up to this many tokens in all replay graphs too, one
    # row per token (workers/runner/cuda_graph.py, token rows); 0: decode-only graphs.
    max_cuda_graph_tokens: int = 0
    # Decode attention kernel on GPU: "auto", "torch", "flash_attn" or "flashinfer".
    decode_attention: str = "auto"
    # CPU only: prepack linear weights for oneDNN once after loading (workers/cpu/linear.py).
    cpu_prepack_linear: bool = True
    # CPU only: tpserve's own kernels (workers/cpu/kernels.py): "auto" where they load, "on" or
    # fail at load, "off" torch ops (workers/model/backend.py).
    cpu_kernels: str = "auto"
    # CPU, with prepacking and the kernels: batches of up to as many rows as panel_linear was
    # timed faster than oneDNN at load (float32 on a copy of each weight in panels, on a Zen 3
    # every batch; bf16 with AVX512-BF16 but no AMX on bf16 panels or, where vdpbf16ps is timed
    # faster, k-pair panels, on a Zen 4 every batch), 64 (bf16 with AMX: amx_linear on an AMX
    # tile copy), else 8 (bf16 with AVX512-BF16 only: skinny_linear on the plain weight) run
    # tpserve's own kernel (workers/cpu/linear.py).
    cpu_small_batch_linear: bool = True
    # CPU, with the kernels: prefill chunks through the kernels' flash attention over the paged
    # cache (workers/cpu/csrc/prefill_attention.cpp) instead of torch's SDPA, in the dtypes and on
    # the CPUs where workers/attention/cpu_prefill_choice.py prefill_kernel_serves says it is faster.
    cpu_prefill_attention: bool = True
    # CPU, one rank, with the kernels: the layer loop as one call into them for the models it
    # serves (workers/model/cpu_layer_stack.py).
    cpu_layer_stack: bool = True
    # CPU kernels, one rank: greedy batches of 1-2 rows take their tokens from an int8 copy
    # of the LM head and an exact pass over the few vocabulary rows it leaves
    # (workers/model/greedy_lm_head.py).
    cpu_greedy_lm_head: bool = True


@dataclass
class WorkerLoadReport:
    # This rank.
    rank: int
    # Bytes of parameters held by this rank.
    param_bytes: int
    # Seconds spent loading weights.
    load_time: float
    # Blocks that fit this rank's KV budget.
    num_blocks: int
    # Bytes of one block on this rank (all layers, K and V).
    bytes_per_block: int
    # The KV budget in bytes and how it was derived, for the startup log.
    kv_budget_bytes: int
    budget_note: str
    # The longest request this rank serves: the configured max_model_len, or (GPU) less when the
    # cache cannot hold one request of it or its worst step fits only shorter (capped, with a
    # warning line: workers/runner/kv_cache.py, workers/runner/profiling.py).
    max_model_len: int


class WorkerCore:
    def __init__(self, config: WorkerConfig, tp: TPGroup, local_rank: int | None = None) -> None:
        self.config = config
        self.tp = tp
        # cuda:{local_rank} on GPU (never a bare "cuda": workers/distributed/device_binding.py).
        self.device = rank_device(config.device, local_rank)
        # max_model_len as the KV cache allows (set by load_model, then by init_kv_cache).
        self.max_model_len = config.max_model_len
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        self.model: DecoderForCausalLM | None = None
        self.runner: ModelRunner | None = None
        self.kv_spec: KVCacheSpec | None = None
        # How this rank computes (torch ops, or tpserve's CPU kernels), chosen once at load.
        self.backend: TorchBackend = TORCH
        # What load_model reported (None before it ran).
        self.load_report: WorkerLoadReport | None = None

    def load_model(self) -> WorkerLoadReport:
        start = time.perf_counter()
        cfg = self.config
        bind_device(self.device)
        mc = self.model_config
        heads = (*local_attention_heads(mc.num_attention_heads, mc.num_key_value_heads, self.tp.world_size),
                 mc.head_dim)
        self.backend = select_backend(self.device, cfg.dtype, cfg.cpu_kernels,
                                      prefill_attention=cfg.cpu_prefill_attention, layer_stack=cfg.cpu_layer_stack,
                                      heads=heads)
        with torch.device(self.device):
            model = build_model(self.model_config, self.tp, cfg.dtype, max_positions=cfg.max_model_len,
                                backend=self.backend)
        if cfg.load_format == "dummy":
            param_bytes = model.load_dummy_weights(cfg.dummy_seed)
        else:
            param_bytes = model.load_weights(cfg.model_path)
        if cfg.cpu_prepack_linear and self.device.type == "cpu":
            rows, layout = self._small_batch_rows(model)
            if can_prepack(self.device, cfg.dtype) or not needs_onednn(rows, layout):
                prepack_linears(model, small_batch_rows=rows, layout=layout)
        model.build_layer_stack()
        if cfg.cpu_greedy_lm_head:
            model.build_greedy_lm_head()
        self.model = model.eval()
        load_time = time.perf_counter() - start
        self.kv_spec = kv_spec_for(self.model_config, cfg.block_size, model.num_local_kv_heads, cfg.dtype)
        budget, note = self._kv_budget(param_bytes)
        num_blocks = num_blocks_for_budget(self.kv_spec, budget)
        if self.device.type == "cuda":  # on CPU the cache size is the user's own setting: admission checks it
            self.max_model_len = max_model_len_for_blocks(num_blocks, cfg.block_size, self.max_model_len, note)
        self.load_report = WorkerLoadReport(
            rank=self.tp.rank,
            param_bytes=param_bytes,
            load_time=load_time,
            num_blocks=num_blocks,
            bytes_per_block=self.kv_spec.bytes_per_block,
            kv_budget_bytes=budget,
            budget_note=note,
            max_model_len=self.max_model_len,
        )
        return self.load_report

    def _small_batch_rows(self, model: torch.nn.Module) -> tuple[int, str]:
        """Rows up to which projections take one of tpserve's kernels (0: off, or no such kernel
        here), and the layout of the weight copy that kernel reads (cpu_linear.LAYOUT_*)."""
        cfg = self.config
        if not (cfg.cpu_small_batch_linear and self.backend.name == "cpu_kernels"):
            return 0, LAYOUT_PLAIN
        ops = kernels.ops()
        shapes = tuple(tuple(m.weight.shape) for m in model.layers[0].modules() if hasattr(m, "packed_weight"))
        if cfg.dtype == torch.float32:
            if (not shapes or not ops.panel_linear_available() or not packable_in_sixteens(model)
                    or not can_prepack(self.device, torch.float32)):  # the calibration times oneDNN
                return 0, LAYOUT_PLAIN
            # How far it beats oneDNN depends on the CPU: timed once per process.
            return calibrate_panel_rows(shapes)[0], LAYOUT_PANEL
        if cfg.dtype == torch.bfloat16:
            amx_rows = int(ops.amx_linear_max_rows())  # 0 without AMX
            if amx_rows and packable_in_sixteens(model):
                return amx_rows, LAYOUT_AMX
            if shapes and ops.panel_linear_bf16_available() and packable_in_sixteens(model):
                # Pair panels where this CPU runs them faster than the widened ones.
                pairs = packable_in_sixteens(model, pairs=True) and pair_panels_win(shapes)
                layout = LAYOUT_PAIRS if pairs else LAYOUT_PANEL
                if not can_prepack(self.device, torch.bfloat16):
                    # No oneDNN bf16 GEMM here (AVX2 without AVX512-BF16): nothing to time the
                    # panels against, and torch's own bf16 GEMM is far slower (linear.py).
                    return PANEL_ALL_ROWS, layout
                panel_rows = calibrate_panel_rows(shapes, torch.bfloat16, pairs)[0]
                if panel_rows:
                    return panel_rows, layout
            return int(ops.skinny_linear_max_rows_bf16()), LAYOUT_PLAIN  # 0 without AVX512-BF16
        return 0, LAYOUT_PLAIN

    def _kv_budget(self, param_bytes: int) -> tuple[int, str]:
        cfg = self.config
        if self.device.type != "cuda":
            budget = int(cfg.kv_cache_memory_gib * GiB)
            return budget, f"kv_cache_memory_gib={cfg.kv_cache_memory_gib} (CPU)"
        from workers.runner.profiling import profile_memory

        profile = profile_memory(self.model, self.device, cfg, param_bytes)
        if profile.max_model_len is not None:  # shorter when the worst step fits only there (logged)
            self.max_model_len = min(self.max_model_len, profile.max_model_len)
        return gpu_kv_budget(profile, cfg.gpu_memory_utilization)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks (the minimum over ranks) and, on GPU, capture the graphs for the
        max_model_len those blocks hold, so that every rank captures the same list."""
        assert self.model is not None and self.kv_spec is not None
        bind_device(self.device)
        if self.device.type == "cuda":
            self.max_model_len = max_model_len_for_blocks(num_blocks, self.config.block_size, self.max_model_len,
                                                          log=False)
        kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        stop_ids = tuple(self.model_config.eos_token_ids)
        graph_runner = self._make_graph_runner(kv_caches) if self.device.type == "cuda" else None
        self.runner = ModelRunner(self.model, kv_caches, self.config.block_size, self.device, stop_ids,
                                  graph_runner=graph_runner, backend=self.backend)

    def _make_graph_runner(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> CudaGraphRunner:
        """GPU decode runner; its graphs are captured now (the KV cache exists) unless enforce_eager.
        With tensor parallelism every rank captures the same list: the eager warm-up before each
        capture has already initialised the NCCL communicator, so the all-reduces are recorded."""
        cfg = self.config
        runner = make_graph_runner(
            self.model, kv_caches, block_size=cfg.block_size, max_model_len=self.max_model_len,
            max_num_seqs=cfg.max_num_seqs, max_cuda_graph_batch_size=cfg.max_cuda_graph_batch_size,
            dtype=cfg.dtype, device=self.device, attention_backend=cfg.decode_attention,
            max_graph_tokens=cfg.max_cuda_graph_tokens,
        )
        if not cfg.enforce_eager:
            runner.capture()
        return runner

    def release(self) -> None:
        """Drop the model, the KV cache and the graphs (the worker is done); on a GPU the
        allocator's cache is emptied so that the device's memory is free for others."""
        self.runner = None
        self.model = None
        if self.device.type == "cuda":
            bind_device(self.device)
            torch.cuda.empty_cache()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.runner is not None, "init_kv_cache must run before execute_model"
        return self.runner.execute_model(scheduler_output)
