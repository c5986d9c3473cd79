// Bindings' side of the products: tensor checks and PackedLinear, a packed weight with the tensors that hold it.
// Included by module.cpp only (one translation unit: torch's headers are compiled once).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <vector>

#include "linear.h"

namespace lmrpc_py {

template <typename T>
inline const T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

inline const uint16_t* half_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const uint16_t*>(t->data_ptr<at::Half>()) : nullptr;
}

inline void check_f32_rows(const at::Tensor& t, int64_t width, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1 && t.size(1) >= width, name,
              ": expected float32 rows [m, >= ", width, "] with unit stride, got ", t.sizes(), " ", t.scalar_type());
}

// A packed weight and the tensors that hold it (kept alive with it).
class PackedLinear {
 public:
  PackedLinear(int64_t format, int64_t compute, int64_t n, int64_t k, int64_t group, bool q4_signed, at::Tensor data,
               std::optional<at::Tensor> scale, std::optional<at::Tensor> offset, std::optional<at::Tensor> bias,
               bool expand_codes = false, bool int8_activations = false, bool int16_activations = false,
               std::optional<at::Tensor> codes = std::nullopt, std::optional<at::Tensor> kd = std::nullopt,
               std::optional<at::Tensor> kdmin = std::nullopt, std::optional<at::Tensor> ksc = std::nullopt,
               std::optional<at::Tensor> km = std::nullopt, int64_t super_groups = 1, bool sc_signed = false,
               bool vnni_in_place = false, std::vector<int64_t> code_values = {}, double d_scale = 1.0)
      : data_(data.contiguous()), scale_(scale), offset_(offset), bias_(bias), kd_(kd), kdmin_(kdmin), ksc_(ksc),
        km_(km), compute_(static_cast<lmrpc::Compute>(compute)) {
    const auto fmt = static_cast<lmrpc::WeightFormat>(format);
    const bool quantized =
        fmt == lmrpc::WeightFormat::Q4 || fmt == lmrpc::WeightFormat::Q8 || fmt == lmrpc::WeightFormat::Q6 ||
        fmt == lmrpc::WeightFormat::Q3 || fmt == lmrpc::WeightFormat::Q5;
    const int64_t n_pad = (n + 31) / 32 * 32;
    const int64_t k_pad = quantized ? (k + group - 1) / group * group : (k + 3) / 4 * 4;
    TORCH_CHECK(k_pad % 4 == 0 && (!quantized || group % 4 == 0), "group and padded k must be multiples of 4");
    TORCH_CHECK(fmt != lmrpc::WeightFormat::Q4 || group == 32, "Q4 weights come in groups of 32");
    TORCH_CHECK(fmt != lmrpc::WeightFormat::Q6 || group == 16 || group == 32, "Q6 weights come in groups of 16 or 32");
    TORCH_CHECK(fmt != lmrpc::WeightFormat::Q3 || group == 16 || group == 32, "Q3 weights come in groups of 16 or 32");
    TORCH_CHECK(fmt != lmrpc::WeightFormat::Q5 || group == 16 || group == 32, "Q5 weights come in groups of 16 or 32");
    const bool k_scaled = kd.has_value();
    TORCH_CHECK(quantized == (scale.has_value() || k_scaled), "quantized weights need scales, dense weights none");
    TORCH_CHECK(!(k_scaled && (scale.has_value() || offset.has_value())), "K scales replace scales and offsets");
    TORCH_CHECK(!offset.has_value() || quantized, "offsets exist only for quantized weights");
    TORCH_CHECK(fmt != lmrpc::WeightFormat::BF16 || compute_ == lmrpc::Compute::BF16,
                "bfloat16 weights take bfloat16 products");
    TORCH_CHECK(fmt != lmrpc::WeightFormat::F32 || compute_ == lmrpc::Compute::F32,
                "float32 weights take float32 products");
    const bool tabled = !code_values.empty();
    TORCH_CHECK(!tabled || ((fmt == lmrpc::WeightFormat::Q4 || fmt == lmrpc::WeightFormat::Q3) &&
                            compute_ == lmrpc::Compute::BF16),
                "codes indexing a table are Q4 or Q3 weights with bfloat16 products "
                "(float32 compute holds them as Q8)");
    TORCH_CHECK(!tabled || (code_values.size() == 16 &&
                            std::all_of(code_values.begin(), code_values.end(), [](int64_t v) { return v >= -128 && v <= 127; })),
                "code_values: 16 int8 values");
    TORCH_CHECK(!tabled || fmt != lmrpc::WeightFormat::Q3 ||
                    std::equal(code_values.begin(), code_values.begin() + 8, code_values.begin() + 8),
                "a Q3 weight's code_values: its 8 values twice");
    TORCH_CHECK((fmt != lmrpc::WeightFormat::Q3 && fmt != lmrpc::WeightFormat::Q5) ||
                    compute_ == lmrpc::Compute::BF16,
                "Q3 and Q5 weights take bfloat16 products (float32 compute holds them as Q6)");
    const int64_t groups = quantized ? k_pad / group : 1;
    int64_t bytes = 0;
    switch (fmt) {
      case lmrpc::WeightFormat::F32: bytes = n_pad * k_pad * 4; break;
      case lmrpc::WeightFormat::BF16: bytes = n_pad * k_pad * 2; break;
      case lmrpc::WeightFormat::Q8: bytes = n_pad * k_pad; break;
      case lmrpc::WeightFormat::Q4: bytes = n_pad * k_pad / 2; break;
      case lmrpc::WeightFormat::Q6: bytes = n_pad * k_pad * 3 / 4; break;
      case lmrpc::WeightFormat::Q3: bytes = n_pad * k_pad * 3 / 8; break;
      case lmrpc::WeightFormat::Q5: bytes = n_pad * k_pad * 5 / 8; break;
    }
    TORCH_CHECK(data_.nbytes() == static_cast<size_t>(bytes), "packed data holds ", data_.nbytes(), " bytes, expected ",
                bytes);
    for (const auto* t : {&scale_, &offset_}) {
      if (t->has_value()) {
        TORCH_CHECK((*t)->scalar_type() == at::kHalf && (*t)->is_contiguous() && (*t)->numel() == n_pad * groups,
                    "scales and offsets: float16 [n_pad / 32, groups, 2, 16]");
      }
    }
    int exponent = 0;
    TORCH_CHECK(d_scale > 0 && std::frexp(d_scale, &exponent) == 0.5 && (d_scale == 1.0 || (k_scaled && !kdmin)),
                "d_scale: a power of two, other than 1 only for K scales without offsets");
    if (k_scaled) {
      TORCH_CHECK(ksc.has_value() && kdmin.has_value() == km.has_value(), "K scales: d with sc, dmin with m");
      TORCH_CHECK(super_groups > 0 && (super_groups & (super_groups - 1)) == 0 && groups % super_groups == 0,
                  "K scales: whole super-blocks of a power of two groups");
      for (const auto* t : {&kd_, &kdmin_}) {
        if (t->has_value()) {
          TORCH_CHECK((*t)->scalar_type() == at::kHalf && (*t)->is_contiguous() &&
                          (*t)->numel() == n_pad * groups / super_groups,
                      "K scales d and dmin: float16 [n_pad / 32, super-blocks, 2, 16]");
        }
      }
      for (const auto* t : {&ksc_, &km_}) {
        if (t->has_value()) {
          TORCH_CHECK(((*t)->scalar_type() == at::kByte || (*t)->scalar_type() == at::kChar) &&
                          (*t)->is_contiguous() && (*t)->numel() == n_pad * groups,
                      "K scales sc and m: 8-bit [n_pad / 32, groups, 2, 16]");
        }
      }
    }
    if (bias_.has_value()) {
      TORCH_CHECK(bias_->scalar_type() == at::kFloat && bias_->is_contiguous() && bias_->numel() == n, "bias: [n]");
    }
    w_ = lmrpc::PackedWeight{fmt, n, k, n_pad, k_pad, quantized ? group : k_pad, q4_signed, data_.data_ptr(),
                             half_or_null(scale_), half_or_null(offset_), ptr_or_null<float>(bias_)};
    if (k_scaled) {
      w_.ks = lmrpc::KScales{half_or_null(kd_), half_or_null(kdmin_),
                            static_cast<const uint8_t*>(ksc_->data_ptr()),
                            km_.has_value() ? static_cast<const uint8_t*>(km_->data_ptr()) : nullptr,
                            __builtin_ctzll(static_cast<unsigned long long>(super_groups)),
                            sc_signed, static_cast<float>(d_scale)};
    }
    // Int8 activations: bfloat16 compute on AVX512-VNNI, with the codes in their own layout: once more, or with
    // vnni_in_place (the caller hands the data over) rewritten in place, so that the weight is held once (its
    // products then never take float inputs: args()); float32 compute on AVX2, over the Q4 layout as it is.
    w_.code_table = tabled;
    for (size_t i = 0; i < code_values.size(); ++i) w_.code_values[i] = static_cast<int8_t>(code_values[i]);
    if (int8_activations && fmt == lmrpc::WeightFormat::Q4 && !tabled) {  // (codes through a table are not linear)
      if (compute_ == lmrpc::Compute::BF16 && lmrpc::native_vnni()) {
        uint8_t* vnni = static_cast<uint8_t*>(data_.data_ptr());
        if (!vnni_in_place) {
          vnni_ = at::empty({n_pad * k_pad / 2}, data_.options().dtype(at::kByte));
          vnni = vnni_->data_ptr<uint8_t>();
        }
        lmrpc::vnni_codes(w_, vnni);
        w_.vnni = vnni;
        w_.int8 = true;
      } else if (compute_ == lmrpc::Compute::F32 && lmrpc::native_avx2()) {
        w_.int8 = true;
      }
    }
    // Int16 activations: float32 compute on AVX2, over the codes as stored (int8 wins where both are asked).
    w_.int16 = int16_activations && !w_.int8 && compute_ == lmrpc::Compute::F32 && lmrpc::native_avx2() &&
               lmrpc::int16_takes(fmt, group, k_pad, w_.has_offsets());
    // Q8 and Q6 products of many rows read these; Q4 ones expand their 4-bit codes in registers (block_q4), which is
    // faster.
    const bool eight_bit = fmt == lmrpc::WeightFormat::Q8 || fmt == lmrpc::WeightFormat::Q6;
    if (expand_codes && eight_bit && compute_ == lmrpc::Compute::BF16 && lmrpc::native_bf16()) {
      if (codes.has_value()) {  // the caller's buffer (huge pages: kernels/hugepages.py)
        TORCH_CHECK(codes->scalar_type() == at::kShort && codes->is_contiguous() && codes->numel() == n_pad * k_pad,
                    "codes: int16 [n_pad * k_pad]");
        codes_ = *codes;
      } else {
        codes_ = at::empty({n_pad * k_pad}, data_.options().dtype(at::kShort));
      }
      lmrpc::expand_codes(w_, reinterpret_cast<uint16_t*>(codes_->data_ptr<int16_t>()));
      w_.codes = reinterpret_cast<const uint16_t*>(codes_->data_ptr<int16_t>());
    }
  }

  // y = prologue(x) W^T (+ bias) (+ residual); x [m, k] ([m, 2k] with silu). With `out`, written there.
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& norm_weight, double eps, bool silu,
                     const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& out) const {
    at::Tensor y = out.has_value() ? *out : at::empty({x.size(0), w_.n}, x.options());
    run(x, norm_weight.has_value() ? &*norm_weight : nullptr, eps, silu,
        residual.has_value() ? &*residual : nullptr, y);
    return y;
  }

  // forward into y [m, n] (which may be the residual itself: each element is read before it is written).
  void run(const at::Tensor& x, const at::Tensor* norm_weight, double eps, bool silu, const at::Tensor* residual,
           const at::Tensor& y) const {
    TORCH_CHECK(y.size(0) == x.size(0) && (residual == nullptr || residual->size(0) == x.size(0)),
                "out and residual: as many rows as x");
    const lmrpc::LinearArgs a = args(x, x.size(0), norm_weight, eps, silu, residual, y);
    thread_local std::vector<lmrpc::LinearJob> work;  // kept between calls (a step makes hundreds)
    work.clear();
    jobs(a, work);
    lmrpc::linear_batch(work.data(), static_cast<int64_t>(work.size()), compute_);
  }

  // A product over parts stacked along their rows, each kept in its own format (a Q4_K_M layer's Q4_K q and k
  // beside its Q6_K v): its output [m, sum of the parts' n] holds part i's columns after those of parts 0..i-1.
  // The parts run as jobs of one parallel region (linear_batch), each computing its columns exactly as it would
  // alone; so no part is held in a wider format than its file's for the sake of one fused product.
  static std::shared_ptr<PackedLinear> stacked(const std::vector<std::shared_ptr<PackedLinear>>& parts) {
    TORCH_CHECK(parts.size() >= 2, "a stacked product has at least two parts");
    std::shared_ptr<PackedLinear> s(new PackedLinear());
    s->compute_ = parts.front()->compute_;
    s->w_.k = parts.front()->k();
    for (const auto& p : parts) {
      TORCH_CHECK(p && p->parts_.empty() && p->k() == s->w_.k && p->compute_ == s->compute_,
                  "stacked parts: plain products of the same inputs, in the same compute type");
      s->w_.n += p->n();
    }
    s->parts_ = parts;
    return s;
  }

  // The jobs of one call with arguments `a` (args()), appended to `out`: this weight's, or one per part, each
  // writing (and adding the residual of) its own columns.
  void jobs(const lmrpc::LinearArgs& a, std::vector<lmrpc::LinearJob>& out) const {
    if (parts_.empty()) {
      out.push_back({&w_, a});
      return;
    }
    int64_t start = 0;
    for (const auto& p : parts_) {
      lmrpc::LinearArgs part = a;
      part.y = a.y + start;
      if (a.residual != nullptr) part.residual = a.residual + start;
      out.push_back({&p->w_, part});
      start += p->n();
    }
  }

  // The checked arguments of m rows: x [>= m, k] ([>= m, 2k] with silu), y and residual [>= m, n]. Row i reads
  // x row x_rows[i] and residual and y rows y_rows[i] when given (int64 indices the caller checked against the
  // tensors' rows); else row i of each.
  lmrpc::LinearArgs args(const at::Tensor& x, int64_t m, const at::Tensor* norm_weight, double eps, bool silu,
                         const at::Tensor* residual, const at::Tensor& y, const int64_t* x_rows = nullptr,
                         const int64_t* y_rows = nullptr) const {
    check_f32_rows(x, silu ? 2 * w_.k : w_.k, "x");
    TORCH_CHECK(!(silu && norm_weight != nullptr), "one prologue at a time");
    TORCH_CHECK(!(silu && codes_in_vnni_order()), "a weight whose codes were rewritten for int8 activations "
                "(vnni_in_place) takes no SiLU-gated inputs: those products keep float inputs (build it without)");
    TORCH_CHECK(x_rows != nullptr || x.size(0) >= m, "x rows");
    check_f32_rows(y, w_.n, "out");
    TORCH_CHECK(y_rows != nullptr || y.size(0) >= m, "out rows");
    lmrpc::LinearArgs a{};
    a.x = x.data_ptr<float>();
    a.m = m;
    a.x_stride = x.stride(0);
    a.x_rows = x_rows;
    a.y_rows = y_rows;
    a.prologue = silu ? lmrpc::Prologue::SILU_MUL
                      : (norm_weight != nullptr ? lmrpc::Prologue::RMS_NORM : lmrpc::Prologue::NONE);
    if (norm_weight != nullptr) {
      TORCH_CHECK(norm_weight->scalar_type() == at::kFloat && norm_weight->is_contiguous() &&
                      norm_weight->numel() == w_.k, "norm_weight: float32 [k]");
      a.norm_weight = norm_weight->data_ptr<float>();
    }
    a.eps = static_cast<float>(eps);
    if (residual != nullptr) {
      check_f32_rows(*residual, w_.n, "residual");
      TORCH_CHECK(y_rows != nullptr || residual->size(0) >= m, "residual rows");
      a.residual = residual->data_ptr<float>();
      a.residual_stride = residual->stride(0);
    }
    a.y = y.data_ptr<float>();
    a.y_stride = y.stride(0);
    return a;
  }

  const lmrpc::PackedWeight& weight() const {
    TORCH_CHECK(parts_.empty(), "a stacked product has no one weight: use jobs()");
    return w_;
  }
  lmrpc::Compute compute() const { return compute_; }

  // Rows of the dequantized weight (embedding lookups of a tied weight): ids [t] -> [t, k] float32.
  at::Tensor rows(const at::Tensor& ids) const {
    TORCH_CHECK(parts_.empty(), "rows of a stacked product are not served (it is never an embedding table)");
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids: int64 [t]");
    const int64_t* p = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) TORCH_CHECK(p[i] >= 0 && p[i] < w_.n, "row id out of range");
    at::Tensor out = at::empty({ids.numel(), w_.k}, ids.options().dtype(at::kFloat));
    lmrpc::weight_rows(w_, p, ids.numel(), out.data_ptr<float>(), w_.k);
    return out;
  }

  int64_t n() const { return w_.n; }
  int64_t k() const { return w_.k; }
  bool int8_activations() const {
    return w_.int8 || std::any_of(parts_.begin(), parts_.end(), [](const auto& p) { return p->w_.int8; });
  }
  // Whether the codes are held only in the VNNI products' order (vnni_in_place): then no product takes float inputs.
  bool codes_in_vnni_order() const {
    return w_.codes_in_vnni_order() ||
           std::any_of(parts_.begin(), parts_.end(), [](const auto& p) { return p->codes_in_vnni_order(); });
  }
  bool int16_activations() const {
    return w_.int16 || std::any_of(parts_.begin(), parts_.end(), [](const auto& p) { return p->w_.int16; });
  }
  int64_t nbytes() const {
    int64_t total = data_.defined() ? static_cast<int64_t>(data_.nbytes()) : 0;
    for (const auto& p : parts_) total += p->nbytes();
    for (const auto* t : {&scale_, &offset_, &bias_, &codes_, &vnni_, &kd_, &kdmin_, &ksc_, &km_}) {
      total += t->has_value() ? (*t)->nbytes() : 0;
    }
    return total;
  }

 private:
  PackedLinear() = default;  // stacked(): parts instead of a weight of its own

  at::Tensor data_;
  std::optional<at::Tensor> scale_, offset_, bias_;
  std::optional<at::Tensor> kd_, kdmin_, ksc_, km_;  // KScales, when the weight has them
  std::optional<at::Tensor> codes_;  // PackedWeight::codes, when expanded
  std::optional<at::Tensor> vnni_;   // PackedWeight::vnni, when products take int8 activations
  lmrpc::Compute compute_ = lmrpc::Compute::F32;
  lmrpc::PackedWeight w_{};  // a stacked product's: only n (the parts' sum) and k
  std::vector<std::shared_ptr<PackedLinear>> parts_;  // stacked(): the parts, in output order; else empty
};

}  // namespace lmrpc_py
