"""The model architecture as tpserve needs it, read from an HF folder's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class RopeScaling:
    # "llama3" is the only scaling type implemented; None means plain RoPE.
    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    # Folder holding config.json, *.safetensors and the tokenizer.
    path: str
    # The architecture named in config.json.
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Token that ends generation (the first one when config.json lists several).
    eos_token_id: int | None
    # Every id config.json calls EOS (Llama 3 lists several).
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{config_file} does not exist: the model must be a local HF folder")
        raw = json.loads(config_file.read_text())
        archs = raw.get("architectures") or [raw.get("model_type", "unknown")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported (tpserve serves {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if arch == "MistralForCausalLM" and raw.get("sliding_window") not in (None, 0):
            if raw.get("sliding_window", 0) < raw.get("max_position_embeddings", 0):
                raise UnsupportedModelError("Mistral with a sliding window is not supported")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        # transformers 5 nests rope settings under rope_parameters; 4.x keeps them flat.
        rope = dict(raw.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling_raw = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            path=str(path),
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=_parse_rope_scaling(scaling_raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_id=eos_ids[0] if eos_ids else None,
            eos_token_ids=eos_ids,
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
        )


def _parse_rope_scaling(raw: dict | None) -> RopeScaling | None:
    if not raw:
        return None
    rope_type = raw.get("rope_type") or raw.get("type")
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported (llama3 is)")
    return RopeScaling(
        rope_type="llama3",
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
