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
// Integer dot products: AVX-512 VNNI's `vpdpbusd` (u8 x s8) on W's bytes offset by 128 (an xor), less 128 * sum(xq) of
// the block, precomputed per row of x; AVX2's `maddubs` on |q| against xq carrying q's sign (|q| <= 128 and |xq| <= 127
// keep each int16 pair sum below saturation, q = -128 included); or plain loops. On VNNI each lane of a vector is one
// of 16 W rows: a block of those rows is turned (4-byte groups transposed, as it is read: the file's bytes stay as
// stored) so that 8 `vpdpbusd`s against x's groups, broadcast, leave every row's block sum whole in its lane, and the
// turn serves every x row of the step, where a row-at-a-time dot product needs a horizontal fold per block and per x
// row. On AVX2 eight blocks' sums of one row are folded into one vector of eight (one per block) by `hadd`.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "half_float.h"
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
// W rows of one VNNI tile: one per int32 lane of an AVX-512 vector.
constexpr int64_t kTileRows = 16;

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

// Block b of 16 W rows, turned so that lane l of v[g] holds bytes 4g..4g+3 of row l's block (W + 128,
// unsigned): an 8 x 8 transpose of 4-byte groups in each 256-bit half (rows 0-7, rows 8-15).
TANDEM_VNNI inline void turn_block(const uint8_t* const* rows, int64_t offset, __m512i* v) {
  __m512i z[kLanes], t[kLanes], u[kLanes];
  for (int q = 0; q < kLanes; ++q) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[q] + offset));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[q + kLanes] + offset));
    z[q] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  // t[2q], t[2q + 1]: rows 2q and 2q + 1 interleaved, groups (0, 1 | 4, 5) and (2, 3 | 6, 7).
  for (int q = 0; q < kLanes / 2; ++q) {
    t[2 * q] = _mm512_unpacklo_epi32(z[2 * q], z[2 * q + 1]);
    t[2 * q + 1] = _mm512_unpackhi_epi32(z[2 * q], z[2 * q + 1]);
  }
  // u[4h + c]: group c of rows 4h..4h + 3 in 128-bit lane 0, group c + 4 in lane 1 (lanes 2, 3: rows + 8).
  for (int h = 0; h < 2; ++h) {
    u[4 * h] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  const __m512i offset_bytes = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm512_xor_si512(_mm512_mask_shuffle_i32x4(u[c], 0xF0F0, u[c + 4], u[c + 4], 0x80), offset_bytes);
    v[c + 4] = _mm512_xor_si512(_mm512_mask_shuffle_i32x4(u[c + 4], 0x0F0F, u[c], u[c], 0x31), offset_bytes);
  }
}

// W rows [r0, r0 + rows) (rows <= kTileRows; missing lanes repeat the last row and are not stored) against x
// rows [m0, m0 + MR): each lane of a vector is one W row, so every block sum comes out of `vpdpbusd` whole,
// each x row's 4-byte group broadcast to all lanes, and the block's turned W serves every x row of the step.
template <int MR>
TANDEM_VNNI void tile_vnni(const Problem& p, int64_t r0, int64_t rows, int64_t m0) {
  const Q8_0Activations& x = *p.x;
  const int64_t blocks = x.k / kBlockWeights, row_bytes = blocks * kBlockBytes;
  const uint8_t* row[kTileRows];
  alignas(64) int32_t offsets[kTileRows];
  for (int l = 0; l < kTileRows; ++l) {
    const int64_t r = std::min<int64_t>(l, rows - 1);
    row[l] = p.w + (r0 + r) * row_bytes;
    offsets[l] = static_cast<int32_t>(r * row_bytes);
  }
  const __m512i row_at = _mm512_load_si512(offsets);
  const uint8_t* next = p.w + (r0 + kTileRows) * row_bytes;
  __m512 acc[MR][kLanes];
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < kLanes; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += kLanes) {
    const int64_t count = std::min(kLanes, blocks - b0);
#pragma GCC unroll 8
    for (int i = 0; i < kLanes; ++i) {
      if (i >= count) break;
      const int64_t b = b0 + i;
      // The next tile's rows are the bytes after this tile's: a block's share of them (as many bytes as this
      // block reads), so the next tile is in L2 by the time it starts.
      const uint8_t* ahead = next + b * kTileRows * kBlockBytes;
      for (int64_t o = 0; o < kTileRows * kBlockBytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
      __m512i v[kLanes];
      turn_block(row, b * kBlockBytes + 2, v);
      // Each lane's fp16 scale: the low half of the 4 bytes at the block's start.
      const __m512i head = _mm512_i32gather_epi32(row_at, row[0] + b * kBlockBytes, 1);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
      for (int j = 0; j < MR; ++j) {
        const int8_t* xq = x.q.data() + (m0 + j) * x.k + b * kBlockWeights;
        __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
        for (int g = 0; g < kLanes; g += 2) {
          int32_t four[2];
          std::memcpy(four, xq + 4 * g, sizeof(four));
          even = _mm512_dpbusd_epi32(even, v[g], _mm512_set1_epi32(four[0]));
          odd = _mm512_dpbusd_epi32(odd, v[g + 1], _mm512_set1_epi32(four[1]));
        }
        const int64_t at = (m0 + j) * x.padded_blocks + b;
        const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(even, odd), _mm512_set1_epi32(x.offset_sums[at]));
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(x.scale[at])));
        acc[j][i] = _mm512_add_ps(acc[j][i], t);
      }
    }
  }
  for (int j = 0; j < MR; ++j) {
    const __m512* a = acc[j];
    const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                                   _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
    alignas(64) float totals[kTileRows];
    _mm512_store_ps(totals, y);
    for (int64_t l = 0; l < rows; ++l) store(p, r0 + l, m0 + j, totals[l]);
  }
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
  if (w8a8_q8_0_isa() == GemvIsa::kAvx2) return row_avx2<MR>(p, r, m0);
  row_portable<MR>(p, r, m0);
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
  if (w8a8_q8_0_isa() != GemvIsa::kAvx512) {
    for (int64_t r = row_begin; r < row_end; ++r) row_against_x(p, r);
    return;
  }
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, row_end - r0);
    for (int64_t m0 = 0; m0 < x.m; m0 += kMaxTileRows) {
      switch (std::min<int64_t>(kMaxTileRows, x.m - m0)) {
        case 1: tile_vnni<1>(p, r0, rows, m0); break;
        case 2: tile_vnni<2>(p, r0, rows, m0); break;
        case 3: tile_vnni<3>(p, r0, rows, m0); break;
        default: tile_vnni<4>(p, r0, rows, m0); break;
      }
    }
  }
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
