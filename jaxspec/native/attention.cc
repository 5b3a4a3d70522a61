// Attention for a few query rows per slot on XLA:CPU through XLA's FFI (jaxspec/native/__init__.py),
// with results that depend on nothing but the row's own query and the keys and values it sees.
//
//   out[b, t, h] = sum_c softmax_c(q[b, t, h] . k[b, c, h / G] * scale) v[b, c, h / G]
//   q: [B, T, H, D], k and v: [B, S, Hkv, D] float32 (G = H / Hkv), kv_len: [B] int32,
//   offset: [] int32, mask: [B, T, W] uint8 (W = 0: causal), out: [B, T, H, D] float32
//
// Which columns c a row sees (as jaxspec/attention.py states them): with rel = c - kv_len[b],
//   rel < 0 (the committed prefix), or the local region: rel <= offset + t when causal (W = 0),
//   else 0 <= rel < W and mask[b, t, rel]; with a sliding window, only c > kv_len + offset + t - window.
//
// Why a kernel: XLA:CPU's reductions, dots and exponentials round differently with the shapes
// around them (the buffer's length, the other rows of the call, how a fusion vectorises), so a
// token's logits in a verification pass could differ in the last bit from the plain decoding step's,
// and where activations are then rounded to integers (GGUF, w8a8) such a bit can flip a near tie.
// Here a row's visible columns are listed in order, and every sum runs over that list in the same
// steps, whatever the buffer's length S, the row count T, the other rows or the thread: plain
// decoding and speculative verification see the same list for the same token (its prefix, then its
// ancestors in order) and compute bitwise the same output. The exponential is one fixed
// polynomial (Exp8), run on groups of 8 scores, the last group padded.
// Where the CPU has AVX2 and FMA (compiled with -march=native), a row's scores are computed 8 columns
// at a time in vectors (RowVec): each column's dot product in 8 lanes by fused multiply-adds, the 8
// columns' lanes summed by one fixed tree of adds, the weighted values summed in registers. Every
// row takes that same path on such a machine, so the guarantees above hold on either path.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// exp(x) for 8 values, x <= 0 (scores minus the row's max), by the same operations on every path:
// x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, 2^n from the exponent bits.
// Below -87.3 the result is 0 (as float32's exp underflows there, near enough for weights).
inline void Exp8(const float* x, float* y) {
  for (int i = 0; i < 8; ++i) {
    const float v = std::max(x[i], -87.3f);
    const float n = std::nearbyint(v * 1.44269504088896341f);
    const float r = (v - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = (int32_t(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    y[i] = x[i] < -87.3f ? 0.0f : p * scale;
  }
}

inline float Sum8(const float* lane) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// q . k over D, in 8 running sums (lane i takes d = i, i + 8, ...) added in a fixed order.
inline float Dot(const float* q, const float* k, int d) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= d; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] += q[i + j] * k[i + j];
  for (int j = 0; i < d; ++i, ++j) lane[j] += q[i] * k[i];
  return Sum8(lane);
}

struct Shape {
  int64_t b, t, h, d, s, hkv, w;
  int32_t window;
  float scale;
};

// The visible columns of (slot bi, row ti), in order: the committed prefix, then the local region's.
void Columns(const Shape& sh, const int32_t* kv_len, int32_t offset, const uint8_t* mask, int64_t bi, int64_t ti,
             std::vector<int32_t>& cols) {
  const int64_t len = std::min<int64_t>(kv_len[bi], sh.s);
  // with a sliding window, only c > kv_len + offset + t - window
  const int64_t first = sh.window > 0 ? std::max<int64_t>(0, kv_len[bi] + offset + ti - sh.window + 1) : 0;
  cols.clear();
  for (int64_t c = first; c < len; ++c) cols.push_back(int32_t(c));  // rel < 0: every column
  for (int64_t c = std::max(len, first); c < sh.s; ++c) {
    const int64_t rel = c - kv_len[bi];
    const bool vis = sh.w == 0 ? rel <= offset + ti : rel < sh.w && mask[(bi * sh.t + ti) * sh.w + rel] != 0;
    if (vis) cols.push_back(int32_t(c));
  }
}

// One (slot, row, KV head) over the row's visible columns `cols`: for each of the G query heads on
// that KV head their scores, their weights and the weighted sum of the values.
void Row(const Shape& sh, const float* q, const float* k, const float* v, float* out, int64_t bi, int64_t ti,
         int64_t kh, const std::vector<int32_t>& cols, std::vector<float>& score) {
  const int64_t d = sh.d, g = sh.h / sh.hkv;
  const int64_t n = int64_t(cols.size()), padded = (n + 7) / 8 * 8;
  score.resize(padded);
  for (int64_t hi = kh * g; hi < (kh + 1) * g; ++hi) {
    float* o = out + ((bi * sh.t + ti) * sh.h + hi) * d;
    std::fill(o, o + d, 0.0f);
    if (n == 0) continue;
    const float* qr = q + ((bi * sh.t + ti) * sh.h + hi) * d;
    float top = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
      score[i] = Dot(qr, k + ((bi * sh.s + cols[i]) * sh.hkv + kh) * d, int(d)) * sh.scale;
      top = std::max(top, score[i]);
    }
    for (int64_t i = 0; i < padded; ++i) score[i] = i < n ? score[i] - top : -INFINITY;
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < padded; i += 8) {
      Exp8(&score[i], &score[i]);
      for (int j = 0; j < 8; ++j) lane[j] += score[i + j];
    }
    const float l = Sum8(lane);
    for (int64_t i = 0; i < n; ++i) {
      const float p = score[i];
      const float* vr = v + ((bi * sh.s + cols[i]) * sh.hkv + kh) * d;
      for (int64_t j = 0; j < d; ++j) o[j] += p * vr[j];
    }
    const float inv = 1.0f / l;
    for (int64_t j = 0; j < d; ++j) o[j] *= inv;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Exp8 on a vector: the same reduction and polynomial, by fused multiply-adds; 0 below -87.3
// (the padding's -inf included).
inline __m256 Exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 v = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), v));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), _mm256_cmp_ps(x, lo, _CMP_GE_OQ));
}

// Lane c of the result: the sum of a[c]'s 8 lanes, as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline __m256 Sum8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float Sum8(__m256 v) {
  alignas(32) float lane[8];
  _mm256_store_ps(lane, v);
  return Sum8(lane);
}

// Row (below) in vectors, for D a multiple of 8. Scores 8 columns at a time (the last group
// repeating the last column, its scores then set to -inf); the weighted sum of the values over the
// columns in order, 64 dimensions at a time in registers.
void RowVec(const Shape& sh, const float* q, const float* k, const float* v, float* out, int64_t bi, int64_t ti,
            int64_t kh, const std::vector<int32_t>& cols, std::vector<float>& score) {
  const int64_t d = sh.d, g = sh.h / sh.hkv, stride = sh.hkv * d;
  const int64_t n = int64_t(cols.size()), padded = (n + 7) / 8 * 8;
  score.resize(padded);
  const float* kbase = k + (bi * sh.s * sh.hkv + kh) * d;
  const float* vbase = v + (bi * sh.s * sh.hkv + kh) * d;
  const __m256 scale = _mm256_set1_ps(sh.scale);
  for (int64_t hi = kh * g; hi < (kh + 1) * g; ++hi) {
    float* o = out + ((bi * sh.t + ti) * sh.h + hi) * d;
    if (n == 0) {
      std::fill(o, o + d, 0.0f);
      continue;
    }
    const float* qr = q + ((bi * sh.t + ti) * sh.h + hi) * d;
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t c0 = 0; c0 < padded; c0 += 8) {
      const float* kr[8];
      for (int c = 0; c < 8; ++c) kr[c] = kbase + int64_t(cols[std::min(c0 + c, n - 1)]) * stride;
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qr + i);
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[c] + i), acc[c]);
      }
      __m256 s = _mm256_mul_ps(Sum8x8(acc), scale);
      if (c0 + 8 > n) {  // the padding
        const __m256 idx = _mm256_add_ps(_mm256_set1_ps(float(c0)), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
        s = _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), _mm256_cmp_ps(idx, _mm256_set1_ps(float(n)), _CMP_GE_OQ));
      }
      top = _mm256_max_ps(top, s);
      _mm256_storeu_ps(&score[c0], s);
    }
    alignas(32) float tops[8];
    _mm256_store_ps(tops, top);
    const __m256 mx = _mm256_set1_ps(*std::max_element(tops, tops + 8));
    __m256 lanes = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < padded; c0 += 8) {
      const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(&score[c0]), mx));
      _mm256_storeu_ps(&score[c0], e);
      lanes = _mm256_add_ps(lanes, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / Sum8(lanes));
    for (int64_t j0 = 0; j0 < d; j0 += 64) {  // 64 dimensions (8 vectors) at a time
      const int nv = int(std::min<int64_t>(64, d - j0) / 8);
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < n; ++i) {
        const __m256 p = _mm256_set1_ps(score[i]);
        const float* vr = vbase + int64_t(cols[i]) * stride + j0;
        for (int j = 0; j < nv; ++j) acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * j), acc[j]);
      }
      for (int j = 0; j < nv; ++j) _mm256_storeu_ps(o + j0 + 8 * j, _mm256_mul_ps(acc[j], inv));
    }
  }
}
#endif

ffi::Error AttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                         ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> offset, ffi::Buffer<ffi::U8> mask,
                         ffi::ResultBuffer<ffi::F32> out, int32_t window) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      kd[0] != qd[0] || kd[3] != qd[3] ||
      kd[2] == 0 || qd[2] % kd[2] != 0 || kv_len.element_count() != qd[0] || offset.element_count() != 1 ||
      md.size() != 3 || (md[2] != 0 && (md[0] != qd[0] || md[1] != qd[1])))
    return ffi::Error::InvalidArgument(
        "attention: q must be [B, T, H, D], k and v [B, S, Hkv, D] (Hkv dividing H), kv_len [B], offset [], "
        "mask [B, T, W] or [.., .., 0]");
  Shape sh{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], md[2], window, 1.0f / std::sqrt(float(qd[3]))};
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t* lp = kv_len.typed_data();
  const int32_t off = offset.typed_data()[0];
  const uint8_t* mp = mask.typed_data();
  float* op = out->typed_data();
  // on the calling thread: at a few rows the work is tens of microseconds a layer, less than waking
  // other threads would cost, and XLA's own threads stay free for the products around it
  std::vector<int32_t> cols;
  std::vector<float> score;
  for (int64_t r = 0; r < sh.b * sh.t; ++r) {  // r = (slot, row)
    Columns(sh, lp, off, mp, r / sh.t, r % sh.t, cols);
    for (int64_t kh = 0; kh < sh.hkv; ++kh) {
#if defined(__AVX2__) && defined(__FMA__)
      if (sh.d % 8 == 0) {
        RowVec(sh, qp, kp, vp, op, r / sh.t, r % sh.t, kh, cols, score);
        continue;
      }
#endif
      Row(sh, qp, kp, vp, op, r / sh.t, r % sh.t, kh, cols, score);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("window"));
