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
#include <tuple>
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
// down) an A product and one B product per targeted module (its rank columns of A's output -> its slice of the
// product's output), or none where the adapter leaves that product alone.
struct StackAdapter {
  using Part = std::tuple<std::shared_ptr<PackedLinear>, int64_t, int64_t>;  // (b, rank_start, out_start)
  using Delta = std::pair<std::shared_ptr<PackedLinear>, std::vector<Part>>;  // (a, parts)
  std::vector<std::array<std::optional<Delta>, 4>> layers;

  explicit StackAdapter(const std::vector<std::vector<std::optional<Delta>>>& per_layer) {
    for (const auto& products : per_layer) {
      TORCH_CHECK(products.size() == 4, "a layer's deltas: (qkv, o, gate_up, down), each (a, parts) or None");
      std::array<std::optional<Delta>, 4> layer;
      for (size_t p = 0; p < 4; ++p) {
        if (products[p].has_value()) {
          const Delta& d = *products[p];
          TORCH_CHECK(d.first && !d.second.empty(), "a delta: an A product and at least one B product");
          for (const Part& part : d.second) {
            const auto& b = std::get<0>(part);
            TORCH_CHECK(b && std::get<1>(part) >= 0 && std::get<1>(part) + b->k() <= d.first->n() &&
                            std::get<2>(part) >= 0 && b->compute() == d.first->compute(),
                        "a B product reads columns of its A product's output, in the same compute type");
          }
        }
        layer[p] = products[p];
      }
      layers.push_back(std::move(layer));
    }
  }
};

// The rows of one step that run under one adapter (ascending int64 indices into the step's rows).
using StackGroup = std::pair<at::Tensor, std::shared_ptr<StackAdapter>>;

// Rows of a step's MLP computed at once (DecoderStack::forward).
constexpr int64_t kMlpRows = 128;

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
  // positions [T]: the row of the rope tables each token rotates by; rope_cos/rope_sin, when given, are the step's
  // own tables (M-RoPE: one row per token, positions = arange(T)) in place of the model's.
  at::Tensor forward(at::Tensor x, const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& block_table,
                     const at::Tensor& token_seq, const at::Tensor& token_ctx,
                     const std::vector<StackGroup>& lora, const std::optional<at::Tensor>& rope_cos,
                     const std::optional<at::Tensor>& rope_sin) const {
    TORCH_CHECK(rope_cos.has_value() == rope_sin.has_value(), "rope_cos and rope_sin: both or neither");
    const at::Tensor& cos = rope_cos.has_value() ? *rope_cos : cos_;
    const at::Tensor& sin = rope_sin.has_value() ? *rope_sin : sin_;
    TORCH_CHECK(x.is_contiguous(), "x: contiguous [T, hidden]");
    const int64_t t = x.size(0), head_dim = keys_.size(3);
    // Scratch of one layer, reused by the next (every layer has the same widths).
    at::Tensor q = at::empty({t, heads_, head_dim}, x.options());
    at::Tensor attn = at::empty({t, heads_ * head_dim}, x.options());
    at::Tensor qkv = at::empty({t, layers_.front().qkv->n()}, x.options());
    Deltas deltas = check_lora(lora, t, x.options());
    // The MLP runs kMlpRows rows at a time where no adapter splits the rows: its [rows, 2 * ffn] scratch and the down
    // product's float inputs stay a chunk's (a 512-token step at 1.7B: 32 + 16 MB -> 8 + 4), for a process's peak
    // under load; a row's bits never depend on which rows share its product.
    const bool chunked = deltas.groups.empty();
    const int64_t mlp_rows = chunked ? std::min(t, kMlpRows) : t;
    at::Tensor gate_up = at::empty({mlp_rows, layers_.front().gate_up->n()}, x.options());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      project(deltas, i, 0, *l.qkv, x, &l.input_norm, eps_, false, nullptr, qkv);
      at::Tensor keys = keys_.select(0, static_cast<int64_t>(i)), values = values_.select(0, static_cast<int64_t>(i));
      rope_store(qkv, heads_, positions, cos, sin, l.q_norm, l.k_norm, qk_eps_, slots, keys, values, q);
      paged_attention(q, keys, values, block_table, token_seq, token_ctx, scale_, attn);
      project(deltas, i, 1, *l.o, attn, nullptr, 0.0, false, &x, x);
      for (int64_t r0 = 0; r0 < t; r0 += mlp_rows) {
        const int64_t n = std::min(mlp_rows, t - r0);
        at::Tensor rows = chunked ? x.narrow(0, r0, n) : x, scratch = gate_up.narrow(0, 0, n);
        project(deltas, i, 2, *l.gate_up, rows, &l.post_attention_norm, eps_, false, nullptr, scratch);
        project(deltas, i, 3, *l.down, scratch, nullptr, 0.0, true, &rows, rows);
      }
    }
    return x;
  }

 private:
  // The step's adapter groups, checked, and the scratch their low-rank products write: each group's A outputs are
  // its own n rows of `ranks` (one buffer for the step, every layer and product reusing it), and the job lists
  // every projection refills.
  struct Group {
    const int64_t* rows;  // [n] ascending indices into the step's rows
    int64_t n;
    const StackAdapter* adapter;
    float* h;  // its rows of `ranks`
  };
  struct Deltas {
    std::vector<Group> groups;
    at::Tensor ranks;  // [rows under adapters, widest A product]
    int64_t h_stride = 0;
    std::vector<lmrpc::LinearJob> first, second;
  };

  Deltas check_lora(const std::vector<StackGroup>& lora, int64_t t, const at::TensorOptions& options) const {
    Deltas d;
    int64_t rows = 0, widest = 1;
    std::vector<char> taken(lora.empty() ? 0 : t, 0);  // groups must be disjoint: their B products write their rows
    for (const StackGroup& g : lora) {
      const at::Tensor& r = g.first;
      TORCH_CHECK(r.scalar_type() == at::kLong && r.dim() == 1 && r.is_contiguous() && r.device().is_cpu(),
                  "a group's rows: contiguous int64 [n]");
      TORCH_CHECK(g.second && g.second->layers.size() == layers_.size(), "an adapter's deltas: one per layer");
      const int64_t* p = r.data_ptr<int64_t>();
      for (int64_t j = 0; j < r.numel(); ++j) {
        TORCH_CHECK(p[j] >= 0 && p[j] < t && !taken[p[j]], "a group's row out of range, or in two groups");
        taken[p[j]] = 1;
      }
      for (size_t i = 0; i < layers_.size(); ++i) {
        const StackLayer& l = layers_[i];
        const PackedLinear* base[4] = {l.qkv.get(), l.o.get(), l.gate_up.get(), l.down.get()};
        for (size_t p2 = 0; p2 < 4; ++p2) {
          const auto& delta = g.second->layers[i][p2];
          if (!delta.has_value()) continue;
          TORCH_CHECK(delta->first->k() == base[p2]->k() && delta->first->compute() == base[p2]->compute(),
                      "an adapter's A product must read its base product's input, in its compute type");
          for (const auto& part : delta->second) {
            TORCH_CHECK(std::get<2>(part) + std::get<0>(part)->n() <= base[p2]->n(),
                        "an adapter's B product must write within its base product's output");
          }
          widest = std::max(widest, delta->first->n());
        }
      }
      d.groups.push_back({p, r.numel(), g.second.get(), nullptr});
      rows += r.numel();
    }
    d.ranks = at::empty({rows, widest}, options);
    d.h_stride = widest;
    int64_t offset = 0;
    for (Group& g : d.groups) {
      g.h = d.ranks.data_ptr<float>() + offset * widest;
      offset += g.n;
    }
    d.first.reserve(1 + d.groups.size());
    d.second.reserve(4 * d.groups.size());
    return d;
  }

  // y = base(x) as in the Python loop, then each group's delta on its rows as add_delta computes it: A over the
  // group's rows of x with the base product's prologue (norm or silu), then each module's B over its columns of
  // that with its columns of the rows of y as residual, written back to them. The base product and the A products
  // read only x and run in one batch; the B products, which read y, in a second one. (Shapes were checked by
  // check_lora and the StackAdapter: the arguments are built here from pointers, no tensor ops per product.)
  void project(Deltas& d, size_t layer, size_t product, const PackedLinear& base, const at::Tensor& x,
               const at::Tensor* norm, double eps, bool silu, const at::Tensor* residual, const at::Tensor& y) const {
    if (d.groups.empty()) {
      base.run(x, norm, eps, silu, residual, y);
      return;
    }
    TORCH_CHECK(y.size(0) == x.size(0) && (residual == nullptr || residual->size(0) == x.size(0)),
                "out and residual: as many rows as x");
    const lmrpc::LinearArgs base_args = base.args(x, x.size(0), norm, eps, silu, residual, y);
    d.first.clear();
    d.second.clear();
    base.jobs(base_args, d.first);
    for (const Group& g : d.groups) {
      const auto& delta = g.adapter->layers[layer][product];
      if (!delta.has_value() || g.n == 0) continue;
      lmrpc::LinearArgs a = base_args;  // the base product's input rows and prologue
      a.m = g.n;
      a.x_rows = g.rows;
      a.residual = nullptr;
      a.residual_stride = 0;
      a.y = g.h;
      a.y_stride = d.h_stride;
      a.y_rows = nullptr;
      d.first.push_back({&delta->first->weight(), a});
      for (const auto& [b, rank_start, out_start] : delta->second) {
        lmrpc::LinearArgs bargs{};
        bargs.x = g.h + rank_start;  // [n, rank] within h's rows
        bargs.m = g.n;
        bargs.x_stride = d.h_stride;
        bargs.prologue = lmrpc::Prologue::NONE;
        bargs.residual = base_args.y + out_start;  // the module's columns of the group's rows of y
        bargs.residual_stride = base_args.y_stride;
        bargs.y = base_args.y + out_start;
        bargs.y_stride = base_args.y_stride;
        bargs.y_rows = g.rows;
        d.second.push_back({&b->weight(), bargs});
      }
    }
    lmrpc::linear_batch(d.first.data(), static_cast<int64_t>(d.first.size()), base.compute());
    lmrpc::linear_batch(d.second.data(), static_cast<int64_t>(d.second.size()), base.compute());
  }

 private:
  std::vector<StackLayer> layers_;
  at::Tensor keys_, values_;  // [layers, pages, kv_heads, head_dim, P], [layers, pages, kv_heads, P, head_dim]
  at::Tensor cos_, sin_;      // [positions, head_dim] float32
  int64_t heads_;
  double eps_, qk_eps_, scale_;
};

}  // namespace lmrpc_py
