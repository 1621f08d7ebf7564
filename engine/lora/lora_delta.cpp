// The LoRA delta of one linear for a small batch, fused: y[t] += B_s (A_s x[t]) for each row t
// under slot s = token_slots[t] (-1: no adapter, the row is left untouched).
//
// At decode sizes the delta is two tiny matrix products per linear; through oneDNN each costs
// a fixed 20-30 us on this class of CPU, more than reading the weights. Here both run in one
// call: the shrink h = A_s x (dot products over K, 16 lanes of fp32 accumulators), then the
// expand as saxpys over the output (B_s kept transposed, [W, N], so that each rank's row is
// contiguous), each thread owning a slice of N, accumulating in fp32 and rounding y once.
// Long prefill chunks go to oneDNN instead (engine/lora/ops.py): it is FLOP-bound there.

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline void store(float* dst, float v) { *dst = v; }
inline void store(c10::BFloat16* dst, float v) { *dst = c10::BFloat16(v); }  // nearest even

#if defined(__AVX512F__)
// 16 values widened to fp32 (a bf16 is the top half of an fp32).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// y[0:16] = round(y[0:16] + acc[0:16]) to y's type (bf16: to nearest even).
inline void add16(float* y, const float* acc) {
  _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), _mm512_loadu_ps(acc)));
}
inline void add16(c10::BFloat16* y, const float* acc) {
  const __m512i bits = _mm512_castps_si512(_mm512_add_ps(load16(y), _mm512_loadu_ps(acc)));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#endif

// sum_k x[k] * a[k] in fp32.
template <typename T>
inline float dot(const T* x, const T* a, int64_t len) {
  int64_t k = 0;
  float acc = 0.0f;
#if defined(__AVX512F__)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; k + 32 <= len; k += 32) {
    acc0 = _mm512_fmadd_ps(load16(x + k), load16(a + k), acc0);
    acc1 = _mm512_fmadd_ps(load16(x + k + 16), load16(a + k + 16), acc1);
  }
  acc = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
  for (; k < len; ++k) acc += load(x[k]) * load(a[k]);
  return acc;
}

constexpr int64_t kBlock = 32;  // expand: output columns per block (two vectors)
constexpr int64_t kMaxRows = 8;

// acc[r][0:len] = sum_w h[r * hstride + w] * b[w * stride + 0:len] for `count` rows (<= 8)
// under one slot: each load of b feeds every row, whose sums stay in registers.
template <typename T>
inline void expand_rows(const float* h, int64_t hstride, int64_t count, const T* b,
                        int64_t width, int64_t stride, int64_t len,
                        float (*acc)[kBlock]) {
#if defined(__AVX512F__)
  if (len == kBlock) {
    __m512 lo[kMaxRows], hi[kMaxRows];
    for (int64_t r = 0; r < kMaxRows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t w = 0; w < width; ++w) {
      const __m512 b0 = load16(b + w * stride), b1 = load16(b + w * stride + 16);
      for (int64_t r = 0; r < kMaxRows; ++r) {
        if (r >= count) break;
        const __m512 hv = _mm512_set1_ps(h[r * hstride + w]);
        lo[r] = _mm512_fmadd_ps(hv, b0, lo[r]);
        hi[r] = _mm512_fmadd_ps(hv, b1, hi[r]);
      }
    }
    for (int64_t r = 0; r < count; ++r) {
      _mm512_storeu_ps(acc[r], lo[r]);
      _mm512_storeu_ps(acc[r] + 16, hi[r]);
    }
    return;
  }
#endif
  for (int64_t r = 0; r < count; ++r) {
    std::fill(acc[r], acc[r] + len, 0.0f);
    for (int64_t w = 0; w < width; ++w)
      for (int64_t n = 0; n < len; ++n) acc[r][n] += h[r * hstride + w] * load(b[w * stride + n]);
  }
}

// Four shrink sums at once: the ranks w..w+3 of one row share each load of x.
template <typename T>
inline void dot4(const T* x, const T* a, int64_t len, float* out) {
  int64_t k = 0;
  float tail[4] = {0, 0, 0, 0};
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (; k + 16 <= len; k += 16) {
    const __m512 xv = load16(x + k);
    s0 = _mm512_fmadd_ps(xv, load16(a + k), s0);
    s1 = _mm512_fmadd_ps(xv, load16(a + len + k), s1);
    s2 = _mm512_fmadd_ps(xv, load16(a + 2 * len + k), s2);
    s3 = _mm512_fmadd_ps(xv, load16(a + 3 * len + k), s3);
  }
  tail[0] = _mm512_reduce_add_ps(s0);
  tail[1] = _mm512_reduce_add_ps(s1);
  tail[2] = _mm512_reduce_add_ps(s2);
  tail[3] = _mm512_reduce_add_ps(s3);
#endif
  for (; k < len; ++k) {
    const float xv = load(x[k]);
    for (int j = 0; j < 4; ++j) tail[j] += xv * load(a[j * len + k]);
  }
  for (int j = 0; j < 4; ++j) out[j] = tail[j];
}

constexpr int64_t kRows = kMaxRows;  // expand: rows of one slot sharing each load of B^T

template <typename T>
void lora_delta_impl(const at::Tensor& x, at::Tensor& y, const at::Tensor& a_stack,
                     const at::Tensor& bt_stack, const at::Tensor& token_slots) {
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t width = a_stack.size(1), num_slots = a_stack.size(0);
  const T* xs = x.data_ptr<T>();
  T* ys = y.data_ptr<T>();
  const T* as = a_stack.data_ptr<T>();
  const T* bts = bt_stack.data_ptr<T>();
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);

  // Rows grouped by slot, in groups of up to kRows: (slot, first index into `order`, count).
  std::vector<int64_t> order;
  std::vector<std::array<int64_t, 3>> groups;
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t first = static_cast<int64_t>(order.size());
    for (int64_t t = 0; t < rows; ++t)
      if (slots[t] == s) order.push_back(t);
    for (int64_t g = first; g < static_cast<int64_t>(order.size()); g += kRows)
      groups.push_back({s, g, std::min(kRows, static_cast<int64_t>(order.size()) - g)});
  }
  if (order.empty()) return;

  // Shrink: h[i] = A_slot x[t] for each grouped row i, four ranks at a time.
  const int64_t quads = (width + 3) / 4;
  std::vector<float> h(order.size() * quads * 4, 0.0f);
  at::parallel_for(0, static_cast<int64_t>(order.size()) * quads, 4, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t i = item / quads, w = (item % quads) * 4, t = order[i];
      const T* xr = xs + t * x_stride;
      const T* ar = as + (slots[t] * width + w) * in;
      float* hi = h.data() + i * quads * 4 + w;
      if (w + 4 <= width) {
        dot4(xr, ar, in, hi);
      } else {
        for (int64_t j = 0; w + j < width; ++j) hi[j] = dot(xr, ar + j * in, in);
      }
    }
  });

  // Expand: y[t] += B_slot h[i], by blocks of kBlock columns; the rows of a group share each
  // load of B^T, their sums in registers.
  const int64_t hstride = quads * 4;
  const int64_t blocks = (out + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    float acc[kRows][kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock, len = std::min(kBlock, out - n0);
      for (const auto& group : groups) {
        const int64_t slot = group[0], first = group[1], count = group[2];
        const T* bs = bts + slot * width * out + n0;
        expand_rows(h.data() + first * hstride, hstride, count, bs, width, out, len, acc);
        for (int64_t r = 0; r < count; ++r) {
          T* yr = ys + order[first + r] * y_stride + n0;
          int64_t n = 0;
#if defined(__AVX512F__)
          for (; n + 16 <= len; n += 16) add16(yr + n, acc[r] + n);
#endif
          for (; n < len; ++n) store(&yr[n], load(yr[n]) + acc[r][n]);
        }
      }
    }
  });
}

void lora_delta(const at::Tensor& x, at::Tensor y, const at::Tensor& a_stack,
                const at::Tensor& bt_stack, const at::Tensor& token_slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x [T, K], y [T, N]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x and y rows must be contiguous");
  TORCH_CHECK(a_stack.is_contiguous() && bt_stack.is_contiguous(), "A and B^T contiguous");
  TORCH_CHECK(a_stack.size(2) == x.size(1) && bt_stack.size(2) == y.size(1), "shapes");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.size(0) >= x.size(0),
              "token_slots int64 [T]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && x.scalar_type() == a_stack.scalar_type() &&
                  x.scalar_type() == bt_stack.scalar_type(),
              "one dtype for x, y, A and B");
  if (x.scalar_type() == at::kFloat) {
    lora_delta_impl<float>(x, y, a_stack, bt_stack, token_slots);
  } else if (x.scalar_type() == at::kBFloat16) {
    lora_delta_impl<c10::BFloat16>(x, y, a_stack, bt_stack, token_slots);
  } else {
    TORCH_CHECK(false, "lora_delta takes float32 or bfloat16");
  }
}

}  // namespace

TORCH_LIBRARY(tidegate_lora, m) {
  m.def("lora_delta(Tensor x, Tensor(a!) y, Tensor a_stack, Tensor bt_stack, Tensor token_slots) -> ()");
}

TORCH_LIBRARY_IMPL(tidegate_lora, CPU, m) { m.impl("lora_delta", &lora_delta); }
