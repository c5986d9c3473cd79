"""The engine-side Sampler: per-sequence state, parameters to tensors, results and prompt logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from lmrpc.server.engine.sampler import Sampler, SamplingRow, SamplingState, prompt_logprobs
from lmrpc.server.engine.types import LogprobOptions, SamplingParams
from lmrpc.server.logit_processors import ProcessorRegistry

V = 16
EOS = 2


def _sampler() -> Sampler:
    return Sampler(V, (EOS,), torch.device("cpu"))


def _state(logprobs: LogprobOptions | None = None, **kw: object) -> SamplingState:
    return SamplingState(SamplingParams(**kw), logprobs, V, "cpu")  # type: ignore[arg-type]


def _run(sampler: Sampler, logits: torch.Tensor, state: SamplingState, steps: int) -> list[int]:
    out = []
    for pos in range(steps):
        out.append(sampler.sample(logits.clone(), [SamplingRow(state, pos, None, None)])[0].token_id)
        state.observe(out[-1])  # the engine records each kept token
    return out


def test_state_keeps_counts_only_with_penalties() -> None:
    plain = _state()
    assert plain.counts is None
    pen = _state(presence_penalty=0.5)
    for t in (3, 3, 5):
        pen.observe(t)
    assert pen.counts is not None and pen.counts.shape == (V,)
    assert pen.counts[3].item() == 2 and pen.counts[5].item() == 1 and pen.counts.sum().item() == 3


def test_frequency_penalty_raises_distinct_tokens_on_a_repetitive_distribution() -> None:
    logits = torch.zeros(1, V)
    logits[0, 7] = 3.0  # one token dominates
    sampler = _sampler()
    plain = _run(sampler, logits, _state(temperature=0.0), 20)
    penalized = _run(sampler, logits, _state(temperature=0.0, frequency_penalty=1.0), 20)
    assert len(set(plain)) == 1
    assert len(set(penalized)) > 5
    # Exactly as defined: 7 wins until 3 - count >= 0 stops beating the others (ties go to the lowest id).
    assert penalized[:3] == [7, 7, 7]


def test_presence_and_repetition_penalties_through_the_sampler() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.5] + [-5.0] * (V - 3)])
    sampler = _sampler()
    # presence 1.0: after one 2, its logit is 1.5 > 1.0, so 2 again; presence is not cumulative.
    assert _run(sampler, logits, _state(temperature=0.0, presence_penalty=1.0), 3) == [2, 2, 2]
    # repetition 3.0: 2.5 / 3 = 0.83 < 1.0, so 1 next; then 1 / 3 = 0.33 < 0.83: back to 2.
    assert _run(sampler, logits, _state(temperature=0.0, repetition_penalty=3.0), 3) == [2, 1, 2]


def test_min_new_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.full((1, V), -1.0)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0  # a stop_token_id
    state = _state(temperature=0.0, min_new_tokens=2, stop_token_ids=(9,))
    sampler = _sampler()
    first = sampler.sample(logits.clone(), [SamplingRow(state, 0, None, None)])[0].token_id
    second = sampler.sample(logits.clone(), [SamplingRow(state, 1, None, None)])[0].token_id
    third = sampler.sample(logits.clone(), [SamplingRow(state, 2, None, None)])[0].token_id
    assert first not in (EOS, 9) and second not in (EOS, 9)
    assert third == EOS


def test_logit_bias_forces_a_token() -> None:
    logits = torch.randn(2, V) * 3
    rows = [
        SamplingRow(_state(logit_bias={11: 100.0}), 0, None, None),
        SamplingRow(_state(temperature=0.0, logit_bias={4: 100.0}), 0, None, None),
    ]
    assert [r.token_id for r in _sampler().sample(logits, rows)] == [11, 4]


def test_grammar_bitmask_row() -> None:
    words = (V + 31) // 32
    mask = torch.zeros(words, dtype=torch.int32)
    mask[0] = (1 << 3) | (1 << 12)
    logits = torch.randn(30, V) * 4
    rows = [SamplingRow(_state(), 0, mask if i % 2 else None, None) for i in range(30)]
    tokens = [r.token_id for r in _sampler().sample(logits, rows)]
    assert all(t in (3, 12) for t in tokens[1::2])


def test_custom_processor_sees_output_ids() -> None:
    registry = ProcessorRegistry.load()
    seen: list[list[int]] = []

    class Spy:
        def __call__(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None:
            seen.append(list(output_ids))

    logits = torch.zeros(1, V)
    logits[0, 5] = 10.0
    logits[0, 6] = 9.0
    state = _state(temperature=0.0, logit_processor="disallowed_tokens")
    banned = registry.create("disallowed_tokens", {"token_ids": [5]})
    sampler = _sampler()
    assert sampler.sample(logits.clone(), [SamplingRow(state, 0, None, banned)])[0].token_id == 6
    state.observe(6)  # the engine records each kept token
    sampler.sample(logits.clone(), [SamplingRow(state, 1, None, Spy())])
    assert seen == [[6]]


def test_seeded_row_same_token_alone_and_in_any_batch() -> None:
    torch.manual_seed(3)
    row = torch.randn(1, V)
    sampler = _sampler()
    for pos in (0, 5, 17):
        alone = sampler.sample(row.clone(), [SamplingRow(_state(seed=77), pos, None, None)])[0].token_id
        batch = torch.randn(4, V)
        batch[2] = row[0]
        rows = [
            SamplingRow(_state(), 3, None, None),
            SamplingRow(_state(seed=77, top_p=0.5), pos + 1, None, None),
            SamplingRow(_state(seed=77), pos, None, None),
            SamplingRow(_state(temperature=0.0), 0, None, None),
        ]
        assert sampler.sample(batch, rows)[2].token_id == alone
    # Different positions draw differently: 30 positions of a near-uniform row cannot all agree.
    flat = torch.zeros(1, V)
    singles = [[SamplingRow(_state(seed=77), pos, None, None)] for pos in range(30)]
    tokens = {sampler.sample(flat.clone(), single)[0].token_id for single in singles}
    assert len(tokens) > 3


def test_logprob_results_per_row_options() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    rows = [
        SamplingRow(_state(LogprobOptions(top_k=3, token_ids=(1, 0)), temperature=0.0), 0, None, None),
        SamplingRow(_state(), 0, None, None),
        SamplingRow(_state(LogprobOptions(top_k=1), temperature=0.5), 0, None, None),
    ]
    res = _sampler().sample(logits, rows)
    assert res[1].logprobs is None
    lp0 = res[0].logprobs
    assert lp0 is not None
    ref0 = torch.log_softmax(logits[0], -1)
    assert lp0.chosen.token_id == res[0].token_id == int(logits[0].argmax())
    assert lp0.top[0].token_id == lp0.chosen.token_id  # greedy: top-1 is the chosen token
    assert [t.token_id for t in lp0.top] == ref0.topk(3).indices.tolist()
    assert [t.logprob for t in lp0.top] == pytest.approx(ref0.topk(3).values.tolist())
    assert [t.token_id for t in lp0.requested] == [1, 0]
    assert [t.logprob for t in lp0.requested] == pytest.approx(ref0[[1, 0]].tolist())
    lp2 = res[2].logprobs
    assert lp2 is not None and len(lp2.top) == 1 and lp2.requested == ()
    ref2 = torch.log_softmax(logits[2] / 0.5, -1)
    assert lp2.chosen.logprob == pytest.approx(ref2[res[2].token_id].item())
    assert lp2.chosen.text is None


def test_prompt_logprobs_raw_distribution() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    out = prompt_logprobs(logits, [4, 9], LogprobOptions(start_len=0, top_k=2, token_ids=(7,)))
    assert len(out) == 2  # the last row predicts a token not known yet
    ref = torch.log_softmax(logits, -1)
    assert out[0].chosen.token_id == 4 and out[0].chosen.logprob == pytest.approx(ref[0, 4].item())
    assert out[1].chosen.logprob == pytest.approx(ref[1, 9].item())
    assert [t.token_id for t in out[1].top] == ref[1].topk(2).indices.tolist()
    assert out[1].requested[0].token_id == 7
    assert out[1].requested[0].logprob == pytest.approx(ref[1, 7].item())
    assert math.isclose(sum(math.exp(x) for x in ref[0].tolist()), 1.0, rel_tol=1e-5)


def test_padded_vocabulary_columns_are_never_sampled() -> None:
    logits = torch.zeros(2, V + 8)
    logits[:, V + 3] = 100.0  # a padding column of the embedding
    rows = [SamplingRow(_state(temperature=0.0), 0, None, None), SamplingRow(_state(), 0, None, None)]
    assert all(r.token_id < V for r in _sampler().sample(logits, rows))


@pytest.mark.parametrize("feature", ["none", "logit_bias", "grammar", "min_new_tokens", "penalty", "processor",
                                     "logprobs"])
def test_a_greedy_batch_still_applies_each_rows_feature(feature: str) -> None:
    # A batch of greedy rows with nothing to apply takes each row's argmax as it is (Sampler.sample's shortcut);
    # one row with a feature among plain greedy rows must still get it.
    logits = torch.full((3, V), -1.0)
    logits[:, EOS] = 10.0  # every row's maximum...
    logits[:, 7] = 9.0  # ...and the runner-up
    mask = torch.zeros((V + 31) // 32, dtype=torch.int32)
    mask[0] = 1 << 3
    kw: dict[str, object] = {"temperature": 0.0}
    bitmask, processor, logprobs = None, None, None
    if feature == "logit_bias":
        kw["logit_bias"] = {4: 100.0}
    elif feature == "grammar":
        bitmask = mask
    elif feature == "min_new_tokens":
        kw["min_new_tokens"] = 1
    elif feature == "penalty":
        kw["repetition_penalty"] = 3.0
    elif feature == "processor":
        processor = ProcessorRegistry.load().create("disallowed_tokens", {"token_ids": [EOS]})
    elif feature == "logprobs":
        logprobs = LogprobOptions(top_k=2)
    state = _state(logprobs, **kw)
    state.observe(EOS)  # penalized from now on
    featured = SamplingRow(state, 0, bitmask, processor)
    plain = [SamplingRow(_state(temperature=0.0), 0, None, None) for _ in range(2)]
    assert featured.plain_greedy == (feature == "none") and all(r.plain_greedy for r in plain)
    results = _sampler().sample(logits, [plain[0], featured, plain[1]])
    expected = {"none": EOS, "logit_bias": 4, "grammar": 3, "min_new_tokens": 7, "penalty": 7, "processor": 7,
                "logprobs": EOS}[feature]
    assert [r.token_id for r in results] == [EOS, expected, EOS]
    assert [r.logprobs is not None for r in results] == [False, feature == "logprobs", False]
    if feature == "logprobs":
        lp = results[1].logprobs
        assert lp is not None and [t.token_id for t in lp.top] == [EOS, 7]
