// Paged attention for the CPU over a mixed batch: every sequence's new query rows (one for a
// decode, many for a prefill chunk) attend causally to its context, read in place through the
// block table. One pass over K and V with an online softmax, so the KV rows are streamed once and
// never gathered into a copy; the query heads of a GQA group and up to kRowTile query rows share
// each K/V row while it is in L1. Threads take contiguous task ranges of about equal cost.
//
// A sliding window (window > 0; 0 is full attention) limits the query at position p to keys
// p - window < j <= p. A task starts reading at the block of the first key its first query row can
// see: earlier blocks of the sequence may have been freed and reused, so their table entries are
// never looked at, let alone the blocks they name.
//
// A quantized cache (int8 or fp8 e4m3 elements, one fp32 scale per token and KV head) is read as it is
// stored, a quarter of fp32's bytes, and each block's rows a task needs are dequantized once into an L1
// scratch that the fp32 loops then read: converting inside those loops instead repeated the conversion
// for every query of the GQA group and made int8 attention slower than fp32's, not faster.
// A bf16 cache (a bf16 model's) takes the same path without scales: each block's rows are widened to fp32
// once into the scratch. A bf16 query is widened on the way in and the output rounded back to bf16; the
// scores, softmax and sums are fp32 whatever the element types.
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/types.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kRowTile = 16;
constexpr int64_t kMaxHeadDim = 256;
// A finite stand-in for -inf: the build uses -ffast-math, under which infinities are undefined.
constexpr float kLowest = -1e30f;

struct Problem {
  const float* q;
  const void* k_cache;
  const void* v_cache;
  const float* k_scales;  // [blocks, bs, kv_heads], null for an fp32 cache
  const float* v_scales;
  const int64_t* tables;
  const int64_t* seq_lens;
  const int64_t* starts;
  float* out;
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, table_width, row_stride, block_stride;
  float scale;
  int64_t window;  // 0: full attention
};

// The first key position the query at `pos` sees.
int64_t first_visible(const Problem& p, int64_t pos) {
  return p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
}

// Query rows [row_begin, row_end) of one sequence (relative to its first new row), one KV head, and of its
// group's query heads those in [head_begin, head_end) (all of them, except in one thread's share of the
// one-region decode stack).
struct Task {
  int64_t seq, kv_head, row_begin, row_end, cost, head_begin, head_end;
};

// What a task of `rows` query rows over `keys` key positions costs, in units the thread split balances.
int64_t task_cost(int64_t rows, int64_t keys) { return rows * keys + 64; }

// Every fp8 e4m3 bit pattern's value: one table lookup per element instead of the bit arithmetic.
std::array<float, 256> make_fp8_values() {
  std::array<float, 256> values{};
  for (int i = 0; i < 256; ++i) {
    values[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
  return values;
}
const std::array<float, 256> kFp8Values = make_fp8_values();

// A cache element as a float: fp32 as it is, int8 converted, fp8 e4m3 looked up (both times a scale), bf16
// widened by a 16-bit shift (exact).
struct Fp32Element {
  using Stored = float;
};
struct Int8Element {
  using Stored = int8_t;
  static constexpr bool kScaled = true;
  static float load(const int8_t* row, int64_t d) { return static_cast<float>(row[d]); }
};
struct Fp8Element {
  using Stored = uint8_t;
  static constexpr bool kScaled = true;
  static float load(const uint8_t* row, int64_t d) { return kFp8Values[row[d]]; }
};
struct Bf16Element {
  using Stored = uint16_t;
  static constexpr bool kScaled = false;
  static float load(const uint16_t* row, int64_t d) {
    const uint32_t bits = static_cast<uint32_t>(row[d]) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
};

// Rows [first, n) of one KV head in one block of a converted cache, times their scales (a quantized cache's),
// into `out` [n][D].
template <int kD, typename E>
void convert_rows(const Problem& p, const typename E::Stored* rows, const float* scales, int64_t first, int64_t n,
                  float* out) {
  const int64_t D = kD > 0 ? kD : p.head_dim;
  for (int64_t j = first; j < n; ++j) {
    const typename E::Stored* row = rows + j * p.row_stride;
    float* dst = out + j * D;
    if constexpr (E::kScaled) {
      const float scale = scales[j * p.num_kv_heads];
      for (int64_t d = 0; d < D; ++d) dst[d] = E::load(row, d) * scale;
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d] = E::load(row, d);
    }
  }
}

template <int kD, typename E>
void run_task(const Problem& p, const Task& t, std::vector<float>& scratch) {
  using Stored = typename E::Stored;
  constexpr bool kConverted = !std::is_same_v<E, Fp32Element>;
  const int64_t D = kD > 0 ? kD : p.head_dim;
  const int64_t G = t.head_end - t.head_begin, bs = p.block_size;  // G: the task's query heads per row
  const int64_t q_len = p.starts[t.seq + 1] - p.starts[t.seq];
  const int64_t first_pos = p.seq_lens[t.seq] - q_len;  // position of the sequence's first new row
  const int64_t nq = (t.row_end - t.row_begin) * G;     // query vectors in this task
  const int64_t head0 = t.kv_head * p.group + t.head_begin;  // the task's first query head
  const int64_t kv_end = first_pos + t.row_end;         // the last row sees positions < kv_end
  const int64_t kv_begin = first_visible(p, first_pos + t.row_begin);  // the first row sees positions >= kv_begin
  scratch.resize(nq * (2 * D + bs + 2) + (kConverted ? 2 * bs * D : 0));
  float* qbuf = scratch.data();      // [nq][D], pre-scaled
  float* acc = qbuf + nq * D;        // [nq][D]
  float* scores = acc + nq * D;      // [nq][bs]
  float* row_max = scores + nq * bs; // [nq]
  float* denom = row_max + nq;       // [nq]
  float* k_rows = denom + nq;        // [bs][D], a converted cache's current block, as fp32
  float* v_rows = k_rows + bs * D;   // [bs][D]
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t row = p.starts[t.seq] + t.row_begin + i / G;
    const float* src = p.q + (row * p.num_heads + head0 + i % G) * D;
    for (int64_t d = 0; d < D; ++d) qbuf[i * D + d] = src[d] * p.scale;
    std::fill(acc + i * D, acc + (i + 1) * D, 0.f);
    row_max[i] = kLowest;
    denom[i] = 0.f;
  }
  const int64_t* table = p.tables + t.seq * p.table_width;
  for (int64_t block_start = kv_begin / bs * bs; block_start < kv_end; block_start += bs) {
    const int64_t block = table[block_start / bs];
    const int64_t offset = block * p.block_stride + t.kv_head * D;
    const float* k_block;
    const float* v_block;
    int64_t row_stride;
    if constexpr (kConverted) {
      // Row j's scale (a quantized cache's) is at [j * num_kv_heads] from the block's first.
      const int64_t scale_offset = (block * bs) * p.num_kv_heads + t.kv_head;
      const float* k_scales = E::kScaled ? p.k_scales + scale_offset : nullptr;
      const float* v_scales = E::kScaled ? p.v_scales + scale_offset : nullptr;
      const int64_t first = std::max<int64_t>(0, kv_begin - block_start);
      const int64_t rows = std::min(bs, kv_end - block_start);
      const Stored* stored = static_cast<const Stored*>(p.k_cache) + offset;
      convert_rows<kD, E>(p, stored, k_scales, first, rows, k_rows);
      stored = static_cast<const Stored*>(p.v_cache) + offset;
      convert_rows<kD, E>(p, stored, v_scales, first, rows, v_rows);
      k_block = k_rows, v_block = v_rows, row_stride = D;
    } else {
      k_block = static_cast<const float*>(p.k_cache) + offset;
      v_block = static_cast<const float*>(p.v_cache) + offset;
      row_stride = p.row_stride;
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t pos = first_pos + t.row_begin + i / G;
      const int64_t n = std::min(bs, std::min(pos + 1 - block_start, kv_end - block_start));  // causal limit
      const int64_t j0 = std::max<int64_t>(0, first_visible(p, pos) - block_start);            // window limit
      if (n <= j0) continue;
      const float* qi = qbuf + i * D;
      float* s = scores + i * bs;
      float block_max = kLowest;
      for (int64_t j = j0; j < n; ++j) {
        const float* k = k_block + j * row_stride;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qi[d] * k[d];
        s[j] = dot;
        block_max = std::max(block_max, dot);
      }
      const float new_max = std::max(row_max[i], block_max);
      const float rescale = std::exp(row_max[i] - new_max);
      row_max[i] = new_max;
      float sum = 0.f;
      for (int64_t j = j0; j < n; ++j) {
        s[j] = std::exp(s[j] - new_max);
        sum += s[j];
      }
      denom[i] = denom[i] * rescale + sum;
      // A local accumulator (no aliasing with the cache) the compiler keeps in registers across the
      // block's rows when the head size is a compile-time constant.
      float* a = acc + i * D;
      float local[kMaxHeadDim];
      for (int64_t d = 0; d < D; ++d) local[d] = a[d] * rescale;
      for (int64_t j = j0; j < n; ++j) {
        const float* __restrict__ v = v_block + j * row_stride;
        const float w = s[j];
        for (int64_t d = 0; d < D; ++d) local[d] += w * v[d];
      }
      for (int64_t d = 0; d < D; ++d) a[d] = local[d];
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t row = p.starts[t.seq] + t.row_begin + i / G;
    float* dst = p.out + (row * p.num_heads + head0 + i % G) * D;
    const float inv = 1.f / denom[i];
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[i * D + d] * inv;
  }
}

template <int kD, typename E>
void run_range(const Problem& p, const std::vector<Task>& tasks, int64_t begin, int64_t end) {
  thread_local std::vector<float> scratch;  // grown once per thread, not allocated per call
  for (int64_t i = begin; i < end; ++i) run_task<kD, E>(p, tasks[i], scratch);
}

template <typename E>
void run_tasks(const Problem& p, const std::vector<Task>& tasks, int64_t begin, int64_t end) {
  switch (p.head_dim) {
    case 64: return run_range<64, E>(p, tasks, begin, end);
    case 128: return run_range<128, E>(p, tasks, begin, end);
    case 256: return run_range<256, E>(p, tasks, begin, end);
    default: return run_range<0, E>(p, tasks, begin, end);
  }
}

void run_tasks(torch::ScalarType dtype, const Problem& p, const std::vector<Task>& tasks, int64_t begin,
               int64_t end) {
  switch (dtype) {
    case torch::kInt8: return run_tasks<Int8Element>(p, tasks, begin, end);
    case torch::kFloat8_e4m3fn: return run_tasks<Fp8Element>(p, tasks, begin, end);
    case torch::kBFloat16: return run_tasks<Bf16Element>(p, tasks, begin, end);
    default: return run_tasks<Fp32Element>(p, tasks, begin, end);
  }
}

// A quantized cache's scale cache: contiguous fp32 [blocks, bs, kv_heads] beside a cache of that shape.
const float* scales_of(const std::optional<torch::Tensor>& scales, const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(scales.has_value(), "a quantized cache needs its ", name, " scale cache");
  TORCH_CHECK(scales->scalar_type() == torch::kFloat32 && scales->is_contiguous() && scales->dim() == 3 &&
                  scales->size(0) == cache.size(0) && scales->size(1) == cache.size(1) &&
                  scales->size(2) == cache.size(2),
              name, " scales must be contiguous fp32 [blocks, block_size, kv_heads]");
  return scales->data_ptr<float>();
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale, std::optional<torch::Tensor> k_scales,
                              std::optional<torch::Tensor> v_scales, int64_t window) {
  const auto dtype = k_cache.scalar_type();
  const bool quantized = dtype == torch::kInt8 || dtype == torch::kFloat8_e4m3fn;
  const auto query_dtype = query.scalar_type();
  TORCH_CHECK((query_dtype == torch::kFloat32 || query_dtype == torch::kBFloat16) &&
                  (dtype == torch::kFloat32 || dtype == torch::kBFloat16 || quantized) && v_cache.scalar_type() == dtype,
              "the CPU paged attention kernel takes an fp32 or bf16 query over an fp32, bf16, int8 or fp8 e4m3 cache");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query [T, heads, d] and cache [blocks, bs, kv_heads, d]");
  auto q = query.to(torch::kFloat32).contiguous();
  auto kc = k_cache.contiguous();
  auto vc = v_cache.contiguous();
  const float* k_scale_data = quantized ? scales_of(k_scales, kc, "K") : nullptr;
  const float* v_scale_data = quantized ? scales_of(v_scales, vc, "V") : nullptr;
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  auto starts = query_start_loc.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_seqs = lens.size(0);
  Problem p{q.data_ptr<float>(), kc.data_ptr(), vc.data_ptr(), k_scale_data, v_scale_data, tables.data_ptr<int64_t>(),
            lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), out.data_ptr<float>(),
            q.size(1), kc.size(2), q.size(1) / kc.size(2), q.size(2), kc.size(1), tables.size(1),
            kc.size(2) * kc.size(3), kc.size(1) * kc.size(2) * kc.size(3), static_cast<float>(scale), window};
  TORCH_CHECK(window >= 0, "window must be a positive number of tokens, or 0 for full attention");
  TORCH_CHECK(kc.size(3) == p.head_dim && p.num_heads % p.num_kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(p.head_dim <= kMaxHeadDim, "head_dim above ", kMaxHeadDim, " is not supported");

  std::vector<Task> tasks;
  int64_t total_cost = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = p.starts[s + 1] - p.starts[s];
    const int64_t first_pos = p.seq_lens[s] - q_len;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      for (int64_t r = 0; r < q_len; r += kRowTile) {
        const int64_t r_end = std::min(q_len, r + kRowTile);
        const int64_t kv_rows = first_pos + r_end - first_visible(p, first_pos + r);
        const int64_t cost = task_cost(r_end - r, kv_rows);
        tasks.push_back({s, h, r, r_end, cost, 0, p.group});
        total_cost += cost;
      }
    }
  }
  // Contiguous task ranges of about equal cost, one per thread.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<int64_t> bounds(parts + 1, static_cast<int64_t>(tasks.size()));
  bounds[0] = 0;
  int64_t running = 0, part = 1;
  for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()) && part < parts; ++i) {
    running += tasks[i].cost;
    if (running * parts >= total_cost * part) bounds[part++] = i + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) run_tasks(dtype, p, tasks, bounds[i], bounds[i + 1]);
  });
  return out.to(query_dtype);
}

std::vector<std::vector<AttentionPiece>> attention_shares(const DecodeAttention& step, int64_t shares) {
  // Every (sequence, query head) of the step with its cost, in order; contiguous runs of about equal cost,
  // each cut into pieces at KV-group boundaries.
  const int64_t group = step.num_heads / step.num_kv_heads;
  std::vector<int64_t> costs(static_cast<size_t>(step.num_seqs));
  int64_t total = 0;
  for (int64_t s = 0; s < step.num_seqs; ++s) {
    costs[s] = task_cost(step.starts[s + 1] - step.starts[s], step.seq_lens[s]);
    total += costs[s] * step.num_heads;
  }
  std::vector<std::vector<AttentionPiece>> out(static_cast<size_t>(shares));
  int64_t running = 0;
  for (int64_t s = 0; s < step.num_seqs; ++s) {
    for (int64_t h = 0; h < step.num_heads; ++h) {
      auto& pieces = out[static_cast<size_t>(std::min(shares - 1, running * shares / std::max<int64_t>(1, total)))];
      running += costs[s];
      const int64_t kv_head = h / group;
      if (!pieces.empty() && pieces.back().seq == s && pieces.back().kv_head == kv_head) {
        pieces.back().head_end = h % group + 1;
      } else {
        pieces.push_back({s, kv_head, h % group, h % group + 1});
      }
    }
  }
  return out;
}

void attend_pieces(const DecodeAttention& step, const std::vector<AttentionPiece>& pieces, const float* query,
                   const torch::Tensor& k_cache, const torch::Tensor& v_cache, const float* k_scales,
                   const float* v_scales, float scale, int64_t window, float* out) {
  const Problem p{query, k_cache.data_ptr(), v_cache.data_ptr(), k_scales, v_scales, step.tables, step.seq_lens,
                  step.starts, out, step.num_heads, step.num_kv_heads, step.num_heads / step.num_kv_heads,
                  step.head_dim, step.block_size, step.table_width, step.num_kv_heads * step.head_dim,
                  step.block_size * step.num_kv_heads * step.head_dim, scale, window};
  thread_local std::vector<Task> tasks;
  tasks.clear();
  for (const AttentionPiece& piece : pieces) {
    const int64_t rows = step.starts[piece.seq + 1] - step.starts[piece.seq];
    tasks.push_back({piece.seq, piece.kv_head, 0, rows, 0, piece.head_begin, piece.head_end});
  }
  run_tasks(k_cache.scalar_type(), p, tasks, 0, static_cast<int64_t>(tasks.size()));
}
