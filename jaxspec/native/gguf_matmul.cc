// GGUF weight blocks multiplied as they are stored, on XLA:CPU through XLA's FFI (jaxspec/native/__init__.py).
//
//   y[r, o] = sum_i x[r, i] * w[o, i]   x: [R, I] float32, w: [O, I / 32 * block bytes] uint8 (GGUF
//                                        blocks, row o holding weight row o), y: [R, O] float32
//
// Block formats (llama.cpp's, 32 weights each, d and m float16):
//   Q4_0  d, 16 bytes of 4-bit q (low nibbles: weights 0-15, high: 16-31)    w = d * (q - 8)
//   Q4_1  d, m, 16 bytes of 4-bit q (same order)                              w = d * q + m
//   Q8_0  d, 32 signed bytes q                                                w = d * q
// With an RMSNorm's weight (norm [I], eps), each row of x is normalised first, inside the call (a
// model's norm before its projections, in place of XLA's ops for it).
// Activations are quantized per row and block of 32, as llama.cpp does for these formats: a
// float16 scale dx = max|x| / 127 and q_x = round(x / dx) in [-127, 127], plus (for Q4_1) s =
// dx * sum q_x. A block's product is then an exact integer sum scaled in float:
//   Q4_0: d dx (sum q q_x - 8 sum q_x)   Q4_1: d dx sum q q_x + m s   Q8_0: d dx sum q q_x
// Each weight row is read once for up to 8 rows of x (a decoding step, a verification tree); a row's
// result does not depend on how many rows share the call (same operations in the same order).
// Weights come in the file's layout or interleaved 8 rows side by side (see GroupBytes), and each
// call's weight rows are split over a small pool of threads (Pool).
// Three code paths, chosen at compile time for the machine (-march=native): AVX-512 VNNI
// (vpdpbusd on 256-bit vectors, unsigned bytes times signed bytes into int32), AVX2 (vpmaddubsw then
// vpmaddwd), otherwise a plain loop.
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 8;  // rows per pass over the weights (more rows: several passes)
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML type ids

int BlockBytes(int kind) { return kind == kQ4_0 ? 18 : kind == kQ4_1 ? 20 : kind == kQ8_0 ? 34 : 0; }

// Interleaved layouts ("x8", made at load by jaxspec/gguf.py `interleave`): 8 weight rows' blocks
// side by side, so that one vector holds 4 weights of each of 8 rows and a dot product instruction
// yields 8 rows' sums at once, and one scale-and-add serves 8 rows. Per group of 8 rows and block b,
// GroupBytes(kind) bytes:
//   Q4_0x8  d[8] (float16) | 128 bytes of nibbles
//   Q4_1x8  d[8] | m[8] | 128 bytes of nibbles
//   Q8_0x8  d[8] | 256 bytes q
// Nibbles: 4 runs of 32 bytes; run t, byte 4 j + i = q[row j][8 t + i] | q[row j][8 t + 4 + i] << 4
// (i < 4). Q8_0: 8 runs of 32 bytes; run k, byte 4 j + i = q[row j][4 k + i].
constexpr int kX8 = 100;  // kind + kX8: the interleaved layout of kind
constexpr int64_t kPrefetchBytes = 1280;  // how far ahead of an interleaved pass its weights are fetched
int GroupBytes(int kind) {
  return kind == kQ4_0 + kX8 ? 144 : kind == kQ4_1 + kX8 ? 160 : kind == kQ8_0 + kX8 ? 272 : 0;
}

float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(man), -24);
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    f = std::ldexp(float(man | 0x400), int(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= sign;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// x rounded to the nearest float16 (ties to even) and back: the precision llama.cpp stores scales in.
float RoundToHalf(float x) {
#if defined(__F16C__)
  return _cvtsh_ss(_cvtss_sh(x, 0));
#else
  if (x == 0.0f || !std::isfinite(x)) return x;
  int e;
  std::frexp(x, &e);                      // x = f * 2^e, 0.5 <= |f| < 1
  const int keep = e - 11 < -24 ? -24 : e - 11;  // float16 keeps 11 significant bits (subnormals: 2^-24 steps)
  return std::ldexp(std::nearbyint(std::ldexp(x, -keep)), keep);
#endif
}

// x quantized to blocks of 32 (block k = row r, block b at k = r * nb + b): q [R * I] int8, d [k]
// the float16-rounded scale, sum [k] the integer sum of q, s [k] = d * sum rounded to float16 (Q4_1's
// offset term); d8 and s8 hold d and s / 8 eight times each, for 8-lane vector products.
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> d, s, d8, s8, normed;
  std::vector<int32_t> sum;

  // Fills the buffers (kept by the calling thread from call to call: no allocation per call). norm
  // (or null): an RMSNorm's weight [in], applied to each row first (Normalize).
  void Quantize(const float* x, int64_t rows, int64_t in, const float* norm, float eps) {
    q.resize(rows * in), d.resize(rows * in / 32), s.resize(d.size()), d8.resize(8 * d.size());
    s8.resize(8 * d.size()), sum.resize(d.size());
    if (norm != nullptr) x = Normalize(x, rows, in, norm, eps);
    for (int64_t blk = 0; blk < rows * in / 32; ++blk) {
      const float* xb = x + blk * 32;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
      const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t total = 0;
      for (int i = 0; i < 32; ++i) {
        const int v = int(std::nearbyint(xb[i] * inv));
        q[blk * 32 + i] = int8_t(v);
        total += v;
      }
      d[blk] = RoundToHalf(dx);
      sum[blk] = total;
      s[blk] = RoundToHalf(dx * float(total));
      for (int i = 0; i < 8; ++i) d8[8 * blk + i] = d[blk], s8[8 * blk + i] = s[blk] / 8;
    }
  }

  // RMSNorm of each row into `normed`: x * (1 / sqrt(mean(x^2) + eps)) * weight, the squares summed
  // in 8 running sums (lane j: i = j, j + 8, ...) added in a fixed order, so a row's result depends
  // on nothing but the row. Returns normed's data.
  const float* Normalize(const float* x, int64_t rows, int64_t in, const float* weight, float eps) {
    normed.resize(rows * in);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * in;
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < in; i += 8)  // in: a multiple of 32
        for (int j = 0; j < 8; ++j) lane[j] += xr[i + j] * xr[i + j];
      const float ss = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
      const float inv = 1.0f / std::sqrt(ss / float(in) + eps);
      float* out = normed.data() + r * in;
      for (int64_t i = 0; i < in; ++i) out[i] = xr[i] * inv * weight[i];
    }
    return normed.data();
  }
};

// The plain loops' block: weights wq[32] (q, before Q4_0's -8) with scale dw and minimum m, times
// block b of rows r0 .. r0 + NR, added to acc.
template <int Kind, int NR>
void AddBlock(const Activations& a, int64_t r0, int64_t nb, int64_t b, const int* wq, float dw, float m, float* acc) {
  for (int r = 0; r < NR; ++r) {
    const int64_t k = (r0 + r) * nb + b;
    const int8_t* xq = a.q.data() + k * 32;
    int32_t dot = Kind == kQ4_0 ? -8 * a.sum[k] : 0;
    for (int i = 0; i < 32; ++i) dot += wq[i] * int32_t(xq[i]);
    acc[r] += float(dot) * (dw * a.d[k]);
    if (Kind == kQ4_1) acc[r] += m * a.s[k];
  }
}

#if defined(__AVX2__)
// acc + lanes whose sum is sum_i u[i] * s[i] (u: unsigned bytes, s: signed bytes; with AVX2 the
// pairwise int16 sums must not saturate: |u| <= 127 or |s| small enough, true for every use here).
inline __m256i DotUS(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows r0 .. r0 + NR of y for weight rows [o0, o1). Per block and row: one integer dot product
// (vpdpbusd or its AVX2 equivalent), then the 8 partial sums scaled by d_w d_x into a float
// accumulator; Q4_1's m s term through the s / 8 lanes (their 8 lanes sum to m s).
template <int Kind, int NR>
void Pass(const Activations& a, int64_t r0, const uint8_t* w, float* y, int64_t in, int64_t out, int64_t o0,
          int64_t o1) {
  const int64_t nb = in / 32, bs = BlockBytes(Kind);
  const __m128i low = _mm_set1_epi8(0x0f);
  const int8_t* xq = a.q.data() + r0 * in;
  const float* d8 = a.d8.data() + r0 * nb * 8;
  const float* s8 = a.s8.data() + r0 * nb * 8;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* wr = w + o * nb * bs;
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wr + b * bs;
      uint16_t dh;
      std::memcpy(&dh, blk, 2);
      const __m256 dw = _mm256_set1_ps(HalfToFloat(dh));
      if constexpr (Kind == kQ8_0) {
        const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        const __m256i wabs = _mm256_sign_epi8(wq, wq);
        for (int r = 0; r < NR; ++r) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r * nb + b) * 32));
          const __m256i dot = DotUS(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(x, wq));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_loadu_ps(d8 + (r * nb + b) * 8)),
                                   acc[r]);
        }
      } else {
        const uint8_t* qs = blk + (Kind == kQ4_1 ? 4 : 2);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
        const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
        __m256 m = _mm256_setzero_ps();
        if constexpr (Kind == kQ4_1) {
          uint16_t mh;
          std::memcpy(&mh, blk + 2, 2);
          m = _mm256_set1_ps(HalfToFloat(mh));
        }
        for (int r = 0; r < NR; ++r) {
          const int64_t k = (r0 + r) * nb + b;
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r * nb + b) * 32));
          // Q4_0's -8 sum q_x starts the integer sum, so it stays exact
          const __m256i init = Kind == kQ4_0 ? _mm256_zextsi128_si256(_mm_cvtsi32_si128(-8 * a.sum[k]))
                                             : _mm256_setzero_si256();
          const __m256i dot = DotUS(init, wq, x);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_loadu_ps(d8 + (r * nb + b) * 8)),
                                   acc[r]);
          if constexpr (Kind == kQ4_1) acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(s8 + (r * nb + b) * 8), acc[r]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) y[(r0 + r) * out + o] = HSum(acc[r]);
  }
}
#else
template <int Kind, int NR>
void Pass(const Activations& a, int64_t r0, const uint8_t* w, float* y, int64_t in, int64_t out, int64_t o0,
          int64_t o1) {
  const int64_t nb = in / 32, bs = BlockBytes(Kind);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* wr = w + o * nb * bs;
    float acc[NR] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wr + b * bs;
      uint16_t dh, mh = 0;
      std::memcpy(&dh, blk, 2);
      if (Kind == kQ4_1) std::memcpy(&mh, blk + 2, 2);
      const float dw = HalfToFloat(dh), m = HalfToFloat(mh);
      int wq[32];
      if (Kind == kQ8_0) {
        for (int i = 0; i < 32; ++i) wq[i] = int8_t(blk[2 + i]);
      } else {
        const uint8_t* qs = blk + (Kind == kQ4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) wq[i] = qs[i] & 0x0f, wq[i + 16] = qs[i] >> 4;
      }
      AddBlock<Kind, NR>(a, r0, nb, b, wq, dw, m, acc);
    }
    for (int r = 0; r < NR; ++r) y[(r0 + r) * out + o] = acc[r];
  }
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// Rows r0 .. r0 + NR of y for weight row groups [g0, g1) of an interleaved layout (Kind: the block
// type without kX8). Per group, block and row: 8 dot product instructions (each 4 weights of 8
// rows times 4 activations broadcast straight from memory: a broadcast copy of the activations, read
// through the cache, was 1.5x slower at 4 rows), then one scale-and-add for all 8 rows.
template <int Kind, int NR>
void PassX8(const Activations& a, int64_t r0, const uint8_t* w, float* y, int64_t in, int64_t out, int64_t g0,
            int64_t g1) {
  const int64_t nb = in / 32, gs = GroupBytes(Kind + kX8);
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * nb * gs;
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wg + b * gs;
      // the weights kPrefetchBytes ahead (8 blocks of Q4_1x8) asked for now, so that they stream from
      // memory while this block is multiplied (a prefetch past the weights' end is harmless)
      for (int64_t ahead = kPrefetchBytes; ahead < kPrefetchBytes + gs; ahead += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + ahead), _MM_HINT_T0);
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
      __m256i wv[8];  // Q8_0: |q|, the signs applied to the activations instead
      __m256 m = _mm256_setzero_ps();
      if constexpr (Kind == kQ8_0) {
        for (int k = 0; k < 8; ++k) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * k));
          wv[k] = _mm256_sign_epi8(q, q);
        }
      } else {
        const uint8_t* qs = blk + (Kind == kQ4_1 ? 32 : 16);
        if constexpr (Kind == kQ4_1) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
        for (int t = 0; t < 4; ++t) {
          const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * t));
          wv[2 * t] = _mm256_and_si256(p, low);
          wv[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
        }
      }
      for (int r = 0; r < NR; ++r) {
        const int64_t k = (r0 + r) * nb + b;
        const int8_t* xb = a.q.data() + k * 32;
        __m256i dot = Kind == kQ4_0 ? _mm256_set1_epi32(-8 * a.sum[k]) : _mm256_setzero_si256();
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
        if constexpr (Kind != kQ8_0) {
          // AVX2: the 8 pairwise products of nibbles (<= 15) and activations (|q_x| <= 127) summed in
          // int16 lanes (at most 8 * 2 * 15 * 127 = 30480, exact), widened to int32 once: 9
          // multiply instructions a row and block instead of 16, the same integer sums
          __m256i s16 = _mm256_maddubs_epi16(wv[0], _mm256_broadcastd_epi32(_mm_loadu_si32(xb)));
          for (int j = 1; j < 8; ++j)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wv[j], _mm256_broadcastd_epi32(_mm_loadu_si32(xb + 4 * j))));
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
        } else
#endif
        for (int j = 0; j < 8; ++j) {
          const __m256i xv = _mm256_broadcastd_epi32(_mm_loadu_si32(xb + 4 * j));
          if constexpr (Kind == kQ8_0)  // (the signs reloaded from the block: no registers left for them)
            dot = DotUS(dot, wv[j], _mm256_sign_epi8(xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                              blk + 16 + 32 * j))));
          else
            dot = DotUS(dot, wv[j], xv);
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[k])), acc[r]);
        if constexpr (Kind == kQ4_1) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s[k]), acc[r]);
      }
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(y + (r0 + r) * out + 8 * g, acc[r]);
  }
}
#else
template <int Kind, int NR>
void PassX8(const Activations& a, int64_t r0, const uint8_t* w, float* y, int64_t in, int64_t out, int64_t g0,
            int64_t g1) {
  const int64_t nb = in / 32, gs = GroupBytes(Kind + kX8);
  for (int64_t g = g0; g < g1; ++g) {
    for (int j = 0; j < 8; ++j) {
      float acc[NR] = {};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + (g * nb + b) * gs;
        uint16_t dh, mh = 0;
        std::memcpy(&dh, blk + 2 * j, 2);
        if (Kind == kQ4_1) std::memcpy(&mh, blk + 16 + 2 * j, 2);
        const float dw = HalfToFloat(dh), m = HalfToFloat(mh);
        int wq[32];
        const uint8_t* qs = blk + (Kind == kQ4_1 ? 32 : 16);
        for (int i = 0; i < 32; ++i) {
          const uint8_t byte = qs[32 * (i / 8) + 4 * j + i % 4];
          wq[i] = Kind == kQ8_0 ? int8_t(blk[16 + 32 * (i / 4) + 4 * j + i % 4]) : (i % 8) < 4 ? byte & 0x0f : byte >> 4;
        }
        AddBlock<Kind, NR>(a, r0, nb, b, wq, dw, m, acc);
      }
      for (int r = 0; r < NR; ++r) y[(r0 + r) * out + 8 * g + j] = acc[r];
    }
  }
}
#endif

// nr (<= kMaxRows) rows from r0 through the pass compiled for exactly that many (X8: the
// interleaved layout, [o0, o1) counting groups of 8 weight rows).
template <int Kind, bool X8, int NR = kMaxRows>
void Rows(int nr, const Activations& a, int64_t r0, const uint8_t* w, float* y, int64_t in, int64_t out, int64_t o0,
          int64_t o1) {
  if constexpr (NR > 1) {
    if (nr < NR) return Rows<Kind, X8, NR - 1>(nr, a, r0, w, y, in, out, o0, o1);
  }
  if constexpr (X8)
    PassX8<Kind, NR>(a, r0, w, y, in, out, o0, o1);
  else
    Pass<Kind, NR>(a, r0, w, y, in, out, o0, o1);
}

// Every row of y for weight rows [o0, o1), kMaxRows rows of x per pass over those weights.
void AllRows(int kind, const Activations& a, int64_t rows, const uint8_t* w, float* y, int64_t in, int64_t out,
             int64_t o0, int64_t o1) {
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    const int nr = int(rows - r < kMaxRows ? rows - r : kMaxRows);
    if (kind == kQ4_0) Rows<kQ4_0, false>(nr, a, r, w, y, in, out, o0, o1);
    if (kind == kQ4_1) Rows<kQ4_1, false>(nr, a, r, w, y, in, out, o0, o1);
    if (kind == kQ8_0) Rows<kQ8_0, false>(nr, a, r, w, y, in, out, o0, o1);
    if (kind == kQ4_0 + kX8) Rows<kQ4_0, true>(nr, a, r, w, y, in, out, o0, o1);
    if (kind == kQ4_1 + kX8) Rows<kQ4_1, true>(nr, a, r, w, y, in, out, o0, o1);
    if (kind == kQ8_0 + kX8) Rows<kQ8_0, true>(nr, a, r, w, y, in, out, o0, o1);
  }
}

// Worker threads that take a share of the weight rows of each call (the caller takes the first).
// A product of a few rows unpacks and scales every block once per row, so it is bound by
// arithmetic, not by memory, and a second core halves it. Workers wait for the next call spinning
// for a short while (the calls of one decoding step come microseconds apart), then sleeping.
// JAXSPEC_NATIVE_THREADS sets the thread count (default: the CPUs this process may run on, at most 8).
class Pool {
 public:
  static Pool& Get() {
    static Pool* pool = new Pool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }
  int size() const { return int(workers_.size()) + 1; }

  // Runs fn(0) .. fn(parts - 1), fn(0) on this thread; returns when all have returned.
  void Run(int parts, const std::function<void(int)>& fn) {
    if (parts <= 1) return fn(0);
    std::lock_guard<std::mutex> one_call(call_mu_);  // concurrent programs take turns
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      parts_ = parts;
      pending_.store(parts - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0);
    while (pending_.load(std::memory_order_acquire) > 0) Relax();
  }

 private:
  Pool() {
    int n = 0;
    if (const char* env = std::getenv("JAXSPEC_NATIVE_THREADS")) n = std::atoi(env);
    if (n <= 0) {
      cpu_set_t set;
      n = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : int(std::thread::hardware_concurrency());
      n = n < 1 ? 1 : n > 8 ? 8 : n;
    }
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { Work(i); });
    for (auto& t : workers_) t.detach();
  }

  static void Relax() {
#if defined(__AVX2__)
    _mm_pause();
#endif
  }

  void Work(int index) {
    uint64_t seen = 0;  // the generation before any call (a thread may start after the first call)
    for (;;) {
      for (int spin = 0; spin < 20000 && generation_.load(std::memory_order_acquire) == seen; ++spin) Relax();
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      // a call waits for its workers before the next may start, so generation, parts and fn agree
      seen = generation_.load(std::memory_order_acquire);
      if (index < parts_) {
        (*fn_)(index);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* fn_ = nullptr;
  int parts_ = 0;
};

ffi::Error GgufMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> norm,
                          ffi::ResultBuffer<ffi::F32> y, int32_t kind, float eps) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const bool x8 = GroupBytes(kind) != 0;
  if (BlockBytes(kind) == 0 && !x8) return ffi::Error::InvalidArgument("gguf_matmul: unknown block kind");
  if (xd.size() != 2 || wd.size() != 2 || xd[1] % 32 != 0 ||
      wd[1] != xd[1] / 32 * (x8 ? GroupBytes(kind) : BlockBytes(kind)))
    return ffi::Error::InvalidArgument(
        "gguf_matmul: x must be [R, I] (I a multiple of 32) and w [O, I / 32 * block bytes] (interleaved: [O / 8, "
        "I / 32 * group bytes])");
  if (y->dimensions().size() != 2 || y->dimensions()[1] != wd[0] * (x8 ? 8 : 1))
    return ffi::Error::InvalidArgument("gguf_matmul: y must be [R, O]");
  if (norm.element_count() != 0 && norm.element_count() != size_t(xd[1]))
    return ffi::Error::InvalidArgument("gguf_matmul: the norm's weight must be [I] (or [0]: no norm)");
  const int64_t rows = xd[0], in = xd[1], out = wd[0] * (x8 ? 8 : 1), units = wd[0];
  thread_local Activations buffers;
  Activations& a = buffers;  // (a lambda naming `buffers` would see each worker's own, empty, copy)
  a.Quantize(x.typed_data(), rows, in, norm.element_count() ? norm.typed_data() : nullptr, eps);
  float* yp = y->typed_data();
  const uint8_t* wp = w.typed_data();
  Pool& pool = Pool::Get();
  // a share per thread (whole multiples of 16 weight rows, or of 2 groups of 8), none for tiny products
  const int64_t work = rows * out * in;
  const int parts = work < (int64_t{1} << 18) ? 1 : pool.size();
  const int64_t align = x8 ? 2 : 16;  // weight rows, or groups of 8 of them, per share: a multiple of this
  const int64_t step = (units / parts + align - 1) / align * align;
  pool.Run(parts, [&](int p) {
    const int64_t o0 = std::min<int64_t>(units, p * step);
    const int64_t o1 = p == parts - 1 ? units : std::min<int64_t>(units, o0 + step);
    if (o0 < o1) AllRows(kind, a, rows, wp, yp, in, out, o0, o1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecGgufMatmul, GgufMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("kind")
                                  .Attr<float>("eps"));
