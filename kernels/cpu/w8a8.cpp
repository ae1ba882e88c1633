// The W8A8 int8 linear: int8 weights (one fp32 scale per output row) times activations quantized to int8
// per row as they arrive (one fp32 scale per row), accumulated exactly in int32.
//
// Past a few rows a linear layer is bound by arithmetic, and an fp32 FMA does one multiply-add per lane where int8 dot
// products do four: oneDNN's int8 GEMM (`at::_int_mm`) runs 2-4x the fp32 GEMM's rate on this kind of CPU. Few rows are
// bound by reading W, where oneDNN's int8 path is slower than streaming W ourselves, so those take the GEMV below: on
// AVX-512 VNNI, `dpbusd` on W's bytes as stored against x's, a tile of 4 W rows by 4 x rows at a time, so each W vector
// read serves every x row of a decode step at 4 products per lane (int16 `madd` on a widened copy of each W row does 2,
// and its cost grew with every row a step adds). Both paths quantize x with the same function and finish each output
// with the same function, and the int32 sums are exact whatever the order, so a row's output does not depend on how
// many rows share its step (a sequence decodes to the same tokens alone or in a batch).
//
// Numerics, which `kernels.w8a8_linear.w8a8_linear_reference` spells out in torch: `s = max|x| / 127`,
// `xq = round_half_even(x / s)` clamped to ±127 (0 where s is 0), `acc = xq . q` in int32, and
// `y = float(acc) * s * scale + bias`, left to right. The float steps are compiled without -ffast-math's
// reassociation, reciprocals or contraction (`kExactFloat`), so they equal torch's bit for bit.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#define TANDEM_AVX512BW __attribute__((target("avx512f,avx512bw")))
#define TANDEM_EXACT_FLOAT __attribute__((noinline, optimize("no-fast-math", "fp-contract=off")))

namespace {

constexpr float kQmax = 127.f;
// |acc| <= 127 * 127 * K must fit an int32.
constexpr int64_t kMaxFeatures = INT32_MAX / (127 * 127);
// Columns the widened GEMV (AVX2, portable) pads x's int16 rows to: whole AVX2 vectors of int16.
constexpr int64_t kPad = 32;
// Output rows a GEMV thread finishes at a time (its int32 sums wait in a buffer of m x kRowsPerFinish).
constexpr int64_t kRowsPerFinish = 256;
// The int32 sums of one `_int_mm` call are kept near this size (bytes), so they are finished while in cache.
constexpr int64_t kChunkBytes = int64_t{4} << 20;

// One row of x quantized: `q[i] = round(x[i] / s)` clamped, with `s = max|x| / 127` returned. T is int8
// (for oneDNN) or int16 (the GEMV's widened copy). The AVX-512 loop divides, rounds half to even and
// clamps exactly as the scalar tail does.
template <typename T>
TANDEM_EXACT_FLOAT TANDEM_AVX512BW float quantize_row_avx512(const float* x, int64_t k, T* q) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (int64_t t = i; t < k; ++t) amax = std::max(amax, std::fabs(x[t]));
  const float s = amax / kQmax;
  if (!(s > 0.f)) {
    std::memset(q, 0, static_cast<size_t>(k) * sizeof(T));
    return 0.f;
  }
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-kQmax), hi = _mm512_set1_ps(kQmax);
  for (i = 0; i + 16 <= k; i += 16) {
    __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
    if constexpr (sizeof(T) == 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(v));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm512_cvtepi32_epi16(v));
    }
  }
  for (; i < k; ++i) q[i] = static_cast<T>(std::min(std::max(std::nearbyint(x[i] / s), -kQmax), kQmax));
  return s;
}

template <typename T>
TANDEM_EXACT_FLOAT float quantize_row_portable(const float* x, int64_t k, T* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax / kQmax;
  if (!(s > 0.f)) {
    std::memset(q, 0, static_cast<size_t>(k) * sizeof(T));
    return 0.f;
  }
  for (int64_t i = 0; i < k; ++i) q[i] = static_cast<T>(std::min(std::max(std::nearbyint(x[i] / s), -kQmax), kQmax));
  return s;
}

bool has_avx512bw() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return supported;
}

bool has_avx512vnni() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return has_avx512bw() && __builtin_cpu_supports("avx512vnni");
  }();
  return supported;
}

// The instruction set the W8A8 kernels run on: the GEMVs' (tests narrow it), where AVX-512 also needs BW and
// VNNI.
GemvIsa w8a8_isa() {
  const GemvIsa isa = current_gemv_isa();
  return isa == GemvIsa::kAvx512 && !has_avx512vnni() ? GemvIsa::kAvx2 : isa;
}

template <typename T>
float quantize_row(const float* x, int64_t k, T* q) {
  return w8a8_isa() == GemvIsa::kAvx512 ? quantize_row_avx512(x, k, q) : quantize_row_portable(x, k, q);
}

// Each row of x [m, k] (rows ldx apart) quantized into q (rows ldq apart); the scales into s.
template <typename T>
void quantize_rows(const float* x, int64_t ldx, int64_t m, int64_t k, T* q, int64_t ldq, float* s) {
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) s[r] = quantize_row(x + r * ldx, k, q + r * ldq);
  });
}

// `y[j] = float(acc[j]) * s * scale[j] (+ bias[j])` for one row of output, left to right.
TANDEM_EXACT_FLOAT void finish_row(const int32_t* acc, float s, const float* scale, const float* bias, float* y,
                                   int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float v = static_cast<float>(acc[j]) * s * scale[j];
    y[j] = bias ? v + bias[j] : v;
  }
}

// The widened GEMV's operands (AVX2, portable): each W row widened to int16 and multiplied with `madd`.
struct Gemv {
  const int16_t* x;  // [m, kp]: the quantized rows widened to int16, zero past k
  const int8_t* w;  // [n, k]
  int64_t m, n, k, kp;
};

#define TANDEM_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// The AVX-512 VNNI GEMV's operands. `dpbusd` multiplies 4 unsigned by 4 signed bytes per int32 lane and adds
// the sum: W's bytes, shifted to unsigned by +128 (an xor) as they are loaded, against x's signed bytes, so
// `sum (w + 128) xq = w . xq + 128 sum xq`, and each x row's `128 sum xq` is taken back out once at the end,
// in wrapping int32 (the true value fits). x needs no shifted or packed copy, W none at all.
struct VnniGemv {
  const int8_t* x;  // [m, kx]: the quantized rows, zero past k
  const uint32_t* offsets;  // [m]: 128 * sum of each quantized row
  const int8_t* w;  // [n, k]
  int64_t m, n, k, kx;
};

// Columns of W per step of the VNNI GEMV (one vector), and rows of each operand it holds at once: the NR x MR
// sums stay in registers, each W vector read serves MR x rows and each x vector NR W rows.
constexpr int64_t kVnniBytes = 64;
constexpr int kVnniWRows = 4;
constexpr int kVnniXRows = 4;

// The int32 dot products of W rows [n, n + NR) with x rows [m0, m0 + MR), into acc[row of x][n - n0] (stride
// ld). The last partial vector of each W row is read under a mask (x is zero there).
template <int NR, int MR>
TANDEM_AVX512VNNI void vnni_gemv_tile(const VnniGemv& p, int64_t n, int64_t n0, int64_t m0, int32_t* acc,
                                      int64_t ld) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* w[NR];
  __m512i sums[NR][MR];
  for (int i = 0; i < NR; ++i) {
    w[i] = p.w + (n + i) * p.k;
    for (int j = 0; j < MR; ++j) sums[i][j] = _mm512_setzero_si512();
  }
  const auto step = [&](int64_t c, __mmask64 mask) {
    __m512i wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w[i] + c), flip);
    for (int j = 0; j < MR; ++j) {
      const __m512i xv = _mm512_loadu_si512(p.x + (m0 + j) * p.kx + c);
      for (int i = 0; i < NR; ++i) sums[i][j] = _mm512_dpbusd_epi32(sums[i][j], wv[i], xv);
    }
  };
  const int64_t whole = p.k / kVnniBytes * kVnniBytes;
  for (int64_t c = 0; c < whole; c += kVnniBytes) step(c, ~__mmask64{0});
  if (whole < p.k) step(whole, (uint64_t{1} << (p.k - whole)) - 1);
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < MR; ++j) {
      const uint32_t shifted = static_cast<uint32_t>(_mm512_reduce_add_epi32(sums[i][j]));
      acc[(m0 + j) * ld + n - n0 + i] = static_cast<int32_t>(shifted - p.offsets[m0 + j]);
    }
  }
}

template <int NR>
void vnni_gemv_rows(const VnniGemv& p, int64_t n, int64_t n0, int32_t* acc, int64_t ld) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kVnniXRows) {
    switch (std::min<int64_t>(kVnniXRows, p.m - m0)) {
      case 1: vnni_gemv_tile<NR, 1>(p, n, n0, m0, acc, ld); break;
      case 2: vnni_gemv_tile<NR, 2>(p, n, n0, m0, acc, ld); break;
      case 3: vnni_gemv_tile<NR, 3>(p, n, n0, m0, acc, ld); break;
      default: vnni_gemv_tile<NR, 4>(p, n, n0, m0, acc, ld); break;
    }
  }
}

// W rows [n0, n1) against every x row: exact int32 sums into acc[row of x][n - n0] (stride n1 - n0).
void vnni_gemv_block(const VnniGemv& p, int64_t n0, int64_t n1, int32_t* acc) {
  const int64_t ld = n1 - n0;
  int64_t n = n0;
  for (; n + kVnniWRows <= n1; n += kVnniWRows) vnni_gemv_rows<kVnniWRows>(p, n, n0, acc, ld);
  switch (n1 - n) {
    case 3: vnni_gemv_rows<3>(p, n, n0, acc, ld); break;
    case 2: vnni_gemv_rows<2>(p, n, n0, acc, ld); break;
    case 1: vnni_gemv_rows<1>(p, n, n0, acc, ld); break;
    default: break;
  }
}

TANDEM_AVX2 int32_t reduce_epi32_avx2(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

TANDEM_AVX2 void block_avx2(const Gemv& p, int64_t n0, int64_t n1, int16_t* wide, int32_t* acc) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.w + n * p.k;
    int64_t c = 0;
    for (; c + 16 <= p.k; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide + c),
                          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c))));
    for (; c < p.k; ++c) wide[c] = w[c];
    for (int64_t m = 0; m < p.m; ++m) {
      __m256i sum = _mm256_setzero_si256();
      for (int64_t i = 0; i < p.kp; i += 16) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wide + i));
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x + m * p.kp + i));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(wv, xv));
      }
      acc[m * (n1 - n0) + (n - n0)] = reduce_epi32_avx2(sum);
    }
  }
}

void block_portable(const Gemv& p, int64_t n0, int64_t n1, int32_t* acc) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.w + n * p.k;
    for (int64_t m = 0; m < p.m; ++m) {
      int32_t sum = 0;
      for (int64_t i = 0; i < p.k; ++i) sum += static_cast<int32_t>(w[i]) * p.x[m * p.kp + i];
      acc[m * (n1 - n0) + (n - n0)] = sum;
    }
  }
}

// W's rows over the threads in chunks of kRowsPerFinish: `block(n0, n1, acc)` writes the int32 sums of rows
// [n0, n1) against every x row into acc[row of x][n - n0], which are finished while in cache.
template <typename Block>
void gemv(int64_t m, int64_t n, int64_t k, const float* row_scale, const float* scale, const float* bias, float* y,
          const Block& block) {
  // ~64 KiB of W per thread at least, below which a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(16, 65536 / std::max<int64_t>(1, k));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int32_t> acc;
    acc.resize(static_cast<size_t>(m * kRowsPerFinish));
    for (int64_t n0 = begin; n0 < end; n0 += kRowsPerFinish) {
      const int64_t n1 = std::min(end, n0 + kRowsPerFinish);
      block(n0, n1, acc.data());
      for (int64_t r = 0; r < m; ++r)
        finish_row(acc.data() + r * (n1 - n0), row_scale[r], scale + n0, bias ? bias + n0 : nullptr, y + r * n + n0,
                   n1 - n0);
    }
  });
}

// The GEMV on AVX-512 VNNI: x quantized to int8 rows padded with zeros to whole vectors.
void vnni_gemv(const torch::Tensor& x, const torch::Tensor& qweight, const float* scale, const float* bias, float* y) {
  const int64_t m = x.size(0), n = qweight.size(0), k = qweight.size(1);
  const int64_t kx = (k + kVnniBytes - 1) / kVnniBytes * kVnniBytes;
  std::vector<int8_t> xq(static_cast<size_t>(m * kx), 0);
  std::vector<float> row_scale(static_cast<size_t>(m));
  quantize_rows(x.data_ptr<float>(), x.stride(0), m, k, xq.data(), kx, row_scale.data());
  std::vector<uint32_t> offsets(static_cast<size_t>(m));
  for (int64_t r = 0; r < m; ++r) {
    int32_t sum = 0;
    for (int64_t i = 0; i < k; ++i) sum += xq[r * kx + i];
    offsets[r] = 128u * static_cast<uint32_t>(sum);
  }
  const VnniGemv p{xq.data(), offsets.data(), qweight.data_ptr<int8_t>(), m, n, k, kx};
  gemv(m, n, k, row_scale.data(), scale, bias, y,
       [&](int64_t n0, int64_t n1, int32_t* acc) { vnni_gemv_block(p, n0, n1, acc); });
}

// The GEMV elsewhere: x quantized straight into int16 rows padded with zeros to kp columns.
void widened_gemv(const torch::Tensor& x, const torch::Tensor& qweight, const float* scale, const float* bias,
                  float* y) {
  const int64_t m = x.size(0), n = qweight.size(0), k = qweight.size(1);
  const int64_t kp = (k + kPad - 1) / kPad * kPad;
  std::vector<int16_t> wide_x(static_cast<size_t>(m * kp), 0);
  std::vector<float> row_scale(static_cast<size_t>(m));
  quantize_rows(x.data_ptr<float>(), x.stride(0), m, k, wide_x.data(), kp, row_scale.data());
  const Gemv p{wide_x.data(), qweight.data_ptr<int8_t>(), m, n, k, kp};
  const bool avx2 = w8a8_isa() == GemvIsa::kAvx2;
  gemv(m, n, k, row_scale.data(), scale, bias, y, [&](int64_t n0, int64_t n1, int32_t* acc) {
    if (!avx2) return block_portable(p, n0, n1, acc);
    thread_local std::vector<int16_t> wide;
    wide.assign(static_cast<size_t>(kp), 0);
    block_avx2(p, n0, n1, wide.data(), acc);
  });
}

void gemm(const torch::Tensor& xq, const float* row_scale, const torch::Tensor& qweight, const float* scale,
          const float* bias, float* y) {
  const int64_t m = xq.size(0), n = qweight.size(0);
  const int64_t columns = std::max<int64_t>(256, kChunkBytes / (4 * m) / 64 * 64);
  for (int64_t n0 = 0; n0 < n; n0 += columns) {
    const int64_t count = std::min(columns, n - n0);
    const torch::Tensor acc = at::_int_mm(xq, qweight.narrow(0, n0, count).t());
    const int32_t* sums = acc.data_ptr<int32_t>();
    at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        finish_row(sums + r * count, row_scale[r], scale + n0, bias ? bias + n0 : nullptr, y + r * n + n0, count);
    });
  }
}

// AVX-512 VNNI GEMM for a decode batch's rows (`vnni_gemm`). oneDNN's int8 GEMM reaches only ~250 GOPS at
// 32 rows on this kind of CPU (its blocking suits hundreds of rows), so the LM head of a 32-sequence step
// took 40% of the step. VNNI's `dpbusd` multiplies 4 unsigned bytes by 4 signed bytes per int32 lane and
// adds the sum: here the lanes are 16 rows of x (packed [K/4][rows][4], shifted to unsigned by +128)
// and the signed bytes are 4 consecutive weights of one output column, broadcast from W as it is stored,
// so W needs no packed copy. The +128 is taken back out exactly with each W row's sum:
// `sum (xq + 128) w = xq . w + 128 sum w`, in wrapping int32 (the true value fits).
struct Vnni {
  const uint8_t* x;  // [kq][mp][4]: rows of xq + 128, row padding 128 (xq = 0)
  const int8_t* xq;  // [m][k]: the quantized rows (for the K % 4 tail)
  const int8_t* w;   // [n][k]
  const int32_t* w_sums;  // [n]
  int64_t m, mp, n, k, kq;
};

constexpr int kVnniCols = 12;  // output columns per register tile (12 x 2 = 24 accumulators)
// Output columns a thread's int32 sums wait for before they are finished (m x this many).
constexpr int64_t kVnniChunk = kVnniCols * 20;

// Rows [m0, m0 + 16 * MV) of x against columns n0..n0 + 11 (rows past n repeat the last: their sums are
// dropped), into out[column][16 * MV].
template <int MV>
TANDEM_AVX512VNNI void vnni_tile(const Vnni& p, int64_t m0, int64_t n0, int32_t* out) {
  __m512i acc[MV][kVnniCols];
  const int8_t* w[kVnniCols];
  for (int i = 0; i < kVnniCols; ++i) {
    w[i] = p.w + std::min(n0 + i, p.n - 1) * p.k;
    for (int v = 0; v < MV; ++v) acc[v][i] = _mm512_setzero_si512();
  }
  // The next tile's rows, a line each every 16 groups: fetched while this tile computes.
  const int8_t* next = p.w + std::min(n0 + kVnniCols, p.n - 1) * p.k;
  for (int64_t g = 0; g < p.kq; ++g) {
    if (g % 16 == 0 && n0 + kVnniCols < p.n)
      for (int i = 0; i < kVnniCols; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(next + std::min<int64_t>(i, p.n - 1 - n0 - kVnniCols) * p.k + 4 * g),
                     _MM_HINT_T0);
    __m512i xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = _mm512_loadu_si512(p.x + (g * p.mp + m0 + 16 * v) * 4);
    for (int i = 0; i < kVnniCols; ++i) {
      int32_t four;
      std::memcpy(&four, w[i] + 4 * g, 4);
      const __m512i wv = _mm512_set1_epi32(four);
      for (int v = 0; v < MV; ++v) acc[v][i] = _mm512_dpbusd_epi32(acc[v][i], xv[v], wv);
    }
  }
  for (int i = 0; i < kVnniCols; ++i)
    for (int v = 0; v < MV; ++v) _mm512_storeu_si512(out + i * 16 * MV + 16 * v, acc[v][i]);
}

// Columns [n0, n1) for every row of x: exact int32 sums into acc[row][n - n0] (stride n1 - n0).
void vnni_columns(const Vnni& p, int64_t n0, int64_t n1, int32_t* acc) {
  alignas(64) int32_t tile[kVnniCols * 32];
  const int64_t width = n1 - n0;
  for (int64_t c0 = n0; c0 < n1; c0 += kVnniCols) {
    for (int64_t m0 = 0; m0 < p.m; m0 += 32) {
      const int mv = p.m - m0 > 16 ? 2 : 1;
      if (mv == 2) {
        vnni_tile<2>(p, m0, c0, tile);
      } else {
        vnni_tile<1>(p, m0, c0, tile);
      }
      for (int64_t c = c0; c < std::min(c0 + kVnniCols, n1); ++c) {
        const int32_t* column = tile + (c - c0) * 16 * mv;
        // The packed groups cover the first 4 * kq weights: the row sum's tail is no part of them.
        int32_t tail_sum = 0;
        for (int64_t t = p.kq * 4; t < p.k; ++t) tail_sum += p.w[c * p.k + t];
        const uint32_t offset = 128u * static_cast<uint32_t>(p.w_sums[c] - tail_sum);
        for (int64_t r = m0; r < std::min(m0 + 16 * mv, p.m); ++r) {
          int32_t sum = static_cast<int32_t>(static_cast<uint32_t>(column[r - m0]) - offset);
          for (int64_t t = p.kq * 4; t < p.k; ++t) sum += static_cast<int32_t>(p.xq[r * p.k + t]) * p.w[c * p.k + t];
          acc[r * width + (c - n0)] = sum;
        }
      }
    }
  }
}

void vnni_gemm(const torch::Tensor& xq, const float* row_scale, const torch::Tensor& qweight,
               const torch::Tensor& w_sums, const float* scale, const float* bias, float* y) {
  const int64_t m = xq.size(0), n = qweight.size(0), k = qweight.size(1);
  const int64_t kq = k / 4, mp = (m + 15) / 16 * 16;
  std::vector<uint8_t> packed(static_cast<size_t>(std::max<int64_t>(1, kq * mp * 4)), 128);
  const int8_t* rows = xq.data_ptr<int8_t>();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < kq; ++g)
      for (int b = 0; b < 4; ++b)
        packed[(g * mp + r) * 4 + b] = static_cast<uint8_t>(rows[r * k + g * 4 + b] ^ 0x80);
  const Vnni p{packed.data(), rows, qweight.data_ptr<int8_t>(), w_sums.data_ptr<int32_t>(), m, mp, n, k, kq};
  const int64_t chunks = (n + kVnniChunk - 1) / kVnniChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int32_t> acc;
    acc.resize(static_cast<size_t>(m * kVnniChunk));
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n0 = chunk * kVnniChunk, n1 = std::min(n, n0 + kVnniChunk);
      vnni_columns(p, n0, n1, acc.data());
      for (int64_t r = 0; r < m; ++r)
        finish_row(acc.data() + r * (n1 - n0), row_scale[r], scale + n0, bias ? bias + n0 : nullptr, y + r * n + n0,
                   n1 - n0);
    }
  });
}

}  // namespace

float quantize_row_int8(const float* x, int64_t k, int8_t* q) { return quantize_row(x, k, q); }

std::tuple<torch::Tensor, torch::Tensor> quantize_rows_int8(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "x must be 2-D fp32 with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1);
  auto q = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  auto s = torch::empty({m}, x.options());
  quantize_rows(x.data_ptr<float>(), x.stride(0), m, k, q.data_ptr<int8_t>(), k, s.data_ptr<float>());
  return {q, s};
}

torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                          std::optional<torch::Tensor> bias, int64_t gemv_max_rows,
                          std::optional<torch::Tensor> weight_sums, int64_t vnni_max_rows) {
  const float* bias_ptr = check_int8_linear(x, qweight, scale, bias);
  const int64_t m = x.size(0), n = qweight.size(0), k = qweight.size(1);
  TORCH_CHECK(k <= kMaxFeatures, "a W8A8 linear takes at most ", kMaxFeatures, " input features, not ", k);
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  if (m > gemv_max_rows) {
    auto [xq, row_scale] = quantize_rows_int8(x);
    if (weight_sums.has_value() && m <= vnni_max_rows && w8a8_isa() == GemvIsa::kAvx512) {
      TORCH_CHECK(weight_sums->scalar_type() == torch::kInt32 && weight_sums->is_contiguous() &&
                      weight_sums->numel() == n,
                  "weight_sums must be the int32 sums of the ", n, " weight rows");
      vnni_gemm(xq, row_scale.data_ptr<float>(), qweight, *weight_sums, scale.data_ptr<float>(), bias_ptr,
                y.data_ptr<float>());
      return y;
    }
    gemm(xq, row_scale.data_ptr<float>(), qweight, scale.data_ptr<float>(), bias_ptr, y.data_ptr<float>());
    return y;
  }
  if (w8a8_isa() == GemvIsa::kAvx512) {
    vnni_gemv(x, qweight, scale.data_ptr<float>(), bias_ptr, y.data_ptr<float>());
  } else {
    widened_gemv(x, qweight, scale.data_ptr<float>(), bias_ptr, y.data_ptr<float>());
  }
  return y;
}
