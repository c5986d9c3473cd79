"""The host side of CUDA-graph decode steps (no GPU needed): bucket choice and padding rows that touch only the
scratch page. Capture and replay are tested in tests/gpu/test_cuda_graphs_gpu.py."""

from __future__ import annotations

import torch

from lmrpc.kernels.paged import ChunkSpec
from lmrpc.server.engine.cuda_graphs import default_buckets, pad_decode_rows


def test_buckets_cover_every_batch_up_to_the_limit() -> None:
    assert default_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert default_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert default_buckets(1) == (1,)


def test_padding_rows_write_only_to_the_scratch_page() -> None:
    page, scratch = 16, 99
    chunks = [ChunkSpec(37, 1, [4, 7, 2, 9]), ChunkSpec(0, 1, [5]), ChunkSpec(15, 1, [8, 3])]
    rows = pad_decode_rows([11, 12, 13], chunks, bucket=8, page_size=page, scratch_page=scratch)
    assert rows.real == 3 and rows.bucket == 8
    assert rows.ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert rows.positions.tolist() == [37, 0, 15, 0, 0, 0, 0, 0]
    # position 37 is page index 2 (page 2), offset 5; the padding rows all write slot 0 of the scratch page
    assert rows.slots.tolist() == [2 * page + 5, 5 * page, 8 * page + 15] + [scratch * page] * 5
    # flashinfer's table: only the pages holding positions 0..position (the 4th page of row 0 is not used yet)
    assert rows.paged.kv_indptr.tolist() == [0, 3, 4, 5, 6, 7, 8, 9, 10]
    assert rows.paged.kv_indices.tolist() == [4, 7, 2, 5, 8] + [scratch] * 5
    assert rows.paged.kv_last_page_len.tolist() == [6, 1, 16, 1, 1, 1, 1, 1]
    assert rows.paged.kv_indices.dtype == torch.int32
