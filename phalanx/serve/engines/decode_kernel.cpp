// The serving engine's decode-step linear products: a few rows times a weight (see decode_kernel.py).
//
// oneDNN's packed products (row_invariant.py) read the weights at 10-15 GB/s a core when a step holds
// up to 16 rows, where one core can stream them at 21-28 GB/s. This kernel reads a weight packed in
// 64-output panels as one sequential stream, up to four rows at a time, and sums each output exactly as
// oneDNN does on the CPUs where the engine uses it: k ascending within blocks of `block` inputs (fp32
// FMA, or bf16 pairs by vdpbf16ps), the blocks' sums added in order. Each row's sums are its own, so
// its bits never depend on the other rows. row_invariant.py checks the bits against oneDNN before the
// engine uses the kernel, so a request's tokens stay the same alone and in a busy batch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>

#include "decode_kernel.h"

namespace {

using namespace phalanx_kernel;

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
      weighted_sum(p, head, step, seen, F, o);
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
