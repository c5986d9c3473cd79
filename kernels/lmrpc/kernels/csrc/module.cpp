// Python bindings of lmrpc's CPU kernels (pybind11: a call costs well under a microsecond, where a dispatcher op
// costs several). Tensors are checked here, at the boundary; the kernels take raw pointers. Every kernel call
// releases the GIL (as torch's ops do): the engine thread runs them while the event loop thread streams outputs.
#include <torch/extension.h>

#include <optional>

#include "attention.h"
#include "linear.h"

namespace py = pybind11;

namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, what); }

template <typename T>
const T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

const uint16_t* half_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const uint16_t*>(t->data_ptr<at::Half>()) : nullptr;
}

void check_f32_rows(const at::Tensor& t, int64_t width, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1 && t.size(1) >= width, name,
              ": expected float32 rows [m, >= ", width, "] with unit stride, got ", t.sizes(), " ", t.scalar_type());
}

// A packed weight and the tensors that hold it (kept alive with it).
class PackedLinear {
 public:
  PackedLinear(int64_t format, int64_t compute, int64_t n, int64_t k, int64_t group, bool q4_signed, at::Tensor data,
               std::optional<at::Tensor> scale, std::optional<at::Tensor> offset, std::optional<at::Tensor> bias)
      : data_(data.contiguous()), scale_(scale), offset_(offset), bias_(bias),
        compute_(static_cast<lmrpc::Compute>(compute)) {
    const auto fmt = static_cast<lmrpc::WeightFormat>(format);
    const bool quantized = fmt == lmrpc::WeightFormat::Q4 || fmt == lmrpc::WeightFormat::Q8;
    const int64_t n_pad = (n + 31) / 32 * 32;
    const int64_t k_pad = quantized ? (k + group - 1) / group * group : (k + 3) / 4 * 4;
    TORCH_CHECK(k_pad % 4 == 0 && (!quantized || group % 4 == 0), "group and padded k must be multiples of 4");
    TORCH_CHECK(fmt != lmrpc::WeightFormat::Q4 || group == 32, "Q4 weights come in groups of 32");
    TORCH_CHECK(quantized == scale.has_value(), "quantized weights need scales, dense weights none");
    TORCH_CHECK(!offset.has_value() || fmt == lmrpc::WeightFormat::Q4, "offsets exist only for Q4");
    TORCH_CHECK(fmt != lmrpc::WeightFormat::BF16 || compute_ == lmrpc::Compute::BF16,
                "bfloat16 weights take bfloat16 products");
    TORCH_CHECK(fmt != lmrpc::WeightFormat::F32 || compute_ == lmrpc::Compute::F32,
                "float32 weights take float32 products");
    const int64_t groups = quantized ? k_pad / group : 1;
    int64_t bytes = 0;
    switch (fmt) {
      case lmrpc::WeightFormat::F32: bytes = n_pad * k_pad * 4; break;
      case lmrpc::WeightFormat::BF16: bytes = n_pad * k_pad * 2; break;
      case lmrpc::WeightFormat::Q8: bytes = n_pad * k_pad; break;
      case lmrpc::WeightFormat::Q4: bytes = n_pad * k_pad / 2; break;
    }
    TORCH_CHECK(data_.nbytes() == static_cast<size_t>(bytes), "packed data holds ", data_.nbytes(), " bytes, expected ",
                bytes);
    for (const auto* t : {&scale_, &offset_}) {
      if (t->has_value()) {
        TORCH_CHECK((*t)->scalar_type() == at::kHalf && (*t)->is_contiguous() && (*t)->numel() == n_pad * groups,
                    "scales and offsets: float16 [n_pad / 32, groups, 2, 16]");
      }
    }
    if (bias_.has_value()) {
      TORCH_CHECK(bias_->scalar_type() == at::kFloat && bias_->is_contiguous() && bias_->numel() == n, "bias: [n]");
    }
    w_ = lmrpc::PackedWeight{fmt, n, k, n_pad, k_pad, quantized ? group : k_pad, q4_signed, data_.data_ptr(),
                             half_or_null(scale_), half_or_null(offset_), ptr_or_null<float>(bias_)};
  }

  // y = prologue(x) W^T (+ bias) (+ residual); x [m, k] ([m, 2k] with silu). With `out`, written there.
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& norm_weight, double eps, bool silu,
                     const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& out) const {
    check_f32_rows(x, silu ? 2 * w_.k : w_.k, "x");
    TORCH_CHECK(!(silu && norm_weight.has_value()), "one prologue at a time");
    const int64_t m = x.size(0);
    at::Tensor y = out.has_value() ? *out : at::empty({m, w_.n}, x.options());
    check_f32_rows(y, w_.n, "out");
    TORCH_CHECK(y.size(0) == m, "out rows");
    lmrpc::LinearArgs a{};
    a.x = x.data_ptr<float>();
    a.m = m;
    a.x_stride = x.stride(0);
    a.prologue = silu ? lmrpc::Prologue::SILU_MUL
                      : (norm_weight.has_value() ? lmrpc::Prologue::RMS_NORM : lmrpc::Prologue::NONE);
    if (norm_weight.has_value()) {
      TORCH_CHECK(norm_weight->scalar_type() == at::kFloat && norm_weight->is_contiguous() &&
                      norm_weight->numel() == w_.k, "norm_weight: float32 [k]");
      a.norm_weight = norm_weight->data_ptr<float>();
    }
    a.eps = static_cast<float>(eps);
    if (residual.has_value()) {
      check_f32_rows(*residual, w_.n, "residual");
      TORCH_CHECK(residual->size(0) == m, "residual rows");
      a.residual = residual->data_ptr<float>();
      a.residual_stride = residual->stride(0);
    }
    a.y = y.data_ptr<float>();
    a.y_stride = y.stride(0);
    lmrpc::linear(w_, compute_, a);
    return y;
  }

  // Rows of the dequantized weight (embedding lookups of a tied weight): ids [t] -> [t, k] float32.
  at::Tensor rows(const at::Tensor& ids) const {
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids: int64 [t]");
    const int64_t* p = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) TORCH_CHECK(p[i] >= 0 && p[i] < w_.n, "row id out of range");
    at::Tensor out = at::empty({ids.numel(), w_.k}, ids.options().dtype(at::kFloat));
    lmrpc::weight_rows(w_, p, ids.numel(), out.data_ptr<float>(), w_.k);
    return out;
  }

  int64_t n() const { return w_.n; }
  int64_t k() const { return w_.k; }
  int64_t nbytes() const {
    int64_t total = data_.nbytes();
    for (const auto* t : {&scale_, &offset_, &bias_}) total += t->has_value() ? (*t)->nbytes() : 0;
    return total;
  }

 private:
  at::Tensor data_;
  std::optional<at::Tensor> scale_, offset_, bias_;
  lmrpc::Compute compute_;
  lmrpc::PackedWeight w_{};
};

lmrpc::CacheView cache_view(const at::Tensor& keys, const at::Tensor& values) {
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

void check_i64(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() && t.numel() == n, name,
              ": int64 [", n, "]");
}

void check_i32(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous() && t.numel() == n, name,
              ": int32 [", n, "]");
}

// q_out [t, heads, head_dim] = RoPE(q); keys and values of every token written into the cache at its slot.
void rope_store(const at::Tensor& qkv, int64_t heads, const at::Tensor& positions, const at::Tensor& cos,
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
void paged_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lmrpc's CPU kernels: row-invariant packed products, paged attention, RoPE with cache writes";
  m.def("native_bf16", &lmrpc::native_bf16, "whether products use AVX512-BF16 instructions");
  py::class_<PackedLinear>(m, "PackedLinear")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, bool, at::Tensor, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, std::optional<at::Tensor>>(),
           py::arg("format"), py::arg("compute"), py::arg("n"), py::arg("k"), py::arg("group"), py::arg("q4_signed"),
           py::arg("data"), py::arg("scale"), py::arg("offset"), py::arg("bias"))
      .def("forward", &PackedLinear::forward, py::arg("x"), py::arg("norm_weight") = py::none(),
           py::arg("eps") = 0.0, py::arg("silu") = false, py::arg("residual") = py::none(),
           py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("rows", &PackedLinear::rows, py::arg("ids"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("n", &PackedLinear::n)
      .def_property_readonly("k", &PackedLinear::k)
      .def_property_readonly("nbytes", &PackedLinear::nbytes);
  m.def("rope_store", &rope_store, py::arg("qkv"), py::arg("heads"), py::arg("positions"), py::arg("cos"),
        py::arg("sin"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("slots"), py::arg("keys"),
        py::arg("values"), py::arg("q_out"), py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, py::arg("q"), py::arg("keys"), py::arg("values"),
        py::arg("block_table"), py::arg("token_seq"), py::arg("token_ctx"), py::arg("scale"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
}
