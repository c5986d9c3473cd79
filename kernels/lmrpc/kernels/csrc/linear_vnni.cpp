// Q4 weights with int8 activations (PackedWeight::vnni, AVX512-VNNI): a tile pair's products over every row, and
// the codes laid out for them (vnni_codes).
#include "linear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear_impl.h"

namespace lmrpc {

namespace linear_detail {

#if LMRPC_VNNI
// ---- Q4 weights with int8 activations (PackedWeight::vnni) ---------------------------------------------------------
namespace {

// Per row and output: for each group in order, isum = sum of code * q over its 32 inputs (exact, int32), then
// Y = fma(isum * d, scale, Y) and Y = fma(d * sum(q), offset, Y) (Q4_0: offset = -8 * scale). Integer sums are
// exact, so neither the row block nor the order inside a group can change a bit; the fold order is fixed.
template <int R>
void vnni_block(const PackedWeight& w, int64_t p, const int8_t* const* x, const float* const* d,
                const float* const* dsum, float (*out)[32 * kMaxPairs]) {
  const int64_t groups = w.k_pad / 32;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 Y[R][2];
  for (int r = 0; r < R; ++r) Y[r][0] = Y[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = w.vnni + (p * groups + g) * 512;
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
    const int64_t si = (p * groups + g) * 32;
    for (int t = 0; t < 2; ++t) {
      const __m512 s = load_halfx16(w.scale + si + 16 * t);
      const __m512 o = w.offset != nullptr ? load_halfx16(w.offset + si + 16 * t)
                                           : _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
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

}  // namespace linear_detail

void vnni_codes(const PackedWeight& w, uint8_t* out) {
  const int64_t groups = w.k_pad / 32, pairs = w.n_pad / 32;
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
  auto code = [&](int64_t n, int64_t k) {  // the stored code (see linear.h's Q4 layout)
    const int64_t pair = n / 32, t = (n / 16) % 2, o = n % 16, g = k / 32, jg = (k / 2) % 16;
    const uint8_t byte = data[((pair * groups + g) * 2 + t) * 256 + 32 * (jg / 2) + 2 * o + k % 2];
    return jg % 2 == 0 ? byte & 15 : byte >> 4;
  };
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t g = 0; g < groups; ++g)
      for (int q = 0; q < 4; ++q)
        for (int t = 0; t < 2; ++t)
          for (int o = 0; o < 16; ++o)
            for (int e = 0; e < 4; ++e) {
              const int64_t n = 32 * p + 16 * t + o, k = 32 * g + 4 * q + e;
              out[(p * groups + g) * 512 + (q * 2 + t) * 64 + 4 * o + e] =
                  static_cast<uint8_t>(code(n, k) | (code(n, k + 16) << 4));
            }
}

}  // namespace lmrpc
