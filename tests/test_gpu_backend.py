"""CudaBackend (workers/model/backend.py) on CPU, its Triton kernels under TRITON_INTERPRET=1.

* One mixed step's attention (decodes, a chunk from position 0, chunks after cached context) with
  GQA, sliding windows and soft-capping equals TorchBackend's, which gathers and masks: the
  decodes through the Triton paged decode kernel, the chunks through the Triton prefill kernel
  (varlen_attn is CUDA-only), the K/V written by the fused rotary kernel.
* A tiny Llama engine whose layers run on CudaBackend (chunked prefills beside decodes, a chunk
  after a prefix-cache hit, no CUDA graphs) gives the greedy tokens of the torch path.
* Launches per decoder layer: a TorchDispatchMode counts the aten ops each backend issues while
  the fused kernels are stood in for by counting stubs; CudaBackend issues nothing but the four
  GEMMs besides its five kernel calls.
* select_backend: CUDA devices get CudaBackend; CPU backends are unchanged.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (it is in the `test` extra)")

from scheduler.block_pool import NULL_BLOCK_ID  # noqa: E402
from workers.attention.paged import AttentionMetadata, PrefillChunk  # noqa: E402
from workers.model.backend import TORCH, CudaBackend, TorchBackend, select_backend  # noqa: E402
from workers.model.rotary import RotaryEmbedding  # noqa: E402
from workers.runner.decode_inputs import decode_mask, padded_block_tables  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreted CPU stand-in; on CUDA the GPU "
                                "check script runs the compiled kernels")
BLOCK_SIZE = 8


def _mixed_step(heads, kv_heads, head_dim, decodes, chunks, seed=0):
    """decodes: context lengths (this token included); chunks: (cached, query) tokens. Returns
    qkv-view q/k/v, positions, empty caches with the cached context filled in, and metadata for
    the torch path (masks) and the GPU path (lengths and tables)."""
    gen = torch.Generator().manual_seed(seed)
    contexts = list(decodes) + [c + n for c, n in chunks]
    widths = [-(-c // BLOCK_SIZE) for c in contexts]
    num_blocks = 1 + sum(widths) + 2
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for w in widths:
        tables.append(ids[:w])
        ids = ids[w:]
    positions, slots = [], []
    for ctx, table in zip(decodes, tables):
        positions.append(ctx - 1)
    for (cached, n) in chunks:
        positions += list(range(cached, cached + n))
    row_tables = tables[: len(decodes)] + [t for t, (_, n) in zip(tables[len(decodes):], chunks) for _ in range(n)]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, p in zip(row_tables, positions)]
    tokens = len(positions)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)

    nd = len(decodes)
    width = max(widths[:nd], default=1)
    decode_tables = torch.tensor(padded_block_tables(tables[:nd], width)) if nd else None
    prefills, start = [], nd
    for (cached, n), table in zip(chunks, tables[nd:]):
        context = cached + n
        mask = torch.arange(context)[None, :] <= torch.arange(cached, context)[:, None] if cached else None
        prefills.append(PrefillChunk(start, n, context, torch.tensor(table), mask))
        start += n
    slot_mapping = torch.tensor(slots)

    def meta(gpu: bool) -> AttentionMetadata:
        chunk_info = prefill_tables = None
        if gpu and prefills:
            chunk_info = torch.tensor([[c.query_start, c.query_len, c.context_len] for c in prefills],
                                      dtype=torch.int32)
            prefill_tables = torch.tensor(padded_block_tables(tables[nd:], max(widths[nd:])), dtype=torch.int32)
        return AttentionMetadata(
            slot_mapping=slot_mapping, num_decodes=nd, decode_block_tables=decode_tables,
            decode_mask=None if gpu or not nd else decode_mask(torch.tensor(decodes), width * BLOCK_SIZE),
            prefills=[PrefillChunk(c.query_start, c.query_len, c.context_len, c.block_table, None if gpu else c.mask)
                      for c in prefills],
            decode_context_lens=torch.tensor(decodes, dtype=torch.int32) if gpu and nd else None,
            prefill_chunk_info=chunk_info, prefill_block_tables=prefill_tables)

    return qkv, (q, k, v), torch.tensor(positions), (k_cache, v_cache), meta


@pytest.mark.parametrize("heads,kv_heads,window,soft_cap", [
    (4, 4, None, None), (8, 2, None, None), (8, 2, 12, None), (6, 2, None, 5.0), (8, 4, 9, 3.0),
])
def test_mixed_step_attention_matches_the_torch_path(heads, kv_heads, window, soft_cap):
    head_dim = 32
    decodes = [1, 9, 30]
    chunks = [(0, 21), (13, 10), (40, 1 + 1)]
    qkv, (q, k, v), positions, (k_cache, v_cache), meta = _mixed_step(heads, kv_heads, head_dim, decodes, chunks)
    rope = RotaryEmbedding(head_dim, 128, 10000.0, None, torch.float32)
    scale = head_dim ** -0.5
    outs, caches = [], []
    for backend, gpu in ((TORCH, False), (CudaBackend(), True)):
        qc, kc, vc = q.clone(), k.clone(), v.clone()
        k_cache_c, v_cache_c = k_cache.clone(), v_cache.clone()
        outs.append(backend.rope_attention(rope, positions, qc, kc, vc, k_cache_c, v_cache_c, meta(gpu), scale,
                                           window, soft_cap))
        caches.append((k_cache_c, v_cache_c))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(caches[1], caches[0], atol=1e-6, rtol=1e-6)


def _swap_backend(engine, backend: TorchBackend) -> None:
    """Every module of the engine's model (and its runner) on `backend`."""
    worker = engine.executor.worker
    for module in worker.model.modules():
        if hasattr(module, "backend"):
            module.backend = backend
    worker.runner.backend = backend


def test_engine_on_the_cuda_backend_matches_the_torch_path(tmp_path):
    from engine_helpers import greedy, make_engine, run_engine
    from model_fixtures import make_tiny_llama

    path = make_tiny_llama(tmp_path / "llama", num_heads=8, num_kv_heads=2, num_layers=2)
    budget = 12
    settings = dict(block_size=BLOCK_SIZE, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=budget,
                    min_num_batched_tokens=budget, num_batched_tokens_per_request=0, cpu_kernels="off")
    shared = [300 + k for k in range(16)]  # two full blocks: a prefix-cache hit for "d"
    requests = {"a": (shared + [7, 8, 9], greedy(5)), "b": ([500 + k for k in range(9)], greedy(6)),
                "c": ([900, 901, 902], greedy(7))}
    results = []
    for backend in (None, CudaBackend()):
        engine = make_engine(path, **settings)
        if backend is not None:
            _swap_backend(engine, backend)
        out = run_engine(engine, requests)
        out.update(run_engine(engine, {"d": (shared + [11, 12], greedy(4))}))
        results.append(out)
    assert results[1] == results[0]


class CountingKernels:
    """Stands in for workers/attention/triton_fused.py: the torch ops it replaces, run where the
    dispatch counter does not see them, each call counted as one launch."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def _run(self, name, fn):
        self.calls[name] += 1
        with _Paused():
            return fn()

    def rms_norm(self, x, weight, eps, offset):
        return self._run("rms_norm", lambda: F.rms_norm(x, (x.shape[-1],), weight, eps))

    def add_rms_norm(self, residual, x, weight, eps, offset):
        def run():
            summed = residual + x
            return F.rms_norm(summed, (x.shape[-1],), weight, eps), summed
        return self._run("add_rms_norm", run)

    def rotary_write_kv(self, positions, q, k, v, cos, sin, k_cache=None, v_cache=None, slot_mapping=None):
        return self._run("rotary_write_kv", lambda: None)

    def silu_and_mul(self, gate_up):
        return self._run("silu_and_mul", lambda: TORCH.act_and_mul(F.silu, gate_up))


class CountingAttention:
    """Stands in for the paged attention kernels: one launch per call."""

    def __init__(self, calls: Counter) -> None:
        self.calls = calls

    def __call__(self, q, k_cache, v_cache, meta, scale, sliding_window, soft_cap, prefill_kernels):
        self.calls["attention"] += 1
        with _Paused():
            return torch.zeros(q.shape[0], q.shape[1] * q.shape[2])


_PAUSED = [False]


class _Paused:
    def __enter__(self):
        _PAUSED[0] = True

    def __exit__(self, *exc):
        _PAUSED[0] = False


class LaunchCounter(TorchDispatchMode):
    """Aten ops that launch work: views and allocations launch nothing and are not counted."""

    FREE = {"empty", "empty_like", "empty_strided", "view", "_unsafe_view", "t", "split", "split_with_sizes",
            "chunk", "slice", "select", "unsqueeze", "transpose", "expand", "alias", "detach", "reshape"}

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not _PAUSED[0] and not func.is_view and name not in self.FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _one_decode_layer(backend: TorchBackend):
    from workers.distributed.parallel_state import SINGLE_RANK
    from workers.model.config import ModelConfig
    from workers.model.layers import DecoderLayer

    cfg = ModelConfig(path="", architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=False, eos_token_id=None, eos_token_ids=())
    rope = RotaryEmbedding(16, 64, 10000.0, None, torch.float32)
    return cfg, DecoderLayer(cfg, SINGLE_RANK, rope, torch.float32, None, backend)


def test_launches_per_decode_layer(monkeypatch):
    """Per layer of a decode step, after the first (which starts the residual stream)."""
    import workers.attention.gpu_paged as gpu_paged

    kernels = CountingKernels()
    monkeypatch.setattr(gpu_paged, "cuda_paged_attention", CountingAttention(kernels.calls))
    batch = 4
    counts = {}
    for name, backend in (("torch", TORCH), ("cuda", CudaBackend(kernels=kernels, prefill_kernels=object()))):
        cfg, layer = _one_decode_layer(backend)
        caches = (torch.zeros(8, BLOCK_SIZE, 2, 16), torch.zeros(8, BLOCK_SIZE, 2, 16))
        contexts = [3, 5, 9, 2]
        tables = [[1], [2], [3, 4], [5]]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([t[(c - 1) // BLOCK_SIZE] * BLOCK_SIZE + (c - 1) % BLOCK_SIZE
                                       for t, c in zip(tables, contexts)]),
            num_decodes=batch, decode_block_tables=torch.tensor(padded_block_tables(tables, 2)),
            decode_mask=None if name == "cuda" else decode_mask(torch.tensor(contexts), 2 * BLOCK_SIZE),
            prefills=[], decode_context_lens=torch.tensor(contexts, dtype=torch.int32) if name == "cuda" else None)
        x, residual = torch.randn(batch, 64), torch.randn(batch, 64)
        positions = torch.tensor([c - 1 for c in contexts])
        kernels.calls.clear()
        with torch.inference_mode(), LaunchCounter() as counter:
            layer(positions, x, residual, caches, meta)
        counts[name] = (counter.ops, Counter(kernels.calls))
    torch_ops, _ = counts["torch"]
    cuda_ops, cuda_kernels = counts["cuda"]
    gemms = {"mm", "addmm", "linear"}  # F.linear reaches the mode whole or as its GEMM
    # CudaBackend: only the projections' GEMMs (qkv, o, gate_up, down) reach aten ...
    assert set(cuda_ops) <= gemms and sum(cuda_ops.values()) == 4, cuda_ops
    # ... and one launch per fused step: two add+norms, rotary with the KV write, SiLU*mul, attention.
    assert cuda_kernels == Counter(add_rms_norm=2, rotary_write_kv=1, silu_and_mul=1, attention=1)
    # The torch path issues the same GEMMs and many more elementwise launches around them, among
    # them the two index_copy_ KV writes and rotate-half's cats that the fused kernel removes.
    assert sum(torch_ops[g] for g in gemms) == 4
    assert torch_ops["index_copy_"] == 2 and torch_ops["cat"] == 2
    assert sum(torch_ops.values()) - 4 >= 3 * (sum(cuda_kernels.values())), torch_ops


def test_select_backend_by_device():
    assert isinstance(select_backend(torch.device("cuda", 0), torch.bfloat16), CudaBackend)
    assert select_backend(torch.device("cpu"), torch.float32, "off") is TORCH
    assert not isinstance(select_backend(torch.device("cpu"), torch.float32, "auto"), CudaBackend)
    assert NULL_BLOCK_ID == 0  # the padded tables above rely on the null block being block 0


def _fake_varlen(aligned_bottom_right: bool):
    """varlen_attn's documented paged semantics in torch ops (FlashAttention's conventions): chunk
    i's queries are rows cu_seq_q[i]:cu_seq_q[i + 1], its keys the first seqused_k[i] tokens of its
    pages; causal masks align the last query with the last key (bottom-right); window (left, 0)
    keeps keys pos - left .. pos. aligned_bottom_right=False: a wrong (top-left) alignment."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False, seqused_k=None, block_table=None):
        out = torch.empty_like(query)
        group = query.shape[1] // key.shape[2]
        for i in range(len(seqused_k)):
            s, e, n_k = int(cu_seq_q[i]), int(cu_seq_q[i + 1]), int(seqused_k[i])
            pages = block_table[i, : -(-n_k // key.shape[1])].long()
            k = key[pages].flatten(0, 1)[:n_k].repeat_interleave(group, 1).transpose(0, 1)
            v = value[pages].flatten(0, 1)[:n_k].repeat_interleave(group, 1).transpose(0, 1)
            q_pos = torch.arange(e - s)[:, None] + (n_k - (e - s) if aligned_bottom_right else 0)
            keys = torch.arange(n_k)[None, :]
            mask = keys <= q_pos
            if window_size[0] >= 0:
                mask &= keys >= q_pos - window_size[0]
            o = F.scaled_dot_product_attention(query[s:e].transpose(0, 1), k, v, attn_mask=mask, scale=scale)
            out[s:e] = o.transpose(0, 1)
        return out

    return varlen_attn


def test_varlen_attn_is_chosen_only_when_it_agrees_with_the_triton_kernel():
    """The start check passes our arguments (cumulative query lengths, context lengths, chunk
    tables, the window as (W - 1, 0)) to a varlen_attn: one with the documented semantics is taken,
    one that aligns the causal mask wrongly is refused, and so is one that raises."""
    from workers.attention.gpu_paged import LayerShape, PrefillKernels, paged_varlen_attn

    shape = LayerShape(num_heads=8, num_kv_heads=2, head_dim=32, block_size=BLOCK_SIZE, dtype=torch.float32)
    cpu = torch.device("cpu")
    assert PrefillKernels(_fake_varlen(True))._check_varlen(shape, cpu)
    assert not PrefillKernels(_fake_varlen(False))._check_varlen(shape, cpu)

    def raises(*args, **kwargs):
        raise RuntimeError("FlashAttention: paged KV needs page_size % 256 == 0")

    assert not PrefillKernels(raises)._check_varlen(shape, cpu)
    # Never on CPU, never with a soft cap (varlen_attn has none).
    kernels = PrefillKernels(_fake_varlen(True))
    assert not kernels.use_varlen(shape, cpu, None)
    assert not kernels.use_varlen(shape, torch.device("cuda", 0), 30.0)
    # This torch (2.13) has the paged form.
    assert paged_varlen_attn() is not None


FAMILY_TOKENS = 24


# Minutes each on a loaded 2-core machine: every kernel of every step runs in Triton's interpreter.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_families_on_the_cuda_backend_match_hf(family, tmp_path):
    """Per-head q/k norms on strided views (Qwen3); a sliding window crossed by prompt and output,
    soft-capping, (1 + w) norms and GeGLU (Gemma 2): greedy tokens with chunked prefill (every
    prompt split, chunks after cached context beside decodes) equal HF's."""
    from engine_helpers import PROMPTS, greedy, hf_greedy, make_engine, run_engine
    from family_models import make_tiny_family_model
    from transformers import AutoTokenizer

    path = make_tiny_family_model(tmp_path / "model", family)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:3]]
    engine = make_engine(path, max_num_batched_tokens=8, cpu_kernels="off")
    assert max(len(p) for p in prompts) > 8
    _swap_backend(engine, CudaBackend())
    outputs = run_engine(engine, {str(i): (p, greedy(FAMILY_TOKENS)) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == hf_greedy(path, p, FAMILY_TOKENS), f"{family}: prompt {i}"
