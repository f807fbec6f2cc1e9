// Causal self-attention, forward and backward, for a training step on a CPU with AVX-512, in bf16 (with
// avx512_bf16) or float32 (models/cpu_attention.py says when it is used and why).
//
// torch's CPU flash attention runs its block products through MKL's GEMM. In bf16, on a CPU without AMX,
// that reaches about half of what oneDNN's products do (92 against 204 GFLOP/s a core on a 256 x 256 x 64
// block, measured on the EPYC of BENCHMARKS.md), so a bf16 step attended slower than a float32 one. Here
// every product is register tiles of float32 accumulators (vdpbf16ps on bf16 pairs, or vfmadd on
// float32), 64 queries at a time over the causal triangle's rows, so that a block's scores and gradients
// stay in its core's L2.
//
// Given RoPE's tables, it takes q and k unrotated and rotates them as it packs them (rounded once to the
// element type), and turns their gradients back the same way: RoPE's own passes over q, k and their
// gradients go.
//
// Numerics follow torch's flash kernel: scores, softmax, logsumexp and the gradient's row sums in float32;
// in bf16 the probabilities and dS are rounded (to nearest even) for the products that read them. Each
// (batch, kv head) item is computed by one thread in a fixed order, so results do not depend on the
// thread count.
//
// Words: a product C = A . B reads A and B as 32-bit words, W elements of consecutive k each: two bf16
// values (what vdpbf16ps multiplies in pairs), or one float32. Tp is T rounded up to 64; rows and keys
// past T are zeros.
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
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int R = 4;        // rows per tile: R x 4 accumulators of 16 lanes
constexpr int64_t QB = 64;  // queries per block: a block's scores and their gradients stay in L2

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }
inline __m256i narrow(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // round to nearest even
inline __m512i words(__m256i lo, __m256i hi) {  // 16 bf16 of row 2p and of row 2p+1, paired by column
  return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

// W elements per word: the element type and its 16-lane loads and stores through float32.
template <int W>
struct Elem;
template <>
struct Elem<2> {
  using T = uint16_t;  // bf16
  static __m512 load(const T* x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
  }
  static void store(T* y, __m512 v, __mmask16 m = 0xFFFF) { _mm256_mask_storeu_epi16(y, m, narrow(v)); }
};
template <>
struct Elem<1> {
  using T = float;
  static __m512 load(const T* x) { return _mm512_loadu_ps(x); }
  static void store(T* y, __m512 v, __mmask16 m = 0xFFFF) { _mm512_mask_storeu_ps(y, m, v); }
};

// C[r][0..16*NV) (+)= sum over k in [k0, k1) of A[r][k] * B[k][...], words of W elements.
template <int W, int NV>
void tile(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, int64_t k0, int64_t k1, float* C,
          int64_t ldc, bool add) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    const uint32_t* b = B + k * ldb;
    __m512i bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_si512(b + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(A[r * lda + k]));
      for (int j = 0; j < NV; ++j) {
        if constexpr (W == 2)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)a, (__m512bh)bv[j]);
        else
          acc[r][j] = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(bv[j]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) {
      float* c = C + r * ldc + 16 * j;
      _mm512_storeu_ps(c, add ? _mm512_add_ps(_mm512_loadu_ps(c), acc[r][j]) : acc[r][j]);
    }
}

// C (M x cols) (+)= A (M x words) . B (words x N), rows R at a time. cols(m0): the columns a row block
// needs (a multiple of 16); steps(m0, n0): the range of k words a tile sums.
template <int W, typename Cols, typename Steps>
void product(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C, int64_t ldc, int64_t M,
             Cols cols, Steps steps, bool add = false) {
  for (int64_t m0 = 0; m0 < M; m0 += R) {
    const int64_t n1 = cols(m0);
    const uint32_t* a = A + m0 * lda;
    float* c = C + m0 * ldc;
    for (int64_t n0 = 0; n0 < n1;) {
      const auto [k0, k1] = steps(m0, n0);
      switch (std::min<int64_t>(4, (n1 - n0) / 16)) {
        case 4: tile<W, 4>(a, lda, B + n0, ldb, k0, k1, c + n0, ldc, add); n0 += 64; break;
        case 3: tile<W, 3>(a, lda, B + n0, ldb, k0, k1, c + n0, ldc, add); n0 += 48; break;
        case 2: tile<W, 2>(a, lda, B + n0, ldb, k0, k1, c + n0, ldc, add); n0 += 32; break;
        default: tile<W, 1>(a, lda, B + n0, ldb, k0, k1, c + n0, ldc, add); n0 += 16; break;
      }
    }
  }
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
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
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
template <int W>
struct Rows {
  using T = typename Elem<W>::T;
  const T* x;
  int64_t step, T_;
  const T* row(int64_t t) const { return x + t * step; }

  // ... as A, row-major: out[t][E / W words]
  void as_rows(int64_t Tp, int64_t E, uint32_t* out) const {
    for (int64_t t = 0; t < T_; ++t) std::memcpy(out + t * (E / W), row(t), E * sizeof(T));
    std::memset(out + T_ * (E / W), 0, (Tp - T_) * E * sizeof(T));
  }
  // ... as B of a product with x transposed: out[E / W][Tp]; `rows` holds as_rows on the way.
  void as_transposed(int64_t Tp, int64_t E, uint32_t* rows, uint32_t* out) const {
    as_rows(Tp, E, rows);
    transpose(rows, Tp, E / W, out);
  }
  // ... as B of a product with x itself, k along t: out[Tp / W][E]. bf16: word e of row p pairs x[2p][e]
  // and x[2p+1][e].
  void as_steps(int64_t Tp, int64_t E, uint32_t* out) const {
    if constexpr (W == 1) {
      as_rows(Tp, E, out);
    } else {
      const auto load = [&](int64_t t, int64_t e) {
        return t < T_ ? _mm256_loadu_si256((const __m256i*)(row(t) + e)) : _mm256_setzero_si256();
      };
      for (int64_t p = 0; p < Tp / 2; ++p)
        for (int64_t e = 0; e < E; e += 16) _mm512_storeu_si512(out + p * E + e, words(load(2 * p, e), load(2 * p + 1, e)));
    }
  }
  // ... as A of a product with x transposed, k along t: out[E][Tp / W]; `steps` holds as_steps on the way.
  void as_transposed_steps(int64_t Tp, int64_t E, uint32_t* steps, uint32_t* out) const {
    as_steps(Tp, E, steps);
    transpose(steps, Tp / W, E, out);
  }
};

// RoPE in rotate_half's layout (models/rope.py): tables (T, E) in the element type, rotate_half's minus
// sign on the first half of sin, so that rotated x[e] = x[e] cos[e] + x[e +- E/2] signed_sin[e], computed
// in float32 and rounded once. Without tables (cos null) nothing is rotated.
template <int W>
struct Rope {
  using T = typename Elem<W>::T;
  const T* cos = nullptr;
  const T* sin = nullptr;

  // x's rows rotated, as as_rows lays them out: out[Tp][E], zeros past T.
  void rows(const Rows<W>& x, int64_t Tp, int64_t E, uint32_t* out) const {
    if (cos == nullptr) return x.as_rows(Tp, E, out);
    T* y = reinterpret_cast<T*>(out);
    const int64_t half = E / 2;
    for (int64_t t = 0; t < x.T_; ++t) {
      const T *r = x.row(t), *c = cos + t * E, *s = sin + t * E;
      for (int64_t e = 0; e < half; e += 16) {
        const __m512 a = Elem<W>::load(r + e), b = Elem<W>::load(r + e + half);
        Elem<W>::store(y + t * E + e, _mm512_fmadd_ps(a, Elem<W>::load(c + e), _mm512_mul_ps(b, Elem<W>::load(s + e))));
        Elem<W>::store(y + t * E + e + half,
                       _mm512_fmadd_ps(b, Elem<W>::load(c + e + half), _mm512_mul_ps(a, Elem<W>::load(s + e + half))));
      }
    }
    std::memset(y + x.T_ * E, 0, (Tp - x.T_) * E * sizeof(T));
  }
  // Row t's gradient for the unrotated x from the rotated one's, g (E float32), in place:
  // dx = g cos + swap_halves(g signed_sin).
  void unrotate(float* g, int64_t t, int64_t E) const {
    if (cos == nullptr) return;
    const T *c = cos + t * E, *s = sin + t * E;
    const int64_t half = E / 2;
    for (int64_t e = 0; e < half; e += 16) {
      const __m512 ga = _mm512_loadu_ps(g + e), gb = _mm512_loadu_ps(g + e + half);
      _mm512_storeu_ps(g + e, _mm512_fmadd_ps(ga, Elem<W>::load(c + e), _mm512_mul_ps(gb, Elem<W>::load(s + e + half))));
      _mm512_storeu_ps(g + e + half,
                       _mm512_fmadd_ps(gb, Elem<W>::load(c + e + half), _mm512_mul_ps(ga, Elem<W>::load(s + e))));
    }
  }
};

// p[0..n) = softmax(s[0..n) * sc), zeros on to `edge`; s is overwritten; returns the row's logsumexp.
template <int W>
float softmax_row(float* s, int64_t n, float sc, typename Elem<W>::T* p, int64_t edge) {
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
  for (int64_t j = 0; j < n; j += 16)
    Elem<W>::store(p + j, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(n - j), s + j), inv), lanes(n - j));
  if (edge > n) std::memset(p + n, 0, (edge - n) * sizeof(p[0]));
  return mx + std::log(sum);
}

// Rows i and i + 1 of P = exp(S * sc - lse) and dS = P * (dP - D) * sc, zero past the diagonal and on to
// `edge`. S, dP and the outputs start at the two rows: dS row-major (ds_rows, rows Tp apart), and P and dS
// as B operands with k along the queries (p_steps, ds_steps: bf16 pairs the two rows in each word).
template <int W>
void grad_rows(const float* S, const float* dP, int64_t Tp, int64_t i, int64_t T, const float* lse, const float* D,
               float sc, int64_t edge, typename Elem<W>::T* ds_rows, uint32_t* p_steps, uint32_t* ds_steps) {
  const __m512 scale = _mm512_set1_ps(sc);
  for (int64_t j = 0; j < edge; j += 16) {
    __m512 p[2], ds[2];
    for (int r = 0; r < 2; ++r) {
      const int64_t n = i + r < T ? i + r + 1 : 0;
      if (j >= n) {
        p[r] = ds[r] = _mm512_setzero_ps();
        continue;
      }
      const __mmask16 m = lanes(n - j);
      const __m512 s = _mm512_maskz_loadu_ps(m, S + r * Tp + j);
      p[r] = _mm512_maskz_mov_ps(m, Sleef_expf16_u10(_mm512_fmsub_ps(s, scale, _mm512_set1_ps(lse[i + r]))));
      const __m512 dp = _mm512_maskz_loadu_ps(m, dP + r * Tp + j);
      ds[r] = _mm512_mul_ps(_mm512_mul_ps(p[r], _mm512_sub_ps(dp, _mm512_set1_ps(D[i + r]))), scale);
    }
    for (int r = 0; r < 2; ++r) Elem<W>::store(ds_rows + r * Tp + j, ds[r]);
    if constexpr (W == 2) {
      _mm512_storeu_si512(p_steps + j, words(narrow(p[0]), narrow(p[1])));
      _mm512_storeu_si512(ds_steps + j, words(narrow(ds[0]), narrow(ds[1])));
    } else {
      for (int r = 0; r < 2; ++r) {
        _mm512_storeu_ps(reinterpret_cast<float*>(p_steps) + r * Tp + j, p[r]);
        _mm512_storeu_ps(reinterpret_cast<float*>(ds_steps) + r * Tp + j, ds[r]);
      }
    }
  }
}

template <int W>
float dot(const typename Elem<W>::T* a, const typename Elem<W>::T* b, int64_t n) {  // n % 16 == 0
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(Elem<W>::load(a + i), Elem<W>::load(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

// y[t][e] = x[e][t] for t < T, e < E, rope's gradient rotation undone on each row: x is (E, Tp) float32,
// y's rows `step` apart; `rows` holds x transposed on the way.
template <int W>
void store_transposed(const float* x, int64_t Tp, int64_t T, int64_t E, const Rope<W>& rope, float* rows,
                      typename Elem<W>::T* y, int64_t step) {
  transpose(reinterpret_cast<const uint32_t*>(x), E, Tp, reinterpret_cast<uint32_t*>(rows));
  for (int64_t t = 0; t < T; ++t) {
    rope.unrotate(rows + t * E, t, E);
    for (int64_t e = 0; e < E; e += 16) Elem<W>::store(y + t * step + e, _mm512_loadu_ps(rows + t * E + e));
  }
}

struct Shape {
  int64_t B, H, KV, T, E, Tp;
};

void check(const at::Tensor& x, const at::Tensor& q, const char* name) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == q.scalar_type() && x.stride(3) == 1, name,
              ": (B, heads, T, E) of q's dtype with contiguous rows");
}

// q (B, H, T, E); k and v (B, KV, T, E) with H a multiple of KV (grouped-query heads, in HF's repeat_kv
// order: query head h reads kv head h / (H / KV)) and E a multiple of 32; bf16 or float32.
Shape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "q: bf16 or float32");
  check(q, q, "q");
  check(k, q, "k");
  check(v, q, "v");
  const int64_t B = q.size(0), H = q.size(1), KV = k.size(1), T = q.size(2), E = q.size(3);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == T && k.size(3) == E && H % KV == 0,
              "q, k, v: mismatched shapes");
  TORCH_CHECK(E % 32 == 0, "head dim must be a multiple of 32");
  return {B, H, KV, T, E, round_up(T, 64)};
}

template <int W>
Rows<W> head(const at::Tensor& x, int64_t b, int64_t h) {
  using T = typename Elem<W>::T;
  return {static_cast<const T*>(x.data_ptr()) + b * x.stride(0) + h * x.stride(1), x.stride(2), x.size(2)};
}

template <int W>
typename Elem<W>::T* data(at::Tensor& x) {
  return static_cast<typename Elem<W>::T*>(x.data_ptr());
}

template <int W>
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float sc, const Rope<W>& rope,
             const Shape& s, at::Tensor& o, at::Tensor& lse) {
  using T = typename Elem<W>::T;
  const int64_t G = s.H / s.KV, E = s.E, Tp = s.Tp;
  T* o_data = data<W>(o);
  float* lse_data = lse.data_ptr<float>();
  at::parallel_for(0, s.B * s.KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> kt(E / W * Tp), vs(Tp / W * E), qa(Tp * E / W), P(QB * Tp / W);
    std::vector<float> S(QB * Tp), out(QB * E);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / s.KV, kvh = item % s.KV;
      rope.rows(head<W>(k, b, kvh), Tp, E, qa.data());
      transpose(qa.data(), Tp, E / W, kt.data());
      head<W>(v, b, kvh).as_steps(Tp, E, vs.data());
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        rope.rows(head<W>(q, b, h), Tp, E, qa.data());
        float* row_lse = lse_data + (b * s.H + h) * s.T;
        for (int64_t i0 = 0; i0 < s.T; i0 += QB) {
          // S = q k^T, the lower triangle to each row tile's edge
          product<W>(qa.data() + i0 * E / W, E / W, kt.data(), Tp, S.data(), Tp, QB,
                     [&](int64_t m0) { return std::min(Tp, round_up(i0 + m0 + R, 16)); },
                     [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, E / W); });
          T* p = reinterpret_cast<T*>(P.data());
          for (int64_t r = 0; r < QB; ++r) {
            const int64_t i = i0 + r, edge = std::min(Tp, round_up(i + 1, 64));
            if (i < s.T) row_lse[i] = softmax_row<W>(S.data() + r * Tp, i + 1, sc, p + r * Tp, edge);
            else std::memset(p + r * Tp, 0, edge * sizeof(T));
          }
          // o = P v
          product<W>(P.data(), Tp / W, vs.data(), E, out.data(), E, QB, [&](int64_t) { return E; },
                     [&](int64_t m0, int64_t) { return std::pair<int64_t, int64_t>(0, std::min(Tp, round_up(i0 + m0 + R, 64)) / W); });
          for (int64_t i = i0; i < std::min(s.T, i0 + QB); ++i)
            for (int64_t e = 0; e < E; e += 16)
              Elem<W>::store(o_data + ((b * s.T + i) * s.H + h) * E + e, _mm512_loadu_ps(out.data() + (i - i0) * E + e));
        }
      }
    }
  });
}

template <int W>
void backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
              const at::Tensor& lse, const at::Tensor& d_o, float sc, const Rope<W>& rope, const Shape& s,
              at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  using T = typename Elem<W>::T;
  const int64_t G = s.H / s.KV, E = s.E, Tp = s.Tp;
  const float* lse_data = lse.data_ptr<float>();
  T *dq_data = data<W>(dq), *dk_data = data<W>(dk), *dv_data = data<W>(dv);
  at::parallel_for(0, s.B * s.KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> kt(E / W * Tp), vt(E / W * Tp), ks(Tp / W * E), ka(Tp * E / W), qa(Tp * E / W), da(Tp * E / W),
        qts(E * Tp / W), dts(E * Tp / W), steps(Tp / W * E), p_steps(QB / W * Tp), ds_steps(QB / W * Tp),
        ds_rows(QB * Tp / W);
    std::vector<float> S(QB * Tp), dP(QB * Tp), dqf(QB * E), dkt(E * Tp), dvt(E * Tp), D(Tp), rows_t(Tp * E);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / s.KV, kvh = item % s.KV;
      rope.rows(head<W>(k, b, kvh), Tp, E, ka.data());  // k as the products read it: rotated
      const Rows<W> K{reinterpret_cast<const T*>(ka.data()), E, s.T};
      transpose(ka.data(), Tp, E / W, kt.data());
      K.as_steps(Tp, E, ks.data());
      head<W>(v, b, kvh).as_transposed(Tp, E, qa.data(), vt.data());
      std::fill(dkt.begin(), dkt.end(), 0.f);
      std::fill(dvt.begin(), dvt.end(), 0.f);
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        rope.rows(head<W>(q, b, h), Tp, E, qa.data());
        const Rows<W> Q{reinterpret_cast<const T*>(qa.data()), E, s.T}, dO = head<W>(d_o, b, h), O = head<W>(o, b, h);
        dO.as_rows(Tp, E, da.data());
        Q.as_transposed_steps(Tp, E, steps.data(), qts.data());
        dO.as_transposed_steps(Tp, E, steps.data(), dts.data());
        for (int64_t i = 0; i < s.T; ++i) D[i] = dot<W>(dO.row(i), O.row(i), E);
        const float* row_lse = lse_data + (b * s.H + h) * s.T;
        for (int64_t i0 = 0; i0 < s.T; i0 += QB) {  // QB queries at a time
          const int64_t cols = std::min(Tp, i0 + QB);  // the keys these queries see, and zeros to a tile's edge
          const auto causal = [&](int64_t m0) { return std::min(Tp, round_up(i0 + m0 + R, 16)); };
          const auto all_e = [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, E / W); };
          product<W>(qa.data() + i0 * E / W, E / W, kt.data(), Tp, S.data(), Tp, QB, causal, all_e);
          product<W>(da.data() + i0 * E / W, E / W, vt.data(), Tp, dP.data(), Tp, QB, causal, all_e);
          T* dsr = reinterpret_cast<T*>(ds_rows.data());
          for (int64_t r = 0; r < QB; r += 2)
            grad_rows<W>(S.data() + r * Tp, dP.data() + r * Tp, Tp, i0 + r, s.T, row_lse, D.data(), sc, cols,
                         dsr + r * Tp, p_steps.data() + r / W * Tp, ds_steps.data() + r / W * Tp);
          // dq = dS k
          product<W>(ds_rows.data(), Tp / W, ks.data(), E, dqf.data(), E, QB, [&](int64_t) { return E; },
                     [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, cols / W); });
          for (int64_t i = i0; i < std::min(s.T, i0 + QB); ++i) {
            float* row = dqf.data() + (i - i0) * E;
            rope.unrotate(row, i, E);
            for (int64_t e = 0; e < E; e += 16)
              Elem<W>::store(dq_data + ((b * s.T + i) * s.H + h) * E + e, _mm512_loadu_ps(row + e));
          }
          // dk^T += q^T dS, dv^T += dO^T P over these queries, for the keys they see
          const auto block = [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, QB / W); };
          const auto seen = [&](int64_t) { return cols; };
          product<W>(qts.data() + i0 / W, Tp / W, ds_steps.data(), Tp, dkt.data(), Tp, E, seen, block, true);
          product<W>(dts.data() + i0 / W, Tp / W, p_steps.data(), Tp, dvt.data(), Tp, E, seen, block, true);
        }
      }
      store_transposed<W>(dkt.data(), Tp, s.T, E, rope, rows_t.data(), dk_data + (b * s.T * s.KV + kvh) * E, s.KV * E);
      store_transposed<W>(dvt.data(), Tp, s.T, E, Rope<W>{}, rows_t.data(), dv_data + (b * s.T * s.KV + kvh) * E, s.KV * E);
    }
  });
}

// The tables, where given: (T, E) in q's dtype, contiguous.
template <int W>
Rope<W> rope_of(const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin, const at::Tensor& q) {
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and signed_sin come together");
  if (!cos) return {};
  for (const at::Tensor* table : {&*cos, &*sin})
    TORCH_CHECK(table->dim() == 2 && table->size(0) == q.size(2) && table->size(1) == q.size(3) &&
                    table->scalar_type() == q.scalar_type() && table->is_contiguous(),
                "RoPE tables: (T, E) of q's dtype, contiguous");
  using T = typename Elem<W>::T;
  return {static_cast<const T*>(cos->data_ptr()), static_cast<const T*>(sin->data_ptr())};
}

}  // namespace

// q (B, H, T, E), k and v (B, KV, T, E) (see shape_of); with RoPE's tables, q and k before their rotation
// (Rope). Returns o (B, H, T, E) over a (B, T, H, E) tensor, and lse (B, H, T) float32.
std::tuple<at::Tensor, at::Tensor> causal_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  double scale, const std::optional<at::Tensor>& cos,
                                                  const std::optional<at::Tensor>& signed_sin) {
  const Shape s = shape_of(q, k, v);
  at::Tensor o = at::empty({s.B, s.T, s.H, s.E}, q.options());
  at::Tensor lse = at::empty({s.B, s.H, s.T}, q.options().dtype(at::kFloat));
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16) forward<2>(q, k, v, sc, rope_of<2>(cos, signed_sin, q), s, o, lse);
  else forward<1>(q, k, v, sc, rope_of<1>(cos, signed_sin, q), s, o, lse);
  return {o.transpose(1, 2), lse};
}

// The gradients of causal_forward's q, k, v (unrotated, where it had tables), given its o and lse and o's
// gradient (B, H, T, E). Returns dq, dk, dv in the layout causal_forward returns o.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_backward(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& o,
                                                               const at::Tensor& lse, const at::Tensor& d_o,
                                                               double scale, const std::optional<at::Tensor>& cos,
                                                               const std::optional<at::Tensor>& signed_sin) {
  const Shape s = shape_of(q, k, v);
  check(o, q, "o");
  check(d_o, q, "grad");
  TORCH_CHECK(o.sizes() == q.sizes() && d_o.sizes() == q.sizes() && lse.numel() == s.B * s.H * s.T,
              "o, lse, grad: mismatched shapes");
  const at::Tensor lse_c = lse.contiguous();
  at::Tensor dq = at::empty({s.B, s.T, s.H, s.E}, q.options());
  at::Tensor dk = at::empty({s.B, s.T, s.KV, s.E}, q.options());
  at::Tensor dv = at::empty({s.B, s.T, s.KV, s.E}, q.options());
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16)
    backward<2>(q, k, v, o, lse_c, d_o, sc, rope_of<2>(cos, signed_sin, q), s, dq, dk, dv);
  else
    backward<1>(q, k, v, o, lse_c, d_o, sc, rope_of<1>(cos, signed_sin, q), s, dq, dk, dv);
  return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
}

TORCH_LIBRARY(phalanx_attention, m) {
  m.def(
      "causal_forward(Tensor q, Tensor k, Tensor v, float scale, Tensor? cos=None, Tensor? signed_sin=None) -> "
      "(Tensor, Tensor)");
  m.def(
      "causal_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor grad, float scale, Tensor? cos=None, "
      "Tensor? signed_sin=None) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(phalanx_attention, CPU, m) {
  m.impl("causal_forward", causal_forward);
  m.impl("causal_backward", causal_backward);
}
