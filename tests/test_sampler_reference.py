"""The sampler's filtered distributions against transformers' logits processors, row by row.

Every case runs in ONE batch with rows that use other settings (the sampler batches filters over
rows), on real logits of the default model and on random logits, ties and extreme values
included. The reference for each row is HF's processor chain applied to that row alone, in
`generate`'s order: repetition penalty, (frequency/presence: written out, HF has none), logit
bias, min new tokens, then temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import math

import pytest
import torch

from scheduler.sampling_params import SamplingParams as SP
from tests.sampling_reference import hf_reference, row
from workers.sampling.filters import filtered_probs
from workers.sampling.penalties import apply_request_processors

# One row each, all in one batch. Values chosen to hit each rule's edges: ties at the k-th,
# top_p tiny / just under 1, top_k above the vocabulary, temperature near 0, min_p 1.
CASES = {
    "plain": SP(temperature=1.0),
    "temperature_low": SP(temperature=0.3),
    "temperature_near_zero": SP(temperature=2e-5),
    "temperature_high": SP(temperature=2.0),
    "top_k_1": SP(temperature=1.0, top_k=1),
    "top_k_20": SP(temperature=0.8, top_k=20),
    "top_k_above_vocab": SP(temperature=1.0, top_k=10**9),
    "top_p_tiny": SP(temperature=1.0, top_p=1e-6),
    "top_p_half": SP(temperature=1.0, top_p=0.5),
    "top_p_high": SP(temperature=1.3, top_p=0.97),
    "min_p": SP(temperature=1.0, min_p=0.05),
    "min_p_one": SP(temperature=1.0, min_p=1.0),
    "all_filters": SP(temperature=0.7, top_k=50, top_p=0.9, min_p=0.02),
    "repetition_up": SP(temperature=1.0, repetition_penalty=1.5),
    "repetition_down": SP(temperature=1.0, repetition_penalty=0.6),
    "frequency_presence": SP(temperature=1.0, frequency_penalty=1.5, presence_penalty=-0.7),
    "logit_bias": SP(temperature=1.0, logit_bias={17: 5.0, 300: -100.0, 9: 100.0}),
    "bias_after_penalties": SP(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5,
                               logit_bias={17: 3.0, 25: -2.0, 42: 1.0}),
    "min_tokens": SP(temperature=1.0, min_tokens=10),
    "min_tokens_last_masked_step": SP(temperature=1.0, min_tokens=7),  # 6 outputs so far
    "min_tokens_met": SP(temperature=1.0, min_tokens=6),
    "everything": SP(temperature=0.9, top_k=40, top_p=0.8, min_p=0.01, repetition_penalty=1.2,
                     frequency_penalty=0.4, presence_penalty=0.3, logit_bias={25: 6.0}, min_tokens=8),
}


def tpserve_probs(logits: torch.Tensor, params: list[SP]) -> torch.Tensor:
    rows = [row(p) for p in params]
    return filtered_probs(apply_request_processors(logits, rows), params)


def assert_same_distribution(ours: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    # Same support exactly (a filter's edge is a decision, not a rounding), same mass within float.
    assert torch.equal(ours > 0, ref > 0), f"{name}: kept tokens differ: ours {int((ours > 0).sum())}, " \
                                            f"HF {int((ref > 0).sum())}"
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    # Unlikely tokens too: their log-probabilities (an absolute tolerance on probabilities alone
    # would let a rule that only moves the tail pass).
    kept = ref > 0
    torch.testing.assert_close(ours[kept].log(), ref[kept].log(), atol=1e-3, rtol=0,
                               msg=lambda m: f"{name} (log-probabilities): {m}")


@pytest.fixture(scope="module")
def real_logits() -> torch.Tensor:
    """Last-position logits of the default model for a few prompts (float32)."""
    from tests.engine_helpers import PROMPTS, _hf_model
    from tests.model_fixtures import default_model_path
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = _hf_model(path)
    rows = []
    with torch.no_grad():
        for prompt in PROMPTS[:4]:
            rows.append(model(torch.tensor([tokenizer.encode(prompt)])).logits[0, -1].float())
    return torch.stack(rows)


def random_logits(num_rows: int, vocab: int, seed: int, ties: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=generator) * 4
    # Integer logits: hundreds of exact ties at every k-th / nucleus edge.
    return logits.round() if ties else logits


@pytest.mark.parametrize("source", ["real", "random", "random_ties"])
def test_filtered_distribution_equals_hf_processors(source, request):
    names = list(CASES)
    params = [CASES[n] for n in names]
    if source == "real":
        base = request.getfixturevalue("real_logits")
        logits = base[torch.arange(len(names)) % base.shape[0]]
    else:
        logits = random_logits(len(names), 1024, seed=1, ties=source == "random_ties")
    ours = tpserve_probs(logits, params)
    for i, name in enumerate(names):
        assert_same_distribution(ours[i].double(), hf_reference(logits[i], params[i]).double(), f"{source}/{name}")


def test_a_row_does_not_depend_on_its_batch_mates():
    logits = random_logits(len(CASES), 512, seed=2, ties=True)
    params = list(CASES.values())
    together = tpserve_probs(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(tpserve_probs(logits[i : i + 1], [p])[0], together[i]), list(CASES)[i]


def test_logit_bias_and_penalties_move_the_right_way():
    """Signs, stated plainly (the reference test above could share a sign error with HF's use)."""
    logits = torch.zeros(1, 400)
    out = apply_request_processors(logits, [row(SP(logit_bias={9: 3.0, 10: -3.0}, repetition_penalty=2.0,
                                                    frequency_penalty=0.5, presence_penalty=0.25))])[0]
    assert out[9] == 3.0 and out[10] == -3.0
    assert out[25] == pytest.approx(-(0.5 * 3 + 0.25))  # three times in OUTPUT
    positive = apply_request_processors(torch.full((1, 400), 2.0), [row(SP(repetition_penalty=2.0))])[0]
    negative = apply_request_processors(torch.full((1, 400), -2.0), [row(SP(repetition_penalty=2.0))])[0]
    assert positive[5] == 1.0 and negative[5] == -4.0 and positive[6] == 2.0  # 5 is in the prompt


def test_allowed_bitmask_equals_xgrammar_application():
    xgr = pytest.importorskip("xgrammar")
    vocab = 1000  # not a multiple of 32: the last word is partly beyond the vocabulary
    logits = random_logits(3, vocab, seed=3, ties=False)
    words = torch.randint(-(2**31), 2**31, (3, math.ceil(vocab / 32)), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(4)).to(torch.int32)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, words)
    # As a signed list, as unsigned values, as a tensor; row 1 has no mask.
    rows = [row(SP(), allowed_token_bitmask=words[0].tolist()),
            row(SP()),
            row(SP(), allowed_token_bitmask=[w & 0xFFFFFFFF for w in words[2].tolist()])]
    ours = apply_request_processors(logits, rows)
    assert torch.equal(ours[0], expected[0]) and torch.equal(ours[2], expected[2])
    assert torch.equal(ours[1], logits[1])
    tensor_rows = [row(SP(), allowed_token_bitmask=words[0])]
    assert torch.equal(apply_request_processors(logits[:1], tensor_rows)[0], expected[0])


def test_bitmask_bit_order_by_hand():
    """Bit t % 32 of word t // 32: token 0 is bit 0 of word 0, token 33 is bit 1 of word 1."""
    logits = torch.zeros(1, 64)
    out = apply_request_processors(logits, [row(SP(), allowed_token_bitmask=[1, 2])])[0]
    assert (out == 0).nonzero().flatten().tolist() == [0, 33]
