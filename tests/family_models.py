"""Tiny random-weight checkpoints of every supported family, saved by transformers itself (which is
then the reference implementation), with SmolLM2's tokenizer so the engine's tokenizer path is real.

Every family gets 8 query heads and 4 KV heads (TP=2 splits both), 2-3 layers, and small sliding
windows where the family has them, so that the test prompts and their outputs cross the windows.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from workers.model.default_model import ensure_default_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
# Shorter than the test prompts + outputs (and than one 16-token block for Mistral, longer for
# Gemma) so windows mask inside a block and across blocks.
MISTRAL_WINDOW = 12
GEMMA_WINDOW = 20

_COMMON = dict(vocab_size=49152, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, intermediate_size=192)


def _config(family: str):
    import transformers as tf

    head_dim = 16
    hidden = 8 * head_dim
    if family == "qwen2":  # tied embeddings, bias on q/k/v
        return tf.Qwen2Config(hidden_size=hidden, num_hidden_layers=2, tie_word_embeddings=True,
                              rope_theta=1_000_000.0, **_COMMON)
    if family == "qwen2-untied":
        return tf.Qwen2Config(hidden_size=hidden, num_hidden_layers=2, tie_word_embeddings=False, **_COMMON)
    if family == "qwen3":
        return tf.Qwen3Config(hidden_size=96, head_dim=head_dim, num_hidden_layers=2, tie_word_embeddings=True,
                              **_COMMON)
    if family == "mistral":
        return tf.MistralConfig(hidden_size=hidden, head_dim=head_dim, num_hidden_layers=2,
                                sliding_window=MISTRAL_WINDOW, tie_word_embeddings=False, **_COMMON)
    if family == "gemma2":
        return tf.Gemma2Config(hidden_size=hidden, head_dim=head_dim, num_hidden_layers=3, sliding_window=GEMMA_WINDOW,
                               query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                               hidden_activation="gelu_pytorch_tanh", **_COMMON)
    if family == "gemma3":
        return tf.Gemma3TextConfig(hidden_size=hidden, head_dim=head_dim, num_hidden_layers=3,
                                   sliding_window=GEMMA_WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=24,
                                   rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_local_base_freq=500.0,
                                   **_COMMON)
    raise ValueError(family)


def _model_class(family: str):
    import transformers as tf

    return {"qwen2": tf.Qwen2ForCausalLM, "qwen2-untied": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
            "mistral": tf.MistralForCausalLM, "gemma2": tf.Gemma2ForCausalLM,
            "gemma3": tf.Gemma3ForCausalLM}[family]


FAMILIES = ("qwen2", "qwen2-untied", "qwen3", "mistral", "gemma2", "gemma3")


def make_tiny_family_model(folder: Path, family: str, seed: int = 0) -> str:
    """Write a random-weight checkpoint of `family` (float32, safetensors) into folder."""
    folder = Path(folder)
    if (folder / "config.json").exists():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _config(family)
    torch.manual_seed(seed)
    model = _model_class(family)(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                # Larger-than-default init so logits are peaked enough for stable greedy comparisons.
                p.normal_(0.0, 0.08)
            else:
                # Biases and norm weights off their zero/one init, so a dropped bias or a norm
                # missing its (1 + w) offset changes the outputs.
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder), safe_serialization=True)
    source = ensure_default_model()
    for name in _TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return str(folder)
