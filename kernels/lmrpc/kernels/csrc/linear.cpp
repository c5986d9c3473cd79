// Row-invariant products over packed weights (see linear.h for the layout).
//
// Work is split by output tiles (and by rows, when a product has few tiles: job_items), never along k: each output
// element of each row is accumulated by one thread, over its groups in order, each group over its kpairs in order
// (even and odd kpairs in two sums, added at the group's end). Rows are processed in blocks of up to 6 that share
// weight loads, but a row's operations do not depend on its block, so a row gives the same bits alone or among any
// number of rows.
//
// This file: the inputs (prologues, rounding) and the public functions; linear_products.cpp: the products and the
// work split; linear_kernels.h: the micro-kernels; linear_int8.cpp: int8 activations; linear_int16.cpp: AVX2's int16
// activations; linear_impl.h: the rest.
#include "linear.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "common.h"
#include "linear_impl.h"

namespace lmrpc {

namespace linear_detail {
namespace {

// ---- prologue: input rows -> rounded (bf16) or float32 rows of k_pad, and per-group sums --------------------

inline float silu_mul(float g, float u) { return g / (1.0f + exp_scalar(-g)) * u; }

// One input row after its prologue, float32, into `out` [k] (the caller pads).
void prologue_row(const LinearArgs& a, int64_t i, int64_t k, float* out) {
  const float* x = a.x + (a.x_rows != nullptr ? a.x_rows[i] : i) * a.x_stride;
  switch (a.prologue) {
    case Prologue::NONE:
      std::memcpy(out, x, k * sizeof(float));
      break;
    case Prologue::RMS_NORM: {
      const float inv = row_inv_rms(x, k, a.eps);
      for (int64_t j = 0; j < k; ++j) out[j] = x[j] * inv * a.norm_weight[j];
      break;
    }
    case Prologue::SILU_MUL: {
      const float* up = x + k;
      int64_t j = 0;
#if LMRPC_AVX512
      for (; j + 16 <= k; j += 16) {
        const __m512 g = _mm512_loadu_ps(x + j);
        const __m512 e = exp_vec(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(out + j, _mm512_mul_ps(s, _mm512_loadu_ps(up + j)));
      }
#elif LMRPC_AVX2
      for (; j + 8 <= k; j += 8) {
        const __m256 g = _mm256_loadu_ps(x + j);
        const __m256 e = exp_vec8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(s, _mm256_loadu_ps(up + j)));
      }
#endif
      for (; j < k; ++j) out[j] = silu_mul(x[j], up[j]);
      break;
    }
  }
}

// Whether a product takes int8 activations: Q4 weights made for them (PackedWeight::int8), except after SILU_MUL, whose inputs (the
// MLP's gated activations) have outliers that int8 with one scale per 32 rounds away (measured on SmolLM2 by
// tests/unit/test_int4_quality.py: int8 there too gave top-1 agreement 310/320 and perplexity +1.1%; without,
// 312/320 and -0.2%; bf16 everywhere 319/320). Fixed per weight and call site, never by the number of rows.
inline bool int8_inputs(const PackedWeight& w, const LinearArgs& a) {
  return w.int8 && a.prologue != Prologue::SILU_MUL;
}

// One row (float32, k_pad after its prologue) -> int8 codes (kI8Width bytes per input), and per group d and
// d * sum(q).
void quantize_row(const float* row, int64_t kp, int8_t* q, float* d, float* dsum) {
  for (int64_t g = 0; g < kp / 32; ++g) {
    const float* x = row + 32 * g;
#if LMRPC_AVX2
    // The loop below, 8 at a time: max is exact in any order, the product and round-to-nearest-even are the same
    // operations, the sum is of integers. So the same bits (a decode step quantizes a row per product).
    {
      const float amax = group_amax32(x);
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      __m256i v[4];
      __m256i total = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), _mm256_set1_ps(inv)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v[j] = _mm256_cvtps_epi32(r);
        total = _mm256_add_epi32(total, v[j]);
      }
      // int32 -> int8 in order: packs interleave the 128-bit halves, the permute puts them back.
      const __m256i w16 = _mm256_packs_epi32(v[0], v[1]), x16 = _mm256_packs_epi32(v[2], v[3]);
      const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, x16),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      const __m256i lo = _mm256_unpacklo_epi16(b8, b8), hi = _mm256_unpackhi_epi16(b8, b8);  // pairs doubled
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * g), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * g + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
      alignas(32) int32_t sums[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), total);
      int sum = 0;
      for (int32_t s : sums) sum += s;
      d[g] = amax / 127.0f;
      dsum[g] = d[g] * static_cast<float>(sum);
      continue;
    }
#endif
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(x[j] * inv));
      q[32 * g + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[g] = scale;
    dsum[g] = scale * static_cast<float>(sum);
  }
}

void prepare_inputs(const PackedWeight& w, Compute compute, const LinearArgs& a, Inputs* in) {
  const int64_t k = w.k, kp = w.k_pad, groups = w.k_pad / w.group;
  const bool int8 = int8_inputs(w, a);
  in->int8 = int8;
#if LMRPC_AVX2
  const bool int16 = w.int16;
#else
  const bool int16 = false;
#endif
  in->int16 = int16;
  // Not zero-filled: every row is written whole below, its padding included (a serial memset of every row was 3%
  // of a prefill step).
  // Integer activations come in groups of 32 inputs whatever the weight's groups (Q6_K's are 16).
  const int64_t qgroups = kp / 32;
  if (int8 || int16) {
    if (int8) in->i8.resize(a.m * kp * kI8Width); else in->i16.resize(a.m * kp);
    in->d.resize(a.m * qgroups);
    in->dsum.resize(a.m * qgroups);
  } else if (compute == Compute::BF16) {
    in->bf16.resize(a.m * kp);
  } else {
    in->f32.resize(a.m * kp);
  }
  if (w.has_offsets() && !int8 && !int16) in->sums.resize(a.m * groups);
  const int64_t parts = a.m >= 8 ? omp_get_max_threads() : 1;
  // Many rows: the bf16 codes bypass the caches on their way out. Between two products the previous one's weights
  // have evicted this buffer, so ordinary stores would first wait on each line's old contents from memory: in a
  // 32-stream decode step, perf put most of the prologue's samples behind them. Interleaved step by step, decode
  // steps were up to 0.5% faster on a quiet host and 5-7% in a run with a busy one; prefill unchanged. A few rows
  // stay in cache for the products that read them next.
  const bool stream = parts > 1;
#pragma omp parallel num_threads(parts) if (parts > 1)
  {
    thread_local AlignedBuffer<float> buffer;  // one row after its prologue; kept between calls (no malloc each)
    buffer.resize(kp);
    float* row = buffer.data();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < a.m; ++i) {
      std::fill(row + k, row + kp, 0.0f);
      prologue_row(a, i, k, row);
      if (int8) {
        quantize_row(row, kp, in->i8.data() + i * kp * kI8Width, in->d.data() + i * qgroups,
                     in->dsum.data() + i * qgroups);
        continue;
      }
#if LMRPC_AVX2
      if (int16) {
        quantize_row_int16(row, kp, in->i16.data() + i * kp, in->d.data() + i * qgroups,
                           in->dsum.data() + i * qgroups);
        continue;
      }
#endif
      if (compute == Compute::BF16) {
        // The padding is zeros, so its codes are too; `row` becomes the values the products see (for the sums).
        round_to_bf16(row, in->bf16.data() + i * kp, kp, stream);
      } else {
        std::memcpy(in->f32.data() + i * kp, row, kp * sizeof(float));  // with its zero padding
      }
      if (w.has_offsets()) {
        for (int64_t g = 0; g < groups; ++g) {
          float sum = 0.0f;
          for (int64_t j = g * w.group; j < (g + 1) * w.group; ++j) sum += row[j];
          in->sums.data()[i * groups + g] = sum;
        }
      }
    }
#if LMRPC_AVX512
    if (stream) _mm_sfence();  // the streamed codes reach memory before the products (other threads) read them
#endif
  }
}

// W[n, k], dequantized, read from the packed weight (weight_rows): q * scale + offset, as gguf's dequantize
// computes it (Q4_0: (q - 8) * scale).
float weight_value(const PackedWeight& w, int64_t n, int64_t k) {
  const int64_t pair = n / 32, t = (n / 16) % 2, o = n % 16, kp = w.k_pad / 2, groups = w.k_pad / w.group;
  const int64_t j = k / 2, lane = 2 * o + k % 2, g = k / w.group;
  const int64_t vector = (pair * kp + j) * 2 + t;
  switch (w.format) {
    case WeightFormat::F32:
      return static_cast<const float*>(w.data)[vector * 32 + lane];
    case WeightFormat::BF16:
      return bf16_to_f32(static_cast<const uint16_t*>(w.data)[vector * 32 + lane]);
    case WeightFormat::Q8:
    case WeightFormat::Q6:
    case WeightFormat::Q3:
    case WeightFormat::Q5:
    case WeightFormat::Q4: {
      int q;
      if (w.format == WeightFormat::Q8) {
        q = static_cast<const int8_t*>(w.data)[vector * 32 + lane];
      } else if (w.format == WeightFormat::Q6) {
        q = q6_code(q6_group(w, vector), static_cast<int>(vector % 4), lane);
      } else if (w.format == WeightFormat::Q3) {
        const int stored = word_code<3>(word_group<3>(w, vector), static_cast<int>(vector % 16), lane);
        q = w.code_table ? w.code_values[stored] : stored - 4;
      } else if (w.format == WeightFormat::Q5) {
        q = word_code<5>(word_group<5>(w, vector), static_cast<int>(vector % 16), lane) - (w.q4_signed ? 16 : 0);
      } else if (w.codes_in_vnni_order()) {  // (linear.h: PackedWeight::vnni)
        const int64_t kg = k % 32, e = kg % 4, quad = (kg % 16) / 4;
        const uint8_t byte = w.vnni[(pair * groups + g) * 512 + (quad * 2 + t) * 64 + 4 * o + e];
        q = q4_code_value(kg < 16 ? byte & 15 : byte >> 4, w);
      } else {
        const int64_t jg = j % 16;
        const uint8_t byte =
            static_cast<const uint8_t*>(w.data)[((pair * groups + g) * 2 + t) * 256 + 32 * (jg / 2) + lane];
        q = q4_code_value(jg % 2 == 0 ? byte & 15 : byte >> 4, w);
      }
      const GroupWeights gw = group_weights(w, pair, groups, g, nullptr);
      const int l = static_cast<int>(16 * t + o);
      const float v = static_cast<float>(q) * lane_scale(gw, l);
      if (w.ks.d_scale != 1.0f) return v * w.ks.d_scale;  // (K scales without offsets only)
      return gw.has_offset() ? v + lane_offset(gw, l) : v;
    }
  }
  return 0.0f;
}

}  // namespace
}  // namespace linear_detail

using namespace linear_detail;

void linear(const PackedWeight& w, Compute compute, const LinearArgs& args) {
  const LinearJob job{&w, args};
  linear_batch(&job, 1, compute);
}

void linear_batch(const LinearJob* jobs, int64_t count, Compute compute) {
  // Kept between calls, per thread: a step makes hundreds of these calls, each would otherwise allocate them.
  thread_local std::vector<LinearJob> work;  // the jobs with rows
  thread_local std::vector<Inputs> in;
  work.clear();
  for (int64_t j = 0; j < count; ++j) {
    if (jobs[j].args.m > 0) work.push_back(jobs[j]);
  }
  if (work.empty()) return;
  if (in.size() < work.size()) in.resize(work.size());
  for (size_t j = 0; j < work.size(); ++j) prepare_inputs(*work[j].w, compute, work[j].args, &in[j]);
  const int64_t n = static_cast<int64_t>(work.size());
  if (compute == Compute::BF16) products<uint16_t>(work.data(), in.data(), n); else products<float>(work.data(), in.data(), n);
}

void weight_rows(const PackedWeight& w, const int64_t* ids, int64_t count, float* out, int64_t out_stride) {
  for (int64_t i = 0; i < count; ++i)
    for (int64_t k = 0; k < w.k; ++k) out[i * out_stride + k] = weight_value(w, ids[i], k);
}

void expand_codes(const PackedWeight& w, uint16_t* out) {
  const int64_t kp = w.k_pad / 2, groups = w.k_pad / w.group, gkp = w.group / 2, pairs = w.n_pad / 32;
  const Q4Table table(w);
  for (int64_t p = 0; p < pairs; ++p) {
    ExpandSource<uint16_t>{PairIndex{&w, p, groups, gkp, kp}, &table, out + p * kp * 64}.expand_all();
  }
}

bool native_bf16() { return LMRPC_AVX512 != 0; }
bool native_avx2() { return LMRPC_AVX2 != 0; }
bool native_vnni() { return LMRPC_VNNI != 0; }

}  // namespace lmrpc
