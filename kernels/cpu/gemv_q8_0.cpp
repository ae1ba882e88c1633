// The few-row linear layer over GGUF Q8_0 weights as stored, with fp32 activations (the exact mode).
//
// A Q8_0 row is K / 32 blocks of 34 bytes: an fp16 scale d, then 32 int8 q; the weight is d * q. Decode
// reads every weight once per step, so reading the 8.5-bit blocks in place (they view the memory-mapped
// GGUF) streams about a quarter of fp32's bytes. Each weight is widened int8 -> fp32 in registers and
// multiplied by its block's scale, which is exact in fp32 (an 11-bit by 8-bit product): the FMAs then
// multiply x by exactly the dequantized weight, so the result is the fp32 product with it up to
// summation order, as gemv_int8.cpp's is (quantizing x as well would change the numbers).
//
// Threads share W's rows in contiguous runs; each reads one W row's blocks front to back (on AVX-512, two at
// a time past two rows of x, and four at a time for one or two rows of x too long to stay in L1) against
// up to 4 rows of x at a time (more rows of x go round again, as a decode step has few), with 2 (AVX-512)
// or 4 (AVX2) FMA chains per x row, asking for the line 4 KiB ahead as it goes (one sequential stream per
// row that the prefetchers follow). A
// block's scale is converted by F16C in one instruction (in software it takes a dozen, with branches).
// Many rows are the torch reference's (dequantize, then one GEMM).
//
// `q8_0_gemv_row_range` is a thread's share of rows inside a parallel region that is already running (the
// decode stack's, decode_region.cpp); it may write each W row's output to another column (`out_rows`), which
// is how a fused layer's segments, and llama.cpp's permuted q/k rows, land in Hugging Face order.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "half_float.h"
#include "kernels.h"

namespace {

constexpr int64_t kBlockWeights = 32;
constexpr int64_t kBlockBytes = 34;
constexpr int kMaxTileRows = 4;

constexpr int64_t kAheadBytes = 4096;

struct Problem {
  const float* x;  // [M, K], row stride ldx
  const uint8_t* w;  // [N, K / 32 * 34]
  const float* bias;  // indexed by output column, or null
  const int64_t* out_rows;  // W row n's output column, or null: column n
  float* y;  // [M, *], rows ldy apart
  int64_t m, n, k, ldx, ldy;
};

inline float block_scale(const uint8_t* block) {
  uint16_t h;
  std::memcpy(&h, block, sizeof(h));
  return half_to_float(h);
}

inline void store(const Problem& p, int64_t n, int64_t m, float dot) {
  const int64_t column = p.out_rows ? p.out_rows[n] : n;
  p.y[m * p.ldy + column] = dot + (p.bias ? p.bias[column] : 0.f);
}

// The same value as block_scale (F16C converts exactly), in one instruction.
__attribute__((target("f16c"))) inline float block_scale_f16c(const uint8_t* block) {
  uint16_t h;
  std::memcpy(&h, block, sizeof(h));
  return _cvtsh_ss(h);
}

inline void prefetch_ahead(const Problem& p, const uint8_t* at) {
  if (at + kAheadBytes < p.w + p.n * (p.k / kBlockWeights) * kBlockBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes), _MM_HINT_T0);
  }
}

TANDEM_AVX512 inline __m512 widen16(const uint8_t* q, __m512 d) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), d);
}

// W rows r0.. (NR of them) against MR rows of x from m0: per block, its two halves of 16 weights on two FMA
// chains per (W row, x row), each x vector loaded once for the NR rows. Each output's arithmetic is the
// same whatever NR (its own two chains, summed at the end), so the value never depends on the grouping.
template <int NR, int MR>
TANDEM_AVX512 void rows_avx512(const Problem& p, int64_t r0, int64_t m0) {
  __m512 acc[NR][2][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][0][j] = acc[i][1][j] = _mm512_setzero_ps();
  const int64_t row_bytes = (p.k / kBlockWeights) * kBlockBytes;
  for (int64_t b = 0, c = 0; c < p.k; ++b, c += kBlockWeights) {
    __m512 w0[NR], w1[NR];
    for (int i = 0; i < NR; ++i) {
      const uint8_t* block = p.w + (r0 + i) * row_bytes + b * kBlockBytes;
      if (b % 2 == 0) prefetch_ahead(p, block);
      const __m512 d = _mm512_set1_ps(block_scale_f16c(block));
      w0[i] = widen16(block + 2, d), w1[i] = widen16(block + 18, d);
    }
    for (int j = 0; j < MR; ++j) {
      const float* x = p.x + (m0 + j) * p.ldx + c;
      const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
      for (int i = 0; i < NR; ++i) {
        acc[i][0][j] = _mm512_fmadd_ps(w0[i], x0, acc[i][0][j]);
        acc[i][1][j] = _mm512_fmadd_ps(w1[i], x1, acc[i][1][j]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j)
      store(p, r0 + i, m0 + j, _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0][j], acc[i][1][j])));
}

TANDEM_AVX2 inline __m256 widen8(const uint8_t* q, __m256 d) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d);
}

TANDEM_AVX2 inline float reduce8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MR>
TANDEM_AVX2 void row_avx2(const Problem& p, int64_t r, int64_t m0) {
  __m256 acc[4][MR];
  for (int u = 0; u < 4; ++u)
    for (int j = 0; j < MR; ++j) acc[u][j] = _mm256_setzero_ps();
  const uint8_t* row = p.w + r * (p.k / kBlockWeights) * kBlockBytes;
  for (int64_t b = 0, c = 0; c < p.k; ++b, c += kBlockWeights) {
    const uint8_t* block = row + b * kBlockBytes;
    if (b % 2 == 0) prefetch_ahead(p, block);
    const __m256 d = _mm256_set1_ps(block_scale_f16c(block));
    __m256 w[4];
    for (int u = 0; u < 4; ++u) w[u] = widen8(block + 2 + 8 * u, d);
    for (int j = 0; j < MR; ++j) {
      const float* x = p.x + (m0 + j) * p.ldx + c;
      for (int u = 0; u < 4; ++u) acc[u][j] = _mm256_fmadd_ps(w[u], _mm256_loadu_ps(x + 8 * u), acc[u][j]);
    }
  }
  for (int j = 0; j < MR; ++j)
    store(p, r, m0 + j, reduce8(_mm256_add_ps(_mm256_add_ps(acc[0][j], acc[1][j]), _mm256_add_ps(acc[2][j], acc[3][j]))));
}

template <int MR>
void row_portable(const Problem& p, int64_t r, int64_t m0) {
  const uint8_t* row = p.w + r * (p.k / kBlockWeights) * kBlockBytes;
  for (int j = 0; j < MR; ++j) {
    const float* x = p.x + (m0 + j) * p.ldx;
    float sum = 0.f;
    for (int64_t b = 0, c = 0; c < p.k; ++b, c += kBlockWeights) {
      const uint8_t* block = row + b * kBlockBytes;
      const float d = block_scale(block);
      for (int64_t t = 0; t < kBlockWeights; ++t)
        sum += (static_cast<float>(static_cast<int8_t>(block[2 + t])) * d) * x[c + t];
    }
    store(p, r, m0 + j, sum);
  }
}

template <int MR>
void row(const Problem& p, int64_t r, int64_t m0) {
  switch (current_gemv_isa()) {
    case GemvIsa::kAvx512: return rows_avx512<1, MR>(p, r, m0);
    case GemvIsa::kAvx2: return row_avx2<MR>(p, r, m0);
    case GemvIsa::kPortable: return row_portable<MR>(p, r, m0);
  }
}

// W rows r, r + 1 against every row of x, up to kMaxTileRows at a time (AVX-512, 3 or more rows of x).
void pair_against_x(const Problem& p, int64_t r) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kMaxTileRows) {
    switch (std::min<int64_t>(kMaxTileRows, p.m - m0)) {
      case 1: rows_avx512<2, 1>(p, r, m0); break;
      case 2: rows_avx512<2, 2>(p, r, m0); break;
      case 3: rows_avx512<2, 3>(p, r, m0); break;
      default: rows_avx512<2, 4>(p, r, m0); break;
    }
  }
}

// W rows r..r + 3 against one or two rows of x (AVX-512, rows of x past half of L1).
void quad_against_x(const Problem& p, int64_t r) {
  if (p.m == 1) return rows_avx512<4, 1>(p, r, 0);
  rows_avx512<4, 2>(p, r, 0);
}

// W row `r` against every row of x, up to kMaxTileRows at a time.
void row_against_x(const Problem& p, int64_t r) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kMaxTileRows) {
    switch (std::min<int64_t>(kMaxTileRows, p.m - m0)) {
      case 1: row<1>(p, r, m0); break;
      case 2: row<2>(p, r, m0); break;
      case 3: row<3>(p, r, m0); break;
      default: row<4>(p, r, m0); break;
    }
  }
}

// Rows of x up to this many bytes stay in L1 beside the stream of W.
constexpr int64_t kRowsOfXInL1Bytes = 16 * 1024;

// Rows [begin, end) of W. Three or more rows of x (AVX-512) take W rows in pairs: each x row is then read
// from L2 once per two W rows (4 rows of 4096 features are 64 KiB, past L1), which bound the GEMV there.
// One or two rows of x stream W one row after another while they fit in half of L1; longer ones (an MLP's
// down projection: 14336 features are 56 KiB) take W rows in fours, for the same reason (AVX-512).
void rows_against_x(const Problem& p, int64_t begin, int64_t end) {
  int64_t r = begin;
  if (current_gemv_isa() == GemvIsa::kAvx512) {
    if (p.m > 2) {
      for (; r + 2 <= end; r += 2) pair_against_x(p, r);
    } else if (p.m * p.k * static_cast<int64_t>(sizeof(float)) > kRowsOfXInL1Bytes) {
      for (; r + 4 <= end; r += 4) quad_against_x(p, r);
    }
  }
  for (; r < end; ++r) row_against_x(p, r);
}

}  // namespace

void q8_0_gemv_row_range(const float* x, int64_t ldx, int64_t m, const uint8_t* blocks, int64_t n, int64_t k,
                         const float* bias, const int64_t* out_rows, float* y, int64_t ldy, int64_t row_begin,
                         int64_t row_end) {
  const Problem p{x, blocks, bias, out_rows, y, m, n, k, ldx, ldy};
  rows_against_x(p, row_begin, row_end);
}

torch::Tensor linear_q8_0_gemv(torch::Tensor x, torch::Tensor blocks, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "Q8_0 linear takes fp32 activations");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous(),
              "Q8_0 weights must be a contiguous [N, K / 32 * 34] uint8 matrix");
  const int64_t m = x.size(0), n = blocks.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlockWeights == 0 && blocks.size(1) == k / kBlockWeights * kBlockBytes, "x has ", k,
              " features; Q8_0 rows of ", blocks.size(1), " bytes hold ", blocks.size(1) / kBlockBytes * kBlockWeights);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous fp32 vector of ", n);
    bias_ptr = bias->data_ptr<float>();
  }
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Problem p{x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), bias_ptr, nullptr, y.data_ptr<float>(), m, n, k,
                  x.stride(0), n};
  // ~64 KiB of blocks per thread at least: below that waking a thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, blocks.size(1)));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { rows_against_x(p, begin, end); });
  return y;
}
