"""`load_format: dummy`: a model built from config.json alone, with seeded random weights scaled
like the model's own init; a scaled-down Llama-3-8B and Qwen2.5-7B run a step on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from model_configs.scaled import scaled_config
from scheduler.outputs import NewRequestData, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from workers.distributed.parallel_state import SINGLE_RANK
from workers.model.config import ModelConfig
from workers.model.decoder import build_model
from workers.model.dummy_weights import INIT_STD, fill_dummy_weights
from workers.worker import WorkerConfig, WorkerCore


def _worker(path: str, **overrides) -> WorkerCore:
    cfg = WorkerConfig(model_path=path, dtype=torch.float32, block_size=16, max_model_len=256,
                       kv_cache_memory_gib=0.01, gpu_memory_utilization=0.9, device="cpu", max_num_seqs=4,
                       load_format="dummy", cpu_prepack_linear=False, cpu_kernels="off",
                       **overrides)
    return WorkerCore(cfg, SINGLE_RANK)


def _step(worker: WorkerCore, prompts: list[list[int]]) -> list[int]:
    """One prefill step of these prompts (blocks after the null block); the sampled tokens."""
    reqs, next_block = [], 1
    for i, prompt in enumerate(prompts):
        n = -(-len(prompt) // 16) + 1
        reqs.append(NewRequestData(f"r{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0),
                                   list(range(next_block, next_block + n)), 0))
        next_block += n
    out = SchedulerOutput(scheduled_new_reqs=reqs, num_scheduled_tokens={f"r{i}": len(p) for i, p in enumerate(prompts)},
                          total_num_scheduled_tokens=sum(map(len, prompts)))
    result = worker.execute_model(out)
    return [result.sampled_token_ids[f"r{i}"][0] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen2.5-7b"])
def test_a_scaled_down_published_config_serves_a_step_with_no_weight_files(tmp_path, name):
    path = scaled_config(name, tmp_path / name)
    assert [p.name for p in tmp_path.joinpath(name).iterdir()] == ["config.json"]
    worker = _worker(path)
    report = worker.load_model()
    worker.init_kv_cache(report.num_blocks)
    assert report.param_bytes == 4 * sum(p.numel() for p in worker.model.parameters())
    prompts = [[5, 17, 99, 3, 250, 7, 11], [400, 2, 9, 9, 9, 31, 42, 77, 300, 1, 8]]
    tokens = _step(worker, prompts)
    vocab = json.loads((tmp_path / name / "config.json").read_text())["vocab_size"]
    assert all(0 <= t < vocab for t in tokens)
    # Logits are finite and not all equal: the weights carry signal through the layers.
    with torch.inference_mode():
        from workers.attention.paged import AttentionMetadata, PrefillChunk

        n = len(prompts[1])
        scratch = [(torch.zeros(2, 16, *k.shape[2:]), torch.zeros(2, 16, *k.shape[2:]))
                   for k, _ in worker.runner.kv_caches]
        meta = AttentionMetadata(slot_mapping=torch.arange(16, 16 + n), num_decodes=0, decode_block_tables=None,
                                 decode_mask=None, prefills=[PrefillChunk(0, n, n, torch.tensor([1]), None)])
        out = worker.model(torch.tensor(prompts[1]), torch.arange(n), scratch, meta)
        logits = worker.model.compute_logits(out)
    assert torch.isfinite(logits).all() and logits.std() > 1e-3


def test_qwen_qkv_biases_exist_and_start_at_zero(tmp_path):
    worker = _worker(scaled_config("qwen2.5-7b", tmp_path / "q"))
    worker.load_model()
    biases = {n: p for n, p in worker.model.named_parameters() if n.endswith("bias")}
    assert biases and all("qkv_proj" in n for n in biases)
    assert all(torch.count_nonzero(p) == 0 for p in biases.values())


def test_dummy_weights_are_deterministic_and_scaled_like_a_real_init(tmp_path):
    cfg = ModelConfig.from_pretrained(scaled_config("llama-3-8b", tmp_path / "l"))
    first, second, other = (build_model(cfg, SINGLE_RANK) for _ in range(3))
    fill_dummy_weights(first, seed=7)
    fill_dummy_weights(second, seed=7)
    fill_dummy_weights(other, seed=8)
    for (name, a), b, c in zip(first.named_parameters(), second.parameters(), other.parameters()):
        assert torch.equal(a, b), name
        if "norm" in name:
            assert torch.all(a == 1.0), name  # RMSNorm at its identity
        else:
            assert not torch.equal(a, c), name
            assert abs(a.std().item() - INIT_STD) < 0.2 * INIT_STD, name
    # Parameters of the same shape differ (each draws from its own stream).
    layers = first.layers
    assert not torch.equal(layers[0].mlp.gate_up_proj.weight, layers[1].mlp.gate_up_proj.weight)


def test_gemma_norms_start_at_their_identity_of_zero(tmp_path):
    model = build_model(ModelConfig.from_pretrained(scaled_config("llama-3-8b", tmp_path / "l")), SINGLE_RANK)
    fill_dummy_weights(model, norm_weight_offset=1.0)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(torch.count_nonzero(p) == 0 for p in norms)


def test_the_published_configs_read_as_published():
    from model_configs.scaled import LLAMA_3_8B, QWEN2_5_7B

    llama, qwen = ModelConfig.from_pretrained(LLAMA_3_8B), ModelConfig.from_pretrained(QWEN2_5_7B)
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.intermediate_size, llama.vocab_size, llama.rope_theta, llama.max_position_embeddings,
            llama.rms_norm_eps, llama.qkv_bias, llama.tie_word_embeddings) == (
        4096, 32, 32, 8, 14336, 128256, 500000.0, 8192, 1e-5, False, False)
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.intermediate_size, qwen.vocab_size, qwen.rope_theta, qwen.max_position_embeddings,
            qwen.rms_norm_eps, qwen.qkv_bias, qwen.tie_word_embeddings) == (
        3584, 28, 28, 4, 18944, 152064, 1e6, 32768, 1e-6, True, False)
