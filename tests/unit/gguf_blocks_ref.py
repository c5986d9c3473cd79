"""GGUF test blocks and what gguf's own `dequantize` says they stand for: random blocks of each format served as
blocks (the K-quants and IQ4s as raw random bytes with valid fp16 scales, gguf has no quantizer for them; Q5_0 and
Q5_1 through `gguf.quants.quantize`), and each block's codes, group scales and offsets read back through
`gguf.quants.dequantize` alone (probing copies of the blocks with chosen codes and scales), independent of our
loader."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
FORMATS = {"q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "q3_k": T.Q3_K,
           "q2_k": T.Q2_K, "iq4_nl": T.IQ4_NL, "iq4_xs": T.IQ4_XS}
# The 4-bit formats that serve through the Q4 layout (the int8-activation products read only those).
Q4_FORMATS = {"q4_0": T.Q4_0, "q4_1": T.Q4_1, "q4_k": T.Q4_K}
_ALL = FORMATS | Q4_FORMATS
ONE = np.array([1.0], dtype=np.float16).view(np.uint8)  # fp16 1.0 as two bytes


@dataclass(frozen=True)
class KParts:
    """A K-quant's scales as the file keeps them: scale = d * sc and offset = -(dmin * m), per super-block of
    `super_groups` groups d and dmin, per group sc and m (small integers, as float32)."""

    d: np.ndarray  # [n, supers] float32
    sc: np.ndarray  # [n, groups] float32
    dmin: np.ndarray | None  # [n, supers] float32
    m: np.ndarray | None  # [n, groups] float32
    super_groups: int


@dataclass(frozen=True)
class Reference:
    """What the kernels must multiply: value = code * scale (+ offset), each group's scale and offset float32."""

    values: np.ndarray  # [n, k] float32: gguf.quants.dequantize
    codes: np.ndarray  # [n, k] float32 (small integers, signed where the format is)
    scale: np.ndarray  # [n, groups] float32
    offset: np.ndarray | None  # [n, groups] float32
    group: int
    parts: KParts | None = None  # K-quants: the scales' parts (the products fold them per super-block)


def _fp16(rng: np.random.Generator, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
    return rng.uniform(low, high, shape).astype(np.float16).view(np.uint8).reshape(*shape, 2)


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, bytes of a row] of random blocks of this format."""
    rng = np.random.default_rng(seed)
    qtype = _ALL[fmt]
    if qtype in (T.Q5_0, T.Q5_1, T.Q4_0, T.Q4_1):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    halves = {T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}.get(qtype)
    if halves is not None:
        for at in halves:
            b[..., at : at + 2] = _fp16(rng, (n, k // size), 1e-4, 2e-3)
    else:
        b[..., 0:2] = _fp16(rng, (n, k // size), 1e-4, 2e-3)
        b[..., 2:4] = _fp16(rng, (n, k // size), 1e-4, 2e-3)
    return b.reshape(n, -1)


def _dequantize(blocks: np.ndarray, qtype: T, n: int) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(blocks.reshape(n, -1), qtype), dtype=np.float32).reshape(n, -1)


def reference(fmt: str, raw: np.ndarray, n: int, k: int) -> Reference:
    """Codes, scales and offsets of these blocks, each read from gguf's dequantize of a probe copy."""
    qtype = _ALL[fmt]
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    b = raw.reshape(n, k // size, nbytes)
    values = _dequantize(b, qtype, n)

    def probe(*edits: tuple[int, int, np.ndarray | int]) -> np.ndarray:
        """gguf's values of a copy of the blocks with bytes [start, stop) of each block set."""
        c = b.copy()
        for start, stop, v in edits:
            c[..., start:stop] = v
        return _dequantize(c, qtype, n)

    def per_group(v: np.ndarray, group: int) -> np.ndarray:
        return v.reshape(n, -1, group)[..., 0]

    if qtype in (T.Q4_K, T.Q5_K):
        unit = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)  # every sc = 1, m = 0
        codes = probe((0, 2, ONE), (2, 4, 0), (4, 16, unit))  # q * 1 - 0
        qs, high = ((16, 144, 0x11), (0, 0, 0)) if qtype == T.Q4_K else ((48, 176, 0x11), (16, 48, 0))
        scale = per_group(probe((2, 4, 0), qs, high), 32)  # 1 * d * sc - 0
        offset = per_group(probe((qs[0], qs[1], 0), high), 32)  # 0 * d * sc - dmin * m
        d = per_group(probe((2, 4, 0), (4, 16, unit), qs, high), 256)  # 1 * d * 1 - 0
        m_unit = np.array([0, 0, 0, 0, 1, 1, 1, 1, 0x10, 0x10, 0x10, 0x10], dtype=np.uint8)  # every sc = 0, m = 1
        dmin = -per_group(probe((4, 16, m_unit)), 256)  # q * d * 0 - dmin * 1
        parts = KParts(d, _quotient(scale, d, 8), dmin, _quotient(-offset, dmin, 8), 8)
        return Reference(values, codes, scale, offset, 32, parts)
    if qtype == T.Q6_K:
        codes = probe((208, 210, ONE), (192, 208, 1))  # (q - 32) * 1 * 1
        scale = per_group(probe((0, 128, 0x11), (128, 192, 0xAA)), 16)  # q = 33: 1 * d * sc
        d = per_group(probe((0, 128, 0x11), (128, 192, 0xAA), (192, 208, 1)), 256)  # 1 * d * 1
        return Reference(values, codes, scale, None, 16, KParts(d, _quotient(scale, d, 16), None, None, 16))
    if qtype == T.Q3_K:  # value (q - 4) * (d * (sc - 32)); scale bytes 0x11 and 0xAA: every sc - 32 = 1
        unit = ((96, 104, 0x11), (104, 108, 0xAA))
        codes = probe((108, 110, ONE), *unit)
        scale = per_group(probe((32, 96, 0x55), (0, 32, 0xFF)), 16)  # every q - 4 = 1: d * (sc - 32)
        d = per_group(probe((32, 96, 0x55), (0, 32, 0xFF), *unit), 256)
        return Reference(values, codes, scale, None, 16, KParts(d, _quotient(scale, d, 16), None, None, 16))
    if qtype == T.Q2_K:  # value q * (d * sc) - dmin * m; scale byte: sc low nibble, m high
        codes = probe((80, 82, ONE), (82, 84, 0), (0, 16, 0x01))
        scale = per_group(probe((82, 84, 0), (16, 80, 0x55)), 16)  # every q = 1
        offset = per_group(probe((16, 80, 0)), 16)  # q = 0: -dmin * m
        d = per_group(probe((82, 84, 0), (0, 16, 0x01), (16, 80, 0x55)), 256)
        dmin = -per_group(probe((0, 16, 0x10)), 256)  # sc = 0, m = 1
        return Reference(values, codes, scale, offset, 16,
                         KParts(d, _quotient(scale, d, 16), dmin, _quotient(-offset, dmin, 16), 16))
    if qtype == T.IQ4_NL:  # value T[i] * d; T[8] = 1
        codes = probe((0, 2, ONE))
        return Reference(values, codes, per_group(probe((2, 18, 0x88)), 32), None, 32)
    if qtype == T.IQ4_XS:  # value T[i] * (d * (sc - 32)); bytes 2-3 0xAA and 4-7 0x11: every sc - 32 = 1
        unit = ((2, 4, 0xAA), (4, 8, 0x11))
        codes = probe((0, 2, ONE), *unit)
        scale = per_group(probe((8, 136, 0x88)), 32)
        d = per_group(probe((8, 136, 0x88), *unit), 256)
        return Reference(values, codes, scale, None, 32, KParts(d, _quotient(scale, d, 8), None, None, 8))
    if qtype == T.Q4_0:  # value (q - 8) * d
        codes = probe((0, 2, ONE))
        scale = per_group(probe((2, 18, 0x99)), 32)  # q = 9
        return Reference(values, codes, scale, None, 32)
    if qtype == T.Q4_1:  # value q * d + m
        codes = probe((0, 2, ONE), (2, 4, 0))
        scale = per_group(probe((2, 4, 0), (4, 20, 0x11)), 32)  # q = 1, m = 0
        offset = per_group(probe((4, 20, 0)), 32)  # q = 0
        return Reference(values, codes, scale, offset, 32)
    if qtype == T.Q5_0:  # value (q - 16) * d
        codes = probe((0, 2, ONE))
        scale = per_group(probe((2, 6, 0xFF), (6, 22, 0x11)), 32)  # q = 17
        return Reference(values, codes, scale, None, 32)
    codes = probe((0, 2, ONE), (2, 4, 0))  # Q5_1: value q * d + m
    scale = per_group(probe((2, 4, 0), (4, 8, 0), (8, 24, 0x11)), 32)  # q = 1, m = 0
    offset = per_group(probe((4, 24, 0)), 32)  # q = 0
    return Reference(values, codes, scale, offset, 32)


def stacked(refs: list[Reference]) -> Reference:
    """The reference of these weights' rows stacked in order (all of one format)."""
    def rows(arrays: list[np.ndarray | None]) -> np.ndarray | None:
        return None if arrays[0] is None else np.concatenate(arrays)

    parts = None
    if refs[0].parts is not None:
        ps = [r.parts for r in refs if r.parts is not None]
        d, sc, dmin, m = (rows([getattr(p, f) for p in ps]) for f in ("d", "sc", "dmin", "m"))
        assert d is not None and sc is not None
        parts = KParts(d, sc, dmin, m, ps[0].super_groups)
    values, codes, scale = (rows([getattr(r, f) for r in refs]) for f in ("values", "codes", "scale"))
    assert values is not None and codes is not None and scale is not None
    return Reference(values, codes, scale, rows([r.offset for r in refs]), refs[0].group, parts)


def _quotient(per_group: np.ndarray, per_super: np.ndarray, super_groups: int) -> np.ndarray:
    """Each group's integer multiplier: its value / its super-block's (exact, the value being their exact product)."""
    q = per_group / np.repeat(per_super, super_groups, axis=1)
    assert np.array_equal(q, np.round(q)), "a group's scale is not an integer times its super-block's"
    return q.astype(np.float32)


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add, exact: a * b + c rounded once. The float64 sum of the exact product and c is
    made round-to-odd (its error found by TwoSum), which a float32 rounding then rounds as the exact value."""
    p = a.astype(np.float64) * b.astype(np.float64)  # exact: 24-bit significands
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    bits = s.view(np.int64).copy()
    inexact_even = (err != 0) & (bits & 1 == 0)
    bits += np.where(inexact_even, np.where((err > 0) == (s > 0), 1, -1), 0)
    return bits.view(np.float64).astype(np.float32)


# GGUF's grid and ternary formats (kernels/gguf_grids.py): (ggml type, byte offset of the fp16 d in a block; IQ1_M
# keeps its d in the top nibbles of its four scale words, bytes 48-55)
GRID_FORMATS = {"iq2_xxs": (T.IQ2_XXS, 0), "iq2_xs": (T.IQ2_XS, 0), "iq2_s": (T.IQ2_S, 0), "iq3_xxs": (T.IQ3_XXS, 0),
                "iq3_s": (T.IQ3_S, 0), "iq1_s": (T.IQ1_S, 0), "iq1_m": (T.IQ1_M, None), "tq1_0": (T.TQ1_0, 52),
                "tq2_0": (T.TQ2_0, 64)}


def random_grid_blocks(fmt: str, n: int, k: int, seed: int, low: float = 1e-4, high: float = 2e-3) -> np.ndarray:
    """uint8 [n, bytes of a row]: random blocks of a grid format (every byte pattern is a valid block), d drawn from
    [low, high) (fp16s: d / 8, as the kernels would fold it, is often subnormal there)."""
    qtype, at = GRID_FORMATS[fmt]
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    d = _fp16(rng, (n, k // size), low, high)
    if at is not None:
        b[..., at : at + 2] = d
    else:  # nibble i of d's bits: the top nibble of scale word i
        bits = d.view(np.uint16)[..., 0]
        words = np.ascontiguousarray(b[..., 48:56]).view(np.uint16)
        for i in range(4):
            words[..., i] = (words[..., i] & 0x0FFF) | (((bits >> (4 * i)) & 15) << 12)
        b[..., 48:56] = words.view(np.uint8)
    return b.reshape(n, -1)
