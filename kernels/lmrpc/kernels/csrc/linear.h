// Row-invariant matrix products y = x W^T over packed weights (dense float32 / bfloat16, or blocks of 4- or 8-bit
// integers with per-group scales), with the prologues and epilogues a decoder layer needs fused in.
#pragma once

#include <cstdint>

namespace lmrpc {

enum class WeightFormat : int32_t {
  F32 = 0,   // float32 values
  BF16 = 1,  // bfloat16 values
  Q4 = 2,    // 4-bit codes q in groups of 32, value (q - 8 if q4_signed else q) * scale + offset (table: T[q] * scale)
  Q8 = 3,    // signed 8-bit codes in groups of `group` elements, value q * scale (+ offset)
  Q6 = 4,    // Q8 whose codes lie in -32..31 (GGUF Q6_K; Q5 and Q3 for float32), held in 6 bits: see kQ6UnitBytes
  Q3 = 5,    // Q8 whose codes lie in -4..3 (GGUF Q3_K, Q2_K), held in 3 bits: see kQ3BlockBytes (bf16 products only)
  Q5 = 6,    // 5-bit codes q, value (q - 16 if q4_signed else q) * scale + offset (GGUF Q5_0, Q5_1, Q5_K), held as
             // kQ5BlockBytes says (bf16 products only)
};

// A Q6 weight holds Q8's kpair vectors (32 codes each, in Q8's order) four at a time, each four in 96 bytes: bytes
// 0-31 the low 4 bits of vectors 0 (low nibbles) and 1 (high nibbles), bytes 32-63 those of vectors 2 and 3, bytes
// 64-95 the top 2 bits of vector i in bits 2i, 2i + 1; each code stored as q + 32 (0..63). Groups are whole units
// (groups of a multiple of 4 inputs: 2 kpairs x 2 tiles), so Q8 vector v starts unit v / 4 and group g of a tile
// pair sits at 24 bytes per Q8 vector. Q5_K_M and Q4_K_M files' 5- and 6-bit tensors take 6 bits a code, not 8.
constexpr int64_t kQ6UnitBytes = 96;

// A Q3 weight holds Q8's kpair vectors sixteen at a time (a block: one tile pair's 8 kpairs, 16 inputs, of a group)
// in 192 bytes, three lines of 32 little-endian 16-bit words, one word per lane of a vector: word l of line j holds
// lane l of vector 5j + s in bits 3s..3s + 2 (s = 0..4) and bit j of lane l of vector 15 in bit 15; each code stored
// as q + 4 (0..7). A vector is then one shift of a line and one table lookup (vector 15: three lines' top bits).
// Groups are whole blocks (16 or 32 inputs), so Q8 vector v starts block v / 16 and a group of a tile pair sits at
// 12 bytes per Q8 vector. Q3_K_M and Q2_K files' bulk takes 3 bits a code (their own 3.44 and 2.63 bits a weight
// held in 3.56 and 4.13 with the scales), not Q6's 6.
constexpr int64_t kQ3BlockBytes = 192;

// A Q5 weight holds its codes as Q3 does, sixteen vectors to a block, in five lines of 32 16-bit words: word l of
// line j holds lane l of vector 3j + s in bits 5s..5s + 4 (s = 0..2) and bit j of lane l of vector 15 in bit 15; each
// code as the file stores it (0..31; q4_signed: value q - 16, GGUF Q5_0). A vector is one shift of a line and one
// table lookup (vpermw reads the index's 5 low bits). Q5_K_M files' bulk takes 5.625 bits a weight (file 5.5).
constexpr int64_t kQ5BlockBytes = 320;

// GGUF K-quant scales (Q4_K, Q5_K, Q6_K), kept as the file stores them instead of as one float per group: per
// output and super-block of 2^`super_shift` groups, fp16 d (and dmin); per output and group, 8-bit multipliers sc
// (and m). A group's scale is d * sc and its offset -(dmin * m) (exact in float32: an fp16 significand times an 8-bit
// integer fits float32's, so they are gguf's dequantize values to the bit). The products fold sums per super-block:
// each group's sum times sc, the super-block's total times d once (linear_kscales.h). A float32 per
// group would cost 2 bits per weight more than the file (Q4_K: 6 instead of 4.5); these, 0.625.
struct KScales {
  const uint16_t* d = nullptr;     // fp16 [n_pad / 32][supers][2][16], or null (scales are PackedWeight::scale)
  const uint16_t* dmin = nullptr;  // fp16 [n_pad / 32][supers][2][16], or null (no offsets)
  const uint8_t* sc = nullptr;     // [n_pad / 32][groups][2][16]: uint8, or int8 when sc_signed
  const uint8_t* m = nullptr;      // [n_pad / 32][groups][2][16] uint8, or null
  int super_shift = 0;             // log2 of the groups per super-block (8 or 16: 256 inputs of 32 or 16), so
                                   // a group finds its super-block by a shift, not a division per group
  bool sc_signed = false;          // Q6_K's multipliers are signed
  // A power of two every d stands times (GGUF grid formats: d / 8 is not always an fp16, d is): the products
  // fold with d and the epilogue multiplies their results by it, exactly as if each d were d * d_scale.
  float d_scale = 1.0f;
};

// How activations enter the products: rounded to bfloat16 (AVX512-BF16 dot products, float32 sums), or float32.
enum class Compute : int32_t { F32 = 0, BF16 = 1 };

// A weight [n, k] in lmrpc's tiled layout (see kernels/lmrpc/kernels/packing.py, which builds it).
// Outputs come in tiles of 16, tiles in pairs: n is padded to n_pad (a multiple of 32) with zero weights. Inputs
// come in pairs (kpairs): k is padded to k_pad (a multiple of 2, and of `group` when quantized) with zeros.
// Within a tile, kpair j holds [16 outputs][2 inputs]: for BF16 and Q8 one 64- or 32-byte vector per kpair (Q6: as
// Q8, four vectors in 96 bytes); Q4
// stores each group of 16 kpairs as 8 chunks of 32 bytes, byte 2*o+e of chunk c holding kpair 2c in its low nibble
// and kpair 2c+1 in its high nibble.
struct PackedWeight {
  WeightFormat format;
  int64_t n, k;          // logical output and input features
  int64_t n_pad, k_pad;  // padded sizes
  int64_t group;         // quantized: inputs per scale group (32 for Q4); dense: k_pad
  bool q4_signed;        // Q4_0 (q - 8) rather than Q4_1 (q with an offset); Q5: Q5_0 (q - 16)
  const void* data;      // packed codes or values
  const uint16_t* scale;   // quantized: fp16 [n_pad / 32][groups][2][16]; dense: null
  const uint16_t* offset;  // Q4 with offsets: fp16, laid out as scale; else null
  const float* bias;     // [n] or null
  KScales ks;            // K-quant scales (ks.d non-null), instead of `scale` and `offset`
  // Quantized weights with bfloat16 products: the codes once more, expanded to bfloat16 values (exact: small
  // integers) in the BF16 layout, or null. Products over many rows read these instead of expanding the codes on
  // every call; the sums and their order are the same, so the results are too (2 bytes per weight more memory).
  const uint16_t* codes = nullptr;
  // Q4 weights whose products take int8 activations at every row count (but after SILU_MUL): with bfloat16
  // compute on AVX512-VNNI (reading `vnni`), or float32 compute on AVX2 (reading the Q4 layout as it is).
  bool int8 = false;
  // Weights whose products take int16 activations at every row count (float32 compute on AVX2; linear_int16.cpp):
  // per row and group of 32 inputs, d = max |x| / 32767 and q = round(x / d). Each input is then within
  // max |x| / 65534 of its value, finer than bfloat16 rounding for all but the group's smallest inputs.
  bool int16 = false;
  // For the VNNI products: the codes once more, per tile pair and group 512 bytes: for quad q < 4, tile t, output
  // o, byte e: the code of k = 4q + e in the low nibble and of k = 4(q + 4) + e in the high nibble (at
  // (q * 2 + t) * 64 + 4 * o + e). Else null. It may be `data` itself (vnni_codes in place: the stored order is
  // gone; codes_in_vnni_order), so that the weight is not held twice: then no product of it takes float inputs,
  // and weight_rows reads this order.
  const uint8_t* vnni = nullptr;
  // Codes that index a table of int8 values instead of standing for themselves: Q4 codes (GGUF's IQ4_NL and IQ4_XS,
  // and the IQ3 grid formats: packing.Q4_TABLES) their 16 values, Q3 codes (the IQ2 and IQ1 grid formats:
  // packing.Q3_TABLES) as stored (q + 4, 0..7) the first 8, repeated in the last 8 so that an index's fourth bit
  // picks the same value. Only bfloat16 products take them (codes become values through Q4Table); float32
  // compute holds such a weight as Q8 (packing.py).
  bool code_table = false;
  int8_t code_values[16] = {};

  bool codes_in_vnni_order() const { return vnni != nullptr && vnni == data; }

  bool k_scaled() const { return ks.d != nullptr; }
  bool quantized() const {
    return format == WeightFormat::Q4 || format == WeightFormat::Q8 || format == WeightFormat::Q6 ||
           format == WeightFormat::Q3 || format == WeightFormat::Q5;
  }
  // Whether groups carry offsets (the products then need each row's group sums).
  bool has_offsets() const { return offset != nullptr || ks.dmin != nullptr; }
};

// What happens to each input row before it enters the products.
enum class Prologue : int32_t {
  NONE = 0,      // x as is
  RMS_NORM = 1,  // x * rsqrt(mean(x^2) + eps) * norm_weight
  SILU_MUL = 2,  // x holds [gate | up] (2k wide): silu(gate) * up
};

struct LinearArgs {
  const float* x;          // [m, x_stride] float32 input rows
  int64_t m;               // rows
  int64_t x_stride;        // floats between rows of x
  Prologue prologue;
  const float* norm_weight;  // RMS_NORM: [k]
  float eps;                 // RMS_NORM epsilon
  const float* residual;   // [m, residual_stride] added to the output, or null
  int64_t residual_stride;
  float* y;                // [m, y_stride] float32 output (y may alias residual: each element is read, then written)
  int64_t y_stride;
  // Row i of the product reads x row x_rows[i] (else i) and residual and y rows y_rows[i] (else i): a LoRA delta
  // runs over its adapter's rows of a step where they lie, with no gathered copies (the same operations per row).
  const int64_t* x_rows;
  const int64_t* y_rows;
};

// y[i, :n] = prologue(x[i]) W^T (+ bias) (+ residual[i]) for every row i. Each element is computed with the same
// operations whatever m is and however rows or tiles are split between threads.
void linear(const PackedWeight& w, Compute compute, const LinearArgs& args);

// One product of a batch run by linear_batch.
struct LinearJob {
  const PackedWeight* w;
  LinearArgs args;
};

// linear() of every job (one compute type), their output tiles shared between the threads of one parallel region:
// a step's small LoRA products and the base product beside them cost one thread fork, not one each. Each job's
// outputs are computed exactly as linear() computes them. Jobs must not write what another job reads.
void linear_batch(const LinearJob* jobs, int64_t count, Compute compute);

// rows [count, n ... ] of the dequantized weight W[ids[i], :k] as float32 (embedding lookups from a tied weight).
void weight_rows(const PackedWeight& w, const int64_t* ids, int64_t count, float* out, int64_t out_stride);

// The codes of a quantized weight as bfloat16 values in the BF16 layout: out [n_pad * k_pad] (PackedWeight::codes).
void expand_codes(const PackedWeight& w, uint16_t* out);

// The codes of a Q4 weight in the layout of PackedWeight::vnni: out [n_pad * k_pad / 2], which may be w.data
// itself (rewritten in place: each tile pair's group keeps its 512 bytes).
void vnni_codes(const PackedWeight& w, uint8_t* out);

// Whether products of such a weight can take int16 activations (Q4; Q8 and Q6 in groups of 32, or of 16 without
// offsets), where the build has them (native_avx2).
bool int16_takes(WeightFormat format, int64_t group, int64_t k_pad, bool has_offsets);

bool native_bf16();  // compiled with AVX512-BF16 products
bool native_avx2();  // compiled with AVX2 + FMA products (a CPU without AVX512-BF16)
bool native_vnni();  // compiled with AVX512-VNNI products (Q4 weights with int8 activations, bfloat16 compute)

}  // namespace lmrpc
