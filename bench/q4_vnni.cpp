// Prototype, not product code (the product's kernel is `vnni_block` in kernels/lmrpc/kernels/csrc/linear_int8.cpp, which
// this measured first): many-row products over Q4_1 weights (group 32, a scale and an offset per group and
// output), today's kernel scheme against AVX512-VNNI with int8 activations (llama.cpp's scheme for Q4_1).
//
//   g++ -O3 -march=native -fopenmp -o /tmp/q4_vnni bench/q4_vnni.cpp
//   OMP_NUM_THREADS=1 /tmp/q4_vnni 36 3072 576 20     # rows (a multiple of 6), outputs (of 32), k (of 32), repeats
//
// bf16-codes: the codes expanded to bf16 once (as `many_rows_codes` in kernels/.../linear_products.cpp reads them), bf16
// activations, `vdpbf16ps`, each group's sum folded with its scale and offset. vnni-u8: codes as bytes; activations
// quantized per row and group of 32 to int8 with one scale d_x; `vpdpbusd` sums code x int8 exactly in int32; the
// fold is scale * d_x * isum + offset * d_x * sum(q). vnni-packed: the same over nibbles unpacked in registers. The
// integer sums are exact, so a row's result would not depend on the rows beside it (route invariance). Printed:
// median times, the speedup over bf16-codes, and each path's relative error against float64 on exact weights.
// Measured 2026-11-24 (AMD EPYC, AVX512-VNNI and -BF16): 1.51-1.64x for vnni over bf16-codes at 6, 36 and 516 rows,
// one and two threads (36 x 3072 x 576, one thread: 653 us against 412 us); relative error 3.6e-3 against 1.5e-3.
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cmath>
#include <algorithm>

static uint16_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4); return (u + 0x7fff + ((u >> 16) & 1)) >> 16; }

constexpr int R = 6;  // rows per register block
constexpr int GK = 32;

// A: bf16 codes: per tile (32 outputs), per group, per kpair j (16): 2 vectors of 16 outputs x 2 k (bf16) = 64 u16
void bf16_path(const uint16_t* W, const float* scale, const float* offset, const uint16_t* x, const float* xs,
               int M, int N, int K, float* Y) {
  const int groups = K / GK, tiles = N / 32;
#pragma omp parallel for schedule(static)
  for (int tile = 0; tile < tiles; ++tile) {
    for (int r0 = 0; r0 < M; r0 += R) {
      __m512 y[R][2];
      for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm512_setzero_ps();
      for (int g = 0; g < groups; ++g) {
        const uint16_t* w = W + ((size_t)tile * groups + g) * 16 * 64;
        __m512 acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int j = 0; j < 16; ++j) {
          __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + 64 * j), w1 = (__m512bh)_mm512_loadu_si512(w + 64 * j + 32);
          for (int r = 0; r < R; ++r) {
            int32_t p; memcpy(&p, x + (size_t)(r0 + r) * K + g * GK + 2 * j, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(p);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
          }
        }
        const float* sc = scale + ((size_t)tile * groups + g) * 32;
        const float* of = offset + ((size_t)tile * groups + g) * 32;
        for (int t = 0; t < 2; ++t) {
          __m512 s = _mm512_loadu_ps(sc + 16 * t), o = _mm512_loadu_ps(of + 16 * t);
          for (int r = 0; r < R; ++r) {
            y[r][t] = _mm512_fmadd_ps(acc[r][t], s, y[r][t]);
            y[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xs[(size_t)(r0 + r) * groups + g]), o, y[r][t]);
          }
        }
      }
      for (int r = 0; r < R; ++r) { _mm512_storeu_ps(Y + (size_t)(r0 + r) * N + tile * 32, y[r][0]); _mm512_storeu_ps(Y + (size_t)(r0 + r) * N + tile * 32 + 16, y[r][1]); }
    }
  }
}

// B: u8 codes: per tile, per group, per k-quad q (8): 2 vectors of 16 outputs x 4 k (u8) = 128 bytes.
// Activations int8 per row [K], per (row, group) scale dx and dx * sum(q).
template <bool PACKED>
void vnni_path(const uint8_t* W, const float* scale, const float* offset, const int8_t* xq, const float* dx,
               const float* dxs, int M, int N, int K, float* Y) {
  const int groups = K / GK, tiles = N / 32;
  const __m512i low = _mm512_set1_epi8(0x0f);
#pragma omp parallel for schedule(static)
  for (int tile = 0; tile < tiles; ++tile) {
    for (int r0 = 0; r0 < M; r0 += R) {
      __m512 y[R][2];
      for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm512_setzero_ps();
      for (int g = 0; g < groups; ++g) {
        __m512i acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
        if (PACKED) {
          // 8 quads x 2 vectors x 64 bytes of u8 = 1024 codes -> 512 bytes packed: vector pair (q, q+4) share bytes
          const uint8_t* w = W + ((size_t)tile * groups + g) * 512;
          for (int q = 0; q < 4; ++q) {
            __m512i p0 = _mm512_loadu_si512(w + 128 * q), p1 = _mm512_loadu_si512(w + 128 * q + 64);
            __m512i wa0 = _mm512_and_si512(p0, low), wa1 = _mm512_and_si512(p1, low);
            __m512i wb0 = _mm512_and_si512(_mm512_srli_epi16(p0, 4), low), wb1 = _mm512_and_si512(_mm512_srli_epi16(p1, 4), low);
            for (int r = 0; r < R; ++r) {
              const int8_t* xr = xq + (size_t)(r0 + r) * K + g * GK;
              int32_t pa, pb; memcpy(&pa, xr + 4 * q, 4); memcpy(&pb, xr + 4 * (q + 4), 4);
              __m512i xa = _mm512_set1_epi32(pa), xb = _mm512_set1_epi32(pb);
              acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], wa0, xa);
              acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], wa1, xa);
              acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], wb0, xb);
              acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], wb1, xb);
            }
          }
        } else {
          const uint8_t* w = W + ((size_t)tile * groups + g) * 1024;
          for (int q = 0; q < 8; ++q) {
            __m512i w0 = _mm512_loadu_si512(w + 128 * q), w1 = _mm512_loadu_si512(w + 128 * q + 64);
            for (int r = 0; r < R; ++r) {
              int32_t p; memcpy(&p, xq + (size_t)(r0 + r) * K + g * GK + 4 * q, 4);
              __m512i xb = _mm512_set1_epi32(p);
              acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, xb);
              acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, xb);
            }
          }
        }
        const float* sc = scale + ((size_t)tile * groups + g) * 32;
        const float* of = offset + ((size_t)tile * groups + g) * 32;
        for (int t = 0; t < 2; ++t) {
          __m512 s = _mm512_loadu_ps(sc + 16 * t), o = _mm512_loadu_ps(of + 16 * t);
          for (int r = 0; r < R; ++r) {
            const size_t rg = (size_t)(r0 + r) * groups + g;
            __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][t]), _mm512_set1_ps(dx[rg]));
            y[r][t] = _mm512_fmadd_ps(a, s, y[r][t]);
            y[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(dxs[rg]), o, y[r][t]);
          }
        }
      }
      for (int r = 0; r < R; ++r) { _mm512_storeu_ps(Y + (size_t)(r0 + r) * N + tile * 32, y[r][0]); _mm512_storeu_ps(Y + (size_t)(r0 + r) * N + tile * 32 + 16, y[r][1]); }
    }
  }
}

int main(int argc, char** argv) {
  if (argc != 5) { fprintf(stderr, "usage: q4_vnni ROWS OUTPUTS K REPEATS\n"); return 2; }
  const int M = atoi(argv[1]), N = atoi(argv[2]), K = atoi(argv[3]), reps = atoi(argv[4]);
  if (M % R || N % 32 || K % GK || reps < 1) { fprintf(stderr, "rows: a multiple of 6; outputs, k: of 32\n"); return 2; }
  const int groups = K / GK, tiles = N / 32;
  srand(1);
  std::vector<uint8_t> codes((size_t)N * K);  // [n][k]
  for (auto& c : codes) c = rand() % 16;
  std::vector<float> sc((size_t)tiles * groups * 32), of(sc.size());
  for (auto& v : sc) v = 0.01f + (rand() % 100) * 1e-4f;
  for (auto& v : of) v = -0.1f + (rand() % 100) * 1e-3f;
  std::vector<float> x((size_t)M * K);
  for (auto& v : x) v = ((rand() % 2001) - 1000) * 1e-3f;
  // pack A
  std::vector<uint16_t> WA((size_t)tiles * groups * 16 * 64);
  for (int t = 0; t < tiles; ++t) for (int g = 0; g < groups; ++g) for (int j = 0; j < 16; ++j) for (int v = 0; v < 2; ++v) for (int o = 0; o < 16; ++o) for (int e = 0; e < 2; ++e)
    WA[(((size_t)t * groups + g) * 16 + j) * 64 + v * 32 + o * 2 + e] = f2bf((float)codes[(size_t)(t * 32 + v * 16 + o) * K + g * GK + 2 * j + e]);
  std::vector<uint8_t> WB((size_t)tiles * groups * 1024), WP((size_t)tiles * groups * 512);
  for (int t = 0; t < tiles; ++t) for (int g = 0; g < groups; ++g) for (int q = 0; q < 8; ++q) for (int v = 0; v < 2; ++v) for (int o = 0; o < 16; ++o) for (int e = 0; e < 4; ++e) {
    uint8_t c = codes[(size_t)(t * 32 + v * 16 + o) * K + g * GK + 4 * q + e];
    WB[((size_t)t * groups + g) * 1024 + q * 128 + v * 64 + o * 4 + e] = c;
    size_t pi = ((size_t)t * groups + g) * 512 + (q % 4) * 128 + v * 64 + o * 4 + e;
    if (q < 4) WP[pi] = (WP[pi] & 0xf0) | c; else WP[pi] = (WP[pi] & 0x0f) | (c << 4);
  }
  std::vector<uint16_t> xb((size_t)M * K); std::vector<float> xs((size_t)M * groups, 0.f);
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = f2bf(x[i]);
  std::vector<int8_t> xq((size_t)M * K); std::vector<float> dx((size_t)M * groups), dxs(dx.size());
  for (int r = 0; r < M; ++r) for (int g = 0; g < groups; ++g) {
    float amax = 0; for (int k = 0; k < GK; ++k) amax = std::max(amax, std::fabs(x[(size_t)r * K + g * GK + k]));
    float d = amax / 127.f, inv = d ? 1.f / d : 0.f; int s = 0; float fs = 0;
    for (int k = 0; k < GK; ++k) { int q = (int)std::nearbyint(x[(size_t)r * K + g * GK + k] * inv); xq[(size_t)r * K + g * GK + k] = q; s += q; uint32_t u = (uint32_t)xb[(size_t)r*K+g*GK+k] << 16; float bf; memcpy(&bf,&u,4); fs += bf; }
    dx[(size_t)r * groups + g] = d; dxs[(size_t)r * groups + g] = d * s; xs[(size_t)r * groups + g] = fs;
  }
  std::vector<float> YA((size_t)M * N), YB(YA.size()), YP(YA.size()), ref(YA.size());
  for (int r = 0; r < M; ++r) for (int n = 0; n < N; ++n) { double a = 0; int t = n / 32, o = n % 32;
    for (int k = 0; k < K; ++k) { int g = k / GK; a += (sc[((size_t)t*groups+g)*32+o] * codes[(size_t)n*K+k] + of[((size_t)t*groups+g)*32+o]) * x[(size_t)r*K+k]; }
    ref[(size_t)r*N+n] = a; }
  auto timeit = [&](auto f) { std::vector<double> ts; for (int i = 0; i < reps; ++i) { auto t0 = std::chrono::steady_clock::now(); f(); ts.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count()); } std::sort(ts.begin(), ts.end()); return ts[ts.size() / 2]; };
  double ta = 0, tb = 0, tp = 0;
  for (int round = 0; round < 3; ++round) {
    ta += timeit([&] { bf16_path(WA.data(), sc.data(), of.data(), xb.data(), xs.data(), M, N, K, YA.data()); });
    tb += timeit([&] { vnni_path<false>(WB.data(), sc.data(), of.data(), xq.data(), dx.data(), dxs.data(), M, N, K, YB.data()); });
    tp += timeit([&] { vnni_path<true>(WP.data(), sc.data(), of.data(), xq.data(), dx.data(), dxs.data(), M, N, K, YP.data()); });
  }
  double ea = 0, eb = 0, ep = 0, nr = 0;
  for (size_t i = 0; i < ref.size(); ++i) { ea += std::pow(YA[i] - ref[i], 2); eb += std::pow(YB[i] - ref[i], 2); ep += std::pow(YP[i]-ref[i],2); nr += ref[i] * ref[i]; }
  printf("M=%d N=%d K=%d  bf16-codes %.0f us  vnni-u8 %.0f us (%.2fx)  vnni-packed %.0f us (%.2fx)  rel.err bf16 %.2e vnni %.2e packed %.2e\n", M, N, K, ta / 3, tb / 3, ta / tb, tp / 3, ta / tp,
         std::sqrt(ea / nr), std::sqrt(eb / nr), std::sqrt(ep / nr));
}
