// A GGUF Q8_0 linear of several checkpoint tensors (a fused qkv or gate_up) in the decode stack, computed
// where its blocks lie.
//
// Each segment stays the view of the memory-mapped file the model holds (processes that map one file share
// its pages), so nothing is concatenated: a share of the linear's rows walks the segments it crosses.
// llama.cpp's converter stores q/k rows in its own RoPE order; rather than permute the rows (a copy) or read
// them out of order (breaking the sequential stream the GEMV is fast on), each stored row is computed in
// place and its output written to its Hugging Face column (`Q8_0Weights::out_rows`), as
// `kernels.block_linear.BlockLinear` gathers its output columns: the same value lands in the same place.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>

#include "kernels.h"

void q8_0_linear_rows(const float* x, int64_t ldx, int64_t m, int64_t k, const Q8_0Weights& w, const float* bias,
                      float* y, int64_t row_begin, int64_t row_end) {
  const int64_t ldy = w.out_rows.numel();
  const int64_t* out_rows = w.out_rows.data_ptr<int64_t>();
  // Each thread quantizes the rows it reads itself: a few rows of x cost far less than a barrier.
  thread_local Q8_0Activations activations;
  if (w.w8a8 && row_begin < row_end) quantize_q8_0_activations(x, ldx, m, k, activations);
  int64_t first = 0;
  for (const torch::Tensor& segment : w.segments) {
    const int64_t rows = segment.size(0);
    const int64_t begin = std::max(row_begin, first) - first, end = std::min(row_end, first + rows) - first;
    if (begin < end) {
      const uint8_t* blocks = segment.data_ptr<uint8_t>();
      if (w.w8a8) {
        q8_0_w8a8_row_range(activations, blocks, bias, out_rows + first, y, ldy, begin, end);
      } else {
        q8_0_gemv_row_range(x, ldx, m, blocks, rows, k, bias, out_rows + first, y, ldy, begin, end);
      }
    }
    first += rows;
  }
}

torch::Tensor q8_0_linear(const torch::Tensor& x, const Q8_0Weights& w, const std::optional<torch::Tensor>& bias) {
  const int64_t m = x.size(0), k = x.size(1), n = w.out_rows.numel();
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  // ~64 KiB of blocks per thread at least, as linear_q8_0_gemv.
  const int64_t grain = std::max<int64_t>(1, 65536 / (k / 32 * 34));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    q8_0_linear_rows(x.data_ptr<float>(), x.stride(0), m, k, w, b, y.data_ptr<float>(), begin, end);
  });
  return y;
}
