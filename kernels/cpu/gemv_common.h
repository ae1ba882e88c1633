// What the fp32 GEMV (gemv.cpp) and the int8-weight GEMV (gemv_int8.cpp) share: the work split over W's
// rows, the prefetch one group of rows ahead, and the AVX2 horizontal sum. Both stream W front to back in
// groups of 4 rows, so they split and prefetch it the same way whatever its element type (except the
// int8 GEMV's one or two rows of x on AVX2, which read a group's rows one after another: see gemv_int8.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace gemv_common {

// Output rows each thread takes at least: ~64 KiB of W (elements of type T), below which waking a second
// thread costs more than it saves.
template <typename T>
int64_t row_grain(int64_t k) {
  return std::max<int64_t>(4, static_cast<int64_t>(65536 / sizeof(T)) / std::max<int64_t>(1, k));
}

// Every row of W once: `group(n0)` for each whole group of rows n0..n0 + 3, `single(r)` for each row of a
// last, partial group. Threads take contiguous runs of groups, so each reads one contiguous, 4-row
// aligned slice of W.
template <typename T, typename Group, typename Single>
void for_each_row_group(int64_t n, int64_t k, const Group& group, const Single& single) {
  const int64_t groups = (n + 3) / 4;
  at::parallel_for(0, groups, row_grain<T>(k) / 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * 4;
      if (n0 + 4 <= n) {
        group(n0);
      } else {
        for (int64_t r = n0; r < n; ++r) single(r);
      }
    }
  });
}

// Asks for the cache line at column c of each of the NR W rows after [n0, n0 + NR) into L2. `p` is a GEMV's
// problem: W in `p.w`, contiguous [p.n, p.k].
template <int NR, typename Problem>
inline void prefetch_next_group(const Problem& p, int64_t n0, int64_t c) {
  for (int i = 0; i < NR; ++i) {
    const int64_t offset = (n0 + NR + i) * p.k + c;
    if (offset < p.n * p.k) _mm_prefetch(reinterpret_cast<const char*>(p.w + offset), _MM_HINT_T1);
  }
}

TANDEM_AVX2 inline float reduce_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace gemv_common
