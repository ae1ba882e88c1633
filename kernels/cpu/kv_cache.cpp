// Writing a step's new K and V rows into their slots of the paged cache (fp32). The torch reference
// does it with a mask, an `all()` that reads the mask back to the host, and two `index_copy_`, per
// layer per step; here it is one pass of row copies.
#include <torch/extension.h>

#include <cstring>

#include "kernels.h"

namespace {

// key/value rows `[T, kv_heads, d]`, possibly strided views into the fused qkv output.
void check_rows(const torch::Tensor& x, const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3, name, " must be fp32 [T, kv_heads, d]");
  TORCH_CHECK(x.size(1) == cache.size(2) && x.size(2) == cache.size(3), name, " rows do not match the cache");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), name, " heads must be contiguous within a token");
}

}  // namespace

void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4,
              "caches must be contiguous fp32 [blocks, block_size, kv_heads, d] of one shape");
  check_rows(key, k_cache, "key");
  check_rows(value, v_cache, "value");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "slot_mapping must be int64 [T] for T key and value rows");
  auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t row = k_cache.size(2) * k_cache.size(3), num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < key.size(0); ++t) {
    if (slot[t] < 0) continue;  // a padding row
    TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " is outside the cache's ", num_slots, " slots");
    std::memcpy(k_cache.data_ptr<float>() + slot[t] * row, key.data_ptr<float>() + t * key.stride(0),
                row * sizeof(float));
    std::memcpy(v_cache.data_ptr<float>() + slot[t] * row, value.data_ptr<float>() + t * value.stride(0),
                row * sizeof(float));
  }
}
