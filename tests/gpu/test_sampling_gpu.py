"""The sampling kernel on CUDA (flashinfer path when installed) agrees with the torch reference."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lmrpc.kernels.sampling import LogprobRequest, SamplingInputs, filter_logits, sample, seed_key

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = torch.device("cuda")


def _inputs(n: int, **kw: torch.Tensor) -> SamplingInputs:
    inputs = SamplingInputs(
        temperature=torch.ones(n, device=CUDA), generator=torch.Generator(device=CUDA).manual_seed(0)
    )
    for name, value in kw.items():
        setattr(inputs, name, value.to(CUDA).expand(n).clone())
    return inputs


def test_greedy_and_top_k_1_match_argmax() -> None:
    logits = torch.randn(32, 4096, device=CUDA)
    greedy = SamplingInputs(temperature=torch.zeros(32, device=CUDA))
    assert torch.equal(sample(logits, greedy).token_ids, logits.argmax(-1))
    top1 = _inputs(32, top_k=torch.tensor(1))
    assert torch.equal(sample(logits, top1).token_ids, logits.argmax(-1))


@pytest.mark.parametrize(
    "filters",
    [{}, {"top_k": torch.tensor(2)}, {"top_p": torch.tensor(0.8)}, {"min_p": torch.tensor(0.3)}],
)
def test_filtered_draws_stay_in_the_reference_support(filters: dict[str, torch.Tensor]) -> None:
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = p.log().to(CUDA).expand(n, -1).clone()
    drawn = Counter(sample(logits, _inputs(n, **filters)).token_ids.tolist())
    one = {k: v.reshape(1) for k, v in filters.items()}  # the torch reference on a single row
    ref = filter_logits(p.log()[None], one.get("top_k"), one.get("top_p"), one.get("min_p"))
    support = set(torch.isfinite(ref[0]).nonzero().squeeze(1).tolist())
    assert set(drawn) == support
    kept = p * torch.isfinite(ref[0])
    kept = kept / kept.sum()
    for token in support:
        assert abs(drawn[token] / n - kept[token].item()) < 0.03


def test_seeded_rows_on_cuda_are_batch_independent() -> None:
    row = torch.randn(1, 4096, device=CUDA)
    key = seed_key(7, 3)
    alone = sample(row, SamplingInputs(temperature=torch.ones(1, device=CUDA), seeds=[key])).token_ids.item()
    batch = torch.randn(3, 4096, device=CUDA)
    batch[1] = row[0]
    inputs = SamplingInputs(temperature=torch.ones(3, device=CUDA), seeds=[None, key, seed_key(8, 3)])
    assert sample(batch, inputs).token_ids[1].item() == alone


def test_logprobs_match_cpu() -> None:
    logits = torch.randn(4, 1000)
    req = LogprobRequest(rows=torch.tensor([0, 2]), top_k=5, requested=torch.tensor([[1, 2], [3, 4]]))
    cpu = sample(logits, SamplingInputs(temperature=torch.zeros(4), logprobs=req))
    req_gpu = LogprobRequest(rows=req.rows.to(CUDA), top_k=5, requested=req.requested.to(CUDA))  # type: ignore[union-attr]
    gpu = sample(logits.to(CUDA), SamplingInputs(temperature=torch.zeros(4, device=CUDA), logprobs=req_gpu))
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    assert cpu.top_logprobs is not None and gpu.top_logprobs is not None
    assert torch.allclose(cpu.top_logprobs, gpu.top_logprobs.cpu(), atol=1e-4)
