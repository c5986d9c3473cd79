// The ceilings of AVX2 + FMA float32 products of 4-bit codes, one thread, nothing read beyond L1: (1) FMAs alone on 12
// independent accumulators; (2) the many-row Q4 kernel's inner step (block_q4_f32 in
// kernels/lmrpc/kernels/csrc/linear_kernels_avx2.h) for R rows: 16 bytes of codes made 4 float vectors (q4_lanes: zero
// extend, mask / shift, convert), then per row two input broadcasts and 4 FMAs; (3) the same step without the
// conversion (the codes' vectors held in registers). Prints G multiply-adds a second. A kernel figure from
// bench/products.py (`OMP_NUM_THREADS=1`) reads against these. Not product code.
//
//   g++ -O3 -mavx2 -mfma bench/f32_q4_peak.cpp -o /tmp/f32_q4_peak && /tmp/f32_q4_peak
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

constexpr long kSteps = 100000000;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double fma_only() {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 x = _mm256_set1_ps(0.5f), y = _mm256_set1_ps(0.25f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < kSteps; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
  }
  const double s = seconds_since(t0);
  float sink = 0;
  for (int i = 0; i < 12; ++i) sink += acc[i][0];
  std::printf("  (sink %g)\n", sink);
  return kSteps * 12.0 * 8 / s / 1e9;
}

alignas(64) double inputs[6][32];  // each row's inputs, two floats per double (a kpair)
alignas(64) uint8_t codes[4096];

inline __attribute__((always_inline)) void q4_lanes(const uint8_t* bytes, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

template <int R, bool kConvert>
double q4_step() {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  __m256 lo[2], hi[2];
  for (int i = 0; i < 2; ++i) q4_lanes(codes + 8 * i, lo[i], hi[i]);
  const auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < kSteps; ++k) {
    const int c = static_cast<int>(k & 15);
    if constexpr (kConvert) {
      for (int i = 0; i < 2; ++i) q4_lanes(codes + 16 * (k & 255) + 8 * i, lo[i], hi[i]);
    } else {
      __asm__ volatile("" : "+x"(lo[0]), "+x"(lo[1]), "+x"(hi[0]), "+x"(hi[1]));  // not hoisted nor folded
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_castpd_ps(_mm256_broadcast_sd(&inputs[r][2 * c]));
      const __m256 x1 = _mm256_castpd_ps(_mm256_broadcast_sd(&inputs[r][2 * c + 1]));
      for (int i = 0; i < 2; ++i) acc[r][i] = _mm256_fmadd_ps(hi[i], x1, _mm256_fmadd_ps(lo[i], x0, acc[r][i]));
    }
  }
  const double s = seconds_since(t0);
  float sink = 0;
  for (int r = 0; r < R; ++r) sink += acc[r][0][0] + acc[r][1][0];
  std::printf("  (sink %g)\n", sink);
  return kSteps * R * 4.0 * 8 / s / 1e9;
}

}  // namespace

int main() {
  for (int r = 0; r < 6; ++r)
    for (int j = 0; j < 32; ++j) inputs[r][j] = 1e-3;
  for (int i = 0; i < 4096; ++i) codes[i] = static_cast<uint8_t>(i * 7);
  std::printf("FMAs alone: %.2f G multiply-adds/s\n", fma_only());
  std::printf("step, 4 rows, codes held: %.2f\n", q4_step<4, false>());
  std::printf("step, 2 rows, codes converted: %.2f\n", q4_step<2, true>());
  std::printf("step, 4 rows, codes converted: %.2f\n", q4_step<4, true>());
  std::printf("step, 6 rows, codes converted: %.2f\n", q4_step<6, true>());
}
