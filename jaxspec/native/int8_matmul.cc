// The integer product of w8a8_int8 on XLA:CPU, called through XLA's FFI (jaxspec/native/__init__.py).
//
//   y[r, o] = sum_i x[r, i] * w[o, i]   x: [R, I] int8, w: [O, I] int8 (out-major), y: [R, O] int32
//
// Each weight row is read once for all R rows of x, so the
// weights (the bytes that matter: megabytes, against kilobytes of x) stream through once per call.
// Three code paths, chosen at compile time for the machine (-march=native):
//   AVX-512 VNNI  vpdpbusd multiplies unsigned by signed bytes, 64 per instruction, into int32; x is
//                 made unsigned (x + 128) and the excess 128 * sum_i w[o, i] subtracted after.
//   AVX2          bytes sign-extended to int16, vpmaddwd into int32, 16 per instruction.
//   otherwise     a plain loop (whatever the compiler vectorises).
// Sums are exact in int32 for I < 133000 (|x|, |w| <= 127).
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 8;  // rows per pass over the weights (more rows: several passes)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int NR>
void Pass(const int8_t* x, const int8_t* w, int32_t* y, int64_t in, int64_t o_begin, int64_t o_end,
          int64_t y_stride) {
  const int64_t in64 = in / 64 * 64;
  std::vector<uint8_t> xu(NR * in);  // x + 128, unsigned, as vpdpbusd wants it
  for (int r = 0; r < NR; ++r)
    for (int64_t i = 0; i < in; ++i) xu[r * in + i] = uint8_t(int(x[r * in + i]) + 128);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int8_t* wr = w + o * in;
    __m512i acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_si512();
    __m512i wsum = _mm512_setzero_si512();
    for (int64_t i = 0; i < in64; i += 64) {
      const __m512i wv = _mm512_loadu_si512(wr + i);
      wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
      for (int r = 0; r < NR; ++r)
        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(xu.data() + r * in + i), wv);
    }
    int32_t ws = _mm512_reduce_add_epi32(wsum);
    int32_t tail[NR] = {};
    for (int64_t i = in64; i < in; ++i) {
      ws += wr[i];
      for (int r = 0; r < NR; ++r) tail[r] += int32_t(xu[r * in + i]) * int32_t(wr[i]);
    }
    for (int r = 0; r < NR; ++r)
      y[r * y_stride + (o - o_begin)] = _mm512_reduce_add_epi32(acc[r]) + tail[r] - 128 * ws;
  }
}
#elif defined(__AVX2__)
inline int32_t HSum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

template <int NR>
void Pass(const int8_t* x, const int8_t* w, int32_t* y, int64_t in, int64_t o_begin, int64_t o_end,
          int64_t y_stride) {
  const int64_t in16 = in / 16 * 16;
  std::vector<int16_t> xs(NR * in);  // x as int16
  for (int64_t k = 0; k < NR * in; ++k) xs[k] = x[k];
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int8_t* wr = w + o * in;
    __m256i acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_si256();
    for (int64_t i = 0; i < in16; i += 16) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + i)));
      for (int r = 0; r < NR; ++r)
        acc[r] = _mm256_add_epi32(
            acc[r], _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs.data() + r * in + i)), wv));
    }
    for (int r = 0; r < NR; ++r) {
      int32_t s = HSum(acc[r]);
      for (int64_t i = in16; i < in; ++i) s += int32_t(xs[r * in + i]) * int32_t(wr[i]);
      y[r * y_stride + (o - o_begin)] = s;
    }
  }
}
#else
template <int NR>
void Pass(const int8_t* x, const int8_t* w, int32_t* y, int64_t in, int64_t o_begin, int64_t o_end,
          int64_t y_stride) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int8_t* wr = w + o * in;
    for (int r = 0; r < NR; ++r) {
      int32_t s = 0;
      for (int64_t i = 0; i < in; ++i) s += int32_t(x[r * in + i]) * int32_t(wr[i]);
      y[r * y_stride + (o - o_begin)] = s;
    }
  }
}
#endif

template <int NR = kMaxRows>
void Rows(int nr, const int8_t* x, const int8_t* w, int32_t* y, int64_t in, int64_t o_begin, int64_t o_end,
          int64_t y_stride) {
  if constexpr (NR > 1) {
    if (nr < NR) return Rows<NR - 1>(nr, x, w, y, in, o_begin, o_end, y_stride);
  }
  Pass<NR>(x, w, y, in, o_begin, o_end, y_stride);
}

ffi::Error Int8MatmulImpl(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w, ffi::ResultBuffer<ffi::S32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("int8_matmul: x must be [R, I] and w [O, I]");
  const int64_t rows = xd[0], in = xd[1], out = wd[0];
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    const int nr = int(rows - r < kMaxRows ? rows - r : kMaxRows);
    Rows(nr, x.typed_data() + r * in, w.typed_data(), y->typed_data() + r * out, in, int64_t{0}, out, out);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
