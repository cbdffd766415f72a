"""The model's own sampling defaults, from its generation_config.json (as vLLM applies them).

Model authors ship recommended settings (Qwen2.5: temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05); a request that leaves a parameter out gets the model's value instead of
the OpenAI default. Only keys present in the file count (save_pretrained writes only the values
that differ from transformers' defaults). Like vLLM, `do_sample` is not consulted: a file with
`do_sample: false` and a temperature still supplies that temperature.

Pure: no torch, no I/O beyond reading the one file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, fields
from pathlib import Path

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> (SamplingParams field, type it must have).
_SAMPLING_KEYS = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults from generation_config.json; None = the file does not set it."""

    # Softmax temperature.
    temperature: float | None = None
    # Nucleus sampling mass.
    top_p: float | None = None
    # Top-k cutoff.
    top_k: int | None = None
    # Minimum probability relative to the most likely token.
    min_p: float | None = None
    # HF/CTRL repetition penalty.
    repetition_penalty: float | None = None
    # Output-length cap when the request names none (from max_new_tokens).
    max_tokens: int | None = None
    # Token ids that end generation (an int or a list in the file); () = none named.
    eos_token_ids: tuple[int, ...] = ()

    def sampling_overrides(self, fields_set_by_client: Collection[str]) -> dict[str, float | int]:
        """SamplingParams fields to take from the model: those it sets and the client left out.

        `fields_set_by_client` is pydantic's `request.model_fields_set` (the protocol drops
        explicit nulls before validation, so a null counts as left out, as in vLLM).
        """
        overrides: dict[str, float | int] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "eos_token_ids" or value is None or f.name in fields_set_by_client:
                continue
            if f.name == "max_tokens" and "max_completion_tokens" in fields_set_by_client:
                continue  # chat's name for the same cap
            overrides[f.name] = value
        return overrides


def parse_generation_config(raw: dict) -> GenerationDefaults:
    """The defaults found in a generation_config.json's contents (entries of the wrong type are
    skipped with a warning rather than failing the server at start)."""
    values: dict = {}
    for key, (name, kind) in _SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            logger.warning("%s: ignoring %s=%r (expected %s)", GENERATION_CONFIG_FILE, key, value, kind.__name__)
            continue
        values[name] = kind(value)
    eos = raw.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    values["eos_token_ids"] = tuple(int(i) for i in eos_list if isinstance(i, int) and not isinstance(i, bool))
    return GenerationDefaults(**values)


def read_generation_defaults(model_path: str | Path, mode: str = "auto") -> GenerationDefaults:
    """The model folder's defaults (empty when the file is absent).

    mode "ignore" drops the sampling defaults but keeps the EOS ids: they say where the model's
    turns end (Llama 3 Instruct's <|eot_id|> is only there), not how to sample.
    """
    if mode not in ("auto", "ignore"):
        raise ValueError(f"generation_config must be 'auto' or 'ignore', not {mode!r}")
    path = Path(model_path) / GENERATION_CONFIG_FILE
    if not path.exists():
        return GenerationDefaults()
    defaults = parse_generation_config(json.loads(path.read_text()))
    return GenerationDefaults(eos_token_ids=defaults.eos_token_ids) if mode == "ignore" else defaults
