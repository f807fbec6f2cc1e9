// One-row linear products for the serving engine's one-stream decode step (see one_row.py).
//
// oneDNN's packed products (row_invariant.py) read the weights at about 12-14 GB/s when a step holds one
// row, where one core can stream them at 20-28 GB/s. This kernel reads a weight packed in 64-output
// panels as one sequential stream, and sums each output exactly as oneDNN does on the CPUs where the
// engine uses it: k ascending within blocks of `block` inputs (fp32 FMA, or bf16 pairs by vdpbf16ps),
// the blocks' sums added in order. one_row.py checks those bits against oneDNN at every width before
// it lets the engine use the kernel, so a request's tokens stay the same alone and in a busy batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t PANEL = 64;  // outputs per panel: four 16-lane accumulators

// fp32 panel p: [K][64], output n of the panel at lane n % 16 of vector n / 16.
void panel_f32(const float* x, const float* p, int64_t K, int64_t block, __m512 total[4]) {
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t k1 = std::min(K, k0 + block);
    for (int64_t k = k0; k < k1; ++k) {
      const __m512 xv = _mm512_set1_ps(x[k]);
      const float* row = p + k * PANEL;
      for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(row + 16 * j), acc[j]);
    }
    for (int j = 0; j < 4; ++j) total[j] = k0 == 0 ? acc[j] : _mm512_add_ps(total[j], acc[j]);
  }
}

// bf16 panel p: [ceil(K/2)][64][2], inputs k and k+1 of an output side by side (a zero pads odd K).
void panel_bf16(const uint16_t* x, const uint16_t* p, int64_t K, int64_t block, __m512 total[4]) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t q1 = std::min(pairs, (k0 + block) / 2);
    for (int64_t q = k0 / 2; q < q1; ++q) {
      const uint32_t hi = 2 * q + 1 < K ? x[2 * q + 1] : 0;
      const __m512i xv = _mm512_set1_epi32(static_cast<int32_t>(x[2 * q] | (hi << 16)));
      const uint16_t* row = p + q * PANEL * 2;
      for (int j = 0; j < 4; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)xv, (__m512bh)_mm512_loadu_si512(row + 32 * j));
    }
    for (int j = 0; j < 4; ++j) total[j] = k0 == 0 ? acc[j] : _mm512_add_ps(total[j], acc[j]);
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

at::Tensor one_row_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "one contiguous row");
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == x.scalar_type(), "panels of the input's dtype");
  TORCH_CHECK(block > 0 && block % 2 == 0, "an even block");
  const int64_t K = x.size(1), N = out_features, count = (N + PANEL - 1) / PANEL;
  const int64_t panel_size = x.scalar_type() == at::kFloat ? K * PANEL : (K + 1) / 2 * PANEL * 2;
  TORCH_CHECK(panels.numel() == count * panel_size, "panels of another shape");
  auto y = at::empty({1, N}, x.options());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      __m512 total[4];
      if (x.scalar_type() == at::kFloat) {
        panel_f32(x.data_ptr<float>(), panels.data_ptr<float>() + b * panel_size, K, block, total);
        store(total, y.data_ptr<float>() + b * PANEL, std::min(PANEL, N - b * PANEL));
      } else {
        auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr()); };
        panel_bf16(bits(x), bits(panels) + b * panel_size, K, block, total);
        store(total, reinterpret_cast<uint16_t*>(y.data_ptr()) + b * PANEL, std::min(PANEL, N - b * PANEL));
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(phalanx_one_row, m) { m.def("linear(Tensor x, Tensor panels, int out_features, int block) -> Tensor"); }
TORCH_LIBRARY_IMPL(phalanx_one_row, CPU, m) { m.impl("linear", &one_row_linear); }
