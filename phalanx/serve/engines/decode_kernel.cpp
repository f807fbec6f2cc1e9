// The serving engine's decode-step linear products: a few rows times a weight (see decode_kernel.py).
//
// oneDNN's packed products (row_invariant.py) read the weights at 10-15 GB/s a core when a step holds
// up to 16 rows, where one core can stream them at 21-28 GB/s. This kernel reads a weight packed in
// 64-output panels as one sequential stream, up to four rows at a time, and sums each output exactly as
// oneDNN does on the CPUs where the engine uses it: k ascending within blocks of `block` inputs (fp32
// FMA, or bf16 pairs by vdpbf16ps), the blocks' sums added in order. Each row's sums are its own, so
// its bits never depend on the other rows. row_invariant.py checks the bits against oneDNN before the
// engine uses the kernel, so a request's tokens stay the same alone and in a busy batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t PANEL = 64;  // outputs per panel: four 16-lane accumulators

// Rows go through a panel R at a time (R <= 4: 16 accumulators), each output of each row summed alone.

// fp32 panel p: [K][64], output n of the panel at lane n % 16 of vector n / 16.
template <int R>
void panel_f32(const float* x, int64_t ldx, const float* p, int64_t K, int64_t block, __m512 total[R][4]) {
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    const int64_t k1 = std::min(K, k0 + block);
    for (int64_t k = k0; k < k1; ++k) {
      const float* row = p + k * PANEL;
      __m512 w[4];
      for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_ps(row + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) total[r][j] = k0 == 0 ? acc[r][j] : _mm512_add_ps(total[r][j], acc[r][j]);
  }
}

// bf16 panel p: [ceil(K/2)][64][2], inputs k and k+1 of an output side by side (a zero pads odd K).
template <int R>
void panel_bf16(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t K, int64_t block, __m512 total[R][4]) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    const int64_t q1 = std::min(pairs, (k0 + block) / 2);
    for (int64_t q = k0 / 2; q < q1; ++q) {
      const uint16_t* row = p + q * PANEL * 2;
      __m512i w[4];
      for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_si512(row + 32 * j);
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * ldx;
        const uint32_t hi = 2 * q + 1 < K ? xr[2 * q + 1] : 0;
        const __m512i xv = _mm512_set1_epi32(static_cast<int32_t>(xr[2 * q] | (hi << 16)));
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)w[j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) total[r][j] = k0 == 0 ? acc[r][j] : _mm512_add_ps(total[r][j], acc[r][j]);
  }
}

void store(const __m512 total[4], float* y, int64_t n) {
  for (int j = 0; j < 4 && 16 * j < n; ++j) {
    const int64_t left = std::min<int64_t>(16, n - 16 * j);
    _mm512_mask_storeu_ps(y + 16 * j, (__mmask16)((1u << left) - 1), total[j]);
  }
}

void store(const __m512 total[4], uint16_t* y, int64_t n) {
  for (int j = 0; j < 4 && 16 * j < n; ++j) {
    const int64_t left = std::min<int64_t>(16, n - 16 * j);
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(total[j]);  // round to nearest even, as oneDNN
    _mm256_mask_storeu_epi16(y + 16 * j, (__mmask16)((1u << left) - 1), rounded);
  }
}

// R rows of x through panel b into y's columns b * 64 ...
template <int R, typename T>
void rows(const T* x, int64_t K, const T* panel, int64_t block, T* y, int64_t N, int64_t b) {
  __m512 total[R][4];
  if constexpr (std::is_same_v<T, float>)
    panel_f32<R>(x, K, panel, K, block, total);
  else
    panel_bf16<R>(x, K, panel, K, block, total);
  for (int r = 0; r < R; ++r) store(total[r], y + r * N + b * PANEL, std::min(PANEL, N - b * PANEL));
}

template <typename T>
void linear(const T* x, const T* panels, T* y, int64_t M, int64_t N, int64_t K, int64_t panel_size, int64_t block) {
  const int64_t count = (N + PANEL - 1) / PANEL;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const T* panel = panels + b * panel_size;
      for (int64_t m = 0; m < M; m += 4) {
        const T* xm = x + m * K;
        T* ym = y + m * N;
        switch (std::min<int64_t>(4, M - m)) {
          case 4: rows<4>(xm, K, panel, block, ym, N, b); break;
          case 3: rows<3>(xm, K, panel, block, ym, N, b); break;
          case 2: rows<2>(xm, K, panel, block, ym, N, b); break;
          default: rows<1>(xm, K, panel, block, ym, N, b); break;
        }
      }
    }
  });
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "contiguous rows");
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == x.scalar_type(), "panels of the input's dtype");
  TORCH_CHECK(block > 0 && block % 2 == 0, "an even block");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, count = (N + PANEL - 1) / PANEL;
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(f32 || x.scalar_type() == at::kBFloat16, "float32 or bfloat16");
  const int64_t panel_size = f32 ? K * PANEL : (K + 1) / 2 * PANEL * 2;
  TORCH_CHECK(panels.numel() == count * panel_size, "panels of another shape");
  auto y = at::empty({M, N}, x.options());
  if (f32) {
    linear<float>(x.const_data_ptr<float>(), panels.const_data_ptr<float>(), y.data_ptr<float>(), M, N, K,
                  panel_size, block);
  } else {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr()); };
    linear<uint16_t>(bits(x), bits(panels), reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K, panel_size, block);
  }
  return y;
}

// ---- Decode attention: one query row per request over its cached keys (float32) ----
// Each (row, kv head) is summed alone and in a fixed order, and only up to the row's own position, so a
// row's bits depend neither on the other rows nor on how far the step's span reaches.

inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

void check_rows(const at::Tensor& rows, const at::Tensor& cache, const at::Tensor& positions, const char* what) {
  TORCH_CHECK(rows.dim() == 4 && rows.is_contiguous() && rows.scalar_type() == at::kFloat, what, ": (B, K, G, n) float32");
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1 && cache.scalar_type() == at::kFloat, "cache: (B, K, S, n) float32");
  TORCH_CHECK(cache.size(0) == rows.size(0) && cache.size(1) == rows.size(1), "cache rows and heads");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows.size(0) && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "positions: (B,) int64");
}

// body(i, head, seen) for each (row b, kv head k), i = b * K + k, in parallel: head points at the cache's
// positions for (b, k), seen is how many of them the row holds (its position + 1, at most S).
template <typename Body>
void for_each_head(const at::Tensor& cache, const at::Tensor& positions, const Body& body) {
  const int64_t K = cache.size(1), S = cache.size(2);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const float* base = cache.const_data_ptr<float>();
  at::parallel_for(0, positions.size(0) * K, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / K, k = i % K;
      body(i, base + b * cache.stride(0) + k * cache.stride(1), std::clamp<int64_t>(pos[b] + 1, 0, S));
    }
  });
}

// scores[b, k, g, s] = (q[b, k, g] . keys[b, k, s]) * scale for s <= positions[b], -inf beyond.
at::Tensor attend_scores(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& positions, double scale) {
  check_rows(q, keys, positions, "queries");
  TORCH_CHECK(keys.size(3) == q.size(3), "key and query head dims");
  const int64_t G = q.size(2), E = q.size(3), S = keys.size(2), step = keys.stride(2);
  auto out = at::empty({q.size(0), q.size(1), G, S}, q.options());
  const float* qp = q.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float factor = static_cast<float>(scale);
  for_each_head(keys, positions, [&](int64_t i, const float* head, int64_t seen) {
    for (int64_t g = 0; g < G; ++g) {
      const float* query = qp + (i * G + g) * E;
      float* row = op + (i * G + g) * S;
      for (int64_t s = 0; s < seen; ++s) row[s] = dot(query, head + s * step, E) * factor;
      std::fill(row + seen, row + S, -std::numeric_limits<float>::infinity());
    }
  });
  return out;
}

// out[b, k, g] = sum over s <= positions[b] of probs[b, k, g, s] * values[b, k, s], s ascending.
at::Tensor attend_values(const at::Tensor& probs, const at::Tensor& values, const at::Tensor& positions) {
  check_rows(probs, values, positions, "probabilities");
  TORCH_CHECK(values.size(2) == probs.size(3), "one probability per cached position");
  const int64_t G = probs.size(2), S = probs.size(3), F = values.size(3), step = values.stride(2);
  auto out = at::empty({probs.size(0), probs.size(1), G, F}, probs.options());
  const float* pp = probs.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_head(values, positions, [&](int64_t i, const float* head, int64_t seen) {
    for (int64_t g = 0; g < G; ++g) {
      const float* p = pp + (i * G + g) * S;
      float* o = op + (i * G + g) * F;
      for (int64_t f0 = 0; f0 < F; f0 += 64) {  // 64 outputs at a time: four accumulators
        __mmask16 mask[4];
        __m512 acc[4];
        for (int j = 0; j < 4; ++j) {
          const int64_t left = std::clamp<int64_t>(F - f0 - 16 * j, 0, 16);
          mask[j] = (__mmask16)((1u << left) - 1);
          acc[j] = _mm512_setzero_ps();
        }
        for (int64_t s = 0; s < seen; ++s) {
          const __m512 weight = _mm512_set1_ps(p[s]);
          const float* v = head + s * step + f0;
          for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(weight, _mm512_maskz_loadu_ps(mask[j], v + 16 * j), acc[j]);
        }
        for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(o + f0 + 16 * j, mask[j], acc[j]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(phalanx_decode_kernel, m) {
  m.def("linear(Tensor x, Tensor panels, int out_features, int block) -> Tensor");
  m.def("attend_scores(Tensor q, Tensor keys, Tensor positions, float scale) -> Tensor");
  m.def("attend_values(Tensor probs, Tensor values, Tensor positions) -> Tensor");
}
TORCH_LIBRARY_IMPL(phalanx_decode_kernel, CPU, m) {
  m.impl("linear", &panel_linear);
  m.impl("attend_scores", &attend_scores);
  m.impl("attend_values", &attend_values);
}
