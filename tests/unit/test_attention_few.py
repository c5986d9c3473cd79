"""Few decode queries (one or two sequences) on AVX512 take attention_few.cpp: the threads share each kv head's keys
and values instead of splitting its query heads. Wider heads, larger groups and longer contexts than
test_native_kernels.py's attention test: every position decoded alone, and two sequences decoded together, give the
bits of the same tokens computed in one prefill step (a query at a time, attention.cpp)."""

from __future__ import annotations

import pytest
import torch
from test_native_kernels import attention_rows, naive, rope

from lmrpc.kernels import native
from lmrpc.kernels.paged import AttentionShape

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels do not build here")


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 2, 128), (9, 3, 64), (4, 2, 64)])
def test_few_decode_queries_take_the_shared_heads_route(heads: int, kv_heads: int, head_dim: int, bf16: bool) -> None:
    """The decode steps below (one or two sequences) run attention_few.cpp on an AVX512 build with two threads or
    more, and a prefill step the query-at-a-time route: so the bitwise test compares the two routes, not one with
    itself (a route switched off would pass it)."""
    k = native.load()
    threads = torch.get_num_threads()
    few = "few_queries" if k.native_bf16() and threads >= 2 else "queries"
    for t in (1, 2):
        assert k.attention_route(t, heads, kv_heads, head_dim, bf16, threads) == few
    assert k.attention_route(300, heads, kv_heads, head_dim, bf16, threads) == "queries"
    assert k.attention_route(1, heads, heads, head_dim, bf16, 2) == "queries"  # one query head a kv head: no split
    assert k.attention_route(1, heads, kv_heads, 96, bf16, 2) == "queries"  # no few-query kernel for that width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(16, 2, 128), (9, 3, 64), (4, 2, 64)])
def test_decoding_few_queries_gives_the_prefill_bits(dtype: torch.dtype, heads: int, kv_heads: int,
                                                    head_dim: int) -> None:
    shape = AttentionShape(layers=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim, scale=head_dim**-0.5,
                           qk_norm_eps=1e-6)
    g = torch.Generator().manual_seed(heads * head_dim)
    lengths = (300, 177)
    width = (heads + 2 * kv_heads) * head_dim
    seqs = [torch.randn(n, width, generator=g) for n in lengths]
    rot = rope(max(lengths), head_dim)
    pages = torch.randperm(48, generator=g).tolist()  # scrambled: the runs of pages are not runs of addresses
    tables = [pages[:19], pages[19:31]]

    def run(steps: list[list[tuple[int, int, int]]]) -> dict[tuple[int, int], torch.Tensor]:
        return attention_rows(shape, rot, dtype, seqs, tables, steps, None, num_pages=48)

    together = run([[(0, 0, 300), (1, 0, 177)]])
    alone = run([[(0, 0, 200)]] + [[(0, p, 1)] for p in range(200, 300)])
    # Both sequences' prompts, then both decoded in the same steps (2 queries: still few on 2 threads).
    pairs = run([[(0, 0, 250), (1, 0, 127)]] + [[(0, 250 + k, 1), (1, 127 + k, 1)] for k in range(50)])
    for p in range(200, 300):
        assert torch.equal(alone[(0, p)], together[(0, p)]), p
    for k in range(50):
        assert torch.equal(pairs[(0, 250 + k)], together[(0, 250 + k)]), k
        assert torch.equal(pairs[(1, 127 + k)], together[(1, 127 + k)]), k
    expected = naive(seqs[0], torch.arange(300), rot, None, dtype, shape)
    torch.testing.assert_close(torch.stack([alone[(0, p)] for p in range(200, 300)]), expected[200:], atol=1e-5,
                               rtol=1e-4)
