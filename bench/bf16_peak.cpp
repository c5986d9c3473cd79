// The machine's ceiling for bf16 products: AVX512-BF16 dot products (vdpbf16ps, 16 lanes x 2 multiply-adds) on 12
// independent accumulators per thread, nothing read from memory; prints multiply-adds a second over all threads.
// A kernel figure from bench/products.py (G multiply-adds a second) reads against this one. Not product code.
//
//   g++ -O3 -fopenmp -march=native bench/bf16_peak.cpp -o /tmp/bf16_peak && OMP_NUM_THREADS=2 /tmp/bf16_peak
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>

int main() {
  constexpr int kAccumulators = 12;  // enough independent sums to cover the instruction's latency
  constexpr long kSteps = 16000000;  // per thread, each kAccumulators dot products
  for (int rep = 0; rep < 5; ++rep) {
    float sink = 0;
    int threads = 1;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : sink)
    {
#pragma omp single
      threads = omp_get_num_threads();
      __m512 acc[kAccumulators];
      for (auto& a : acc) a = _mm512_setzero_ps();
      __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));  // 1.0
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3c00 + omp_get_thread_num()));
      for (long s = 0; s < kSteps; ++s) {
#pragma GCC unroll 12
        for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], w, x);
        __asm__ volatile("" : "+v"(w));  // keeps the loop from being folded away
      }
      for (const auto& a : acc) sink += _mm512_reduce_add_ps(a);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double madds = static_cast<double>(threads) * kSteps * kAccumulators * 32;
    std::printf("%d threads: %.1f G multiply-adds a second (checksum %g)\n", threads, madds / seconds / 1e9, sink);
  }
}
