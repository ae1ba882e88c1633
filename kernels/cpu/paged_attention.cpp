// Paged attention for the CPU over a mixed batch: every sequence's new query rows (one for a
// decode, many for a prefill chunk) attend causally to its context, read in place through the
// block table. One pass over K and V with an online softmax, so the KV rows are streamed once and
// never gathered into a copy; the query heads of a GQA group and up to kRowTile query rows share
// each K/V row while it is in L1. Threads take contiguous task ranges of about equal cost.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kRowTile = 16;
constexpr int64_t kMaxHeadDim = 256;
// A finite stand-in for -inf: the build uses -ffast-math, under which infinities are undefined.
constexpr float kLowest = -1e30f;

struct Problem {
  const float* q;
  const float* k_cache;
  const float* v_cache;
  const int64_t* tables;
  const int64_t* seq_lens;
  const int64_t* starts;
  float* out;
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, table_width, row_stride, block_stride;
  float scale;
};

// Query rows [row_begin, row_end) of one sequence (relative to its first new row), one KV head.
struct Task {
  int64_t seq, kv_head, row_begin, row_end, cost;
};

template <int kD>
void run_task(const Problem& p, const Task& t, std::vector<float>& scratch) {
  const int64_t D = kD > 0 ? kD : p.head_dim;
  const int64_t G = p.group, bs = p.block_size;
  const int64_t q_len = p.starts[t.seq + 1] - p.starts[t.seq];
  const int64_t first_pos = p.seq_lens[t.seq] - q_len;  // position of the sequence's first new row
  const int64_t nq = (t.row_end - t.row_begin) * G;     // query vectors in this task
  const int64_t kv_end = first_pos + t.row_end;         // the last row sees positions < kv_end
  scratch.resize(nq * (2 * D + bs + 2));
  float* qbuf = scratch.data();      // [nq][D], pre-scaled
  float* acc = qbuf + nq * D;        // [nq][D]
  float* scores = acc + nq * D;      // [nq][bs]
  float* row_max = scores + nq * bs; // [nq]
  float* denom = row_max + nq;       // [nq]
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t row = p.starts[t.seq] + t.row_begin + i / G;
    const float* src = p.q + (row * p.num_heads + t.kv_head * G + i % G) * D;
    for (int64_t d = 0; d < D; ++d) qbuf[i * D + d] = src[d] * p.scale;
    std::fill(acc + i * D, acc + (i + 1) * D, 0.f);
    row_max[i] = kLowest;
    denom[i] = 0.f;
  }
  const int64_t* table = p.tables + t.seq * p.table_width;
  for (int64_t block_start = 0; block_start < kv_end; block_start += bs) {
    const int64_t offset = table[block_start / bs] * p.block_stride + t.kv_head * D;
    const float* k_block = p.k_cache + offset;
    const float* v_block = p.v_cache + offset;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t visible = first_pos + t.row_begin + i / G + 1 - block_start;  // causal limit
      const int64_t n = std::min(bs, std::min(visible, kv_end - block_start));
      if (n <= 0) continue;
      const float* qi = qbuf + i * D;
      float* s = scores + i * bs;
      float block_max = kLowest;
      for (int64_t j = 0; j < n; ++j) {
        const float* k = k_block + j * p.row_stride;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qi[d] * k[d];
        s[j] = dot;
        block_max = std::max(block_max, dot);
      }
      const float new_max = std::max(row_max[i], block_max);
      const float rescale = std::exp(row_max[i] - new_max);
      row_max[i] = new_max;
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        s[j] = std::exp(s[j] - new_max);
        sum += s[j];
      }
      denom[i] = denom[i] * rescale + sum;
      // A local accumulator (no aliasing with the cache) the compiler keeps in registers across the
      // block's rows when the head size is a compile-time constant.
      float* a = acc + i * D;
      float local[kMaxHeadDim];
      for (int64_t d = 0; d < D; ++d) local[d] = a[d] * rescale;
      for (int64_t j = 0; j < n; ++j) {
        const float* __restrict__ v = v_block + j * p.row_stride;
        const float w = s[j];
        for (int64_t d = 0; d < D; ++d) local[d] += w * v[d];
      }
      for (int64_t d = 0; d < D; ++d) a[d] = local[d];
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t row = p.starts[t.seq] + t.row_begin + i / G;
    float* dst = p.out + (row * p.num_heads + t.kv_head * G + i % G) * D;
    const float inv = 1.f / denom[i];
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[i * D + d] * inv;
  }
}

template <int kD>
void run_range(const Problem& p, const std::vector<Task>& tasks, int64_t begin, int64_t end) {
  std::vector<float> scratch;
  for (int64_t i = begin; i < end; ++i) run_task<kD>(p, tasks[i], scratch);
}

void run_tasks(const Problem& p, const std::vector<Task>& tasks, int64_t begin, int64_t end) {
  switch (p.head_dim) {
    case 64: return run_range<64>(p, tasks, begin, end);
    case 128: return run_range<128>(p, tasks, begin, end);
    default: return run_range<0>(p, tasks, begin, end);
  }
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32,
              "the CPU paged attention kernel takes fp32");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query [T, heads, d] and cache [blocks, bs, kv_heads, d]");
  auto q = query.contiguous();
  auto kc = k_cache.contiguous();
  auto vc = v_cache.contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  auto starts = query_start_loc.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_seqs = lens.size(0);
  Problem p{q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), tables.data_ptr<int64_t>(),
            lens.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), out.data_ptr<float>(),
            q.size(1), kc.size(2), q.size(1) / kc.size(2), q.size(2), kc.size(1), tables.size(1),
            kc.size(2) * kc.size(3), kc.size(1) * kc.size(2) * kc.size(3), static_cast<float>(scale)};
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
        const int64_t cost = (r_end - r) * (first_pos + r_end) + 64;  // rows x KV rows, plus a fixed part
        tasks.push_back({s, h, r, r_end, cost});
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
    for (int64_t i = begin; i < end; ++i) run_tasks(p, tasks, bounds[i], bounds[i + 1]);
  });
  return out;
}
