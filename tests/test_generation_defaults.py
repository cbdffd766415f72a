"""generation_config.json -> the sampling defaults a request gets when it leaves a parameter out."""

from __future__ import annotations

import json

import pytest

from workers.model.generation_defaults import GenerationDefaults, parse_generation_config, read_generation_defaults

# Qwen2.5-Instruct's file, as shipped.
QWEN25 = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
          "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
          "transformers_version": "4.37.0"}


def test_parse_reads_sampling_keys_and_eos_list():
    d = parse_generation_config(QWEN25)
    assert d == GenerationDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                                   eos_token_ids=(151645, 151643))
    assert isinstance(d.top_k, int) and isinstance(d.temperature, float)


def test_parse_single_eos_and_max_new_tokens():
    d = parse_generation_config({"eos_token_id": 2, "max_new_tokens": 256, "min_p": 0.05, "temperature": 1})
    assert (d.eos_token_ids, d.max_tokens, d.min_p, d.temperature) == ((2,), 256, 0.05, 1.0)
    assert d.top_p is None and d.top_k is None and d.repetition_penalty is None


def test_wrong_types_are_skipped_not_fatal():
    d = parse_generation_config({"temperature": "hot", "top_k": 2.5, "top_p": True, "eos_token_id": [1, "x"]})
    assert d == GenerationDefaults(eos_token_ids=(1,))


def test_overrides_only_for_what_the_client_left_out():
    d = parse_generation_config(QWEN25)
    assert d.sampling_overrides(set()) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert d.sampling_overrides({"temperature", "top_k"}) == {"top_p": 0.8, "repetition_penalty": 1.05}
    capped = GenerationDefaults(max_tokens=64)
    assert capped.sampling_overrides(set()) == {"max_tokens": 64}
    assert capped.sampling_overrides({"max_completion_tokens"}) == {}
    assert GenerationDefaults().sampling_overrides(set()) == {}


def test_read_from_folder_auto_and_ignore(tmp_path):
    assert read_generation_defaults(tmp_path) == GenerationDefaults()  # no file: no defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN25))
    assert read_generation_defaults(tmp_path, "auto").temperature == 0.7
    # "ignore" drops the sampling defaults, not the EOS ids (where the model's turns end).
    assert read_generation_defaults(tmp_path, "ignore") == GenerationDefaults(eos_token_ids=(151645, 151643))
    with pytest.raises(ValueError, match="auto.*ignore"):
        read_generation_defaults(tmp_path, "vllm")
