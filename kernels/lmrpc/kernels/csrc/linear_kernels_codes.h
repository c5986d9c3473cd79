// Micro-kernels of the row-invariant products over 8-bit and 6-bit codes (Q8 and Q6 weights, run by
// linear_products.cpp): R rows x one tile pair with each unit of four kpair vectors made bf16 in registers once per
// block of rows (block_codes), and one row of P tile pairs over the codes as stored (one_row_q8_bf16,
// one_row_q6_bf16). The sums and their order are those of linear_kernels.h's kernels over expanded codes.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear.h"
#include "linear_impl.h"
#include "linear_kernels.h"
#include "linear_kscales.h"

namespace lmrpc::linear_detail {

#if LMRPC_AVX512
// bf16 values of a Q6 weight's 64 stored codes (code - 32), the two 32-entry halves of a vpermi2w table.
struct Q6Table {
  alignas(64) uint16_t bf16[64];
  Q6Table() {
    for (int c = 0; c < 64; ++c) bf16[c] = f32_to_bf16(static_cast<float>(c - 32));
  }
};

// The one table every Q6 kernel reads (built on first use).
inline const Q6Table& q6_table() {
  static const Q6Table table;
  return table;
}

// A Q6 unit's four kpair vectors (linear.h) as bf16, decoded in registers: in each 16-bit lane the code's low
// nibble lands in bits 0-3 and its top two bits in bits 4-5 of a table index (vpermi2w reads only bits 0-5).
LMRPC_INLINE void q6_unit_bf16(const uint8_t* unit, __m512i lut_lo, __m512i lut_hi, __m512i (&v)[4]) {
  const __m512i nibble = _mm512_set1_epi16(0x0f);
  const __m512i a = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit)));
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 32)));
  const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 64)));
  // 0xca: the second operand's bits where the first (nibble) has ones, the third's elsewhere
  const auto code = [&](__m512i low, __m512i top) {
    return _mm512_permutex2var_epi16(lut_lo, _mm512_ternarylogic_epi32(nibble, low, top, 0xca), lut_hi);
  };
  v[0] = code(a, _mm512_slli_epi16(h, 4));
  v[1] = code(_mm512_srli_epi16(a, 4), _mm512_slli_epi16(h, 2));
  v[2] = code(b, h);
  v[3] = code(_mm512_srli_epi16(b, 4), _mm512_srli_epi16(h, 2));
}

// 32 8-bit codes (a kpair vector) as bf16, in registers: the values expand_q8 writes.
LMRPC_INLINE __m512i q8_vector_bf16(const int8_t* codes) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

// R rows x one tile pair of Q8 or Q6 weights over every group, four kpair vectors at a time (kpairs 2u and 2u + 1,
// both tiles; a Q6 unit) made bf16 in registers and used by all R rows: the operations of block_bf16<R, 1, true>
// over expanded codes, without a copy of 2 bytes a weight.
template <int R, bool kQ6, bool KS>
void block_codes_ks(const PackedWeight& w, int64_t p, const Q6Table& table, int64_t groups, const RowBlock& rb) {
  const int64_t gkp = w.group / 2;
  const PairIndex at{&w, p, groups, gkp, w.k_pad / 2};
  const __m512i lut_lo = _mm512_load_si512(table.bf16), lut_hi = _mm512_load_si512(table.bf16 + 32);
  rows_over_groups<R, KS>(w, p, groups, rb, [&](__m512 (&acc)[R][2], int64_t g) LMRPC_LAMBDA_INLINE {
    const int64_t first = at.vectors(g);
    for (int64_t u = 0; u < gkp / 2; ++u) {
      __m512i v[4];  // kpair 2u tile 0, tile 1; kpair 2u + 1 tile 0, tile 1
      if constexpr (kQ6) {
        q6_unit_bf16(q6_group(w, first) + u * kQ6UnitBytes, lut_lo, lut_hi, v);
      } else {
        const int8_t* codes = static_cast<const int8_t*>(w.data) + (first + 4 * u) * 32;
        for (int i = 0; i < 4; ++i) v[i] = q8_vector_bf16(codes + 32 * i);
      }
      for (int r = 0; r < R; ++r) {
        int32_t p0, p1;
        const uint16_t* x = static_cast<const uint16_t*>(rb.x[r]) + 2 * (g * gkp + 2 * u);
        std::memcpy(&p0, x, 4);
        std::memcpy(&p1, x + 2, 4);
        const __m512bh x0 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p0));
        const __m512bh x1 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p1));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], reinterpret_cast<__m512bh>(v[0]), x0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], reinterpret_cast<__m512bh>(v[1]), x0);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], reinterpret_cast<__m512bh>(v[2]), x1);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], reinterpret_cast<__m512bh>(v[3]), x1);
      }
    }
  });
}

template <int R, bool kQ6>
void block_codes(const PackedWeight& w, int64_t p, const Q6Table& table, int64_t groups, const RowBlock& rb) {
  if (w.k_scaled()) block_codes_ks<R, kQ6, true>(w, p, table, groups, rb);
  else block_codes_ks<R, kQ6, false>(w, p, table, groups, rb);
}

// One unit (kpairs `at` and `at` + 1, both tiles) of each of P tile pairs, one row: decode(q, v) makes pair q's four
// kpair vectors (kpair `at` tile 0, tile 1; kpair `at` + 1 tile 0, tile 1) bf16, each tile's sum takes them in kpair
// order (one_row_q8_bf16, one_row_q6_bf16).
template <int P, typename Decode>
LMRPC_INLINE void unit_products(__m512 (&acc)[2 * P], const uint16_t* x, int64_t at, Decode&& decode) {
  int32_t p0, p1;
  std::memcpy(&p0, x + 2 * at, 4);
  std::memcpy(&p1, x + 2 * (at + 1), 4);
  const __m512bh x0 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p0));
  const __m512bh x1 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p1));
  for (int q = 0; q < P; ++q) {
    __m512i v[4];
    decode(q, v);
    acc[2 * q] = _mm512_dpbf16_ps(acc[2 * q], reinterpret_cast<__m512bh>(v[0]), x0);
    acc[2 * q + 1] = _mm512_dpbf16_ps(acc[2 * q + 1], reinterpret_cast<__m512bh>(v[1]), x0);
    acc[2 * q] = _mm512_dpbf16_ps(acc[2 * q], reinterpret_cast<__m512bh>(v[2]), x1);
    acc[2 * q + 1] = _mm512_dpbf16_ps(acc[2 * q + 1], reinterpret_cast<__m512bh>(v[3]), x1);
  }
}

// One row, Q8 (the bundled model's Q8_0 output head; a Q8_0 file's layers): a group's pieces are its units of four
// kpair vectors (kpairs 2u and 2u + 1, both tiles), made bf16 in registers from the 8-bit codes. Read as stored, half
// the bytes of the expanded copy, which products of many rows read instead.
template <int P>
void one_row_q8_bf16(const PackedWeight& w, int64_t p, const uint16_t* x, const float* sums, float* out) {
  const int64_t groups = w.k_pad / w.group, gkp = w.group / 2, kp = w.k_pad / 2;
  const int8_t* pairs[P];  // each pair's first group
  for (int q = 0; q < P; ++q) {
    pairs[q] = static_cast<const int8_t*>(w.data) + PairIndex{&w, p + q, groups, gkp, kp}.vectors(0) * 32;
  }
  auto unit = [&](__m512 (&acc)[2 * P], int64_t g, int64_t u) LMRPC_LAMBDA_INLINE {
    const int64_t offset = (g * gkp + 2 * u) * 64;
    // The unit kQ8PrefetchBytes ahead, by bytes rather than groups (an int8 weight of ours is one group of all its
    // inputs), into L2 (see kOneRowHint).
    const int64_t ahead = one_row_ahead(offset + kQ8PrefetchBytes, kp * 64, P);
    unit_products<P>(acc, x, g * gkp + 2 * u, [&](int q, __m512i (&v)[4]) LMRPC_LAMBDA_INLINE {
      prefetch_one_row(pairs[q] + ahead, 128);
      for (int i = 0; i < 4; ++i) v[i] = q8_vector_bf16(pairs[q] + offset + 32 * i);
    });
  };
  auto no_prefetch = [](int64_t) LMRPC_LAMBDA_INLINE {};  // the units ask for theirs
  one_row_grouped<P>(w, p, gkp / 2, sums, out, unit, no_prefetch);
}

// One row, Q6 (1.7B Q4_K_M's Q6_K output head and down projections): a group's pieces are its units (kpairs 2u and
// 2u + 1 of both tiles), each decoded in registers (against a group decoded to 8-bit codes, then to bf16 in a buffer).
template <int P>
void one_row_q6_bf16(const PackedWeight& w, int64_t p, const Q6Table& table, const uint16_t* x, const float* sums,
                     float* out) {
  const int64_t groups = w.k_pad / w.group, gkp = w.group / 2, kp = w.k_pad / 2;
  const int64_t units = gkp / 2, group_bytes = units * kQ6UnitBytes;
  const __m512i lut_lo = _mm512_load_si512(table.bf16), lut_hi = _mm512_load_si512(table.bf16 + 32);
  const uint8_t* pairs[P];  // each pair's first group
  for (int q = 0; q < P; ++q) pairs[q] = q6_group(w, PairIndex{&w, p + q, groups, gkp, kp}.vectors(0));
  auto unit = [&](__m512 (&acc)[2 * P], int64_t g, int64_t u) LMRPC_LAMBDA_INLINE {
    unit_products<P>(acc, x, g * gkp + 2 * u, [&](int q, __m512i (&v)[4]) LMRPC_LAMBDA_INLINE {
      q6_unit_bf16(pairs[q] + g * group_bytes + u * kQ6UnitBytes, lut_lo, lut_hi, v);
    });
  };
  auto prefetch = [&](int64_t g) LMRPC_LAMBDA_INLINE {  // kOneRowPrefetchGroups ahead, into L2 (kOneRowHint)
    const int64_t at = one_row_ahead((g + kOneRowPrefetchGroups) * group_bytes, groups * group_bytes, P);
    for (int q = 0; q < P; ++q) prefetch_one_row(pairs[q] + at, group_bytes);
    const int64_t ahead = one_row_ahead(g + 2 * kOneRowPrefetchGroups, groups, P);
    for (int q = 0; q < P; ++q) prefetch_scales(w, p + q, groups, ahead);
  };
  one_row_grouped<P>(w, p, units, sums, out, unit, prefetch);
}
#endif

}  // namespace lmrpc::linear_detail
