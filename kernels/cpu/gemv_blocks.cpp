// The few-row linear layer over GGUF 4-, 5- and 6-bit block types as stored (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K), with fp32 activations (the exact mode, as gemv_q8_0.cpp is for Q8_0).
//
// Every type's weight is an integer q of 4 to 6 bits and, per group of 16 weights, a scale s and an offset o
// with weight = s * q + o, where s * q is exact in fp32 (an fp16, or fp16 times a 6- or 8-bit sub-scale, times
// q: at most 24 significant bits), so one fused multiply-add rounds once, to the fp32 value
// `gguf.quants.dequantize` gives. The FMAs then multiply x by exactly those weights: the result is the fp32
// product with them up to summation order.
//
// A block (32 weights, or a super-block of 256) is decoded once per step of up to 4 rows of x, so the rows of
// a step share its cost. On AVX-512 Q4_K and Q6_K decode in registers (Q4_K: a sub-block's 16 possible weights
// are a 16-float table one permute indexes with the 4-bit q; Q6_K: q - 32 assembled as bytes a half
// super-block at a time, widened and scaled); otherwise a block is unpacked into an L1 scratch (q as bytes, s
// and o per 16) that the FMA loop widens to fp32. Threads share W's rows in contiguous runs, each reading a
// row's blocks front to back (two rows side by side for 3 or more rows of x on AVX-512) and asking for the
// bytes 4 KiB ahead (one sequential stream the prefetchers follow). fp16 scales are converted by F16C on the
// vector paths, in software on the portable one.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "half_float.h"
#include "kernels.h"

#define TANDEM_BLOCKS_AVX512 __attribute__((target("avx512f,avx512dq,f16c,fma")))
#define TANDEM_BLOCKS_AVX2 __attribute__((target("avx2,f16c,fma")))

namespace {

constexpr int kMaxTileRows = 4;
constexpr int64_t kAheadBytes = 4096;

// A block as `weight[i] = fma(scale[i / 16], q[i], offset[i / 16])`.
struct Unpacked {
  alignas(64) uint8_t q[256];
  alignas(64) float scale[16];
  alignas(64) float offset[16];
};

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// How a block's fp16 scales and a 32-weight type's q are read: in plain C++ on the portable path... The
// 32-weight types have 16 bytes of nibbles (weight i the low nibble of byte i, weight 16 + i the high one) and,
// the 5-bit ones, a fifth bit per weight from a 32-bit mask; weight = d * (q - bias) or d * q + m.
struct PortableDecode {
  static float half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof(h));
    return half_to_float(h);
  }
  template <int kHighBits>
  static void nibbles32(const uint8_t* qs, uint32_t qh, uint8_t* q) {
    for (int i = 0; i < 16; ++i) {
      q[i] = static_cast<uint8_t>((qs[i] & 15) | (kHighBits ? ((qh >> i) & 1) << 4 : 0));
      q[16 + i] = static_cast<uint8_t>((qs[i] >> 4) | (kHighBits ? ((qh >> (16 + i)) & 1) << 4 : 0));
    }
  }
};

// ... and with F16C and 16-byte vectors on the AVX2 and AVX-512 ones (compilers turn the plain loop into
// byte-at-a-time stores that the vector loads then wait on).
struct VectorDecode {
  __attribute__((target("f16c"))) static float half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
  }
  // 16 bits of `bits` as bytes 16 (bit set) or 0.
  TANDEM_BLOCKS_AVX2 static __m128i fifth_bits(uint32_t bits) {
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)),
                                            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(16));
  }
  template <int kHighBits>
  TANDEM_BLOCKS_AVX2 static void nibbles32(const uint8_t* qs, uint32_t qh, uint8_t* q) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), low4 = _mm_set1_epi8(15);
    __m128i low = _mm_and_si128(bytes, low4), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    if (kHighBits) {
      low = _mm_or_si128(low, fifth_bits(qh & 0xffffu));
      high = _mm_or_si128(high, fifth_bits(qh >> 16));
    }
    _mm_store_si128(reinterpret_cast<__m128i*>(q), low);
    _mm_store_si128(reinterpret_cast<__m128i*>(q + 16), high);
  }
};

inline void set_groups(Unpacked& u, int groups, float scale, float offset) {
  for (int g = 0; g < groups; ++g) u.scale[g] = scale, u.offset[g] = offset;
}

struct Q4_0 {
  static constexpr int64_t kType = 2, kWeights = 32, kBytes = 18;
  template <class Decode>
  static void unpack(const uint8_t* b, Unpacked& u) {
    const float d = Decode::half(b);
    Decode::template nibbles32<0>(b + 2, 0, u.q);
    set_groups(u, 2, d, -8.f * d);
  }
};

struct Q4_1 {
  static constexpr int64_t kType = 3, kWeights = 32, kBytes = 20;
  template <class Decode>
  static void unpack(const uint8_t* b, Unpacked& u) {
    Decode::template nibbles32<0>(b + 4, 0, u.q);
    set_groups(u, 2, Decode::half(b), Decode::half(b + 2));
  }
};

struct Q5_0 {
  static constexpr int64_t kType = 6, kWeights = 32, kBytes = 22;
  template <class Decode>
  static void unpack(const uint8_t* b, Unpacked& u) {
    const float d = Decode::half(b);
    Decode::template nibbles32<1>(b + 6, load_u32(b + 2), u.q);
    set_groups(u, 2, d, -16.f * d);
  }
};

struct Q5_1 {
  static constexpr int64_t kType = 7, kWeights = 32, kBytes = 24;
  template <class Decode>
  static void unpack(const uint8_t* b, Unpacked& u) {
    Decode::template nibbles32<1>(b + 8, load_u32(b + 4), u.q);
    set_groups(u, 2, Decode::half(b), Decode::half(b + 2));
  }
};

// Q4_K / Q5_K: fp16 d and dmin, then 12 bytes packing 8 six-bit sub-scales and 8 six-bit sub-mins (one each
// per 32 weights): weight = (d * sc) * q - dmin * mn, both products exact in fp32.
inline void k_scales(const uint8_t* b, float d, float dmin, float* scale, float* neg_min) {
  const uint8_t* s = b + 4;
  for (int j = 0; j < 4; ++j) {
    const int sc_lo = s[j] & 63, mn_lo = s[4 + j] & 63;
    const int sc_hi = (s[8 + j] & 15) | ((s[j] >> 6) << 4), mn_hi = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
    scale[j] = d * static_cast<float>(sc_lo), neg_min[j] = -(dmin * static_cast<float>(mn_lo));
    scale[4 + j] = d * static_cast<float>(sc_hi), neg_min[4 + j] = -(dmin * static_cast<float>(mn_hi));
  }
}

template <class Decode>
inline void unpack_k_scales(const uint8_t* b, Unpacked& u) {
  float scale[8], neg_min[8];
  k_scales(b, Decode::half(b), Decode::half(b + 2), scale, neg_min);
  for (int g = 0; g < 16; ++g) u.scale[g] = scale[g / 2], u.offset[g] = neg_min[g / 2];
}

// Q4_K: 128 bytes of nibbles after the scales; 32 bytes per pair of sub-blocks, low nibbles the first.
struct Q4_K {
  static constexpr int64_t kType = 12, kWeights = 256, kBytes = 144;
  template <class Decode>
  static void unpack(const uint8_t* b, Unpacked& u) {
    unpack_k_scales<Decode>(b, u);
    const uint8_t* qs = b + 16;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        u.q[64 * c + l] = qs[32 * c + l] & 15;
        u.q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
      }
  }
};

// Q5_K: Q4_K's layout with 32 bytes of fifth bits before the nibbles: bit j of byte l belongs to weight l of
// sub-block j.
struct Q5_K {
  static constexpr int64_t kType = 13, kWeights = 256, kBytes = 176;
  template <class Decode>
  static void unpack(const uint8_t* b, Unpacked& u) {
    unpack_k_scales<Decode>(b, u);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        u.q[64 * c + l] = static_cast<uint8_t>((qs[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4));
        u.q[64 * c + 32 + l] = static_cast<uint8_t>((qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
      }
  }
};

// Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 sub-scales (one per 16 weights), fp16 d.
// Each half of 128 weights takes 64 nibble bytes (weights 32g + l from byte 32 * (g % 2) + l, low nibble for
// g < 2) and 32 high bytes (bits 2g, 2g + 1 of byte l); weight = (d * sc) * (q - 32), exact in fp32.
struct Q6_K {
  static constexpr int64_t kType = 14, kWeights = 256, kBytes = 210;
  template <class Decode>
  static void unpack(const uint8_t* b, Unpacked& u) {
    const float d = Decode::half(b + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int s = 0; s < 16; ++s) u.scale[s] = d * static_cast<float>(sc[s]), u.offset[s] = -32.f * u.scale[s];
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
      for (int g = 0; g < 4; ++g)
        for (int l = 0; l < 32; ++l) {
          const int low = (ql[32 * (g % 2) + l] >> (4 * (g / 2))) & 15;
          u.q[128 * h + 32 * g + l] = static_cast<uint8_t>(low | (((qh[l] >> (2 * g)) & 3) << 4));
        }
    }
  }
};

struct Problem {
  const float* x;  // [M, K], row stride ldx
  const uint8_t* w;  // [N, row_bytes]
  const float* bias;  // [N] or null
  float* y;  // [M, N]
  int64_t m, n, k, ldx, row_bytes;
};

inline void store(const Problem& p, int64_t r, int64_t m, float dot) {
  p.y[m * p.n + r] = dot + (p.bias ? p.bias[r] : 0.f);
}

template <class T>
inline void prefetch_ahead(const Problem& p, const uint8_t* block) {
  const uint8_t* end = p.w + p.n * p.row_bytes;
  for (int64_t at = 0; at < T::kBytes; at += 64) {
    const uint8_t* ahead = block + at + kAheadBytes;
    if (ahead < end) _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
  }
}

// An unpacked block's weights 32 at a time to `emit(offset, first 16, next 16)`, widened to fp32 on AVX-512.
template <int kWeights, class Emit>
TANDEM_BLOCKS_AVX512 inline void emit_unpacked_avx512(const Unpacked& u, const Emit& emit) {
  for (int g = 0; g < kWeights / 16; g += 2) {
    const __m128i* q = reinterpret_cast<const __m128i*>(u.q + 16 * g);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(q)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(q + 1)));
    emit(16 * g, _mm512_fmadd_ps(_mm512_set1_ps(u.scale[g]), q0, _mm512_set1_ps(u.offset[g])),
         _mm512_fmadd_ps(_mm512_set1_ps(u.scale[g + 1]), q1, _mm512_set1_ps(u.offset[g + 1])));
  }
}

// AVX-512: a block's weights handed 32 at a time to `emit(offset, first 16, next 16)`.
template <class T>
struct Avx512Block {
  template <class Emit>
  TANDEM_BLOCKS_AVX512 static inline void decode(const uint8_t* block, const Emit& emit) {
    Unpacked u;
    T::template unpack<VectorDecode>(block, u);
    emit_unpacked_avx512<T::kWeights>(u, emit);
  }
};

// Q6_K in registers, a half (128 weights) at a time: its 64 nibble bytes in one vector, its 32 high-part bytes
// twice in another, assembled into bytes 4 * (q - 32) (q - 32 is q's 6 bits with the top one flipped, read as
// signed; shifted up 2 it fills an int8), which sign-extend and convert to fp32 and times d * sc / 4 give the
// weight exactly. 32-bit shifts move each byte's bits into place; the masks drop what crossed from a neighbour.
template <>
struct Avx512Block<Q6_K> {
  template <class Emit>
  TANDEM_BLOCKS_AVX512 static inline void decode(const uint8_t* block, const Emit& emit) {
    const __m128i sub_scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m512 quarter_scale = _mm512_mul_ps(_mm512_set1_ps(0.25f * VectorDecode::half(block + 208)),
                                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub_scales)));
    const __m512i nibble_bits = _mm512_set1_epi32(0x3c3c3c3c), top_bits = _mm512_set1_epi32(0xc0c0c0c0);
    const __m512i flip_sign = _mm512_set1_epi32(static_cast<int>(0x80808080u));
    // Bits 2g, 2g + 1 of a high byte up to bits 6, 7: g = 0, 1 for the low nibbles, g = 2, 3 for the high ones.
    const __m512i to_low = _mm512_setr_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i to_high = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    constexpr int kAndXor = 0x6a;  // (a & b) ^ c
    constexpr int kAndOr = 0xec;  // (a & c) | b
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(block + 64 * h);
      const __m512i qh =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h)));
      const __m512i top_low = _mm512_ternarylogic_epi32(_mm512_sllv_epi32(qh, to_low), top_bits, flip_sign, kAndXor);
      const __m512i top_high = _mm512_ternarylogic_epi32(_mm512_sllv_epi32(qh, to_high), top_bits, flip_sign, kAndXor);
      const __m512i low = _mm512_ternarylogic_epi32(_mm512_slli_epi32(ql, 2), top_low, nibble_bits, kAndOr);
      const __m512i high = _mm512_ternarylogic_epi32(_mm512_srli_epi32(ql, 2), top_high, nibble_bits, kAndOr);
      emit_quarters(low, quarter_scale, 8 * h, 128 * h, emit);
      emit_quarters(high, quarter_scale, 8 * h + 4, 128 * h + 64, emit);
    }
  }

  // 64 bytes 4 * (q - 32) as four groups of 16 weights, group i times lane first + i of quarter_scale (taken
  // from the register: a broadcast load would wait on the vector store).
  template <class Emit>
  TANDEM_BLOCKS_AVX512 static inline void emit_quarters(__m512i bytes, __m512 quarter_scale, int first, int at,
                                                        const Emit& emit) {
    const auto weights = [&](__m128i lane, int i) {
      const __m512 scale = _mm512_permutexvar_ps(_mm512_set1_epi32(first + i), quarter_scale);
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lane)), scale);
    };
    emit(at, weights(_mm512_castsi512_si128(bytes), 0), weights(_mm512_extracti32x4_epi32(bytes, 1), 1));
    emit(at + 32, weights(_mm512_extracti32x4_epi32(bytes, 2), 2), weights(_mm512_extracti32x4_epi32(bytes, 3), 3));
  }
};

// Q4_K in registers: a sub-block's 16 possible weights fma(s, 0..15, o) are one vector, and a permute by the
// nibbles (it reads an index's low 4 bits, so the low nibble needs no mask) picks each weight from it. The 8
// sub-scales and sub-mins are unpacked 4 at a time in 32-bit words and scaled 8 at a time.
template <>
struct Avx512Block<Q4_K> {
  template <class Emit>
  TANDEM_BLOCKS_AVX512 static inline void decode(const uint8_t* block, const Emit& emit) {
    const uint32_t s0 = load_u32(block + 4), s1 = load_u32(block + 8), s2 = load_u32(block + 12);
    const uint32_t sc_high = (s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u);
    const uint32_t mn_high = ((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u);
    const uint64_t sc = (s0 & 0x3f3f3f3fu) | static_cast<uint64_t>(sc_high) << 32;
    const uint64_t mn = (s1 & 0x3f3f3f3fu) | static_cast<uint64_t>(mn_high) << 32;
    const auto widen = [](uint64_t bytes) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))));
    };
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 scale = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(VectorDecode::half(block)), widen(sc)));
    const __m512 neg_min =
        _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(-VectorDecode::half(block + 2)), widen(mn)));
    // Sub-block j's table, its scale and min taken from the registers (broadcast loads would wait on a store).
    const auto table = [&](int j) {
      const __m512i lane = _mm512_set1_epi32(j);
      return _mm512_fmadd_ps(_mm512_permutexvar_ps(lane, scale), iota, _mm512_permutexvar_ps(lane, neg_min));
    };
    const uint8_t* qs = block + 16;
    for (int c = 0; c < 4; ++c) {
      const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * c)));
      const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * c + 16)));
      const __m512 low = table(2 * c), high = table(2 * c + 1);
      emit(64 * c, _mm512_permutexvar_ps(v0, low), _mm512_permutexvar_ps(v1, low));
      emit(64 * c + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), high),
           _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), high));
    }
  }
};

// W rows r.. (NR of them) against MR rows of x from m0: each 32 weights on two FMA chains per (W row, x row),
// first and second 16. Each W row's block in turn, so the x columns the first reads from L2 the second finds in
// L1; an output's arithmetic is the same whatever NR and MR, so its value never depends on the grouping.
template <class T, int NR, int MR>
TANDEM_BLOCKS_AVX512 void rows_avx512(const Problem& p, int64_t r, int64_t m0) {
  __m512 acc0[NR][MR], acc1[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc0[i][j] = acc1[i][j] = _mm512_setzero_ps();
  const uint8_t* row = p.w + r * p.row_bytes;
  for (int64_t c = 0; c < p.k; c += T::kWeights, row += T::kBytes) {
    const float* x = p.x + m0 * p.ldx + c;
#pragma GCC unroll 2
    for (int i = 0; i < NR; ++i) {
      const uint8_t* block = row + i * p.row_bytes;
      prefetch_ahead<T>(p, block);
      Avx512Block<T>::decode(block, [&](int at, __m512 w0, __m512 w1) {
        for (int j = 0; j < MR; ++j) {
          acc0[i][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + j * p.ldx + at), acc0[i][j]);
          acc1[i][j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + j * p.ldx + at + 16), acc1[i][j]);
        }
      });
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j)
      store(p, r + i, m0 + j, _mm512_reduce_add_ps(_mm512_add_ps(acc0[i][j], acc1[i][j])));
}

TANDEM_BLOCKS_AVX2 inline __m256 widen8(const uint8_t* q, float scale, float offset) {
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  return _mm256_fmadd_ps(_mm256_set1_ps(scale), v, _mm256_set1_ps(offset));
}

TANDEM_BLOCKS_AVX2 inline float reduce8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// AVX2: each block unpacked, then each 16 weights as two 8-wide vectors on two of 4 FMA chains per x row.
template <class T, int MR>
TANDEM_BLOCKS_AVX2 void row_avx2(const Problem& p, int64_t r, int64_t m0) {
  __m256 acc[4][MR];
  for (int u = 0; u < 4; ++u)
    for (int j = 0; j < MR; ++j) acc[u][j] = _mm256_setzero_ps();
  const uint8_t* row = p.w + r * p.row_bytes;
  Unpacked u;
  for (int64_t c = 0; c < p.k; c += T::kWeights, row += T::kBytes) {
    prefetch_ahead<T>(p, row);
    T::template unpack<VectorDecode>(row, u);
    for (int g = 0; g < T::kWeights / 16; g += 2) {
      __m256 w[4];
      for (int h = 0; h < 4; ++h) w[h] = widen8(u.q + 16 * g + 8 * h, u.scale[g + h / 2], u.offset[g + h / 2]);
      for (int j = 0; j < MR; ++j) {
        const float* x = p.x + (m0 + j) * p.ldx + c + 16 * g;
        for (int h = 0; h < 4; ++h) acc[h][j] = _mm256_fmadd_ps(w[h], _mm256_loadu_ps(x + 8 * h), acc[h][j]);
      }
    }
  }
  for (int j = 0; j < MR; ++j)
    store(p, r, m0 + j,
          reduce8(_mm256_add_ps(_mm256_add_ps(acc[0][j], acc[1][j]), _mm256_add_ps(acc[2][j], acc[3][j]))));
}

// Portable: one sum per x row, weights in order.
template <class T, int MR>
void row_portable(const Problem& p, int64_t r, int64_t m0) {
  float sum[MR] = {};
  const uint8_t* row = p.w + r * p.row_bytes;
  Unpacked u;
  for (int64_t c = 0; c < p.k; c += T::kWeights, row += T::kBytes) {
    T::template unpack<PortableDecode>(row, u);
    for (int j = 0; j < MR; ++j) {
      const float* x = p.x + (m0 + j) * p.ldx + c;
      for (int i = 0; i < T::kWeights; ++i)
        sum[j] += std::fma(u.scale[i / 16], static_cast<float>(u.q[i]), u.offset[i / 16]) * x[i];
    }
  }
  for (int j = 0; j < MR; ++j) store(p, r, m0 + j, sum[j]);
}

template <class T, int MR>
void row(const Problem& p, int64_t r, int64_t m0) {
  switch (current_gemv_isa()) {
    case GemvIsa::kAvx512: return rows_avx512<T, 1, MR>(p, r, m0);
    case GemvIsa::kAvx2: return row_avx2<T, MR>(p, r, m0);
    case GemvIsa::kPortable: return row_portable<T, MR>(p, r, m0);
  }
}

// W row r against every row of x, up to kMaxTileRows at a time.
template <class T>
void row_against_x(const Problem& p, int64_t r) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kMaxTileRows) {
    switch (std::min<int64_t>(kMaxTileRows, p.m - m0)) {
      case 1: row<T, 1>(p, r, m0); break;
      case 2: row<T, 2>(p, r, m0); break;
      case 3: row<T, 3>(p, r, m0); break;
      default: row<T, 4>(p, r, m0); break;
    }
  }
}

// W rows r, r + 1 against every row of x, up to kMaxTileRows at a time (AVX-512, 3 or more rows of x).
template <class T>
void pair_against_x(const Problem& p, int64_t r) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kMaxTileRows) {
    switch (std::min<int64_t>(kMaxTileRows, p.m - m0)) {
      case 1: rows_avx512<T, 2, 1>(p, r, m0); break;
      case 2: rows_avx512<T, 2, 2>(p, r, m0); break;
      case 3: rows_avx512<T, 2, 3>(p, r, m0); break;
      default: rows_avx512<T, 2, 4>(p, r, m0); break;
    }
  }
}

// W rows [begin, end). Three or more rows of x (AVX-512) take W rows in pairs: each x row is then read from L2
// once per two W rows (4 rows of 4096 features are 64 KiB, past L1). One or two stream W a row at a time.
template <class T>
void rows_against_x(const Problem& p, int64_t begin, int64_t end) {
  int64_t r = begin;
  if (p.m > 2 && current_gemv_isa() == GemvIsa::kAvx512) {
    for (; r + 2 <= end; r += 2) pair_against_x<T>(p, r);
  }
  for (; r < end; ++r) row_against_x<T>(p, r);
}

struct BlockType {
  int64_t type, weights, bytes;
  const char* name;
  void (*rows)(const Problem&, int64_t, int64_t);
};

template <class T>
constexpr BlockType block_type(const char* name) {
  return {T::kType, T::kWeights, T::kBytes, name, &rows_against_x<T>};
}

constexpr BlockType kBlockTypes[] = {
    block_type<Q4_0>("Q4_0"), block_type<Q4_1>("Q4_1"), block_type<Q5_0>("Q5_0"), block_type<Q5_1>("Q5_1"),
    block_type<Q4_K>("Q4_K"), block_type<Q5_K>("Q5_K"), block_type<Q6_K>("Q6_K"),
};

const BlockType& find_block_type(int64_t ggml_type) {
  for (const BlockType& t : kBlockTypes)
    if (t.type == ggml_type) return t;
  TORCH_CHECK(false, "ggml_type ", ggml_type,
              " is not a block type linear_gguf_gemv reads; expected Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), "
              "Q4_K (12), Q5_K (13) or Q6_K (14)");
}

}  // namespace

torch::Tensor linear_gguf_gemv(torch::Tensor x, torch::Tensor blocks, int64_t ggml_type,
                               std::optional<torch::Tensor> bias) {
  const BlockType& type = find_block_type(ggml_type);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be fp32, not ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with contiguous rows");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous 2-D uint8 matrix [N, bytes per row]");
  const int64_t m = x.size(0), n = blocks.size(0), k = x.size(1);
  TORCH_CHECK(k % type.weights == 0, "x has ", k, " features, not a multiple of the ", type.name, " block of ",
              type.weights);
  const int64_t row_bytes = k / type.weights * type.bytes;
  TORCH_CHECK(blocks.size(1) == row_bytes, "blocks rows are ", blocks.size(1), " bytes; ", type.name, " rows of ",
              k, " features are ", row_bytes);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->dim() == 1 &&
                    bias->numel() == n,
                "bias must be a contiguous fp32 vector of ", n);
    bias_ptr = bias->data_ptr<float>();
  }
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Problem p{x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), bias_ptr, y.data_ptr<float>(), m, n, k,
                  x.stride(0), row_bytes};
  // ~64 KiB of blocks per thread at least: below that waking a thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { type.rows(p, begin, end); });
  return y;
}
