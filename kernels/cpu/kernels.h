// The CPU kernels one translation unit offers another (and the bindings expose to Python).
#pragma once

#include <torch/types.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

// Functions built for one instruction set, chosen at run time from the CPU's features.
#define TANDEM_AVX512 __attribute__((target("avx512f,avx512dq,fma")))
#define TANDEM_AVX2 __attribute__((target("avx2,fma")))

// k_scales/v_scales: the fp32 [blocks, block_size, kv_heads] scales of an int8 or fp8 e4m3 cache; none for fp32.
// window: a sliding window in tokens (the query at position p sees keys p - window < j <= p), 0 for full
// attention; blocks below every query's window of a sequence are never read (their table entries may be garbage).
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale, std::optional<torch::Tensor> k_scales,
                              std::optional<torch::Tensor> v_scales, int64_t window);
// One (token, KV head) row of K and V written to `slot` of the caches: copied into an fp32 cache, quantized (its
// scale beside it) into an int8 or fp8 e4m3 one, as `write_kv_cache` writes it. Unchecked: the caller checked.
void write_kv_head(const float* key, const float* value, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   float* k_scales, float* v_scales, int64_t slot, int64_t head);
// A decode step's attention cut into shares of about equal cost at query-head granularity, for the threads
// of a parallel region (decode_region.cpp). A piece is one sequence's rows against one KV head, for the query
// heads [head_begin, head_end) of its group; each head's value is the one `paged_attention` gives it,
// whatever the cut.
struct AttentionPiece {
  int64_t seq, kv_head, head_begin, head_end;
};
struct DecodeAttention {
  const int64_t* tables;  // [num_seqs, table_width]
  const int64_t* seq_lens;
  const int64_t* starts;  // query_start_loc, num_seqs + 1
  int64_t num_seqs, table_width, num_heads, num_kv_heads, head_dim, block_size;
};
std::vector<std::vector<AttentionPiece>> attention_shares(const DecodeAttention& step, int64_t shares);
// k_scales / v_scales: a quantized cache's scales (null for fp32; the cache's dtype says which).
void attend_pieces(const DecodeAttention& step, const std::vector<AttentionPiece>& pieces, const float* query,
                   const torch::Tensor& k_cache, const torch::Tensor& v_cache, const float* k_scales,
                   const float* v_scales, float scale, int64_t window, float* out);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping, std::optional<torch::Tensor> k_scales,
                    std::optional<torch::Tensor> v_scales);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual);
std::tuple<torch::Tensor, torch::Tensor> apply_rope(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                                                    torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
// y[m, n] = x[m, k] W[n, k]^T + bias, x rows ldx apart, y contiguous (the GEMV behind linear_gemv).
void gemv_into(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t m, int64_t n,
               int64_t k);
torch::Tensor linear_gemv(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias);
// Output rows [row_begin, row_end) of y = x W^T + b for the m rows of x (ldx apart), on the calling thread: a
// thread's share of a GEMV inside a parallel region that is already running. row_begin must be a multiple of 4;
// every value is the one the whole GEMV (linear_gemv, linear_int8_gemv) gives it.
void gemv_row_range(const float* x, int64_t ldx, int64_t m, const float* w, const float* bias, float* y, int64_t n,
                    int64_t k, int64_t row_begin, int64_t row_end);
void int8_gemv_row_range(const float* x, int64_t ldx, int64_t m, const int8_t* qweight, const float* scale,
                         const float* bias, float* y, int64_t n, int64_t k, int64_t row_begin, int64_t row_end);
// The instruction set the GEMVs (fp32 and int8 weights) and the int8 GEMM run on: the widest this CPU
// has, unless a test narrowed it with set_gemv_isa.
enum class GemvIsa { kAvx512, kAvx2, kPortable };
GemvIsa current_gemv_isa();
std::string gemv_isa();
void set_gemv_isa(const std::string& name);
// `y = (x Wq^T) * scale + b` for a few rows of x over int8 weights Wq [N, K] with one fp32 scale per row.
torch::Tensor linear_int8_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                               std::optional<torch::Tensor> bias);
// The same for many rows: panels of Wq converted to fp32 q * scale, multiplied by a register-tiled GEMM.
torch::Tensor linear_int8_gemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                               std::optional<torch::Tensor> bias);
// `y = x W^T + b` for a few rows of fp32 x over GGUF Q8_0 blocks [N, K / 32 * 34] (fp16 scale + 32 int8 each),
// read in place; each weight is the exact fp32 d * q (gemv_q8_0.cpp).
torch::Tensor linear_q8_0_gemv(torch::Tensor x, torch::Tensor blocks, std::optional<torch::Tensor> bias);
// `y = x W^T + b` for a few rows of fp32 x over GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K blocks
// [N, K / block * bytes] read in place (`ggml_type` is gguf's number for the type); each weight is the fp32
// value gguf's dequantize gives it (gemv_blocks.cpp).
torch::Tensor linear_gguf_gemv(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                               std::optional<torch::Tensor> bias);
// A GGUF Q8_0 linear as the decode stack reads it (q8_0_linear.cpp): the checkpoint tensors' blocks, each a view
// of the mapped file, their rows one after another; `out_rows[r]` is the output column of stored row r (a
// segment's offset, and llama.cpp's q/k permutation undone); `w8a8` quantizes x per 32-block.
struct Q8_0Weights {
  std::vector<torch::Tensor> segments;
  torch::Tensor out_rows;
  bool w8a8 = false;
};
// Rows of x quantized per block of 32 for the w8a8 Q8_0 GEMV (gemv_q8_0_w8a8.cpp): q [m, k]; per row
// `padded_blocks` (k / 32 rounded up to 8) fp32 scales and 128 * sum(q) of each block, zero past k / 32.
struct Q8_0Activations {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> offset_sums;
  int64_t m = 0, k = 0, padded_blocks = 0;
};
// One row of x as int8 round(x / s), s = max|x| / 127 returned (w8a8.cpp's rounding).
float quantize_row_int8(const float* x, int64_t k, int8_t* q);
void quantize_q8_0_activations(const float* x, int64_t ldx, int64_t m, int64_t k, Q8_0Activations& out);
// W rows [row_begin, row_end) of Q8_0 `blocks` ([n, k / 32 * 34]) against every row of x on the calling thread,
// row r written to column out_rows[r] (r when null) of y (rows ldy apart), plus bias[column]; exact and w8a8.
void q8_0_gemv_row_range(const float* x, int64_t ldx, int64_t m, const uint8_t* blocks, int64_t n, int64_t k,
                         const float* bias, const int64_t* out_rows, float* y, int64_t ldy, int64_t row_begin,
                         int64_t row_end);
void q8_0_w8a8_row_range(const Q8_0Activations& x, const uint8_t* blocks, const float* bias, const int64_t* out_rows,
                         float* y, int64_t ldy, int64_t row_begin, int64_t row_end);
torch::Tensor linear_q8_0_w8a8(torch::Tensor x, torch::Tensor blocks, std::optional<torch::Tensor> bias);
// Stored rows [row_begin, row_end) of a Q8_0 linear (across its segments) for m rows of x (k = width of x,
// rows ldx apart) into y [m, out_rows.numel()]; a w8a8 linear quantizes x on the calling thread.
void q8_0_linear_rows(const float* x, int64_t ldx, int64_t m, int64_t k, const Q8_0Weights& w, const float* bias,
                      float* y, int64_t row_begin, int64_t row_end);
// The whole linear over the extension's threads (the decode stack's per-op loop).
torch::Tensor q8_0_linear(const torch::Tensor& x, const Q8_0Weights& w, const std::optional<torch::Tensor>& bias);
// W8A8: x quantized to int8 per row (`quantize_rows_int8`: int8 rows and one fp32 scale each), multiplied by
// int8 Wq in exact int32 sums, scaled back by both scales (w8a8.cpp); the GEMV up to gemv_max_rows rows of x,
// oneDNN's int8 GEMM beyond.
std::tuple<torch::Tensor, torch::Tensor> quantize_rows_int8(torch::Tensor x);
// weight_sums (int32 row sums of Wq), when given, let rows past the GEMV's, up to vnni_max_rows, take the AVX-512
// VNNI GEMM instead of oneDNN's.
torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                          std::optional<torch::Tensor> bias, int64_t gemv_max_rows,
                          std::optional<torch::Tensor> weight_sums, int64_t vnni_max_rows);
// The argument checks both int8 linears share; returns the bias pointer (null without one).
const float* check_int8_linear(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scale,
                               const std::optional<torch::Tensor>& bias);
torch::Tensor greedy_lm_head(torch::Tensor hidden, torch::Tensor weight, torch::Tensor weight_t, int64_t gemv_max_rows);

// The activation of a layer's gated MLP, `act(gate) * up`: SiLU (the fused kernel) or GELU-tanh (ATen's).
enum class Activation { kSilu, kGeluTanh };

// One decoder layer as the decode stack computes it: plain row-major weights, shared with the model's own
// modules (nothing is copied), and the facts that make a family's layer what it is. The layer is
//   h = input_norm(x + residual); a = o(attention(rope(q_norm(q)), rope(k_norm(k)), v)) for qkv = qkv(h);
//   a = attn_out_norm(a) where present; m = mlp_norm(a + stream); y = down(act(gate_up(m)));
//   y = mlp_out_norm(y) where present,
// so the Llama layer has input_norm and mlp_norm (its post-attention norm) only, Qwen3 adds the q/k norms and
// Gemma 3 all six. Norm weights are the factors the RMSNorm kernel multiplies by (Gemma's 1 + weight). A
// linear with a scale has int8 weights (a scale per row).
struct DecoderLayerWeights {
  torch::Tensor input_norm, qkv, o, mlp_norm, gate_up, down;
  std::optional<torch::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
  std::optional<torch::Tensor> qkv_scale, o_scale, gate_up_scale, down_scale;
  // fp32 linears: the weight reordered into oneDNN's blocked layout, for steps past the GEMV's rows.
  std::optional<torch::Tensor> qkv_blocked, o_blocked, gate_up_blocked, down_blocked;
  // Over one head's features, applied to every query / key head before RoPE.
  std::optional<torch::Tensor> q_norm, k_norm;
  // Over the attention's and the MLP's outputs, before their residual adds (Gemma's sandwich).
  std::optional<torch::Tensor> attn_out_norm, mlp_out_norm;
  Activation activation = Activation::kSilu;
  // The attention's score scale (1/sqrt(head_dim), or Gemma's query_pre_attn_scalar^-0.5).
  double scale = 1.0;
  // The leading features of each head RoPE rotates (the head size, or less for a partial rotary); the rest
  // pass through.
  int64_t rotary_dim = 0;
  // The layer's sliding window in tokens, 0 for full attention (as `paged_attention` takes it).
  int64_t window = 0;
  // The KV group whose block tables and slot mapping the layer reads (`engine.kv_layout`).
  int64_t kv_group = 0;
  // The cos/sin table its RoPE reads (a model may have one per layer type).
  int64_t rope = 0;
  // GGUF Q8_0 linears, whose weight above is then a meta tensor of the linear's [N, K] shape.
  std::optional<Q8_0Weights> qkv_q8_0, o_q8_0, gate_up_q8_0, down_q8_0;
};

// decode_layers' few-row case (decode_region.cpp): every layer of a step whose rows all run on the GEMVs in one
// parallel region; `decode_region_applies` says whether a step is that case (k_scales/v_scales as decode_layers
// takes them). `steps` and `slot_mappings` have one entry per KV group (its block tables, its int64 slots).
bool decode_region_applies(const torch::Tensor& hidden, const std::vector<DecoderLayerWeights>& layers,
                           const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                           const std::vector<torch::Tensor>& k_scales, const std::vector<torch::Tensor>& v_scales,
                           int64_t gemv_max_rows, int64_t int8_gemv_max_rows);
std::tuple<torch::Tensor, torch::Tensor> decode_region(
    torch::Tensor hidden, const std::vector<DecoderLayerWeights>& layers, const std::vector<torch::Tensor>& k_caches,
    const std::vector<torch::Tensor>& v_caches, const std::vector<torch::Tensor>& k_scales,
    const std::vector<torch::Tensor>& v_scales, std::optional<torch::Tensor> rotation,
    const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
    const std::vector<torch::Tensor>& slot_mappings, const std::vector<DecodeAttention>& steps, double eps);

// k_scales/v_scales: one scale cache per layer for a quantized cache, empty for fp32; rotation: the
// [head_dim, head_dim] matrix a quantized cache's keys (and the queries) are rotated by after RoPE; cos/sin: the
// step's RoPE tables, [T, rotary_dim] each, as `DecoderLayerWeights::rope` indexes them; slot_mappings /
// block_tables: one per KV group, as `DecoderLayerWeights::kv_group` indexes them (seq_lens and
// query_start_loc are the step's, shared by every group); gemv_max_rows / int8_gemv_max_rows: the most rows an
// fp32 / int8 linear runs on its GEMV (oneDNN / the int8 GEMM beyond), as `CpuLinear` and `Int8Linear` do.
std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor hidden, const std::vector<DecoderLayerWeights>& layers, const std::vector<torch::Tensor>& k_caches,
    const std::vector<torch::Tensor>& v_caches, const std::vector<torch::Tensor>& cos,
    const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& slot_mappings,
    const std::vector<torch::Tensor>& block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
    int64_t num_heads, double eps, const std::vector<torch::Tensor>& k_scales,
    const std::vector<torch::Tensor>& v_scales, std::optional<torch::Tensor> rotation, int64_t gemv_max_rows,
    int64_t int8_gemv_max_rows);

// `y = x W^T + b` for a few rows of bf16 x over bf16 W [N, K], accumulated in fp32 (gemv_bf16.cpp); y is bf16,
// or fp32 with fp32_out (logits). The instruction set: the widest this CPU has (avx512_bf16, avx512, avx2,
// portable) unless a test chose another of `bf16_gemv_isas()`.
torch::Tensor linear_bf16_gemv(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias,
                               bool fp32_out);
std::string bf16_gemv_isa();
std::vector<std::string> bf16_gemv_isas();
void set_bf16_gemv_isa(const std::string& name);
// rms_norm, apply_rope and silu_and_mul for bf16 activations, rounding to bf16 where torch's bf16 ops do
// (fused_ops_bf16.cpp).
std::tuple<torch::Tensor, torch::Tensor> rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps,
                                                       std::optional<torch::Tensor> residual);
std::tuple<torch::Tensor, torch::Tensor> apply_rope_bf16(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                                                         torch::Tensor sin);
torch::Tensor silu_and_mul_bf16(torch::Tensor gate_up);
