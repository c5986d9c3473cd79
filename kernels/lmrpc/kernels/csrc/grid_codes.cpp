// GGUF's grid and ternary blocks -> their integer codes (gguf_grids.py), read straight from each block's bits.
//
// A block holds 256 weights; every weight is value / (d' * sc), an integer: a grid entry's value (or a ternary
// digit) with its sign, in the units gguf_grids.py hands in (the grid tables come from the gguf package, already
// scaled to those units; IQ1's codes add the group's delta, +-1 in them). Loading used to compute these as gguf's
// float dequantize divided by d' * sc, seconds per large tensor; here each block is a few hundred byte operations.
// The layouts are GGML's (ggml-common.h), as gguf's `dequantize` reads them; tests compare the two bit for bit.
#include "grid_codes.h"

#include <omp.h>

#include <array>
#include <cstring>

namespace lmrpc {

namespace {

struct Tables {
  const int8_t* grid;     // [entries, width] the format's grid in code units
  const uint8_t* ksigns;  // [128] sign bits of 8 weights from a 7-bit index (bit 7: the parity the index leaves out)
};
using BlockDecoder = void (*)(const uint8_t* block, const Tables& t, int8_t* out);

uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// `width` weights of one grid entry, weight j negated where bit j of `signs` is set.
template <int width>
void signed_entry(const int8_t* entry, uint32_t signs, int8_t* out) {
  for (int j = 0; j < width; ++j) out[j] = static_cast<int8_t>((signs >> j) & 1 ? -entry[j] : entry[j]);
}

// IQ2_XXS (66 bytes): d; per 32 weights two words: four grid indices (a byte each, 8 weights each), then four 7-bit
// sign indices and the scale in the top nibble.
void iq2_xxs(const uint8_t* b, const Tables& t, int8_t* out) {
  for (int g = 0; g < 8; ++g) {
    const uint8_t* q = b + 2 + 8 * g;
    const uint32_t aux = u32(q + 4);
    for (int l = 0; l < 4; ++l) signed_entry<8>(t.grid + 8 * q[l], t.ksigns[(aux >> (7 * l)) & 127], out + 32 * g + 8 * l);
  }
}

// IQ2_XS (74 bytes): d; 32 words of a 9-bit grid index and a 7-bit sign index, 8 weights each; scales after.
void iq2_xs(const uint8_t* b, const Tables& t, int8_t* out) {
  for (int i = 0; i < 32; ++i) {
    const uint16_t q = u16(b + 2 + 2 * i);
    signed_entry<8>(t.grid + 8 * (q & 511), t.ksigns[q >> 9], out + 8 * i);
  }
}

// IQ2_S (82 bytes): d; 32 grid indices' low bytes; 32 sign bytes; their high 2 bits, four to a byte; scales after.
void iq2_s(const uint8_t* b, const Tables& t, int8_t* out) {
  const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66;
  for (int i = 0; i < 32; ++i) {
    const int index = qs[i] | (((qh[i / 4] >> (2 * (i % 4))) & 3) << 8);
    signed_entry<8>(t.grid + 8 * index, signs[i], out + 8 * i);
  }
}

// IQ3_XXS (98 bytes): d; 64 grid indices (4 weights each); per 32 weights a word of four 7-bit sign indices (8
// weights each) and the scale in the top nibble.
void iq3_xxs(const uint8_t* b, const Tables& t, int8_t* out) {
  const uint8_t *qs = b + 2, *words = b + 66;
  for (int g = 0; g < 8; ++g) {
    const uint32_t aux = u32(words + 4 * g);
    for (int l = 0; l < 4; ++l) {
      const uint32_t signs = t.ksigns[(aux >> (7 * l)) & 127];
      int8_t* o = out + 32 * g + 8 * l;
      signed_entry<4>(t.grid + 4 * qs[8 * g + 2 * l], signs, o);
      signed_entry<4>(t.grid + 4 * qs[8 * g + 2 * l + 1], signs >> 4, o + 4);
    }
  }
}

// IQ3_S (110 bytes): d; 64 grid indices' low bytes (4 weights each); their high bits, eight to a byte; one sign bit
// a weight; scales after.
void iq3_s(const uint8_t* b, const Tables& t, int8_t* out) {
  const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74;
  for (int i = 0; i < 64; ++i) {
    const int index = qs[i] | (((qh[i / 8] >> (i % 8)) & 1) << 8);
    signed_entry<4>(t.grid + 4 * index, signs[i / 2] >> (4 * (i % 2)), out + 4 * i);
  }
}

// 8 weights of an IQ1 grid entry (-8, 0, 8 in code units) plus the group's delta (+-1).
void iq1_entry(const int8_t* entry, int delta, int8_t* out) {
  for (int j = 0; j < 8; ++j) out[j] = static_cast<int8_t>(entry[j] + delta);
}

// IQ1_S (50 bytes): d; 32 grid indices' low bytes (8 weights each); per 32 weights a word: four 3-bit high parts,
// the scale (bits 12-14) and the delta's sign (bit 15).
void iq1_s(const uint8_t* b, const Tables& t, int8_t* out) {
  const uint8_t *qs = b + 2, *words = b + 34;
  for (int g = 0; g < 8; ++g) {
    const uint16_t h = u16(words + 2 * g);
    const int delta = (h & 0x8000) ? -1 : 1;
    for (int l = 0; l < 4; ++l) {
      iq1_entry(t.grid + 8 * (qs[4 * g + l] | (((h >> (3 * l)) & 7) << 8)), delta, out + 32 * g + 8 * l);
    }
  }
}

// IQ1_M (56 bytes): 32 grid indices' low bytes; a nibble each: 3 high bits and the delta's sign; scales and d after.
void iq1_m(const uint8_t* b, const Tables& t, int8_t* out) {
  const uint8_t *qs = b, *qh = b + 32;
  for (int i = 0; i < 32; ++i) {
    const int nibble = qh[i / 2] >> (4 * (i % 2));
    iq1_entry(t.grid + 8 * (qs[i] | ((nibble & 7) << 8)), (nibble & 8) ? -1 : 1, out + 8 * i);
  }
}

// TQ1_0 (54 bytes): base-3 digits, five a byte in 48 bytes and four a byte in 4; the digit m of byte x is the top
// of (x * 3^m mod 256) * 3 / 256, stored as q + 1.
int8_t tq_digit(int x, int m) {
  constexpr std::array<int, 5> pow3 = {1, 3, 9, 27, 81};
  return static_cast<int8_t>(((((x * pow3[m]) & 255) * 3) >> 8) - 1);
}

void tq1_0(const uint8_t* b, const Tables&, int8_t* out) {
  const auto digit = tq_digit;
  int n = 0;
  for (int m = 0; m < 5; ++m)
    for (int j = 0; j < 32; ++j) out[n++] = digit(b[j], m);
  for (int m = 0; m < 5; ++m)
    for (int j = 0; j < 16; ++j) out[n++] = digit(b[32 + j], m);
  for (int m = 0; m < 4; ++m)
    for (int j = 0; j < 4; ++j) out[n++] = digit(b[48 + j], m);
}

// TQ2_0 (66 bytes): 2-bit q + 1, four a byte: weight 128 h + 32 l + j in bits 2l of byte 32 h + j.
void tq2_0(const uint8_t* b, const Tables&, int8_t* out) {
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 4; ++l)
      for (int j = 0; j < 32; ++j) out[128 * h + 32 * l + j] = static_cast<int8_t>(((b[32 * h + j] >> (2 * l)) & 3) - 1);
}

struct Format {
  int64_t bytes;      // of a block of 256 weights (0: not a grid or ternary type)
  int64_t grid_size;  // int8 values of its grid, entries x width: every index its bits can form (0: no grid)
  BlockDecoder decode;
};

// by ggml type id
Format format_of(int64_t ggml_type) {
  switch (ggml_type) {
    case 16: return {66, 256 * 8, iq2_xxs};
    case 17: return {74, 512 * 8, iq2_xs};
    case 18: return {98, 256 * 4, iq3_xxs};
    case 19: return {50, 2048 * 8, iq1_s};
    case 21: return {110, 512 * 4, iq3_s};
    case 22: return {82, 1024 * 8, iq2_s};
    case 29: return {56, 2048 * 8, iq1_m};
    case 34: return {54, 0, tq1_0};
    case 35: return {66, 0, tq2_0};
    default: return {0, 0, nullptr};
  }
}

}  // namespace

int64_t grid_block_bytes(int64_t ggml_type) { return format_of(ggml_type).bytes; }

int64_t grid_size(int64_t ggml_type) { return format_of(ggml_type).grid_size; }

void grid_codes(const uint8_t* blocks, int64_t n, int64_t ggml_type, const int8_t* grid, const uint8_t* ksigns,
                int8_t* out) {
  const Format f = format_of(ggml_type);
  const Tables t{grid, ksigns};
#pragma omp parallel for schedule(static) if (n >= 1024)
  for (int64_t i = 0; i < n; ++i) f.decode(blocks + i * f.bytes, t, out + i * 256);
}

namespace {

// Each block's codes as their indices through `lookup` (index [256]), handed to write(i, index) for block i, blocks
// in parallel; returns how many codes the table lacks (indices above 15).
template <typename Write>
int64_t each_block_indices(const uint8_t* blocks, int64_t n, int64_t ggml_type, const int8_t* grid,
                           const uint8_t* ksigns, const uint8_t* lookup, Write&& write) {
  const Format f = format_of(ggml_type);
  const Tables t{grid, ksigns};
  int64_t missing = 0;
#pragma omp parallel for schedule(static) reduction(+ : missing) if (n >= 1024)
  for (int64_t i = 0; i < n; ++i) {
    int8_t codes[256];
    f.decode(blocks + i * f.bytes, t, codes);
    uint8_t index[256];
    for (int j = 0; j < 256; ++j) {
      index[j] = lookup[static_cast<uint8_t>(codes[j])];
      missing += index[j] > 15;
    }
    write(i, index);
  }
  return missing;
}

}  // namespace

int64_t grid_indices(const uint8_t* blocks, int64_t n, int64_t ggml_type, const int8_t* grid, const uint8_t* ksigns,
                     const uint8_t* lookup, int bias, int8_t* out) {
  return each_block_indices(blocks, n, ggml_type, grid, ksigns, lookup, [&](int64_t i, const uint8_t (&index)[256]) {
    for (int j = 0; j < 256; ++j) out[i * 256 + j] = static_cast<int8_t>(index[j] - bias);
  });
}

int64_t grid_q4_pairs(const uint8_t* blocks, int64_t n, int64_t ggml_type, const int8_t* grid, const uint8_t* ksigns,
                      const uint8_t* lookup, uint8_t* out) {
  return each_block_indices(blocks, n, ggml_type, grid, ksigns, lookup, [&](int64_t i, const uint8_t (&index)[256]) {
    // per group of 32 (8 chunks of 4 codes), byte (c, e): code 4c + e in the low nibble, 4c + 2 + e in the high one
    uint8_t* o = out + i * 128;
    for (int g = 0; g < 8; ++g)
      for (int c = 0; c < 8; ++c)
        for (int e = 0; e < 2; ++e) {
          const uint8_t* q = index + 32 * g + 4 * c + e;
          o[16 * g + 2 * c + e] = static_cast<uint8_t>((q[0] & 15) | (q[2] << 4));
        }
  });
}

}  // namespace lmrpc
