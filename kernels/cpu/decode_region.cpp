// Every decoder layer of a decode step whose rows all run on the GEMVs (single-stream decode, a few streams,
// a draft's verification), in one parallel region.
//
// At one row a layer of SmolLM2-135M reads ~3.5 MB of int8 weights, about 0.15 ms of memory time. The
// stack's per-op path (decode_stack.cpp) opens a parallel region per GEMV and for the attention, five a
// layer, and runs the small ops between them on one thread while the others wait; its attention splits
// the work by KV head, 2:1 over SmolLM2's three. Here the threads enter one region for the whole stack.
// Each takes a contiguous share of every GEMV's output rows, a share of the attention's query heads
// (`attention_shares`) and of the (token, KV head) rows to write, and computes the norms and SiLU of every
// row on its own copy; they meet at a barrier only where a later step reads what all of them wrote. Every
// value is computed by the same code as on the per-op path (the GEMVs' rows, `row_ops`, the attention's
// per-head loop) on buffers laid out as torch lays out the per-op path's tensors, so the result equals it
// to the last bit.
//
// A quantized cache's rows are quantized as they are written (`write_kv_head`) and read through its scales;
// where its keys are rotated, one thread ropes and rotates every row with torch's matmul while the others wait.
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <utility>
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

bool fp32_vector(const std::optional<torch::Tensor>& t, int64_t size) {
  return !t.has_value() || (t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == size);
}

// The GEMV takes this linear's weight as it is (contiguous, int8 with a scale per row or fp32) at these rows.
bool gemv_ready(const torch::Tensor& weight, const std::optional<torch::Tensor>& scale,
                const std::optional<torch::Tensor>& bias, int64_t rows, int64_t gemv_max_rows,
                int64_t int8_gemv_max_rows) {
  const auto dtype = scale.has_value() ? torch::kInt8 : torch::kFloat32;
  const int64_t max_rows = scale.has_value() ? int8_gemv_max_rows : gemv_max_rows;
  return rows <= max_rows && weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == dtype &&
         fp32_vector(scale, weight.size(0)) && fp32_vector(bias, weight.size(0));
}

// Rows [begin, end) of one linear layer for the m rows of x (contiguous, `k` wide) into y [m, n].
void linear_rows(const float* x, int64_t m, const torch::Tensor& weight, const std::optional<torch::Tensor>& scale,
                 const std::optional<torch::Tensor>& bias, float* y, std::pair<int64_t, int64_t> rows) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (scale.has_value()) {
    int8_gemv_row_range(x, k, m, weight.data_ptr<int8_t>(), scale->data_ptr<float>(), b, y, n, k, rows.first,
                        rows.second);
  } else {
    gemv_row_range(x, k, m, weight.data_ptr<float>(), b, y, n, k, rows.first, rows.second);
  }
}

}  // namespace

bool decode_region_applies(const torch::Tensor& hidden, const std::vector<DecoderLayerWeights>& layers,
                           const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                           const std::vector<torch::Tensor>& k_scales, const std::vector<torch::Tensor>& v_scales,
                           int64_t gemv_max_rows, int64_t int8_gemv_max_rows) {
  if (hidden.scalar_type() != torch::kFloat32 || !hidden.is_contiguous()) return false;
  const auto dtype = k_caches[0].scalar_type();
  const bool quantized = dtype == torch::kInt8 || dtype == torch::kFloat8_e4m3fn;
  if (!quantized && dtype != torch::kFloat32) return false;
  const size_t scale_caches = quantized ? layers.size() : 0;
  if (k_scales.size() != scale_caches || v_scales.size() != scale_caches) return false;
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayerWeights& w = layers[i];
    const auto ready = [&](const torch::Tensor& weight, const std::optional<torch::Tensor>& scale,
                           const std::optional<torch::Tensor>& bias) {
      return gemv_ready(weight, scale, bias, rows, gemv_max_rows, int8_gemv_max_rows);
    };
    const auto scales_ready = [&](const std::vector<torch::Tensor>& scales) {
      return !quantized || (scales[i].scalar_type() == torch::kFloat32 && scales[i].is_contiguous() &&
                            scales[i].numel() == k_caches[i].numel() / k_caches[i].size(3));
    };
    if (k_caches[i].scalar_type() != dtype || v_caches[i].scalar_type() != dtype || !k_caches[i].is_contiguous() ||
        !v_caches[i].is_contiguous() || !scales_ready(k_scales) || !scales_ready(v_scales) ||
        !fp32_vector(w.input_norm, width) || !fp32_vector(w.post_norm, width) ||
        !ready(w.qkv, w.qkv_scale, w.qkv_bias) || !ready(w.o, w.o_scale, w.o_bias) ||
        !ready(w.gate_up, w.gate_up_scale, w.gate_up_bias) || !ready(w.down, w.down_scale, w.down_bias)) {
      return false;
    }
  }
  return true;
}

std::tuple<torch::Tensor, torch::Tensor> decode_region(
    torch::Tensor hidden, const std::vector<DecoderLayerWeights>& layers, const std::vector<torch::Tensor>& k_caches,
    const std::vector<torch::Tensor>& v_caches, const std::vector<torch::Tensor>& k_scales,
    const std::vector<torch::Tensor>& v_scales, std::optional<torch::Tensor> rotation, torch::Tensor cos,
    torch::Tensor sin, torch::Tensor slot_mapping, const DecodeAttention& step, double eps, double scale) {
  const int64_t m = hidden.size(0), width = hidden.size(1), head_dim = step.head_dim;
  const int64_t q_size = step.num_heads * head_dim, kv_size = step.num_kv_heads * head_dim;
  const int64_t qkv_size = layers[0].qkv.size(0), inner = layers[0].down.size(1);
  TORCH_CHECK(qkv_size == q_size + 2 * kv_size && layers[0].gate_up.size(0) == 2 * inner,
              "the layers' shapes do not match the cache's heads");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.numel() == m * head_dim && sin.numel() == m * head_dim,
              "cos/sin must be fp32 [T, head_dim]");
  TORCH_CHECK(step.starts[step.num_seqs] == m, "query_start_loc does not cover the step's ", m, " rows");
  auto slots = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK(slots.numel() == m, "slot_mapping must have one slot per row");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_caches[0].size(0) * step.block_size;
  for (int64_t r = 0; r < m; ++r) TORCH_CHECK(slot[r] < num_slots, "slot ", slot[r], " is outside the cache");
  const int threads = at::get_num_threads();
  const std::vector<std::vector<AttentionPiece>> pieces = attention_shares(step, threads);
  auto options = hidden.options();
  // Written by every thread's share, read whole after a barrier; shaped as the per-op path's tensors.
  auto qkv = torch::empty({m, qkv_size}, options), q_rot = torch::empty({m, q_size}, options);
  auto k_rot = torch::empty({m, kv_size}, options), attended = torch::empty({m, q_size}, options);
  auto attn_out = torch::empty({m, width}, options), gate_up = torch::empty({m, 2 * inner}, options);
  // Each layer's output: the next layer reads it in its first step, before a barrier.
  auto out = torch::empty({m, width}, options), residual = torch::empty({m, width}, options);
  // Each thread's own rows (sum, residual, normed, activation), each block 64-byte aligned with rows `width`
  // or `inner` apart as in torch's tensors: the compiler's vector loops (norms, SiLU's exp) then peel and
  // split as on the per-op path, and give the same bits (a misaligned copy put some elements on scalar expf).
  const int64_t block = (m * std::max(width, inner) + 15) / 16 * 16;
  auto private_rows = torch::empty({threads, 4, block}, options);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const float eps_f = static_cast<float>(eps), scale_f = static_cast<float>(scale);
  const bool quantized = !k_scales.empty();
  // A rotated cache's queries and keys are rotated after RoPE by torch's matmul, as on the per-op path: one
  // thread ropes every row and multiplies while the others wait, then all read the products.
  torch::Tensor q_rotated, k_rotated;

#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    const auto qkv_rows = share(qkv_size, 4, t, team), o_rows = share(width, 4, t, team);
    const auto gate_up_rows = share(2 * inner, 4, t, team), down_rows = share(width, 4, t, team);
    const auto kv_writes = share(m * step.num_kv_heads, 1, t, team);
    float* own = private_rows.data_ptr<float>() + t * 4 * block;
    float *sum = own, *res = own + block, *normed = own + 2 * block, *act = own + 3 * block;
    const float* x = hidden.data_ptr<float>();
    for (size_t i = 0; i < layers.size(); ++i) {
      const DecoderLayerWeights& w = layers[i];
      const bool first = i == 0;
      // The residual stream: x alone at the first layer, x + the previous layer's sum after.
      for (int64_t r = 0; r < m; ++r) {
        row_ops::add_rms_norm(x + r * width, first ? nullptr : res + r * width, w.input_norm.data_ptr<float>(),
                              eps_f, width, sum + r * width, normed + r * width);
      }
      const float* stream = first ? x : sum;
      linear_rows(normed, m, w.qkv, w.qkv_scale, w.qkv_bias, qkv.data_ptr<float>(), qkv_rows);
#pragma omp barrier
      const float* q = qkv.data_ptr<float>();
      const auto rope_k = [&](int64_t r, int64_t h) {
        row_ops::rotate_half(q + r * qkv_size + q_size + h * head_dim, c + r * head_dim, s + r * head_dim, head_dim,
                             k_rot.data_ptr<float>() + r * kv_size + h * head_dim);
      };
      const auto rope_q = [&](int64_t r, int64_t head) {
        row_ops::rotate_half(q + r * qkv_size + head * head_dim, c + r * head_dim, s + r * head_dim, head_dim,
                             q_rot.data_ptr<float>() + r * q_size + head * head_dim);
      };
      if (rotation.has_value()) {
        if (t == 0) {
          for (int64_t r = 0; r < m; ++r) {
            for (int64_t h = 0; h < step.num_kv_heads; ++h) rope_k(r, h);
            for (int64_t h = 0; h < step.num_heads; ++h) rope_q(r, h);
          }
          q_rotated = torch::matmul(q_rot.view({m, step.num_heads, head_dim}), *rotation);
          k_rotated = torch::matmul(k_rot.view({m, step.num_kv_heads, head_dim}), *rotation);
        }
#pragma omp barrier
      } else {
        for (size_t share_index = t; share_index < pieces.size(); share_index += team) {
          for (const AttentionPiece& piece : pieces[share_index]) {
            for (int64_t r = step.starts[piece.seq]; r < step.starts[piece.seq + 1]; ++r) {
              for (int64_t h = piece.head_begin; h < piece.head_end; ++h) {
                rope_q(r, piece.kv_head * (step.num_heads / step.num_kv_heads) + h);
              }
            }
          }
        }
      }
      const float* keys = rotation.has_value() ? k_rotated.data_ptr<float>() : k_rot.data_ptr<float>();
      float* k_scale = quantized ? k_scales[i].data_ptr<float>() : nullptr;
      float* v_scale = quantized ? v_scales[i].data_ptr<float>() : nullptr;
      for (int64_t u = kv_writes.first; u < kv_writes.second; ++u) {
        const int64_t r = u / step.num_kv_heads, h = u % step.num_kv_heads;
        if (!rotation.has_value()) rope_k(r, h);
        if (slot[r] < 0) continue;  // a padding row
        write_kv_head(keys + r * kv_size + h * head_dim, q + r * qkv_size + q_size + kv_size + h * head_dim,
                      k_caches[i], v_caches[i], k_scale, v_scale, slot[r], h);
      }
#pragma omp barrier
      const float* queries = rotation.has_value() ? q_rotated.data_ptr<float>() : q_rot.data_ptr<float>();
      for (size_t share_index = t; share_index < pieces.size(); share_index += team) {
        attend_pieces(step, pieces[share_index], queries, k_caches[i], v_caches[i], k_scale, v_scale, scale_f,
                      w.window, attended.data_ptr<float>());
      }
#pragma omp barrier
      linear_rows(attended.data_ptr<float>(), m, w.o, w.o_scale, w.o_bias, attn_out.data_ptr<float>(), o_rows);
#pragma omp barrier
      for (int64_t r = 0; r < m; ++r) {
        row_ops::add_rms_norm(attn_out.data_ptr<float>() + r * width, stream + r * width,
                              w.post_norm.data_ptr<float>(), eps_f, width, res + r * width, normed + r * width);
      }
      linear_rows(normed, m, w.gate_up, w.gate_up_scale, w.gate_up_bias, gate_up.data_ptr<float>(), gate_up_rows);
#pragma omp barrier
      for (int64_t r = 0; r < m; ++r) {
        const float* g = gate_up.data_ptr<float>() + r * 2 * inner;
        row_ops::silu_and_mul(g, g + inner, inner, act + r * inner);
      }
      linear_rows(act, m, w.down, w.down_scale, w.down_bias, out.data_ptr<float>(), down_rows);
#pragma omp barrier
      x = out.data_ptr<float>();
    }
    if (t == 0) std::memcpy(residual.data_ptr<float>(), res, m * width * sizeof(float));
  }
  return {out, residual};
}
