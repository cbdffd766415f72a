"""Seeded benchmark workloads: random prompts of given token lengths, or prompts from a JSONL file.

Random prompts are built the way `vllm bench serve --dataset-name random` builds them: draw token
ids from the tokenizer's vocabulary, decode them to text, and re-encode to check the length, since
decode -> encode is not an identity (merges, byte pieces). Servers get text, so the length that
counts is the re-encoded one. Everything is driven by one `random.Random(seed)`: the same seed and
tokenizer give the same prompts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, as the tokenizer counts them (0 = unknown, e.g. file mode sans tokenizer)
    max_tokens: int


def load_tokenizer(path: str | Path):
    """An HF tokenizer from a local folder; never touches the hub."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _usable_ids(tokenizer) -> list[int]:
    # Special tokens (BOS/EOS/chat markers) would change the server's behaviour, not just length.
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def random_token_ids(rng: random.Random, vocab: list[int], length: int) -> list[int]:
    return [vocab[rng.randrange(len(vocab))] for _ in range(length)]


def random_text(tokenizer, rng: random.Random, vocab: list[int], length: int, tries: int = 8) -> tuple[str, int]:
    """Text that re-encodes to exactly `length` tokens when possible, else the closest found."""
    best: tuple[str, int] | None = None
    for _ in range(tries):
        ids = random_token_ids(rng, vocab, length)
        # Re-encoding usually drifts by a few tokens; trim or pad a few times to land on length.
        for _ in range(4):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            n = len(tokenizer.encode(text, add_special_tokens=False))
            if n == length:
                return text, n
            if best is None or abs(n - length) < abs(best[1] - length):
                best = (text, n)
            if n > length:
                ids = ids[: max(1, len(ids) - (n - length))]
            else:
                ids = ids + random_token_ids(rng, vocab, length - n)
    assert best is not None
    return best


def random_requests(
    tokenizer,
    num: int,
    input_len_min: int,
    input_len_max: int,
    output_len: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """`num` text prompts with lengths uniform in [input_len_min, input_len_max] tokens."""
    if not 1 <= input_len_min <= input_len_max:
        raise ValueError("need 1 <= input_len_min <= input_len_max")
    rng = random.Random(seed)
    vocab = _usable_ids(tokenizer)
    out = []
    for _ in range(num):
        length = rng.randint(input_len_min, input_len_max)
        text, n = random_text(tokenizer, rng, vocab, length)
        out.append(BenchRequest(prompt=text, prompt_len=n, max_tokens=output_len))
    return out


def random_id_prompts(
    vocab_size: int, num: int, input_len_min: int, input_len_max: int, seed: int = 0
) -> list[list[int]]:
    """Token-id prompts without a tokenizer (offline engines, tests)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(input_len_min, input_len_max))]
        for _ in range(num)
    ]


def file_requests(
    path: str | Path, num: int | None, default_output_len: int, tokenizer=None, seed: int = 0
) -> list[BenchRequest]:
    """Prompts from JSONL lines `{"prompt": str, "max_tokens"?: int}`; sampled (seeded) if `num` is
    smaller than the file, cycled if larger."""
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: needs a string `prompt`")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    rng = random.Random(seed)
    if num is None:
        picked = rows
    elif num <= len(rows):
        picked = rng.sample(rows, num)
    else:
        picked = [rows[i % len(rows)] for i in range(num)]
    out = []
    for row in picked:
        n = len(tokenizer.encode(row["prompt"], add_special_tokens=False)) if tokenizer else 0
        out.append(BenchRequest(row["prompt"], n, int(row.get("max_tokens", default_output_len))))
    return out


def word_token_ids(tokenizer) -> list[int]:
    """Tokens that are one space and a lowercase ASCII word (" apple"), each encoding back to
    itself alone. A byte-level BPE splits text at spaces before merging, so a string of such
    words is exactly as many tokens as words, under any tokenizer built from the same vocabulary
    (llama.cpp's GGUF copy of it included), where random token ids decode to byte fragments whose
    re-encoding may differ from one tokenizer implementation to another."""
    out = []
    for i in _usable_ids(tokenizer):
        text = tokenizer.decode([i])
        if (len(text) >= 4 and text[0] == " " and text[1:].isascii() and text[1:].isalpha() and text[1:].islower()
                and tokenizer.encode(text, add_special_tokens=False) == [i]):
            out.append(i)
    return out


def exact_length_text(tokenizer, words: list[int], length: int, seed: int) -> str:
    """Seeded text of exactly `length` tokens (as `tokenizer` counts it, special tokens aside):
    random word tokens; different seeds share no prefix beyond chance."""
    if not words:
        raise ValueError("the tokenizer has no plain-word tokens to build text from")
    rng = random.Random(seed)
    text = tokenizer.decode(random_token_ids(rng, words, length))
    n = len(tokenizer.encode(text, add_special_tokens=False))
    if n != length:
        raise ValueError(f"{length} word tokens re-encode to {n} tokens: this tokenizer merges across spaces")
    return text
