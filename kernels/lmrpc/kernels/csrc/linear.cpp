// Row-invariant products over packed weights (see linear.h for the layout).
//
// Work is split by output tiles (and by rows, when a product has few tiles: job_items), never along k: each output
// element of each row is accumulated by one thread, over its groups in order, each group over its kpairs in order
// (even and odd kpairs in two sums, added at the group's end). Rows are processed in blocks of up to 6 that share
// weight loads, but a row's operations do not depend on its block, so a row gives the same bits alone or among any
// number of rows.
#include "linear.h"

#include <algorithm>
#include <vector>

#include "common.h"

namespace lmrpc {

namespace {

constexpr int kMaxRows = 6;  // rows per register block (at most)

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
#endif
      for (; j < k; ++j) out[j] = silu_mul(x[j], up[j]);
      break;
    }
  }
}

// The rows as the products read them: xq [m][k_pad] (uint16 bf16 or float), and group sums [m][groups] of the
// values as rounded (only for weights with offsets).
struct Inputs {
  AlignedBuffer<uint16_t> bf16;
  AlignedBuffer<float> f32;
  AlignedBuffer<float> sums;
  // Q4 weights with int8 activations (PackedWeight::vnni): per row and group of 32, d = max |x| / 127 and
  // q = round(x / d) in int8 [m][k_pad]; d [m][groups] and d * sum(q) [m][groups].
  AlignedBuffer<int8_t> i8;
  AlignedBuffer<float> d;
  AlignedBuffer<float> dsum;
  bool int8 = false;  // the rows are in i8/d/dsum (else bf16/f32 and sums)
};

// Whether a product takes int8 activations: Q4 weights with VNNI codes, except after SILU_MUL, whose inputs (the
// MLP's gated activations) have outliers that int8 with one scale per 32 rounds away (measured on SmolLM2 by
// tests/unit/test_int4_quality.py: int8 there too gave top-1 agreement 310/320 and perplexity +1.1%; without,
// 312/320 and -0.2%; bf16 everywhere 319/320). Fixed per weight and call site, never by the number of rows.
inline bool int8_inputs(const PackedWeight& w, const LinearArgs& a) {
  return w.vnni != nullptr && a.prologue != Prologue::SILU_MUL;
}

// One row (float32, k_pad after its prologue) -> int8 codes, and per group d and d * sum(q).
void quantize_row(const float* row, int64_t kp, int8_t* q, float* d, float* dsum) {
  for (int64_t g = 0; g < kp / 32; ++g) {
    const float* x = row + 32 * g;
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
  if (int8) {
    in->i8.resize(a.m * kp, true);
    in->d.resize(a.m * groups, true);
    in->dsum.resize(a.m * groups, true);
  } else if (compute == Compute::BF16) {
    in->bf16.resize(a.m * kp, true);
  } else {
    in->f32.resize(a.m * kp, true);
  }
  if (w.offset != nullptr && !int8) in->sums.resize(a.m * groups, true);
  const int64_t parts = a.m >= 8 ? omp_get_max_threads() : 1;
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
        quantize_row(row, kp, in->i8.data() + i * kp, in->d.data() + i * groups, in->dsum.data() + i * groups);
        continue;
      }
      if (compute == Compute::BF16) {
        uint16_t* out = in->bf16.data() + i * kp;
        for (int64_t j = 0; j < k; ++j) {
          out[j] = f32_to_bf16(row[j]);
          row[j] = bf16_to_f32(out[j]);  // the value the products see, for the group sums
        }
      } else {
        std::memcpy(in->f32.data() + i * kp, row, k * sizeof(float));
      }
      if (w.offset != nullptr) {
        for (int64_t g = 0; g < groups; ++g) {
          float sum = 0.0f;
          for (int64_t j = g * w.group; j < (g + 1) * w.group; ++j) sum += row[j];
          in->sums.data()[i * groups + g] = sum;
        }
      }
    }
  }
}

// ---- quantized codes -> one group of a tile pair as kpair vectors ([kpairs][2 tiles][16 outputs][2]) ----------

inline int q4_value(uint8_t code, bool is_signed) { return is_signed ? static_cast<int>(code) - 8 : code; }

// bf16 values of the 16 codes (twice, to fill a 32-entry permute table).
struct Q4Table {
  alignas(64) uint16_t bf16[32];
  explicit Q4Table(bool is_signed) {
    for (int q = 0; q < 32; ++q) bf16[q] = f32_to_bf16(static_cast<float>(q4_value(q & 15, is_signed)));
  }
};

constexpr int kPrefetchGroups = 4;  // Q4 groups read ahead (2 KiB): codes stream from memory as they are expanded

// A Q4 group of a tile pair (2 x 256 bytes: per tile 8 chunks of 32, chunk c holding kpair 2c in its low nibbles
// and kpair 2c + 1 in its high nibbles) -> 16 kpairs x 2 tiles x 32 values.
template <typename T>
void expand_q4(const uint8_t* src, bool is_signed, const Q4Table& table, T* dst) {
#if LMRPC_AVX512
  for (int line = 0; line < 8; ++line) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchGroups * 512 + 64 * line),
                                                    _MM_HINT_T0);
  if constexpr (sizeof(T) == 2) {
    const __m512i lut = _mm512_load_si512(table.bf16);
    const __m512i low = _mm512_set1_epi16(0x0f);
    for (int t = 0; t < 2; ++t) {
      for (int c = 0; c < 8; ++c) {
        const __m512i words = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 256 * t + 32 * c)));
        _mm512_storeu_si512(dst + 32 * (4 * c + t), _mm512_permutexvar_epi16(_mm512_and_si512(words, low), lut));
        _mm512_storeu_si512(dst + 32 * (4 * c + 2 + t), _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), lut));
      }
    }
    return;
  } else {
    const __m512i bias = _mm512_set1_epi32(is_signed ? 8 : 0);
    const __m512i low = _mm512_set1_epi32(0x0f);
    for (int t = 0; t < 2; ++t) {
      for (int c = 0; c < 8; ++c) {
        for (int h = 0; h < 2; ++h) {
          const __m512i v = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 256 * t + 32 * c + 16 * h)));
          const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(v, low), bias);
          const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(v, 4), bias);
          _mm512_storeu_ps(dst + 32 * (4 * c + t) + 16 * h, _mm512_cvtepi32_ps(lo));
          _mm512_storeu_ps(dst + 32 * (4 * c + 2 + t) + 16 * h, _mm512_cvtepi32_ps(hi));
        }
      }
    }
    return;
  }
#endif
  for (int t = 0; t < 2; ++t) {
    for (int c = 0; c < 8; ++c) {
      for (int b = 0; b < 32; ++b) {
        const uint8_t byte = src[256 * t + 32 * c + b];
        if constexpr (sizeof(T) == 2) {
          dst[32 * (4 * c + t) + b] = table.bf16[byte & 15];
          dst[32 * (4 * c + 2 + t) + b] = table.bf16[byte >> 4];
        } else {
          dst[32 * (4 * c + t) + b] = static_cast<float>(q4_value(byte & 15, is_signed));
          dst[32 * (4 * c + 2 + t) + b] = static_cast<float>(q4_value(byte >> 4, is_signed));
        }
      }
    }
  }
}

// Q8 vectors (32 int8 each: one kpair of one tile) -> vectors of 32 values.
template <typename T>
void expand_q8(const int8_t* src, int64_t vectors, T* dst) {
  for (int64_t j = 0; j < vectors; ++j) {
    const int8_t* s = src + 32 * j;
    T* d = dst + 32 * j;
#if LMRPC_AVX512
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16))));
    if constexpr (sizeof(T) == 2) {
      _mm512_storeu_si512(d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    } else {
      _mm512_storeu_ps(d, lo);
      _mm512_storeu_ps(d + 16, hi);
    }
#else
    for (int b = 0; b < 32; ++b) {
      if constexpr (sizeof(T) == 2) d[b] = f32_to_bf16(static_cast<float>(s[b])); else d[b] = static_cast<float>(s[b]);
    }
#endif
  }
}

// ---- where a tile pair's weights come from, one group at a time ----------------------------------------------
// Each source yields, for group g, the pair's kpairs ([kpairs][2 tiles][32] values) and scales and offsets
// ([2 tiles][16] each).

struct GroupWeights {
  const void* w;        // [kpairs][2][32] values
  const uint16_t* scale;   // fp16 [2][16], or null (dense)
  const uint16_t* offset;  // fp16 [2][16], or null
};

// Offsets of tile pair p, group g in the packed arrays.
struct PairIndex {
  const PackedWeight* w;
  int64_t pair, groups, gkp, kp;
  int64_t scales(int64_t g) const { return (pair * groups + g) * 32; }
  int64_t q4_bytes(int64_t g) const { return (pair * groups + g) * 512; }
  int64_t vectors(int64_t g) const { return (pair * kp + g * gkp) * 2; }  // kpair vectors of 32 values
};

// Dense weights: pointers into the packed data.
template <typename T>
struct DenseSource {
  PairIndex at;
  GroupWeights group(int64_t g) const {
    return {static_cast<const T*>(at.w->data) + at.vectors(g) * 32, nullptr, nullptr};
  }
};

// Quantized weights, expanded a group at a time into a small buffer (few rows: one row block reads them), or all
// groups at once (many rows: every row block reads them).
template <typename T>
struct ExpandSource {
  PairIndex at;
  const Q4Table* table;
  T* buffer;  // two slots of [gkp][2][32] (group by group; slot g % 2) or [kp][2][32] (all)

  void expand(int64_t g, T* dst) const {
    const PackedWeight& w = *at.w;
    if (w.format == WeightFormat::Q4) {
      expand_q4<T>(static_cast<const uint8_t*>(w.data) + at.q4_bytes(g), w.q4_signed, *table, dst);
    } else {
      expand_q8<T>(static_cast<const int8_t*>(w.data) + at.vectors(g) * 32, 2 * at.gkp, dst);
    }
  }
  GroupWeights group(int64_t g) const {
    T* slot = buffer + (g % 2) * at.gkp * 64;
    expand(g, slot);
    return {slot, at.w->scale + at.scales(g), at.w->offset != nullptr ? at.w->offset + at.scales(g) : nullptr};
  }
  void expand_all() const {
    for (int64_t g = 0; g < at.groups; ++g) expand(g, buffer + g * at.gkp * 64);
  }
};

// Quantized weights already expanded by ExpandSource::expand_all.
template <typename T>
struct ExpandedSource {
  PairIndex at;
  const T* all;  // [kp][2][32]
  GroupWeights group(int64_t g) const {
    return {all + g * at.gkp * 64, at.w->scale + at.scales(g),
            at.w->offset != nullptr ? at.w->offset + at.scales(g) : nullptr};
  }
};

// Quantized weights whose codes were expanded once, when the weight was made (PackedWeight::codes).
struct CodesSource {
  PairIndex at;
  GroupWeights group(int64_t g) const {
    return {at.w->codes + at.vectors(g) * 32, at.w->scale + at.scales(g),
            at.w->offset != nullptr ? at.w->offset + at.scales(g) : nullptr};
  }
};

float weight_value(const PackedWeight& w, int64_t n, int64_t k) {
  const int64_t pair = n / 32, t = (n / 16) % 2, o = n % 16, kp = w.k_pad / 2, groups = w.k_pad / w.group;
  const int64_t j = k / 2, lane = 2 * o + k % 2, g = k / w.group;
  const int64_t vector = (pair * kp + j) * 2 + t, scale = (pair * groups + g) * 32 + 16 * t + o;
  switch (w.format) {
    case WeightFormat::F32:
      return static_cast<const float*>(w.data)[vector * 32 + lane];
    case WeightFormat::BF16:
      return bf16_to_f32(static_cast<const uint16_t*>(w.data)[vector * 32 + lane]);
    case WeightFormat::Q8:
      return static_cast<float>(static_cast<const int8_t*>(w.data)[vector * 32 + lane]) * half_to_f32(w.scale[scale]);
    case WeightFormat::Q4: {
      const int64_t jg = j % 16;
      const uint8_t byte = static_cast<const uint8_t*>(w.data)[((pair * groups + g) * 2 + t) * 256 + 32 * (jg / 2) + lane];
      const int q = q4_value(jg % 2 == 0 ? byte & 15 : byte >> 4, w.q4_signed);
      const float m = w.offset != nullptr ? half_to_f32(w.offset[scale]) : 0.0f;
      return std::fma(static_cast<float>(q), half_to_f32(w.scale[scale]), m);
    }
  }
  return 0.0f;
}

// ---- micro-kernels: R rows x P tile pairs over every group -------------------------------------------------------
// Per row and output: for each group in order, its kpairs summed in order (one running sum a), then
// Y = fma(a, scale, Y) and Y = fma(group sum of x, offset, Y) when quantized; dense weights are one group, Y = a.
// R and P only choose how many sums run side by side in registers: they never change a sum's operations.

constexpr int kMaxPairs = 2;

// The rows [begin, end) of a product that one work item computes.
struct RowRange {
  int64_t begin, end;
  int64_t size() const { return end - begin; }
};

struct RowBlock {
  const void* x[kMaxRows];      // each row's inputs ([k_pad] bf16 or float)
  const float* sums[kMaxRows];  // each row's group sums [groups], or null
  float* out[kMaxRows];         // each row's results [P * 32]
};

#if LMRPC_AVX512
template <int R, int P, bool Q>
inline void fold_group(__m512 (&Y)[R][2 * P], const __m512 (&acc)[R][2 * P], const GroupWeights (&gw)[P],
                       const RowBlock& rb, int64_t g) {
  for (int q = 0; q < P; ++q)
    for (int t = 0; t < 2; ++t) {
      const int i = 2 * q + t;
      if constexpr (Q) {
        const __m512 s = load_halfx16(gw[q].scale + 16 * t);
        for (int r = 0; r < R; ++r) Y[r][i] = _mm512_fmadd_ps(acc[r][i], s, Y[r][i]);
        if (gw[q].offset != nullptr) {
          const __m512 o = load_halfx16(gw[q].offset + 16 * t);
          for (int r = 0; r < R; ++r) Y[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(rb.sums[r][g]), o, Y[r][i]);
        }
      } else {
        for (int r = 0; r < R; ++r) Y[r][i] = acc[r][i];
      }
    }
}

template <int R, int P, bool Q, typename Source>
void block_bf16(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  __m512 Y[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P; ++i) Y[r][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    GroupWeights gw[P];
    for (int q = 0; q < P; ++q) gw[q] = src[q].group(g);
    __m512 acc[R][2 * P];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2 * P; ++i) acc[r][i] = _mm512_setzero_ps();
    const int64_t k0 = 2 * g * gkp;
    for (int64_t j = 0; j < gkp; ++j) {
      __m512bh wv[2 * P];
      for (int q = 0; q < P; ++q)
        for (int t = 0; t < 2; ++t) {
          wv[2 * q + t] = reinterpret_cast<__m512bh>(
              _mm512_loadu_si512(static_cast<const uint16_t*>(gw[q].w) + 64 * j + 32 * t));
        }
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, static_cast<const uint16_t*>(rb.x[r]) + k0 + 2 * j, 4);
        const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        for (int i = 0; i < 2 * P; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv[i], xb);
      }
    }
    fold_group<R, P, Q>(Y, acc, gw, rb, g);
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P; ++i) _mm512_storeu_ps(rb.out[r] + 16 * i, Y[r][i]);
}

template <int R, int P, bool Q, typename Source>
void block_f32(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512 Y[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P; ++i) Y[r][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    GroupWeights gw[P];
    for (int q = 0; q < P; ++q) gw[q] = src[q].group(g);
    // [row][tile][half]: outputs 0-7 or 8-15 of the tile, as (output, even/odd input) lane pairs
    __m512 acc[R][2 * P][2];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2 * P; ++i) acc[r][i][0] = acc[r][i][1] = _mm512_setzero_ps();
    const int64_t k0 = 2 * g * gkp;
    for (int64_t j = 0; j < gkp; ++j) {
      __m512 wv[2 * P][2];
      for (int q = 0; q < P; ++q)
        for (int t = 0; t < 2; ++t)
          for (int h = 0; h < 2; ++h)
            wv[2 * q + t][h] = _mm512_loadu_ps(static_cast<const float*>(gw[q].w) + 64 * j + 32 * t + 16 * h);
      for (int r = 0; r < R; ++r) {
        double pair;
        std::memcpy(&pair, static_cast<const float*>(rb.x[r]) + k0 + 2 * j, 8);
        const __m512 xb = _mm512_castpd_ps(_mm512_set1_pd(pair));
        for (int i = 0; i < 2 * P; ++i)
          for (int h = 0; h < 2; ++h) acc[r][i][h] = _mm512_fmadd_ps(wv[i][h], xb, acc[r][i][h]);
      }
    }
    __m512 sum[R][2 * P];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2 * P; ++i) {
        sum[r][i] = _mm512_add_ps(_mm512_permutex2var_ps(acc[r][i][0], even, acc[r][i][1]),
                                  _mm512_permutex2var_ps(acc[r][i][0], odd, acc[r][i][1]));
      }
    fold_group<R, P, Q>(Y, sum, gw, rb, g);
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P; ++i) _mm512_storeu_ps(rb.out[r] + 16 * i, Y[r][i]);
}
#else
template <int R, int P, bool Q>
inline void fold_group_scalar(float (&Y)[R][32 * P], const float (&a)[R][32 * P], const GroupWeights (&gw)[P],
                              const RowBlock& rb, int64_t g) {
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q)
      for (int l = 0; l < 32; ++l) {
        float& y = Y[r][32 * q + l];
        if constexpr (Q) {
          y = std::fma(a[r][32 * q + l], half_to_f32(gw[q].scale[l]), y);
          if (gw[q].offset != nullptr) y = std::fma(rb.sums[r][g], half_to_f32(gw[q].offset[l]), y);
        } else {
          y = a[r][32 * q + l];
        }
      }
}

template <int R, int P, bool Q, typename Source>
void block_bf16(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  float Y[R][32 * P] = {};
  for (int64_t g = 0; g < groups; ++g) {
    GroupWeights gw[P];
    for (int q = 0; q < P; ++q) gw[q] = src[q].group(g);
    float acc[R][32 * P] = {};  // [row][pair, tile, output]
    const int64_t k0 = 2 * g * gkp;
    for (int64_t j = 0; j < gkp; ++j)
      for (int r = 0; r < R; ++r) {
        const uint16_t* x = static_cast<const uint16_t*>(rb.x[r]) + k0 + 2 * j;
        const float x0 = bf16_to_f32(x[0]), x1 = bf16_to_f32(x[1]);
        for (int q = 0; q < P; ++q)
          for (int l = 0; l < 32; ++l) {  // l = 16 * tile + output
            const uint16_t* w = static_cast<const uint16_t*>(gw[q].w) + 64 * j + 32 * (l / 16) + 2 * (l % 16);
            const float v = std::fma(x0, bf16_to_f32(w[0]), acc[r][32 * q + l]);
            acc[r][32 * q + l] = std::fma(x1, bf16_to_f32(w[1]), v);
          }
      }
    fold_group_scalar<R, P, Q>(Y, acc, gw, rb, g);
  }
  for (int r = 0; r < R; ++r) std::memcpy(rb.out[r], Y[r], sizeof(Y[r]));
}

template <int R, int P, bool Q, typename Source>
void block_f32(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  float Y[R][32 * P] = {};
  for (int64_t g = 0; g < groups; ++g) {
    GroupWeights gw[P];
    for (int q = 0; q < P; ++q) gw[q] = src[q].group(g);
    float acc[R][64 * P] = {};  // [row][pair, tile, output, even/odd input]
    const int64_t k0 = 2 * g * gkp;
    for (int64_t j = 0; j < gkp; ++j)
      for (int r = 0; r < R; ++r) {
        const float* x = static_cast<const float*>(rb.x[r]) + k0 + 2 * j;
        for (int q = 0; q < P; ++q) {
          const float* w = static_cast<const float*>(gw[q].w) + 64 * j;
          for (int l = 0; l < 64; ++l) acc[r][64 * q + l] = std::fma(w[l], x[l & 1], acc[r][64 * q + l]);
        }
      }
    float a[R][32 * P];
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < 32 * P; ++l) a[r][l] = acc[r][2 * l] + acc[r][2 * l + 1];
    fold_group_scalar<R, P, Q>(Y, a, gw, rb, g);
  }
  for (int r = 0; r < R; ++r) std::memcpy(rb.out[r], Y[r], sizeof(Y[r]));
}
#endif

#if LMRPC_AVX512
// One row, quantized: two groups' sums run side by side (a single sum per group is a chain of dependent dot
// products); they are folded in group order, so the operations are those of block_bf16<1, P, true>.
template <int P, typename Source>
void one_row_quantized_bf16(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  __m512 Y[2 * P];
  for (int i = 0; i < 2 * P; ++i) Y[i] = _mm512_setzero_ps();
  const uint16_t* x = static_cast<const uint16_t*>(rb.x[0]);
  auto fold = [&](const GroupWeights (&gw)[P], const __m512 (&acc)[2 * P], int64_t g) {
    for (int q = 0; q < P; ++q)
      for (int t = 0; t < 2; ++t) {
        const int i = 2 * q + t;
        Y[i] = _mm512_fmadd_ps(acc[i], load_halfx16(gw[q].scale + 16 * t), Y[i]);
        if (gw[q].offset != nullptr) {
          Y[i] = _mm512_fmadd_ps(_mm512_set1_ps(rb.sums[0][g]), load_halfx16(gw[q].offset + 16 * t), Y[i]);
        }
      }
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    GroupWeights ga[P], gb[P];
    for (int q = 0; q < P; ++q) {
      ga[q] = src[q].group(g);
      gb[q] = src[q].group(g + 1);
    }
    __m512 acc_a[2 * P], acc_b[2 * P];
    for (int i = 0; i < 2 * P; ++i) acc_a[i] = acc_b[i] = _mm512_setzero_ps();
    const uint16_t* xa = x + 2 * g * gkp;
    const uint16_t* xb = x + 2 * (g + 1) * gkp;
    for (int64_t j = 0; j < gkp; ++j) {
      int32_t pa, pb;
      std::memcpy(&pa, xa + 2 * j, 4);
      std::memcpy(&pb, xb + 2 * j, 4);
      const __m512bh va = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pa));
      const __m512bh vb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pb));
      for (int q = 0; q < P; ++q)
        for (int t = 0; t < 2; ++t) {
          const int i = 2 * q + t;
          acc_a[i] = _mm512_dpbf16_ps(acc_a[i], reinterpret_cast<__m512bh>(_mm512_loadu_si512(
              static_cast<const uint16_t*>(ga[q].w) + 64 * j + 32 * t)), va);
          acc_b[i] = _mm512_dpbf16_ps(acc_b[i], reinterpret_cast<__m512bh>(_mm512_loadu_si512(
              static_cast<const uint16_t*>(gb[q].w) + 64 * j + 32 * t)), vb);
        }
    }
    fold(ga, acc_a, g);
    fold(gb, acc_b, g + 1);
  }
  for (; g < groups; ++g) {
    GroupWeights ga[P];
    for (int q = 0; q < P; ++q) ga[q] = src[q].group(g);
    __m512 acc[2 * P];
    for (int i = 0; i < 2 * P; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < gkp; ++j) {
      int32_t pa;
      std::memcpy(&pa, x + 2 * g * gkp + 2 * j, 4);
      const __m512bh va = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pa));
      for (int q = 0; q < P; ++q)
        for (int t = 0; t < 2; ++t) {
          acc[2 * q + t] = _mm512_dpbf16_ps(acc[2 * q + t], reinterpret_cast<__m512bh>(_mm512_loadu_si512(
              static_cast<const uint16_t*>(ga[q].w) + 64 * j + 32 * t)), va);
        }
    }
    fold(ga, acc, g);
  }
  for (int i = 0; i < 2 * P; ++i) _mm512_storeu_ps(rb.out[0] + 16 * i, Y[i]);
}
#endif

#if LMRPC_AVX512
// One row, Q4, bf16 products: codes are expanded in registers and used at once (no buffer), and two groups' sums
// run side by side. Per output the operations are those of the expanded path: each group's kpairs in order in one
// sum, folded in group order.
template <int P>
void one_row_q4_bf16(const PackedWeight& w, int64_t p, const Q4Table& table, const uint16_t* x, const float* sums,
                     float* out) {
  const int64_t groups = w.k_pad / w.group;
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
  const __m512i lut = _mm512_load_si512(table.bf16);
  const __m512i low = _mm512_set1_epi16(0x0f);
  __m512 Y[2 * P];
  for (int i = 0; i < 2 * P; ++i) Y[i] = _mm512_setzero_ps();
  auto fold = [&](const __m512 (&acc)[2 * P], int64_t g) {
    for (int q = 0; q < P; ++q) {
      const int64_t at = ((p + q) * groups + g) * 32;
      for (int t = 0; t < 2; ++t) {
        const int i = 2 * q + t;
        Y[i] = _mm512_fmadd_ps(acc[i], load_halfx16(w.scale + at + 16 * t), Y[i]);
        if (w.offset != nullptr) {
          Y[i] = _mm512_fmadd_ps(_mm512_set1_ps(sums[g]), load_halfx16(w.offset + at + 16 * t), Y[i]);
        }
      }
    }
  };
  // acc[i] += the group's kpairs 2c, 2c + 1 of chunk c, for every tile of the P pairs
  auto chunk = [&](__m512 (&acc)[2 * P], int64_t g, int c) {
    int32_t p0, p1;
    std::memcpy(&p0, x + 2 * (16 * g + 2 * c), 4);
    std::memcpy(&p1, x + 2 * (16 * g + 2 * c + 1), 4);
    const __m512bh x0 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p0));
    const __m512bh x1 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p1));
    for (int q = 0; q < P; ++q) {
      const uint8_t* src = data + ((p + q) * groups + g) * 512 + 32 * c;
      for (int t = 0; t < 2; ++t) {
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 256 * t)));
        const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_and_si512(words, low), lut));
        const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), lut));
        acc[2 * q + t] = _mm512_dpbf16_ps(acc[2 * q + t], lo, x0);
        acc[2 * q + t] = _mm512_dpbf16_ps(acc[2 * q + t], hi, x1);
      }
    }
  };
  auto prefetch = [&](int64_t g) {
    for (int q = 0; q < P; ++q) {
      const char* ahead = reinterpret_cast<const char*>(data + ((p + q) * groups + g + kPrefetchGroups) * 512);
      for (int line = 0; line < 8; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    prefetch(g);
    prefetch(g + 1);
    __m512 a[2 * P], b[2 * P];
    for (int i = 0; i < 2 * P; ++i) a[i] = b[i] = _mm512_setzero_ps();
    for (int c = 0; c < 8; ++c) {
      chunk(a, g, c);
      chunk(b, g + 1, c);
    }
    fold(a, g);
    fold(b, g + 1);
  }
  for (; g < groups; ++g) {
    __m512 a[2 * P];
    for (int i = 0; i < 2 * P; ++i) a[i] = _mm512_setzero_ps();
    for (int c = 0; c < 8; ++c) chunk(a, g, c);
    fold(a, g);
  }
  for (int i = 0; i < 2 * P; ++i) _mm512_storeu_ps(out + 16 * i, Y[i]);
}
#endif

// ---- many rows: group-outer, running sums Y in memory ---------------------------------------------------------
// The same operations as block_* (a group's kpairs in one running sum, then the fold), with Y kept in an L1 buffer
// between groups, so one expanded group (P pairs, 4 KiB for bf16) serves a whole chunk of rows from L1.

#if LMRPC_AVX512
template <int R, int P>
void group_rows_bf16(const GroupWeights (&gw)[P], const uint16_t* const* x, const float* const* sums, int64_t g,
                     int64_t gkp, float* const* Y) {
  __m512 acc[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P; ++i) acc[r][i] = _mm512_setzero_ps();
  const uint16_t* w[P];
  for (int q = 0; q < P; ++q) w[q] = static_cast<const uint16_t*>(gw[q].w);
  const uint16_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x[r];
#pragma GCC unroll 2
  for (int64_t j = 0; j < gkp; ++j) {
    // The tiles' vectors for this kpair, loaded once and kept in registers for every row.
    __m512i wv[2 * P];
    for (int q = 0; q < P; ++q) {
      wv[2 * q] = _mm512_loadu_si512(w[q] + 64 * j);
      wv[2 * q + 1] = _mm512_loadu_si512(w[q] + 64 * j + 32);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr[r] + 2 * j)));
      for (int i = 0; i < 2 * P; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], reinterpret_cast<__m512bh>(wv[i]), xb);
    }
  }
  for (int q = 0; q < P; ++q)
    for (int t = 0; t < 2; ++t) {
      const int i = 2 * q + t;
      const __m512 sc = load_halfx16(gw[q].scale + 16 * t);
      for (int r = 0; r < R; ++r) {
        __m512 y = _mm512_fmadd_ps(acc[r][i], sc, _mm512_loadu_ps(Y[r] + 16 * i));
        if (gw[q].offset != nullptr) {
          y = _mm512_fmadd_ps(_mm512_set1_ps(sums[r][g]), load_halfx16(gw[q].offset + 16 * t), y);
        }
        _mm512_storeu_ps(Y[r] + 16 * i, y);
      }
    }
}
#endif

// How many rows share a register block: as many as fit beside their sums (quantized products keep a running
// total per group besides the group's sum).
template <typename T>
constexpr int block_rows(bool quantized) {
  if constexpr (sizeof(T) == 2) return quantized ? 2 : 4;
  return 2;
}

constexpr int64_t kRowChunk = 64;  // many rows, quantized: rows whose running sums share one expanded group
constexpr int kGroupRows = 4;      // rows per call of group_rows_bf16 (its instantiations go up to 4)

template <typename T, int P, bool Q, typename Source>
void run_block(int rows, const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  if constexpr (sizeof(T) == 2) {
#if LMRPC_AVX512
    if constexpr (Q) {
      if (rows == 1) {
        one_row_quantized_bf16<P>(src, groups, gkp, rb);
        return;
      }
    }
#endif
    switch (rows) {
      case 1: block_bf16<1, P, Q>(src, groups, gkp, rb); break;
      case 2: block_bf16<2, P, Q>(src, groups, gkp, rb); break;
      case 3: block_bf16<3, P, Q>(src, groups, gkp, rb); break;
      default: block_bf16<4, P, Q>(src, groups, gkp, rb); break;
    }
  } else {
    switch (rows) {
      case 1: block_f32<1, P, Q>(src, groups, gkp, rb); break;
      default: block_f32<2, P, Q>(src, groups, gkp, rb); break;
    }
  }
}

// ---- the product ------------------------------------------------------------------------------------------------

// Bias and residual added to one block of results (`pairs` tile pairs from pair p), written to y: (Y + bias) +
// residual. The cases are separate loops: a loop testing for a null pointer gets if-converted into masked loads
// from address 0, which AMD CPUs serve through a slow microcode assist.
void epilogue(const PackedWeight& w, const LinearArgs& a, int64_t row0, int rows, int64_t p, int pairs,
              const float (*Y)[32 * kMaxPairs]) {
  const int64_t n0 = 32 * p, width = std::min<int64_t>(32 * pairs, w.n - n0);
  const float* bias = w.bias != nullptr ? w.bias + n0 : nullptr;
  for (int r = 0; r < rows; ++r) {
    const int64_t i = a.y_rows != nullptr ? a.y_rows[row0 + r] : row0 + r;
    float* y = a.y + i * a.y_stride + n0;
    const float* v = Y[r];
    if (a.residual == nullptr) {
      if (bias == nullptr) {
        std::memcpy(y, v, width * sizeof(float));
      } else {
        for (int64_t o = 0; o < width; ++o) y[o] = v[o] + bias[o];
      }
    } else {
      const float* res = a.residual + i * a.residual_stride + n0;
      if (bias == nullptr) {
        for (int64_t o = 0; o < width; ++o) y[o] = v[o] + res[o];
      } else {
        for (int64_t o = 0; o < width; ++o) y[o] = (v[o] + bias[o]) + res[o];
      }
    }
  }
}

#if LMRPC_AVX512
// Quantized weights, bf16 products, many rows: per chunk of rows, per group, expand the group once (L1) and run
// every row block of the chunk over it, the running sums in memory.
template <int P>
void many_rows_quantized(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p,
                         const Q4Table& table, AlignedBuffer<uint16_t>& buffer) {
  const int64_t kp = w.k_pad / 2, groups = w.k_pad / w.group, gkp = w.group / 2;
  if (buffer.size() < static_cast<size_t>(2 * P * gkp * 64)) buffer.resize(2 * P * gkp * 64);
  AlignedBuffer<float> Y;
  for (int64_t c0 = rr.begin; c0 < rr.end; c0 += kRowChunk) {
    const int64_t rows = std::min<int64_t>(kRowChunk, rr.end - c0);
    Y.resize(kRowChunk * 32 * kMaxPairs, true);
    ExpandSource<uint16_t> src[P];
    for (int q = 0; q < P; ++q) {
      src[q] = {PairIndex{&w, p + q, groups, gkp, kp}, &table, buffer.data() + 2 * q * gkp * 64};
    }
    for (int64_t g = 0; g < groups; ++g) {
      GroupWeights gw[P];
      for (int q = 0; q < P; ++q) gw[q] = src[q].group(g);
      for (int64_t r0 = 0; r0 < rows; r0 += kGroupRows) {
        const int n = static_cast<int>(std::min<int64_t>(kGroupRows, rows - r0));
        const uint16_t* x[kMaxRows];
        const float* sums[kMaxRows];
        float* y[kMaxRows];
        for (int r = 0; r < n; ++r) {
          x[r] = in.bf16.data() + (c0 + r0 + r) * w.k_pad + 2 * g * gkp;
          sums[r] = w.offset != nullptr ? in.sums.data() + (c0 + r0 + r) * groups : nullptr;
          y[r] = Y.data() + (r0 + r) * 32 * kMaxPairs;
        }
        switch (n) {
          case 1: group_rows_bf16<1, P>(gw, x, sums, g, gkp, y); break;
          case 2: group_rows_bf16<2, P>(gw, x, sums, g, gkp, y); break;
          case 3: group_rows_bf16<3, P>(gw, x, sums, g, gkp, y); break;
          default: group_rows_bf16<4, P>(gw, x, sums, g, gkp, y); break;
        }
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kGroupRows) {
      const int n = static_cast<int>(std::min<int64_t>(kGroupRows, rows - r0));
      epilogue(w, a, c0 + r0, n, p, P, reinterpret_cast<const float (*)[32 * kMaxPairs]>(Y.data() + r0 * 32 * kMaxPairs));
    }
  }
}
#endif

#if LMRPC_AVX512
// Quantized weights with expanded codes, bf16 products, many rows: one tile pair at a time, blocks of up to
// kMaxRows rows with their running sums in registers across the groups (block_bf16<R, 1, true>: 2R group sums and
// 2R totals fit beside the weights), so no group's sums leave the registers and six rows share each weight load.
// (Measured here against two pairs of three or four rows: one pair of six or four is faster.)
void many_rows_codes(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p) {
  const int64_t kp = w.k_pad / 2, groups = w.k_pad / w.group, gkp = w.group / 2;
  const CodesSource src[1] = {{PairIndex{&w, p, groups, gkp, kp}}};
  alignas(64) float out[kMaxRows][32 * kMaxPairs];
  for (int64_t r0 = rr.begin; r0 < rr.end; r0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, rr.end - r0));
    RowBlock rb{};
    for (int r = 0; r < rows; ++r) {
      rb.x[r] = in.bf16.data() + (r0 + r) * w.k_pad;
      rb.sums[r] = w.offset != nullptr ? in.sums.data() + (r0 + r) * groups : nullptr;
      rb.out[r] = out[r];
    }
    switch (rows) {
      case 1: block_bf16<1, 1, true>(src, groups, gkp, rb); break;
      case 2: block_bf16<2, 1, true>(src, groups, gkp, rb); break;
      case 3: block_bf16<3, 1, true>(src, groups, gkp, rb); break;
      case 4: block_bf16<4, 1, true>(src, groups, gkp, rb); break;
      case 5: block_bf16<5, 1, true>(src, groups, gkp, rb); break;
      default: block_bf16<6, 1, true>(src, groups, gkp, rb); break;
    }
    epilogue(w, a, r0, rows, p, 1, out);
  }
}
#endif

#if LMRPC_VNNI
// ---- Q4 weights with int8 activations (PackedWeight::vnni) ---------------------------------------------------------
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

// The rows of `pairs` (1 or kMaxPairs) tile pairs from pair p.
template <typename T, int P>
void pair_products(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p,
                   const Q4Table& table, AlignedBuffer<T>& buffer) {
  const int64_t kp = w.k_pad / 2, groups = w.k_pad / w.group, gkp = w.group / 2;
  const bool quantized = w.format == WeightFormat::Q4 || w.format == WeightFormat::Q8;
  const int rows_per_block = block_rows<T>(quantized);
  const bool one_block = rr.size() <= rows_per_block;
  const T* xq;
  if constexpr (sizeof(T) == 2) xq = in.bf16.data(); else xq = in.f32.data();
#if LMRPC_VNNI
  if constexpr (sizeof(T) == 2) {
    if (in.int8) {
      for (int q = 0; q < P; ++q) vnni_pair(w, in, a, rr, p + q);
      return;
    }
  }
#endif
#if LMRPC_AVX512
  if constexpr (sizeof(T) == 2) {
    if (quantized && !one_block) {
      if (w.codes != nullptr) {
        for (int q = 0; q < P; ++q) many_rows_codes(w, in, a, rr, p + q);
      } else {
        many_rows_quantized<P>(w, in, a, rr, p, table, buffer);
      }
      return;
    }
    if (w.format == WeightFormat::Q4 && rr.size() == 1) {
      alignas(64) float row[32 * kMaxPairs];
      one_row_q4_bf16<P>(w, p, table, in.bf16.data() + rr.begin * w.k_pad,
                         w.offset != nullptr ? in.sums.data() + rr.begin * groups : nullptr, row);
      epilogue(w, a, rr.begin, 1, p, P, reinterpret_cast<const float (*)[32 * kMaxPairs]>(row));
      return;
    }
  }
#endif
  alignas(64) float out[kMaxRows][32 * kMaxPairs];
  const int64_t per_pair = (one_block ? 2 * gkp : kp) * 64;  // expanded values per pair (two group slots)
  if (quantized && buffer.size() < static_cast<size_t>(P * per_pair)) buffer.resize(P * per_pair);
  for (int64_t r0 = rr.begin; r0 < rr.end; r0 += rows_per_block) {
    const int rows = static_cast<int>(std::min<int64_t>(rows_per_block, rr.end - r0));
    RowBlock rb{};
    for (int r = 0; r < rows; ++r) {
      rb.x[r] = xq + (r0 + r) * w.k_pad;
      rb.sums[r] = w.offset != nullptr ? in.sums.data() + (r0 + r) * groups : nullptr;
      rb.out[r] = out[r];
    }
    if (!quantized) {
      DenseSource<T> src[P];
      for (int q = 0; q < P; ++q) src[q] = DenseSource<T>{PairIndex{&w, p + q, groups, gkp, kp}};
      run_block<T, P, false>(rows, src, groups, gkp, rb);
    } else if (one_block) {
      ExpandSource<T> src[P];
      for (int q = 0; q < P; ++q) src[q] = {PairIndex{&w, p + q, groups, gkp, kp}, &table, buffer.data() + q * per_pair};
      run_block<T, P, true>(rows, src, groups, gkp, rb);
    } else {
      ExpandedSource<T> src[P];
      for (int q = 0; q < P; ++q) {
        if (r0 == rr.begin) {
          ExpandSource<T>{PairIndex{&w, p + q, groups, gkp, kp}, &table, buffer.data() + q * per_pair}.expand_all();
        }
        src[q] = {PairIndex{&w, p + q, groups, gkp, kp}, buffer.data() + q * per_pair};
      }
      run_block<T, P, true>(rows, src, groups, gkp, rb);
    }
    epilogue(w, a, r0, rows, p, P, out);
  }
}

constexpr int64_t kSerialWork = int64_t{1} << 18;  // multiply-adds (rows x padded outputs x padded inputs)
constexpr int64_t kItemsPerThread = 8;  // work items a job should offer each thread, so the last ones even out

// A job's work items: its blocks of kMaxPairs tile pairs, each over `row_chunk` of its rows. A job with few blocks
// (576 outputs: 9 blocks for 2 threads) splits its rows too, so no thread waits a whole block for the other; the two
// halves of a block come one after the other, so both threads read its weights while they are in cache. Which rows
// share an item never changes a row's bits.
struct JobItems {
  int64_t blocks;     // blocks of tile pairs
  int64_t splits;     // row chunks per block
  int64_t row_chunk;  // rows per chunk (the last may have fewer)
};

JobItems job_items(const LinearJob& job, int threads) {
  const int64_t blocks = (job.w->n_pad / 32 + kMaxPairs - 1) / kMaxPairs, m = job.args.m;
  int64_t splits = 1;
  if (threads > 1 && blocks < kItemsPerThread * threads) {
    const int64_t wanted = (kItemsPerThread * threads + blocks - 1) / blocks;
    splits = std::max<int64_t>(1, std::min<int64_t>(wanted, m / kMaxRows));  // chunks of at least kMaxRows rows
  }
  const int64_t row_chunk = (m + splits - 1) / splits;
  return {blocks, (m + row_chunk - 1) / row_chunk, row_chunk};  // no chunk left empty by the rounding up
}

// The work items of every job, handed out a few at a time: a vCPU slowed by its host does less of the work. Which
// thread computes an item never changes its bits. T: uint16_t (bf16 products) or float (float32).
template <typename T>
void products(const LinearJob* jobs, const Inputs* in, int64_t count) {
  thread_local std::vector<int64_t> starts;  // kept between calls (the calling thread's; the team reads `first`)
  thread_local std::vector<JobItems> items;
  starts.assign(count + 1, 0);
  items.resize(count);
  int64_t pairs = 0, work = 0;
  for (int64_t j = 0; j < count; ++j) {
    const PackedWeight& w = *jobs[j].w;
    pairs += w.n_pad / 32;
    work += jobs[j].args.m * w.n_pad * w.k_pad;
  }
  static const Q4Table tables[2] = {Q4Table(false), Q4Table(true)};
  // Work smaller than a thread hand-off costs (a decode step's LoRA products: a few rows of rank-16 matrices) stays
  // on the calling thread. Which thread computes a block never changes its bits.
  const int threads =
      work < kSerialWork ? 1 : static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), pairs)));
  int64_t* first = starts.data();  // job j's items are [first[j], first[j + 1])
  for (int64_t j = 0; j < count; ++j) {
    items[j] = job_items(jobs[j], threads);
    first[j + 1] = first[j] + items[j].blocks * items[j].splits;
  }
  const JobItems* job_items_of = items.data();  // (the team reads the calling thread's items through this)
  const int64_t total = first[count];
  const int64_t grab = std::max<int64_t>(1, total / (8 * threads));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    thread_local AlignedBuffer<T> buffer;  // expanded weights, each thread's own; kept between calls
#pragma omp for schedule(dynamic, grab)
    for (int64_t b = 0; b < total; ++b) {
      const int64_t j = std::upper_bound(first, first + count + 1, b) - first - 1;
      const PackedWeight& w = *jobs[j].w;
      const JobItems& it = job_items_of[j];
      const Q4Table& table = tables[w.q4_signed ? 1 : 0];
      const int64_t item = b - first[j], block = item / it.splits, chunk = item % it.splits;
      const RowRange rr{chunk * it.row_chunk, std::min<int64_t>(jobs[j].args.m, (chunk + 1) * it.row_chunk)};
      const int64_t job_pairs = w.n_pad / 32, p = block * kMaxPairs;
      if (p + kMaxPairs <= job_pairs) {
        pair_products<T, kMaxPairs>(w, in[j], jobs[j].args, rr, p, table, buffer);
      } else {
        for (int64_t q = p; q < job_pairs; ++q) pair_products<T, 1>(w, in[j], jobs[j].args, rr, q, table, buffer);
      }
    }
  }
}

}  // namespace

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
  const Q4Table table(w.q4_signed);
  for (int64_t p = 0; p < pairs; ++p) {
    ExpandSource<uint16_t>{PairIndex{&w, p, groups, gkp, kp}, &table, out + p * kp * 64}.expand_all();
  }
}

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

bool native_bf16() { return LMRPC_AVX512 != 0; }
bool native_vnni() { return LMRPC_VNNI != 0; }

}  // namespace lmrpc
