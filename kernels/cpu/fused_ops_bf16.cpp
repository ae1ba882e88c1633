// The small per-token ops of a decoder layer for bf16 activations, each one pass over its rows as the fp32
// ones are (fused_ops.cpp): in torch each is 3-10 separate bf16 ops, whose dispatch costs more than the
// arithmetic at decode sizes.
//
// Each op rounds to bf16 exactly where torch's bf16 chain does (`kernels.torch_reference`, Hugging Face's
// order), computing in fp32 between roundings: the residual sum, the normalised row and its product with
// the weight; each RoPE product and their sum; SiLU and its product with `up`. So they give the reference's
// values but for a last-bit difference of an fp32 reduction order or `exp`, which a bf16 rounding rarely
// shows.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include "kernels.h"

namespace {

using bf16 = c10::BFloat16;

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_elements)); }

inline bf16 round(float value) { return bf16(value); }

void check_bf16_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, name, " must be bf16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

const bf16* rows_of(const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
bf16* rows_of(torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

// q or k `[T, heads, d]` (rows may be strided views into the fused qkv output) rotated by bf16 cos/sin [T, d].
torch::Tensor rotate_bf16(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 3, "q/k must be bf16 [T, heads, d]");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == d, "q/k heads must be contiguous within a token");
  auto out = torch::empty({tokens, heads, d}, x.options());
  const bf16* c = rows_of(cos);
  const bf16* s = rows_of(sin);
  const bf16* in = rows_of(x);
  bf16* dst = rows_of(out);
  at::parallel_for(0, tokens, grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const bf16* row = in + t * x.stride(0) + h * d;
        bf16* o = dst + (t * heads + h) * d;
        for (int64_t i = 0; i < d; ++i) {
          const float rotated = i < half ? -static_cast<float>(row[i + half]) : static_cast<float>(row[i - half]);
          const float a = round(static_cast<float>(row[i]) * static_cast<float>(c[t * d + i]));
          const float b = round(rotated * static_cast<float>(s[t * d + i]));
          o[i] = round(a + b);
        }
      }
    }
  });
  return out;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps,
                                                       std::optional<torch::Tensor> residual) {
  check_bf16_rows(x, "x");
  if (residual.has_value()) check_bf16_rows(*residual, "residual");
  const int64_t rows = x.size(0), width = x.size(1);
  auto w = weight.to(torch::kBFloat16).contiguous();
  auto out = torch::empty({rows, width}, x.options());
  auto sum = residual.has_value() ? torch::empty({rows, width}, x.options()) : x;
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* s = rows_of(x) + r * x.stride(0);
      if (residual.has_value()) {
        const bf16* res = rows_of(*residual) + r * residual->stride(0);
        bf16* total = rows_of(sum) + r * width;
        for (int64_t i = 0; i < width; ++i) total[i] = round(static_cast<float>(s[i]) + static_cast<float>(res[i]));
        s = total;
      }
      float squares = 0.f;
      for (int64_t i = 0; i < width; ++i) squares += static_cast<float>(s[i]) * static_cast<float>(s[i]);
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + epsilon);
      const bf16* wp = rows_of(w);
      bf16* o = rows_of(out) + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float normed = round(static_cast<float>(s[i]) * inv);
        o[i] = round(static_cast<float>(wp[i]) * normed);
      }
    }
  });
  return {out, sum};
}

std::tuple<torch::Tensor, torch::Tensor> apply_rope_bf16(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                                                         torch::Tensor sin) {
  auto c = cos.to(torch::kBFloat16).contiguous();
  auto s = sin.to(torch::kBFloat16).contiguous();
  TORCH_CHECK(c.dim() == 2 && c.size(1) == query.size(2), "cos/sin must be [T, d]");
  return {rotate_bf16(query, c, s), rotate_bf16(key, c, s)};
}

torch::Tensor silu_and_mul_bf16(torch::Tensor gate_up) {
  check_bf16_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* g = rows_of(gate_up) + r * gate_up.stride(0);
      bf16* o = rows_of(out) + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float gate = static_cast<float>(g[i]);
        const float silu = round(gate / (1.f + std::exp(-gate)));
        o[i] = round(silu * static_cast<float>(g[width + i]));
      }
    }
  });
  return out;
}
