// The small per-token ops of a decoder layer, each fused into one pass over its rows: residual add
// plus RMSNorm, rotate-half RoPE on q and k, and SiLU-and-multiply. In torch each is 3-7 separate
// ops with their temporaries, and on a CPU their dispatch and memory passes add up to a tenth of a
// decode step. fp32 only; the arithmetic follows Hugging Face's order (statistics in fp32, weight
// applied after normalising) so greedy decoding still matches it.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include "row_ops.h"

namespace {

// Rows per thread: below ~64k elements a second thread costs more to wake than it saves.
int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_elements)); }

void check_fp32_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be fp32");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual) {
  check_fp32_rows(x, "x");
  const int64_t rows = x.size(0), width = x.size(1);
  auto out = torch::empty({rows, width}, x.options());
  auto sum = residual.has_value() ? torch::empty({rows, width}, x.options()) : x;
  if (residual.has_value()) check_fp32_rows(*residual, "residual");
  auto w = weight.contiguous();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* rr = residual.has_value() ? residual->data_ptr<float>() + r * residual->stride(0) : nullptr;
      row_ops::add_rms_norm(x.data_ptr<float>() + r * x.stride(0), rr, wp, static_cast<float>(eps), width,
                            sum.data_ptr<float>() + r * sum.stride(0), out.data_ptr<float>() + r * width);
    }
  });
  return {out, sum};
}

namespace {

// q or k `[T, heads, d]` whose rows may be strided views into the fused qkv output.
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3, "q/k must be fp32 [T, heads, d]");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == d, "q/k heads must be contiguous within a token");
  auto out = torch::empty({tokens, heads, d}, x.options());
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, tokens, grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + t * d;
      const float* st = s + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        row_ops::rotate_half(x.data_ptr<float>() + t * x.stride(0) + h * d, ct, st, d,
                             out.data_ptr<float>() + (t * heads + h) * d);
      }
    }
  });
  return out;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> apply_rope(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                                                    torch::Tensor sin) {
  auto c = cos.contiguous();
  auto s = sin.contiguous();
  TORCH_CHECK(c.scalar_type() == torch::kFloat32 && c.dim() == 2, "cos/sin must be fp32 [T, d]");
  return {rotate(query, c, s), rotate(key, c, s)};
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_fp32_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up.data_ptr<float>() + r * gate_up.stride(0);
      row_ops::silu_and_mul(g, g + width, width, out.data_ptr<float>() + r * width);
    }
  });
  return out;
}
