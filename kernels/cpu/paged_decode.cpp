// Paged decode attention for the CPU: one query token per sequence, KV read in place through the
// block table (no gathered copy), GQA group sharing each KV row, fp32 softmax. Threads split the
// (sequence, kv head) pairs.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "the CPU paged decode kernel takes fp32");
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "contiguous tensors expected");
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, table_width = tables.size(1);
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t row_stride = num_kv_heads * head_dim;  // one token of one block
  const int64_t block_stride = block_size * row_stride;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t n = len[b];
      const float* qg = q + (b * num_heads + h * group) * head_dim;
      scores.assign(group * n, 0.f);
      for (int64_t s = 0; s < n; ++s) {
        const float* k = kc + tab[b * table_width + s / block_size] * block_stride + (s % block_size) * row_stride +
                         h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qq = qg + g * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qq[d] * k[d];
          scores[g * n + s] = dot * static_cast<float>(scale);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> norm(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        const float mx = *std::max_element(sg, sg + n);
        float sum = 0.f;
        for (int64_t s = 0; s < n; ++s) {
          sg[s] = std::exp(sg[s] - mx);
          sum += sg[s];
        }
        norm[g] = 1.f / sum;
      }
      for (int64_t s = 0; s < n; ++s) {
        const float* v = vc + tab[b * table_width + s / block_size] * block_stride + (s % block_size) * row_stride +
                         h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + s];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* dst = o + (b * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[g * head_dim + d] * norm[g];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (fp32, CPU)");
}
