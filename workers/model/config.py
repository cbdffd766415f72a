"""The model architecture as tpserve needs it, read from an HF folder's config.json.

One decoder implementation serves every supported family; what differs between families is
expressed as fields of `ModelConfig`, filled here from each family's config.json conventions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# HF `architectures` name -> family; the family decides how config.json is read.
ARCHITECTURE_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_FAMILIES)
# Architectures people will point us at that we name precisely when refusing them.
_KNOWN_UNSUPPORTED = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 (vision tower, image tokens) is not supported; "
                                      "the text-only Gemma3ForCausalLM checkpoints (e.g. gemma-3-1b) are",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class RopeScaling:
    # "llama3" (frequency-band scaling) or "linear" (positions divided by factor).
    rope_type: str
    factor: float
    # llama3 only.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    # Bias on the q/k/v projections (Qwen2 always; Llama/Qwen3 when attention_bias).
    qkv_bias: bool = False
    # Bias on the output projection (Llama's attention_bias; never in Qwen2).
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # Family: llama, mistral, qwen2, qwen3, gemma2, gemma3.
    family: str = "llama"
    # MLP activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma).
    hidden_act: str = "silu"
    # Per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # RMSNorm multiplies by (offset + weight): 0 for Llama, 1 for Gemma (weights stored as w - 1).
    norm_weight_offset: float = 0.0
    # Gemma's four norms per layer: after attention, and before and after the MLP.
    sandwich_norms: bool = False
    # Embeddings multiplied by this (Gemma: sqrt(hidden_size)); None = not scaled.
    embedding_multiplier: float | None = None
    # Softmax scale of attention scores (head_dim ** -0.5 unless query_pre_attn_scalar says).
    attention_scale: float | None = None
    # Gemma 2: scores -> cap * tanh(scores / cap) before the softmax; None = not capped.
    attn_logit_softcap: float | None = None
    # Gemma 2: logits -> cap * tanh(logits / cap); None = not capped.
    final_logit_softcap: float | None = None
    # Per layer: its sliding window in tokens (a key is visible when query_pos - key_pos < window),
    # or None for full attention. Empty tuple = every layer full.
    layer_sliding_windows: tuple[int | None, ...] = ()
    # RoPE base of the sliding layers when it differs from rope_theta (Gemma 3's local layers,
    # which also take no rope scaling); None = same RoPE as full layers.
    local_rope_theta: float | None = None

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    def sliding_window_of(self, layer: int) -> int | None:
        return self.layer_sliding_windows[layer] if self.layer_sliding_windows else None

    @property
    def kv_sliding_window(self) -> int | None:
        """The window past which a request's KV blocks are dead for every layer, or None when
        some layer attends to the whole context (Gemma's global layers, most models)."""
        return max(self.layer_sliding_windows) if self.every_layer_slides else None

    @property
    def every_layer_slides(self) -> bool:
        """True when no layer attends beyond the window (blocks outside it are dead for all layers)."""
        return bool(self.layer_sliding_windows) and all(w is not None for w in self.layer_sliding_windows)

    def describe(self) -> str:
        """One line for the startup log: the architecture and the options that set it apart."""
        windows = sorted({w for w in self.layer_sliding_windows if w is not None})
        parts = [f"architecture {self.architecture} (family {self.family})", f"{self.num_hidden_layers} layers",
                 f"{self.num_attention_heads}/{self.num_key_value_heads} q/kv heads of {self.head_dim}"]
        if windows:
            num_sliding = sum(w is not None for w in self.layer_sliding_windows)
            parts.append(f"sliding window {'/'.join(map(str, windows))} on {num_sliding} layers")
        if self.attn_logit_softcap or self.final_logit_softcap:
            parts.append(f"soft caps attention={self.attn_logit_softcap} final={self.final_logit_softcap}")
        return ", ".join(parts)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{config_file} does not exist: the model must be a local HF folder")
        raw = json.loads(config_file.read_text())
        arch = (raw.get("architectures") or [raw.get("model_type", "unknown")])[0]
        if arch not in ARCHITECTURE_FAMILIES:
            detail = _KNOWN_UNSUPPORTED.get(arch, "")
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported{' (' + detail + ')' if detail else ''}; "
                f"tpserve serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = ARCHITECTURE_FAMILIES[arch]
        fields = _common_fields(raw)
        fields.update(_FAMILY_READERS[family](raw, fields))
        return cls(path=str(path), architecture=arch, family=family, **fields)


def _common_fields(raw: dict) -> dict:
    num_heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    # transformers 5 nests rope settings under rope_parameters; 4.x keeps them flat.
    rope = dict(raw.get("rope_parameters") or {})
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling_raw = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    attention_bias = raw.get("attention_bias", False)
    return dict(
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
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=raw.get("mlp_bias", False),
    )


def _windows_from_layer_types(raw: dict, default_types: list[str] | None) -> tuple[int | None, ...]:
    """Per-layer windows from config.json's layer_types (or the family's default pattern)."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types") or default_types
    if not window or not types:
        return ()
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _llama(raw: dict, common: dict) -> dict:
    return {}


def _mistral(raw: dict, common: dict) -> dict:
    # Mistral slides on every layer when sliding_window is set (v0.1: 4096; later versions: null).
    window = raw.get("sliding_window")
    return {"layer_sliding_windows": (window,) * common["num_hidden_layers"] if window else ()}


def _qwen_windows(raw: dict, common: dict) -> tuple[int | None, ...]:
    # Qwen2/3 slide only when use_sliding_window, on layers from max_window_layers on.
    if not raw.get("use_sliding_window", False):
        return ()
    first = raw.get("max_window_layers", 28)
    n = common["num_hidden_layers"]
    return _windows_from_layer_types(
        raw, ["sliding_attention" if i >= first else "full_attention" for i in range(n)])


def _qwen2(raw: dict, common: dict) -> dict:
    # Qwen2 hard-codes bias on q/k/v and none on o_proj (config.json has no attention_bias).
    return {"qkv_bias": True, "o_proj_bias": False, "layer_sliding_windows": _qwen_windows(raw, common)}


def _qwen3(raw: dict, common: dict) -> dict:
    return {"qk_norm": True, "layer_sliding_windows": _qwen_windows(raw, common)}


def _gemma_common(raw: dict, common: dict, pattern: int) -> dict:
    n = common["num_hidden_layers"]
    default_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    scalar = raw.get("query_pre_attn_scalar") or common["head_dim"]
    return dict(
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        norm_weight_offset=1.0,
        sandwich_norms=True,
        embedding_multiplier=common["hidden_size"] ** 0.5,
        attention_scale=float(scalar) ** -0.5,
        attn_logit_softcap=raw.get("attn_logit_softcapping"),
        final_logit_softcap=raw.get("final_logit_softcapping"),
        layer_sliding_windows=_windows_from_layer_types(raw, default_types),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
    )


def _gemma2(raw: dict, common: dict) -> dict:
    return _gemma_common(raw, common, pattern=2)


def _gemma3(raw: dict, common: dict) -> dict:
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
    fields = _gemma_common(raw, common, pattern=raw.get("sliding_window_pattern", 6))
    fields["qk_norm"] = True
    # Local (sliding) layers use their own RoPE base and no scaling; global ones rope_theta + scaling.
    rope = raw.get("rope_parameters") or {}
    full = rope.get("full_attention") if isinstance(rope.get("full_attention"), dict) else None
    local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else None
    if full is not None:
        fields["rope_theta"] = float(full.get("rope_theta", 1_000_000.0))
        fields["rope_scaling"] = _parse_rope_scaling(full)
    else:
        fields["rope_theta"] = float(raw.get("rope_theta", 1_000_000.0))
    local_theta = (local or {}).get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    fields["local_rope_theta"] = float(local_theta)
    return fields


_FAMILY_READERS = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "gemma2": _gemma2, "gemma3": _gemma3,
}


def _parse_rope_scaling(raw: dict | None) -> RopeScaling | None:
    if not raw:
        return None
    rope_type = raw.get("rope_type") or raw.get("type")
    if rope_type in (None, "default"):
        return None
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(raw["factor"]))
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported (llama3 and linear are)")
    return RopeScaling(
        rope_type="llama3",
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
