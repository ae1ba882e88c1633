// Writing a step's new K and V rows into their slots of the paged cache. The torch reference does it
// with a mask, an `all()` that reads the mask back to the host, and two `index_copy_`, per layer per
// step; here it is one pass of row copies. A quantized cache (int8 or fp8 e4m3, with scale caches)
// gets each (token, KV head) row quantized on the way, as `torch_reference.quantize_kv` defines it. A bf16
// cache takes bf16 rows (a bf16 model's) as they are and fp32 rows rounded to nearest even, as torch's cast
// rounds them; bf16 rows bound for an fp32 or quantized cache are widened first.
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>

#include "kernels.h"

namespace {

// key/value rows `[T, kv_heads, d]`, possibly strided views into the fused qkv output.
void check_rows(const torch::Tensor& x, const torch::Tensor& cache, const char* name) {
  TORCH_CHECK((x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) && x.dim() == 3, name,
              " must be fp32 or bf16 [T, kv_heads, d]");
  TORCH_CHECK(x.size(1) == cache.size(2) && x.size(2) == cache.size(3), name, " rows do not match the cache");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), name, " heads must be contiguous within a token");
}

// One head's row: scale = max|x| / qmax, stored = x / scale rounded (half to even) and clamped.
template <typename T>
float quantize_row(const float* x, T* out, int64_t d, float qmax) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / qmax;
  const float divisor = scale > 0.f ? scale : 1.f;
  for (int64_t i = 0; i < d; ++i) {
    const float q = std::min(qmax, std::max(-qmax, x[i] / divisor));
    if constexpr (std::is_same_v<T, int8_t>) {
      out[i] = static_cast<int8_t>(std::nearbyint(q));
    } else {
      out[i] = static_cast<T>(q);
    }
  }
  return scale;
}

template <typename T>
void write_quantized(const torch::Tensor& rows, int64_t t, torch::Tensor& cache, torch::Tensor& scales,
                     int64_t slot, float qmax) {
  const int64_t heads = cache.size(2), d = cache.size(3);
  const float* src = rows.data_ptr<float>() + t * rows.stride(0);
  T* dst = reinterpret_cast<T*>(cache.data_ptr()) + slot * heads * d;
  float* scale = scales.data_ptr<float>() + slot * heads;
  for (int64_t h = 0; h < heads; ++h) scale[h] = quantize_row(src + h * d, dst + h * d, d, qmax);
}

// Token t's rows (all heads) into `slot` of a bf16 cache: copied when bf16, rounded when fp32.
void write_bf16(const torch::Tensor& rows, int64_t t, torch::Tensor& cache, int64_t slot) {
  const int64_t row = cache.size(2) * cache.size(3);
  auto* dst = reinterpret_cast<c10::BFloat16*>(cache.data_ptr()) + slot * row;
  if (rows.scalar_type() == torch::kBFloat16) {
    std::memcpy(dst, reinterpret_cast<const c10::BFloat16*>(rows.data_ptr()) + t * rows.stride(0),
                row * sizeof(c10::BFloat16));
    return;
  }
  const float* src = rows.data_ptr<float>() + t * rows.stride(0);
  for (int64_t i = 0; i < row; ++i) dst[i] = c10::BFloat16(src[i]);
}

void check_scales(const std::optional<torch::Tensor>& scales, const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(scales.has_value(), "a quantized cache needs its ", name, " scale cache");
  TORCH_CHECK(scales->scalar_type() == torch::kFloat32 && scales->is_contiguous() && scales->dim() == 3 &&
                  scales->size(0) == cache.size(0) && scales->size(1) == cache.size(1) &&
                  scales->size(2) == cache.size(2),
              name, " scales must be contiguous fp32 [blocks, block_size, kv_heads]");
}

}  // namespace

void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping, std::optional<torch::Tensor> k_scales,
                    std::optional<torch::Tensor> v_scales) {
  const auto dtype = k_cache.scalar_type();
  const bool quantized = dtype == torch::kInt8 || dtype == torch::kFloat8_e4m3fn;
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16 || quantized) && v_cache.scalar_type() == dtype &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4,
              "caches must be contiguous fp32, bf16, int8 or fp8 e4m3 [blocks, block_size, kv_heads, d] of one shape");
  check_rows(key, k_cache, "key");
  check_rows(value, v_cache, "value");
  if (dtype != torch::kBFloat16) {  // the fp32 and quantizing writes read fp32 rows
    key = key.to(torch::kFloat32);
    value = value.to(torch::kFloat32);
  }
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "slot_mapping must be int64 [T] for T key and value rows");
  if (quantized) {
    check_scales(k_scales, k_cache, "K");
    check_scales(v_scales, v_cache, "V");
  }
  auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t row = k_cache.size(2) * k_cache.size(3), num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < key.size(0); ++t) {
    if (slot[t] < 0) continue;  // a padding row
    TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " is outside the cache's ", num_slots, " slots");
    if (dtype == torch::kInt8) {
      write_quantized<int8_t>(key, t, k_cache, *k_scales, slot[t], 127.f);
      write_quantized<int8_t>(value, t, v_cache, *v_scales, slot[t], 127.f);
    } else if (dtype == torch::kFloat8_e4m3fn) {
      write_quantized<c10::Float8_e4m3fn>(key, t, k_cache, *k_scales, slot[t], 448.f);
      write_quantized<c10::Float8_e4m3fn>(value, t, v_cache, *v_scales, slot[t], 448.f);
    } else if (dtype == torch::kBFloat16) {
      write_bf16(key, t, k_cache, slot[t]);
      write_bf16(value, t, v_cache, slot[t]);
    } else {
      std::memcpy(k_cache.data_ptr<float>() + slot[t] * row, key.data_ptr<float>() + t * key.stride(0),
                  row * sizeof(float));
      std::memcpy(v_cache.data_ptr<float>() + slot[t] * row, value.data_ptr<float>() + t * value.stride(0),
                  row * sizeof(float));
    }
  }
}

void write_kv_head(const float* key, const float* value, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   float* k_scales, float* v_scales, int64_t slot, int64_t head) {
  const int64_t heads = k_cache.size(2), d = k_cache.size(3), offset = (slot * heads + head) * d;
  switch (k_cache.scalar_type()) {
    case torch::kInt8:
      k_scales[slot * heads + head] =
          quantize_row(key, static_cast<int8_t*>(k_cache.data_ptr()) + offset, d, 127.f);
      v_scales[slot * heads + head] =
          quantize_row(value, static_cast<int8_t*>(v_cache.data_ptr()) + offset, d, 127.f);
      return;
    case torch::kFloat8_e4m3fn:
      k_scales[slot * heads + head] =
          quantize_row(key, static_cast<c10::Float8_e4m3fn*>(k_cache.data_ptr()) + offset, d, 448.f);
      v_scales[slot * heads + head] =
          quantize_row(value, static_cast<c10::Float8_e4m3fn*>(v_cache.data_ptr()) + offset, d, 448.f);
      return;
    default:
      std::memcpy(static_cast<float*>(k_cache.data_ptr()) + offset, key, d * sizeof(float));
      std::memcpy(static_cast<float*>(v_cache.data_ptr()) + offset, value, d * sizeof(float));
  }
}
