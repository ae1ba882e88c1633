// `y = x (q * scale)^T + b` for many rows of fp32 x (a prefill chunk, a big decode batch) over int8 weights.
//
// Past a couple of dozen rows each weight feeds enough FMAs that a linear layer is bound by arithmetic
// more than by reading W, so the int8 weight has to reach the FMA units as fp32 as fast as a fp32 GEMM
// gets its own. Dequantizing W into a buffer for a BLAS GEMM cost two copies of it (ours, then the
// library's packing) and a barrier per tile, and ran slower than fp32; this file is the GEMM instead, with
// one copy, and runs faster than fp32 (timings in bench/README.md, "CPU kernels").
//
// W is cut into panels of kCols output columns. For a chunk of panels (~256 KiB of fp32, resident in L2)
// a thread converts each int8 row to q * scale in fp32, transposed to [K][kCols] so that one vector load
// holds consecutive output columns at one k; every block of kRows rows of x then passes over those
// panels, a register tile of kRows x kCols accumulators fed by one broadcast of x per row and one load of
// the panel per vector at each k. Threads take contiguous ranges of panels in one parallel region, so
// each writes its own columns of y and nothing waits in between.
//
// Numerics: each panel holds exactly the dequantized weight the torch reference multiplies (q * scale,
// one fp32 rounding), and each output is an fp32 sum of x * w over k in order, plus the bias: the
// reference's arithmetic up to summation order. There is no activation rounding and no lower precision.
//
// ISA: an AVX-512 kernel (12 x 32: 24 zmm accumulators), an AVX2 one (6 x 16: 12 ymm) and a plain C++
// one, on the instruction set the GEMVs use (`current_gemv_isa`, which tests narrow).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

struct Gemm {
  const float* x;  // [M, K], row stride ldx
  const int8_t* w;  // [N, K], contiguous
  const float* scale;  // [N]
  const float* bias;  // [N] or null
  float* y;  // [M, N], contiguous
  int64_t m, n, k, ldx;
};

// Panel width (output columns) and register-tile height (rows of x) per instruction set.
template <GemvIsa isa>
struct Tile;
template <>
struct Tile<GemvIsa::kAvx512> {
  static constexpr int kCols = 32, kRows = 12;
};
template <>
struct Tile<GemvIsa::kAvx2> {
  static constexpr int kCols = 16, kRows = 6;
};
template <>
struct Tile<GemvIsa::kPortable> {
  static constexpr int kCols = 16, kRows = 4;
};

// Writes a finished tile (`rows` x `width` floats) to y plus the bias, clipped at N: the last panel of the
// vector kernels (which store full panels themselves) and every panel of the portable one.
void store_tile(const Gemm& g, const float* tile, int rows, int width, int64_t m0, int64_t n0) {
  const int64_t cols = std::min<int64_t>(width, g.n - n0);
  for (int i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      g.y[(m0 + i) * g.n + n0 + j] = tile[i * width + j] + (g.bias ? g.bias[n0 + j] : 0.f);
}

// Reads 16 int8 weights of row `row` from column c (fewer at the end of K, zero-padded) as int32.
TANDEM_AVX512 inline __m512i load16_i8(const Gemm& g, int64_t row, int64_t c) {
  const int8_t* src = g.w + row * g.k + c;
  if (c + 16 <= g.k) return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  alignas(16) int8_t tail[16] = {};
  std::memcpy(tail, src, static_cast<size_t>(g.k - c));
  return _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
}

// r[i] = row i of a 16 x 16 block becomes r[j] = column j (unpack pairs, then 2x2, 4x4, 8x8 blocks).
TANDEM_AVX512 inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int h = 0; h < 16; h += 8)
    for (int j = 0; j < 4; ++j) {
      t[h + j] = _mm512_shuffle_f32x4(r[h + j], r[h + 4 + j], 0x88);
      t[h + 4 + j] = _mm512_shuffle_f32x4(r[h + j], r[h + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}

// Panel of output rows [n0, n0 + 32) as [K][32] fp32 q * scale, 16 rows x 16 columns at a time. While
// converting, it asks for the next panel's rows, so a chunk's conversion is not one stall per row start
// (faster at every row count with the weights coming from DRAM).
TANDEM_AVX512 void pack_avx512(const Gemm& g, int64_t n0, float* panel) {
  for (int half = 0; half < 32; half += 16) {
    const int64_t first = n0 + half;
    const int valid = static_cast<int>(std::clamp<int64_t>(g.n - first, 0, 16));
    const __m512 scales = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1u), g.scale + first);
    for (int64_t c = 0; c < g.k; c += 16) {
      if (c % 64 == 0)
        for (int64_t row = first + 32; row < std::min(first + 48, g.n); ++row)
          _mm_prefetch(reinterpret_cast<const char*>(g.w + row * g.k + c), _MM_HINT_T0);
      __m512 block[16];
      for (int i = 0; i < 16; ++i)
        block[i] = i < valid ? _mm512_cvtepi32_ps(load16_i8(g, first + i, c)) : _mm512_setzero_ps();
      transpose16(block);
      const int64_t count = std::min<int64_t>(16, g.k - c);
      for (int j = 0; j < count; ++j) _mm512_store_ps(panel + (c + j) * 32 + half, _mm512_mul_ps(block[j], scales));
    }
  }
}

template <int R>
TANDEM_AVX512 void kernel_avx512(const Gemm& g, const float* panel, int64_t m0, int64_t n0) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const float* x = g.x + m0 * g.ldx;
  for (int64_t c = 0; c < g.k; ++c) {
    const __m512 w0 = _mm512_load_ps(panel + c * 32), w1 = _mm512_load_ps(panel + c * 32 + 16);
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * g.ldx + c]);
      acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  if (n0 + 32 <= g.n) {
    const __m512 b0 = g.bias ? _mm512_loadu_ps(g.bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = g.bias ? _mm512_loadu_ps(g.bias + n0 + 16) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      _mm512_storeu_ps(g.y + (m0 + i) * g.n + n0, _mm512_add_ps(acc[i][0], b0));
      _mm512_storeu_ps(g.y + (m0 + i) * g.n + n0 + 16, _mm512_add_ps(acc[i][1], b1));
    }
    return;
  }
  alignas(64) float tile[R * 32];
  for (int i = 0; i < R; ++i) {
    _mm512_store_ps(tile + i * 32, acc[i][0]);
    _mm512_store_ps(tile + i * 32 + 16, acc[i][1]);
  }
  store_tile(g, tile, R, 32, m0, n0);
}

TANDEM_AVX2 inline __m256 load8_i8(const Gemm& g, int64_t row, int64_t c) {
  const int8_t* src = g.w + row * g.k + c;
  alignas(8) int8_t tail[8] = {};
  if (c + 8 > g.k) {
    std::memcpy(tail, src, static_cast<size_t>(g.k - c));
    src = tail;
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
}

// The 8 x 8 block transpose: unpack pairs, 2x2 blocks, then swap the 128-bit halves.
TANDEM_AVX2 inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x20);
    t[4 + j] = _mm256_permute2f128_ps(r[j], r[4 + j], 0x31);
  }
  for (int j = 0; j < 8; ++j) r[j] = t[j];
}

TANDEM_AVX2 void pack_avx2(const Gemm& g, int64_t n0, float* panel) {
  for (int half = 0; half < 16; half += 8) {
    const int64_t first = n0 + half;
    alignas(32) float row_scales[8] = {};
    for (int64_t i = 0; i < 8 && first + i < g.n; ++i) row_scales[i] = g.scale[first + i];
    const __m256 scales = _mm256_load_ps(row_scales);
    for (int64_t c = 0; c < g.k; c += 8) {
      __m256 block[8];
      for (int i = 0; i < 8; ++i) block[i] = first + i < g.n ? load8_i8(g, first + i, c) : _mm256_setzero_ps();
      transpose8(block);
      const int64_t count = std::min<int64_t>(8, g.k - c);
      for (int j = 0; j < count; ++j) _mm256_store_ps(panel + (c + j) * 16 + half, _mm256_mul_ps(block[j], scales));
    }
  }
}

template <int R>
TANDEM_AVX2 void kernel_avx2(const Gemm& g, const float* panel, int64_t m0, int64_t n0) {
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const float* x = g.x + m0 * g.ldx;
  for (int64_t c = 0; c < g.k; ++c) {
    const __m256 w0 = _mm256_load_ps(panel + c * 16), w1 = _mm256_load_ps(panel + c * 16 + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * g.ldx + c);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  if (n0 + 16 <= g.n) {
    const __m256 b0 = g.bias ? _mm256_loadu_ps(g.bias + n0) : _mm256_setzero_ps();
    const __m256 b1 = g.bias ? _mm256_loadu_ps(g.bias + n0 + 8) : _mm256_setzero_ps();
    for (int i = 0; i < R; ++i) {
      _mm256_storeu_ps(g.y + (m0 + i) * g.n + n0, _mm256_add_ps(acc[i][0], b0));
      _mm256_storeu_ps(g.y + (m0 + i) * g.n + n0 + 8, _mm256_add_ps(acc[i][1], b1));
    }
    return;
  }
  alignas(32) float tile[R * 16];
  for (int i = 0; i < R; ++i) {
    _mm256_store_ps(tile + i * 16, acc[i][0]);
    _mm256_store_ps(tile + i * 16 + 8, acc[i][1]);
  }
  store_tile(g, tile, R, 16, m0, n0);
}

void pack_portable(const Gemm& g, int64_t n0, float* panel) {
  for (int64_t c = 0; c < g.k; ++c)
    for (int64_t i = 0; i < 16; ++i)
      panel[c * 16 + i] = n0 + i < g.n ? static_cast<float>(g.w[(n0 + i) * g.k + c]) * g.scale[n0 + i] : 0.f;
}

template <int R>
void kernel_portable(const Gemm& g, const float* panel, int64_t m0, int64_t n0) {
  float tile[R * 16] = {};
  for (int64_t c = 0; c < g.k; ++c)
    for (int i = 0; i < R; ++i) {
      const float xv = g.x[(m0 + i) * g.ldx + c];
      for (int j = 0; j < 16; ++j) tile[i * 16 + j] += xv * panel[c * 16 + j];
    }
  store_tile(g, tile, R, 16, m0, n0);
}

template <GemvIsa isa>
void pack(const Gemm& g, int64_t n0, float* panel) {
  if constexpr (isa == GemvIsa::kAvx512) pack_avx512(g, n0, panel);
  if constexpr (isa == GemvIsa::kAvx2) pack_avx2(g, n0, panel);
  if constexpr (isa == GemvIsa::kPortable) pack_portable(g, n0, panel);
}

// Rows [m0, m0 + rows) of x (rows <= kRows) against one panel: the kernel compiled for exactly that many.
template <GemvIsa isa, int R = Tile<isa>::kRows>
void rows_against_panel(const Gemm& g, const float* panel, int64_t m0, int64_t n0, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return rows_against_panel<isa, R - 1>(g, panel, m0, n0, rows);
  }
  if constexpr (isa == GemvIsa::kAvx512) kernel_avx512<R>(g, panel, m0, n0);
  if constexpr (isa == GemvIsa::kAvx2) kernel_avx2<R>(g, panel, m0, n0);
  if constexpr (isa == GemvIsa::kPortable) kernel_portable<R>(g, panel, m0, n0);
}

// This thread's panel buffer, 64-byte aligned for the vector loads; kept between calls.
float* panel_buffer(int64_t floats) {
  thread_local std::vector<float> storage;
  storage.resize(static_cast<size_t>(floats) + 16);
  const auto address = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<float*>((address + 63) & ~static_cast<uintptr_t>(63));
}

template <GemvIsa isa>
void gemm(const Gemm& g) {
  constexpr int64_t kCols = Tile<isa>::kCols, kRows = Tile<isa>::kRows;
  const int64_t panels = (g.n + kCols - 1) / kCols;
  // Panels converted at a time: ~256 KiB of fp32 stays in L2 while every row block of x passes over it
  // (128 and 512 KiB measured alike; 1 MiB, and blocking K as well, were slower).
  const int64_t chunk = std::max<int64_t>(1, 262144 / (kCols * g.k * 4));
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    float* buffer = panel_buffer(std::min(chunk, end - begin) * kCols * g.k);
    for (int64_t first = begin; first < end; first += chunk) {
      const int64_t count = std::min(chunk, end - first);
      for (int64_t j = 0; j < count; ++j) pack<isa>(g, (first + j) * kCols, buffer + j * kCols * g.k);
      for (int64_t m0 = 0; m0 < g.m; m0 += kRows)
        for (int64_t j = 0; j < count; ++j)
          rows_against_panel<isa>(g, buffer + j * kCols * g.k, m0, (first + j) * kCols, std::min(kRows, g.m - m0));
    }
  });
}

}  // namespace

torch::Tensor linear_int8_gemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                               std::optional<torch::Tensor> bias) {
  const float* bias_ptr = check_int8_linear(x, qweight, scale, bias);
  const int64_t m = x.size(0), n = qweight.size(0), k = qweight.size(1);
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Gemm g{x.data_ptr<float>(), qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), bias_ptr,
               y.data_ptr<float>(), m, n, k, x.stride(0)};
  switch (current_gemv_isa()) {
    case GemvIsa::kAvx512: gemm<GemvIsa::kAvx512>(g); break;
    case GemvIsa::kAvx2: gemm<GemvIsa::kAvx2>(g); break;
    case GemvIsa::kPortable: gemm<GemvIsa::kPortable>(g); break;
  }
  return y;
}
