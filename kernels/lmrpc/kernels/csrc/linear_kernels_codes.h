// Micro-kernels of the row-invariant products over 8-, 6-, 5- and 3-bit codes (Q8, Q6, Q5 and Q3 weights, run by
// linear_products.cpp): R rows x one tile pair with each unit of four kpair vectors made bf16 in registers once per
// block of rows (block_codes), and one row of P tile pairs over the codes as stored (one_row_q8_bf16,
// one_row_units_bf16). The sums and their order are those of linear_kernels.h's kernels over expanded codes.
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

// bf16 values of a Q3 weight's stored codes (code - 4), indexed by a code's 3 bits: the 8 values four times, so
// that vpermw (which reads bits 0-4 of an index) picks the same value whatever bits 3-4 hold.
struct Q3Table {
  alignas(64) uint16_t bf16[32];
  Q3Table() {
    for (int c = 0; c < 32; ++c) bf16[c] = f32_to_bf16(static_cast<float>((c & 7) - 4));
  }
};

// The one table every Q3 kernel reads (built on first use).
inline const Q3Table& q3_table() {
  static const Q3Table table;
  return table;
}

// bf16 values of a Q5 weight's 32 codes (less 16 when signed: GGUF Q5_0).
struct Q5Table {
  alignas(64) uint16_t bf16[32];
  explicit Q5Table(bool is_signed) {
    for (int c = 0; c < 32; ++c) bf16[c] = f32_to_bf16(static_cast<float>(is_signed ? c - 16 : c));
  }
};

inline const Q5Table& q5_table(bool is_signed) {
  static const Q5Table tables[2] = {Q5Table(false), Q5Table(true)};
  return tables[is_signed ? 1 : 0];
}

// Vector I (0..15) of a block of kBits-bit codes in 16-bit words (Q3, Q5: linear.h) as bf16, decoded in registers:
// a line shifted so that the code's bits are the low bits of a table index (vpermw reads bits 0-4; for 3-bit codes
// the table repeats every 8, so bits 3-4 pick the same value); vector 15's bits gathered from the lines' bit 15.
template <int kBits, int I>
LMRPC_INLINE __m512i word_vector_bf16(const uint8_t* block, __m512i lut) {
  constexpr int per = 15 / kBits;
  const auto line = [&](int j) { return _mm512_loadu_si512(block + 64 * j); };
  if constexpr (I < 15) {
    const __m512i words = line(I / per);
    return _mm512_permutexvar_epi16(I % per == 0 ? words : _mm512_srli_epi16(words, kBits * (I % per)), lut);
  } else {
    __m512i index = _mm512_srli_epi16(line(0), 15);
    // 0xca: the second operand's bits where the first has ones (bit j), the third's elsewhere
    for (int j = 1; j < kBits; ++j) {
      index = _mm512_ternarylogic_epi32(_mm512_set1_epi16(static_cast<int16_t>(1 << j)),
                                        _mm512_srli_epi16(line(j), 15 - j), index, 0xca);
    }
    return _mm512_permutexvar_epi16(index, lut);
  }
}

// 32 8-bit codes (a kpair vector) as bf16, in registers: the values expand_q8 writes.
LMRPC_INLINE __m512i q8_vector_bf16(const int8_t* codes) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

// How block_codes and one_row_units_bf16 read a weight's units of four kpair vectors (kpairs 2u and 2u + 1, both
// tiles), per format: where a group's units start, how many units a block of kBlockBytes holds (kPer), and unit w
// of a block made bf16 in registers (decode).
struct Q8Units {
  static constexpr int kPer = 1;
  static constexpr int64_t kBlockBytes = 128;
  Q8Units(const PackedWeight&, const Q4Table&) {}
  static const uint8_t* group(const PackedWeight& w, int64_t vector) {
    return static_cast<const uint8_t*>(w.data) + vector * 32;
  }
  LMRPC_INLINE void decode(const uint8_t* block, int, __m512i (&v)[4]) const {
    for (int i = 0; i < 4; ++i) v[i] = q8_vector_bf16(reinterpret_cast<const int8_t*>(block) + 32 * i);
  }
};
struct Q6Units {
  static constexpr int kPer = 1;
  static constexpr int64_t kBlockBytes = kQ6UnitBytes;
  __m512i lut_lo, lut_hi;
  Q6Units(const PackedWeight&, const Q4Table&)
      : lut_lo(_mm512_load_si512(q6_table().bf16)), lut_hi(_mm512_load_si512(q6_table().bf16 + 32)) {}
  static const uint8_t* group(const PackedWeight& w, int64_t vector) { return q6_group(w, vector); }
  LMRPC_INLINE void decode(const uint8_t* block, int, __m512i (&v)[4]) const {
    q6_unit_bf16(block, lut_lo, lut_hi, v);
  }
};
// Q3 and Q5: blocks of 16 vectors, four units each.
template <int kBits>
struct WordUnits {
  static constexpr int kPer = 4;
  static constexpr int64_t kBlockBytes = 64 * kBits;
  __m512i lut;
  // (a Q3 weight's codes may index values of their own: `table`, the call's Q4Table of the weight)
  WordUnits(const PackedWeight& w, const Q4Table& table)
      : lut(_mm512_load_si512(kBits == 5        ? q5_table(w.q4_signed).bf16
                              : w.code_table ? table.bf16
                                             : q3_table().bf16)) {}
  static const uint8_t* group(const PackedWeight& w, int64_t vector) { return word_group<kBits>(w, vector); }
  LMRPC_INLINE void decode(const uint8_t* block, int w, __m512i (&v)[4]) const {  // (callers unroll over w)
    switch (w) {
      case 0: units<0>(block, v); break;
      case 1: units<1>(block, v); break;
      case 2: units<2>(block, v); break;
      default: units<3>(block, v); break;
    }
  }
  template <int W>
  LMRPC_INLINE void units(const uint8_t* block, __m512i (&v)[4]) const {
    v[0] = word_vector_bf16<kBits, 4 * W>(block, lut);
    v[1] = word_vector_bf16<kBits, 4 * W + 1>(block, lut);
    v[2] = word_vector_bf16<kBits, 4 * W + 2>(block, lut);
    v[3] = word_vector_bf16<kBits, 4 * W + 3>(block, lut);
  }
};
using Q3Units = WordUnits<3>;
using Q5Units = WordUnits<5>;

// R rows x one tile pair of Q8, Q6, Q5 or Q3 weights over every group, four kpair vectors at a time (a unit: kpairs 2u
// and 2u + 1, both tiles) made bf16 in registers and used by all R rows: the operations of block_bf16<R, 1, true>
// over expanded codes, without a copy of 2 bytes a weight.
template <int R, typename Units, bool KS>
void block_codes_ks(const PackedWeight& w, int64_t p, int64_t groups, const RowBlock& rb, const Q4Table& table) {
  const int64_t gkp = w.group / 2;
  const PairIndex at{&w, p, groups, gkp, w.k_pad / 2};
  const Units units(w, table);
  rows_over_groups<R, KS>(w, p, groups, rb, [&](__m512 (&acc)[R][2], int64_t g) LMRPC_LAMBDA_INLINE {
    const uint8_t* first = Units::group(w, at.vectors(g));
    const int64_t group_bytes = gkp / 2 / Units::kPer * Units::kBlockBytes;
    prefetch_one_row(first + kL2AheadGroups * group_bytes, group_bytes);  // (a block's groups lie in order)
    for (int64_t b = 0; b < gkp / 2 / Units::kPer; ++b) {
#pragma GCC unroll 4
      for (int wu = 0; wu < Units::kPer; ++wu) {
        const int64_t u = b * Units::kPer + wu;
        __m512i v[4];  // kpair 2u tile 0, tile 1; kpair 2u + 1 tile 0, tile 1
        units.decode(first + b * Units::kBlockBytes, wu, v);
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
    }
  });
}

template <int R, typename Units>
void block_codes(const PackedWeight& w, int64_t p, int64_t groups, const RowBlock& rb, const Q4Table& table) {
  if (w.k_scaled()) block_codes_ks<R, Units, true>(w, p, groups, rb, table);
  else block_codes_ks<R, Units, false>(w, p, groups, rb, table);
}

// One unit (kpairs `at` and `at` + 1, both tiles) of each of P tile pairs, one row: decode(q, v) makes pair q's four
// kpair vectors (kpair `at` tile 0, tile 1; kpair `at` + 1 tile 0, tile 1) bf16, each tile's sum takes them in kpair
// order (one_row_q8_bf16, one_row_units_bf16).
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

// One row, Q6 (1.7B Q4_K_M's Q6_K output head and down projections), Q5 (Q5_K_M's bulk) or Q3 (Q3_K_M's and Q2_K's): a group's
// pieces are its units (kpairs 2u and 2u + 1 of both tiles), each decoded in registers (against a group decoded to
// 8-bit codes, then to bf16 in a buffer).
template <int P, typename Units>
void one_row_units_bf16(const PackedWeight& w, int64_t p, const Q4Table& table, const uint16_t* x, const float* sums,
                        float* out) {
  const int64_t groups = w.k_pad / w.group, gkp = w.group / 2, kp = w.k_pad / 2;
  const int64_t blocks = gkp / 2 / Units::kPer, group_bytes = blocks * Units::kBlockBytes;
  const Units decoder(w, table);
  const uint8_t* pairs[P];  // each pair's first group
  for (int q = 0; q < P; ++q) pairs[q] = Units::group(w, PairIndex{&w, p + q, groups, gkp, kp}.vectors(0));
  auto block = [&](__m512 (&acc)[2 * P], int64_t g, int64_t b) LMRPC_LAMBDA_INLINE {  // its units in order
#pragma GCC unroll 4
    for (int wu = 0; wu < Units::kPer; ++wu) {
      const int64_t u = b * Units::kPer + wu;
      unit_products<P>(acc, x, g * gkp + 2 * u, [&](int q, __m512i (&v)[4]) LMRPC_LAMBDA_INLINE {
        decoder.decode(pairs[q] + g * group_bytes + b * Units::kBlockBytes, wu, v);
      });
    }
  };
  auto prefetch = [&](int64_t g) LMRPC_LAMBDA_INLINE {  // kL2AheadGroups ahead, into L2 (kOneRowHint)
    const int64_t at = one_row_ahead((g + kL2AheadGroups) * group_bytes, groups * group_bytes, P);
    for (int q = 0; q < P; ++q) prefetch_one_row(pairs[q] + at, group_bytes);
    const int64_t ahead = one_row_ahead(g + 2 * kL2AheadGroups, groups, P);
    for (int q = 0; q < P; ++q) prefetch_scales(w, p + q, groups, ahead);
  };
  one_row_grouped<P>(w, p, blocks, sums, out, block, prefetch);
}
#endif

}  // namespace lmrpc::linear_detail
