// DecoderStack: every decoder layer of a Llama-family model run in one call, with the GIL released for the whole
// forward (the layer-by-layer Python loop takes and gives the GIL back at each of its ~150 calls per step, racing the
// event loop that streams outputs). The same kernels in the same order as the Python loop (models/llama.py,
// DecoderLayer.__call__, and lora/products.py's add_delta for rows under LoRA adapters), so the same bits. Included
// by module.cpp only.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <memory>
#include <optional>
#include <utility>
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

// One LoRA adapter's deltas on every layer (lora/products.py's LayerLora): per layer and product (qkv, o, gate_up,
// down) the low-rank pair x -> b(a(x)), or none where the adapter leaves that product alone.
struct StackAdapter {
  using Pair = std::pair<std::shared_ptr<PackedLinear>, std::shared_ptr<PackedLinear>>;  // (a, b)
  std::vector<std::array<std::optional<Pair>, 4>> layers;

  explicit StackAdapter(const std::vector<std::vector<std::optional<Pair>>>& per_layer) {
    for (const auto& products : per_layer) {
      TORCH_CHECK(products.size() == 4, "a layer's deltas: (qkv, o, gate_up, down), each (a, b) or None");
      std::array<std::optional<Pair>, 4> layer;
      for (size_t p = 0; p < 4; ++p) {
        if (products[p].has_value()) {
          const Pair& pair = *products[p];
          TORCH_CHECK(pair.first && pair.second && pair.first->n() == pair.second->k(),
                      "a delta's b reads what its a writes");
          TORCH_CHECK(pair.first->compute() == pair.second->compute(), "a delta's products share a compute type");
        }
        layer[p] = products[p];
      }
      layers.push_back(std::move(layer));
    }
  }
};

// The rows of one step that run under one adapter (ascending int64 indices into the step's rows).
using StackGroup = std::pair<at::Tensor, std::shared_ptr<StackAdapter>>;

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

  // x [T, hidden] float32 (updated in place: the residual stream) -> x after every layer. lora: the step's rows
  // under adapters, grouped by adapter (disjoint groups): each product of those rows gets its adapter's delta.
  at::Tensor forward(at::Tensor x, const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& block_table,
                     const at::Tensor& token_seq, const at::Tensor& token_ctx,
                     const std::vector<StackGroup>& lora) const {
    TORCH_CHECK(x.is_contiguous(), "x: contiguous [T, hidden]");
    const int64_t t = x.size(0), head_dim = keys_.size(3);
    // Scratch of one layer, reused by the next (every layer has the same widths).
    at::Tensor q = at::empty({t, heads_, head_dim}, x.options());
    at::Tensor attn = at::empty({t, heads_ * head_dim}, x.options());
    at::Tensor qkv = at::empty({t, layers_.front().qkv->n()}, x.options());
    at::Tensor gate_up = at::empty({t, layers_.front().gate_up->n()}, x.options());
    const Deltas deltas = check_lora(lora, t, x.options());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      project(deltas, i, 0, *l.qkv, x, &l.input_norm, eps_, false, nullptr, qkv);
      at::Tensor keys = keys_.select(0, static_cast<int64_t>(i)), values = values_.select(0, static_cast<int64_t>(i));
      rope_store(qkv, heads_, positions, cos_, sin_, l.q_norm, l.k_norm, qk_eps_, slots, keys, values, q);
      paged_attention(q, keys, values, block_table, token_seq, token_ctx, scale_, attn);
      project(deltas, i, 1, *l.o, attn, nullptr, 0.0, false, &x, x);
      project(deltas, i, 2, *l.gate_up, x, &l.post_attention_norm, eps_, false, nullptr, gate_up);
      project(deltas, i, 3, *l.down, gate_up, nullptr, 0.0, true, &x, x);
    }
    return x;
  }

 private:
  // The step's adapter groups, checked, and the scratch their low-rank products write: group g's a outputs are
  // rows [offset[g], offset[g] + n) of `ranks` (one buffer for the step, every layer and product reusing it).
  struct Deltas {
    const std::vector<StackGroup>* groups;
    std::vector<int64_t> offset;
    at::Tensor ranks;  // [rows under adapters, widest a product]
  };

  Deltas check_lora(const std::vector<StackGroup>& lora, int64_t t, const at::TensorOptions& options) const {
    Deltas d{&lora, {}, {}};
    int64_t rows = 0, widest = 0;
    for (const StackGroup& g : lora) {
      const at::Tensor& r = g.first;
      TORCH_CHECK(r.scalar_type() == at::kLong && r.dim() == 1 && r.is_contiguous() && r.device().is_cpu(),
                  "a group's rows: contiguous int64 [n]");
      TORCH_CHECK(g.second && g.second->layers.size() == layers_.size(), "an adapter's deltas: one per layer");
      const int64_t* p = r.data_ptr<int64_t>();
      for (int64_t j = 0; j < r.numel(); ++j) TORCH_CHECK(p[j] >= 0 && p[j] < t, "a group's row out of range");
      for (size_t i = 0; i < layers_.size(); ++i) {
        const StackLayer& l = layers_[i];
        const PackedLinear* base[4] = {l.qkv.get(), l.o.get(), l.gate_up.get(), l.down.get()};
        for (size_t p2 = 0; p2 < 4; ++p2) {
          const auto& pair = g.second->layers[i][p2];
          if (!pair.has_value()) continue;
          TORCH_CHECK(pair->first->k() == base[p2]->k() && pair->second->n() == base[p2]->n() &&
                          pair->first->compute() == base[p2]->compute(),
                      "an adapter's delta must match its base product's widths and compute type");
          widest = std::max(widest, pair->first->n());
        }
      }
      d.offset.push_back(rows);
      rows += r.numel();
    }
    d.ranks = at::empty({rows, std::max<int64_t>(widest, 1)}, options);
    return d;
  }

  // y = base(x) as in the Python loop, then each group's delta on its rows as add_delta computes it: a over the
  // group's rows of x with the base product's prologue (norm or silu), then b over those with the rows of y as
  // residual, written back to them. The base product and the a products read only x and run in one batch; the b
  // products, which read y, in a second one.
  void project(const Deltas& d, size_t layer, size_t product, const PackedLinear& base, const at::Tensor& x,
               const at::Tensor* norm, double eps, bool silu, const at::Tensor* residual, const at::Tensor& y) const {
    if (d.groups->empty()) {
      base.run(x, norm, eps, silu, residual, y);
      return;
    }
    TORCH_CHECK(y.size(0) == x.size(0) && (residual == nullptr || residual->size(0) == x.size(0)),
                "out and residual: as many rows as x");
    std::vector<lmrpc::LinearJob> jobs{{&base.weight(), base.args(x, x.size(0), norm, eps, silu, residual, y)}};
    std::vector<lmrpc::LinearJob> second;
    for (size_t g = 0; g < d.groups->size(); ++g) {
      const StackGroup& group = (*d.groups)[g];
      const auto& pair = group.second->layers[layer][product];
      const int64_t n = group.first.numel();
      if (!pair.has_value() || n == 0) continue;
      const int64_t* rows = group.first.data_ptr<int64_t>();
      const at::Tensor h = d.ranks.narrow(0, d.offset[g], n);  // [n, >= ranks]
      jobs.push_back({&pair->first->weight(), pair->first->args(x, n, norm, eps, silu, nullptr, h, rows, nullptr)});
      second.push_back({&pair->second->weight(), pair->second->args(h, n, nullptr, 0.0, false, &y, y, nullptr, rows)});
    }
    lmrpc::linear_batch(jobs.data(), static_cast<int64_t>(jobs.size()), base.compute());
    lmrpc::linear_batch(second.data(), static_cast<int64_t>(second.size()), base.compute());
  }

 private:
  std::vector<StackLayer> layers_;
  at::Tensor keys_, values_;  // [layers, pages, kv_heads, head_dim, P], [layers, pages, kv_heads, P, head_dim]
  at::Tensor cos_, sin_;      // [positions, head_dim] float32
  int64_t heads_;
  double eps_, qk_eps_, scale_;
};

}  // namespace lmrpc_py
