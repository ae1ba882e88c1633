// The per-row arithmetic of the small decoder ops: residual add plus RMSNorm, rotate-half RoPE on one
// head, SiLU-and-multiply. fused_ops.cpp runs them over a step's rows; decode_region.cpp runs them inside
// its one parallel region. One definition, so both compute the same numbers to the last bit. The
// arithmetic follows Hugging Face's order (statistics in fp32, weight applied after normalising).
#pragma once

#include <cmath>
#include <cstdint>

namespace row_ops {

// out = weight * norm(x + residual); the sum is written to `sum` and read from there. Without a
// residual (null) the sum is x itself and `sum` is not written.
inline void add_rms_norm(const float* x, const float* residual, const float* weight, float eps, int64_t width,
                         float* sum, float* out) {
  const float* s = x;
  if (residual != nullptr) {
    for (int64_t i = 0; i < width; ++i) sum[i] = x[i] + residual[i];
    s = sum;
  }
  float squares = 0.f;
  for (int64_t i = 0; i < width; ++i) squares += s[i] * s[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
  for (int64_t i = 0; i < width; ++i) out[i] = weight[i] * (s[i] * inv);
}

// One head of d values rotated by this token's cos and sin (d of each).
inline void rotate_half(const float* in, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = in[i] * cos[i] - in[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = in[i] * cos[i] + in[i - half] * sin[i];
}

// out = silu(gate) * up over `width` values.
inline void silu_and_mul(const float* gate, const float* up, int64_t width, float* out) {
  for (int64_t i = 0; i < width; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

}  // namespace row_ops
