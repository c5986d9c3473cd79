// Quantized weights with int16 activations (PackedWeight::int16), AVX2: the float32-compute products of CPUs without
// AVX512-BF16. Q4 codes, and 8-bit ones (Q8; Q6 decoded to them: in registers for a row alone, else a group at a
// time) in groups of 32 or 16. Each row is quantized per group of 32 inputs to q = round(x / d), d = max |x| / 32767
// (an input moves by at most max |x| / 65534: less than bfloat16 rounding, which the AVX512 route applies, moves any
// input above 1/128 of its group's largest), and `vpmaddwd` multiplies the codes by q in integers.
//
// Per row and output, for each group in order: isum = sum of code * q over its inputs (exact in int32; for Q4 codes
// |isum| <= 32 * 15 * 32767 < 2^24, so float(isum) is exact too, for 8-bit codes float(isum) rounds once), then
// Y = fma(float(isum) * d, scale, Y) and Y = fma(d * sum(q), offset, Y) (Q4_0: offset = -8 * scale). The integer
// sums are exact, so neither the row block nor the order inside a group can change a bit; the fold order is fixed.
// Why: an exact float32 product spends most of its instructions making codes floats (at one row each code is used
// once); here a code becomes an int16 lane with one widening per 16.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear.h"
#include "linear_impl.h"
#include "linear_int16_fold.h"
#include "linear_kernels_avx2.h"

namespace lmrpc::linear_detail {

#if LMRPC_AVX2
namespace {

constexpr int kInt16Rows = 4;  // rows per register block: 8 accumulators + 4 code registers + 2 inputs of 16

// One row x one tile pair (p) over every group of Q4 codes: int16_block's operations per output, laid out for one
// row: each chunk's input pairs broadcast once for both tiles, the sums held in registers.
void int16_row_q4(const PackedWeight& w, int64_t p, const int16_t* x, const float* d, const float* dsum,
                  bool one_row, float* out) {
  const int64_t groups = w.k_pad / 32;
  const bool has_offset = w.has_offsets() || w.q4_signed;
  const uint8_t* codes = static_cast<const uint8_t*>(w.data) + p * groups * 512;
  const int64_t length = groups * 512;
  __m256 Y[2][2], kd[2][2] = {}, kdmin[2][2] = {};
  for (int t = 0; t < 2; ++t) Y[t][0] = Y[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const GroupWeights gw = group_weights(w, p, groups, g, nullptr);
    const uint8_t* src = codes + g * 512;
    if (one_row) {
      // One row goes through its codes fastest: ask for them further ahead, into L2 (see kL2AheadGroups).
      prefetch_one_row(codes + one_row_ahead((g + kL2AheadGroups) * 512, length, 1), 512);
    } else {
      prefetch_q4_ahead(src);
    }
    split_super(w, gw, g, kd, kdmin);
    __m256i acc[2][2];  // [tile][half]: int32 sums
    for (int t = 0; t < 2; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m256i x0, x1;
      input_pairs(x + 32 * g + 4 * c, x0, x1);
      for (int t = 0; t < 2; ++t) q4_int16_chunk(src + 256 * t + 32 * c, x0, x1, acc[t]);
    }
    const __m256 dg = _mm256_set1_ps(d[g]), sg = _mm256_set1_ps(dsum[g]);
    for (int t = 0; t < 2; ++t)
      for (int h = 0; h < 2; ++h)
        Y[t][h] = fold_split(Y[t][h], acc[t][h], dg, sg, split_fold(w, gw, kd, kdmin, t, h), has_offset);
  }
  store_split(Y, out);
}

// R >= 2 rows x one tile pair (p) over every group, from the Q4 layout (q4_int16_chunk), the sums in the split order
// (a row alone: int16_row_q4).
template <int R>
void int16_block(const PackedWeight& w, int64_t p, const int16_t* const* x, const float* const* d,
                 const float* const* dsum, float (*out)[32 * kMaxPairs]) {
  const int64_t groups = w.k_pad / 32;
  const bool has_offset = w.has_offsets() || w.q4_signed;
  alignas(32) __m256 Y[R][2][2];  // [row][tile][half]
  __m256 kd[2][2] = {}, kdmin[2][2] = {};
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 2; ++t) Y[r][t][0] = Y[r][t][1] = _mm256_setzero_ps();
  const uint8_t* codes = static_cast<const uint8_t*>(w.data) + p * groups * 512;
  for (int64_t g = 0; g < groups; ++g) {
    const GroupWeights gw = group_weights(w, p, groups, g, nullptr);
    const uint8_t* src = codes + g * 512;
    prefetch_q4_ahead(src);
    split_super(w, gw, g, kd, kdmin);
    for (int t = 0; t < 2; ++t) {
      __m256i acc[R][2];  // [row][half]: int32 sums
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const uint8_t* at = src + 256 * t + 32 * c;
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m256i x0, x1;
          input_pairs(x[r] + 32 * g + 4 * c, x0, x1);
          q4_int16_chunk(at, x0, x1, acc[r]);
        }
      }
      for (int h = 0; h < 2; ++h) {
        const SplitFold f = split_fold(w, gw, kd, kdmin, t, h);
        for (int r = 0; r < R; ++r) {
          Y[r][t][h] = fold_split(Y[r][t][h], acc[r][h], _mm256_set1_ps(d[r][g]), _mm256_set1_ps(dsum[r][g]), f,
                                  has_offset);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) store_split(Y[r], out[r]);
}

// R >= 2 rows x one tile pair (p) of 8-bit codes (Q8, or Q6 decoded a group at a time) over every group of 16 or
// 32 inputs (a row alone: int16_row_codes): per kpair and tile 32 int8 = 16 outputs x 2 inputs; sign-extended to
// int16 in their 128-bit lanes, each output's two codes are one 32-bit lane, and vpmaddwd against the kpair's inputs
// broadcast gives its two products. |code| <= 128: a group's isum stays below 32 * 128 * 32767 < 2^31.
template <int R>
void int16_codes_block(const PackedWeight& w, int64_t p, const int16_t* const* x, const float* const* d,
                       const float* const* dsum, float (*out)[32 * kMaxPairs]) {
  const int64_t groups = w.k_pad / w.group, gkp = w.group / 2, kp = w.k_pad / 2;
  const bool q6 = w.format == WeightFormat::Q6;
  const bool has_offset = w.has_offsets();
  alignas(32) float Y[R][32] = {};
  alignas(64) int8_t q6_codes[2][kMaxQ6Group * 32];  // Q6: two groups' codes as Q8 vectors (g % 2)
  const int8_t* codes = static_cast<const int8_t*>(w.data) + p * kp * 64;
  for (int64_t g = 0; g < groups; ++g) {
    const GroupWeights gw = group_weights(w, p, groups, g, nullptr);
    const int8_t* src = codes + g * gkp * 64;
    if (q6) {
      // Group g + 1 is decoded now, g's codes were the step before: its loads never wait on stores just made.
      if (g == 0) decode_q6(q6_group(w, p * kp * 2), gkp / 2, q6_codes[0]);
      if (g + 1 < groups) decode_q6(q6_group(w, (p * kp + (g + 1) * gkp) * 2), gkp / 2, q6_codes[(g + 1) % 2]);
      src = q6_codes[g % 2];
    } else {
      for (int64_t line = 0; line < gkp; ++line) {  // the group two ahead, into L1
        _mm_prefetch(reinterpret_cast<const char*>(src + 2 * gkp * 64 + 64 * line), _MM_HINT_T0);
      }
    }
    const int64_t ag = g * w.group / 32;  // the inputs' group of 32 (its d)
    const int64_t x0 = 2 * g * gkp;       // the group's first input
    for (int t = 0; t < 2; ++t) {
      __m256i acc[R][2];  // [row][outputs 0-3, 8-11 | 4-7, 12-15 of the tile]: int32 sums
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int64_t j = 0; j < gkp; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * j + 32 * t));
        const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);
        const __m256i u0 = _mm256_unpacklo_epi8(v, sign), u1 = _mm256_unpackhi_epi8(v, sign);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i xj = _mm256_broadcastd_epi32(_mm_loadu_si32(x[r] + x0 + 2 * j));  // inputs 2j, 2j + 1
          acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(u0, xj));
          acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(u1, xj));
        }
      }
      for (int r = 0; r < R; ++r) {  // -> outputs 0-7 | 8-15
        const __m256i a = acc[r][0], b = acc[r][1];
        acc[r][0] = _mm256_permute2x128_si256(a, b, 0x20);
        acc[r][1] = _mm256_permute2x128_si256(a, b, 0x31);
      }
      for (int h = 0; h < 2; ++h) {
        const int l0 = 16 * t + 8 * h;
        const __m256 scale = scale_x8(gw, l0);
        const __m256 offset = has_offset ? offset_x8(gw, l0) : _mm256_setzero_ps();
        for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_set1_ps(d[r][ag]));
          __m256 y = _mm256_fmadd_ps(a, scale, _mm256_load_ps(&Y[r][l0]));
          if (has_offset) y = _mm256_fmadd_ps(_mm256_set1_ps(dsum[r][ag]), offset, y);
          _mm256_store_ps(&Y[r][l0], y);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out[r], Y[r], sizeof(Y[r]));
}

// One row x one tile pair (p) of 8-bit codes over every group (of 16 or 32 inputs): int16_codes_block's operations
// per output, the codes kept in registers, each kpair's inputs broadcast once for both tiles, the sums in the split
// order (linear_int16_fold.h). Q8 codes are sign-extended. Q6 units (linear.h, kQ6UnitBytes) hold kpair 2i's vectors
// for tiles 0 and 1 and kpair 2i + 1's, decoded in registers; each code stored as q + 32 in 0..63 is widened as it
// is, unsigned, and the group's sums take 32 * sum(inputs) off: sum((c - 32) x) = sum(c x) - 32 sum(x), the same
// integers, so the same bits.
template <bool Q6>
void int16_row_codes(const PackedWeight& w, int64_t p, const int16_t* x, const float* d, const float* dsum,
                     bool one_row, float* out) {
  const int64_t groups = w.k_pad / w.group, gkp = w.group / 2, kp = w.k_pad / 2;
  const bool has_offset = w.has_offsets();
  const uint8_t* codes = Q6 ? q6_group(w, p * kp * 2) : static_cast<const uint8_t*>(w.data) + p * kp * 64;
  const int64_t group_bytes = Q6 ? gkp / 2 * kQ6UnitBytes : gkp * 64, length = groups * group_bytes;
  __m256 Y[2][2], kd[2][2] = {}, kdmin[2][2] = {};
  for (int t = 0; t < 2; ++t) Y[t][0] = Y[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const GroupWeights gw = group_weights(w, p, groups, g, nullptr);
    const uint8_t* src = codes + g * group_bytes;
    if (one_row) {
      prefetch_one_row(codes + one_row_ahead((g + kL2AheadGroups) * group_bytes, length, 1), group_bytes);
    } else {
      prefetch_one_row(src + 2 * group_bytes, group_bytes);
    }
    split_super(w, gw, g, kd, kdmin);
    const int16_t* xg = x + 2 * g * gkp;
    __m256i acc[2][2];  // [tile][half]: int32 sums (Q6: of (c + 32) x)
    for (int t = 0; t < 2; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
    for (int64_t u = 0; u < gkp / 2; ++u) {
      __m256i v[4];  // vector i = kpair 2u + i / 2, tile i % 2
      if constexpr (Q6) {
        q6_unit_codes(src + u * kQ6UnitBytes, v);
      } else {
        for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 128 * u + 32 * i));
      }
      for (int j = 0; j < 2; ++j) {
        const __m256i xj = _mm256_broadcastd_epi32(_mm_loadu_si32(xg + 2 * (2 * u + j)));  // inputs of kpair 2u + j
        for (int t = 0; t < 2; ++t) {
          const __m256i c = v[2 * j + t];
          // high bytes: zero for Q6's unsigned codes, the sign for Q8's
          const __m256i high = Q6 ? _mm256_setzero_si256() : _mm256_cmpgt_epi8(_mm256_setzero_si256(), c);
          acc[t][0] = _mm256_add_epi32(acc[t][0], _mm256_madd_epi16(_mm256_unpacklo_epi8(c, high), xj));
          acc[t][1] = _mm256_add_epi32(acc[t][1], _mm256_madd_epi16(_mm256_unpackhi_epi8(c, high), xj));
          __asm__("" : "+x"(acc[t][0]), "+x"(acc[t][1]));  // running sums, as in q4_int16_chunk
        }
      }
    }
    if constexpr (Q6) {
      const __m256i bias = _mm256_slli_epi32(sum_q_x8(xg, w.group), 5);  // 32 * sum(x)
      for (int t = 0; t < 2; ++t)
        for (int hf = 0; hf < 2; ++hf) acc[t][hf] = _mm256_sub_epi32(acc[t][hf], bias);
    }
    const int64_t ag = g * w.group / 32;  // the inputs' group of 32 (its d)
    const __m256 dg = _mm256_set1_ps(d[ag]), sg = _mm256_set1_ps(dsum[ag]);
    for (int t = 0; t < 2; ++t)
      for (int hf = 0; hf < 2; ++hf)
        Y[t][hf] = fold_split(Y[t][hf], acc[t][hf], dg, sg, split_fold(w, gw, kd, kdmin, t, hf), has_offset);
  }
  store_split(Y, out);
}

}  // namespace

void int16_pair_avx2(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p) {
  const int64_t groups = w.k_pad / 32;
  alignas(64) float out[kInt16Rows][32 * kMaxPairs];
  const bool one_row = rr.size() == 1;
  for (int64_t r0 = rr.begin; r0 < rr.end; r0 += kInt16Rows) {
    const int rows = static_cast<int>(std::min<int64_t>(kInt16Rows, rr.end - r0));
    const int16_t* x[kInt16Rows];
    const float* d[kInt16Rows];
    const float* dsum[kInt16Rows];
    for (int r = 0; r < rows; ++r) {
      x[r] = in.i16.data() + (r0 + r) * w.k_pad;
      d[r] = in.d.data() + (r0 + r) * groups;
      dsum[r] = in.dsum.data() + (r0 + r) * groups;
    }
    if (w.format == WeightFormat::Q4) {
      switch (rows) {
        case 1: int16_row_q4(w, p, x[0], d[0], dsum[0], one_row, out[0]); break;
        case 2: int16_block<2>(w, p, x, d, dsum, out); break;
        case 3: int16_block<3>(w, p, x, d, dsum, out); break;
        default: int16_block<4>(w, p, x, d, dsum, out); break;
      }
    } else {
      switch (rows) {
        case 1:
          if (w.format == WeightFormat::Q6) {
            int16_row_codes<true>(w, p, x[0], d[0], dsum[0], one_row, out[0]);
          } else {
            int16_row_codes<false>(w, p, x[0], d[0], dsum[0], one_row, out[0]);
          }
          break;
        case 2: int16_codes_block<2>(w, p, x, d, dsum, out); break;
        case 3: int16_codes_block<3>(w, p, x, d, dsum, out); break;
        default: int16_codes_block<4>(w, p, x, d, dsum, out); break;
      }
    }
    epilogue(w, a, r0, rows, p, 1, out);
  }
}

void quantize_row_int16(const float* row, int64_t kp, int16_t* q, float* d, float* dsum) {
  for (int64_t g = 0; g < kp / 32; ++g) {
    const float* x = row + 32 * g;
    const float amax = group_amax32(x);
    // |x * inv| <= 32767 (rounded at most to 32767.004), so the codes fit int16 without saturating.
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    __m256i v[4];
    __m256i total = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), inv),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      total = _mm256_add_epi32(total, v[j]);
    }
    // int32 -> int16 in order: packs interleave the 128-bit halves, the permute puts them back.
    for (int j = 0; j < 2; ++j) {
      const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[2 * j], v[2 * j + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * g + 16 * j), w16);
    }
    alignas(32) int32_t sums[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), total);
    int sum = 0;
    for (int32_t s : sums) sum += s;
    d[g] = amax / 32767.0f;
    dsum[g] = d[g] * static_cast<float>(sum);  // |sum| <= 32 * 32767 < 2^24: exact before the product
  }
}
#endif

}  // namespace lmrpc::linear_detail

namespace lmrpc {

bool int16_takes(WeightFormat format, int64_t group, int64_t k_pad, bool has_offsets) {
  if (format == WeightFormat::Q4) return true;
  // 8-bit codes: a weight group within one group of inputs (one d); with offsets, the same group (one d * sum(q)).
  const bool eight_bit = format == WeightFormat::Q8 || format == WeightFormat::Q6;
  return eight_bit && (group == 32 || (group == 16 && !has_offsets)) && k_pad % 32 == 0;
}

}  // namespace lmrpc
