// `y = x W^T + b` for a few rows of bf16 x over bf16 W, accumulated in fp32: the decode GEMV of a bf16 model.
//
// Like the fp32 GEMV (gemv.cpp) it streams the plain row-major W [N, K] once, threads taking contiguous
// runs of 4-row groups, with a register tile of 4 W rows x up to 4 x rows; bf16 halves the bytes read per
// token, which at decode is the cost. Every product of two bf16 values is exact in fp32 and every sum is
// an fp32 one, so the result differs from the fp64 dot product of the same bf16 values only by fp32
// rounding; y is then rounded once to bf16 (or kept fp32: the LM head's logits).
//
// Four code paths, chosen at run time from the CPU's features: AVX512-BF16's `vdpbf16ps` (two bf16
// products per fp32 lane per instruction), AVX-512 and AVX2 widening bf16 to fp32 by a 16-bit shift
// before an FMA, and a plain C++ loop.
#include <immintrin.h>
#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "gemv_common.h"
#include "kernels.h"

namespace {

#define TANDEM_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define TANDEM_AVX512_BW __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

struct Problem {
  const uint16_t* x;  // [M, K] bf16, row stride ldx
  const uint16_t* w;  // [N, K] bf16, contiguous
  const float* bias;  // [N] (fp32, converted once) or null
  void* y;            // [M, N] contiguous, bf16 or fp32
  bool fp32_out;
  int64_t m, n, k, ldx;
};

inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline void store(const Problem& p, int64_t row, int64_t col, float value) {
  const int64_t at = row * p.n + col;
  if (p.fp32_out) {
    static_cast<float*>(p.y)[at] = value;
  } else {
    static_cast<c10::BFloat16*>(p.y)[at] = c10::BFloat16(value);  // round to nearest even
  }
}

inline void store_tile(const Problem& p, int64_t n0, int64_t m0, int i, int j, float sum) {
  store(p, m0 + j, n0 + i, sum + (p.bias ? p.bias[n0 + i] : 0.f));
}

// 32 bf16 per step: vdpbf16ps multiplies the pairs exactly and adds both products into each fp32 lane.
template <int NR, int MR>
TANDEM_AVX512_BF16 void tile_avx512_bf16(const Problem& p, int64_t n0, int64_t m0) {
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* w[NR];
  const uint16_t* x[MR];
  for (int i = 0; i < NR; ++i) w[i] = p.w + (n0 + i) * p.k;
  for (int j = 0; j < MR; ++j) x[j] = p.x + (m0 + j) * p.ldx;
  const bool prefetch = m0 == 0;
  int64_t c = 0;
  for (; c + 32 <= p.k; c += 32) {
    if (prefetch) gemv_common::prefetch_next_group<NR>(p, n0, c);
    __m512bh wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = (__m512bh)_mm512_loadu_si512(w[i] + c);
    for (int j = 0; j < MR; ++j) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[j] + c);
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
    }
  }
  if (c < p.k) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (p.k - c)) - 1ull);
    __m512bh wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[i] + c);
    for (int j = 0; j < MR; ++j) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[j] + c);
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) store_tile(p, n0, m0, i, j, _mm512_reduce_add_ps(acc[i][j]));
}

// 16 bf16 widened to fp32 by shifting each into the upper half of its 32-bit lane.
TANDEM_AVX512_BW inline __m512 widen_avx512(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <int NR, int MR>
TANDEM_AVX512_BW void tile_avx512(const Problem& p, int64_t n0, int64_t m0) {
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* w[NR];
  const uint16_t* x[MR];
  for (int i = 0; i < NR; ++i) w[i] = p.w + (n0 + i) * p.k;
  for (int j = 0; j < MR; ++j) x[j] = p.x + (m0 + j) * p.ldx;
  const bool prefetch = m0 == 0;
  int64_t c = 0;
  for (; c + 16 <= p.k; c += 16) {
    if (prefetch && c % 32 == 0) gemv_common::prefetch_next_group<NR>(p, n0, c);
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = widen_avx512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + c)));
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = widen_avx512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[j] + c)));
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  if (c < p.k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (p.k - c)) - 1u);
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = widen_avx512(_mm256_maskz_loadu_epi16(mask, w[i] + c));
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = widen_avx512(_mm256_maskz_loadu_epi16(mask, x[j] + c));
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) store_tile(p, n0, m0, i, j, _mm512_reduce_add_ps(acc[i][j]));
}

TANDEM_AVX2 inline __m256 widen_avx2(const uint16_t* bits) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

template <int NR, int MR>
TANDEM_AVX2 void tile_avx2(const Problem& p, int64_t n0, int64_t m0) {
  __m256 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  const uint16_t* w[NR];
  const uint16_t* x[MR];
  for (int i = 0; i < NR; ++i) w[i] = p.w + (n0 + i) * p.k;
  for (int j = 0; j < MR; ++j) x[j] = p.x + (m0 + j) * p.ldx;
  const bool prefetch = m0 == 0;
  int64_t c = 0;
  for (; c + 8 <= p.k; c += 8) {
    if (prefetch && c % 32 == 0) gemv_common::prefetch_next_group<NR>(p, n0, c);
    __m256 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = widen_avx2(w[i] + c);
    for (int j = 0; j < MR; ++j) {
      const __m256 xv = widen_avx2(x[j] + c);
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < MR; ++j) {
      float sum = gemv_common::reduce_avx2(acc[i][j]);
      for (int64_t t = c; t < p.k; ++t) sum += widen(w[i][t]) * widen(x[j][t]);
      store_tile(p, n0, m0, i, j, sum);
    }
  }
}

template <int NR, int MR>
void tile_portable(const Problem& p, int64_t n0, int64_t m0) {
  for (int i = 0; i < NR; ++i) {
    const uint16_t* w = p.w + (n0 + i) * p.k;
    for (int j = 0; j < MR; ++j) {
      const uint16_t* x = p.x + (m0 + j) * p.ldx;
      float sum = 0.f;
      for (int64_t t = 0; t < p.k; ++t) sum += widen(w[t]) * widen(x[t]);
      store_tile(p, n0, m0, i, j, sum);
    }
  }
}

enum class Isa { kAvx512Bf16, kAvx512, kAvx2, kPortable };
constexpr Isa kAllIsas[] = {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kPortable};

bool supports(Isa isa) {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case Isa::kAvx512Bf16: return avx512 && __builtin_cpu_supports("avx512bf16");
    case Isa::kAvx512: return avx512;
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kPortable: return true;
  }
  return false;
}

Isa best_isa() {
  for (Isa isa : kAllIsas)
    if (supports(isa)) return isa;
  return Isa::kPortable;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kPortable: return "portable";
  }
  return "portable";
}

// The code path every call takes; only tests change it (set_bf16_gemv_isa), to run the narrower ones too.
std::atomic<Isa> g_isa{best_isa()};

template <int NR, int MR>
void tile(const Problem& p, int64_t n0, int64_t m0) {
  switch (g_isa.load(std::memory_order_relaxed)) {
    case Isa::kAvx512Bf16: return tile_avx512_bf16<NR, MR>(p, n0, m0);
    case Isa::kAvx512: return tile_avx512<NR, MR>(p, n0, m0);
    case Isa::kAvx2: return tile_avx2<NR, MR>(p, n0, m0);
    case Isa::kPortable: return tile_portable<NR, MR>(p, n0, m0);
  }
}

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

std::string bf16_gemv_isa() { return isa_name(g_isa.load()); }

std::vector<std::string> bf16_gemv_isas() {
  std::vector<std::string> names;
  for (Isa isa : kAllIsas)
    if (supports(isa)) names.emplace_back(isa_name(isa));
  return names;
}

void set_bf16_gemv_isa(const std::string& name) {
  for (Isa isa : kAllIsas) {
    if (name != isa_name(isa)) continue;
    TORCH_CHECK(supports(isa), "this CPU cannot run the ", name, " bf16 GEMV");
    g_isa.store(isa);
    return;
  }
  TORCH_CHECK(false, "unknown bf16 GEMV instruction set ", name, "; expected avx512_bf16, avx512, avx2 or portable");
}

torch::Tensor linear_bf16_gemv(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias,
                               bool fp32_out) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16,
              "linear_bf16_gemv takes bf16 x and bf16 weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(x.size(1) == weight.size(1), "x has ", x.size(1), " features, weight expects ", weight.size(1));
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  torch::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n, "bias must be a vector of ", n);
    bias32 = bias->to(torch::kFloat32).contiguous();
  }
  auto y = torch::empty({m, n}, x.options().dtype(fp32_out ? torch::kFloat32 : torch::kBFloat16));
  if (m == 0 || n == 0) return y;
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                  bias32.defined() ? bias32.data_ptr<float>() : nullptr, y.data_ptr(), fp32_out, m, n, k, x.stride(0)};
  gemv_common::for_each_row_group<uint16_t>(
      n, k, [&](int64_t n0) { rows_of_w<4>(p, n0); }, [&](int64_t r) { rows_of_w<1>(p, r); });
  return y;
}
