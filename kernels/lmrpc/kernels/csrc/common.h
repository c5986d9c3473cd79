// Shared helpers of lmrpc's CPU kernels: bf16 conversion, a deterministic vector exp, OpenMP partitioning.
//
// Every kernel here computes each output element with one fixed sequence of floating-point operations that depends
// only on that element's own inputs (its row, its weights, its context length), never on how many rows share the
// call or on how work is split between threads. That is what makes a request's numbers independent of its batch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define LMRPC_AVX512 1
#include <immintrin.h>
#else
#define LMRPC_AVX512 0
#endif
// AVX2 with FMA and F16C and no AVX512-BF16 (AMD Zen 2/3, older Xeons): the portable loops' operations, eight
// outputs per register (linear_kernels_avx2.h).
#if !LMRPC_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LMRPC_AVX2 1
#include <immintrin.h>
#else
#define LMRPC_AVX2 0
#endif
#if LMRPC_AVX512 && defined(__AVX512VNNI__)
#define LMRPC_VNNI 1
#else
#define LMRPC_VNNI 0
#endif

#include <omp.h>

// For the small helpers a kernel calls once per group (its scales and offsets): the compiler leaves some of them
// out of line, and a call each costs a few percent of a decode step.
#define LMRPC_INLINE inline __attribute__((always_inline))
// The same for a lambda (after its parameter list): the one-row kernels' folds, pieces and prefetches, which gcc left
// out of line.
#define LMRPC_LAMBDA_INLINE __attribute__((always_inline))
// A function kept out of its callers: rarely run code whose temporaries would take a hot loop's registers.
#define LMRPC_NOINLINE __attribute__((noinline))

namespace lmrpc {

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// IEEE half -> float (exact; subnormals and infinities kept).
inline float half_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does (NaN kept a quiet NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 88: 2^n * p(r) with n = round(x / ln2), r = x - n ln2 (two-step reduction), p a degree-6
// polynomial. The same operations in the scalar and vector forms, so both are deterministic.
inline float exp_scalar(float x) {
  x = std::fmax(x, -87.0f);
  x = std::fmin(x, 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693145751953125f, x);
  r = std::fma(n, -1.428606765330187e-06f, r);
  float p = 1.0f / 720.0f;
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t e = static_cast<int32_t>(n) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if LMRPC_AVX512
inline __m512 exp_vec(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// 16 halves (32 bytes) -> 16 floats.
inline __m512 load_halfx16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 bf16 values (32 bytes) -> 16 floats.
inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}

// Sum of 16 lanes in a fixed order (halves added pairwise).
inline float reduce_add(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
#endif

#if LMRPC_AVX2
// exp_scalar's operations on 8 lanes.
inline __m256 exp_vec8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// The same pairwise lane reduction as reduce_add, on 16 scalars.
inline float reduce_add16(const float* v) {
  float a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
  const float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}

// Rounds n floats to bf16 as f32_to_bf16 does: their codes into `out`, and x becomes the values the codes stand for.
// `stream`: the codes go to memory without first reading their cache lines (non-temporal stores; the caller fences
// before another thread reads them). Same bits either way.
inline void round_to_bf16(float* x, uint16_t* out, int64_t n, bool stream) {
  int64_t j = 0;
#if LMRPC_AVX512
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x40);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  stream = stream && reinterpret_cast<uintptr_t>(out) % 32 == 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i bits = _mm512_loadu_si512(x + j);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i even = _mm512_add_epi32(half, _mm512_and_si512(high, one));  // ties to even
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, even), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, magnitude), inf);
    const __m512i code = _mm512_mask_or_epi32(rounded, nan, high, quiet);  // NaN: kept, made quiet
    __m256i* to = reinterpret_cast<__m256i*>(out + j);
    const __m256i codes = _mm512_cvtepi32_epi16(code);
    if (stream) _mm256_stream_si256(to, codes); else _mm256_storeu_si256(to, codes);
    _mm512_storeu_si512(x + j, _mm512_slli_epi32(code, 16));
  }
#else
  (void)stream;
#endif
  for (; j < n; ++j) {
    out[j] = f32_to_bf16(x[j]);
    x[j] = bf16_to_f32(out[j]);
  }
}

// 1 / sqrt(mean(x^2) + eps) over k values, the squares summed in 16 lanes then pairwise.
inline float row_inv_rms(const float* x, int64_t k, float eps) {
#if LMRPC_AVX512
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  if (j < k) {
    const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (k - j)) - 1), x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float ss = reduce_add(acc);
#else
  float lanes[16] = {0};
  int64_t j = 0;
#if LMRPC_AVX2
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7 and 8-15
  for (; j + 16 <= k; j += 16) {
    const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + 8);
    lo = _mm256_fmadd_ps(a, a, lo);
    hi = _mm256_fmadd_ps(b, b, hi);
  }
  _mm256_storeu_ps(lanes, lo);
  _mm256_storeu_ps(lanes + 8, hi);
#endif
  for (; j < k; ++j) lanes[j % 16] = std::fma(x[j], x[j], lanes[j % 16]);
  const float ss = reduce_add16(lanes);
#endif
  return 1.0f / std::sqrt(ss * (1.0f / static_cast<float>(k)) + eps);
}

// Scratch memory aligned to a cache line: 64-byte vectors stored to and loaded from it never straddle two lines
// (a split store defeats store-to-load forwarding, and the kernels reload what they just wrote).
template <typename T>
class AlignedBuffer {
 public:
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  size_t size() const { return size_; }
  // At least n elements (contents not kept), zero-filled when asked.
  void resize(size_t n, bool zero = false) {
    if (n > capacity_) {
      const size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
      data_.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
      capacity_ = bytes / sizeof(T);
    }
    size_ = n;
    if (zero) std::memset(static_cast<void*>(data_.get()), 0, n * sizeof(T));
  }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  size_t size_ = 0, capacity_ = 0;
};

// [begin, end) of part `index` when `total` items are split into `parts` contiguous parts.
inline void split_range(int64_t total, int parts, int index, int64_t* begin, int64_t* end) {
  const int64_t base = total / parts, extra = total % parts;
  *begin = index * base + (index < extra ? index : extra);
  *end = *begin + base + (index < extra ? 1 : 0);
}

}  // namespace lmrpc
