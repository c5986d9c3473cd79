// Paged attention and RoPE with cache writes, one query at a time in a fixed order (route-invariant).
//
// Cache layout of one layer (page_size P, a multiple of 16; storage float32 or bfloat16):
//   keys   [pages][kv_heads][head_dim][P]   (transposed within a page: 16 keys' scores are one vector product)
//   values [pages][kv_heads][P][head_dim]
// A sequence's position i lives in page block_table[i / P] at offset i % P.
#pragma once

#include <cstdint>

namespace lmrpc {

struct CacheView {
  void* keys;        // see the layout above
  void* values;
  bool bf16;         // storage: bfloat16 (else float32)
  int64_t kv_heads;
  int64_t head_dim;
  int64_t page_size;
};

struct RopeArgs {
  const float* qkv;        // [t, qkv_stride]: q heads, then k heads, then v heads, each head_dim wide
  int64_t t;               // tokens
  int64_t qkv_stride;
  int64_t heads;           // query heads
  const int64_t* positions;  // [t]
  const float* cos;        // [positions, head_dim]
  const float* sin;        // [positions, head_dim], first half negated (rotate-half folded in)
  const float* q_norm;     // [head_dim] per-head RMSNorm of q before RoPE (Qwen3), or null
  const float* k_norm;     // likewise for k
  float eps;
  const int64_t* slots;    // [t] page * page_size + offset of each token's key and value
  float* q_out;            // [t, heads, head_dim]
};

// Rotate q and k; write q to q_out, k and v (rounded to the storage dtype) into the cache.
void rope_store(const RopeArgs& a, const CacheView& cache);

struct AttentionArgs {
  const float* q;             // [t, heads, head_dim]
  int64_t t;
  int64_t heads;
  const int32_t* block_table;  // [sequences, table_width] page ids
  int64_t table_width;
  const int32_t* token_seq;   // [t] the sequence (row of block_table) of each query
  const int32_t* token_ctx;   // [t] keys it sees: positions 0 .. token_ctx - 1 of its sequence
  float scale;
  float* out;                 // [t, heads * head_dim]
};

// Causal attention of every query over its sequence's cached keys and values.
void paged_attention(const AttentionArgs& a, const CacheView& cache);

// The route paged_attention takes for t queries of `heads` query heads on `threads` threads: items of one query each
// (attention.cpp), or few queries with the threads sharing each kv head (attention_few.cpp). The one decision
// paged_attention follows; tests ask it, so a route they cover cannot fall out of use unnoticed.
enum class AttentionRoute { kQueries, kFewQueries };
AttentionRoute attention_route(int64_t t, int64_t heads, const CacheView& cache, int64_t threads);

}  // namespace lmrpc
