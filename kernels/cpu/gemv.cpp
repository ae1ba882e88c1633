// `y = x W^T + b` for a few rows of x (a decode step's tokens): a GEMV that streams W at memory speed.
//
// At one to a few rows a linear layer is bound by reading W once, not by arithmetic; a general GEMM
// library spends its time packing and blocking for reuse that a skinny x cannot give. W stays in its
// plain row-major [N, K] layout, which is already one sequential stream: each thread takes a
// contiguous range of output rows, so it reads one contiguous slice of W front to back, and asks for
// each group of W rows one group ahead. A register tile of 4 W rows x up to 4 x rows keeps 16
// independent accumulators, so a W cache line, once loaded, feeds every x row; rows of x beyond 4
// re-read the 4 W rows from L1. The inner loop is AVX-512 or AVX2+FMA, chosen at run time from the
// CPU's features, with a plain C++ loop where neither is present.
#include <immintrin.h>
#include <torch/types.h>

#include <atomic>
#include <optional>
#include <string>

#include "gemv_common.h"
#include "kernels.h"

namespace {

using gemv_common::prefetch_next_group;
using gemv_common::reduce_avx2;

struct Problem {
  const float* x;  // [M, K], row stride ldx
  const float* w;  // [N, K], contiguous
  const float* bias;  // [N] or null
  float* y;  // [M, N], contiguous
  int64_t m, n, k, ldx;
};

// NR rows of W against MR rows of x over the whole K, 16 floats at a time; a masked load does the tail.
template <int NR, int MR>
TANDEM_AVX512 void tile_avx512(const Problem& p, int64_t n0, int64_t m0) {
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* w[NR];
  const float* x[MR];
  for (int i = 0; i < NR; ++i) w[i] = p.w + (n0 + i) * p.k;
  for (int j = 0; j < MR; ++j) x[j] = p.x + (m0 + j) * p.ldx;
  int64_t c = 0;
  // The first x tile streams these W rows from memory; it asks for the next group's lines one group
  // ahead (9-24 KiB at SmolLM2's widths), which keeps 4 x rows as fast as 1 where the hardware
  // prefetchers alone fell behind.
  const bool prefetch = m0 == 0;
  for (; c + 16 <= p.k; c += 16) {
    if (prefetch) prefetch_next_group<NR>(p, n0, c);
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm512_loadu_ps(w[i] + c);
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_loadu_ps(x[j] + c);
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  if (c < p.k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (p.k - c)) - 1u);
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm512_maskz_loadu_ps(mask, w[i] + c);
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x[j] + c);
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    const float b = p.bias ? p.bias[n0 + i] : 0.f;
    for (int j = 0; j < MR; ++j) p.y[(m0 + j) * p.n + n0 + i] = _mm512_reduce_add_ps(acc[i][j]) + b;
  }
}

template <int NR, int MR>
TANDEM_AVX2 void tile_avx2(const Problem& p, int64_t n0, int64_t m0) {
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* w[NR];
  const float* x[MR];
  for (int i = 0; i < NR; ++i) w[i] = p.w + (n0 + i) * p.k;
  for (int j = 0; j < MR; ++j) x[j] = p.x + (m0 + j) * p.ldx;
  int64_t c = 0;
  const bool prefetch = m0 == 0;
  for (; c + 8 <= p.k; c += 8) {
    if (prefetch && c % 16 == 0) prefetch_next_group<NR>(p, n0, c);
    __m256 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm256_loadu_ps(w[i] + c);
    for (int j = 0; j < MR; ++j) {
      const __m256 xv = _mm256_loadu_ps(x[j] + c);
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    const float b = p.bias ? p.bias[n0 + i] : 0.f;
    for (int j = 0; j < MR; ++j) {
      float sum = reduce_avx2(acc[i][j]);
      for (int64_t t = c; t < p.k; ++t) sum += w[i][t] * x[j][t];
      p.y[(m0 + j) * p.n + n0 + i] = sum + b;
    }
  }
}

template <int NR, int MR>
void tile_portable(const Problem& p, int64_t n0, int64_t m0) {
  for (int i = 0; i < NR; ++i) {
    const float* w = p.w + (n0 + i) * p.k;
    for (int j = 0; j < MR; ++j) {
      const float* x = p.x + (m0 + j) * p.ldx;
      float sum = 0.f;
      for (int64_t t = 0; t < p.k; ++t) sum += w[t] * x[t];
      p.y[(m0 + j) * p.n + n0 + i] = sum + (p.bias ? p.bias[n0 + i] : 0.f);
    }
  }
}

using Isa = GemvIsa;

bool supports(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kPortable: return true;
  }
  return false;
}

Isa best_isa() {
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2})
    if (supports(isa)) return isa;
  return Isa::kPortable;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kPortable: return "portable";
  }
  return "portable";
}

// The code path every call takes; only tests change it (set_gemv_isa), to run the narrower ones too.
std::atomic<Isa> g_isa{best_isa()};

template <int NR, int MR>
void tile(const Problem& p, int64_t n0, int64_t m0) {
  switch (g_isa.load(std::memory_order_relaxed)) {
    case Isa::kAvx512: return tile_avx512<NR, MR>(p, n0, m0);
    case Isa::kAvx2: return tile_avx2<NR, MR>(p, n0, m0);
    case Isa::kPortable: return tile_portable<NR, MR>(p, n0, m0);
  }
}

// All x rows against NR rows of W, in x tiles of up to 4 rows.
template <int NR>
void rows_of_w(const Problem& p, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= p.m; m0 += 4) tile<NR, 4>(p, n0, m0);
  switch (p.m - m0) {
    case 3: return tile<NR, 3>(p, n0, m0);
    case 2: return tile<NR, 2>(p, n0, m0);
    case 1: return tile<NR, 1>(p, n0, m0);
    default: return;
  }
}

}  // namespace

GemvIsa current_gemv_isa() { return g_isa.load(std::memory_order_relaxed); }

std::string gemv_isa() { return isa_name(g_isa.load()); }

void set_gemv_isa(const std::string& name) {
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kPortable}) {
    if (name != isa_name(isa)) continue;
    TORCH_CHECK(supports(isa), "this CPU cannot run the ", name, " GEMV");
    g_isa.store(isa);
    return;
  }
  TORCH_CHECK(false, "unknown GEMV instruction set ", name, "; expected avx512, avx2 or portable");
}

void gemv_into(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t m, int64_t n,
               int64_t k) {
  if (m == 0 || n == 0) return;
  const Problem p{x, w, bias, y, m, n, k, ldx};
  gemv_common::for_each_row_group<float>(
      n, k, [&](int64_t n0) { rows_of_w<4>(p, n0); }, [&](int64_t r) { rows_of_w<1>(p, r); });
}

torch::Tensor linear_gemv(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "linear_gemv is fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(x.size(1) == weight.size(1), "x has ", x.size(1), " features, weight expects ", weight.size(1));
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == weight.size(0),
                "bias must be a contiguous fp32 vector of ", weight.size(0));
    bias_ptr = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  auto y = torch::empty({m, n}, x.options());
  gemv_into(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), bias_ptr, y.data_ptr<float>(), m, n, k);
  return y;
}

void gemv_row_range(const float* x, int64_t ldx, int64_t m, const float* w, const float* bias, float* y, int64_t n,
                    int64_t k, int64_t row_begin, int64_t row_end) {
  const Problem p{x, w, bias, y, m, n, k, ldx};
  int64_t r = row_begin;
  for (; r + 4 <= row_end; r += 4) rows_of_w<4>(p, r);
  for (; r < row_end; ++r) rows_of_w<1>(p, r);
}
