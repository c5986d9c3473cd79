"""The tensor-level sampling kernel (lmrpc.kernels.sampling): logit processing steps, filters, seeds, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from lmrpc.kernels.sampling import (
    LogprobRequest,
    Penalties,
    SamplingInputs,
    apply_bitmask,
    filter_logits,
    process_logits,
    row_argmax,
    sample,
    seed_key,
)

V = 8


def _temps(*t: float) -> torch.Tensor:
    return torch.tensor(t, dtype=torch.float32)


def _probs_logits(*p: float) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float32).log()


def _draws(logits: torch.Tensor, n: int, **kw: torch.Tensor | None) -> Counter[int]:
    """n draws from one row: the row repeated n times, one pass."""
    batch = logits.expand(n, -1).clone()
    inputs = SamplingInputs(temperature=torch.ones(n), generator=torch.Generator().manual_seed(0))
    for name, value in kw.items():
        setattr(inputs, name, None if value is None else value.expand(n).clone())
    return Counter(sample(batch, inputs).token_ids.tolist())


def test_greedy_is_argmax_whatever_top_k_top_p_say() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    inputs = SamplingInputs(
        temperature=_temps(0.0, 1e-7, 0.0, 0.0),
        top_k=torch.tensor([3, 1, V, 2]),
        top_p=torch.tensor([0.1, 0.5, 0.2, 1.0]),
        min_p=torch.tensor([0.9, 0.0, 0.5, 0.1]),
        seeds=[None, 5, None, 7],
    )
    assert sample(logits, inputs).token_ids.tolist() == logits.argmax(-1).tolist()


def test_row_argmax_is_torchs_argmax_ties_nan_and_infinities_included() -> None:
    """The vectorised CPU argmax greedy rows take answers what torch.argmax answers: the first maximum, a NaN before
    any number, a row of -inf its first entry, over contiguous and strided rows, in int64."""
    logits = torch.randn(9, 49152, generator=torch.Generator().manual_seed(3))
    logits[0, [17, 4000, 30000]] = 50.0  # a three-way tie: the first wins
    logits[1, 123] = float("nan")
    logits[1, 9] = float("inf")
    logits[2, 77] = float("inf")
    logits[3] = float("-inf")
    logits[4, [5, 6]] = float("nan")
    logits[5, -1] = 1e30
    logits[6] = 0.0
    for case in (logits, logits[:, :40000], logits[::2], logits[3:4]):
        got = row_argmax(case)
        assert got.dtype == torch.int64
        assert got.tolist() == case.argmax(dim=-1).tolist()
    assert row_argmax(logits)[:7].tolist() == [17, 123, 77, 0, 5, 49151, 0]


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(2))
    inputs = SamplingInputs(
        temperature=torch.full((64,), 1.5), top_k=torch.ones(64, dtype=torch.int64), generator=torch.Generator()
    )
    assert sample(logits, inputs).token_ids.tolist() == logits.argmax(-1).tolist()


def test_sampling_follows_the_distribution() -> None:
    p = [0.5, 0.3, 0.15, 0.05]
    counts = _draws(_probs_logits(*p), 20000)
    for token, prob in enumerate(p):
        assert abs(counts[token] / 20000 - prob) < 0.02


def test_temperature_flattens_and_sharpens() -> None:
    logits = _probs_logits(0.7, 0.3)
    hot = _draws(logits, 8000, temperature=torch.tensor(100.0))
    cold = _draws(logits, 8000, temperature=torch.tensor(0.2))
    assert abs(hot[1] / 8000 - 0.5) < 0.03  # ~uniform
    expected_cold = 0.3**5 / (0.3**5 + 0.7**5)  # p ** (1/T), renormalized
    assert abs(cold[1] / 8000 - expected_cold) < 0.02


def test_logit_bias_plus_100_forces_a_token() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3)) * 5
    inputs = SamplingInputs(
        temperature=_temps(1.0, 0.0, 0.7),
        bias_rows=torch.tensor([0, 1, 2, 2]),
        bias_ids=torch.tensor([6, 5, 4, 1]),
        bias_values=torch.tensor([100.0, 100.0, 100.0, -100.0]),
        generator=torch.Generator().manual_seed(0),
    )
    assert sample(logits, inputs).token_ids.tolist() == [6, 5, 4]


def test_frequency_and_presence_penalties_exact() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5], [1.0, 2.0, -1.0, 0.5]])
    counts = torch.tensor([[0.0, 3.0, 1.0, 0.0]])
    pen = Penalties(
        rows=torch.tensor([1]),
        counts=counts,
        frequency=torch.tensor([0.5]),
        presence=torch.tensor([0.25]),
        repetition=torch.tensor([1.0]),
    )
    out = process_logits(logits, SamplingInputs(temperature=_temps(1, 1), penalties=pen))
    assert out[0].tolist() == [1.0, 2.0, -1.0, 0.5]  # row 0 has no penalties
    assert out[1].tolist() == pytest.approx([1.0, 2.0 - 1.5 - 0.25, -1.0 - 0.5 - 0.25, 0.5])


def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([[3.0, -2.0, 1.0, -4.0]])
    pen = Penalties(
        rows=torch.tensor([0]),
        counts=torch.tensor([[1.0, 2.0, 0.0, 0.0]]),
        frequency=torch.zeros(1),
        presence=torch.zeros(1),
        repetition=torch.tensor([2.0]),
    )
    out = process_logits(logits, SamplingInputs(temperature=_temps(1), penalties=pen))
    # Present tokens: positive divided by r, negative multiplied by r; absent tokens untouched.
    assert out[0].tolist() == [1.5, -4.0, 1.0, -4.0]


def test_min_p_never_draws_tokens_under_threshold() -> None:
    p = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
    counts = _draws(_probs_logits(*p), 6000, min_p=torch.tensor(0.3))  # threshold 0.12
    assert set(counts) == {0, 1, 2}
    assert abs(counts[0] / 6000 - 0.4 / 0.8) < 0.03  # renormalized over the kept tokens


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = _probs_logits(0.5, 0.3, 0.15, 0.05)
    assert set(_draws(logits, 3000, top_p=torch.tensor(0.8))) == {0, 1}  # 0.5 + 0.3 reaches 0.8
    assert set(_draws(logits, 3000, top_p=torch.tensor(0.81))) == {0, 1, 2}
    assert set(_draws(logits, 3000, top_p=torch.tensor(0.3))) == {0}  # the best token always stays
    assert set(_draws(logits, 6000, top_p=torch.tensor(1.0))) == {0, 1, 2, 3}


def test_top_k_then_top_p_on_the_renormalized_rest() -> None:
    logits = _probs_logits(0.4, 0.3, 0.2, 0.1)
    # top_k=2 leaves 0.4/0.7 and 0.3/0.7; top_p=0.5 then keeps only the first (0.57 >= 0.5).
    assert set(_draws(logits, 3000, top_k=torch.tensor(2), top_p=torch.tensor(0.5))) == {0}
    assert set(_draws(logits, 3000, top_k=torch.tensor(3))) == {0, 1, 2}


def test_filter_logits_per_row_parameters() -> None:
    logits = _probs_logits(0.4, 0.3, 0.2, 0.1).expand(3, -1).clone()
    out = filter_logits(
        logits, top_k=torch.tensor([1, 4, 4]), top_p=torch.tensor([1.0, 0.6, 1.0]), min_p=torch.tensor([0, 0, 0.45])
    )
    kept = torch.isfinite(out).tolist()
    assert kept == [[True, False, False, False], [True, True, False, False], [True, True, True, False]]
    assert out[2, :3].tolist() == logits[2, :3].tolist()  # kept logits keep their values


def test_min_tokens_banned_ids_get_minus_inf() -> None:
    logits = torch.zeros(2, V)
    logits[:, 2] = 50.0  # "EOS" would always win
    inputs = SamplingInputs(temperature=_temps(0, 0), banned_rows=torch.tensor([0, 0]), banned_ids=torch.tensor([2, 3]))
    tokens = sample(logits, inputs).token_ids.tolist()
    assert tokens[0] != 2 and tokens[1] == 2


def _pack(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    words = (vocab + 31) // 32
    out = torch.zeros(len(allowed), words, dtype=torch.int64)
    for r, ids in enumerate(allowed):
        for t in ids:
            out[r, t // 32] |= 1 << (t % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)  # as signed int32 words


def test_bitmask_blocks_disallowed_ids() -> None:
    vocab = 70  # three words, the last partial
    allowed = [[1, 33, 69], [31, 64]]
    logits = torch.randn(3, vocab)
    apply_bitmask(logits, torch.tensor([0, 2]), _pack(allowed, vocab))
    assert torch.isfinite(logits[0]).nonzero().squeeze(1).tolist() == [1, 33, 69]
    assert torch.isfinite(logits[1]).all()  # unconstrained row
    assert torch.isfinite(logits[2]).nonzero().squeeze(1).tolist() == [31, 64]
    many = torch.randn(200, vocab) * 10
    inputs = SamplingInputs(
        temperature=torch.ones(200),
        bitmask_rows=torch.arange(200),
        bitmask=_pack([[31, 64]], vocab).expand(200, -1).clone(),
    )
    assert set(sample(many, inputs).token_ids.tolist()) <= {31, 64}


def test_custom_row_processors_in_place_or_returned() -> None:
    logits = torch.zeros(3, V)

    def in_place(row: torch.Tensor) -> None:
        row[5] = 9.0

    def replaced(row: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(row, -1.0)
        out[6] = 9.0
        return out

    out = process_logits(logits, SamplingInputs(temperature=_temps(1, 1, 1), processors=[(0, in_place), (2, replaced)]))
    assert out.argmax(-1).tolist() == [5, 0, 6]
    assert logits.abs().sum() == 0  # the caller's logits are left alone


def test_seeded_row_is_independent_of_the_batch() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 1000)
    key = seed_key(1234, 7)
    alone = sample(row, SamplingInputs(temperature=_temps(0.9), seeds=[key])).token_ids.item()
    batch = torch.randn(5, 1000)
    batch[3] = row[0]
    inputs = SamplingInputs(
        temperature=_temps(1.0, 0.9, 0.0, 0.9, 1.3),
        seeds=[None, seed_key(1234, 8), None, key, seed_key(99, 7)],
        top_k=torch.tensor([5, 1000, 1000, 1000, 3]),
        generator=torch.Generator().manual_seed(5),
    )
    for _ in range(3):
        assert sample(batch, inputs).token_ids[3].item() == alone


def test_seeds_vary_by_position_and_follow_the_distribution() -> None:
    p = [0.6, 0.3, 0.1]
    n = 6000
    logits = _probs_logits(*p).expand(n, -1).clone()
    inputs = SamplingInputs(temperature=torch.ones(n), seeds=[seed_key(42, pos) for pos in range(n)])
    counts = Counter(sample(logits, inputs).token_ids.tolist())
    for token, prob in enumerate(p):
        assert abs(counts[token] / n - prob) < 0.025


def test_seed_key_mixes() -> None:
    keys = {seed_key(s, pos) for s in range(20) for pos in range(50)}
    assert len(keys) == 1000
    assert all(0 <= k < 2**63 for k in keys)


def test_logprobs_chosen_top_requested_with_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0], [0.5, 0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 5.0, 1.0, 1.0]])
    temps = _temps(0.0, 2.0, 1.0)
    inputs = SamplingInputs(
        temperature=temps,
        top_k=torch.tensor([5, 1, 5]),  # filtering must not change the logprobs
        logprobs=LogprobRequest(rows=torch.tensor([0, 1]), top_k=3, requested=torch.tensor([[3, 0], [1, 4]])),
        generator=torch.Generator().manual_seed(0),
    )
    out = sample(logits, inputs)
    assert out.chosen_logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    assert out.requested_logprobs is not None
    ref0 = torch.log_softmax(logits[0], -1)  # greedy row: temperature 1
    ref1 = torch.log_softmax(logits[1] / 2.0, -1)
    assert out.token_ids[0].item() == 4
    assert out.top_ids[0].tolist() == [4, 0, 1]  # best first; greedy chosen is the top-1
    assert out.top_logprobs[0].tolist() == pytest.approx(ref0[[4, 0, 1]].tolist())
    assert out.chosen_logprobs[0].item() == pytest.approx(ref0[4].item())
    assert out.requested_logprobs[0].tolist() == pytest.approx(ref0[[3, 0]].tolist())
    assert out.token_ids[1].item() == 0  # top_k = 1
    assert out.chosen_logprobs[1].item() == pytest.approx(ref1[0].item())
    assert out.requested_logprobs[1].tolist() == pytest.approx(ref1[[1, 4]].tolist())
    assert math.isfinite(out.top_logprobs[1, 2].item())  # before top-k filtering


def test_logprobs_after_processing() -> None:
    logits = torch.zeros(1, 4)
    inputs = SamplingInputs(
        temperature=_temps(0.0),
        bias_rows=torch.tensor([0]),
        bias_ids=torch.tensor([2]),
        bias_values=torch.tensor([math.log(3.0)]),
        logprobs=LogprobRequest(rows=torch.tensor([0]), top_k=1, requested=None),
    )
    out = sample(logits, inputs)
    assert out.token_ids.item() == 2
    assert out.chosen_logprobs is not None
    assert out.chosen_logprobs.item() == pytest.approx(math.log(3.0 / 6.0))


def _reference_keep(logits: torch.Tensor, k: int, p: float, min_p: float) -> set[int]:
    """The textbook definition on one row, with a full sort: top_k, top_p over the renormalized rest, min_p."""
    probs = torch.softmax(logits.double(), -1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:k]
    mass = sum(probs[t].item() for t in kept)
    nucleus: list[int] = []
    acc = 0.0
    for t in kept:
        if nucleus and (p < 1.0 and acc >= p * mass):
            break
        nucleus.append(t)
        acc += probs[t].item()
    pmax = probs.max().item()
    return {t for t in nucleus if probs[t].item() >= min_p * pmax}


@pytest.mark.parametrize("scale", [0.05, 1.0, 6.0])  # flat rows need a wider ranking than RANK_PREFIX
def test_filter_matches_the_full_sort_definition(scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale * 100))
    vocab, rows = 3000, 24
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64).float() * scale
    ks = torch.randint(1, 400, (rows,), generator=gen)
    ks[::3] = vocab  # no top_k
    ps = torch.rand(rows, generator=gen) * 0.98 + 0.01
    ps[1::4] = 1.0  # no top_p
    mins = torch.zeros(rows)
    mins[2::5] = 0.2
    out = filter_logits(logits, ks, ps, mins)
    widest = int(torch.isfinite(out).sum(-1).max())
    assert widest > 256 if scale < 0.1 else True  # the flat case does exercise the wider retry
    for r in range(rows):
        got = set(torch.isfinite(out[r]).nonzero().squeeze(1).tolist())
        want = _reference_keep(logits[r], int(ks[r]), float(ps[r]), float(mins[r]))
        # Float rounding may flip a token sitting exactly on the top_p boundary; nothing else may differ.
        assert len(got ^ want) <= 1, (r, len(got), len(want))


def test_bitmask_disallows_columns_past_its_width() -> None:
    """A model's padded vocabulary is wider than the tokenizer's mask: the extra columns are never allowed."""
    logits = torch.randn(2, 100)  # the mask below covers 3 words = 96 ids
    apply_bitmask(logits, torch.tensor([1]), _pack([[0, 95]], 96))
    assert torch.isfinite(logits[1]).nonzero().squeeze(1).tolist() == [0, 95]
    assert torch.isfinite(logits[0]).all()
