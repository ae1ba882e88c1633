// Every decoder layer of a decode-only fp32 step (weights fp32, int8 or GGUF Q8_0), run in one call.
//
// At batch 1 a layer of SmolLM2-135M reads ~14 MB of weights in well under a millisecond; driven from
// Python the same layer is ~10 module calls and ~40 small aten ops (views, splits, casts, a host sync in
// the cache write, allocations), worth a tenth of the step, and the engine thread holds the GIL between
// them, so the server's event loop waits for it to stream the previous token. Here the same kernels run
// in the same order (so the numbers are the per-op path's, bit for bit) with the GIL released for the
// whole stack. The per-op torch path stays the reference and serves everything else: prefill chunks,
// other dtypes, GPUs. A quantized KV cache (int8, fp8 e4m3) comes with one scale cache per layer and the
// rotation its keys are stored in (applied to keys and queries after RoPE, as the model does).
//
// Each layer says what its family computes (`DecoderLayerWeights`): q/k norms, the sandwich norms, GELU-tanh,
// a partial rotary, its scale, its window, its RoPE table and its KV group, whose block tables and slot
// mapping it reads (Gemma 3's sliding and full layers keep separate ones); a windowed layer reads only the
// blocks its window reaches. A step whose rows all run on the GEMVs goes on to decode_region.cpp, which runs
// the same kernels for the whole stack inside one parallel region.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/types.h>

#include "kernels.h"

namespace {

// oneDNN's inner product over a weight reordered into its blocked layout, the op `CpuLinear` calls past
// the GEMV's rows. Called boxed: its C++ signature has changed between torch releases, its schema has not.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& blocked,
                            const std::optional<torch::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.emplace_back(x);
  stack.emplace_back(blocked);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// The kernel the layer's module runs for its weight's kind and these rows: the int8 GEMV up to
// `int8_gemv_max_rows` rows and the int8 GEMM beyond; the fp32 GEMV up to `gemv_max_rows` rows and oneDNN
// over the blocked weight beyond (the stack takes larger fp32 steps only when it has that weight); a GGUF Q8_0
// linear's GEMV, exact or w8a8, at the rows `kernels.cpu_decode_stack` admits.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const std::optional<torch::Tensor>& blocked,
                     const std::optional<torch::Tensor>& scale, const std::optional<torch::Tensor>& bias,
                     int64_t gemv_max_rows, int64_t int8_gemv_max_rows, const std::optional<Q8_0Weights>& q8_0) {
  if (q8_0.has_value()) return q8_0_linear(x, *q8_0, bias);  // the Python side admits its rows
  if (scale.has_value()) {
    if (x.size(0) <= int8_gemv_max_rows) return linear_int8_gemv(x, weight, *scale, bias);
    return linear_int8_gemm(x, weight, *scale, bias);
  }
  if (x.size(0) <= gemv_max_rows || !blocked.has_value()) return linear_gemv(x, weight, bias);
  return onednn_linear(x, *blocked, bias);
}

// q or k of every token, [T, heads, head_dim], from its columns of the fused qkv output: normed over each head
// where the layer has the norm, as `Attention` norms them (a reshape to one head a row, then the RMSNorm).
torch::Tensor heads_of(const torch::Tensor& part, int64_t heads, int64_t head_dim,
                       const std::optional<torch::Tensor>& norm, double eps) {
  if (!norm.has_value()) return part.view({part.size(0), heads, head_dim});
  return std::get<0>(rms_norm(part.reshape({-1, head_dim}), *norm, eps, std::nullopt)).view({-1, heads, head_dim});
}

// RoPE over the first `rotary_dim` features of each head and the rest passed through, as `Attention._rope`.
std::tuple<torch::Tensor, torch::Tensor> rope(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos,
                                              const torch::Tensor& sin, int64_t rotary_dim) {
  const int64_t head_dim = q.size(2);
  if (rotary_dim == head_dim) return apply_rope(q, k, cos, sin);
  auto [q_rot, k_rot] =
      apply_rope(q.narrow(2, 0, rotary_dim).contiguous(), k.narrow(2, 0, rotary_dim).contiguous(), cos, sin);
  const int64_t rest = head_dim - rotary_dim;
  return {torch::cat({q_rot, q.narrow(2, rotary_dim, rest)}, 2), torch::cat({k_rot, k.narrow(2, rotary_dim, rest)}, 2)};
}

// The gated MLP's activation as `GatedMLP` runs it: the fused SiLU kernel, or ATen's GELU-tanh times up.
torch::Tensor activate(const torch::Tensor& gate_up, Activation activation) {
  if (activation == Activation::kSilu) return silu_and_mul(gate_up);
  const int64_t inner = gate_up.size(1) / 2;
  return at::gelu(gate_up.narrow(1, 0, inner), "tanh") * gate_up.narrow(1, inner, inner);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor hidden, const std::vector<DecoderLayerWeights>& layers, const std::vector<torch::Tensor>& k_caches,
    const std::vector<torch::Tensor>& v_caches, const std::vector<torch::Tensor>& cos,
    const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& slot_mappings,
    const std::vector<torch::Tensor>& block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
    int64_t num_heads, double eps, const std::vector<torch::Tensor>& k_scales,
    const std::vector<torch::Tensor>& v_scales, std::optional<torch::Tensor> rotation, int64_t gemv_max_rows,
    int64_t int8_gemv_max_rows) {
  TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
              "one K and one V cache per layer");
  const bool quantized = !k_scales.empty();
  TORCH_CHECK(!quantized || (k_scales.size() == layers.size() && v_scales.size() == layers.size()),
              "one K and one V scale cache per layer, or none");
  TORCH_CHECK(!layers.empty(), "no layers");
  TORCH_CHECK(cos.size() == sin.size() && slot_mappings.size() == block_tables.size(),
              "one sin per cos table and one slot mapping per block table");
  for (const DecoderLayerWeights& w : layers) {
    TORCH_CHECK(w.rope >= 0 && w.rope < static_cast<int64_t>(cos.size()), "a layer's RoPE table is missing");
    TORCH_CHECK(w.kv_group >= 0 && w.kv_group < static_cast<int64_t>(block_tables.size()),
                "a layer's KV group has no block table");
  }
  const int64_t tokens = hidden.size(0), num_kv_heads = k_caches[0].size(2), head_dim = k_caches[0].size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // Converted once here, not once per layer inside the attention kernel.
  std::vector<torch::Tensor> tables, slots;
  for (size_t g = 0; g < block_tables.size(); ++g) {
    tables.push_back(block_tables[g].to(torch::kInt64).contiguous());
    slots.push_back(slot_mappings[g].to(torch::kInt64).contiguous());
  }
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  auto starts = query_start_loc.to(torch::kInt64).contiguous();
  if (decode_region_applies(hidden, layers, k_caches, v_caches, k_scales, v_scales, gemv_max_rows,
                            int8_gemv_max_rows)) {
    std::vector<DecodeAttention> steps;
    for (const torch::Tensor& table : tables) {
      steps.push_back({table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), lens.size(0),
                       table.size(1), num_heads, num_kv_heads, head_dim, k_caches[0].size(1)});
    }
    std::vector<torch::Tensor> cos_c, sin_c;
    for (size_t i = 0; i < cos.size(); ++i) cos_c.push_back(cos[i].contiguous()), sin_c.push_back(sin[i].contiguous());
    return decode_region(hidden, layers, k_caches, v_caches, k_scales, v_scales, rotation, cos_c, sin_c, slots, steps,
                         eps);
  }
  std::optional<torch::Tensor> residual;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayerWeights& w = layers[i];
    const torch::Tensor &table = tables[w.kv_group], &slot = slots[w.kv_group];
    auto [normed, sum] = rms_norm(hidden, w.input_norm, eps, residual);
    auto qkv = linear(normed, w.qkv, w.qkv_blocked, w.qkv_scale, w.qkv_bias, gemv_max_rows, int8_gemv_max_rows,
                      w.qkv_q8_0);
    auto q = heads_of(qkv.narrow(1, 0, q_size), num_heads, head_dim, w.q_norm, eps);
    auto k = heads_of(qkv.narrow(1, q_size, kv_size), num_kv_heads, head_dim, w.k_norm, eps);
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    auto [q_rot, k_rot] = rope(q, k, cos[w.rope], sin[w.rope], w.rotary_dim);
    if (rotation.has_value()) q_rot = torch::matmul(q_rot, *rotation), k_rot = torch::matmul(k_rot, *rotation);
    std::optional<torch::Tensor> k_scale, v_scale;
    if (quantized) k_scale = k_scales[i], v_scale = v_scales[i];
    write_kv_cache(k_rot, v, k_caches[i], v_caches[i], slot, k_scale, v_scale);
    auto attended =
        paged_attention(q_rot, k_caches[i], v_caches[i], table, lens, starts, w.scale, k_scale, v_scale, w.window);
    auto attn_out = linear(attended.view({tokens, q_size}), w.o, w.o_blocked, w.o_scale, w.o_bias, gemv_max_rows,
                           int8_gemv_max_rows, w.o_q8_0);
    if (w.attn_out_norm.has_value()) attn_out = std::get<0>(rms_norm(attn_out, *w.attn_out_norm, eps, std::nullopt));
    auto [mlp_in, attn_sum] = rms_norm(attn_out, w.mlp_norm, eps, sum);
    auto gate_up = linear(mlp_in, w.gate_up, w.gate_up_blocked, w.gate_up_scale, w.gate_up_bias, gemv_max_rows,
                          int8_gemv_max_rows, w.gate_up_q8_0);
    hidden = linear(activate(gate_up, w.activation), w.down, w.down_blocked, w.down_scale, w.down_bias, gemv_max_rows,
                    int8_gemv_max_rows, w.down_q8_0);
    if (w.mlp_out_norm.has_value()) hidden = std::get<0>(rms_norm(hidden, *w.mlp_out_norm, eps, std::nullopt));
    residual = attn_sum;
  }
  return {hidden, *residual};
}
