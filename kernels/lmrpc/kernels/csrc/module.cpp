// Python bindings of lmrpc's CPU kernels (pybind11: a call costs well under a microsecond, where a dispatcher op
// costs several). Tensors are checked here, at the boundary; the kernels take raw pointers. Every kernel call
// releases the GIL (as torch's ops do): the engine thread runs them while the event loop thread streams outputs.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include "grid_codes.h"
#include "py_attention.h"
#include "py_linear.h"
#include "py_stack.h"

namespace py = pybind11;
using namespace lmrpc_py;  // NOLINT: the bindings name the classes and functions they register

namespace {

// The grid bindings' shared arguments, checked before a kernel reads them.
void check_grid_args(const at::Tensor& blocks, int64_t ggml_type, const at::Tensor& grid, const at::Tensor& ksigns) {
  const int64_t bytes = lmrpc::grid_block_bytes(ggml_type);
  TORCH_CHECK(bytes > 0, "not a grid or ternary ggml type: ", ggml_type);
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.size(1) == bytes && blocks.is_contiguous(),
              "blocks must be contiguous uint8 [blocks, ", bytes, "]");
  TORCH_CHECK(grid.dtype() == at::kChar && grid.is_contiguous() && grid.numel() == lmrpc::grid_size(ggml_type),
              "the grid must be ", lmrpc::grid_size(ggml_type), " contiguous int8");
  TORCH_CHECK(ksigns.dtype() == at::kByte && ksigns.numel() == 128 && ksigns.is_contiguous(),
              "ksigns must be 128 contiguous uint8");
}

// grid_q4_pairs' and grid_indices' table lookup (a code's byte -> its index).
void check_lookup(const at::Tensor& lookup, const char* op) {
  TORCH_CHECK(lookup.dtype() == at::kByte && lookup.numel() == 256 && lookup.is_contiguous(), op,
              ": lookup must be 256 contiguous uint8");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lmrpc's CPU kernels: row-invariant packed products, paged attention, RoPE with cache writes";
  m.def("native_bf16", &lmrpc::native_bf16, "whether products use AVX512-BF16 instructions");
  m.def("native_avx2", &lmrpc::native_avx2, "whether products use AVX2 + FMA registers (no AVX512-BF16 here)");
  m.def("native_vnni", &lmrpc::native_vnni, "whether int4 products with bfloat16 compute can take int8 activations (AVX512-VNNI)");
  py::class_<PackedLinear, std::shared_ptr<PackedLinear>>(m, "PackedLinear")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, bool, at::Tensor, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, std::optional<at::Tensor>, bool, bool, bool, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, int64_t, bool, bool, std::vector<int64_t>, double>(),
           py::arg("format"), py::arg("compute"), py::arg("n"), py::arg("k"), py::arg("group"), py::arg("q4_signed"),
           py::arg("data"), py::arg("scale"), py::arg("offset"), py::arg("bias"), py::arg("expand_codes") = false,
           py::arg("int8_activations") = false, py::arg("int16_activations") = false,
           py::arg("codes") = py::none(), py::arg("kd") = py::none(),
           py::arg("kdmin") = py::none(), py::arg("ksc") = py::none(), py::arg("km") = py::none(),
           py::arg("super_groups") = 1, py::arg("sc_signed") = false, py::arg("vnni_in_place") = false,
           py::arg("code_values") = std::vector<int64_t>{}, py::arg("d_scale") = 1.0)
      .def("forward", &PackedLinear::forward, py::arg("x"), py::arg("norm_weight") = py::none(),
           py::arg("eps") = 0.0, py::arg("silu") = false, py::arg("residual") = py::none(),
           py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def_static("stacked", &PackedLinear::stacked, py::arg("parts"))
      .def("rows", &PackedLinear::rows, py::arg("ids"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("n", &PackedLinear::n)
      .def_property_readonly("k", &PackedLinear::k)
      .def_property_readonly("int8_activations", &PackedLinear::int8_activations)
      .def_property_readonly("int16_activations", &PackedLinear::int16_activations)
      .def_property_readonly("codes_in_vnni_order", &PackedLinear::codes_in_vnni_order)
      .def_property_readonly("nbytes", &PackedLinear::nbytes);
  py::class_<StackLayer>(m, "StackLayer")
      .def(py::init([](std::shared_ptr<PackedLinear> qkv, std::shared_ptr<PackedLinear> o,
                       std::shared_ptr<PackedLinear> gate_up, std::shared_ptr<PackedLinear> down,
                       at::Tensor input_norm, at::Tensor post_attention_norm, std::optional<at::Tensor> q_norm,
                       std::optional<at::Tensor> k_norm) {
             return StackLayer{qkv, o, gate_up, down, input_norm, post_attention_norm, q_norm, k_norm};
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("input_norm"),
           py::arg("post_attention_norm"), py::arg("q_norm"), py::arg("k_norm"));
  py::class_<StackAdapter, std::shared_ptr<StackAdapter>>(m, "StackAdapter")
      .def(py::init<const std::vector<std::vector<std::optional<StackAdapter::Delta>>>&>(), py::arg("layers"));
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<StackLayer>, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double, double,
                    double>(),
           py::arg("layers"), py::arg("keys"), py::arg("values"), py::arg("cos"), py::arg("sin"), py::arg("heads"),
           py::arg("eps"), py::arg("qk_eps"), py::arg("scale"))
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("positions"), py::arg("slots"),
           py::arg("block_table"), py::arg("token_seq"), py::arg("token_ctx"),
           py::arg("lora") = std::vector<StackGroup>{}, py::arg("rope_cos") = py::none(),
           py::arg("rope_sin") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("rope_store", &rope_store, py::arg("qkv"), py::arg("heads"), py::arg("positions"), py::arg("cos"),
        py::arg("sin"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("slots"), py::arg("keys"),
        py::arg("values"), py::arg("q_out"), py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, py::arg("q"), py::arg("keys"), py::arg("values"),
        py::arg("block_table"), py::arg("token_seq"), py::arg("token_ctx"), py::arg("scale"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "grid_codes",
      [](const at::Tensor& blocks, int64_t ggml_type, const at::Tensor& grid, const at::Tensor& ksigns) {
        check_grid_args(blocks, ggml_type, grid, ksigns);
        at::Tensor out = at::empty({blocks.size(0), 256}, at::kChar);
        py::gil_scoped_release release;
        lmrpc::grid_codes(blocks.data_ptr<uint8_t>(), blocks.size(0), ggml_type, grid.data_ptr<int8_t>(),
                          ksigns.data_ptr<uint8_t>(), out.data_ptr<int8_t>());
        return out;
      },
      py::arg("blocks"), py::arg("ggml_type"), py::arg("grid"), py::arg("ksigns"),
      "GGUF grid or ternary blocks [n, bytes] -> int8 codes [n, 256] in the grid's units (gguf_grids.py)");
  m.def(
      "grid_q4_pairs",
      [](const at::Tensor& blocks, int64_t ggml_type, const at::Tensor& grid, const at::Tensor& ksigns,
         const at::Tensor& lookup) {
        check_grid_args(blocks, ggml_type, grid, ksigns);
        check_lookup(lookup, "grid_q4_pairs");
        at::Tensor out = at::empty({blocks.size(0), 128}, at::kByte);
        int64_t missing = 0;
        {
          py::gil_scoped_release release;
          missing = lmrpc::grid_q4_pairs(blocks.data_ptr<uint8_t>(), blocks.size(0), ggml_type,
                                         grid.data_ptr<int8_t>(), ksigns.data_ptr<uint8_t>(),
                                         lookup.data_ptr<uint8_t>(), out.data_ptr<uint8_t>());
        }
        return std::make_tuple(out, missing);
      },
      py::arg("blocks"), py::arg("ggml_type"), py::arg("grid"), py::arg("ksigns"), py::arg("lookup"),
      "GGUF grid blocks [n, bytes] -> their codes' indices in a table of 16 (`lookup`: code byte -> index) as the "
      "Q4 layout's code pairs [n, 128], and how many codes the table lacks");
  m.def(
      "grid_indices",
      [](const at::Tensor& blocks, int64_t ggml_type, const at::Tensor& grid, const at::Tensor& ksigns,
         const at::Tensor& lookup, int64_t bias) {
        check_grid_args(blocks, ggml_type, grid, ksigns);
        check_lookup(lookup, "grid_indices");
        TORCH_CHECK(bias >= 0 && bias <= 15, "grid_indices: bias must be 0..15");
        at::Tensor out = at::empty({blocks.size(0), 256}, at::kChar);
        int64_t missing = 0;
        {
          py::gil_scoped_release release;
          missing = lmrpc::grid_indices(blocks.data_ptr<uint8_t>(), blocks.size(0), ggml_type,
                                        grid.data_ptr<int8_t>(), ksigns.data_ptr<uint8_t>(),
                                        lookup.data_ptr<uint8_t>(), static_cast<int>(bias), out.data_ptr<int8_t>());
        }
        return std::make_tuple(out, missing);
      },
      py::arg("blocks"), py::arg("ggml_type"), py::arg("grid"), py::arg("ksigns"), py::arg("lookup"),
      py::arg("bias"),
      "GGUF grid blocks [n, bytes] -> their codes' indices in a table (`lookup`: code byte -> index) less `bias`, "
      "int8 [n, 256], and how many codes the table lacks");
  m.def("attention_route", &attention_route, py::arg("t"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
        py::arg("bf16"), py::arg("threads"));
}
