// Quantized codes made kpair vectors, shared by the products (linear_impl.h and the kernels): Q4 codes' values and
// their bf16 table, Q6 and Q3 units' codes, how far ahead the products ask for codes, and one group of a tile pair
// expanded (expand_q4, expand_q8, decode_q6, decode_words).
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear.h"

namespace lmrpc::linear_detail {

// ---- quantized codes -> one group of a tile pair as kpair vectors ([kpairs][2 tiles][16 outputs][2]) ----------

inline int q4_value(uint8_t code, bool is_signed) { return is_signed ? static_cast<int>(code) - 8 : code; }

// What a Q4 code of weight `w` stands for (times its group's scale, plus its offset).
inline int q4_code_value(uint8_t code, const PackedWeight& w) {
  return w.code_table ? w.code_values[code & 15] : q4_value(code, w.q4_signed);
}

// The code of byte b of Q8 vector i (0..3) of a Q6 unit (linear.h).
inline int q6_code(const uint8_t* unit, int i, int64_t b) {
  const uint8_t nibbles = unit[32 * (i / 2) + b];
  const int lo = i % 2 == 0 ? nibbles & 15 : nibbles >> 4;
  return (lo | (((unit[64 + b] >> (2 * i)) & 3) << 4)) - 32;
}

// The code of lane b of Q8 vector i (0..15) of a block of kBits-bit codes in 16-bit words (Q3, Q5: linear.h), as
// stored.
template <int kBits>
inline int word_code(const uint8_t* block, int i, int64_t b) {
  constexpr int per = 15 / kBits;  // codes a word holds below its top bit
  const auto word = [&](int line) { return block[64 * line + 2 * b] | (block[64 * line + 2 * b + 1] << 8); };
  if (i < 15) return (word(i / per) >> (kBits * (i % per))) & ((1 << kBits) - 1);
  int c = 0;
  for (int j = 0; j < kBits; ++j) c |= (word(j) >> 15) << j;
  return c;
}

// bf16 values of the 16 codes, twice: vpermw reads 5 bits of an index, and with the table doubled its fifth bit (a
// high nibble's lowest, q4_chunk) never changes the value picked. (int8 values: exact in bfloat16.)
struct Q4Table {
  alignas(64) uint16_t bf16[32];
  explicit Q4Table(bool is_signed, const int8_t* values = nullptr) {
    for (int q = 0; q < 32; ++q) {
      bf16[q] = f32_to_bf16(static_cast<float>(values != nullptr ? values[q & 15] : q4_value(q & 15, is_signed)));
    }
  }
  explicit Q4Table(const PackedWeight& w) : Q4Table(w.q4_signed, w.code_table ? w.code_values : nullptr) {}
};

constexpr int kPrefetchGroups = 4;  // Q4 groups read ahead (2 KiB): codes stream from memory as they are expanded
// Groups a product asks for ahead into L2 (Q4: 4 KiB). One row: since K-quants fold per super-block a one-row
// product goes through its codes faster, and 4 groups ahead left it waiting (Q4_K 8192 x 2048 from memory, two
// threads: 0.89-0.93x the time with 6 or 8, 5 alternating rounds; Q6_K 2048 x 8192 the same). Many rows: their first
// block of rows met its codes in memory with only kPrefetchGroups asked for, into L1; with these asked for too, the
// 1.7B shapes' Q4_K products from memory took 0.70x / 0.87x / 0.95x the time at 2 / 8 / 27 rows, the bundled model's
// Q4_1 layer products 0.82x / 0.89x / 0.86x at 4 / 8 / 16, Q5_K ~0.75x at 2-8 rows (two threads, AMD EPYC Zen 4,
// 3-5 alternating rounds; 8, 12 and 16 groups alike, 32 slower).
constexpr int kL2AheadGroups = 8;
constexpr int64_t kBf16AheadKpairs = kL2AheadGroups * 16;  // bf16 kpairs (128 bytes) as far ahead in time
constexpr int64_t kQ8PrefetchBytes = 4096;  // Q8 codes read ahead in one-row products (four groups of 32 inputs)

// A Q4 group of a tile pair is 2 x 256 bytes: per tile 8 chunks of 32, chunk c holding kpair 2c in its low nibbles
// and kpair 2c + 1 in its high nibbles.
#if LMRPC_AVX512 || LMRPC_AVX2
// One-row products ask for their codes ahead into L2, not L1 (a prefetch into L1 holds one of the core's few L1 miss
// buffers until its line arrives), and past the end of a tile pair's codes they ask for the next block's
// (one_row_ahead). Measured on AMD EPYC Zen 4 (huge pages, one row, a small C++ program over the kernels' sources, old
// and new alternating): a Q6_K 49152 x 2048 head and the bundled Q8_0 head (49152 x 576) each ~0.8x the time of L1
// prefetches; Q4 at the bundled model's 3072 x 576, ~0.76x into L2 and ~0.71x with the next block's groups too (at
// 16384 x 2048: 0.98x and ~0.9x; into L1 with the next block's groups, 1.1-2.2x slower).
constexpr _mm_hint kOneRowHint = _MM_HINT_T1;

// Where a one-row product's prefetch goes: `offset` bytes into the codes of its tile pair q, whose codes are
// `length` bytes, the pairs of a block of P one after the other. Past the pair's end it goes on into the same pair
// of the next block, P pairs on (the pairs of a weight are laid out in order, and a thread takes blocks in order
// as it can): without it each block started with its codes coming from memory unasked (a block is 18-96 KiB at
// these models' widths).
LMRPC_INLINE int64_t one_row_ahead(int64_t offset, int64_t length, int P) {
  return offset < length ? offset : offset + (P - 1) * length;
}

// Asks for `bytes` of codes from `at` into L2 (kOneRowHint), a cache line at a time.
LMRPC_INLINE void prefetch_one_row(const void* at, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(static_cast<const char*>(at) + line, kOneRowHint);
  }
}

// The group kPrefetchGroups ahead of `group`, asked into L1.
inline void prefetch_q4_ahead(const uint8_t* group) {
  for (int line = 0; line < 8; ++line) {
    _mm_prefetch(reinterpret_cast<const char*>(group + kPrefetchGroups * 512 + 64 * line), _MM_HINT_T0);
  }
}
#endif

#if LMRPC_AVX512

// Chunk c of tile t as two bf16 kpair vectors (lut: Q4Table::bf16). vpermw reads only bits 0-4 of each 16-bit
// index and the table holds the 16 values twice, so a byte's high nibble beside its low one picks the same value:
// the low nibbles need no mask.
struct Q4Chunk {
  __m512i lo, hi;  // kpairs 2c and 2c + 1
};
inline Q4Chunk q4_chunk(const uint8_t* group, int t, int c, __m512i lut) {
  const __m512i words =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 256 * t + 32 * c)));
  return {_mm512_permutexvar_epi16(words, lut), _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), lut)};
}
#endif

// A Q4 group of a tile pair -> 16 kpairs x 2 tiles x 32 values.
template <typename T>
void expand_q4(const uint8_t* src, bool is_signed, const Q4Table& table, T* dst) {
#if LMRPC_AVX512
  prefetch_q4_ahead(src);
  if constexpr (sizeof(T) == 2) {
    const __m512i lut = _mm512_load_si512(table.bf16);
    for (int t = 0; t < 2; ++t) {
      for (int c = 0; c < 8; ++c) {
        const Q4Chunk chunk = q4_chunk(src, t, c, lut);
        _mm512_storeu_si512(dst + 32 * (4 * c + t), chunk.lo);
        _mm512_storeu_si512(dst + 32 * (4 * c + 2 + t), chunk.hi);
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
#elif LMRPC_AVX2
  if constexpr (sizeof(T) == 4) {
    const __m256i bias = _mm256_set1_epi32(is_signed ? 8 : 0);
    const __m256i low = _mm256_set1_epi32(0x0f);
    for (int t = 0; t < 2; ++t) {
      for (int c = 0; c < 8; ++c) {
        for (int h = 0; h < 4; ++h) {
          const __m256i v = _mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 256 * t + 32 * c + 8 * h)));
          const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(v, low), bias);
          const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(v, 4), bias);
          _mm256_storeu_ps(dst + 32 * (4 * c + t) + 8 * h, _mm256_cvtepi32_ps(lo));
          _mm256_storeu_ps(dst + 32 * (4 * c + 2 + t) + 8 * h, _mm256_cvtepi32_ps(hi));
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
#if LMRPC_AVX2
    if constexpr (sizeof(T) == 4) {
      for (int h = 0; h < 4; ++h) {
        const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8 * h)));
        _mm256_storeu_ps(d + 8 * h, _mm256_cvtepi32_ps(v));
      }
      continue;
    }
#endif
    for (int b = 0; b < 32; ++b) {
      if constexpr (sizeof(T) == 2) d[b] = f32_to_bf16(static_cast<float>(s[b])); else d[b] = static_cast<float>(s[b]);
    }
#endif
  }
}

#if LMRPC_AVX512 || LMRPC_AVX2
// One Q6 unit at `src` -> its 4 vectors of stored codes, q + 32 in 0..63 (vector i: kpair i / 2 of the unit, tile i % 2).
LMRPC_INLINE void q6_unit_codes(const uint8_t* src, __m256i (&v)[4]) {
  const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
  // 16-bit shifts: each byte's bits are masked back to its own after the shift
  v[0] = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
  v[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
  v[2] = _mm256_or_si256(_mm256_and_si256(b, low), _mm256_and_si256(h, top));
  v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low), _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
}
#endif

// Q6 units (linear.h: kQ6UnitBytes each) -> the Q8 vectors they hold (4 a unit, 32 int8 each).
inline void decode_q6(const uint8_t* src, int64_t units, int8_t* dst) {
#if LMRPC_AVX512 || LMRPC_AVX2
  const __m256i bias = _mm256_set1_epi8(32);
  for (int64_t u = 0; u < units; ++u, src += kQ6UnitBytes, dst += 128) {
    __m256i v[4];
    q6_unit_codes(src, v);
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * i), _mm256_sub_epi8(v[i], bias));
    }
  }
#else
  for (int64_t u = 0; u < units; ++u, src += kQ6UnitBytes, dst += 128) {
    for (int i = 0; i < 4; ++i)
      for (int b = 0; b < 32; ++b) dst[32 * i + b] = static_cast<int8_t>(q6_code(src, i, b));
  }
#endif
}

// Blocks of kBits-bit codes in 16-bit words (Q3, Q5: linear.h; 64 * kBits bytes each, `units` / 4 of them) -> the
// Q8 vectors they hold (16 a block, 32 int8 each: the codes less `bias`).
template <int kBits>
inline void decode_words(const uint8_t* src, int64_t units, int bias, int8_t* dst) {
  constexpr int per = 15 / kBits;
  constexpr int64_t block_bytes = 64 * kBits;
#if LMRPC_AVX512 || LMRPC_AVX2
  const __m256i mask = _mm256_set1_epi16((1 << kBits) - 1), less = _mm256_set1_epi16(static_cast<int16_t>(bias));
  for (int64_t blk = 0; blk < units / 4; ++blk, src += block_bytes, dst += 512) {
    __m256i lines[kBits][2];  // [line][lanes 0-15, 16-31]
    for (int j = 0; j < kBits; ++j)
      for (int h = 0; h < 2; ++h)
        lines[j][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * j + 32 * h));
    for (int i = 0; i < 16; ++i) {
      __m256i half[2];
      for (int h = 0; h < 2; ++h) {
        if (i < 15) {
          half[h] = _mm256_and_si256(_mm256_srl_epi16(lines[i / per][h], _mm_cvtsi32_si128(kBits * (i % per))), mask);
        } else {
          half[h] = _mm256_setzero_si256();
          for (int j = 0; j < kBits; ++j) {
            half[h] = _mm256_or_si256(half[h], _mm256_slli_epi16(_mm256_srli_epi16(lines[j][h], 15), j));
          }
        }
        half[h] = _mm256_sub_epi16(half[h], less);
      }
      // int16 lanes 0-15 and 16-31 -> 32 int8 in order (packs works per 128-bit lane: the quarters reordered)
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi16(half[0], half[1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * i), packed);
    }
  }
#else
  for (int64_t blk = 0; blk < units / 4; ++blk, src += block_bytes, dst += 512) {
    for (int i = 0; i < 16; ++i)
      for (int b = 0; b < 32; ++b) dst[32 * i + b] = static_cast<int8_t>(word_code<kBits>(src, i, b) - bias);
  }
#endif
}

}  // namespace lmrpc::linear_detail
