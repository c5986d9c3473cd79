// Bindings' side of attention: cache tensors as a CacheView, and checked wrappers of the RoPE/cache-write and
// paged-attention kernels. Included by module.cpp only.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>

#include "attention.h"
#include "py_linear.h"

namespace lmrpc_py {

inline lmrpc::CacheView cache_view(const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.is_contiguous() && values.is_contiguous(),
              "caches: contiguous keys [pages, kv_heads, head_dim, P] and values [pages, kv_heads, P, head_dim]");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              "caches: float32 or bfloat16");
  const int64_t kvh = keys.size(1), hd = keys.size(2), page = keys.size(3);
  TORCH_CHECK(values.size(0) == keys.size(0) && values.size(1) == kvh && values.size(2) == page &&
                  values.size(3) == hd, "keys and values disagree in shape");
  TORCH_CHECK(page % 16 == 0, "page size must be a multiple of 16");
  return lmrpc::CacheView{keys.data_ptr(), values.data_ptr(), keys.scalar_type() == at::kBFloat16, kvh, hd, page};
}

inline void check_i64(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() && t.numel() == n, name,
              ": int64 [", n, "]");
}

inline void check_i32(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous() && t.numel() == n, name,
              ": int32 [", n, "]");
}

// q_out [t, heads, head_dim] = RoPE(q); keys and values of every token written into the cache at its slot.
inline void rope_store(const at::Tensor& qkv, int64_t heads, const at::Tensor& positions, const at::Tensor& cos,
                const at::Tensor& sin, const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                double eps, const at::Tensor& slots, at::Tensor& keys, at::Tensor& values, at::Tensor& q_out) {
  const lmrpc::CacheView c = cache_view(keys, values);
  const int64_t t = qkv.size(0), hd = c.head_dim;
  check_f32_rows(qkv, (heads + 2 * c.kv_heads) * hd, "qkv");
  check_i64(positions, t, "positions");
  check_i64(slots, t, "slots");
  TORCH_CHECK(heads % c.kv_heads == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "cos, sin: float32 [positions, head_dim]");
  TORCH_CHECK(q_out.scalar_type() == at::kFloat && q_out.is_contiguous() && q_out.numel() == t * heads * hd,
              "q_out: float32 [t, heads, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t capacity = keys.size(0) * c.page_size;
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos.size(0), "position out of the RoPE table");
    TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "slot out of the cache");
  }
  for (const auto* norm : {&q_norm, &k_norm}) {
    if (norm->has_value()) {
      TORCH_CHECK((*norm)->scalar_type() == at::kFloat && (*norm)->numel() == hd && (*norm)->is_contiguous(),
                  "q/k norm weights: float32 [head_dim]");
    }
  }
  lmrpc::RopeArgs a{qkv.data_ptr<float>(), t, qkv.stride(0), heads, pos, cos.data_ptr<float>(), sin.data_ptr<float>(),
                    ptr_or_null<float>(q_norm), ptr_or_null<float>(k_norm), static_cast<float>(eps), slot,
                    q_out.data_ptr<float>()};
  lmrpc::rope_store(a, c);
}

// out [t, heads * head_dim] = attention of each query over positions 0 .. token_ctx - 1 of its sequence.
inline void paged_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                     const at::Tensor& block_table, const at::Tensor& token_seq, const at::Tensor& token_ctx,
                     double scale, at::Tensor& out) {
  const lmrpc::CacheView c = cache_view(keys, values);
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3 && q.size(2) == c.head_dim &&
                  q.size(1) % c.kv_heads == 0, "q: float32 [t, heads, head_dim]");
  const int64_t t = q.size(0), heads = q.size(1);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == t * heads * c.head_dim,
              "out: float32 [t, heads * head_dim]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.is_contiguous(),
              "block_table: int32 [sequences, width]");
  check_i32(token_seq, t, "token_seq");
  check_i32(token_ctx, t, "token_ctx");
  const int32_t* seq = token_seq.data_ptr<int32_t>();
  const int32_t* ctx = token_ctx.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t width = block_table.size(1), pages = keys.size(0);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(seq[i] >= 0 && seq[i] < block_table.size(0), "token_seq out of the block table");
    TORCH_CHECK(ctx[i] >= 1 && ctx[i] <= width * c.page_size, "token_ctx out of the block table");
    for (int64_t p = 0; p < (ctx[i] + c.page_size - 1) / c.page_size; ++p) {
      const int32_t page = table[seq[i] * width + p];
      TORCH_CHECK(page >= 0 && page < pages, "page id out of the cache");
    }
  }
  lmrpc::AttentionArgs a{q.data_ptr<float>(), t, heads, table, width, seq, ctx, static_cast<float>(scale),
                         out.data_ptr<float>()};
  lmrpc::paged_attention(a, c);
}

// "few_queries" or "queries": the route paged_attention takes for t queries over a cache of this shape, on `threads`
// threads (the tests' check that the route they cover is the one taken).
inline std::string attention_route(int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim, bool bf16,
                                   int64_t threads) {
  TORCH_CHECK(t >= 1 && kv_heads >= 1 && heads % kv_heads == 0 && head_dim >= 1 && threads >= 1,
              "attention_route: t, kv_heads, head_dim, threads >= 1 and heads a multiple of kv_heads");
  const lmrpc::CacheView c{nullptr, nullptr, bf16, kv_heads, head_dim, 16};
  return lmrpc::attention_route(t, heads, c, threads) == lmrpc::AttentionRoute::kFewQueries ? "few_queries"
                                                                                             : "queries";
}

}  // namespace lmrpc_py
