"""The CPU layer stack (workers/model/cpu_layer_stack.py, workers/cpu/csrc/layer_stack.cpp): the decoder's layer
loop as one call into the kernels must give bit-identical hidden states to the Python loop it
replaces, on every step an engine runs: decode-only steps, chunked prefills after cached context
and prefix-cache hits, projections on tpserve's kernels (float32 panel_linear up to its calibrated
limit, bf16 amx_linear <= 64) and on the packed GEMM (more), with those kernels off, without prepacking
(at::linear), with biases on every projection, with sliding windows, and in bf16 (where prefill chunks keep SDPA, called per chunk from C++). Models it
cannot serve (sandwich norms, q/k norms) keep the Python loop, and the op refuses inputs that do
not describe the layers it is given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import greedy, make_engine, run_engine
from family_models import make_tiny_family_model
from model_fixtures import make_tiny_llama
from kernel_requirements import requires_kernels
from workers.cpu import kernels as cpu_ops
from workers.model.default_model import ensure_default_model

pytestmark = requires_kernels


class StackVsLoop:
    """Wraps a model's forward: every step runs through the layer stack and again through the
    Python loop on the same inputs, and the two hidden states must be equal bit for bit (the
    second run writes the same K/V into the same slots, so the cache is unchanged by it)."""

    def __init__(self, model) -> None:
        self.model = model
        self.stack = model.layer_stack
        self.forward = model.forward
        # Steps the stack ran, by kind.
        self.decode_only = self.mixed = self.fallback = 0
        # The rows of every decode-only batch the stack ran.
        self.decode_rows: list[int] = []
        model.forward = self

    def __call__(self, input_ids, positions, kv_caches, meta):
        accepted = self.stack.accepts(meta)
        if not accepted:
            self.fallback += 1
        elif meta.prefills:
            self.mixed += 1
        else:
            self.decode_only += 1
            self.decode_rows.append(input_ids.shape[0])
        stacked = self.forward(input_ids, positions, kv_caches, meta)
        self.model.layer_stack = None
        try:
            looped = self.forward(input_ids, positions, kv_caches, meta)
        finally:
            self.model.layer_stack = self.stack
        assert stacked.dtype == looped.dtype and torch.equal(stacked, looped), (
            f"layer stack differs from the loop by {(stacked.float() - looped.float()).abs().max()}")
        return stacked

    @property
    def max_decode_rows(self) -> int:
        return max(self.decode_rows, default=0)


def _workload(num_requests: int, shared: int = 40, max_tokens: int = 6) -> dict:
    """Prompts sharing a first `shared` tokens (prefix-cache hits after the first), of lengths that
    need several 48-token chunks, then a few decode steps of all of them at once."""
    prefix = list(range(7, 7 + shared))
    return {f"r{i}": (prefix + list(range(200 + 31 * i, 200 + 31 * i + 5 + (i * 7) % 60)), greedy(max_tokens))
            for i in range(num_requests)}


def _run(path: str, requests: dict, **overrides) -> tuple[StackVsLoop, dict]:
    args = {"max_num_batched_tokens": 48, "enable_prefix_caching": True, "kv_cache_memory_gib": 0.5, **overrides}
    engine = make_engine(path, **args)
    model = engine.executor.worker.model
    assert model.layer_stack is not None, "the engine did not build the layer stack"
    check = StackVsLoop(model)
    return check, run_engine(engine, requests)


@pytest.mark.parametrize("overrides", [{}, {"cpu_small_batch_linear": False}, {"cpu_prepack_linear": False}],
                         ids=["panel+packed", "packed-only", "unpacked"])
def test_stack_equals_the_python_loop_on_every_step(tmp_path, overrides):
    """Llama, head_dim 64 (the AVX2 attention tiles), 56 requests, a 64-token budget: steps of up
    to 64 rows, which take panel_linear or the packed GEMM as the calibration at load decided
    (packed-only: always the GEMM); every step bit-identical."""
    path = make_tiny_llama(tmp_path / "m", num_layers=3, head_dim=64, num_heads=6, num_kv_heads=2)
    # 8-token prompts: all 56 are decoding together long before the first finishes.
    requests = {f"w{i}": (list(range(300 + 8 * i, 308 + 8 * i)), greedy(24)) for i in range(56)}
    check, outputs = _run(path, requests, max_num_seqs=64, max_num_batched_tokens=64, **overrides)
    assert check.decode_only >= 3 and check.mixed >= 3 and check.fallback == 0
    assert check.max_decode_rows == 56  # all 56 at once
    assert all(len(tokens) == 24 for tokens in outputs.values())


def test_bf16_stack_on_small_batch_and_packed_decode_steps(tmp_path):
    """bf16, 72 requests finishing one group after another: decode steps of 72 rows take the packed
    GEMM, of at most 64 the small-batch kernel (amx_linear where the CPU has AMX, else
    skinny_linear up to 8); every step bit-identical."""
    path = make_tiny_llama(tmp_path / "m", num_layers=2, head_dim=64, num_heads=6, num_kv_heads=2)
    requests = {f"w{i}": (list(range(300 + 8 * i, 308 + 8 * i)), greedy(20 + i % 18)) for i in range(72)}
    check, outputs = _run(path, requests, dtype="bfloat16", max_num_seqs=96, max_num_batched_tokens=96)
    assert check.fallback == 0 and check.max_decode_rows == 72
    assert min(check.decode_rows) <= 8
    assert [len(outputs[f"w{i}"]) for i in range(72)] == [20 + i % 18 for i in range(72)]


def _llama_with_biases(folder: Path) -> str:
    """A tiny Llama with attention_bias and mlp_bias (q/k/v, o, gate/up and down biases), random."""
    from transformers import LlamaConfig, LlamaForCausalLM

    source = Path(make_tiny_llama(folder / "base"))
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=2048,
                         attention_bias=True, mlp_bias=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    target = folder / "biased"
    model.save_pretrained(str(target), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            (target / name).write_bytes((source / name).read_bytes())
    return str(target)


def test_stack_with_a_bias_on_every_projection(tmp_path):
    check, _ = _run(_llama_with_biases(tmp_path), _workload(6))
    assert check.decode_only >= 3 and check.mixed >= 1 and check.fallback == 0


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_stack_on_other_families(tmp_path, family):
    """Mistral: a sliding window (12) shorter than the prompts; Qwen2: q/k/v biases, tied embeddings."""
    check, _ = _run(make_tiny_family_model(tmp_path / family, family), _workload(6, max_tokens=14))
    assert check.decode_only >= 10 and check.mixed >= 1 and check.fallback == 0


def test_bf16_stack_runs_sdpa_prefill_chunks_from_cpp(tmp_path):
    """bf16 keeps SDPA for prefill chunks (torch's flash attention, AMX where there is one); the
    stack calls it per chunk as the loop does: chunks at position 0, chunks after cached context
    and after prefix-cache hits (a gather and a mask), all bit-identical."""
    path = make_tiny_llama(tmp_path / "m", num_layers=2, head_dim=64)
    check, _ = _run(path, _workload(4), dtype="bfloat16")
    assert check.decode_only >= 3 and check.mixed >= 3 and check.fallback == 0


def test_bf16_stack_with_a_sliding_window(tmp_path):
    """Mistral's window (12) is shorter than the prompts: even a chunk at position 0 is masked."""
    check, _ = _run(make_tiny_family_model(tmp_path / "mistral", "mistral"), _workload(4, max_tokens=14),
                    dtype="bfloat16")
    assert check.decode_only >= 10 and check.mixed >= 1 and check.fallback == 0


def test_float32_stack_without_the_prefill_kernel_runs_sdpa_from_cpp(tmp_path):
    path = make_tiny_llama(tmp_path / "m", num_layers=2, head_dim=64)
    check, _ = _run(path, _workload(4), cpu_prefill_attention=False)
    assert check.decode_only >= 3 and check.mixed >= 3 and check.fallback == 0


def test_greedy_tokens_of_the_default_model_equal_the_loop_s(tmp_path):
    """SmolLM2 (30 layers, 9 heads / 3 KV heads), stack on and off: the same greedy tokens."""
    path = str(ensure_default_model())
    prompts = {f"p{i}": (list(range(1000 + 50 * i, 1000 + 50 * i + 20 + 9 * i)), greedy(8)) for i in range(3)}
    outputs = []
    for on in (True, False):
        engine = make_engine(path, cpu_layer_stack=on)
        assert (engine.executor.worker.model.layer_stack is not None) == on
        outputs.append(run_engine(engine, prompts))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("family", ["gemma2", "qwen3"])
def test_models_it_cannot_serve_keep_the_python_loop(tmp_path, family):
    """Gemma 2's sandwich norms and Qwen3's q/k norms are not what the stack runs."""
    engine = make_engine(make_tiny_family_model(tmp_path / family, family))
    assert engine.executor.worker.model.layer_stack is None


def test_off_by_config_and_without_the_kernels(tmp_path):
    path = make_tiny_llama(tmp_path / "m")
    assert make_engine(path, cpu_layer_stack=False).executor.worker.model.layer_stack is None
    assert make_engine(path, cpu_kernels=False).executor.worker.model.layer_stack is None


def test_the_op_refuses_inputs_that_do_not_fit_its_layers(tmp_path):
    path = make_tiny_llama(tmp_path / "m", num_layers=2)
    engine = make_engine(path)
    stack = engine.executor.worker.model.layer_stack
    kv = engine.executor.worker.runner.kv_caches
    x = torch.randn(1, 128)
    positions = torch.zeros(1, dtype=torch.long)
    slots = torch.tensor([16])
    tables = torch.tensor([[1]])
    lens = torch.tensor([1], dtype=torch.int32)

    def state(weights=stack.weights, windows=(0, 0), soft_cap=stack.soft_cap):
        return torch.classes.tpserve_cpu.LayerStack(
            weights, [k for k, _ in kv], [v for _, v in kv], stack.cos, stack.sin, list(windows), stack.num_heads,
            stack.num_kv_heads, stack.head_dim, stack.eps, stack.norm_offset, stack.scale, soft_cap,
            stack.small_batch_rows)

    def call(decode_tables=tables, decode_lens=lens, num_decodes=1, chunk_tables=None, chunk_info=None,
             prefill_sdpa=False, held=None):
        held = state() if held is None else held
        return cpu_ops.ops().layer_stack(held, x, positions, slots, decode_tables, decode_lens, chunk_tables,
                                         chunk_info, num_decodes, prefill_sdpa)

    hidden, residual = call()
    assert hidden.shape == residual.shape == (1, 128)
    with pytest.raises(RuntimeError, match="weight slots each"):
        state(weights=stack.weights[:-1])
    with pytest.raises(RuntimeError, match="weight slots each"):
        state(windows=(0,))
    with pytest.raises(RuntimeError, match="decodes need their block tables"):
        call(decode_tables=None)
    with pytest.raises(RuntimeError, match="prefill kernel's chunk table"):
        call(num_decodes=0)
    one_chunk = dict(num_decodes=0, chunk_tables=torch.tensor([[1]], dtype=torch.int32),
                     chunk_info=torch.tensor([[0, 1, 1]], dtype=torch.int32), prefill_sdpa=True)
    assert call(**one_chunk)[0].shape == (1, 128)
    with pytest.raises(RuntimeError, match="soft cap needs the eager attention"):
        call(**one_chunk, held=state(soft_cap=30.0))
    missing_norm = list(stack.weights)
    missing_norm[0] = None
    with pytest.raises(RuntimeError, match="lacks weight slot 0"):
        state(weights=missing_norm)
