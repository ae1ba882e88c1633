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
// A family's layer differs only in what `DecoderLayerWeights` says: its q/k norms run per head where the head
// is roped, its sandwich norms on each thread's own rows like the others, its GELU-tanh through ATen's own
// kernel (on each thread's copy, in the one chunk the per-op path runs it in), and each layer attends with its
// KV group's block tables and slots, its RoPE table, scale and window.
//
// A quantized cache's rows are quantized as they are written (`write_kv_head`) and read through its scales;
// where its keys are rotated, one thread ropes and rotates every row with torch's matmul while the others wait.
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/types.h>
// After torch/types.h, which declares the c10 types it uses.
#include <ATen/ops/gelu_cpu_dispatch.h>

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

// A GGUF Q8_0 linear runs its own GEMV at any rows the Python side admits (its segments were checked there).
bool q8_0_ready(const torch::Tensor& weight, const std::optional<Q8_0Weights>& q8_0,
                const std::optional<torch::Tensor>& bias) {
  return q8_0.has_value() && weight.dim() == 2 && weight.size(1) % 32 == 0 &&
         q8_0->out_rows.numel() == weight.size(0) && !q8_0->segments.empty() &&
         q8_0->segments[0].size(1) == weight.size(1) / 32 * 34 && fp32_vector(bias, weight.size(0));
}

// Rows [begin, end) of one linear layer for the m rows of x (contiguous, `k` wide) into y [m, n].
void linear_rows(const float* x, int64_t m, const torch::Tensor& weight, const std::optional<torch::Tensor>& scale,
                 const std::optional<torch::Tensor>& bias, float* y, std::pair<int64_t, int64_t> rows,
                 const std::optional<Q8_0Weights>& q8_0) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (q8_0.has_value()) {
    q8_0_linear_rows(x, k, m, k, *q8_0, b, y, rows.first, rows.second);
  } else if (scale.has_value()) {
    int8_gemv_row_range(x, k, m, weight.data_ptr<int8_t>(), scale->data_ptr<float>(), b, y, n, k, rows.first,
                        rows.second);
  } else {
    gemv_row_range(x, k, m, weight.data_ptr<float>(), b, y, n, k, rows.first, rows.second);
  }
}

// Elements above which ATen's GELU kernel splits its work over threads (GeluKernelImpl's
// GELU_MIN_ELEMENTS_FOR_MULTI_THREADING): each split vectorises from its own start, so a step past it keeps
// the per-op kernels, whose GELU splits as the per-op path's does.
constexpr int64_t kGeluOneChunk = 16384;

// act = gelu_tanh(gate) * up for every row, gate [m, inner] a view of the fused gate_up output and act this
// thread's own [m, inner] rows: ATen's own CPU kernel, called directly (no dispatcher, so from any thread of the
// region), as one chunk, the way the per-op path's `gelu(gate) * up` runs at these sizes.
void gelu_tanh_and_mul(const torch::Tensor& gate, torch::Tensor act) {
  at::cpu::gelu_out(act, gate, "tanh");
  const int64_t m = gate.size(0), inner = gate.size(1), ld = gate.stride(0);
  const float* up = gate.data_ptr<float>() + inner;
  float* a = act.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < inner; ++j) a[r * inner + j] *= up[r * ld + j];
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
  const int64_t rows = hidden.size(0), width = hidden.size(1), head_dim = k_caches[0].size(3);
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayerWeights& w = layers[i];
    const auto ready = [&](const torch::Tensor& weight, const std::optional<torch::Tensor>& scale,
                           const std::optional<torch::Tensor>& bias, const std::optional<Q8_0Weights>& q8_0) {
      return q8_0.has_value() ? q8_0_ready(weight, q8_0, bias)
                              : gemv_ready(weight, scale, bias, rows, gemv_max_rows, int8_gemv_max_rows);
    };
    const auto scales_ready = [&](const std::vector<torch::Tensor>& scales) {
      return !quantized || (scales[i].scalar_type() == torch::kFloat32 && scales[i].is_contiguous() &&
                            scales[i].numel() == k_caches[i].numel() / k_caches[i].size(3));
    };
    // A head norm's sums read each head where the per-op path's copy of the heads has it only when heads are
    // whole 64-byte lines apart (the compiler's vector loop splits the sum by alignment).
    const bool head_norms = w.q_norm.has_value() || w.k_norm.has_value();
    if (k_caches[i].scalar_type() != dtype || v_caches[i].scalar_type() != dtype || !k_caches[i].is_contiguous() ||
        !v_caches[i].is_contiguous() || !scales_ready(k_scales) || !scales_ready(v_scales) ||
        !fp32_vector(w.input_norm, width) || !fp32_vector(w.mlp_norm, width) ||
        !fp32_vector(w.attn_out_norm, width) || !fp32_vector(w.mlp_out_norm, width) ||
        !fp32_vector(w.q_norm, head_dim) || !fp32_vector(w.k_norm, head_dim) || (head_norms && head_dim % 16 != 0) ||
        (w.activation == Activation::kGeluTanh && rows * w.down.size(1) > kGeluOneChunk) ||
        !ready(w.qkv, w.qkv_scale, w.qkv_bias, w.qkv_q8_0) || !ready(w.o, w.o_scale, w.o_bias, w.o_q8_0) ||
        !ready(w.gate_up, w.gate_up_scale, w.gate_up_bias, w.gate_up_q8_0) ||
        !ready(w.down, w.down_scale, w.down_bias, w.down_q8_0)) {
      return false;
    }
  }
  return true;
}

std::tuple<torch::Tensor, torch::Tensor> decode_region(
    torch::Tensor hidden, const std::vector<DecoderLayerWeights>& layers, const std::vector<torch::Tensor>& k_caches,
    const std::vector<torch::Tensor>& v_caches, const std::vector<torch::Tensor>& k_scales,
    const std::vector<torch::Tensor>& v_scales, std::optional<torch::Tensor> rotation,
    const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
    const std::vector<torch::Tensor>& slot_mappings, const std::vector<DecodeAttention>& steps, double eps) {
  const DecodeAttention& shape = steps[0];
  const int64_t m = hidden.size(0), width = hidden.size(1), head_dim = shape.head_dim;
  const int64_t num_heads = shape.num_heads, num_kv_heads = shape.num_kv_heads;
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t qkv_size = layers[0].qkv.size(0), inner = layers[0].down.size(1);
  TORCH_CHECK(shape.starts[shape.num_seqs] == m, "query_start_loc does not cover the step's ", m, " rows");
  const int64_t num_slots = k_caches[0].size(0) * shape.block_size;
  for (const torch::Tensor& slots : slot_mappings) {
    TORCH_CHECK(slots.numel() == m, "slot_mapping must have one slot per row");
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t r = 0; r < m; ++r) TORCH_CHECK(slot[r] < num_slots, "slot ", slot[r], " is outside the cache");
  }
  for (const DecoderLayerWeights& w : layers) {
    TORCH_CHECK(w.qkv.size(0) == qkv_size && qkv_size == q_size + 2 * kv_size && w.down.size(1) == inner &&
                    w.gate_up.size(0) == 2 * inner,
                "the layers' shapes do not match the cache's heads");
    const torch::Tensor &c = cos[w.rope], &s = sin[w.rope];
    TORCH_CHECK(w.rotary_dim > 0 && w.rotary_dim <= head_dim && w.rotary_dim % 2 == 0 &&
                    c.scalar_type() == torch::kFloat32 && s.scalar_type() == torch::kFloat32 &&
                    c.numel() == m * w.rotary_dim && s.numel() == m * w.rotary_dim,
                "cos/sin must be fp32 [T, rotary_dim] for an even rotary_dim up to the head size");
  }
  // Every group has the step's sequences and rows, so one cut of the heads serves every layer.
  const int threads = at::get_num_threads();
  const std::vector<std::vector<AttentionPiece>> pieces = attention_shares(shape, threads);
  auto options = hidden.options();
  // Written by every thread's share, read whole after a barrier; shaped as the per-op path's tensors.
  auto qkv = torch::empty({m, qkv_size}, options), q_rot = torch::empty({m, q_size}, options);
  auto k_rot = torch::empty({m, kv_size}, options), attended = torch::empty({m, q_size}, options);
  auto attn_out = torch::empty({m, width}, options), gate_up = torch::empty({m, 2 * inner}, options);
  const auto gate = gate_up.narrow(1, 0, inner);
  // Each layer's output: the next layer reads it in its first step, before a barrier.
  auto out = torch::empty({m, width}, options), residual = torch::empty({m, width}, options);
  // The stack's output: the last down projection's, or its norm (each thread's own copy; the others may still
  // be reading `out` for theirs when thread 0 writes it here).
  auto result = layers.back().mlp_out_norm.has_value() ? torch::empty({m, width}, options) : out;
  // Each thread's own rows (sum, residual, normed, activation, normed attention and MLP outputs) and one head,
  // each block 64-byte aligned with rows `width` or `inner` apart as in torch's tensors: the compiler's vector
  // loops (norms, SiLU's exp) then peel and split as on the per-op path, and give the same bits (a misaligned
  // copy put some elements on scalar expf).
  constexpr int kBlocks = 7;
  const int64_t block = (std::max(m * std::max(width, inner), head_dim) + 15) / 16 * 16;
  auto private_rows = torch::empty({threads, kBlocks, block}, options);
  // Each thread's activation rows as a tensor for ATen's GELU, made here: views taken inside the region would be
  // taken outside the caller's inference mode.
  std::vector<torch::Tensor> act_rows;
  for (int i = 0; i < threads; ++i) act_rows.push_back(private_rows[i][3].narrow(0, 0, m * inner).view({m, inner}));
  const float eps_f = static_cast<float>(eps);
  const bool quantized = !k_scales.empty();
  // A rotated cache's queries and keys are rotated after RoPE by torch's matmul, as on the per-op path: one
  // thread ropes every row and multiplies while the others wait, then all read the products.
  torch::Tensor q_rotated, k_rotated;

#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    const auto qkv_rows = share(qkv_size, 4, t, team), o_rows = share(width, 4, t, team);
    const auto gate_up_rows = share(2 * inner, 4, t, team), down_rows = share(width, 4, t, team);
    const auto kv_writes = share(m * num_kv_heads, 1, t, team);
    float* own = private_rows.data_ptr<float>() + t * kBlocks * block;
    float *sum = own, *res = own + block, *normed = own + 2 * block, *act = own + 3 * block;
    float *attn_normed = own + 4 * block, *mlp_normed = own + 5 * block, *head = own + 6 * block;
    const float* x = hidden.data_ptr<float>();
    for (size_t i = 0; i < layers.size(); ++i) {
      const DecoderLayerWeights& w = layers[i];
      const DecodeAttention& step = steps[w.kv_group];
      const int64_t* slot = slot_mappings[w.kv_group].data_ptr<int64_t>();
      const int64_t rd = w.rotary_dim;
      const float* c = cos[w.rope].data_ptr<float>();
      const float* s = sin[w.rope].data_ptr<float>();
      const bool first = i == 0;
      // The residual stream: x alone at the first layer, x + the previous layer's sum after.
      for (int64_t r = 0; r < m; ++r) {
        row_ops::add_rms_norm(x + r * width, first ? nullptr : res + r * width, w.input_norm.data_ptr<float>(),
                              eps_f, width, sum + r * width, normed + r * width);
      }
      const float* stream = first ? x : sum;
      linear_rows(normed, m, w.qkv, w.qkv_scale, w.qkv_bias, qkv.data_ptr<float>(), qkv_rows, w.qkv_q8_0);
#pragma omp barrier
      const float* q = qkv.data_ptr<float>();
      // One head of row r, normed where the layer norms heads, then roped.
      const auto prepare = [&](const float* in, const std::optional<torch::Tensor>& norm, int64_t r, float* dst) {
        if (norm.has_value()) {
          row_ops::add_rms_norm(in, nullptr, norm->data_ptr<float>(), eps_f, head_dim, nullptr, head);
          in = head;
        }
        row_ops::rotate_half(in, c + r * rd, s + r * rd, rd, dst);
        std::copy(in + rd, in + head_dim, dst + rd);
      };
      const auto rope_k = [&](int64_t r, int64_t h) {
        prepare(q + r * qkv_size + q_size + h * head_dim, w.k_norm, r,
                k_rot.data_ptr<float>() + r * kv_size + h * head_dim);
      };
      const auto rope_q = [&](int64_t r, int64_t h) {
        prepare(q + r * qkv_size + h * head_dim, w.q_norm, r, q_rot.data_ptr<float>() + r * q_size + h * head_dim);
      };
      if (rotation.has_value()) {
        if (t == 0) {
          for (int64_t r = 0; r < m; ++r) {
            for (int64_t h = 0; h < num_kv_heads; ++h) rope_k(r, h);
            for (int64_t h = 0; h < num_heads; ++h) rope_q(r, h);
          }
          q_rotated = torch::matmul(q_rot.view({m, num_heads, head_dim}), *rotation);
          k_rotated = torch::matmul(k_rot.view({m, num_kv_heads, head_dim}), *rotation);
        }
#pragma omp barrier
      } else {
        for (size_t share_index = t; share_index < pieces.size(); share_index += team) {
          for (const AttentionPiece& piece : pieces[share_index]) {
            for (int64_t r = step.starts[piece.seq]; r < step.starts[piece.seq + 1]; ++r) {
              for (int64_t h = piece.head_begin; h < piece.head_end; ++h) {
                rope_q(r, piece.kv_head * (num_heads / num_kv_heads) + h);
              }
            }
          }
        }
      }
      const float* keys = rotation.has_value() ? k_rotated.data_ptr<float>() : k_rot.data_ptr<float>();
      float* k_scale = quantized ? k_scales[i].data_ptr<float>() : nullptr;
      float* v_scale = quantized ? v_scales[i].data_ptr<float>() : nullptr;
      for (int64_t u = kv_writes.first; u < kv_writes.second; ++u) {
        const int64_t r = u / num_kv_heads, h = u % num_kv_heads;
        if (!rotation.has_value()) rope_k(r, h);
        if (slot[r] < 0) continue;  // a padding row
        write_kv_head(keys + r * kv_size + h * head_dim, q + r * qkv_size + q_size + kv_size + h * head_dim,
                      k_caches[i], v_caches[i], k_scale, v_scale, slot[r], h);
      }
#pragma omp barrier
      const float* queries = rotation.has_value() ? q_rotated.data_ptr<float>() : q_rot.data_ptr<float>();
      for (size_t share_index = t; share_index < pieces.size(); share_index += team) {
        attend_pieces(step, pieces[share_index], queries, k_caches[i], v_caches[i], k_scale, v_scale,
                      static_cast<float>(w.scale), w.window, attended.data_ptr<float>());
      }
#pragma omp barrier
      linear_rows(attended.data_ptr<float>(), m, w.o, w.o_scale, w.o_bias, attn_out.data_ptr<float>(), o_rows,
                  w.o_q8_0);
#pragma omp barrier
      const float* attn = attn_out.data_ptr<float>();
      if (w.attn_out_norm.has_value()) {
        for (int64_t r = 0; r < m; ++r) {
          row_ops::add_rms_norm(attn + r * width, nullptr, w.attn_out_norm->data_ptr<float>(), eps_f, width, nullptr,
                                attn_normed + r * width);
        }
        attn = attn_normed;
      }
      for (int64_t r = 0; r < m; ++r) {
        row_ops::add_rms_norm(attn + r * width, stream + r * width, w.mlp_norm.data_ptr<float>(), eps_f, width,
                              res + r * width, normed + r * width);
      }
      linear_rows(normed, m, w.gate_up, w.gate_up_scale, w.gate_up_bias, gate_up.data_ptr<float>(), gate_up_rows,
                  w.gate_up_q8_0);
#pragma omp barrier
      if (w.activation == Activation::kSilu) {
        for (int64_t r = 0; r < m; ++r) {
          const float* g = gate_up.data_ptr<float>() + r * 2 * inner;
          row_ops::silu_and_mul(g, g + inner, inner, act + r * inner);
        }
      } else {
        gelu_tanh_and_mul(gate, act_rows[t]);
      }
      linear_rows(act, m, w.down, w.down_scale, w.down_bias, out.data_ptr<float>(), down_rows, w.down_q8_0);
#pragma omp barrier
      x = out.data_ptr<float>();
      if (w.mlp_out_norm.has_value()) {
        for (int64_t r = 0; r < m; ++r) {
          row_ops::add_rms_norm(x + r * width, nullptr, w.mlp_out_norm->data_ptr<float>(), eps_f, width, nullptr,
                                mlp_normed + r * width);
        }
        x = mlp_normed;
      }
    }
    if (t == 0) {
      std::memcpy(residual.data_ptr<float>(), res, m * width * sizeof(float));
      if (x != out.data_ptr<float>()) std::memcpy(result.data_ptr<float>(), x, m * width * sizeof(float));
    }
  }
  return {result, residual};
}
