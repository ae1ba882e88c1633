// Every decoder layer for one decode token of one sequence (single-stream decode), in one parallel region.
//
// At one row a layer of SmolLM2-135M reads ~3.5 MB of int8 weights, about 0.15 ms of memory time. The
// stack's per-op path (decode_stack.cpp) opens a parallel region per GEMV and for the attention, five a
// layer, and runs the small ops between them on one thread while the others wait; its attention splits
// the work by KV head, 2:1 over SmolLM2's three. Here the threads enter one region for the whole stack.
// Each takes a contiguous share of every GEMV's output rows, a share of the query heads and of the KV
// heads to write, and computes the small ops (norms, SiLU) on its own copy of the row; they meet at a
// barrier only where a later step reads what all of them wrote. Every value is computed by the same code
// as on the per-op path (the GEMV's rows, `row_ops`, the attention's per-head loop), so the result equals
// it to the last bit.
//
// Taken for an fp32 cache (a quantized one needs its scales and rotation: the per-op path serves it).
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "row_ops.h"

namespace {

// [begin, end) of `count` items in whole units of `unit`, for thread `t` of `threads`: contiguous shares
// that differ by at most one unit.
std::pair<int64_t, int64_t> share(int64_t count, int64_t unit, int t, int threads) {
  const int64_t units = (count + unit - 1) / unit;
  const int64_t begin = units * t / threads, end = units * (t + 1) / threads;
  return {std::min(count, begin * unit), std::min(count, end * unit)};
}

// One linear layer's rows [begin, end) for the row x, on its weight's GEMV.
void linear_rows(const float* x, const torch::Tensor& weight, const std::optional<torch::Tensor>& scale,
                 const std::optional<torch::Tensor>& bias, float* y, std::pair<int64_t, int64_t> rows) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (scale.has_value()) {
    int8_gemv_row_range(x, weight.data_ptr<int8_t>(), scale->data_ptr<float>(), b, y, n, k, rows.first, rows.second);
  } else {
    gemv_row_range(x, weight.data_ptr<float>(), b, y, n, k, rows.first, rows.second);
  }
}

// A thread's own rows of every GEMV: the outputs' sizes of one layer (all layers have the same).
struct Shares {
  std::pair<int64_t, int64_t> qkv, o, gate_up, down, q_heads, kv_heads;
};

}  // namespace

namespace {

bool fp32_vector(const std::optional<torch::Tensor>& t, int64_t size) {
  return !t.has_value() || (t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == size);
}

// The GEMV this linear runs on takes its weight as it is: contiguous, int8 with a scale per row or fp32.
bool row_ready(const torch::Tensor& weight, const std::optional<torch::Tensor>& scale,
               const std::optional<torch::Tensor>& bias) {
  const auto dtype = scale.has_value() ? torch::kInt8 : torch::kFloat32;
  return weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == dtype &&
         fp32_vector(scale, weight.size(0)) && fp32_vector(bias, weight.size(0));
}

}  // namespace

bool decode_row_applies(const torch::Tensor& hidden, const std::vector<DecoderLayerWeights>& layers,
                        const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                        int64_t tokens, int64_t sequences, bool quantized_cache) {
  if (tokens != 1 || sequences != 1 || quantized_cache) return false;
  if (hidden.scalar_type() != torch::kFloat32 || !hidden.is_contiguous()) return false;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayerWeights& w = layers[i];
    if (k_caches[i].scalar_type() != torch::kFloat32 || v_caches[i].scalar_type() != torch::kFloat32 ||
        !k_caches[i].is_contiguous() || !v_caches[i].is_contiguous() || !fp32_vector(w.input_norm, hidden.size(1)) ||
        !fp32_vector(w.post_norm, hidden.size(1)) || !row_ready(w.qkv, w.qkv_scale, w.qkv_bias) ||
        !row_ready(w.o, w.o_scale, w.o_bias) || !row_ready(w.gate_up, w.gate_up_scale, w.gate_up_bias) ||
        !row_ready(w.down, w.down_scale, w.down_bias)) {
      return false;
    }
  }
  return true;
}

std::tuple<torch::Tensor, torch::Tensor> decode_row(torch::Tensor hidden, const std::vector<DecoderLayerWeights>& layers,
                                                    const std::vector<torch::Tensor>& k_caches,
                                                    const std::vector<torch::Tensor>& v_caches, torch::Tensor cos,
                                                    torch::Tensor sin, int64_t slot, const torch::Tensor& block_table,
                                                    int64_t seq_len, int64_t num_heads, double eps, double scale) {
  const int64_t width = hidden.size(1), num_kv_heads = k_caches[0].size(2), head_dim = k_caches[0].size(3);
  const int64_t block_size = k_caches[0].size(1), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t qkv_size = layers[0].qkv.size(0), inner = layers[0].down.size(1);
  TORCH_CHECK(qkv_size == q_size + 2 * kv_size && layers[0].gate_up.size(0) == 2 * inner,
              "the layers' shapes do not match the cache's heads");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.numel() == head_dim &&
                  sin.numel() == head_dim,
              "cos/sin must be fp32 [1, head_dim]");
  TORCH_CHECK(slot >= 0 && slot < k_caches[0].size(0) * block_size, "slot ", slot, " is outside the cache");
  auto options = hidden.options();
  // Written by every thread's share, read whole after a barrier.
  auto qkv = torch::empty({qkv_size}, options), q_rot = torch::empty({q_size}, options);
  auto attended = torch::empty({q_size}, options), attn_out = torch::empty({width}, options);
  auto gate_up = torch::empty({2 * inner}, options);
  // Each layer's output; the next layer reads it in its first step, before a barrier.
  auto out = torch::empty({1, width}, options), residual = torch::empty({1, width}, options);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  // Each thread's own rows, 64-byte aligned as torch's buffers are: the compiler's vector loops (norms,
  // SiLU's exp) then split the same way as on the per-op path, and give the same bits.
  const int64_t pitch = (std::max(width, inner) + 15) / 16 * 16;
  auto private_rows = torch::empty({at::get_num_threads(), 4, pitch}, options);
  const float eps_f = static_cast<float>(eps), scale_f = static_cast<float>(scale);

#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    const Shares mine{share(qkv_size, 4, t, threads),  share(width, 4, t, threads),
                      share(2 * inner, 4, t, threads), share(width, 4, t, threads),
                      share(num_heads, 1, t, threads), share(num_kv_heads, 1, t, threads)};
    // This thread's copy of the row's sums and normed inputs (every thread computes the same values).
    float* own = private_rows.data_ptr<float>() + t * 4 * pitch;
    float *sum = own, *res = own + pitch, *normed = own + 2 * pitch, *act = own + 3 * pitch;
    const float* x = hidden.data_ptr<float>();
    for (size_t i = 0; i < layers.size(); ++i) {
      const DecoderLayerWeights& w = layers[i];
      const bool first = i == 0;
      // The layer's residual stream: x alone at the first layer, x + the previous layer's sum after.
      row_ops::add_rms_norm(x, first ? nullptr : res, w.input_norm.data_ptr<float>(), eps_f, width, sum,
                            normed);
      const float* stream = first ? x : sum;
      linear_rows(normed, w.qkv, w.qkv_scale, w.qkv_bias, qkv.data_ptr<float>(), mine.qkv);
#pragma omp barrier
      const float* q = qkv.data_ptr<float>();
      for (int64_t h = mine.q_heads.first; h < mine.q_heads.second; ++h) {
        row_ops::rotate_half(q + h * head_dim, c, s, head_dim, q_rot.data_ptr<float>() + h * head_dim);
      }
      float* k_row = k_caches[i].data_ptr<float>() + slot * kv_size;
      float* v_row = v_caches[i].data_ptr<float>() + slot * kv_size;
      for (int64_t h = mine.kv_heads.first; h < mine.kv_heads.second; ++h) {
        row_ops::rotate_half(q + q_size + h * head_dim, c, s, head_dim, k_row + h * head_dim);
        std::memcpy(v_row + h * head_dim, q + q_size + kv_size + h * head_dim, head_dim * sizeof(float));
      }
#pragma omp barrier
      attend_decode_heads(q_rot.data_ptr<float>(), k_caches[i].data_ptr<float>(), v_caches[i].data_ptr<float>(),
                          table, seq_len, num_heads, num_kv_heads, head_dim, block_size, scale_f, w.window,
                          mine.q_heads.first, mine.q_heads.second, attended.data_ptr<float>());
#pragma omp barrier
      linear_rows(attended.data_ptr<float>(), w.o, w.o_scale, w.o_bias, attn_out.data_ptr<float>(), mine.o);
#pragma omp barrier
      row_ops::add_rms_norm(attn_out.data_ptr<float>(), stream, w.post_norm.data_ptr<float>(), eps_f, width,
                            res, normed);
      linear_rows(normed, w.gate_up, w.gate_up_scale, w.gate_up_bias, gate_up.data_ptr<float>(),
                  mine.gate_up);
#pragma omp barrier
      row_ops::silu_and_mul(gate_up.data_ptr<float>(), gate_up.data_ptr<float>() + inner, inner, act);
      linear_rows(act, w.down, w.down_scale, w.down_bias, out.data_ptr<float>(), mine.down);
#pragma omp barrier
      x = out.data_ptr<float>();
    }
    if (t == 0) std::memcpy(residual.data_ptr<float>(), res, width * sizeof(float));
  }
  return {out, residual};
}
