// Q4 weights with int8 activations (PackedWeight::int8): a tile pair's products over every row. AVX512-VNNI reads
// the codes once more in their own layout (PackedWeight::vnni, vnni_codes); AVX2 reads the Q4 layout as it is.
//
// Both compute, per row and output, for each group in order: isum = sum of code * q over its 32 inputs (exact, in
// integers), then Y = fma(isum * d, scale, Y) and Y = fma(d * sum(q), offset, Y) (Q4_0: offset = -8 * scale).
// Integer sums are exact, so neither the row block nor the order inside a group can change a bit; the fold order
// is fixed.
#include "linear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear_impl.h"
#include "linear_kernels_avx2.h"

namespace lmrpc {

namespace linear_detail {

#if LMRPC_VNNI
// ---- Q4 weights with int8 activations (PackedWeight::vnni) ---------------------------------------------------------
namespace {

template <int R>
void vnni_block(const PackedWeight& w, int64_t p, const int8_t* const* x, const float* const* d,
                const float* const* dsum, float (*out)[32 * kMaxPairs]) {
  const int64_t groups = w.k_pad / 32;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 Y[R][2];
  for (int r = 0; r < R; ++r) Y[r][0] = Y[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = w.vnni + (p * groups + g) * 512;
    if constexpr (R == 1) {
      // One row streams its codes from memory: asked for ahead into L2 as one_row_q4_bf16's are, past the pair's end
      // into the next pair's (they follow it; a thread takes pairs in order), and the scales a line at a time.
      prefetch_one_row(codes + kL2AheadGroups * 512, 512);
      prefetch_scales(w, p, groups, g + 2 * kL2AheadGroups);
    }
    __m512i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int q = 0; q < 4; ++q) {
      const __m512i p0 = _mm512_loadu_si512(codes + 128 * q), p1 = _mm512_loadu_si512(codes + 128 * q + 64);
      const __m512i a0 = _mm512_and_si512(p0, low), a1 = _mm512_and_si512(p1, low);
      const __m512i b0 = _mm512_and_si512(_mm512_srli_epi16(p0, 4), low);
      const __m512i b1 = _mm512_and_si512(_mm512_srli_epi16(p1, 4), low);
      for (int r = 0; r < R; ++r) {
        int32_t lo, hi;
        std::memcpy(&lo, x[r] + 32 * g + 4 * q, 4);
        std::memcpy(&hi, x[r] + 32 * g + 4 * (q + 4), 4);
        const __m512i xl = _mm512_set1_epi32(lo), xh = _mm512_set1_epi32(hi);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], a0, xl);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], a1, xl);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], b0, xh);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], b1, xh);
      }
    }
    const GroupWeights gw = group_weights(w, p, groups, g, nullptr);  // fp16 scales, or K scales (exact)
    for (int t = 0; t < 2; ++t) {
      const __m512 s = scale_x16(gw, t);
      const __m512 o = gw.has_offset() ? offset_x16(gw, t) : _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][t]), _mm512_set1_ps(d[r][g]));
        Y[r][t] = _mm512_fmadd_ps(a, s, Y[r][t]);
        Y[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(dsum[r][g]), o, Y[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out[r], Y[r][0]);
    _mm512_storeu_ps(out[r] + 16, Y[r][1]);
  }
}

}  // namespace

// Every row of tile pair p, in blocks of up to kMaxRows rows.
void vnni_pair(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p) {
  const int64_t groups = w.k_pad / 32;
  alignas(64) float out[kMaxRows][32 * kMaxPairs];
  for (int64_t r0 = rr.begin; r0 < rr.end; r0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, rr.end - r0));
    const int8_t* x[kMaxRows];
    const float* d[kMaxRows];
    const float* dsum[kMaxRows];
    for (int r = 0; r < rows; ++r) {
      x[r] = in.i8.data() + (r0 + r) * w.k_pad;
      d[r] = in.d.data() + (r0 + r) * groups;
      dsum[r] = in.dsum.data() + (r0 + r) * groups;
    }
    switch (rows) {
      case 1: vnni_block<1>(w, p, x, d, dsum, out); break;
      case 2: vnni_block<2>(w, p, x, d, dsum, out); break;
      case 3: vnni_block<3>(w, p, x, d, dsum, out); break;
      case 4: vnni_block<4>(w, p, x, d, dsum, out); break;
      case 5: vnni_block<5>(w, p, x, d, dsum, out); break;
      default: vnni_block<6>(w, p, x, d, dsum, out); break;
    }
    epilogue(w, a, r0, rows, p, 1, out);
  }
}
#endif

#if LMRPC_AVX2
// ---- Q4 weights with int8 activations, AVX2 (PackedWeight::int8, float32 compute) -----------------------------
namespace {

constexpr int kInt8Rows = 4;  // rows per register block (3 and 6 measured no faster)

// R rows x one tile pair (p) over every group, from the Q4 layout: chunk c of a tile holds, per output o, the codes
// of inputs 4c, 4c + 1 in the low nibbles of bytes 2o, 2o + 1 and of 4c + 2, 4c + 3 in their high nibbles, so
// maddubs of the nibbles against the two inputs broadcast gives each output's sum of two products in an int16
// lane. Codes < 16 and |q| <= 127: 16 products fit an int16 (30,480), so chunks 0-3 and 4-7 sum apart, widened
// to int32 once per group.
template <int R>
void int8_block_avx2(const PackedWeight& w, int64_t p, const int8_t* const* x, const float* const* d,
                     const float* const* dsum, float (*out)[32 * kMaxPairs]) {
  const int64_t groups = w.k_pad / 32;
  const __m256i low = _mm256_set1_epi8(0x0f);
  alignas(32) float Y[R][32] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const GroupWeights gw = group_weights(w, p, groups, g, nullptr);
    const uint8_t* src = static_cast<const uint8_t*>(w.data) + (p * groups + g) * 512;
    prefetch_q4_ahead(src);
    for (int t = 0; t < 2; ++t) {
      __m256i acc[R][2];  // [row][chunks 0-3 | 4-7]: 16 outputs' int16 sums
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      // Unrolled: acc[r][c / 4] then names a register, not a stack slot indexed at run time.
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 256 * t + 32 * c));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          // Inputs (4c, 4c + 1) and (4c + 2, 4c + 3) of the group, each pair stored twice (kI8Width): one 32-bit
          // broadcast from memory each.
          const int8_t* pairs = x[r] + 64 * g + 8 * c;
          const __m256i x0 = _mm256_broadcastd_epi32(_mm_loadu_si32(pairs));
          const __m256i x1 = _mm256_broadcastd_epi32(_mm_loadu_si32(pairs + 4));
          const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
          acc[r][c / 4] = _mm256_add_epi16(acc[r][c / 4], s);
        }
      }
      for (int h = 0; h < 2; ++h) {  // outputs 8h .. 8h + 7 of the tile
        const int l0 = 16 * t + 8 * h;
        const __m256 scale = scale_x8(gw, l0);
        const bool has_offset = gw.has_offset() || w.q4_signed;
        const __m256 offset = gw.has_offset() ? offset_x8(gw, l0) : _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f));
        for (int r = 0; r < R; ++r) {
          const __m256i a0 = _mm256_cvtepi16_epi32(h == 0 ? _mm256_castsi256_si128(acc[r][0])
                                                          : _mm256_extracti128_si256(acc[r][0], 1));
          const __m256i a1 = _mm256_cvtepi16_epi32(h == 0 ? _mm256_castsi256_si128(acc[r][1])
                                                          : _mm256_extracti128_si256(acc[r][1], 1));
          const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1)), _mm256_set1_ps(d[r][g]));
          __m256 y = _mm256_fmadd_ps(a, scale, _mm256_load_ps(&Y[r][l0]));
          if (has_offset) y = _mm256_fmadd_ps(_mm256_set1_ps(dsum[r][g]), offset, y);
          _mm256_store_ps(&Y[r][l0], y);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out[r], Y[r], sizeof(Y[r]));
}

}  // namespace

void int8_pair_avx2(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p) {
  const int64_t groups = w.k_pad / 32;
  alignas(64) float out[kInt8Rows][32 * kMaxPairs];
  for (int64_t r0 = rr.begin; r0 < rr.end; r0 += kInt8Rows) {
    const int rows = static_cast<int>(std::min<int64_t>(kInt8Rows, rr.end - r0));
    const int8_t* x[kInt8Rows];
    const float* d[kInt8Rows];
    const float* dsum[kInt8Rows];
    for (int r = 0; r < rows; ++r) {
      x[r] = in.i8.data() + (r0 + r) * w.k_pad * kI8Width;
      d[r] = in.d.data() + (r0 + r) * groups;
      dsum[r] = in.dsum.data() + (r0 + r) * groups;
    }
    switch (rows) {
      case 1: int8_block_avx2<1>(w, p, x, d, dsum, out); break;
      case 2: int8_block_avx2<2>(w, p, x, d, dsum, out); break;
      case 3: int8_block_avx2<3>(w, p, x, d, dsum, out); break;
      default: int8_block_avx2<4>(w, p, x, d, dsum, out); break;
    }
    epilogue(w, a, r0, rows, p, 1, out);
  }
}
#endif

}  // namespace linear_detail

void vnni_codes(const PackedWeight& w, uint8_t* out) {
  const int64_t groups = w.k_pad / 32, pairs = w.n_pad / 32;
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
  // Both layouts keep a tile pair's group in the same 512 bytes: each is read from a copy, so out may be data.
  uint8_t block[512];
  auto code = [&](int t, int o, int kg) {  // the stored code of tile t, output o, input kg of the group (linear.h)
    const int jg = kg / 2;
    const uint8_t byte = block[t * 256 + 32 * (jg / 2) + 2 * o + kg % 2];
    return jg % 2 == 0 ? byte & 15 : byte >> 4;
  };
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (p * groups + g) * 512;
      std::memcpy(block, data + at, 512);
      for (int q = 0; q < 4; ++q)
        for (int t = 0; t < 2; ++t)
          for (int o = 0; o < 16; ++o)
            for (int e = 0; e < 4; ++e) {
              out[at + (q * 2 + t) * 64 + 4 * o + e] =
                  static_cast<uint8_t>(code(t, o, 4 * q + e) | (code(t, o, 4 * q + e + 16) << 4));
            }
    }
}

}  // namespace lmrpc
