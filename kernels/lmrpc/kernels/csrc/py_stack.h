// DecoderStack: every decoder layer of a Llama-family model run in one call, with the GIL released for the whole
// forward (the layer-by-layer Python loop takes and gives the GIL back at each of its ~150 calls per step, racing the
// event loop that streams outputs). The same kernels in the same order as the Python loop (models/llama.py,
// DecoderLayer.__call__), so the same bits. Included by module.cpp only.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <optional>
#include <vector>

#include "py_attention.h"
#include "py_linear.h"

namespace lmrpc_py {

// One decoder layer: its four products and the norms fused into them.
struct StackLayer {
  std::shared_ptr<PackedLinear> qkv, o, gate_up, down;
  at::Tensor input_norm, post_attention_norm;  // float32 [hidden]
  std::optional<at::Tensor> q_norm, k_norm;    // float32 [head_dim] (Qwen3), or none
};

class DecoderStack {
 public:
  DecoderStack(std::vector<StackLayer> layers, at::Tensor keys, at::Tensor values, at::Tensor cos, at::Tensor sin,
               int64_t heads, double eps, double qk_eps, double scale)
      : layers_(std::move(layers)), keys_(keys), values_(values), cos_(cos), sin_(sin), heads_(heads), eps_(eps),
        qk_eps_(qk_eps), scale_(scale) {
    TORCH_CHECK(!layers_.empty() && keys.dim() == 5 && values.dim() == 5 &&
                    keys.size(0) == static_cast<int64_t>(layers_.size()) && values.size(0) == keys.size(0),
                "caches: [layers, pages, ...], one per layer");
  }

  // x [T, hidden] float32 (updated in place: the residual stream) -> x after every layer.
  at::Tensor forward(at::Tensor x, const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& block_table,
                     const at::Tensor& token_seq, const at::Tensor& token_ctx) const {
    TORCH_CHECK(x.is_contiguous(), "x: contiguous [T, hidden]");
    const int64_t t = x.size(0), head_dim = keys_.size(3);
    // Scratch of one layer, reused by the next (every layer has the same widths).
    at::Tensor q = at::empty({t, heads_, head_dim}, x.options());
    at::Tensor attn = at::empty({t, heads_ * head_dim}, x.options());
    at::Tensor qkv = at::empty({t, layers_.front().qkv->n()}, x.options());
    at::Tensor gate_up = at::empty({t, layers_.front().gate_up->n()}, x.options());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      l.qkv->run(x, &l.input_norm, eps_, false, nullptr, qkv);
      at::Tensor keys = keys_.select(0, static_cast<int64_t>(i)), values = values_.select(0, static_cast<int64_t>(i));
      rope_store(qkv, heads_, positions, cos_, sin_, l.q_norm, l.k_norm, qk_eps_, slots, keys, values, q);
      paged_attention(q, keys, values, block_table, token_seq, token_ctx, scale_, attn);
      l.o->run(attn, nullptr, 0.0, false, &x, x);
      l.gate_up->run(x, &l.post_attention_norm, eps_, false, nullptr, gate_up);
      l.down->run(gate_up, nullptr, 0.0, true, &x, x);
    }
    return x;
  }

 private:
  std::vector<StackLayer> layers_;
  at::Tensor keys_, values_;  // [layers, pages, kv_heads, head_dim, P], [layers, pages, kv_heads, P, head_dim]
  at::Tensor cos_, sin_;      // [positions, head_dim] float32
  int64_t heads_;
  double eps_, qk_eps_, scale_;
};

}  // namespace lmrpc_py
