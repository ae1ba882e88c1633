// Python bindings of the CPU kernels. The GIL is released inside each call, so the server's event
// loop thread can run while the engine thread computes.
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  using pybind11::call_guard;
  using pybind11::gil_scoped_release;
  m.def("paged_attention", &paged_attention,
        "paged attention over a mixed batch (fp32 query; fp32 cache, or int8/fp8 e4m3 with scales), with a "
        "sliding window of `window` tokens (0: full attention)",
        arg("query"),
        arg("k_cache"), arg("v_cache"), arg("block_tables"), arg("seq_lens"), arg("query_start_loc"), arg("scale"),
        arg("k_scales") = pybind11::none(), arg("v_scales") = pybind11::none(), arg("window") = 0,
        call_guard<gil_scoped_release>());
  m.def("write_kv_cache", &write_kv_cache,
        "store new K/V rows at their cache slots, quantizing for an int8/fp8 cache; slot -1 skips (fp32 rows)",
        arg("key"), arg("value"), arg("k_cache"), arg("v_cache"), arg("slot_mapping"),
        arg("k_scales") = pybind11::none(), arg("v_scales") = pybind11::none(), call_guard<gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "optional residual add, then RMSNorm (fp32)", call_guard<gil_scoped_release>());
  m.def("apply_rope", &apply_rope, "rotate-half RoPE on q and k (fp32)", call_guard<gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (fp32)", call_guard<gil_scoped_release>());
  m.def("linear_gemv", &linear_gemv, "x W^T + b for a few rows of x, streaming W (fp32)",
        call_guard<gil_scoped_release>());
  m.def("linear_int8_gemv", &linear_int8_gemv,
        "(x Wq^T) * scale + b for a few rows of fp32 x over int8 Wq with a scale per row, streaming Wq",
        call_guard<gil_scoped_release>());
  m.def("linear_int8_gemm", &linear_int8_gemm,
        "(x Wq^T) * scale + b for many rows: panels of Wq converted to fp32 for a register-tiled GEMM",
        call_guard<gil_scoped_release>());
  m.def("linear_q8_0_gemv", &linear_q8_0_gemv,
        "x W^T + b for a few rows of fp32 x over GGUF Q8_0 blocks read in place (each weight d * q exact in fp32)",
        arg("x"), arg("blocks"), arg("bias") = pybind11::none(), call_guard<gil_scoped_release>());
  m.def("linear_gguf_gemv", &linear_gguf_gemv,
        "x W^T + b for a few rows of fp32 x over GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K blocks read in place "
        "(ggml_type: gguf's type number; each weight exactly gguf's dequantized fp32 value)",
        arg("x"), arg("blocks"), arg("ggml_type"), arg("bias") = pybind11::none(), call_guard<gil_scoped_release>());
  m.def("quantize_rows_int8", &quantize_rows_int8,
        "each fp32 row as int8 round(x / s) with s = max|x| / 127: (int8 rows, fp32 scales)",
        call_guard<gil_scoped_release>());
  m.def("linear_w8a8", &linear_w8a8,
        "x quantized to int8 per row, times int8 Wq in int32, scaled back (+ b); the GEMV up to gemv_max_rows rows, "
        "then (given Wq's int32 row sums) the VNNI GEMM up to vnni_max_rows, then oneDNN",
        arg("x"), arg("qweight"), arg("scale"), arg("bias"), arg("gemv_max_rows"),
        arg("weight_sums") = pybind11::none(), arg("vnni_max_rows") = 0, call_guard<gil_scoped_release>());
  m.def("gemv_isa", &gemv_isa,
        "the instruction set linear_gemv and the int8 linears run on: avx512, avx2 or portable");
  m.def("greedy_lm_head", &greedy_lm_head,
        "each row's argmax of hidden W^T, a vocabulary slice at a time (fp32; the GEMV up to gemv_max_rows rows)",
        call_guard<gil_scoped_release>());
  m.def("set_gemv_isa", &set_gemv_isa,
        "for tests: run linear_gemv and the int8 linears on a narrower instruction set this CPU has");
  m.def("linear_q8_0_w8a8", &linear_q8_0_w8a8,
        "x quantized to int8 per 32-block, times GGUF Q8_0 blocks read in place in exact int32 block sums, scaled "
        "and summed in fp32 (+ b), any rows",
        arg("x"), arg("blocks"), arg("bias") = pybind11::none(), call_guard<gil_scoped_release>());
  pybind11::class_<Q8_0Weights>(m, "Q8_0Weights", pybind11::module_local())
      .def(pybind11::init([](std::vector<torch::Tensor> segments, torch::Tensor out_rows, bool w8a8) {
             int64_t rows = 0;
             for (const auto& s : segments) {
               TORCH_CHECK(s.scalar_type() == torch::kUInt8 && s.dim() == 2 && s.is_contiguous() &&
                               s.size(1) == segments[0].size(1) && s.size(1) % 34 == 0,
                           "Q8_0 segments must be contiguous uint8 [rows, K / 32 * 34] of one K");
               rows += s.size(0);
             }
             TORCH_CHECK(out_rows.scalar_type() == torch::kInt64 && out_rows.is_contiguous() &&
                             out_rows.numel() == rows,
                         "out_rows must be a contiguous int64 vector of the segments' ", rows, " rows");
             return Q8_0Weights{std::move(segments), std::move(out_rows), w8a8};
           }),
           arg("segments"), arg("out_rows"), arg("w8a8") = false);
  // Module-local: a process that loads the extension a second time (tests reset its cache) registers it again.
  pybind11::class_<DecoderLayerWeights>(m, "DecoderLayerWeights", pybind11::module_local())
      .def(pybind11::init([](torch::Tensor input_norm, torch::Tensor qkv, std::optional<torch::Tensor> qkv_bias,
                             torch::Tensor o, std::optional<torch::Tensor> o_bias, torch::Tensor mlp_norm,
                             torch::Tensor gate_up, std::optional<torch::Tensor> gate_up_bias, torch::Tensor down,
                             std::optional<torch::Tensor> down_bias, const std::string& activation, double scale,
                             int64_t rotary_dim, std::optional<torch::Tensor> qkv_scale,
                             std::optional<torch::Tensor> o_scale, std::optional<torch::Tensor> gate_up_scale,
                             std::optional<torch::Tensor> down_scale, std::optional<torch::Tensor> qkv_blocked,
                             std::optional<torch::Tensor> o_blocked, std::optional<torch::Tensor> gate_up_blocked,
                             std::optional<torch::Tensor> down_blocked, std::optional<torch::Tensor> q_norm,
                             std::optional<torch::Tensor> k_norm, std::optional<torch::Tensor> attn_out_norm,
                             std::optional<torch::Tensor> mlp_out_norm, std::optional<Q8_0Weights> qkv_q8_0,
                             std::optional<Q8_0Weights> o_q8_0, std::optional<Q8_0Weights> gate_up_q8_0,
                             std::optional<Q8_0Weights> down_q8_0, int64_t window, int64_t kv_group,
                             int64_t rope) {
             TORCH_CHECK(window >= 0, "window must be a positive number of tokens, or 0 for full attention");
             TORCH_CHECK(activation == "silu" || activation == "gelu_tanh",
                         "activation must be silu or gelu_tanh, not ", activation);
             TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rotary_dim must be a positive even feature count");
             TORCH_CHECK(kv_group >= 0 && rope >= 0, "kv_group and rope are indices into decode_layers' lists");
             DecoderLayerWeights w{input_norm, qkv, o, mlp_norm, gate_up, down,
                                   qkv_bias, o_bias, gate_up_bias, down_bias,
                                   qkv_scale, o_scale, gate_up_scale, down_scale,
                                   qkv_blocked, o_blocked, gate_up_blocked, down_blocked,
                                   q_norm, k_norm, attn_out_norm, mlp_out_norm};
             w.activation = activation == "silu" ? Activation::kSilu : Activation::kGeluTanh;
             w.scale = scale, w.rotary_dim = rotary_dim, w.window = window, w.kv_group = kv_group, w.rope = rope;
             w.qkv_q8_0 = qkv_q8_0, w.o_q8_0 = o_q8_0, w.gate_up_q8_0 = gate_up_q8_0, w.down_q8_0 = down_q8_0;
             return w;
           }),
           arg("input_norm"), arg("qkv"), arg("qkv_bias"), arg("o"), arg("o_bias"), arg("mlp_norm"),
           arg("gate_up"), arg("gate_up_bias"), arg("down"), arg("down_bias"),
           // The MLP's activation (silu or gelu_tanh), the attention's score scale, the features RoPE rotates.
           arg("activation"), arg("scale"), arg("rotary_dim"),
           // int8 linears: a scale per output row (fp32 linears have none).
           arg("qkv_scale") = pybind11::none(), arg("o_scale") = pybind11::none(),
           arg("gate_up_scale") = pybind11::none(), arg("down_scale") = pybind11::none(),
           // fp32 linears: the oneDNN blocked weight, for steps past the GEMV's rows.
           arg("qkv_blocked") = pybind11::none(), arg("o_blocked") = pybind11::none(),
           arg("gate_up_blocked") = pybind11::none(), arg("down_blocked") = pybind11::none(),
           // Per-head norms of queries and keys before RoPE; norms of the attention's and the MLP's outputs.
           arg("q_norm") = pybind11::none(), arg("k_norm") = pybind11::none(),
           arg("attn_out_norm") = pybind11::none(), arg("mlp_out_norm") = pybind11::none(),
           // GGUF Q8_0 linears: their segments (the weight is then a meta tensor of the linear's shape).
           arg("qkv_q8_0") = pybind11::none(), arg("o_q8_0") = pybind11::none(),
           arg("gate_up_q8_0") = pybind11::none(), arg("down_q8_0") = pybind11::none(),
           // The sliding window in tokens (0: full attention), the KV group's and the RoPE table's index in
           // decode_layers' lists.
           arg("window") = 0, arg("kv_group") = 0, arg("rope") = 0)
      .def_readonly("window", &DecoderLayerWeights::window)
      .def_readonly("kv_group", &DecoderLayerWeights::kv_group)
      .def_readonly("rope", &DecoderLayerWeights::rope)
      .def_readonly("rotary_dim", &DecoderLayerWeights::rotary_dim)
      .def_readonly("scale", &DecoderLayerWeights::scale);
  m.def("decode_region_applies", &decode_region_applies,
        "whether decode_layers runs this step's layers in one parallel region (every row on the GEMVs)", arg("hidden"),
        arg("layers"), arg("k_caches"), arg("v_caches"), arg("k_scales"), arg("v_scales"), arg("gemv_max_rows"),
        arg("int8_gemv_max_rows"));
  m.def("decode_layers", &decode_layers,
        "every decoder layer of a decode-only step; returns (hidden, residual) before the final norm (fp32)",
        call_guard<gil_scoped_release>());
  m.def("linear_bf16_gemv", &linear_bf16_gemv,
        "x W^T + b for a few rows of bf16 x over bf16 W, fp32 sums; bf16 y, or fp32 with fp32_out (logits)",
        arg("x"), arg("weight"), arg("bias") = pybind11::none(), arg("fp32_out") = false,
        call_guard<gil_scoped_release>());
  m.def("bf16_gemv_isa", &bf16_gemv_isa,
        "the instruction set linear_bf16_gemv runs on: avx512_bf16, avx512, avx2 or portable");
  m.def("bf16_gemv_isas", &bf16_gemv_isas, "the instruction sets linear_bf16_gemv can run on this CPU");
  m.def("set_bf16_gemv_isa", &set_bf16_gemv_isa, "for tests: run linear_bf16_gemv on another of bf16_gemv_isas()");
  m.def("rms_norm_bf16", &rms_norm_bf16, "optional residual add, then RMSNorm (bf16, fp32 statistics)",
        call_guard<gil_scoped_release>());
  m.def("apply_rope_bf16", &apply_rope_bf16, "rotate-half RoPE on q and k (bf16)", call_guard<gil_scoped_release>());
  m.def("silu_and_mul_bf16", &silu_and_mul_bf16, "silu(gate) * up (bf16)", call_guard<gil_scoped_release>());
}
