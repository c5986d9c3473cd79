"""GGUF files written by the tests: a tiny 2-layer Llama (SmolLM2's vocabulary and tokenizer, widths multiples of
256) with its matrices in one block format, and the real SmolLM2 with its MLP down projections re-quantized to
Q4_K and Q6_K as llama-quantize's Q4_K_M does (its other widths, 576, are no multiple of 256).

K-quants and the IQ4s have no quantizer in the gguf package: `quantize_q4_k`, `quantize_q6_k`, `quantize_q3_k`,
`quantize_q2_k`, `quantize_iq4_nl` and `quantize_iq4_xs` are plain ones of our own (scales from each sub-block's
range, no search), enough for weights a model can run on; what is served is checked against gguf's own
`dequantize` of whatever bytes they write. The grid and ternary formats (IQ1-IQ3, TQ) get random blocks (every byte
pattern is a valid block) with d sized so that the weights are about as large as the others'."""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import gguf
import numpy as np
from gguf_blocks_ref import GRID_FORMATS, random_grid_blocks

from lmrpc.server.models.loader import default_gguf

T = gguf.GGMLQuantizationType
TINY = {"hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "layers": 2, "vocab": 49152}


def _fp16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (fp16 bytes [..., 2], the fp16 values as float32)."""
    h = v.astype(np.float16)
    return h.view(np.uint8).reshape(*v.shape, 2), h.astype(np.float32)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b > 0)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) -> Q4_K blocks, uint8 [n, k / 256 * 144]."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32)
    low = np.minimum(x.min(-1), 0)  # [n, S, 8]
    step = (x.max(-1) - low) / 15
    d_bytes, d = _fp16(step.max(-1) / 63)
    m_bytes, dmin = _fp16(-low.min(-1) / 63)
    sc = np.clip(np.round(_ratio(step, d[..., None])), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_ratio(-low, dmin[..., None])), 0, 63).astype(np.uint8)
    scale, offset = d[..., None] * sc, dmin[..., None] * m
    q = np.clip(np.round(_ratio(x + offset[..., None], np.broadcast_to(scale[..., None], x.shape))), 0, 15)
    q = q.astype(np.uint8)
    packed = np.concatenate([
        (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6), (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, k // 256, 128)
    return np.concatenate([d_bytes, m_bytes, packed, qs], axis=-1).reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) -> Q6_K blocks, uint8 [n, k / 256 * 210]."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16)
    step = np.abs(x).max(-1) / 31
    d_bytes, d = _fp16(step.max(-1) / 127)
    sc = np.clip(np.round(_ratio(step, d[..., None])), -128, 127).astype(np.int8)
    scale = d[..., None] * sc
    signed = np.clip(np.round(_ratio(x, np.broadcast_to(scale[..., None], x.shape))), -32, 31).astype(np.int16)
    q = (signed + 32).astype(np.uint8).reshape(n, k // 256, 2, 128)  # halves of 128
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)  # [n, S, 2, 64]
    top = (q >> 4).reshape(n, k // 256, 2, 4, 32)
    qh = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    return np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8), d_bytes],
                          axis=-1).reshape(n, -1)


def _two_bit_bytes(c: np.ndarray) -> np.ndarray:
    """2-bit codes [n, S, 256] -> Q2_K's and Q3_K's qs [n, S, 64]: per half of 128, element 32 j + l in bits 2j,
    2j + 1 of the half's byte l."""
    q = c.reshape(*c.shape[:2], 2, 4, 32)
    return (q[..., 0, :] | (q[..., 1, :] << 2) | (q[..., 2, :] << 4) | (q[..., 3, :] << 6)).reshape(*c.shape[:2], 64)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> Q3_K blocks, uint8 [n, k / 256 * 110]: per 16, value (c - 4) * d * (sc - 32), c 0..7."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16)
    step = np.abs(x).max(-1) / 4
    d_bytes, d = _fp16(step.max(-1) / 31)
    sc = np.clip(np.round(_ratio(step, d[..., None])), 0, 31).astype(np.int16)  # sc - 32 >= 0
    scale = d[..., None] * sc
    c = (np.clip(np.round(_ratio(x, np.broadcast_to(scale[..., None], x.shape))), -4, 3) + 4).astype(np.uint8)
    c = c.reshape(n, k // 256, 256)
    hmask = np.zeros((n, k // 256, 32), np.uint8)
    for i in range(8):  # bit i of byte l: element 32 i + l's code >= 4
        hmask |= (c[..., 32 * i : 32 * i + 32] >> 2) << i
    s6 = (sc + 32).astype(np.uint8)  # [n, S, 16]
    low = (s6[..., :8] & 15) | ((s6[..., 8:] & 15) << 4)
    top = (s6 >> 4).reshape(n, k // 256, 4, 4)  # [.., g // 4, g % 4]
    high = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    return np.concatenate([hmask, _two_bit_bytes(c & 3), low, high, d_bytes], axis=-1).reshape(n, -1)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> Q2_K blocks, uint8 [n, k / 256 * 84]: per 16, value q * d * sc - dmin * m, q 0..3."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 16, 16)
    low = np.minimum(x.min(-1), 0)
    step = (x.max(-1) - low) / 3
    d_bytes, d = _fp16(step.max(-1) / 15)
    m_bytes, dmin = _fp16(-low.min(-1) / 15)
    sc = np.clip(np.round(_ratio(step, d[..., None])), 0, 15).astype(np.uint8)
    m = np.clip(np.round(_ratio(-low, dmin[..., None])), 0, 15).astype(np.uint8)
    scale, offset = d[..., None] * sc, dmin[..., None] * m
    q = np.clip(np.round(_ratio(x + offset[..., None], np.broadcast_to(scale[..., None], x.shape))), 0, 3)
    qs = _two_bit_bytes(q.astype(np.uint8).reshape(n, k // 256, 256))
    return np.concatenate([sc | (m << 4), qs, d_bytes, m_bytes], axis=-1).reshape(n, -1)


IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)  # the 16 values IQ4_NL's and IQ4_XS's codes index


def _iq4_codes(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The nearest table value's index for x / scale: x [..., 32], scale [...] -> [..., 32] uint8 (0..15)."""
    r = _ratio(x, np.broadcast_to(scale[..., None], x.shape))
    return np.abs(r[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Codes [..., 32] -> 16 bytes: element j in the low nibble of byte j, element j + 16 in its high nibble."""
    return q[..., :16] | (q[..., 16:] << 4)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> IQ4_NL blocks, uint8 [n, k / 32 * 18]: per 32, value T[i] * d."""
    n, k = w.shape
    x = w.reshape(n, k // 32, 32)
    d_bytes, d = _fp16(np.abs(x).max(-1) / 127)
    return np.concatenate([d_bytes, _nibble_pairs(_iq4_codes(x, d))], axis=-1).reshape(n, -1)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> IQ4_XS blocks, uint8 [n, k / 256 * 136]: per 32, value T[i] * d * (sc - 32)."""
    n, k = w.shape
    x = w.reshape(n, k // 256, 8, 32)
    step = np.abs(x).max(-1) / 127
    d_bytes, d = _fp16(step.max(-1) / 31)
    sc = np.clip(np.round(_ratio(step, d[..., None])), 0, 31).astype(np.int16)
    codes = _iq4_codes(x, d[..., None] * sc)  # [n, S, 8, 32]
    s6 = (sc + 32).astype(np.uint16)  # [n, S, 8]
    high = ((s6 >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)  # [n, S]
    low = (s6[..., 0::2] & 15) | ((s6[..., 1::2] & 15) << 4)
    return np.concatenate([d_bytes, high[..., None].view(np.uint8), low.astype(np.uint8),
                           _nibble_pairs(codes).reshape(n, k // 256, 128)], axis=-1).reshape(n, -1)


# A grid format's d for weights of about the size of the others (its values run to ~20-60 d; TQ's to d)
GRID_D = {"iq2_xxs": 2e-3, "iq2_xs": 2e-3, "iq2_s": 2e-3, "iq3_xxs": 4e-4, "iq3_s": 5e-4, "iq1_s": 6e-3,
          "iq1_m": 6e-3, "tq1_0": 0.08, "tq2_0": 0.08}


def quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    grid = next((name for name, (t, _) in GRID_FORMATS.items() if t == qtype), None)
    if grid is not None:  # random blocks, seeded by the weight (a file written twice is the same file)
        d = GRID_D[grid]
        return random_grid_blocks(grid, *w.shape, seed=zlib.crc32(w.tobytes()), low=0.5 * d, high=1.5 * d)
    own = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k, T.Q3_K: quantize_q3_k, T.Q2_K: quantize_q2_k,
           T.IQ4_NL: quantize_iq4_nl, T.IQ4_XS: quantize_iq4_xs}
    if qtype in own:
        return own[qtype](w)
    if qtype == T.Q5_K:  # Q4_K's scales with a fifth bit: codes doubled from Q4_K's grid (a coarse but valid Q5_K)
        q4 = quantize_q4_k(w).reshape(w.shape[0], -1, 144)
        high = np.zeros((*q4.shape[:2], 32), np.uint8)
        return np.concatenate([q4[..., :16], high, q4[..., 16:]], axis=-1).reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, qtype)


@functools.cache
def bundled() -> gguf.GGUFReader:
    """The default model's GGUF as gguf reads it, once per process (5 s each: its 49k-token vocabulary)."""
    return gguf.GGUFReader(str(default_gguf()))


def _copy_fields(src: gguf.GGUFReader, out: gguf.GGUFWriter, keep: tuple[str, ...]) -> None:
    for field in src.fields.values():
        if field.name.startswith(keep):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            out.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def _write(out: gguf.GGUFWriter, tensors: dict[str, tuple[np.ndarray, T]]) -> None:
    for name, (data, qtype) in tensors.items():
        out.add_tensor(name, data, raw_dtype=qtype)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


def write_tiny_llama(path: Path, qtype: T, seed: int = 0, v_down: T | None = None,
                     leave_out: tuple[str, ...] = (), halve_rows: tuple[str, ...] = (),
                     header_heads: int | None = None) -> Path:
    """A 2-layer random Llama (tied embeddings) with every matrix in `qtype` (the v and down projections in `v_down`
    when given: Q4_K_M's mix is Q4_K with Q6_K there), norms in float32. Broken files: the tensors named in
    `leave_out` left out, those in `halve_rows` with half their rows (disagreeing with the header's sizes), the
    header's head count `header_heads` when given."""
    rng = np.random.default_rng(seed)
    c = TINY
    head_dim = c["hidden"] // c["heads"]
    out = gguf.GGUFWriter(str(path), "llama")
    _copy_fields(bundled(), out, ("tokenizer.",))
    out.add_block_count(c["layers"])
    out.add_context_length(4096)
    out.add_embedding_length(c["hidden"])
    out.add_feed_forward_length(c["intermediate"])
    out.add_head_count(header_heads or c["heads"])
    out.add_head_count_kv(c["kv_heads"])
    out.add_rope_freq_base(10000.0)
    out.add_layer_norm_rms_eps(1e-5)
    out.add_vocab_size(c["vocab"])
    out.add_rope_dimension_count(head_dim)

    def matrix(n: int, k: int, fmt: T = qtype) -> tuple[np.ndarray, T]:
        return quantize((rng.standard_normal((n, k)) * 0.08).astype(np.float32), fmt), fmt

    def norm(k: int) -> tuple[np.ndarray, T]:
        return (1 + 0.1 * rng.standard_normal(k)).astype(np.float32), T.F32

    h, f, kv = c["hidden"], c["intermediate"], c["kv_heads"] * head_dim
    tensors = {"token_embd.weight": matrix(c["vocab"], h), "output_norm.weight": norm(h)}
    for i in range(c["layers"]):
        tensors |= {
            f"blk.{i}.attn_norm.weight": norm(h), f"blk.{i}.attn_q.weight": matrix(h, h),
            f"blk.{i}.attn_k.weight": matrix(kv, h), f"blk.{i}.attn_v.weight": matrix(kv, h, v_down or qtype),
            f"blk.{i}.attn_output.weight": matrix(h, h), f"blk.{i}.ffn_norm.weight": norm(h),
            f"blk.{i}.ffn_gate.weight": matrix(f, h), f"blk.{i}.ffn_up.weight": matrix(f, h),
            f"blk.{i}.ffn_down.weight": matrix(h, f, v_down or qtype),
        }
    for name in halve_rows:
        data, fmt = tensors[name]
        tensors[name] = data[: data.shape[0] // 2], fmt
    _write(out, {name: t for name, t in tensors.items() if name not in leave_out})
    return path


def write_smollm2_k_quant(path: Path, even: T = T.Q4_K, odd: T = T.Q6_K) -> Path:
    """SmolLM2 with its MLP down projections (1536 wide) re-quantized from the file's values: `odd` in every other
    layer, `even` in the rest (by default Q4_K_M's mix: Q4_K, and Q6_K in the odd layers); every other tensor as the
    file has it."""
    src = bundled()
    out = gguf.GGUFWriter(str(path), "llama")
    _copy_fields(src, out, ("general.", "llama.", "tokenizer."))
    tensors: dict[str, tuple[np.ndarray, T]] = {}
    for t in src.tensors:
        if t.name.endswith("ffn_down.weight"):
            layer = int(t.name.split(".")[1])
            n, k = int(t.shape[1]), int(t.shape[0])
            values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(n, k)
            qtype = odd if layer % 2 else even
            tensors[t.name] = (quantize(values, qtype), qtype)
        else:
            tensors[t.name] = (np.asarray(t.data), t.tensor_type)
    _write(out, tensors)
    return path
