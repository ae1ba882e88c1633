// The CPU kernels one translation unit offers another (and the bindings expose to Python).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual);
std::tuple<torch::Tensor, torch::Tensor> apply_rope(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                                                    torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor linear_gemv(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias);
std::string gemv_isa();
void set_gemv_isa(const std::string& name);

// One decoder layer's parameters as the decode stack reads them: plain row-major fp32 weights, shared
// with the model's own modules (nothing is copied).
struct DecoderLayerWeights {
  torch::Tensor input_norm, qkv, o, post_norm, gate_up, down;
  std::optional<torch::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
};

std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor hidden, const std::vector<DecoderLayerWeights>& layers, const std::vector<torch::Tensor>& k_caches,
    const std::vector<torch::Tensor>& v_caches, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
    torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc, int64_t num_heads,
    double eps, double scale);
