// The int16 products' (linear_int16.cpp) pieces shared by their kernels: a Q4 chunk's integer step, and the fold of
// a group's integer sums into float32 totals kept in the order vpmaddwd leaves the lanes (the "split" order), with
// the multipliers loaded in that order. Each output gets the operations the header of linear_int16.cpp lists.
#pragma once

#include <cstdint>

#include "common.h"
#include "linear.h"
#include "linear_impl.h"
#include "linear_kernels_avx2.h"

namespace lmrpc::linear_detail {

#if LMRPC_AVX2
// The Q4 step's sums come out of vpmaddwd per tile in two registers, h = 0 holding outputs 0-3, 8-11 and h = 1
// outputs 4-7, 12-15 (its bytes widened within 128-bit lanes). The running sums are kept in that order and the
// multipliers loaded in it, so no lane crosses a 128-bit half per group (a cross-lane permute is 8 micro-ops on
// Zen 1); the totals are put in output order once, at the end. Tile t's 8 values of half h, from its 16 at `at`:
LMRPC_INLINE __m256 split_halfx8(const uint16_t* at, int h) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 8));
  return _mm256_cvtph_ps(h == 0 ? _mm_unpacklo_epi64(a, b) : _mm_unpackhi_epi64(a, b));
}
LMRPC_INLINE __m256 split_u8x8(const uint8_t* at, int h, bool is_signed) {
  // dwords 0, 2 | 1, 3: bytes 0-3, 8-11 then 4-7, 12-15
  const __m128i s = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)), 0xD8);
  const __m128i b = h == 0 ? s : _mm_unpackhi_epi64(s, s);
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// A Q4 group's multipliers for tile t, half h, in the split order: Y = fma(float(isum) * d, scale, Y), then
// Y = fma(d * sum(q), offset, Y) where the weight has offsets (the values scale_x8 and offset_x8 give). A K-scaled
// weight's d and dmin are its super-block's, converted once per super-block into kd and kdmin ([tile][half]).
struct SplitFold {
  __m256 scale, offset;
};
LMRPC_INLINE SplitFold split_fold(const PackedWeight& w, const GroupWeights& gw, const __m256 (&kd)[2][2],
                                  const __m256 (&kdmin)[2][2], int t, int h) {
  if (gw.kd != nullptr) {
    const __m256 scale = _mm256_mul_ps(kd[t][h], split_u8x8(gw.ksc + 16 * t, h, gw.ksigned));
    if (gw.km == nullptr) return {scale, _mm256_setzero_ps()};
    const __m256 dm = _mm256_mul_ps(kdmin[t][h], split_u8x8(gw.km + 16 * t, h, false));
    return {scale, _mm256_xor_ps(dm, _mm256_set1_ps(-0.0f))};  // -(dmin * m)
  }
  const __m256 scale = split_halfx8(gw.scale + 16 * t, h);
  if (gw.offset != nullptr) return {scale, split_halfx8(gw.offset + 16 * t, h)};
  const bool q4_0 = w.format == WeightFormat::Q4 && w.q4_signed;
  return {scale, q4_0 ? _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f)) : _mm256_setzero_ps()};
}

// Group g's d and dmin of a K-scaled weight's super-block into kd and kdmin, when g starts one.
LMRPC_INLINE void split_super(const PackedWeight& w, const GroupWeights& gw, int64_t g, __m256 (&kd)[2][2],
                              __m256 (&kdmin)[2][2]) {
  if (gw.kd == nullptr || (g & ((int64_t{1} << w.ks.super_shift) - 1)) != 0) return;
  for (int t = 0; t < 2; ++t)
    for (int h = 0; h < 2; ++h) {
      kd[t][h] = split_halfx8(gw.kd + 16 * t, h);
      if (gw.kdmin != nullptr) kdmin[t][h] = split_halfx8(gw.kdmin + 16 * t, h);
    }
}

// Chunk c of a Q4 group's tile (32 bytes at `at`): per output o, the codes of inputs 4c, 4c + 1 in the low nibbles of
// bytes 2o, 2o + 1 and of 4c + 2, 4c + 3 in their high nibbles. Widened to int16, bytes 2o, 2o + 1 are one 32-bit
// lane per output, so vpmaddwd against an input pair broadcast gives that output's two products summed, in int32:
// acc[h] += the four products of each output of half h.
LMRPC_INLINE void q4_int16_chunk(const uint8_t* at, __m256i x0, __m256i x1, __m256i (&acc)[2]) {
  const __m256i low = _mm256_set1_epi16(0x0f);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  const __m256i u0 = _mm256_unpacklo_epi8(v, _mm256_setzero_si256());
  const __m256i u1 = _mm256_unpackhi_epi8(v, _mm256_setzero_si256());
  const __m256i lo0 = _mm256_and_si256(u0, low), hi0 = _mm256_srli_epi16(u0, 4);
  const __m256i lo1 = _mm256_and_si256(u1, low), hi1 = _mm256_srli_epi16(u1, 4);
  acc[0] = _mm256_add_epi32(acc[0], _mm256_add_epi32(_mm256_madd_epi16(lo0, x0), _mm256_madd_epi16(hi0, x1)));
  acc[1] = _mm256_add_epi32(acc[1], _mm256_add_epi32(_mm256_madd_epi16(lo1, x0), _mm256_madd_epi16(hi1, x1)));
  // Integer sums are associative, and gcc took that to sum an unrolled group's products as a tree after the loop,
  // spilling them (one-row Q4_K products 1.25x slower on Zen 1): the sums stay running, in registers.
  __asm__("" : "+x"(acc[0]), "+x"(acc[1]));
}

// Inputs 4c, 4c + 1 and 4c + 2, 4c + 3 of a row's group, each pair broadcast to every 32-bit lane.
LMRPC_INLINE void input_pairs(const int16_t* in, __m256i& x0, __m256i& x1) {
  x0 = _mm256_broadcastd_epi32(_mm_loadu_si32(in));
  x1 = _mm256_broadcastd_epi32(_mm_loadu_si32(in + 2));
}

// Y (split order, [tile][half] of 8) after a group whose integer sums are acc, for a row with the group's d and
// d * sum(q): the operations of the file header, in its order.
LMRPC_INLINE __m256 fold_split(__m256 y, __m256i acc, __m256 d, __m256 dsum, const SplitFold& f, bool has_offset) {
  y = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), d), f.scale, y);
  return has_offset ? _mm256_fmadd_ps(dsum, f.offset, y) : y;
}

// Split-order totals [tile][half] -> 32 outputs in order.
LMRPC_INLINE void store_split(const __m256 (&Y)[2][2], float* out) {
  for (int t = 0; t < 2; ++t) {
    _mm256_storeu_ps(out + 16 * t, _mm256_permute2f128_ps(Y[t][0], Y[t][1], 0x20));
    _mm256_storeu_ps(out + 16 * t + 8, _mm256_permute2f128_ps(Y[t][0], Y[t][1], 0x31));
  }
}

// The sum of a row's int16 codes over n = 16 or 32 inputs at `q`, in every 32-bit lane.
LMRPC_INLINE __m256i sum_q_x8(const int16_t* q, int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), ones);
  if (n == 32) s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16)), ones));
  s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0x4E));
  s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0xB1));
  return _mm256_add_epi32(s, _mm256_permute2x128_si256(s, s, 0x01));
}

#endif

}  // namespace lmrpc::linear_detail
