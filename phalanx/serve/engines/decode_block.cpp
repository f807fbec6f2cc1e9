// One transformer block of a decode step in one call (see decode_block.py): RMSNorm, q/k/v, RoPE, the
// KV cache write, attention over each row's own cached positions, the output projection and the
// SwiGLU feed-forward, with the decode kernel's products (decode_kernel.h).
//
// Why by hand: a one-row step of the `125m` shape spent about 3.5 ms of its 10-17 ms in some 1,000 small
// torch ops dispatched from Python, none of them reading much memory. Here they are loops over a few
// thousand numbers. Every row is computed alone, in a fixed order, so a row's bits depend neither on
// the other rows nor on the step's width or span, as the engine promises. The element-wise steps round
// to the model's dtype where torch's ops would (after each op), so a bf16 block stays close to the
// eager one; only exp, rsqrt and the sums' order may differ in the last bits.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <sleef.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "decode_kernel.h"

namespace {

using namespace phalanx_kernel;

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T>
inline T narrow(float f);
template <>
inline float narrow<float>(float f) { return f; }
template <>
inline uint16_t narrow<uint16_t>(float f) { return c10::BFloat16(f).x; }  // round to nearest even, as torch

template <typename T>
const T* data(const at::Tensor& t) { return reinterpret_cast<const T*>(t.const_data_ptr()); }

// e^x in place, 16 at a time, by Sleef's 1-ulp exp (libtorch's own, the one torch's vectorised CPU ops
// use): scalar std::exp cost about 4 ns a value, and softmax takes one per cached position and head.
inline void exp_in_place(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, Sleef_expf16_u10(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, m, Sleef_expf16_u10(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

// A linear layer as RowInvariantLinear holds it for the kernel: panels per chunk of its inputs (chunks
// of at most 1024, summed in order as torch adds them), and an optional bias.
struct Product {
  std::vector<at::Tensor> panels;
  std::vector<int64_t> sizes;  // inputs per chunk
  int64_t out = 0;
  std::optional<at::Tensor> bias;

  // y (M, out) = x (M, sum of sizes) times the weight.
  template <typename T>
  void apply(const T* x, int64_t M, T* y, int64_t block) const {
    const int64_t K = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    std::vector<T> part, partial;
    int64_t offset = 0;
    for (size_t c = 0; c < panels.size(); ++c) {
      const int64_t size = sizes[c];
      const T* xs = x;
      if (panels.size() > 1) {  // the chunk's columns, contiguous, as torch's .contiguous() gives them
        part.resize(M * size);
        for (int64_t m = 0; m < M; ++m) std::memcpy(&part[m * size], x + m * K + offset, size * sizeof(T));
        xs = part.data();
      }
      const int64_t panel_size = std::is_same_v<T, float> ? size * PANEL : (size + 1) / 2 * PANEL * 2;
      T* target = y;
      if (c > 0) {
        partial.resize(M * out);
        target = partial.data();
      }
      linear<T>(xs, data<T>(panels[c]), target, M, out, size, panel_size, block);
      if (c > 0)
        for (int64_t i = 0; i < M * out; ++i) y[i] = narrow<T>(widen(y[i]) + widen(partial[i]));
      offset += size;
    }
    if (bias) {
      const T* b = data<T>(*bias);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < out; ++n) y[m * out + n] = narrow<T>(widen(y[m * out + n]) + widen(b[n]));
    }
  }
};

// weight * (x * rsqrt(mean(x^2) + eps)), normalised in float32 and cast before the weight (HF's order),
// over each run of n values.
template <typename T>
void rms_norm(const T* x, const T* weight, int64_t runs, int64_t n, double eps, T* y) {
  for (int64_t r = 0; r < runs; ++r) {
    const T* xr = x + r * n;
    float squares = 0;
    for (int64_t i = 0; i < n; ++i) squares += widen(xr[i]) * widen(xr[i]);
    const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(n) + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = narrow<T>(widen(weight[i]) * widen(narrow<T>(widen(xr[i]) * rstd)));
  }
}

// RoPE in HF's rotate_half layout with the signed sin of rope_rotation: x * cos + cat(x2, x1) * sin.
template <typename T>
void rotate(T* x, int64_t heads, int64_t E, const T* cos, const T* sin) {
  std::vector<float> head(E);
  const int64_t half = E / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * E;
    for (int64_t i = 0; i < E; ++i) head[i] = widen(xh[i]);
    for (int64_t i = 0; i < E; ++i) {
      const float straight = widen(narrow<T>(head[i] * widen(cos[i])));
      const float swapped = widen(narrow<T>(head[(i + half) % E] * widen(sin[i])));
      xh[i] = narrow<T>(straight + swapped);
    }
  }
}

struct DecodeBlock : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, window, block;  // window < 0: none
  double eps;
  at::Tensor attention_norm, ffn_norm;
  std::optional<at::Tensor> q_norm, k_norm;
  Product q, k, v, o, w1, w3, w2;

  DecodeBlock(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, int64_t window, int64_t block,
              at::Tensor attention_norm, at::Tensor ffn_norm, std::optional<at::Tensor> q_norm,
              std::optional<at::Tensor> k_norm)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), window(window), block(block), eps(eps),
        attention_norm(attention_norm.contiguous()), ffn_norm(ffn_norm.contiguous()), q_norm(q_norm), k_norm(k_norm) {
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "grouped heads and an even head dim");
  }

  // which: 0 q, 1 k, 2 v, 3 o, 4 w1 (gate), 5 w3 (up), 6 w2 (down).
  void set_product(int64_t which, std::vector<at::Tensor> panels, std::vector<int64_t> sizes, int64_t out,
                   std::optional<at::Tensor> bias) {
    TORCH_CHECK(which >= 0 && which < 7 && panels.size() == sizes.size() && !panels.empty(), "a product's parts");
    Product* products[] = {&q, &k, &v, &o, &w1, &w3, &w2};
    *products[which] = Product{panels, sizes, out, bias};
  }

  // x (B, D) the block's input rows, positions (B,) each row's position, cos and sin (B, E) its RoPE
  // tables, keys and values (B, K, S, E) float32 the step's cache (written at each row's position).
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                     at::Tensor values) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "contiguous rows");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
                "positions: (B,) int64");
    TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                    cos.numel() == x.size(0) * head_dim && sin.numel() == cos.numel(),
                "RoPE tables: (B, E) in the rows' dtype");
    TORCH_CHECK(keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat, "a float32 cache");
    TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.size(0) == x.size(0), "the step's cache rows");
    if (x.scalar_type() == at::kFloat) return run<float>(x, positions, cos, sin, keys, values);
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "float32 or bfloat16");
    return run<uint16_t>(x, positions, cos, sin, keys, values);
  }

  template <typename T>
  at::Tensor run(const at::Tensor& x_, const at::Tensor& positions, const at::Tensor& cos_, const at::Tensor& sin_,
                 const at::Tensor& keys, const at::Tensor& values) {
    const int64_t B = x_.size(0), D = x_.size(1), E = head_dim, H = heads, K = kv_heads;
    const T* x = data<T>(x_);
    std::vector<T> normed(B * D), qs(B * H * E), ks(B * K * E), vs(B * K * E), attended(B * H * E), projected(B * D);
    rms_norm<T>(x, data<T>(attention_norm), B, D, eps, normed.data());
    q.apply<T>(normed.data(), B, qs.data(), block);
    k.apply<T>(normed.data(), B, ks.data(), block);
    v.apply<T>(normed.data(), B, vs.data(), block);
    if (q_norm) {  // Qwen3: each head normalised over its E dims
      rms_norm<T>(qs.data(), data<T>(*q_norm), B * H, E, eps, qs.data());
      rms_norm<T>(ks.data(), data<T>(*k_norm), B * K, E, eps, ks.data());
    }
    const int64_t* pos = positions.const_data_ptr<int64_t>();
    const int64_t S = keys.size(2);
    for (int64_t b = 0; b < B; ++b) {
      rotate<T>(qs.data() + b * H * E, H, E, data<T>(cos_) + b * E, data<T>(sin_) + b * E);
      rotate<T>(ks.data() + b * K * E, K, E, data<T>(cos_) + b * E, data<T>(sin_) + b * E);
      TORCH_CHECK(pos[b] >= 0 && pos[b] < S, "a position within the step's cache span");
      for (int64_t h = 0; h < K; ++h) {
        float* key = keys.data_ptr<float>() + b * keys.stride(0) + h * keys.stride(1) + pos[b] * keys.stride(2);
        float* value = values.data_ptr<float>() + b * values.stride(0) + h * values.stride(1) + pos[b] * values.stride(2);
        for (int64_t i = 0; i < E; ++i) key[i] = widen(ks[(b * K + h) * E + i]), value[i] = widen(vs[(b * K + h) * E + i]);
      }
    }
    attend<T>(qs.data(), pos, keys, values, B, attended.data());
    o.apply<T>(attended.data(), B, projected.data(), block);
    auto out = at::empty({B, D}, x_.options());
    T* h = reinterpret_cast<T*>(out.data_ptr());
    for (int64_t i = 0; i < B * D; ++i) h[i] = narrow<T>(widen(x[i]) + widen(projected[i]));
    feed_forward<T>(h, B, D);
    return out;
  }

  // Each (row, kv head) alone: its G queries over the positions up to the row's own (within the sliding
  // window, if any), softmax in float32, then the values; the output cast to the model's dtype.
  template <typename T>
  void attend(const T* qs, const int64_t* pos, const at::Tensor& keys, const at::Tensor& values, int64_t B, T* out) {
    const int64_t E = head_dim, K = kv_heads, G = heads / kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(E));
    at::parallel_for(0, B * K, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> query(E), weights, summed(E);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / K, kv = i % K, seen = pos[b] + 1;
        const int64_t first = window > 0 ? std::max<int64_t>(0, pos[b] - window + 1) : 0;
        const float* key = keys.const_data_ptr<float>() + b * keys.stride(0) + kv * keys.stride(1);
        const float* value = values.const_data_ptr<float>() + b * values.stride(0) + kv * values.stride(1);
        weights.assign(seen, 0.0f);
        for (int64_t g = 0; g < G; ++g) {
          const T* qh = qs + (b * heads + kv * G + g) * E;
          for (int64_t e = 0; e < E; ++e) query[e] = widen(qh[e]);
          float top = -std::numeric_limits<float>::infinity();
          for (int64_t s = first; s < seen; ++s) {
            weights[s] = dot(query.data(), key + s * keys.stride(2), E) * scale;
            top = std::max(top, weights[s]);
          }
          for (int64_t s = first; s < seen; ++s) weights[s] -= top;
          exp_in_place(weights.data() + first, seen - first);
          float total = 0;
          for (int64_t s = first; s < seen; ++s) total += weights[s];
          for (int64_t s = first; s < seen; ++s) weights[s] /= total;
          weighted_sum(weights.data() + first, value + first * values.stride(2), values.stride(2), seen - first, E,
                       summed.data());
          T* o = out + (b * heads + kv * G + g) * E;
          for (int64_t e = 0; e < E; ++e) o[e] = narrow<T>(summed[e]);
        }
      }
    });
  }

  // h += w2(silu(w1(norm(h))) * w3(norm(h))), rounded after each op as torch's would be.
  template <typename T>
  void feed_forward(T* h, int64_t B, int64_t D) {
    const int64_t F = w1.out;
    std::vector<T> normed(B * D), gate(B * F), up(B * F), down(B * D);
    rms_norm<T>(h, data<T>(ffn_norm), B, D, eps, normed.data());
    w1.apply<T>(normed.data(), B, gate.data(), block);
    w3.apply<T>(normed.data(), B, up.data(), block);
    std::vector<float> decay(B * F);  // e^-gate
    for (int64_t i = 0; i < B * F; ++i) decay[i] = -widen(gate[i]);
    exp_in_place(decay.data(), B * F);
    for (int64_t i = 0; i < B * F; ++i)
      gate[i] = narrow<T>(widen(narrow<T>(widen(gate[i]) / (1.0f + decay[i]))) * widen(up[i]));
    w2.apply<T>(gate.data(), B, down.data(), block);
    for (int64_t i = 0; i < B * D; ++i) h[i] = narrow<T>(widen(h[i]) + widen(down[i]));
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(phalanx_decode_kernel, m) {
  m.class_<DecodeBlock>("DecodeBlock")
      .def(torch::init<int64_t, int64_t, int64_t, double, int64_t, int64_t, at::Tensor, at::Tensor,
                       std::optional<at::Tensor>, std::optional<at::Tensor>>())
      .def("set_product", &DecodeBlock::set_product)
      .def("forward", &DecodeBlock::forward);
}
