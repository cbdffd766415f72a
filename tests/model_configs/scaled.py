"""Scaled-down copies of the published configs here, for CPU tests and the GPU check's dry run:
the same architecture, family switches and ratios (GQA, q/k/v bias, tied head or not), smaller
sizes. With `load_format: dummy` a folder holding only this config.json is a servable model."""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parent
LLAMA_3_8B = CONFIGS_DIR / "llama-3-8b"
QWEN2_5_7B = CONFIGS_DIR / "qwen2.5-7b"
SMOLLM2_135M = CONFIGS_DIR / "smollm2-135m"

# Small sizes that keep every ratio that matters to the kernels: 4 query heads per KV head for
# Llama-3-8B (32/8), 7 for Qwen2.5-7B (28/4), head_dim 128 -> 16.
TINY = {
    "llama-3-8b": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=448, vocab_size=512, max_position_embeddings=1024),
    "qwen2.5-7b": dict(hidden_size=112, num_hidden_layers=2, num_attention_heads=7, num_key_value_heads=1,
                       intermediate_size=592, vocab_size=512, max_position_embeddings=1024),
    "smollm2-135m": dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                         intermediate_size=256, vocab_size=512, max_position_embeddings=1024),
}


def scaled_config(name: str, dest: Path, **overrides) -> str:
    """Write tests/model_configs/<name>/config.json with TINY[name] and `overrides` applied into
    dest (a folder); returns its path."""
    raw = json.loads((CONFIGS_DIR / name / "config.json").read_text())
    raw.update(TINY[name])
    raw.update(overrides)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(raw, indent=1))
    return str(dest)
