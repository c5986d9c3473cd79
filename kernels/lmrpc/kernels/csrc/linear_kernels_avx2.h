// AVX2 + FMA forms of the portable micro-kernels (CPUs without AVX512-BF16: AMD Zen 2/3, older Xeons). Each output
// element gets the portable loops' operations in their order (see linear_kernels.h), eight outputs per register, so
// the bits are those of the portable build and do not depend on the row count.
//
// float32 products: per row and lane (16 * tile + output, even/odd input) a running sum over a group's kpairs, the
// even and odd sums added at the group's end, then folded. bfloat16 products: per row and output,
// fma(x_even, w_even, acc) then fma(x_odd, w_odd, .) over the group's kpairs, then folded.
//
// Besides the blocks over expanded groups (block_avx2), float32 products of quantized weights read their codes as
// stored where that saves memory traffic: one row over Q4, Q8 or Q6 codes (one_row_codes_f32), and many rows in
// blocks of 4 over Q4 codes (block_q4_f32) or 8-bit ones (block_q8_f32).
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear.h"
#include "linear_impl.h"
#include "linear_kscales.h"

namespace lmrpc::linear_detail {

#if LMRPC_AVX2
// Lanes l0 .. l0 + 7 of a group's scales and offsets, as lane_scale and lane_offset compute them (the int8 products).
LMRPC_INLINE __m256 scale_x8(const GroupWeights& gw, int l0) {
  if (gw.kd == nullptr) return load_halfx8(gw.scale + l0);
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(gw.ksc + l0));
  const __m256i sc = gw.ksigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  return _mm256_mul_ps(load_halfx8(gw.kd + l0), _mm256_cvtepi32_ps(sc));
}
LMRPC_INLINE __m256 offset_x8(const GroupWeights& gw, int l0) {
  if (gw.kd == nullptr) return load_halfx8(gw.offset + l0);
  const __m256 dm = _mm256_mul_ps(load_halfx8(gw.kdmin + l0), load_u8x8(gw.km + l0));
  return _mm256_xor_ps(dm, _mm256_set1_ps(-0.0f));  // -(dmin * m)
}

// A group's multipliers for 8 outputs, made once and folded into every row's sums.
struct Fold8 {
  __m256 scale, offset;
  bool has_offset;
};
LMRPC_INLINE Fold8 fold_of(const GroupWeights& gw, int l0) {
  const bool off = gw.offset != nullptr;
  return {sum_scale_x8(gw, l0), off ? load_halfx8(gw.offset + l0) : _mm256_setzero_ps(), off};
}

// Y[0..7] (8 outputs of one row) after group g, from the group's sums a: fma(a, scale, Y), then fma(group sum of
// x, offset, Y) when the group has offsets; dense weights (one group): Y = a. (K-scaled: Y is the super-block's S.)
template <bool Q>
LMRPC_INLINE void fold8(float* Y, __m256 a, const Fold8& f, const float* sums, int64_t g) {
  if constexpr (Q) {
    __m256 y = _mm256_fmadd_ps(a, f.scale, _mm256_load_ps(Y));
    if (f.has_offset) y = _mm256_fmadd_ps(_mm256_set1_ps(sums[g]), f.offset, y);
    _mm256_store_ps(Y, y);
  } else {
    _mm256_store_ps(Y, a);
  }
}

// Lanes [o0 e, o0 o, o1 e, o1 o, ...] of two registers (outputs 0-3 and 4-7) -> the 8 outputs' even + odd sums.
inline __m256 pair_sums(__m256 a, __m256 b) {
  const __m256 h = _mm256_hadd_ps(a, b);  // [0, 1, 4, 5, 2, 3, 6, 7]
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
}

// One tile (16 outputs) of one group for N rows (1 or 2), float32: w at the tile's kpair 0 ([kpairs][2 tiles][32]
// floats, so kpair j at w + 64 j), x[r] at the group's first input. The 16 outputs' sums -> s[r][0..1].
template <int N>
inline void tile_f32(const float* w, const float* const (&x)[N], int64_t gkp, __m256 (&s)[N][2]) {
  __m256 acc[N][4];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < gkp; ++j) {
    __m256 wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = _mm256_loadu_ps(w + 64 * j + 8 * c);
    for (int r = 0; r < N; ++r) {
      const __m256 xb = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x[r] + 2 * j)));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xb, acc[r][c]);
    }
  }
  for (int r = 0; r < N; ++r) {
    s[r][0] = pair_sums(acc[r][0], acc[r][1]);
    s[r][1] = pair_sums(acc[r][2], acc[r][3]);
  }
}

// One tile of one group for N rows (1 or 2), bfloat16: kpair j's 16 outputs x 2 inputs at w + 64 j as 32 codes.
template <int N>
inline void tile_bf16(const uint16_t* w, const uint16_t* const (&x)[N], int64_t gkp, __m256 (&s)[N][2]) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  __m256 acc[N][2];
  for (int r = 0; r < N; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < gkp; ++j) {
    __m256 even[2], odd[2];
    for (int h = 0; h < 2; ++h) {  // outputs 8h .. 8h + 7: their (even, odd) code pairs
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 16 * h));
      even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    }
    for (int r = 0; r < N; ++r) {
      const __m256 x0 = _mm256_set1_ps(bf16_to_f32(x[r][2 * j])), x1 = _mm256_set1_ps(bf16_to_f32(x[r][2 * j + 1]));
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(x1, odd[h], _mm256_fmadd_ps(x0, even[h], acc[r][h]));
    }
  }
  for (int r = 0; r < N; ++r) {
    s[r][0] = acc[r][0];
    s[r][1] = acc[r][1];
  }
}

// Rows r, r + 1 (N = 2) or r alone (N = 1) of a block over tile t of pair q, group g: sums, then folded into Y
// with the tile's folds f (outputs 0-7 and 8-15).
template <typename T, int N, int R, int P, bool Q>
inline void tile_rows(const GroupWeights& gw, const Fold8 (&f)[2], int q, int t, int r, int64_t g, int64_t gkp,
                      const RowBlock& rb, float (&Y)[R][32 * P]) {
  const T* x[N];
  for (int i = 0; i < N; ++i) x[i] = static_cast<const T*>(rb.x[r + i]) + 2 * g * gkp;
  const T* w = static_cast<const T*>(gw.w) + 32 * t;
  __m256 s[N][2];
  if constexpr (sizeof(T) == 2) tile_bf16<N>(w, x, gkp, s); else tile_f32<N>(w, x, gkp, s);
  for (int i = 0; i < N; ++i)
    for (int h = 0; h < 2; ++h) {
      fold8<Q>(&Y[r + i][32 * q + 16 * t + 8 * h], s[i][h], f[h], rb.sums[r + i], g);
    }
}

// R rows x P tile pairs over every group (the portable block_f32 / block_bf16's operations), two rows at a time
// per tile so that a tile's kpair vectors serve both from registers.
template <typename V, int R, int P, bool Q, typename Source>
void block_avx2(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  const PackedWeight& w = *src[0].at.w;
  int64_t pairs[P];
  for (int q = 0; q < P; ++q) pairs[q] = src[q].at.pair;
  alignas(32) float Y[R][32 * P] = {};
  alignas(32) float T[R][32 * P] = {};  // a K-scaled weight's totals
  for (int64_t g = 0; g < groups; ++g) {
    GroupWeights gw[P];
    for (int q = 0; q < P; ++q) gw[q] = src[q].group(g);
    for (int q = 0; q < P; ++q)
      for (int t = 0; t < 2; ++t) {
        Fold8 f[2] = {};
        if constexpr (Q) {
          f[0] = fold_of(gw[q], 16 * t);
          f[1] = fold_of(gw[q], 16 * t + 8);
        }
        int r = 0;
        for (; r + 2 <= R; r += 2) tile_rows<V, 2, R, P, Q>(gw[q], f, q, t, r, g, gkp, rb, Y);
        if (r < R) tile_rows<V, 1, R, P, Q>(gw[q], f, q, t, r, g, gkp, rb, Y);
      }
    ks_after_group8<R, P>(Y, T, w, pairs, groups, g, rb.sums);
  }
  for (int r = 0; r < R; ++r) std::memcpy(rb.out[r], w.k_scaled() ? T[r] : Y[r], sizeof(Y[r]));
}

// 8 bytes of a Q4 chunk -> their 8 lanes' values of kpair 2c (low nibbles) and 2c + 1 (high nibbles), as floats:
// q - 8 when kSigned (Q4_0), else q (the subtraction costs two of nine instructions a byte pair: only where needed).
template <bool kSigned>
LMRPC_INLINE void q4_lanes(const uint8_t* bytes, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  __m256i l = _mm256_and_si256(v, _mm256_set1_epi32(0x0f)), h = _mm256_srli_epi32(v, 4);
  if constexpr (kSigned) {
    l = _mm256_sub_epi32(l, _mm256_set1_epi32(8));
    h = _mm256_sub_epi32(h, _mm256_set1_epi32(8));
  }
  lo = _mm256_cvtepi32_ps(l);
  hi = _mm256_cvtepi32_ps(h);
}

// One row, float32, one tile pair (p) of Q4, Q8 or Q6 codes, read as they are stored: each kpair's codes become floats
// in registers and enter the sums at once (no expanded group in memory). The operations of block_f32<1, 1, true>.
// kSigned: Q4 codes stand for q - 8 (Q4_0), else q.
template <bool kSigned>
void one_row_codes_f32(const PackedWeight& w, int64_t p, const float* x, const float* sums, float* out) {
  const int64_t groups = w.k_pad / w.group, gkp = w.group / 2, kp = w.k_pad / 2;
  const bool q4 = w.format == WeightFormat::Q4;
  alignas(32) float Y[1][32] = {};
  alignas(32) float T[1][32] = {};  // a K-scaled weight's totals
  const int64_t pairs[1] = {p};
  const float* const row_sums[1] = {sums};
  alignas(64) int8_t q6_codes[2][kMaxQ6Group * 32];  // Q6: two groups' codes as Q8 vectors (g % 2)
  for (int64_t g = 0; g < groups; ++g) {
    const GroupWeights gw = group_weights(w, p, groups, g, nullptr);
    const float* xg = x + 2 * g * gkp;
    __m256 acc[2][4];  // [tile][lanes 8c .. 8c + 7]
    for (int t = 0; t < 2; ++t)
      for (int c = 0; c < 4; ++c) acc[t][c] = _mm256_setzero_ps();
    auto pair_of = [&](int64_t j) {
      return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(xg + 2 * j)));
    };
    if (q4) {  // 8 chunks of 32 bytes per tile: kpair 2c in the low nibbles, 2c + 1 in the high ones
      const uint8_t* src = static_cast<const uint8_t*>(w.data) + (p * groups + g) * 512;
      prefetch_q4_ahead(src);
      for (int c = 0; c < 8; ++c) {
        const __m256 x0 = pair_of(2 * c), x1 = pair_of(2 * c + 1);
        for (int t = 0; t < 2; ++t)
          for (int h = 0; h < 4; ++h) {
            __m256 lo, hi;
            q4_lanes<kSigned>(src + 256 * t + 32 * c + 8 * h, lo, hi);
            acc[t][h] = _mm256_fmadd_ps(hi, x1, _mm256_fmadd_ps(lo, x0, acc[t][h]));
          }
      }
    } else {  // one vector of 32 int8 per kpair and tile (Q6: decoded a group at a time into them)
      const int8_t* src = static_cast<const int8_t*>(w.data) + (p * kp + g * gkp) * 64;
      if (w.format == WeightFormat::Q6) {
        // Group g + 1 is decoded now, g's codes were the step before: its loads never wait on stores just made.
        if (g == 0) decode_q6(q6_group(w, p * kp * 2), gkp / 2, q6_codes[0]);
        if (g + 1 < groups) {
          const uint8_t* next = q6_group(w, (p * kp + (g + 1) * gkp) * 2);
          for (int64_t line = 0; line < (gkp * 48 + 63) / 64; ++line) {  // the group after it, asked into L1
            _mm_prefetch(reinterpret_cast<const char*>(next + gkp * 48 + 64 * line), _MM_HINT_T0);
          }
          decode_q6(next, gkp / 2, q6_codes[(g + 1) % 2]);
        }
        src = q6_codes[g % 2];
      } else {
        for (int64_t line = 0; line < gkp; ++line) {  // the group two ahead (64 bytes a kpair), asked into L1
          _mm_prefetch(reinterpret_cast<const char*>(src + 2 * gkp * 64 + 64 * line), _MM_HINT_T0);
        }
      }
      for (int64_t j = 0; j < gkp; ++j) {
        const __m256 xj = pair_of(j);
        for (int t = 0; t < 2; ++t)
          for (int h = 0; h < 4; ++h) {
            const __m256i v =
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 64 * j + 32 * t + 8 * h)));
            acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), xj, acc[t][h]);
          }
      }
    }
    for (int t = 0; t < 2; ++t) {
      fold8<true>(Y[0] + 16 * t, pair_sums(acc[t][0], acc[t][1]), fold_of(gw, 16 * t), sums, g);
      fold8<true>(Y[0] + 16 * t + 8, pair_sums(acc[t][2], acc[t][3]), fold_of(gw, 16 * t + 8), sums, g);
    }
    ks_after_group8<1, 1>(Y, T, w, pairs, groups, g, row_sums);
  }
  std::memcpy(out, w.k_scaled() ? T[0] : Y[0], sizeof(Y[0]));
}

// R (<= 4) rows x one tile pair (p) of Q4 codes over every group, float32, the codes made floats in registers
// once per row block: half a tile at a time (8 outputs), each chunk's 16 bytes -> kpairs 2c and 2c + 1 for every
// row. The operations of block_f32<R, 1, true>; reads a quarter byte a weight where expanded groups take four.
template <int R, bool kSigned>
void block_q4_f32(const PackedWeight& w, int64_t p, const RowBlock& rb) {
  const int64_t groups = w.k_pad / w.group;
  alignas(32) float Y[R][32] = {};
  alignas(32) float T[R][32] = {};  // a K-scaled weight's totals
  const int64_t pairs[1] = {p};
  for (int64_t g = 0; g < groups; ++g) {
    const GroupWeights gw = group_weights(w, p, groups, g, nullptr);
    const uint8_t* src = static_cast<const uint8_t*>(w.data) + (p * groups + g) * 512;
    prefetch_q4_ahead(src);
    for (int t = 0; t < 2; ++t)
      for (int half = 0; half < 2; ++half) {  // lanes 16 half .. 16 half + 15: outputs 8 half .. 8 half + 7
        __m256 acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int c = 0; c < 8; ++c) {
          __m256 lo[2], hi[2];
          for (int i = 0; i < 2; ++i) q4_lanes<kSigned>(src + 256 * t + 32 * c + 16 * half + 8 * i, lo[i], hi[i]);
          for (int r = 0; r < R; ++r) {
            const double* x = reinterpret_cast<const double*>(static_cast<const float*>(rb.x[r]) + 32 * g + 4 * c);
            const __m256 x0 = _mm256_castpd_ps(_mm256_broadcast_sd(x));
            const __m256 x1 = _mm256_castpd_ps(_mm256_broadcast_sd(x + 1));
            for (int i = 0; i < 2; ++i) acc[r][i] = _mm256_fmadd_ps(hi[i], x1, _mm256_fmadd_ps(lo[i], x0, acc[r][i]));
          }
        }
        const Fold8 f = fold_of(gw, 16 * t + 8 * half);
        for (int r = 0; r < R; ++r) {
          fold8<true>(&Y[r][16 * t + 8 * half], pair_sums(acc[r][0], acc[r][1]), f, rb.sums[r], g);
        }
      }
    ks_after_group8<R, 1>(Y, T, w, pairs, groups, g, rb.sums);
  }
  for (int r = 0; r < R; ++r) std::memcpy(rb.out[r], w.k_scaled() ? T[r] : Y[r], sizeof(Y[r]));
}

// R (<= 4) rows x one tile pair (p) of 8-bit codes over every group, float32: each kpair's codes made floats in
// registers once per row block, half a tile (8 outputs) at a time. `codes`: the pair's Q8 vectors ([kp][2][32]; a Q6
// weight's decoded once for all row blocks). The operations of block_f32<R, 1, true>; where expanding the pair's
// groups into floats first puts 4 bytes a weight in a buffer every row block reads again (a 2048 x 8192 pair: 1 MiB,
// from L3), this reads a byte a weight.
template <int R>
void block_q8_f32(const PackedWeight& w, int64_t p, const int8_t* codes, const RowBlock& rb) {
  const int64_t groups = w.k_pad / w.group, gkp = w.group / 2;
  alignas(32) float Y[R][32] = {};
  alignas(32) float T[R][32] = {};  // a K-scaled weight's totals
  const int64_t pairs[1] = {p};
  for (int64_t g = 0; g < groups; ++g) {
    const GroupWeights gw = group_weights(w, p, groups, g, nullptr);
    const int8_t* src = codes + g * gkp * 64;
    for (int t = 0; t < 2; ++t)
      for (int half = 0; half < 2; ++half) {  // lanes 16 half .. 16 half + 15: outputs 8 half .. 8 half + 7
        __m256 acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < gkp; ++j) {
          __m256 v[2];
          for (int i = 0; i < 2; ++i) {
            const int8_t* c = src + 64 * j + 32 * t + 16 * half + 8 * i;
            v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
          }
          for (int r = 0; r < R; ++r) {
            const double* x = reinterpret_cast<const double*>(static_cast<const float*>(rb.x[r]) + 2 * (g * gkp + j));
            const __m256 xj = _mm256_castpd_ps(_mm256_broadcast_sd(x));
            for (int i = 0; i < 2; ++i) acc[r][i] = _mm256_fmadd_ps(v[i], xj, acc[r][i]);
          }
        }
        const Fold8 f = fold_of(gw, 16 * t + 8 * half);
        for (int r = 0; r < R; ++r) {
          fold8<true>(&Y[r][16 * t + 8 * half], pair_sums(acc[r][0], acc[r][1]), f, rb.sums[r], g);
        }
      }
    ks_after_group8<R, 1>(Y, T, w, pairs, groups, g, rb.sums);
  }
  for (int r = 0; r < R; ++r) std::memcpy(rb.out[r], w.k_scaled() ? T[r] : Y[r], sizeof(Y[r]));
}

template <int R, int P, bool Q, typename Source>
void block_f32(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  block_avx2<float, R, P, Q>(src, groups, gkp, rb);
}

template <int R, int P, bool Q, typename Source>
void block_bf16(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  block_avx2<uint16_t, R, P, Q>(src, groups, gkp, rb);
}
#endif

}  // namespace lmrpc::linear_detail
