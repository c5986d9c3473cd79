"""Weights and the KV cache in huge pages (kernels/lmrpc/kernels/hugepages.py): the memory is what was asked for,
advised into huge pages where Linux offers them, freed with its last tensor, and products over it give the same bits.
"""

from __future__ import annotations

import gc
import itertools
import mmap
import sys
from pathlib import Path

import pytest
import torch

from lmrpc.kernels import hugepages, native, packing, quantize
from lmrpc.kernels.packing import Compute

linux_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                               reason="transparent huge pages are Linux's")


def _smaps_field(address: int, field: str) -> list[str]:
    """A field of the mapping of this process holding `address` (/proc/self/smaps), split on whitespace."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == field + ":":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> set[str]:
    return set(_smaps_field(address, "VmFlags"))


def _mapped(address: int) -> bool:
    try:
        _smaps_field(address, "Rss")
    except AssertionError:  # no mapping holds it
        return False
    return True


def _resident_kib(address: int) -> int:
    return int(_smaps_field(address, "Rss")[0])


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_zeros_are_resident_from_the_start() -> None:
    # A KV pool that does not fit must fail at start, not under load; and RSS must say what the pool holds.
    t = hugepages.zeros((8 << 20,), torch.uint8)
    assert _resident_kib(t.data_ptr()) >= 8 << 10


def test_zeros_are_zeros_of_the_shape_and_dtype_on_a_huge_page_boundary() -> None:
    t = hugepages.zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert torch.equal(t, torch.zeros(3, 5, 7, dtype=torch.bfloat16))
    t.fill_(1.5)  # writable
    assert bool((t == 1.5).all())


@linux_thp
def test_mappings_are_advised_into_huge_pages_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    advised = hugepages.zeros((4 << 20,), torch.uint8)
    assert "hg" in _vm_flags(advised.data_ptr())  # MADV_HUGEPAGE
    monkeypatch.setenv("LMRPC_HUGE_PAGES", "0")
    plain = hugepages.zeros((4 << 20,), torch.uint8)
    assert "hg" not in _vm_flags(plain.data_ptr())


def test_the_mapping_lives_as_long_as_a_tensor_placed_in_it() -> None:
    arena = hugepages.Arena(chunk_bytes=1 << 20)
    kept = arena.place(torch.arange(1000, dtype=torch.float32))
    address = kept.data_ptr()
    del arena
    gc.collect()
    assert _mapped(address) and torch.equal(kept, torch.arange(1000, dtype=torch.float32))
    del kept
    gc.collect()
    assert not _mapped(address)


def test_arena_places_copies_on_cache_lines_and_grows_by_chunks() -> None:
    arena = hugepages.Arena(chunk_bytes=1 << 16)
    sources = [torch.randn(n) for n in (3, 1000, 5, 9000, 17)] + [torch.randint(0, 255, (40000,), dtype=torch.uint8)]
    placed = [arena.place(s) for s in sources]
    for s, p in zip(sources, placed, strict=True):
        assert torch.equal(s, p) and p.data_ptr() != s.data_ptr()
        assert p.data_ptr() % hugepages.ALIGN == 0
    # no two placed tensors overlap
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in placed)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    big = arena.zeros((1 << 17,), torch.uint8)  # larger than a chunk: a chunk of its own
    assert big.numel() == 1 << 17 and int(big.sum()) == 0


@pytest.mark.skipif(not native.available(), reason="needs the native kernels")
@pytest.mark.parametrize("kind", ["q4", "q8", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 5, 32])
def test_products_over_placed_weights_have_the_same_bits(kind: str, rows: int) -> None:
    from lmrpc.server.models.quantized import NativeLinear

    torch.manual_seed(0)
    dense = torch.randn(200, 96) * 0.05
    make = {"q4": quantize.quantize_int4, "q8": quantize.quantize_int8,
            "bf16": lambda d: packing.pack_dense(d.bfloat16())}
    weight = make[kind](dense)  # q8: its expanded codes are placed too
    x = torch.randn(rows, 96)
    plain = NativeLinear(weight, Compute.BF16, expand_codes=True)
    placed = NativeLinear(weight, Compute.BF16, expand_codes=True, arena=hugepages.Arena())
    assert placed.weight.data.data_ptr() != weight.data.data_ptr()
    assert torch.equal(plain(x), placed(x))


def test_int8_weights_keep_copies_of_their_codes_only_within_the_models_budget() -> None:
    """A large int8 model must not load as a bf16 copy of itself: the first weights built take copies of their codes
    until the model's budget is spent, the rest go without, and the products' bits are the same either way."""
    from lmrpc.server.models.quantized import CodesBudget, LinearBuilder, Quantization

    torch.manual_seed(0)
    dense = torch.randn(64, 96) * 0.05
    copy = 2 * 64 * 96  # a bf16 copy of the codes of one such weight
    builder = LinearBuilder(Quantization.INT8, torch.bfloat16, torch.device("cpu"), native=True,
                            codes_budget=CodesBudget(2 * copy + copy // 2))
    layers = [builder.build(dense) for _ in range(3)]
    assert layers[0].weight.n_pad * layers[0].weight.k_pad == 64 * 96
    if native.load().native_bf16():
        assert [layer.nbytes - layers[2].nbytes for layer in layers] == [copy, copy, 0]
        assert builder.codes_budget.left == copy // 2
    else:  # no bf16 products read a copy here (the portable loops expand codes as they go): none is made or counted
        assert [layer.nbytes - layers[2].nbytes for layer in layers] == [0, 0, 0]
        assert builder.codes_budget.left == 2 * copy + copy // 2
    x = torch.randn(9, 96)  # products of many rows: the ones that read the copy
    assert torch.equal(layers[0](x), layers[2](x))
