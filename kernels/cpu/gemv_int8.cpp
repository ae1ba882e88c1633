// The few-row linear layer over int8 weights (one fp32 scale per output row) with fp32 activations.
//
// Weight-only int8 quarters the bytes a decode step streams, and a batch-1 step is bound by exactly
// those bytes. The activations stay fp32 and every product is an fp32 FMA of x and the int8 weight
// widened to fp32, so the result is the fp32 product with the dequantized weight (q * scale) up to
// summation order: quantizing the activations too (VNNI's u8 x s8 dot products) would change the
// numbers, and greedy output must equal a reference running the dequantized weights.
//
// Few rows (`linear_int8_gemv`): the fp32 GEMV's shape — each thread streams a contiguous slice of W,
// a register tile of 4 W rows x up to 4 x rows, the next group's lines prefetched — with each 16
// (AVX-512) or 8 (AVX2) weights widened int8 -> int32 -> fp32 in registers, and the row's scale applied
// once to the finished dot product. Past 4 x rows AVX-512 tiles 2 W rows x up to 8 x rows (the widening
// shares the FMA pipes, so each widened weight should feed as many FMAs as registers allow), and past one
// x tile the widened rows are kept for the later tiles (see rows_of_w). One or two rows of x (decode of one
// or two sequences) keep 4 FMA chains per output, in the 4-row tile on AVX-512 and one W row after another
// on AVX2 (see row_group). Many rows are gemm_int8.cpp's (`linear_int8_gemm`).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "gemv_common.h"
#include "kernels.h"

namespace {

using gemv_common::prefetch_next_group;
using gemv_common::reduce_avx2;

struct Problem {
  const float* x;  // [M, K], row stride ldx
  const int8_t* w;  // [N, K], contiguous
  const float* scale;  // [N]
  const float* bias;  // [N] or null
  float* y;  // [M, N], contiguous
  int64_t m, n, k, ldx;
};

inline void store(const Problem& p, int64_t n, int64_t m, float dot) {
  p.y[m * p.n + n] = dot * p.scale[n] + (p.bias ? p.bias[n] : 0.f);
}

// The tiles read NR weight rows either as int8, widened in registers (int8 -> int32 -> fp32), or as the
// fp32 copy of them that the first x tile wrote (see rows_of_w); these loads are the only difference.
TANDEM_AVX512 inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
TANDEM_AVX512 inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
TANDEM_AVX512 inline __m512 load16_tail(const int8_t* w, int64_t count) {
  alignas(16) int8_t tail[16] = {};
  std::memcpy(tail, w, static_cast<size_t>(count));
  return load16(tail);
}
TANDEM_AVX512 inline __m512 load16_tail(const float* w, int64_t count) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), w);
}
TANDEM_AVX2 inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
TANDEM_AVX2 inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }

// Independent sums per (W row, x row) pair: a tile with fewer than 4 pairs keeps kUnroll of them per
// pair, over alternate vectors of K, so that at least 4 FMA chains are in flight (one chain left the
// single-row decode GEMV waiting on FMA latency). AVX-512 counts the rows of x alone, so a decode step's
// tile of 4 W rows keeps 4 chains per output too (its 32 registers hold the 16); AVX2's 16 registers count
// the tile's pairs.
constexpr int kUnroll(int pairs) { return pairs >= 4 ? 1 : 4 / pairs; }

// A lone W row (AVX2's 1-2 row GEMV streams W one row after another) asks for the line kAheadBytes ahead
// of the one it reads, into L1; a group of rows asks for the next group's lines, one group ahead.
constexpr int64_t kAheadBytes = 4096;

template <int NR>
inline void prefetch_w(const Problem& p, int64_t n0, int64_t c) {
  if constexpr (NR == 1) {
    const int64_t offset = n0 * p.k + c + kAheadBytes;
    if (offset < p.n * p.k) _mm_prefetch(reinterpret_cast<const char*>(p.w + offset), _MM_HINT_T0);
  } else {
    prefetch_next_group<NR>(p, n0, c);
  }
}

// NR weight rows (`w0`, K apart; output rows n0..) against MR rows of x over the whole K, 16 weights at a
// time; a tail of fewer than 16 is read zero-padded, with a masked load of x. With `kWiden` the widened
// weights are also written to `widened` (NR rows of K floats) for the x tiles that follow.
template <int NR, int MR, typename T, bool kWiden>
TANDEM_AVX512 void tile_avx512(const Problem& p, const T* w0, float* widened, int64_t n0, int64_t m0,
                               bool prefetch) {
  constexpr int U = kUnroll(MR);
  __m512 acc[U][NR][MR];
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < MR; ++j) acc[u][i][j] = _mm512_setzero_ps();
  const float* x[MR];
  for (int j = 0; j < MR; ++j) x[j] = p.x + (m0 + j) * p.ldx;
  const auto step = [&](__m512 (&sums)[NR][MR], int64_t c) {
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) {
      wv[i] = load16(w0 + i * p.k + c);
      if constexpr (kWiden) _mm512_storeu_ps(widened + i * p.k + c, wv[i]);
    }
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_loadu_ps(x[j] + c);
      for (int i = 0; i < NR; ++i) sums[i][j] = _mm512_fmadd_ps(wv[i], xv, sums[i][j]);
    }
  };
  int64_t c = 0;
  for (; c + 16 * U <= p.k; c += 16 * U) {
    if (prefetch && c % 64 == 0) prefetch_w<NR>(p, n0, c);
    for (int u = 0; u < U; ++u) step(acc[u], c + 16 * u);
  }
  for (; c + 16 <= p.k; c += 16) step(acc[0], c);
  if (c < p.k) {
    const int64_t count = p.k - c;
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) {
      wv[i] = load16_tail(w0 + i * p.k + c, count);
      if constexpr (kWiden) _mm512_mask_storeu_ps(widened + i * p.k + c, mask, wv[i]);
    }
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x[j] + c);
      for (int i = 0; i < NR; ++i) acc[0][i][j] = _mm512_fmadd_ps(wv[i], xv, acc[0][i][j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) {
      for (int u = 1; u < U; ++u) acc[0][i][j] = _mm512_add_ps(acc[0][i][j], acc[u][i][j]);
      store(p, n0 + i, m0 + j, _mm512_reduce_add_ps(acc[0][i][j]));
    }
}

template <int NR, int MR, typename T, bool kWiden>
TANDEM_AVX2 void tile_avx2(const Problem& p, const T* w0, float* widened, int64_t n0, int64_t m0, bool prefetch) {
  constexpr int U = kUnroll(NR * MR);
  __m256 acc[U][NR][MR];
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < MR; ++j) acc[u][i][j] = _mm256_setzero_ps();
  const float* x[MR];
  for (int j = 0; j < MR; ++j) x[j] = p.x + (m0 + j) * p.ldx;
  const auto step = [&](__m256 (&sums)[NR][MR], int64_t c) {
    __m256 wv[NR];
    for (int i = 0; i < NR; ++i) {
      wv[i] = load8(w0 + i * p.k + c);
      if constexpr (kWiden) _mm256_storeu_ps(widened + i * p.k + c, wv[i]);
    }
    for (int j = 0; j < MR; ++j) {
      const __m256 xv = _mm256_loadu_ps(x[j] + c);
      for (int i = 0; i < NR; ++i) sums[i][j] = _mm256_fmadd_ps(wv[i], xv, sums[i][j]);
    }
  };
  int64_t c = 0;
  for (; c + 8 * U <= p.k; c += 8 * U) {
    if (prefetch && c % 64 == 0) prefetch_w<NR>(p, n0, c);
    for (int u = 0; u < U; ++u) step(acc[u], c + 8 * u);
  }
  for (; c + 8 <= p.k; c += 8) step(acc[0], c);
  for (int i = 0; i < NR; ++i) {
    const T* w = w0 + i * p.k;
    if constexpr (kWiden)
      for (int64_t t = c; t < p.k; ++t) widened[i * p.k + t] = static_cast<float>(w[t]);
    for (int j = 0; j < MR; ++j) {
      for (int u = 1; u < U; ++u) acc[0][i][j] = _mm256_add_ps(acc[0][i][j], acc[u][i][j]);
      float sum = reduce_avx2(acc[0][i][j]);
      for (int64_t t = c; t < p.k; ++t) sum += static_cast<float>(w[t]) * x[j][t];
      store(p, n0 + i, m0 + j, sum);
    }
  }
}

template <int NR, int MR, typename T, bool kWiden>
void tile_portable(const Problem& p, const T* w0, float* widened, int64_t n0, int64_t m0, bool) {
  for (int i = 0; i < NR; ++i) {
    const T* w = w0 + i * p.k;
    if constexpr (kWiden)
      for (int64_t t = 0; t < p.k; ++t) widened[i * p.k + t] = static_cast<float>(w[t]);
    for (int j = 0; j < MR; ++j) {
      const float* x = p.x + (m0 + j) * p.ldx;
      float sum = 0.f;
      for (int64_t t = 0; t < p.k; ++t) sum += static_cast<float>(w[t]) * x[t];
      store(p, n0 + i, m0 + j, sum);
    }
  }
}

template <int NR, int MR, typename T, bool kWiden = false>
void tile(const Problem& p, const T* w0, float* widened, int64_t n0, int64_t m0, bool prefetch) {
  if constexpr (MR > 4) {  // only AVX-512 runs tiles this wide (x_tile)
    tile_avx512<NR, MR, T, kWiden>(p, w0, widened, n0, m0, prefetch);
  } else {
    switch (current_gemv_isa()) {
      case GemvIsa::kAvx512: return tile_avx512<NR, MR, T, kWiden>(p, w0, widened, n0, m0, prefetch);
      case GemvIsa::kAvx2: return tile_avx2<NR, MR, T, kWiden>(p, w0, widened, n0, m0, prefetch);
      case GemvIsa::kPortable: return tile_portable<NR, MR, T, kWiden>(p, w0, widened, n0, m0, prefetch);
    }
  }
}

// One x tile of `mr` rows (1..kMaxTileRows) against NR rows of W: the runtime row count picks the
// template. Wide tiles are AVX-512's alone, whose 32 registers hold NR x 8 sums (AVX2 has 16).
constexpr int kMaxTileRows = 8;

template <int NR, typename T, bool kWiden = false>
void x_tile(int64_t mr, const Problem& p, const T* w0, float* widened, int64_t n0, int64_t m0, bool prefetch) {
  switch (mr) {
    case 1: return tile<NR, 1, T, kWiden>(p, w0, widened, n0, m0, prefetch);
    case 2: return tile<NR, 2, T, kWiden>(p, w0, widened, n0, m0, prefetch);
    case 3: return tile<NR, 3, T, kWiden>(p, w0, widened, n0, m0, prefetch);
    case 4: return tile<NR, 4, T, kWiden>(p, w0, widened, n0, m0, prefetch);
    default: break;
  }
  if constexpr (NR <= 2) {
    switch (mr) {
      case 5: return tile<NR, 5, T, kWiden>(p, w0, widened, n0, m0, prefetch);
      case 6: return tile<NR, 6, T, kWiden>(p, w0, widened, n0, m0, prefetch);
      case 7: return tile<NR, 7, T, kWiden>(p, w0, widened, n0, m0, prefetch);
      default: return tile<NR, 8, T, kWiden>(p, w0, widened, n0, m0, prefetch);
    }
  } else {
    TORCH_INTERNAL_ASSERT(false, "an x tile of ", mr, " rows against ", NR, " W rows");  // 4 W rows: <= 4
  }
}

// All x rows against NR rows of W, in x tiles of up to `tile_rows` rows. The first tile streams the int8
// rows from memory (prefetching the next group); when more tiles follow it also writes the rows it
// widened to an fp32 copy (NR * K floats, in L1 or L2) that the later tiles read, so each weight is
// widened once however many rows x has. (A separate widening pass before the first tile was slower than
// neither: it stalls on memory where the first tile's arithmetic hides it.)
template <int NR>
void rows_of_w(const Problem& p, int64_t n0, int64_t tile_rows) {
  const int8_t* w0 = p.w + n0 * p.k;
  if (p.m <= tile_rows) return x_tile<NR, int8_t>(p.m, p, w0, nullptr, n0, 0, true);
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(NR * p.k));
  float* widened = buffer.data();
  x_tile<NR, int8_t, true>(tile_rows, p, w0, widened, n0, 0, true);
  for (int64_t m0 = tile_rows; m0 < p.m; m0 += tile_rows)
    x_tile<NR, float>(std::min(tile_rows, p.m - m0), p, widened, nullptr, n0, m0, false);
}

// How a group of 4 W rows meets the rows of x. On AVX-512 up to 4 rows of x share each group of 4 W rows'
// loads: each x vector then feeds 4 W rows, where reading one W row after another (a decode step of one or
// two sequences) read x once per W row, from L2 past a row of 4096 features, and ran at about half the
// rate. AVX2 (16 registers) reads one W row after another for one or two rows of x, asking for the line 4
// KiB ahead as it goes. Past 4 rows, AVX-512 takes W rows two at a time against tiles of up to 8 x rows:
// each widened weight (whose int -> float conversion shares the FMA pipes) then feeds 8 FMAs rather than 4.
struct RowSplit {
  bool wide;
  bool stream_rows;  // one W row after another
  int64_t tile_rows;
};

RowSplit row_split(int64_t m) {
  const bool avx512 = current_gemv_isa() == GemvIsa::kAvx512;
  const bool wide = m > 4 && avx512;
  return {wide, m <= 2 && !avx512, wide ? kMaxTileRows : 4};
}

// W rows n0..n0 + 3 against every row of x.
void row_group(const Problem& p, int64_t n0, const RowSplit& split) {
  if (split.wide) {
    rows_of_w<2>(p, n0, split.tile_rows);
    return rows_of_w<2>(p, n0 + 2, split.tile_rows);
  }
  if (!split.stream_rows) return rows_of_w<4>(p, n0, split.tile_rows);
  for (int64_t r = n0; r < n0 + 4; ++r) rows_of_w<1>(p, r, split.tile_rows);
}

}  // namespace

const float* check_int8_linear(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scale,
                               const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "int8 linear takes fp32 activations");
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8, "int8 linear needs an int8 weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(x.size(1) == qweight.size(1), "x has ", x.size(1), " features, weight expects ", qweight.size(1));
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == qweight.size(0),
              "scale must be a contiguous fp32 vector of ", qweight.size(0));
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == qweight.size(0),
              "bias must be a contiguous fp32 vector of ", qweight.size(0));
  return bias->data_ptr<float>();
}

torch::Tensor linear_int8_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                               std::optional<torch::Tensor> bias) {
  const float* bias_ptr = check_int8_linear(x, qweight, scale, bias);
  const int64_t m = x.size(0), n = qweight.size(0), k = qweight.size(1);
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Problem p{x.data_ptr<float>(), qweight.data_ptr<int8_t>(), scale.data_ptr<float>(), bias_ptr,
                  y.data_ptr<float>(), m, n, k, x.stride(0)};
  const RowSplit split = row_split(m);
  const auto group = [&](int64_t n0) { row_group(p, n0, split); };
  gemv_common::for_each_row_group<int8_t>(n, k, group, [&](int64_t r) { rows_of_w<1>(p, r, split.tile_rows); });
  return y;
}

void int8_gemv_row_range(const float* x, int64_t ldx, int64_t m, const int8_t* qweight, const float* scale,
                         const float* bias, float* y, int64_t n, int64_t k, int64_t row_begin, int64_t row_end) {
  const Problem p{x, qweight, scale, bias, y, m, n, k, ldx};
  const RowSplit split = row_split(m);
  int64_t r = row_begin;
  for (; r + 4 <= row_end; r += 4) row_group(p, r, split);
  for (; r < row_end; ++r) rows_of_w<1>(p, r, split.tile_rows);
}
