// Python bindings of the CPU kernels. The GIL is released inside each call, so the server's event
// loop thread can run while the engine thread computes.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual);
std::tuple<torch::Tensor, torch::Tensor> apply_rope(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                                                    torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor linear_gemv(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias);
std::string gemv_isa();
void set_gemv_isa(const std::string& name);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::call_guard;
  using pybind11::gil_scoped_release;
  m.def("paged_attention", &paged_attention, "paged attention over a mixed batch (fp32)",
        call_guard<gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "optional residual add, then RMSNorm (fp32)", call_guard<gil_scoped_release>());
  m.def("apply_rope", &apply_rope, "rotate-half RoPE on q and k (fp32)", call_guard<gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (fp32)", call_guard<gil_scoped_release>());
  m.def("linear_gemv", &linear_gemv, "x W^T + b for a few rows of x, streaming W (fp32)",
        call_guard<gil_scoped_release>());
  m.def("gemv_isa", &gemv_isa, "the instruction set linear_gemv runs on: avx512, avx2 or portable");
  m.def("set_gemv_isa", &set_gemv_isa, "for tests: run linear_gemv on a narrower instruction set this CPU has");
}
