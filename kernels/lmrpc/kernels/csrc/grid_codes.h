// GGUF's grid and ternary blocks (IQ1_S .. IQ3_S, TQ1_0, TQ2_0) -> each weight's integer code (grid_codes.cpp).
#pragma once

#include <cstdint>

namespace lmrpc {

// Bytes of a block of 256 weights of that ggml type, or 0 where it is not a grid or ternary type.
int64_t grid_block_bytes(int64_t ggml_type);

// The int8 values grid_codes reads of that type's grid (entries x width, every index its bits can form; 0: none).
int64_t grid_size(int64_t ggml_type);

// blocks [n, grid_block_bytes] -> out [n, 256]: each weight's code in the units of `grid` ([entries, 8 or 4], the
// format's grid already scaled by the caller; unused by TQ1_0 and TQ2_0); `ksigns` [128]: the sign bits of 8
// weights by 7-bit index (IQ2_XXS, IQ2_XS, IQ3_XXS). IQ1 codes add their group's delta, +-1.
void grid_codes(const uint8_t* blocks, int64_t n, int64_t ggml_type, const int8_t* grid, const uint8_t* ksigns,
                int8_t* out);

// The same codes as 4-bit indices, through `lookup` [256] (a code's byte -> its index in the weight's table of 16
// values, or above 15 where the table lacks it), as the Q4 layout's code pairs: out [n, 128], per group of 32 byte
// (c, e) of 16 holding index 4c + e in its low nibble and 4c + 2 + e in its high one (packing.code_pairs). Returns
// how many codes the table lacks (0, or the weight cannot be held so).
int64_t grid_q4_pairs(const uint8_t* blocks, int64_t n, int64_t ggml_type, const int8_t* grid, const uint8_t* ksigns,
                      const uint8_t* lookup, uint8_t* out);

// The same indices a byte each, less `bias`: out [n, 256] (the Q3 layout's codes, index - 4, for the formats with 6
// values: IQ2, IQ1). Returns how many codes the table lacks.
int64_t grid_indices(const uint8_t* blocks, int64_t n, int64_t ggml_type, const int8_t* grid, const uint8_t* ksigns,
                     const uint8_t* lookup, int bias, int8_t* out);

}  // namespace lmrpc
