// Greedy next tokens straight from the final hidden states, without materialising the logits.
//
// A greedy step needs only each row's argmax, but the whole [rows, vocab] logits matrix is 25 MB at
// 128 rows of a 49,152-token vocabulary: written to DRAM by the LM head, read back by the argmax.
// Here the logits are made one vocabulary slice at a time into a buffer that stays in cache, and each
// slice is reduced to every row's (maximum, first index) before the next one is computed; the slices'
// answers are folded in vocabulary order at the end.
// A slice is computed by the kernel the full LM head uses at that row count: the streaming GEMV for a
// few rows, GEMM on the transposed weight for more. As in torch.argmax, NaN counts as the maximum and
// ties go to the lowest index.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

// Vocabulary entries per slice: [128 rows, 2048] is 1 MiB, cache-resident between GEMM and scan. Slices
// of 1024 to 4096 measured alike on SmolLM2's head, all faster than one whole GEMM (bench/README.md).
constexpr int64_t kSlice = 2048;

// The maximum of one row of a slice and the first index holding it; `is_nan` when that is a NaN.
struct RowMax {
  float value;
  int64_t index;
  bool is_nan;
};

// Compiled with -ffast-math, which lets the compiler assume no float is NaN: the portable scan tests
// NaN on the bits, and the AVX-512 one through explicit unordered compares.
bool is_nan_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

RowMax row_max_portable(const float* y, int64_t n) {
  RowMax best{y[0], 0, is_nan_bits(y[0])};
  for (int64_t j = 1; j < n && !best.is_nan; ++j) {
    if (is_nan_bits(y[j])) {
      best = {y[j], j, true};
    } else if (y[j] > best.value) {
      best = {y[j], j, false};
    }
  }
  return best;
}

TANDEM_AVX512 __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << remaining) - 1u);
}

// Two passes over the cache-resident row: the maximum (stopping at the first NaN), then its first index.
TANDEM_AVX512 RowMax row_max_avx512(const float* y, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  __m512 best = lowest;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = tail_mask(n - j);
    const __m512 v = _mm512_mask_loadu_ps(lowest, valid, y + j);
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
    if (nan) {
      const int64_t index = j + __builtin_ctz(nan);
      return {y[index], index, true};
    }
    best = _mm512_max_ps(best, v);
  }
  const float value = _mm512_reduce_max_ps(best);
  const __m512 target = _mm512_set1_ps(value);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = tail_mask(n - j);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(valid, _mm512_maskz_loadu_ps(valid, y + j), target, _CMP_EQ_OQ);
    if (hit) return {value, j + __builtin_ctz(hit), false};
  }
  return {value, 0, false};  // unreachable: the maximum is one of the row's values
}

}  // namespace

torch::Tensor greedy_lm_head(torch::Tensor hidden, torch::Tensor weight, torch::Tensor weight_t,
                             int64_t gemv_max_rows) {
  TORCH_CHECK(hidden.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32 &&
                  weight_t.scalar_type() == torch::kFloat32,
              "greedy_lm_head is fp32 only");
  TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1, "hidden must be 2-D with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [vocab, hidden] matrix");
  TORCH_CHECK(weight_t.dim() == 2 && weight_t.is_contiguous() && weight_t.size(0) == weight.size(1) &&
                  weight_t.size(1) == weight.size(0),
              "weight_t must be weight transposed and contiguous, [hidden, vocab]");
  TORCH_CHECK(hidden.size(1) == weight.size(1), "hidden has ", hidden.size(1), " features, weight expects ",
              weight.size(1));
  const int64_t m = hidden.size(0), n = weight.size(0), k = weight.size(1);
  auto token_ids = torch::zeros({m}, hidden.options().dtype(torch::kInt64));
  if (m == 0 || n == 0) return token_ids;
  const bool avx512 = gemv_isa() == "avx512";
  const bool use_gemv = m <= gemv_max_rows;
  const int64_t width_max = std::min(kSlice, n), num_slices = (n + kSlice - 1) / kSlice;
  // Each slice's row maxima, folded in slice order afterwards so ties still go to the lowest index.
  std::vector<RowMax> slice_best(num_slices * m);
  // Threads take whole slices (a GEMM or GEMV inside runs on its caller's thread): splitting every
  // slice's small GEMM between threads cost more in fork/join than it saved.
  at::parallel_for(0, num_slices, 1, [&](int64_t begin, int64_t end) {
    auto buffer = torch::empty({m * width_max}, hidden.options());
    for (int64_t s = begin; s < end; ++s) {
      const int64_t v0 = s * kSlice, width = std::min(kSlice, n - v0);
      auto logits = buffer.narrow(0, 0, m * width).view({m, width});
      if (use_gemv) {
        gemv_into(hidden.data_ptr<float>(), hidden.stride(0), weight.data_ptr<float>() + v0 * k, nullptr,
                  logits.data_ptr<float>(), m, width, k);
      } else {
        at::mm_out(logits, hidden, weight_t.narrow(1, v0, width));
      }
      const float* rows = logits.data_ptr<float>();
      for (int64_t r = 0; r < m; ++r) {
        const float* row = rows + r * width;
        RowMax found = avx512 ? row_max_avx512(row, width) : row_max_portable(row, width);
        found.index += v0;
        slice_best[s * m + r] = found;
      }
    }
  });
  auto* ids = token_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    RowMax best = slice_best[r];
    for (int64_t s = 1; s < num_slices && !best.is_nan; ++s) {
      const RowMax& found = slice_best[s * m + r];
      if (found.is_nan || found.value > best.value) best = found;
    }
    ids[r] = best.index;
  }
  return token_ids;
}
