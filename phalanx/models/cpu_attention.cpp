// Causal self-attention, forward and backward, for a bf16 training step on a CPU with AVX-512 bf16
// (models/cpu_attention.py says when it is used and why).
//
// torch's CPU flash attention runs its block products through MKL's bf16 GEMM, which on a CPU without AMX
// reaches about half of what oneDNN's products do (92 against 204 GFLOP/s a core on a 256 x 256 x 64 block,
// measured on the EPYC of BENCHMARKS.md), so a bf16 step attends slower than a float32 one. Here every
// product is vdpbf16ps on register tiles, float32 accumulators, over whole rows of the causal triangle:
// the sequences a CPU trains on are short enough that a (b, kv head) item's scores fit in its core's L2.
//
// Numerics follow torch's flash kernel: scores, softmax, logsumexp and the gradient's row sums in float32;
// the probabilities and dS rounded to bf16 (round to nearest even) for the products that read them. Each
// item is computed by one thread in a fixed order, so results do not depend on the thread count.
//
// Layout words: a product C = A . B reads A and B as 32-bit words, each two bf16 values of consecutive k
// (what vdpbf16ps multiplies in pairs). Tp is T rounded up to 64; rows and keys past T are zeros.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sleef.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int R = 4;  // rows per tile: R x 4 accumulators of 16 lanes
constexpr int64_t QB = 64;  // queries per block: a block's scores and their gradients stay in L2

// C[r][0..16*NV) = sum over q in [q0, q1) of A[r][q] * B[q][...], as bf16 pairs (vdpbf16ps); A and B are
// 32-bit words, each two bf16 values of consecutive k.
template <int NV>
void tile(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, int64_t q0, int64_t q1, float* C,
                 int64_t ldc, bool add) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t q = q0; q < q1; ++q) {
    const uint32_t* b = B + q * ldb;
    __m512i bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_si512(b + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(A[r * lda + q]));
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)a, (__m512bh)bv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) {
      float* c = C + r * ldc + 16 * j;
      _mm512_storeu_ps(c, add ? _mm512_add_ps(_mm512_loadu_ps(c), acc[r][j]) : acc[r][j]);
    }
}

// C (M x cols) = A (M x pairs, words) . B (pairs x N, words), rows R at a time. cols(m0): the columns a row
// block needs (a multiple of 16); pairs(m0, n0): the range of k pairs a tile sums.
template <typename Cols, typename Pairs>
void product(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C, int64_t ldc, int64_t M,
             Cols cols, Pairs pairs, bool add = false) {
  for (int64_t m0 = 0; m0 < M; m0 += R) {
    const int64_t n1 = cols(m0);
    const uint32_t* a = A + m0 * lda;
    float* c = C + m0 * ldc;
    for (int64_t n0 = 0; n0 < n1;) {
      const auto [q0, q1] = pairs(m0, n0);
      switch (std::min<int64_t>(4, (n1 - n0) / 16)) {
        case 4: tile<4>(a, lda, B + n0, ldb, q0, q1, c + n0, ldc, add); n0 += 64; break;
        case 3: tile<3>(a, lda, B + n0, ldb, q0, q1, c + n0, ldc, add); n0 += 48; break;
        case 2: tile<2>(a, lda, B + n0, ldb, q0, q1, c + n0, ldc, add); n0 += 32; break;
        default: tile<1>(a, lda, B + n0, ldb, q0, q1, c + n0, ldc, add); n0 += 16; break;
      }
    }
  }
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline uint32_t pair(uint16_t lo, uint16_t hi) { return lo | (static_cast<uint32_t>(hi) << 16); }
inline __m512 widen(const uint16_t* x) {  // 16 bf16 -> 16 fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
}
inline __m256i narrow(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // round to nearest even

inline __m512i words(__m256i lo, __m256i hi) {  // 16 bf16 of row 2p and of row 2p+1, paired by column
  return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

// out[c][r] = in[r][c] for a 16 x 16 block of 32-bit words, in registers: pairs of rows interleaved by
// 32 and then 64 bits give each 128-bit lane four rows of one column, and 128-bit lane shuffles put the
// lanes of a column together.
inline void transpose16(const uint32_t* in, int64_t ld_in, uint32_t* out, int64_t ld_out) {
  __m512i r[16], a[16], b[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in + i * ld_in);
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + j]: rows 4i..4i+3 of column 4L + j in lane L
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44), c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xEE);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44), c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
    _mm512_storeu_si512(out + j * ld_out, _mm512_shuffle_i32x4(c0, c2, 0x88));
    _mm512_storeu_si512(out + (4 + j) * ld_out, _mm512_shuffle_i32x4(c0, c2, 0xDD));
    _mm512_storeu_si512(out + (8 + j) * ld_out, _mm512_shuffle_i32x4(c1, c3, 0x88));
    _mm512_storeu_si512(out + (12 + j) * ld_out, _mm512_shuffle_i32x4(c1, c3, 0xDD));
  }
}

// out (cols x rows) = in (rows x cols) transposed, 32-bit words; rows and cols multiples of 16.
void transpose(const uint32_t* in, int64_t rows, int64_t cols, uint32_t* out) {
  for (int64_t r = 0; r < rows; r += 16)
    for (int64_t c = 0; c < cols; c += 16) transpose16(in + r * cols + c, cols, out + c * rows + r, rows);
}

// A head's rows (T x E, row stride `step` elements) as the products read them, Tp rows (zeros past T):
struct Rows {
  const uint16_t* x;
  int64_t step, T;
  const uint16_t* row(int64_t t) const { return x + t * step; }
};
// ... as A, row-major words: out[t][q] = (x[t][2q], x[t][2q+1])
void as_rows(const Rows& x, int64_t Tp, int64_t E, uint32_t* out) {
  for (int64_t t = 0; t < x.T; ++t) std::memcpy(out + t * (E / 2), x.row(t), E * 2);
  std::memset(out + x.T * (E / 2), 0, (Tp - x.T) * E * 2);
}
// ... as B of a product with x transposed: out[q][t] = (x[t][2q], x[t][2q+1]); `rows` holds as_rows(x)
// on the way.
void as_transposed(const Rows& x, int64_t Tp, int64_t E, uint32_t* rows, uint32_t* out) {
  as_rows(x, Tp, E, rows);
  transpose(rows, Tp, E / 2, out);
}
// ... as B of a product with x itself: out[p][e] = (x[2p][e], x[2p+1][e])
void as_pairs(const Rows& x, int64_t Tp, int64_t E, uint32_t* out) {
  const auto load = [&](int64_t t, int64_t e) {
    return t < x.T ? _mm256_loadu_si256((const __m256i*)(x.row(t) + e)) : _mm256_setzero_si256();
  };
  for (int64_t p = 0; p < Tp / 2; ++p)
    for (int64_t e = 0; e < E; e += 16) _mm512_storeu_si512(out + p * E + e, words(load(2 * p, e), load(2 * p + 1, e)));
}
// ... as A of a product with x transposed, pairs along t: out[e][p] = (x[2p][e], x[2p+1][e]); `pairs`
// holds as_pairs(x) on the way.
void as_transposed_pairs(const Rows& x, int64_t Tp, int64_t E, uint32_t* pairs, uint32_t* out) {
  as_pairs(x, Tp, E, pairs);
  transpose(pairs, Tp / 2, E, out);
}

inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, Sleef_expf16_u10(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, m, Sleef_expf16_u10(_mm512_maskz_loadu_ps(m, x + i)));
  }
}


inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// p[0..n) = softmax(s[0..n) * sc) in bf16, zeros on to `edge`; s is overwritten; returns the log of the sum
// of exp(s * sc), the row's logsumexp.
float softmax_row(float* s, int64_t n, float sc, uint16_t* p, int64_t edge) {
  const __m512 scale = _mm512_set1_ps(sc);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(n - j);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), scale);
    _mm512_mask_storeu_ps(s + j, m, x);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, x);
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(n - j);
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmx));
    _mm512_mask_storeu_ps(s + j, m, e);
    vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  int64_t j = 0;
  for (; j < n; j += 16)
    _mm256_mask_storeu_epi16(p + j, lanes(n - j), narrow(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(n - j), s + j), inv)));
  if (edge > n) std::memset(p + n, 0, (edge - n) * 2);  // also clears the tail lanes' neighbours
  return mx + std::log(sum);
}

struct Shape {
  int64_t B, H, KV, T, E, Tp;
};

void check(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kBFloat16 && x.stride(3) == 1, name,
              ": (B, heads, T, E) bf16 with contiguous rows");
}

// q (B, H, T, E); k and v (B, KV, T, E) with H a multiple of KV (grouped-query heads, in HF's repeat_kv
// order: query head h reads kv head h / (H / KV)) and E a multiple of 32.
Shape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check(q, "q");
  check(k, "k");
  check(v, "v");
  const int64_t B = q.size(0), H = q.size(1), KV = k.size(1), T = q.size(2), E = q.size(3);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == T && k.size(3) == E && H % KV == 0,
              "q, k, v: mismatched shapes");
  TORCH_CHECK(E % 32 == 0, "head dim must be a multiple of 32");
  return {B, H, KV, T, E, round_up(T, 64)};
}

const uint16_t* head(const at::Tensor& x, int64_t b, int64_t h) {
  return reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + b * x.stride(0) + h * x.stride(1);
}

}  // namespace

// q (B, H, T, E), k and v (B, KV, T, E), bf16, last dim contiguous, E % 32 == 0, H % KV == 0.
// Returns (o (B, H, T, E) over a (B, T, H, E) tensor, lse (B, H, T) float32).
std::tuple<at::Tensor, at::Tensor> causal_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  double scale) {
  const Shape s = shape_of(q, k, v);
  const int64_t G = s.H / s.KV, E = s.E, T = s.T, Tp = s.Tp;
  at::Tensor o = at::empty({s.B, T, s.H, E}, q.options());
  at::Tensor lse = at::empty({s.B, s.H, T}, q.options().dtype(at::kFloat));
  uint16_t* o_data = reinterpret_cast<uint16_t*>(o.data_ptr<at::BFloat16>());
  float* lse_data = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, s.B * s.KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> kt(E / 2 * Tp), vp(Tp / 2 * E), qa(Tp * E / 2);
    std::vector<float> S(QB * Tp), out(QB * E);
    std::vector<uint16_t> P(QB * Tp);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / s.KV, kvh = item % s.KV;
      as_transposed({head(k, b, kvh), k.stride(2), T}, Tp, E, qa.data(), kt.data());
      as_pairs({head(v, b, kvh), v.stride(2), T}, Tp, E, vp.data());
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        as_rows({head(q, b, h), q.stride(2), T}, Tp, E, qa.data());
        float* row_lse = lse_data + (b * s.H + h) * T;
        for (int64_t i0 = 0; i0 < T; i0 += QB) {  // QB queries at a time: their scores stay in L2
          // S = q k^T, the lower triangle to each row tile's edge
          product(qa.data() + i0 * E / 2, E / 2, kt.data(), Tp, S.data(), Tp, QB,
                  [&](int64_t m0) { return std::min(Tp, round_up(i0 + m0 + R, 16)); },
                  [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, E / 2); });
          for (int64_t r = 0; r < QB; ++r) {
            const int64_t i = i0 + r, edge = std::min(Tp, round_up(i + 1, 64));
            if (i < T) row_lse[i] = softmax_row(S.data() + r * Tp, i + 1, sc, P.data() + r * Tp, edge);
            else std::memset(P.data() + r * Tp, 0, edge * 2);
          }
          // o = P v
          product(reinterpret_cast<const uint32_t*>(P.data()), Tp / 2, vp.data(), E, out.data(), E, QB,
                  [&](int64_t) { return E; },
                  [&](int64_t m0, int64_t) { return std::pair<int64_t, int64_t>(0, std::min(Tp, round_up(i0 + m0 + R, 64)) / 2); });
          for (int64_t i = i0; i < std::min(T, i0 + QB); ++i)
            for (int64_t e = 0; e < E; e += 16)
              _mm256_storeu_si256((__m256i*)(o_data + ((b * T + i) * s.H + h) * E + e),
                                  narrow(_mm512_loadu_ps(out.data() + (i - i0) * E + e)));
        }
      }
    }
  });
  return {o.transpose(1, 2), lse};
}


namespace {

// Rows i and i + 1 of P = exp(S * sc - lse) and dS = P * (dP - D) * sc, zero past the diagonal and on to
// `edge`. S, dP and the outputs start at the two rows: dS row-major (ds_rows, rows Tp apart), P and dS as
// the pair of rows (p_pairs, ds_pairs: word j pairs column j of both).
void grad_rows(const float* S, const float* dP, int64_t Tp, int64_t i, int64_t T, const float* lse, const float* D,
               float sc, int64_t edge, uint16_t* ds_rows, uint32_t* p_pairs, uint32_t* ds_pairs) {
  const __m512 scale = _mm512_set1_ps(sc);
  for (int64_t j = 0; j < edge; j += 16) {
    __m256i p16[2], ds16[2];
    for (int r = 0; r < 2; ++r) {
      const int64_t n = i + r < T ? i + r + 1 : 0;
      if (j >= n) {
        p16[r] = ds16[r] = _mm256_setzero_si256();
        continue;
      }
      const __mmask16 m = lanes(n - j);
      const __m512 s = _mm512_maskz_loadu_ps(m, S + r * Tp + j);
      const __m512 p = _mm512_maskz_mov_ps(m, Sleef_expf16_u10(_mm512_fmsub_ps(s, scale, _mm512_set1_ps(lse[i + r]))));
      const __m512 dp = _mm512_maskz_loadu_ps(m, dP + r * Tp + j);
      const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(dp, _mm512_set1_ps(D[i + r]))), scale);
      p16[r] = narrow(p);
      ds16[r] = narrow(ds);
    }
    _mm256_storeu_si256((__m256i*)(ds_rows + j), ds16[0]);
    _mm256_storeu_si256((__m256i*)(ds_rows + Tp + j), ds16[1]);
    _mm512_storeu_si512(p_pairs + j, words(p16[0], p16[1]));
    _mm512_storeu_si512(ds_pairs + j, words(ds16[0], ds16[1]));
  }
}

// y[t][e] = bf16(x[e][t]) for t < T, e < E: x is (E, Tp) float32, y's rows `step` apart; `rows` holds x
// transposed on the way.
void store_transposed(const float* x, int64_t Tp, int64_t T, int64_t E, float* rows, uint16_t* y, int64_t step) {
  transpose(reinterpret_cast<const uint32_t*>(x), E, Tp, reinterpret_cast<uint32_t*>(rows));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; e += 16)
      _mm256_storeu_si256((__m256i*)(y + t * step + e), narrow(_mm512_loadu_ps(rows + t * E + e)));
}

inline float dot_bf16(const uint16_t* a, const uint16_t* b, int64_t n) {  // n % 16 == 0
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(widen(a + i), widen(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}
}  // namespace

// The gradients of causal_forward's q, k, v, given its o and lse and o's gradient do (B, H, T, E).
// Returns dq, dk, dv in the layout causal_forward returns o.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_backward(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& o,
                                                               const at::Tensor& lse, const at::Tensor& d_o,
                                                               double scale) {
  const Shape s = shape_of(q, k, v);
  check(o, "o");
  check(d_o, "grad");
  TORCH_CHECK(o.sizes() == q.sizes() && d_o.sizes() == q.sizes() && lse.numel() == s.B * s.H * s.T, "o, lse, grad: mismatched shapes");
  const int64_t G = s.H / s.KV, E = s.E, T = s.T, Tp = s.Tp;
  at::Tensor dq = at::empty({s.B, T, s.H, E}, q.options());
  at::Tensor dk = at::empty({s.B, T, s.KV, E}, q.options());
  at::Tensor dv = at::empty({s.B, T, s.KV, E}, q.options());
  const at::Tensor lse_c = lse.contiguous();
  const float* lse_data = lse_c.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  auto out = [](at::Tensor& x) { return reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>()); };
  uint16_t *dq_data = out(dq), *dk_data = out(dk), *dv_data = out(dv);
  at::parallel_for(0, s.B * s.KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> kt(E / 2 * Tp), vt(E / 2 * Tp), kp(Tp / 2 * E), qa(Tp * E / 2), da(Tp * E / 2),
        qtp(E * Tp / 2), dtp(E * Tp / 2), pairs(Tp / 2 * E), p_pairs(QB / 2 * Tp), ds_pairs(QB / 2 * Tp);
    std::vector<float> S(QB * Tp), dP(QB * Tp), dqf(QB * E), dkt(E * Tp), dvt(E * Tp), D(Tp), rows_t(Tp * E);
    std::vector<uint16_t> ds_rows(QB * Tp);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / s.KV, kvh = item % s.KV;
      const Rows K{head(k, b, kvh), k.stride(2), T}, V{head(v, b, kvh), v.stride(2), T};
      as_transposed(K, Tp, E, qa.data(), kt.data());
      as_transposed(V, Tp, E, qa.data(), vt.data());
      as_pairs(K, Tp, E, kp.data());
      std::fill(dkt.begin(), dkt.end(), 0.f);
      std::fill(dvt.begin(), dvt.end(), 0.f);
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        const Rows Q{head(q, b, h), q.stride(2), T}, dO{head(d_o, b, h), d_o.stride(2), T};
        const uint16_t* O = head(o, b, h);
        as_rows(Q, Tp, E, qa.data());
        as_rows(dO, Tp, E, da.data());
        as_transposed_pairs(Q, Tp, E, pairs.data(), qtp.data());
        as_transposed_pairs(dO, Tp, E, pairs.data(), dtp.data());
        for (int64_t i = 0; i < T; ++i) D[i] = dot_bf16(dO.row(i), O + i * o.stride(2), E);
        const float* row_lse = lse_data + (b * s.H + h) * T;
        for (int64_t i0 = 0; i0 < T; i0 += QB) {  // QB queries at a time: their scores stay in L2
          const int64_t cols = std::min(Tp, i0 + QB);  // the keys these queries see, and zeros to a tile's edge
          const auto causal = [&](int64_t m0) { return std::min(Tp, round_up(i0 + m0 + R, 16)); };
          const auto all_e = [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, E / 2); };
          product(qa.data() + i0 * E / 2, E / 2, kt.data(), Tp, S.data(), Tp, QB, causal, all_e);
          product(da.data() + i0 * E / 2, E / 2, vt.data(), Tp, dP.data(), Tp, QB, causal, all_e);
          for (int64_t r = 0; r < QB; r += 2)
            grad_rows(S.data() + r * Tp, dP.data() + r * Tp, Tp, i0 + r, T, row_lse, D.data(), sc, cols,
                      ds_rows.data() + r * Tp, p_pairs.data() + r / 2 * Tp, ds_pairs.data() + r / 2 * Tp);
          // dq = dS k
          product(reinterpret_cast<const uint32_t*>(ds_rows.data()), Tp / 2, kp.data(), E, dqf.data(), E, QB,
                  [&](int64_t) { return E; }, [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, cols / 2); });
          for (int64_t i = i0; i < std::min(T, i0 + QB); ++i)
            for (int64_t e = 0; e < E; e += 16)
              _mm256_storeu_si256((__m256i*)(dq_data + ((b * T + i) * s.H + h) * E + e),
                                  narrow(_mm512_loadu_ps(dqf.data() + (i - i0) * E + e)));
          // dk^T += q^T dS, dv^T += dO^T P over these queries, for the keys they see
          const auto block = [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, QB / 2); };
          const auto seen = [&](int64_t) { return cols; };
          product(qtp.data() + i0 / 2, Tp / 2, ds_pairs.data(), Tp, dkt.data(), Tp, E, seen, block, true);
          product(dtp.data() + i0 / 2, Tp / 2, p_pairs.data(), Tp, dvt.data(), Tp, E, seen, block, true);
        }
      }
      store_transposed(dkt.data(), Tp, T, E, rows_t.data(), dk_data + (b * T * s.KV + kvh) * E, s.KV * E);
      store_transposed(dvt.data(), Tp, T, E, rows_t.data(), dv_data + (b * T * s.KV + kvh) * E, s.KV * E);
    }
  });
  return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
}

TORCH_LIBRARY(phalanx_attention, m) {
  m.def("causal_forward(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)");
  m.def("causal_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor grad, float scale) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(phalanx_attention, CPU, m) { m.impl("causal_forward", causal_forward);
  m.impl("causal_backward", causal_backward);
}
