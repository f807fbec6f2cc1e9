// The decode kernel's products and dot product, shared by its ops (decode_kernel.cpp) and the native
// decode block (decode_block.cpp). See decode_kernel.cpp for what they compute and why.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace phalanx_kernel {

constexpr int64_t PANEL = 64;  // outputs per panel: four 16-lane accumulators

// Rows go through a panel R at a time (R <= 4: 16 accumulators), each output of each row summed alone.

// fp32 panel p: [K][64], output n of the panel at lane n % 16 of vector n / 16.
template <int R>
inline void panel_f32(const float* x, int64_t ldx, const float* p, int64_t K, int64_t block, __m512 total[R][4]) {
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
inline void panel_bf16(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t K, int64_t block, __m512 total[R][4]) {
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

inline void store(const __m512 total[4], float* y, int64_t n) {
  for (int j = 0; j < 4 && 16 * j < n; ++j) {
    const int64_t left = std::min<int64_t>(16, n - 16 * j);
    _mm512_mask_storeu_ps(y + 16 * j, (__mmask16)((1u << left) - 1), total[j]);
  }
}

inline void store(const __m512 total[4], uint16_t* y, int64_t n) {
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

// o[f] = sum over s < seen of p[s] * head[s * step + f], s ascending: one query's values.
inline void weighted_sum(const float* p, const float* head, int64_t step, int64_t seen, int64_t F, float* o) {
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

}  // namespace phalanx_kernel
