// CPU codec kernels of commpress (plain C++, no torch headers), loaded with ctypes by
// compressors/cpu_kernels.py. Every kernel has a torch/numpy twin in compressors/ (the
// fallback and the test oracle) and must give the SAME BITS: build with -ffp-contract=off
// and without -ffast-math, so each fp32 operation below is one IEEE-754 rounding, in the
// order written. Results never depend on the thread count (per-element or per-chunk work).
//
// dtype codes: 0 = float32, 1 = float16, 2 = bfloat16 (inputs are widened exactly).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef int64_t i64;
typedef uint64_t u64;
typedef uint32_t u32;
typedef uint16_t u16;
typedef uint8_t u8;

#define API extern "C" __attribute__((visibility("default")))

namespace {

inline u32 lowbias32(u32 x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

inline float bits_f32(u32 b) { float f; std::memcpy(&f, &b, 4); return f; }

inline float f16_to_f32(u16 h) {
  u32 sign = (u32)(h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) {
    float v = (float)m * 5.9604644775390625e-08f;  // m * 2**-24: exact
    return sign ? -v : v;
  }
  if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

// fp32 -> fp16, round to nearest even; overflow -> inf; NaN -> 0x7E00 with x's sign. The
// branch-free algorithm of the FP16 library's fp16_ieee_from_fp32_value (c10::Half's scalar
// conversion): with exact IEEE fp32 arithmetic (no contraction) it rounds like the hardware.
inline u16 f32_to_f16(float f) {
  const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  u32 w; std::memcpy(&w, &f, 4);
  const u32 shl1_w = w + w, sign = w & 0x80000000u;
  u32 bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  u32 b; std::memcpy(&b, &base, 4);
  const u32 nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  return (u16)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// fp32 -> bf16 as c10::BFloat16 rounds: to nearest even, NaN -> 0x7FC0
inline u16 f32_to_bf16(float f) {
  u32 w; std::memcpy(&w, &f, 4);
  const u32 rounded = (w + (((w >> 16) & 1u) + 0x7FFFu)) >> 16;
  return (w & 0x7fffffffu) > 0x7f800000u ? (u16)0x7FC0u : (u16)rounded;
}

template <int DT> inline float load(const void* p, i64 i) {
  if (DT == 0) return static_cast<const float*>(p)[i];
  if (DT == 1) return f16_to_f32(static_cast<const u16*>(p)[i]);
  return bits_f32((u32) static_cast<const u16*>(p)[i] << 16);
}

// |x|'s bits as an unsigned key: larger key == larger magnitude (NaN above inf)
template <int DT> inline u32 mag_key(const void* p, i64 i) {
  if (DT == 0) return static_cast<const u32*>(p)[i] & 0x7fffffffu;
  return (u32)(static_cast<const u16*>(p)[i] & 0x7fff);
}

// f(u0, u1, t) for nth disjoint ranges of [0, units), range t on thread t (range 0 on the
// caller). A thread that cannot be started (EAGAIN under a thread limit) leaves its range to
// the caller, and started threads are joined however the caller's ranges end: before, the
// std::system_error left here past joinable threads and ctypes' C frames, and the process
// aborted in std::terminate (tests/unit/test_cpu_kernels_threads.py). Ranges and indices never
// depend on how many threads started, so neither do the results.
template <class F> void parallel_for(int nth, i64 units, F f) {
  if (nth > units) nth = (int)units;
  if (nth <= 1) { if (units > 0) f(0, units, 0); return; }
  struct Joiner {
    std::vector<std::thread> ts;
    ~Joiner() { for (auto& th : ts) if (th.joinable()) th.join(); }
  } j;
  j.ts.reserve(nth - 1);
  int started = 1;
  try {
    for (; started < nth; ++started)
      j.ts.emplace_back(f, units * started / nth, units * (started + 1) / nth, started);
  } catch (const std::system_error&) {
  }
  for (int t = started; t < nth; ++t) f(units * t / nth, units * (t + 1) / nth, t);
  f(0, units / nth, 0);
}

i64 gcd64(i64 a, i64 b) { while (b) { i64 t = a % b; a = b; b = t; } return a; }
i64 unit_of(i64 chunk) { return chunk / gcd64(chunk, 8) * 8; }  // lcm(chunk, 8)

// pack L codes (< 2**bits) into bytes, LSB first; the tail of the last byte is zero
void pack_codes(const u8* q, i64 L, int bits, u8* out) {
  if (bits == 8) { std::memcpy(out, q, L); return; }
  const int per = 8 / bits;
  i64 full = L / per;
  if (bits == 4) for (i64 j = 0; j < full; ++j) out[j] = (u8)(q[2 * j] | (q[2 * j + 1] << 4));
  else if (bits == 2)
    for (i64 j = 0; j < full; ++j)
      out[j] = (u8)(q[4 * j] | (q[4 * j + 1] << 2) | (q[4 * j + 2] << 4) | (q[4 * j + 3] << 6));
  else
    for (i64 j = 0; j < full; ++j) {  // eight 0/1 bytes -> one byte (partial products disjoint)
      u64 v;
      std::memcpy(&v, q + 8 * j, 8);
      out[j] = (u8)((v * 0x0102040810204080ull) >> 56);
    }
  i64 rem = L - full * per;
  if (rem) {
    u32 b = 0;
    for (i64 m = 0; m < rem; ++m) b |= (u32)q[full * per + m] << (m * bits);
    out[full] = (u8)b;
  }
}

inline u32 code_at(const u8* packed, i64 i, int bits) {
  if (bits == 8) return packed[i];
  i64 pos = i * bits;
  return (packed[pos >> 3] >> (pos & 7)) & ((1u << bits) - 1);
}

// inverse of pack_codes: L codes from bytes (the first code at bit 0 of in[0])
void unpack_codes(const u8* in, i64 L, int bits, u8* q) {
  if (bits == 8) { std::memcpy(q, in, L); return; }
  const u32 mask = (1u << bits) - 1;
  const int per = 8 / bits;
  const i64 full = L / per;
  if (bits == 4)
    for (i64 j = 0; j < full; ++j) { q[2 * j] = in[j] & 15; q[2 * j + 1] = in[j] >> 4; }
  else if (bits == 2)
    for (i64 j = 0; j < full; ++j)
      for (int m = 0; m < 4; ++m) q[4 * j + m] = (in[j] >> (2 * m)) & 3;
  else
    for (i64 j = 0; j < full; ++j) {
      u64 v = (u64)in[j] * 0x0101010101010101ull;  // the byte in every byte (no carries)
      v &= 0x8040201008040201ull;                   // byte m keeps bit m
      for (int m = 0; m < 8; ++m) q[8 * j + m] = (u8)(((v >> (8 * m)) & 0xff) != 0);
    }
  for (i64 i = full * per; i < L; ++i) q[i] = (in[full] >> ((i - full * per) * bits)) & mask;
}

// ---- QSGD -----------------------------------------------------------------------------
template <int DT>
void qsgd_encode_range(const void* x, i64 n, i64 chunk, int bits, u32 key, i64 e0, i64 e1,
                       float* scales, u8* packed, u8* codes, i64 win) {
  const float M = (float)((1u << bits) - 1);
  const float half = M * 0.5f;
  const float SC = 5.9604644775390625e-08f;  // 2**-24
  for (i64 w0 = e0; w0 < e1; w0 += win) {
    const i64 w1 = std::min(e1, w0 + win);
    u8* q = bits == 8 ? packed + w0 : codes;
    for (i64 c0 = w0; c0 < w1; c0 += chunk) {
      const i64 c1 = std::min(w1, c0 + chunk);
      // max |x| on the magnitude bits (an integer max vectorizes; floats' does not without
      // -ffast-math): for non-negative floats the order of the bits is the order of values
      u32 mk = 0;
      for (i64 i = c0; i < c1; ++i) {
        float v = load<DT>(x, i);
        u32 b;
        std::memcpy(&b, &v, 4);
        b &= 0x7fffffffu;
        mk = b > mk ? b : mk;
      }
      const float s = mk > 0x7f800000u ? bits_f32(0x7fc00000u) : bits_f32(mk);
      scales[c0 / chunk] = s;
      const float r = s > 0.0f ? half / s : 0.0f;
      u8* qc = q + (c0 - w0);
      for (i64 i = c0; i < c1; ++i) {
        float t = load<DT>(x, i) * r;
        t = t + half;
        u32 h = lowbias32((u32)i ^ key) >> 8;
        float v = (float)(int32_t)h;
        v = v + 0.5f;
        t = t + v * SC;
        t = t > 0.0f ? t : 0.0f;  // also NaN -> 0
        t = t < M ? t : M;
        qc[i - c0] = (u8)(int32_t)t;
      }
    }
    if (bits != 8) pack_codes(codes, w1 - w0, bits, packed + w0 * bits / 8);
  }
}

template <int DT>
void qsgd_encode(const void* x, i64 n, i64 chunk, int bits, u32 key, float* scales, u8* packed,
                 int nth) {
  const i64 U = unit_of(chunk);
  const i64 units = (n + U - 1) / U;
  i64 win = U * std::max<i64>(1, 16384 / U);
  parallel_for(nth, units, [&](i64 u0, i64 u1, int) {
    std::vector<u8> codes(bits == 8 ? 0 : win);
    qsgd_encode_range<DT>(x, n, chunk, bits, key, u0 * U, std::min(n, u1 * U), scales, packed,
                          codes.data(), win);
  });
}

void qsgd_decode(const float* s, const u8* packed, i64 n, i64 chunk, int bits, float* out,
                 int acc, int nth) {
  const i64 U = unit_of(chunk);
  const i64 units = (n + U - 1) / U;
  const float M = (float)((1u << bits) - 1);
  const i64 win = U * std::max<i64>(1, 16384 / U);
  parallel_for(nth, units, [&](i64 u0, i64 u1, int) {
    const i64 e1 = std::min(n, u1 * U);
    std::vector<u8> buf(bits == 8 ? 0 : win);
    for (i64 w0 = u0 * U; w0 < e1; w0 += win) {
      const i64 w1 = std::min(e1, w0 + win);
      const u8* q = packed;
      if (bits != 8) {
        unpack_codes(packed + w0 * bits / 8, w1 - w0, bits, buf.data());
        q = buf.data() - w0;
      }
      for (i64 c0 = w0; c0 < w1; c0 += chunk) {
        const i64 c1 = std::min(w1, c0 + chunk);
        const float sc = s[c0 / chunk];
        const float w = (2.0f * sc) / M;
        if (acc)
          for (i64 i = c0; i < c1; ++i) { float f = (float)q[i] * w; f = f - sc; out[i] = out[i] + f; }
        else
          for (i64 i = c0; i < c1; ++i) { float f = (float)q[i] * w; out[i] = f - sc; }
      }
    }
  });
}

// ---- ScaledSign -----------------------------------------------------------------------
inline i64 ceil_log2(i64 x) { return x <= 2 ? 1 : 64 - __builtin_clzll((u64)(x - 1)); }

// torch's CPU sum of a contiguous fp32 row (aten/native/cpu/SumKernel.cpp: cascade_sum ->
// vectorized_inner_sum / scalar_inner_sum -> row_sum -> multi_row_sum with 4 accumulators
// and 4 cascade levels), for |x| of the row, with W-lane vectors (W = Vectorized<float>::size()).
template <int L, class A> void multi_row_sum(const A& a, i64 size, float out[4][L]) {
  const int levels = 4;
  const i64 lp = std::max<i64>(4, ceil_log2(size) / levels);
  const i64 step = (i64)1 << lp, mask = step - 1;
  float acc[4][4][L];
  std::memset(acc, 0, sizeof(acc));
  i64 i = 0;
  for (; i + step <= size;) {
    for (i64 j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < L; ++l) acc[0][k][l] += a((i * 4 + k) * L + l);
    for (int j = 1; j < levels; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < L; ++l) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.0f; }
      if ((i & (mask << (j * lp))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += a((i * 4 + k) * L + l);
  for (int j = 1; j < levels; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  std::memcpy(out, acc[0], sizeof(float) * 4 * L);
}

template <int W> float torch_sum(const float* a, i64 n);

// torch's row sum when no cascade level is reached (n >= W, fewer than 16 groups of four
// vectors): four vector accumulators, the leftover vectors into the first, then the tail and
// the lanes. a(j): element j.
template <int W, class A> float four_acc_sum(A a, i64 n) {
  const i64 V = n / W, S = V / 4;
  float part[4][W];
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < W; ++l) part[k][l] = 0.0f;
  for (i64 i = 0; i < S; ++i)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) part[k][l] += a((i * 4 + k) * W + l);
  for (i64 v = S * 4; v < V; ++v)
    for (int l = 0; l < W; ++l) part[0][l] += a(v * W + l);
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < W; ++l) part[0][l] += part[k][l];
  float fin = 0.0f;
  for (i64 j = V * W; j < n; ++j) fin += a(j);
  for (int l = 0; l < W; ++l) fin += part[0][l];
  return 0.0f + fin;
}

template <int W, int DT> float torch_abs_sum(const void* x, i64 off, i64 n) {
  if (n >= W && n / W / 4 < 16)  // |x| read in place (no copy into a buffer)
    return four_acc_sum<W>([&](i64 j) { return std::fabs(load<DT>(x, off + j)); }, n);
  float buf[1024];
  if (n <= 1024) {
    for (i64 j = 0; j < n; ++j) buf[j] = std::fabs(load<DT>(x, off + j));
    return torch_sum<W>(buf, n);
  }
  auto a = [&](i64 j) { return std::fabs(load<DT>(x, off + j)); };
  float sum;
  if (n >= W) {
    const i64 V = n / W, S = V / 4;
    float part[4][W];
    multi_row_sum<W>(a, S, part);
    for (i64 v = S * 4; v < V; ++v)
      for (int l = 0; l < W; ++l) part[0][l] += a(v * W + l);
    for (int k = 1; k < 4; ++k)
      for (int l = 0; l < W; ++l) part[0][l] += part[k][l];
    float fin = 0.0f;
    for (i64 j = V * W; j < n; ++j) fin += a(j);
    for (int l = 0; l < W; ++l) fin += part[0][l];
    sum = fin;
  } else {
    float part[4][1];
    const i64 S = n / 4;
    multi_row_sum<1>(a, S, part);
    for (i64 j = S * 4; j < n; ++j) part[0][0] += a(j);
    for (int k = 1; k < 4; ++k) part[0][0] += part[k][0];
    sum = part[0][0];
  }
  return 0.0f + sum;  // the output is zero-filled, then accumulated into
}

// torch's row sum (as torch_abs_sum) of a local fp32 array
template <int W> float torch_sum(const float* a, i64 n) {
  const i64 V = n / W, S = V / 4;
  if (n >= W && S < 16) return four_acc_sum<W>([&](i64 j) { return a[j]; }, n);
  auto f = [&](i64 j) { return a[j]; };
  if (n >= W) {
    float part[4][W];
    multi_row_sum<W>(f, S, part);
    for (i64 v = S * 4; v < V; ++v)
      for (int l = 0; l < W; ++l) part[0][l] += a[v * W + l];
    for (int k = 1; k < 4; ++k)
      for (int l = 0; l < W; ++l) part[0][l] += part[k][l];
    float fin = 0.0f;
    for (i64 j = V * W; j < n; ++j) fin += a[j];
    for (int l = 0; l < W; ++l) fin += part[0][l];
    return 0.0f + fin;
  }
  float part[4][1];
  const i64 S1 = n / 4;
  multi_row_sum<1>(f, S1, part);
  for (i64 j = S1 * 4; j < n; ++j) part[0][0] += a[j];
  for (int k = 1; k < 4; ++k) part[0][0] += part[k][0];
  return 0.0f + part[0][0];
}

// bit j of out (LSB first) = x[off + j] >= 0 (NaN: 0), L bits from a byte boundary (off % 8 == 0)
template <int DT> void sign_bits(const void* x, i64 off, i64 L, u8* flags, u8* out) {
  if (DT == 0) {  // eight compares make a byte; written so that the loop vectorizes
    const float* p = static_cast<const float*>(x) + off;
    const i64 full = L / 8;
    i64 j = 0;
#ifdef __AVX2__
    const __m256 zero = _mm256_setzero_ps();
    for (; j < full; ++j)  // _CMP_GE_OQ: false for NaN, true for -0, as the scalar compare
      out[j] = (u8)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + 8 * j), zero, _CMP_GE_OQ));
#endif
    for (; j < full; ++j) {
      u32 b = 0;
      for (int l = 0; l < 8; ++l) b |= (u32)(p[8 * j + l] >= 0.0f) << l;
      out[j] = (u8)b;
    }
    if (L > full * 8) {
      u32 b = 0;
      for (i64 m = full * 8; m < L; ++m) b |= (u32)(p[m] >= 0.0f) << (m - full * 8);
      out[full] = (u8)b;
    }
    return;
  }
  for (i64 i = 0; i < L; ++i) flags[i] = load<DT>(x, off + i) >= 0.0f;
  pack_codes(flags, L, 1, out);
}

template <int W, int DT>
void sign_encode(const void* x, i64 n, i64 chunk, float* scales, u8* packed, int nth) {
  const i64 U = unit_of(chunk);
  const i64 units = (n + U - 1) / U;
  parallel_for(nth, units, [&](i64 u0, i64 u1, int) {
    const i64 e0 = u0 * U, e1 = std::min(n, u1 * U);
    const i64 win = U * std::max<i64>(1, 4096 / U);
    std::vector<u8> flags(win + 8);
    for (i64 w0 = e0; w0 < e1; w0 += win) {  // a window: scales, then bits, x read once
      const i64 w1 = std::min(e1, w0 + win);
      if (scales)
        for (i64 c0 = w0; c0 < w1; c0 += chunk) {
          const i64 L = std::min(chunk, n - c0);
          const float sc = torch_abs_sum<W, DT>(x, c0, L) / (float)L;
          scales[c0 / chunk] = sc != sc ? bits_f32(0x7fc00000u) : sc;  // one canonical NaN
        }
      sign_bits<DT>(x, w0, w1 - w0, flags.data(), packed + w0 / 8);
    }
  });
}

// m[b][l]: the sign bit when bit l of byte b is 0 (the code for -s)
struct SignFlips {
  u32 m[256][8];
  SignFlips() {
    for (int b = 0; b < 256; ++b)
      for (int l = 0; l < 8; ++l) m[b][l] = ((b >> l) & 1) ? 0u : 0x80000000u;
  }
};
const SignFlips& sign_flips() { static const SignFlips t; return t; }

template <int ACC>
void sign_decode_t(const float* s, const u8* packed, i64 n, i64 chunk, float* out, int nth) {
  const i64 U = unit_of(chunk);
  const i64 units = (n + U - 1) / U;
  parallel_for(nth, units, [&](i64 u0, i64 u1, int) {
    const i64 e0 = u0 * U, e1 = std::min(n, u1 * U);
    for (i64 c0 = e0; c0 < e1; c0 += chunk) {
      const i64 c1 = std::min(e1, c0 + chunk);
      const float sc = s[c0 / chunk];
      i64 i = c0;
      for (; i < c1 && (i & 7); ++i) {
        float f = (float)((packed[i >> 3] >> (i & 7)) & 1u);
        f = ((f * 2.0f) - 1.0f) * sc;
        out[i] = ACC ? out[i] + f : f;
      }
      // the reference's ((2 * b) - 1) * s is 1.0f * s or -1.0f * s: both products once per
      // chunk (a NaN scale keeps its sign through either product, unlike -s), then a select
      // -1.0f * s is s with its sign bit flipped, except that a NaN keeps its bits: so the
      // code is a sign-bit mask from a byte -> 8 lanes table, and-ed off for a NaN scale
      const float pos = 1.0f * sc;
      u32 pb;
      std::memcpy(&pb, &pos, 4);
      const u32 fm = sc == sc ? 0x80000000u : 0u;
      const SignFlips& T = sign_flips();
      for (; i + 8 <= c1; i += 8) {
        const u32* t = T.m[packed[i >> 3]];
        for (int m = 0; m < 8; ++m) {
          const u32 w = pb ^ (t[m] & fm);
          float f;
          std::memcpy(&f, &w, 4);
          out[i + m] = ACC ? out[i + m] + f : f;
        }
      }
      for (; i < c1; ++i) {
        float f = (float)((packed[i >> 3] >> (i & 7)) & 1u);
        f = ((f * 2.0f) - 1.0f) * sc;
        out[i] = ACC ? out[i] + f : f;
      }
    }
  });
}

void sign_decode(const float* s, const u8* packed, i64 n, i64 chunk, float* out, int acc, int nth) {
  if (acc) sign_decode_t<1>(s, packed, n, chunk, out, nth);
  else sign_decode_t<0>(s, packed, n, chunk, out, nth);
}

// ---- exact top-k ----------------------------------------------------------------------
// The k largest |x| (keys: |x|'s bits; NaN above inf), ties at the k-th key broken toward
// the lowest indices; indices written ascending. Sampled threshold thr <= the k-th key ->
// candidates {key >= thr} (one pass) -> the k largest (key, -index) among them.
template <int DT>
i64 gather_ge(const void* x, i64 b0, i64 b1, u32 thr, int strict, u32* idx, u32* raw, i64 cap) {
  i64 c = 0;
  const u32 t = strict ? thr + 1 : thr;  // key > thr  <=>  key >= thr + 1 (thr < 2**31)
  i64 i = b0;
  for (; i + 16 <= b1; i += 16) {
    u32 any = 0;
    for (int j = 0; j < 16; ++j) any |= (u32)(mag_key<DT>(x, i + j) >= t);
    if (!any) continue;
    for (int j = 0; j < 16; ++j)
      if (mag_key<DT>(x, i + j) >= t) {
        if (c < cap) {
          idx[c] = (u32)(i + j);
          raw[c] = DT == 0 ? static_cast<const u32*>(x)[i + j] : static_cast<const u16*>(x)[i + j];
        }
        ++c;
      }
  }
  for (; i < b1; ++i)
    if (mag_key<DT>(x, i) >= t) {
      if (c < cap) {
        idx[c] = (u32)i;
        raw[c] = DT == 0 ? static_cast<const u32*>(x)[i] : static_cast<const u16*>(x)[i];
      }
      ++c;
    }
  return c;
}

// parallel gather into per-thread slices of idx/raw (cap each); returns the total, or -1 when
// a slice overflowed; on success the candidates are compacted ascending at idx[0..total)
template <int DT>
i64 gather_all(const void* x, i64 n, u32 thr, int strict, u32* idx, u32* raw, i64 cap, int nth) {
  const i64 units = (n + 65535) / 65536;
  if (nth > units) nth = (int)std::max<i64>(1, units);
  std::vector<i64> cnt(nth, 0);
  parallel_for(nth, nth, [&](i64 t0, i64 t1, int) {
    for (i64 t = t0; t < t1; ++t) {
      i64 b0 = std::min(n, units * t / nth * 65536), b1 = std::min(n, units * (t + 1) / nth * 65536);
      cnt[t] = gather_ge<DT>(x, b0, b1, thr, strict, idx + t * cap, raw + t * cap, cap);
    }
  });
  i64 total = 0;
  for (int t = 0; t < nth; ++t) {
    if (cnt[t] > cap) return -1;
    if (t && cnt[t]) {
      std::memmove(idx + total, idx + t * cap, cnt[t] * 4);
      std::memmove(raw + total, raw + t * cap, cnt[t] * 4);
    }
    total += cnt[t];
  }
  return total;
}

template <int DT> i64 count_ge(const void* x, i64 n, u32 t, int nth) {
  const i64 units = (n + 65535) / 65536;
  std::vector<i64> cnt(std::max(1, nth), 0);
  parallel_for(nth, units, [&](i64 u0, i64 u1, int tid) {
    i64 c = 0;
    const i64 b1 = std::min(n, u1 * 65536);
    for (i64 i = u0 * 65536; i < b1; ++i) c += mag_key<DT>(x, i) >= t;
    cnt[tid] = c;
  });
  i64 c = 0;
  for (i64 v : cnt) c += v;
  return c;
}

inline u64 composite(u32 key, u32 idx) { return ((u64)key << 32) | (u64)(0xffffffffu - idx); }

template <int DT> inline u32 raw_at(const void* x, i64 i) {
  return DT == 0 ? static_cast<const u32*>(x)[i] : static_cast<const u16*>(x)[i];
}
inline u32 key_of_raw(u32 raw, int DT) { return DT == 0 ? raw & 0x7fffffffu : raw & 0x7fffu; }

// Work buffers (caller's, reused): idx, raw: nth * cap u32 each; comp: cap u64.
// Returns the path taken (1 sampled, 2 sampled after lowering, 3 radix fallback).
template <int DT>
int topk_exact(const void* x, i64 n, i64 k, u32* out_idx, void* out_vals, u32* idx, u32* raw,
               u64* comp, i64 cap, int nth) {
  auto emit = [&](i64 j, i64 o, const u32* I, const u32* R) {
    out_idx[o] = I[j];
    if (DT == 0) static_cast<u32*>(out_vals)[o] = R[j];
    else static_cast<u16*>(out_vals)[o] = (u16)R[j];
  };
  if (k >= n) {  // everything, in index order
    for (i64 i = 0; i < n; ++i) {
      out_idx[i] = (u32)i;
      if (DT == 0) static_cast<u32*>(out_vals)[i] = raw_at<DT>(x, i);
      else static_cast<u16*>(out_vals)[i] = (u16)raw_at<DT>(x, i);
    }
    return 0;
  }
  i64 total = -1;
  {
    // the sample: 16 consecutive elements (a cache line of fp32) every `stride` elements
    const i64 want = std::min<i64>(n, std::max<i64>(32768, (i64)((double)n / (double)k * 1024.0)));
    const i64 groups = std::max<i64>(1, want / 16);
    const i64 stride = std::max<i64>(16, n / groups);
    std::vector<u32> smp;
    smp.reserve(groups * 16 + 16);
    for (i64 g = 0; g * stride < n; ++g)
      for (i64 j = g * stride; j < std::min(n, g * stride + 16); ++j) smp.push_back(mag_key<DT>(x, j));
    const i64 m = (i64)smp.size();
    const double p = (double)k * (double)m / (double)n;
    i64 pos = (i64)(p + 4.0 * std::sqrt(p) + 16.0);  // k-th key >= the pos-th sampled key w.h.p.
    for (int attempt = 0; attempt < 2 && total < 0; ++attempt) {
      u32 thr = 0;
      if (pos < m) {
        std::nth_element(smp.begin(), smp.begin() + pos, smp.end(), std::greater<u32>());
        thr = smp[pos];
      }
      i64 t = gather_all<DT>(x, n, thr, 0, idx, raw, cap, nth);
      if (t >= k) total = t;
      else if (t < 0) break;  // too many candidates (ties at a low threshold): radix path
      pos = pos * 4 + 64;
    }
  }
  if (total >= 0) {
    if (total == k) {
      for (i64 j = 0; j < k; ++j) emit(j, j, idx, raw);
      return 1;
    }
    for (i64 j = 0; j < total; ++j) comp[j] = composite(key_of_raw(raw[j], DT), idx[j]);
    std::nth_element(comp, comp + (k - 1), comp + total, std::greater<u64>());
    const u64 kth = comp[k - 1];
    i64 o = 0;
    for (i64 j = 0; j < total; ++j)
      if (composite(key_of_raw(raw[j], DT), idx[j]) >= kth) emit(j, o++, idx, raw);
    return 1;
  }
  // radix fallback: the k-th largest key T bit by bit with counting passes, then every key > T
  // (fewer than k) and the lowest-index keys == T
  u32 T = 0;
  for (int b = (DT == 0 ? 30 : 14); b >= 0; --b)
    if (count_ge<DT>(x, n, T | (1u << b), nth) >= k) T |= 1u << b;
  i64 g = gather_all<DT>(x, n, T, 1, idx, raw, cap, nth);  // g < k <= cap: never overflows
  i64 need = k - g, o = 0, j = 0;
  std::vector<u32> tie_idx(need), tie_raw(need);
  for (i64 i = 0, c = 0; i < n && c < need; ++i)
    if (mag_key<DT>(x, i) == T) { tie_idx[c] = (u32)i; tie_raw[c] = raw_at<DT>(x, i); ++c; }
  i64 t2 = 0;
  while (j < g || t2 < need) {
    if (t2 >= need || (j < g && idx[j] < tie_idx[t2])) emit(j++, o++, idx, raw);
    else emit(t2++, o++, tie_idx.data(), tie_raw.data());
  }
  return 3;
}

// ---- shared_scale (comms/algorithms/shared_scale.py: quantize_reference, decode_reference) ----
// t = clamp(floor(fl(fl(x * inv[c]) + u)), -L, L), NaN -> 0, u = fl(h24 + 0.5) * 2^-24 with
// h24 = lowbias32(i ^ key) >> 8 (hashrng.uniform_into); q = t as int8 (wb 8) or int32, and
// own = fl(t * step[c]) — the torch ops' roundings, one at a time (no FMA: -ffp-contract=off)
// Element j of the given arrays is element base + j of the bucket: the hash and the chunk
// index use base + j, so a part quantized alone gets the bits of the whole (pipelined rounds).
template <int WB>
void ss_quantize_block(const float* x, i64 a, i64 b, i64 base, float iv, float st, float L,
                       u32 key, void* q, float* own) {
  const float SC = 5.9604644775390625e-08f;  // 2**-24
  for (i64 j = a; j < b; ++j) {  // branch-free, so GCC vectorizes it (needs -fno-trapping-math)
    float t = x[j] * iv;
    float v = (float)(int32_t)(lowbias32((u32)(base + j) ^ key) >> 8);
    v = v + 0.5f;
    t = t + v * SC;
    t = std::floor(t);
    t = t < -L ? -L : t;
    t = t > L ? L : t;
    t = t != t ? 0.0f : t;
    if (WB == 8) static_cast<int8_t*>(q)[j] = (int8_t)(int32_t)t;
    else static_cast<int32_t*>(q)[j] = (int32_t)t;
    own[j] = t * st;
  }
}

// local elements [e0, e1) of a part starting at bucket element `base`
void ss_quantize_range(const float* x, i64 base, i64 e0, i64 e1, i64 chunk, const float* inv,
                       const float* step, float L, u32 key, int wb, void* q, float* own) {
  for (i64 c0 = (base + e0) - (base + e0) % chunk; c0 < base + e1; c0 += chunk) {
    const i64 a = std::max(base + e0, c0) - base, b = std::min(base + e1, c0 + chunk) - base;
    const float iv = inv[c0 / chunk], st = step[c0 / chunk];
    if (wb == 8) ss_quantize_block<8>(x, a, b, base, iv, st, L, key, q, own);
    else ss_quantize_block<32>(x, a, b, base, iv, st, L, key, q, own);
  }
}

void ss_decode_range(const void* q, int wb, i64 base, i64 e0, i64 e1, i64 chunk,
                     const float* step, float* out) {
  for (i64 c0 = (base + e0) - (base + e0) % chunk; c0 < base + e1; c0 += chunk) {
    const i64 a = std::max(base + e0, c0) - base, b = std::min(base + e1, c0 + chunk) - base;
    const float st = step[c0 / chunk];
    if (wb == 8)
      for (i64 j = a; j < b; ++j) out[j] = (float)((const int8_t*)q)[j] * st;
    else
      for (i64 j = a; j < b; ++j) out[j] = (float)((const int32_t*)q)[j] * st;
  }
}

}  // namespace

// The fp32 bits of |v| (NaN above inf, as unsigned integers order them): the largest |x| a pass
// wrote is the max of these, for the non-finite flag without another pass.
inline u32 abs_bits(float v) { u32 b; std::memcpy(&b, &v, 4); return b & 0x7fffffffu; }

// *amax <- the max of the threads' partial maxima (amax null: nothing).
inline void store_max(const std::vector<u32>& part, u32* amax) {
  if (!amax) return;
  u32 a = 0;
  for (u32 q : part) a = q > a ? q : a;
  *amax = a;
}

// ---- the C ABI (ctypes) ----------------------------------------------------------------
API int cp_abi_version() { return 8; }

API void cp_qsgd_encode(const void* x, int dt, i64 n, i64 chunk, int bits, u32 key, float* scales,
                        u8* packed, int nth) {
  if (dt == 0) qsgd_encode<0>(x, n, chunk, bits, key, scales, packed, nth);
  else if (dt == 1) qsgd_encode<1>(x, n, chunk, bits, key, scales, packed, nth);
  else qsgd_encode<2>(x, n, chunk, bits, key, scales, packed, nth);
}

API void cp_qsgd_decode(const float* s, const u8* packed, i64 n, i64 chunk, int bits, float* out,
                        int acc, int nth) {
  qsgd_decode(s, packed, n, chunk, bits, out, acc, nth);
}

// lanes: torch's Vectorized<float>::size() (8: AVX2/default, 16: AVX512); scales NULL: bits only
API void cp_sign_encode(const void* x, int dt, i64 n, i64 chunk, int lanes, float* scales,
                        u8* packed, int nth) {
#define SIGN_CASE(W)                                                     \
  if (dt == 0) sign_encode<W, 0>(x, n, chunk, scales, packed, nth);      \
  else if (dt == 1) sign_encode<W, 1>(x, n, chunk, scales, packed, nth); \
  else sign_encode<W, 2>(x, n, chunk, scales, packed, nth);
  if (lanes == 16) { SIGN_CASE(16) } else { SIGN_CASE(8) }
#undef SIGN_CASE
}

API void cp_sign_decode(const float* s, const u8* packed, i64 n, i64 chunk, float* out, int acc,
                        int nth) {
  sign_decode(s, packed, n, chunk, out, acc, nth);
}

API int cp_topk_exact(const void* x, int dt, i64 n, i64 k, u32* out_idx, void* out_vals, u32* idx,
                      u32* raw, u64* comp, i64 cap, int nth) {
  if (dt == 0) return topk_exact<0>(x, n, k, out_idx, out_vals, idx, raw, comp, cap, nth);
  return topk_exact<1>(x, n, k, out_idx, out_vals, idx, raw, comp, cap, nth);  // 16-bit keys
}

// x, q, own (and q, out) point at a part of n elements that starts at bucket element `base`;
// inv and step are the whole bucket's per-chunk arrays
API void cp_ss_quantize(const float* x, i64 n, i64 base, i64 chunk, const float* inv,
                        const float* step, float L, u32 key, int wb, void* q, float* own, int nth) {
  const i64 U = 1 << 16;
  parallel_for(nth, (n + U - 1) / U, [&](i64 u0, i64 u1, int) {
    ss_quantize_range(x, base, u0 * U, std::min(n, u1 * U), chunk, inv, step, L, key, wb, q, own);
  });
}

API void cp_ss_decode(const void* q, int wb, i64 n, i64 base, i64 chunk, const float* step,
                      float* out, int nth) {
  const i64 U = 1 << 16;
  parallel_for(nth, (n + U - 1) / U, [&](i64 u0, i64 u1, int) {
    ss_decode_range(q, wb, base, u0 * U, std::min(n, u1 * U), chunk, step, out);
  });
}

// DGC momentum correction in one pass (fp32): x <- x / div; u <- u * m + x; x <- u (+ r).
// The torch twin is ErrorFeedback.momentum_ / momentum_residual_ after x.div_(div): the
// same three or four roundings, in that order.
// amax (if not null): the largest |x| written, as its fp32 bits (NaN above inf; an unsigned
// max, so the loop still vectorizes) — the hook's non-finite check, read here instead of in
// one more pass over the bucket.
API void cp_momentum(float* x, float* u, const float* r, i64 n, float div, float m, u32* amax,
                     int nth) {
  const i64 U = 1 << 16;
  const i64 units = (n + U - 1) / U;
  std::vector<u32> part(std::max(1, nth), 0u);
  parallel_for(nth, units, [&](i64 u0, i64 u1, int t) {
    const i64 e1 = std::min(n, u1 * U);
    u32 mx = 0;
    if (r) {
      for (i64 i = u0 * U; i < e1; ++i) {
        float v = u[i] * m;
        v = v + x[i] / div;
        u[i] = v;
        const float w = v + r[i];
        x[i] = w;
        const u32 b = abs_bits(w);
        mx = b > mx ? b : mx;
      }
    } else {
      for (i64 i = u0 * U; i < e1; ++i) {
        float v = u[i] * m;
        v = v + x[i] / div;
        u[i] = v;
        x[i] = v;
        const u32 b = abs_bits(v);
        mx = b > mx ? b : mx;
      }
    }
    part[t] = mx;
  });
  store_max(part, amax);
}

// The error-feedback update after a sparsifier's round, with momentum factor masking, in one
// pass (fp32): r <- x - own, and u <- 0 where the masking rule holds (u null: no masking):
//   agg null (DGC, "sent"):  where own != 0 (this rank sent a value);
//   agg given ("held"):      where own != 0 and agg == 0 (the aggregate came back without it).
// The torch twin is torch.sub(x, own, out=r) then u.masked_fill_(rule, 0): the same bits
// (NaN != 0, -0 == 0).
API void cp_ef_update(const float* x, const float* own, const float* agg, float* r, float* u,
                      i64 n, int nth) {
  const i64 U = 1 << 16;
  parallel_for(nth, (n + U - 1) / U, [&](i64 u0, i64 u1, int) {
    const i64 e0 = u0 * U, e1 = std::min(n, u1 * U);
    if (!u) {
      for (i64 i = e0; i < e1; ++i) r[i] = x[i] - own[i];
    } else if (!agg) {
      for (i64 i = e0; i < e1; ++i) {
        const float o = own[i];
        r[i] = x[i] - o;
        if (o != 0.0f) u[i] = 0.0f;
      }
    } else {
      for (i64 i = e0; i < e1; ++i) {
        const float o = own[i];
        r[i] = x[i] - o;
        if (o != 0.0f && agg[i] == 0.0f) u[i] = 0.0f;
      }
    }
  });
}

// random-k's shared indices (compressors/randomk.py: shared_indices): out[i] = the keyed
// bijection of m-bit integers applied to i, cycle-walked until < numel (the orbit returns to
// i < numel, so the walk ends); the same integer arithmetic as the torch twin.
API void cp_randomk_indices(i64 numel, i64 k, int m, u64 k1, u64 k2, i64* out, int nth) {
  const u64 mask = m >= 64 ? ~0ull : ((1ull << m) - 1), A = 0x2545F491ull, B = 0x6C8E9CF5ull;
  const int sh = (m + 1) / 2;
  const i64 U = 1 << 14;
  parallel_for(nth, (k + U - 1) / U, [&](i64 u0, i64 u1, int) {
    const i64 e1 = std::min(k, u1 * U);
    for (i64 i = u0 * U; i < e1; ++i) {
      u64 y = (u64)i;
      do {
        y = (y ^ k1) & mask;
        y = (y * A) & mask;
        y ^= y >> sh;
        y = (y * B) & mask;
        y ^= y >> sh;
        y = (y + k2) & mask;
      } while (y >= (u64)numel);
      out[i] = (i64)y;
    }
  });
}

// The error-feedback residual of PowerSGD's own factors for one matrix, res <- x - P Q^T
// (p: rows x r, q: r x cols, both row-major), P Q^T summed in the order of
// compressors/reproducible.py's outer_sum_into: acc = p0 q0, then acc = acc + pk qk, each
// product and sum rounded once. Saves writing and re-reading a bucket-sized decoded temporary.
API void cp_outer_residual(const float* x, float* res, i64 rows, i64 cols, int r, const float* p,
                           const float* q, int nth) {
  parallel_for(nth, rows, [&](i64 i0, i64 i1, int) {
    for (i64 i = i0; i < i1; ++i) {
      const float* pi = p + i * r;
      const float p0 = pi[0];
      const i64 o = i * cols;
      if (r == 1) {  // the default rank: one product per element, vectorized
        for (i64 j = 0; j < cols; ++j) { const float a = p0 * q[j]; res[o + j] = x[o + j] - a; }
        continue;
      }
      for (i64 j = 0; j < cols; ++j) {
        float acc = p0 * q[j];
        for (int k = 1; k < r; ++k) {
          float t = pi[k] * q[k * cols + j];
          acc = acc + t;
        }
        res[o + j] = x[o + j] - acc;
      }
    }
  });
}

// cp_outer_residual and the aggregate's decode in one pass (fp32): res <- x - P Qo^T, then
// x <- P Qs^T (Qo: this rank's Q factors, Qs: the summed ones; both r x cols, row-major), each
// product summed in outer_sum_into's order. x is read once and written once instead of being
// read by the residual pass and rewritten by a separate decode.
API void cp_outer_residual_into(float* x, float* res, i64 rows, i64 cols, int r, const float* p,
                                const float* qo, const float* qs, int nth) {
  parallel_for(nth, rows, [&](i64 i0, i64 i1, int) {
    for (i64 i = i0; i < i1; ++i) {
      const float* pi = p + i * r;
      const float p0 = pi[0];
      const i64 o = i * cols;
      if (r == 1) {
        for (i64 j = 0; j < cols; ++j) {
          const float a = p0 * qo[j], b = p0 * qs[j];
          res[o + j] = x[o + j] - a;
          x[o + j] = b;
        }
        continue;
      }
      for (i64 j = 0; j < cols; ++j) {
        float a = p0 * qo[j], b = p0 * qs[j];
        for (int k = 1; k < r; ++k) {
          float t = pi[k] * qo[k * cols + j];
          a = a + t;
          float u = pi[k] * qs[k * cols + j];
          b = b + u;
        }
        res[o + j] = x[o + j] - a;
        x[o + j] = b;
      }
    }
  });
}

// This rank's share plus its residual in one pass (fp32): x <- x / div + r. The torch twin is
// x.div_(div) then x.add_(r): the same two roundings, in that order.
API void cp_div_add(float* x, const float* r, i64 n, float div, u32* amax, int nth) {
  const i64 U = 1 << 16;
  std::vector<u32> part(std::max(1, nth), 0u);
  parallel_for(nth, (n + U - 1) / U, [&](i64 u0, i64 u1, int t) {
    const i64 e1 = std::min(n, u1 * U);
    u32 mx = 0;
    for (i64 i = u0 * U; i < e1; ++i) {
      float v = x[i] / div;
      v = v + r[i];
      x[i] = v;
      const u32 b = abs_bits(v);
      mx = b > mx ? b : mx;
    }
    part[t] = mx;
  });
  store_max(part, amax);
}

// A cast compressor's (fp16 / bf16: wdt 1 / 2) allreduce round, finished in one pass over the
// fp32 bucket x: r <- x - widen(narrow(x)) (this rank's rounding error, error feedback's
// residual; skipped where r is null), then x <- widen(sum) (the aggregate, summed in the wire
// dtype; skipped where sum is null). The torch twin is torch.sub(x, x.to(w).to(f32), out=r)
// then x.copy_(sum): the same bits (narrowing rounds to nearest even, widening is exact).
template <int WDT>
void cast_finish_range(float* x, float* r, const u16* sum, i64 e0, i64 e1) {
  i64 i = e0;
#ifdef __F16C__
  // F16C rounds to nearest even like the software pair below (only NaN payloads may differ)
  if (WDT == 1) {
    for (; i + 8 <= e1; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      if (r) {
        const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_ps(r + i, _mm256_sub_ps(v, _mm256_cvtph_ps(h)));
      }
      if (sum) _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sum + i))));
    }
  }
#endif
  for (; i < e1; ++i) {
    const float v = x[i];
    if (r) r[i] = v - (WDT == 1 ? f16_to_f32(f32_to_f16(v)) : bits_f32((u32)f32_to_bf16(v) << 16));
    if (sum) x[i] = WDT == 1 ? f16_to_f32(sum[i]) : bits_f32((u32)sum[i] << 16);
  }
}

API void cp_cast_finish(float* x, float* r, const u16* sum, int wdt, i64 n, int nth) {
  const i64 U = 1 << 16;
  parallel_for(nth, (n + U - 1) / U, [&](i64 u0, i64 u1, int) {
    const i64 e0 = u0 * U, e1 = std::min(n, u1 * U);
    if (wdt == 1) cast_finish_range<1>(x, r, sum, e0, e1);
    else cast_finish_range<2>(x, r, sum, e0, e1);
  });
}

// The outer sync's send of one parameter in one pass (fp32): local <- p (what this rank held
// when it sent; skipped where local is null), d <- (anchor - p) / div (this rank's share of
// the pseudo-gradient). amax (if not null): the largest |d| written, as its fp32 bits (NaN
// above inf), for the non-finite flag without another pass. The torch twin is the parameter's
// copy into local, torch.sub(anchor, p, out=d), then d.div_(div): the same bits.
API void cp_outer_sync_send(const float* __restrict__ anchor, const float* __restrict__ p,
                            float* __restrict__ d, float* __restrict__ local, i64 n, float div,
                            u32* amax, int nth) {
  const i64 U = 1 << 16;
  std::vector<u32> part(std::max(1, nth), 0u);
  parallel_for(nth, (n + U - 1) / U, [&](i64 u0, i64 u1, int t) {
    const i64 e1 = std::min(n, u1 * U);
    i64 i = u0 * U;
    u32 mx = 0;
    auto one = [&](i64 k) {
      const float v = p[k];
      if (local) local[k] = v;
      const float q = (anchor[k] - v) / div;
      d[k] = q;
      const u32 b = abs_bits(q);
      mx = b > mx ? b : mx;
    };
#ifdef __AVX2__
    // streaming stores: the outputs are far larger than the caches (no read for ownership)
    auto misaligned = [&](i64 k) { return (((uintptr_t)(d + k)) | (local ? (uintptr_t)(local + k) : 0)) & 31; };
    for (; i < e1 && misaligned(i); ++i) one(i);
    if (!misaligned(i)) {
      const __m256 dv = _mm256_set1_ps(div);
      const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
      __m256i vmx = _mm256_setzero_si256();
      for (; i + 8 <= e1; i += 8) {
        const __m256 v = _mm256_loadu_ps(p + i);
        if (local) _mm256_stream_ps(local + i, v);
        const __m256 q = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(anchor + i), v), dv);
        _mm256_stream_ps(d + i, q);
        vmx = _mm256_max_epu32(vmx, _mm256_and_si256(_mm256_castps_si256(q), abs_mask));
      }
      _mm_sfence();
      alignas(32) u32 lanes[8];
      _mm256_store_si256((__m256i*)lanes, vmx);
      for (u32 b : lanes) mx = b > mx ? b : mx;
    }
#endif
    for (; i < e1; ++i) one(i);
    part[t] = part[t] > mx ? part[t] : mx;
  });
  store_max(part, amax);
}

// The outer sync's landing of one parameter in one pass (fp32): where avg is set, the plain
// average's step anchor <- anchor - avg; then p <- p + (anchor - local) where local is set
// (the delayed update plus what this rank trained meanwhile), else p <- anchor. The torch twin
// is anchor.sub_(avg), then p.add_(anchor - local) or p.copy_(anchor): the same bits.
API void cp_outer_sync_land(float* __restrict__ anchor, const float* __restrict__ avg,
                            const float* __restrict__ local, float* __restrict__ p, i64 n, int nth) {
  const i64 U = 1 << 16;
  parallel_for(nth, (n + U - 1) / U, [&](i64 u0, i64 u1, int) {
    const i64 e1 = std::min(n, u1 * U);
    for (i64 i = u0 * U; i < e1; ++i) {
      float a = anchor[i];
      if (avg) { a = a - avg[i]; anchor[i] = a; }
      if (local) { const float m = a - local[i]; p[i] = p[i] + m; }
      else p[i] = a;
    }
  });
}
