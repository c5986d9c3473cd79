// Internals of the row-invariant products shared by linear.cpp, linear_products.cpp and linear_int8.cpp: the
// inputs as the products read them, where a tile pair's weights come from (codes expanded: linear_codes.h), the
// epilogue.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear.h"
#include "linear_codes.h"

namespace lmrpc::linear_detail {

constexpr int kMaxRows = 6;  // rows per register block (at most)

// Bytes of Inputs::i8 per input. AVX2 stores each pair of codes twice (q0 q1 q0 q1, q2 q3 q2 q3, ...): its products
// broadcast one pair to every output, and a 32-bit broadcast from memory is a plain load where a 16-bit one is not.
constexpr int64_t kI8Width = LMRPC_AVX2 ? 2 : 1;

// The rows as the products read them: xq [m][k_pad] (uint16 bf16 or float), and group sums [m][groups] of the
// values as rounded (only for weights with offsets).
struct Inputs {
  AlignedBuffer<uint16_t> bf16;
  AlignedBuffer<float> f32;
  AlignedBuffer<float> sums;
  // Q4 weights with int8 activations (PackedWeight::int8): per row and group of 32, d = max |x| / 127 and
  // q = round(x / d) in int8 [m][k_pad * kI8Width]; d [m][groups] and d * sum(q) [m][groups].
  AlignedBuffer<int8_t> i8;
  AlignedBuffer<float> d;
  AlignedBuffer<float> dsum;
  // Q4 weights with int16 activations (PackedWeight::int16): q = round(x / d), d = max |x| / 32767 per group of 32,
  // int16 [m][k_pad]; d and d * sum(q) as for int8.
  AlignedBuffer<int16_t> i16;
  bool int8 = false;   // the rows are in i8/d/dsum (else bf16/f32 and sums)
  bool int16 = false;  // the rows are in i16/d/dsum
};

#if LMRPC_AVX2
// max |x| over a group of 32 inputs (exact in any order): the scale of its integer activations.
inline float group_amax32(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 32; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.0f;
  for (float v : lanes) amax = std::max(amax, v);
  return amax;
}
#endif

// ---- where a tile pair's weights come from, one group at a time ----------------------------------------------
// Each source yields, for group g, the pair's kpairs ([kpairs][2 tiles][32] values) and scales and offsets
// ([2 tiles][16] each).

struct GroupWeights {
  const void* w;        // [kpairs][2][32] values
  const uint16_t* scale;   // fp16 [2][16], or null (dense, or K-scaled)
  const uint16_t* offset;  // fp16 [2][16], or null
  // K-scaled weights (KScales): d and dmin of the group's super-block and the group's sc and m, each [2][16]
  const uint16_t* kd = nullptr;
  const uint16_t* kdmin = nullptr;
  const uint8_t* ksc = nullptr;
  const uint8_t* km = nullptr;
  bool ksigned = false;
  bool has_offset() const { return offset != nullptr || kdmin != nullptr; }
};

// Group g of tile pair `pair`: its values and where its scales and offsets are.
LMRPC_INLINE GroupWeights group_weights(const PackedWeight& w, int64_t pair, int64_t groups, int64_t g,
                                        const void* values) {
  const int64_t at = (pair * groups + g) * 32;
  if (!w.k_scaled()) return {values, w.scale + at, w.offset != nullptr ? w.offset + at : nullptr};
  const int sh = w.ks.super_shift;
  const int64_t sat = (pair * (groups >> sh) + (g >> sh)) * 32;
  GroupWeights gw{values, nullptr, nullptr};
  gw.kd = w.ks.d + sat;
  gw.kdmin = w.ks.dmin != nullptr ? w.ks.dmin + sat : nullptr;
  gw.ksc = w.ks.sc + at;
  gw.km = w.ks.m != nullptr ? w.ks.m + at : nullptr;
  gw.ksigned = w.ks.sc_signed;
  return gw;
}

// Lane l (16 * tile + output) of a group's scale and offset, float32: K-scaled, d * sc and -(dmin * m), exact.
inline float lane_scale(const GroupWeights& gw, int l) {
  if (gw.kd == nullptr) return half_to_f32(gw.scale[l]);
  const float sc = gw.ksigned ? static_cast<float>(static_cast<int8_t>(gw.ksc[l])) : static_cast<float>(gw.ksc[l]);
  return half_to_f32(gw.kd[l]) * sc;
}
inline float lane_offset(const GroupWeights& gw, int l) {
  if (gw.kd == nullptr) return half_to_f32(gw.offset[l]);
  return -(half_to_f32(gw.kdmin[l]) * static_cast<float>(gw.km[l]));
}

#if LMRPC_AVX512
// Tile t's 16 scales and offsets, as lane_scale and lane_offset compute them (the int8 products and offsets of
// weights that are not K-scaled; bf16 and float32 products fold K-scaled weights per super-block, linear_kscales.h).
LMRPC_INLINE __m512 scale_x16(const GroupWeights& gw, int t) {
  if (gw.kd == nullptr) return load_halfx16(gw.scale + 16 * t);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gw.ksc + 16 * t));
  const __m512i sc = gw.ksigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  return _mm512_mul_ps(load_halfx16(gw.kd + 16 * t), _mm512_cvtepi32_ps(sc));
}
LMRPC_INLINE __m512 offset_x16(const GroupWeights& gw, int t) {
  if (gw.kd == nullptr) return load_halfx16(gw.offset + 16 * t);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gw.km + 16 * t));
  const __m512 dm = _mm512_mul_ps(load_halfx16(gw.kdmin + 16 * t), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)));
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), _mm512_set1_epi32(INT32_MIN)));  // -dm
}

// Asks for group g's scales and offsets (K scales: sc, m, d, dmin) of tile pair `pair` into L2 (kOneRowHint). They
// lie apart from the codes, each array a stream of its own that one-row products otherwise met unasked: a Q4_K
// one-row product of 16384 x 2048 from memory took 0.90x the time with them asked for (two threads, huge pages, 8
// alternating rounds, AMD EPYC Zen 4), a 1.7B Q4_K_M-shaped step of one-row products ~0.92x.
LMRPC_INLINE void prefetch_scales(const PackedWeight& w, int64_t pair, int64_t groups, int64_t g) {
  const GroupWeights gw = group_weights(w, pair, groups, g, nullptr);
  const auto ask = [](const void* at) LMRPC_LAMBDA_INLINE {
    if (at != nullptr) _mm_prefetch(static_cast<const char*>(at), kOneRowHint);
  };
  if (gw.kd != nullptr) {
    ask(gw.ksc);
    ask(gw.km);
    ask(gw.kd);
    ask(gw.kdmin);
  } else {
    ask(gw.scale);
    ask(gw.offset);
  }
}
#endif

// Q6, Q5 and Q3 weights' groups are at most this many inputs (GGUF's 16 and 32): a group's codes decode into a stack
// buffer.
constexpr int64_t kMaxQ6Group = 32;

// Where Q8 vector `vector` (a group's first: PairIndex::vectors) starts in a Q6 weight's units.
inline const uint8_t* q6_group(const PackedWeight& w, int64_t vector) {
  return static_cast<const uint8_t*>(w.data) + vector / 4 * kQ6UnitBytes;
}

// Where Q8 vector `vector` (a group's first) starts in the blocks of a weight of kBits-bit codes in 16-bit words (Q3,
// Q5: 64 * kBits bytes per 16 vectors).
static_assert(kQ3BlockBytes == 64 * 3 && kQ5BlockBytes == 64 * 5, "one 64-byte line per bit of a code");
template <int kBits>
inline const uint8_t* word_group(const PackedWeight& w, int64_t vector) {
  return static_cast<const uint8_t*>(w.data) + vector / 16 * (64 * kBits);
}

// Offsets of tile pair p, group g in the packed arrays.
struct PairIndex {
  const PackedWeight* w;
  int64_t pair, groups, gkp, kp;
  int64_t scales(int64_t g) const { return (pair * groups + g) * 32; }
  int64_t q4_bytes(int64_t g) const { return (pair * groups + g) * 512; }
  int64_t vectors(int64_t g) const { return (pair * kp + g * gkp) * 2; }  // kpair vectors of 32 values
};

// Where a product's weights come from, group by group. kStreams: block_bf16 asks for the groups ahead into L2, read
// in place from memory one after the other (a pair's after the previous pair's). The bundled model's Q8_0 head from
// its bf16 codes (CodesSource) took ~0.8x the time at 8-32 rows with it (two threads, AMD EPYC Zen 4, 3 alternating
// rounds); dense bf16 weights gained nothing measurable (the hardware's prefetch keeps up: one group is the whole row).

// Dense weights: pointers into the packed data.
template <typename T>
struct DenseSource {
  static constexpr bool kStreams = false;
  PairIndex at;
  GroupWeights group(int64_t g) const {
    return {static_cast<const T*>(at.w->data) + at.vectors(g) * 32, nullptr, nullptr};
  }
};

// Quantized weights, expanded a group at a time into a small buffer (few rows: one row block reads them), or all
// groups at once (many rows: every row block reads them).
template <typename T>
struct ExpandSource {
  static constexpr bool kStreams = false;
  PairIndex at;
  const Q4Table* table;
  T* buffer;  // two slots of [gkp][2][32] (group by group; slot g % 2) or [kp][2][32] (all)

  void expand(int64_t g, T* dst) const {
    const PackedWeight& w = *at.w;
    if (w.format == WeightFormat::Q4) {
      expand_q4<T>(static_cast<const uint8_t*>(w.data) + at.q4_bytes(g), w.q4_signed, *table, dst);
    } else if (w.format == WeightFormat::Q6) {
      alignas(64) int8_t codes[kMaxQ6Group * 32];
      decode_q6(q6_group(w, at.vectors(g)), at.gkp / 2, codes);
      expand_q8<T>(codes, 2 * at.gkp, dst);
    } else if (w.format == WeightFormat::Q3) {
      alignas(64) int8_t codes[kMaxQ6Group * 32];
      decode_words<3>(word_group<3>(w, at.vectors(g)), at.gkp / 2, 4, codes);
      if (w.code_table) {  // codes q that index values of their own (stored as q + 4)
        for (int64_t i = 0; i < at.gkp * 64; ++i) codes[i] = w.code_values[codes[i] + 4];
      }
      expand_q8<T>(codes, 2 * at.gkp, dst);
    } else if (w.format == WeightFormat::Q5) {
      alignas(64) int8_t codes[kMaxQ6Group * 32];
      decode_words<5>(word_group<5>(w, at.vectors(g)), at.gkp / 2, w.q4_signed ? 16 : 0, codes);
      expand_q8<T>(codes, 2 * at.gkp, dst);
    } else {
      expand_q8<T>(static_cast<const int8_t*>(w.data) + at.vectors(g) * 32, 2 * at.gkp, dst);
    }
  }
  GroupWeights group(int64_t g) const {
    T* slot = buffer + (g % 2) * at.gkp * 64;
    expand(g, slot);
    return group_weights(*at.w, at.pair, at.groups, g, slot);
  }
  void expand_all() const {
    for (int64_t g = 0; g < at.groups; ++g) expand(g, buffer + g * at.gkp * 64);
  }
};

// Quantized weights already expanded by ExpandSource::expand_all.
template <typename T>
struct ExpandedSource {
  static constexpr bool kStreams = false;
  PairIndex at;
  const T* all;  // [kp][2][32]
  GroupWeights group(int64_t g) const { return group_weights(*at.w, at.pair, at.groups, g, all + g * at.gkp * 64); }
};

// Quantized weights whose codes were expanded once, when the weight was made (PackedWeight::codes).
struct CodesSource {
  static constexpr bool kStreams = true;
  PairIndex at;
  GroupWeights group(int64_t g) const {
    return group_weights(*at.w, at.pair, at.groups, g, at.w->codes + at.vectors(g) * 32);
  }
};

// ---- what the micro-kernels (linear_kernels.h) work on: tile pairs and blocks of rows -------------------------------

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

// ---- the product: results into y (linear_products.cpp has the rest) -------------------------------------------------

// A product of many rows writes its outputs past the caches (non-temporal stores; products() fences them before
// its threads part): their lines would otherwise first be read from memory, where the weights streamed since the
// last call have pushed them. Measured on SmolLM2 at 32 streams, interleaved step by step: prefill steps of 512
// tokens ~4% faster, decode steps unchanged. Same bits either way.
constexpr int64_t kStreamRows = 8;

#if LMRPC_AVX512
// y = (v + bias) + residual for the terms present, 16 at a time, streamed (one loop per case, like epilogue's).
template <bool kBias, bool kResidual>
inline void store_streamed(const float* v, const float* bias, const float* res, int64_t width, float* y) {
  for (int64_t o = 0; o < width; o += 16) {
    __m512 t = _mm512_loadu_ps(v + o);
    if constexpr (kBias) t = _mm512_add_ps(t, _mm512_loadu_ps(bias + o));
    if constexpr (kResidual) t = _mm512_add_ps(t, _mm512_loadu_ps(res + o));
    _mm512_stream_ps(y + o, t);
  }
}

inline void store_streamed(const float* v, const float* bias, const float* res, int64_t width, float* y) {
  if (bias == nullptr) {
    if (res == nullptr) store_streamed<false, false>(v, bias, res, width, y);
    else store_streamed<false, true>(v, bias, res, width, y);
  } else {
    if (res == nullptr) store_streamed<true, false>(v, bias, res, width, y);
    else store_streamed<true, true>(v, bias, res, width, y);
  }
}
#endif

// Bias and residual added to one block of results (`pairs` tile pairs from pair p), written to y: (Y + bias) +
// residual. The cases are separate loops: a loop testing for a null pointer gets if-converted into masked loads
// from address 0, which AMD CPUs serve through a slow microcode assist.
inline void epilogue(const PackedWeight& w, const LinearArgs& a, int64_t row0, int rows, int64_t p, int pairs,
                     const float (*Y)[32 * kMaxPairs]) {
  const int64_t n0 = 32 * p, width = std::min<int64_t>(32 * pairs, w.n - n0);
  const float* bias = w.bias != nullptr ? w.bias + n0 : nullptr;
  alignas(64) float scaled[32 * kMaxPairs];
  for (int r = 0; r < rows; ++r) {
    const int64_t i = a.y_rows != nullptr ? a.y_rows[row0 + r] : row0 + r;
    float* y = a.y + i * a.y_stride + n0;
    const float* v = Y[r];
    if (w.ks.d_scale != 1.0f) {  // every d times a power of two (KScales::d_scale): the results times it, exactly
      for (int64_t o = 0; o < width; ++o) scaled[o] = v[o] * w.ks.d_scale;
      v = scaled;
    }
#if LMRPC_AVX512
    if (a.m >= kStreamRows && width % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 64 == 0) {
      store_streamed(v, bias, a.residual != nullptr ? a.residual + i * a.residual_stride + n0 : nullptr, width, y);
      continue;
    }
#endif
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

#if LMRPC_VNNI
// Every row of tile pair p, in blocks of up to kMaxRows rows, with int8 activations (linear_int8.cpp).
void vnni_pair(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p);
#endif
#if LMRPC_AVX2
// The same over the Q4 layout itself, AVX2, float32 compute (linear_int8.cpp).
void int8_pair_avx2(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p);
// Quantized weights with int16 activations, AVX2, float32 compute (linear_int16.cpp).
void int16_pair_avx2(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p);
// One row (float32, k_pad) -> int16 codes, and per group d and d * sum(q) (linear_int16.cpp).
void quantize_row_int16(const float* row, int64_t kp, int16_t* q, float* d, float* dsum);
#endif

// The work items of every job, split between threads (linear_products.cpp, which instantiates it for uint16_t
// and float).
template <typename T>
void products(const LinearJob* jobs, const Inputs* in, int64_t count);

}  // namespace lmrpc::linear_detail
