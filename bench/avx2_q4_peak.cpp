// The ceilings of AVX2 products of 4-bit codes, one thread, nothing read beyond L1: (1) FMAs alone on 12 independent
// accumulators; (2) the many-row float32 Q4 kernel's inner step (block_q4_f32 in
// kernels/lmrpc/kernels/csrc/linear_kernels_avx2.h) for R rows: 16 bytes of codes made 4 float vectors (q4_lanes: zero
// extend, mask / shift, convert), then per row two input broadcasts and 4 FMAs; (3) the same step without the
// conversion (the codes' vectors held in registers); (4) vpmaddwd + vpaddd alone; (5) the one-row int16 step
// (int16_block in linear_int16.cpp): 32 bytes of codes widened to int16, masked / shifted, 4 vpmaddwd against two
// broadcast input pairs; (6) the many-row int16 step for 4 or 6 rows: the codes widened once per step for every row,
// or loaded already widened from an L1 buffer, or the inputs read already broadcast. Prints G multiply-adds a second.
// A kernel figure from bench/products.py (`OMP_NUM_THREADS=1`) reads against these. Not product code.
//
//   g++ -O3 -mavx2 -mfma bench/avx2_q4_peak.cpp -o /tmp/avx2_q4_peak && /tmp/avx2_q4_peak
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

alignas(64) int16_t int16_inputs[64];

double madd_only() {
  __m256i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_epi32(i);
  __m256i a = _mm256_set1_epi16(3), b = _mm256_set1_epi16(5);
  const auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < kSteps; ++k) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(a, b));
    __asm__ volatile("" : "+x"(a), "+x"(b));  // not hoisted out of the loop
  }
  const double s = seconds_since(t0);
  int sink = 0;
  for (int i = 0; i < 8; ++i) sink += _mm256_extract_epi32(acc[i], 0);
  std::printf("  (sink %d)\n", sink);
  return kSteps * 8.0 * 16 / s / 1e9;
}

double int16_one_row_step() {
  const __m256i low = _mm256_set1_epi16(0x0f);
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  const auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < kSteps; ++k) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * (k & 127)));
    const __m256i u0 = _mm256_unpacklo_epi8(v, _mm256_setzero_si256());
    const __m256i u1 = _mm256_unpackhi_epi8(v, _mm256_setzero_si256());
    const __m256i lo0 = _mm256_and_si256(u0, low), hi0 = _mm256_srli_epi16(u0, 4);
    const __m256i lo1 = _mm256_and_si256(u1, low), hi1 = _mm256_srli_epi16(u1, 4);
    const int16_t* in = int16_inputs + 4 * (k & 15);
    const __m256i x0 = _mm256_broadcastd_epi32(_mm_loadu_si32(in));
    const __m256i x1 = _mm256_broadcastd_epi32(_mm_loadu_si32(in + 2));
    acc0 = _mm256_add_epi32(acc0, _mm256_add_epi32(_mm256_madd_epi16(lo0, x0), _mm256_madd_epi16(hi0, x1)));
    acc1 = _mm256_add_epi32(acc1, _mm256_add_epi32(_mm256_madd_epi16(lo1, x0), _mm256_madd_epi16(hi1, x1)));
  }
  const double s = seconds_since(t0);
  std::printf("  (sink %d)\n", _mm256_extract_epi32(acc0, 0) + _mm256_extract_epi32(acc1, 1));
  return kSteps * 64.0 / s / 1e9;
}

alignas(64) int16_t int16_codes[8192];     // codes already widened to int16 (an L1 buffer), 4 vectors a step
alignas(64) int32_t broadcast_pairs[4096];  // input pairs already broadcast: 8 copies of each (32 bytes)

// The many-row int16 step for R rows (int16_block in linear_int16.cpp). kSource 0: 32 bytes of codes widened and
// masked each step, shared by the rows; 1: the 4 widened vectors loaded from an int16 buffer in L1; 2: as 0, with
// each row's input pairs read already broadcast (madd against memory) instead of broadcast each step.
template <int R, int kSource>
double int16_rows_step() {
  const __m256i low = _mm256_set1_epi16(0x0f);
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < kSteps; ++k) {
    __m256i lo0, hi0, lo1, hi1;
    if constexpr (kSource == 1) {
      const __m256i* at = reinterpret_cast<const __m256i*>(int16_codes + 64 * (k & 127));
      lo0 = _mm256_load_si256(at), hi0 = _mm256_load_si256(at + 1);
      lo1 = _mm256_load_si256(at + 2), hi1 = _mm256_load_si256(at + 3);
    } else {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * (k & 127)));
      const __m256i u0 = _mm256_unpacklo_epi8(v, _mm256_setzero_si256());
      const __m256i u1 = _mm256_unpackhi_epi8(v, _mm256_setzero_si256());
      lo0 = _mm256_and_si256(u0, low), hi0 = _mm256_srli_epi16(u0, 4);
      lo1 = _mm256_and_si256(u1, low), hi1 = _mm256_srli_epi16(u1, 4);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      __m256i x0, x1;
      if constexpr (kSource == 2) {
        const __m256i* at = reinterpret_cast<const __m256i*>(broadcast_pairs + 16 * ((k + r) & 127));
        x0 = _mm256_load_si256(at), x1 = _mm256_load_si256(at + 1);
      } else {
        const int16_t* in = int16_inputs + 4 * ((k + r) & 15);
        x0 = _mm256_broadcastd_epi32(_mm_loadu_si32(in));
        x1 = _mm256_broadcastd_epi32(_mm_loadu_si32(in + 2));
      }
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_add_epi32(_mm256_madd_epi16(lo0, x0), _mm256_madd_epi16(hi0, x1)));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_add_epi32(_mm256_madd_epi16(lo1, x0), _mm256_madd_epi16(hi1, x1)));
      __asm__("" : "+x"(acc[r][0]), "+x"(acc[r][1]));
    }
  }
  const double s = seconds_since(t0);
  int sink = 0;
  for (int r = 0; r < R; ++r) sink += _mm256_extract_epi32(acc[r][0], 0) + _mm256_extract_epi32(acc[r][1], 1);
  std::printf("  (sink %d)\n", sink);
  return kSteps * R * 64.0 / s / 1e9;
}

}  // namespace

int main() {
  for (int i = 0; i < 64; ++i) int16_inputs[i] = static_cast<int16_t>(100 * i);
  for (int r = 0; r < 6; ++r)
    for (int j = 0; j < 32; ++j) inputs[r][j] = 1e-3;
  for (int i = 0; i < 4096; ++i) codes[i] = static_cast<uint8_t>(i * 7);
  std::printf("FMAs alone: %.2f G multiply-adds/s\n", fma_only());
  std::printf("step, 4 rows, codes held: %.2f\n", q4_step<4, false>());
  std::printf("step, 2 rows, codes converted: %.2f\n", q4_step<2, true>());
  std::printf("step, 4 rows, codes converted: %.2f\n", q4_step<4, true>());
  std::printf("step, 6 rows, codes converted: %.2f\n", q4_step<6, true>());
  std::printf("vpmaddwd + vpaddd alone: %.2f\n", madd_only());
  std::printf("one-row int16 step: %.2f\n", int16_one_row_step());
  for (int i = 0; i < 8192; ++i) int16_codes[i] = static_cast<int16_t>(i % 16);
  for (int i = 0; i < 4096; ++i) broadcast_pairs[i] = 100 * (i / 8);
  std::printf("int16 step, 4 rows, codes widened each step: %.2f\n", int16_rows_step<4, 0>());
  std::printf("int16 step, 4 rows, codes from an int16 buffer: %.2f\n", int16_rows_step<4, 1>());
  std::printf("int16 step, 6 rows, codes from an int16 buffer: %.2f\n", int16_rows_step<6, 1>());
  std::printf("int16 step, 4 rows, inputs read broadcast: %.2f\n", int16_rows_step<4, 2>());
}
