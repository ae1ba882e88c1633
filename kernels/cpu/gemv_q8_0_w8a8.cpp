// The few-row linear layer over GGUF Q8_0 weights as stored, with int8 activations (the w8a8 mode, as
// llama.cpp computes Q8_0): each block of 32 activations is quantized to int8 with its own fp32 scale,
// each block's dot product is an exact int32 sum, and the sums are scaled and added in fp32.
//
// Numerics, which `kernels.q8_0_w8a8.q8_0_w8a8_reference` spells out in torch, bit for bit:
// - a block of x: `s = max|x| / 127`, `xq = round_half_even(x / s)` clamped to ±127, 0 where s is 0
//   (w8a8.cpp's `quantize_row_int8`, the per-row W8A8's rounding on 32 elements);
// - block b of W row n against it: `isum = xq . q` in int32 (exact), `t_b = float(isum) * (d_b * s_b)`;
// - eight fp32 lanes, lane i adding the t_b of blocks b = 8g + i in order of g, absent blocks adding 0;
// - y = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), then + bias.
// Every step is one IEEE operation, compiled without contraction or reassociation, so
// every instruction set gives the same bits, and so does torch, whatever the row count or thread split.
//
// Integer dot products: AVX-512 VNNI's `vpdpbusd` (u8 x s8) on W's bytes offset by 128 (an xor), less
// 128 * sum(xq) of the block, precomputed per row of x; AVX2's `maddubs` on |q| against xq carrying q's
// sign (|q| <= 128 and |xq| <= 127 keep each int16 pair sum below saturation, q = -128 included); or
// plain loops. Eight blocks' sums are folded into one vector of eight (one per block) by `hadd`.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "kernels.h"

#define TANDEM_VNNI __attribute__((target("avx512f,avx512vl,avx512vnni,avx2,f16c,fma")))
#define TANDEM_AVX2_F16C __attribute__((target("avx2,f16c,fma")))
// Every function below: IEEE operations one at a time, as torch does them (no contraction, reassociation
// or reciprocals), so the reference reproduces them.
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

constexpr int64_t kBlockWeights = 32;
constexpr int64_t kBlockBytes = 34;
constexpr int64_t kLanes = 8;
constexpr int kMaxTileRows = 4;

struct Problem {
  const Q8_0Activations* x;
  const uint8_t* w;  // [N, K / 32 * 34]
  const float* bias;  // indexed by output column, or null
  const int64_t* out_rows;  // W row n's output column, or null: column n
  float* y;  // [M, *], rows ldy apart
  int64_t ldy;
};

bool has_vnni() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return supported;
}

// The GEMVs' instruction set (tests narrow it), where AVX-512 also needs VNNI.
GemvIsa w8a8_q8_0_isa() {
  const GemvIsa isa = current_gemv_isa();
  return isa == GemvIsa::kAvx512 && !has_vnni() ? GemvIsa::kAvx2 : isa;
}

inline uint16_t half_bits(const uint8_t* block) {
  uint16_t h;
  std::memcpy(&h, block, sizeof(h));
  return h;
}

inline void store(const Problem& p, int64_t n, int64_t m, float total) {
  const int64_t column = p.out_rows ? p.out_rows[n] : n;
  p.y[m * p.ldy + column] = p.bias ? total + p.bias[column] : total;
}

inline float lanes_total(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Eight vectors of eight int32 partial sums -> one vector of their eight totals, in order.
TANDEM_AVX2_F16C inline __m256i fold8(const __m256i* v) {
  const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                          _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

// The fp16 scales of blocks b0.. (up to 8; absent ones 0) of a W row, as fp32 (F16C is exact).
TANDEM_AVX2_F16C inline __m256 block_scales(const uint8_t* row, int64_t b0, int64_t count) {
  alignas(16) uint16_t h[kLanes] = {};
  for (int64_t i = 0; i < count; ++i) h[i] = half_bits(row + (b0 + i) * kBlockBytes);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// acc += float(isum) * (d * s), one rounding per operation.
TANDEM_AVX2_F16C inline __m256 accumulate(__m256 acc, __m256i isum, __m256 d, const float* s) {
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_loadu_ps(s))));
}

TANDEM_AVX2_F16C inline float reduce(__m256 acc) {
  alignas(32) float a[kLanes];
  _mm256_store_ps(a, acc);
  return lanes_total(a);
}

template <int MR>
TANDEM_VNNI void row_vnni(const Problem& p, int64_t r, int64_t m0) {
  const Q8_0Activations& x = *p.x;
  const int64_t blocks = x.k / kBlockWeights;
  const uint8_t* row = p.w + r * blocks * kBlockBytes;
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[MR];
  for (int j = 0; j < MR; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += kLanes) {
    const int64_t count = std::min(kLanes, blocks - b0);
    __m256i w[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      w[i] = i < count ? _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                               row + (b0 + i) * kBlockBytes + 2)),
                                           offset)
                       : _mm256_setzero_si256();
    }
    const __m256 d = block_scales(row, b0, count);
    for (int j = 0; j < MR; ++j) {
      const int8_t* xq = x.q.data() + (m0 + j) * x.k + b0 * kBlockWeights;
      __m256i dots[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) {
        dots[i] = i < count ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[i],
                                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * 32)))
                            : _mm256_setzero_si256();
      }
      const int64_t at = (m0 + j) * x.padded_blocks + b0;
      const __m256i isum = _mm256_sub_epi32(
          fold8(dots), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.offset_sums.data() + at)));
      acc[j] = accumulate(acc[j], isum, d, x.scale.data() + at);
    }
  }
  for (int j = 0; j < MR; ++j) store(p, r, m0 + j, reduce(acc[j]));
}

template <int MR>
TANDEM_AVX2_F16C void row_avx2(const Problem& p, int64_t r, int64_t m0) {
  const Q8_0Activations& x = *p.x;
  const int64_t blocks = x.k / kBlockWeights;
  const uint8_t* row = p.w + r * blocks * kBlockBytes;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int j = 0; j < MR; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += kLanes) {
    const int64_t count = std::min(kLanes, blocks - b0);
    __m256i w[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      w[i] = i < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (b0 + i) * kBlockBytes + 2))
                       : _mm256_setzero_si256();
    }
    const __m256 d = block_scales(row, b0, count);
    for (int j = 0; j < MR; ++j) {
      const int8_t* xq = x.q.data() + (m0 + j) * x.k + b0 * kBlockWeights;
      __m256i dots[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) {
        if (i < count) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * 32));
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w[i]), _mm256_sign_epi8(xv, w[i]));
          dots[i] = _mm256_madd_epi16(pairs, ones);
        } else {
          dots[i] = _mm256_setzero_si256();
        }
      }
      const int64_t at = (m0 + j) * x.padded_blocks + b0;
      acc[j] = accumulate(acc[j], fold8(dots), d, x.scale.data() + at);
    }
  }
  for (int j = 0; j < MR; ++j) store(p, r, m0 + j, reduce(acc[j]));
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while ((mantissa & 0x400u) == 0) mantissa <<= 1, --exponent;
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

template <int MR>
void row_portable(const Problem& p, int64_t r, int64_t m0) {
  const Q8_0Activations& x = *p.x;
  const int64_t blocks = x.k / kBlockWeights;
  const uint8_t* row = p.w + r * blocks * kBlockBytes;
  for (int j = 0; j < MR; ++j) {
    const int8_t* xq = x.q.data() + (m0 + j) * x.k;
    const float* s = x.scale.data() + (m0 + j) * x.padded_blocks;
    float acc[kLanes] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * kBlockBytes;
      const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
      int32_t isum = 0;
      for (int64_t t = 0; t < kBlockWeights; ++t) isum += int32_t{q[t]} * int32_t{xq[b * kBlockWeights + t]};
      acc[b % kLanes] = acc[b % kLanes] + static_cast<float>(isum) * (half_to_float(half_bits(block)) * s[b]);
    }
    store(p, r, m0 + j, lanes_total(acc));
  }
}

template <int MR>
void row(const Problem& p, int64_t r, int64_t m0) {
  switch (w8a8_q8_0_isa()) {
    case GemvIsa::kAvx512: return row_vnni<MR>(p, r, m0);
    case GemvIsa::kAvx2: return row_avx2<MR>(p, r, m0);
    case GemvIsa::kPortable: return row_portable<MR>(p, r, m0);
  }
}

void row_against_x(const Problem& p, int64_t r) {
  for (int64_t m0 = 0; m0 < p.x->m; m0 += kMaxTileRows) {
    switch (std::min<int64_t>(kMaxTileRows, p.x->m - m0)) {
      case 1: row<1>(p, r, m0); break;
      case 2: row<2>(p, r, m0); break;
      case 3: row<3>(p, r, m0); break;
      default: row<4>(p, r, m0); break;
    }
  }
}

}  // namespace

void quantize_q8_0_activations(const float* x, int64_t ldx, int64_t m, int64_t k, Q8_0Activations& out) {
  const int64_t blocks = k / kBlockWeights;
  out.m = m, out.k = k, out.padded_blocks = (blocks + kLanes - 1) / kLanes * kLanes;
  out.q.resize(static_cast<size_t>(m * k));
  out.scale.assign(static_cast<size_t>(m * out.padded_blocks), 0.f);
  out.offset_sums.assign(static_cast<size_t>(m * out.padded_blocks), 0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      int8_t* q = out.q.data() + r * k + b * kBlockWeights;
      out.scale[r * out.padded_blocks + b] = quantize_row_int8(x + r * ldx + b * kBlockWeights, kBlockWeights, q);
      int32_t sum = 0;
      for (int64_t t = 0; t < kBlockWeights; ++t) sum += q[t];
      out.offset_sums[r * out.padded_blocks + b] = 128 * sum;
    }
  }
}

void q8_0_w8a8_row_range(const Q8_0Activations& x, const uint8_t* blocks, const float* bias, const int64_t* out_rows,
                         float* y, int64_t ldy, int64_t row_begin, int64_t row_end) {
  const Problem p{&x, blocks, bias, out_rows, y, ldy};
  for (int64_t r = row_begin; r < row_end; ++r) row_against_x(p, r);
}

torch::Tensor linear_q8_0_w8a8(torch::Tensor x, torch::Tensor blocks, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "Q8_0 w8a8 linear takes fp32 activations");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous(),
              "Q8_0 weights must be a contiguous [N, K / 32 * 34] uint8 matrix");
  const int64_t m = x.size(0), n = blocks.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlockWeights == 0, "Q8_0 w8a8 quantizes x in blocks of 32; x has ", k, " features");
  TORCH_CHECK(blocks.size(1) == k / kBlockWeights * kBlockBytes, "x has ", k, " features; Q8_0 rows of ",
              blocks.size(1), " bytes hold ", blocks.size(1) / kBlockBytes * kBlockWeights);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous fp32 vector of ", n);
    bias_ptr = bias->data_ptr<float>();
  }
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  Q8_0Activations activations;
  quantize_q8_0_activations(x.data_ptr<float>(), x.stride(0), m, k, activations);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, blocks.size(1)));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    q8_0_w8a8_row_range(activations, w, bias_ptr, nullptr, out, n, begin, end);
  });
  return y;
}
