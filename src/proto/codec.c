/*
 * codec.c - the value codecs of proto/codec.h: fp16, bf16, int8 and top-k, with the
 * error each leaves (for error feedback).
 *
 * Each of fp16, bf16 and int8 has portable loops (the reference: every path gives the
 * same bits) and x86 kernels written with intrinsics: F16C for fp16, AVX2 for int8 and
 * bf16, chosen at run time from what the CPU says (asked once), so one binary is fast
 * on a current CPU and still runs on any x86-64. A kernel encodes and computes the
 * error in the same pass. Top-k finds its threshold with a histogram of the values'
 * top bits, then a quickselect over the one bucket that holds the k-th largest.
 */
#include "proto/codec.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

/* ---------------------------------------------------------------- names */

const char *ps__codec_name(uint32_t kind) {
  switch (kind) {
  case PS_CODEC_RAW: return "raw";
  case PS_CODEC_FP16: return "fp16";
  case PS_CODEC_BF16: return "bf16";
  case PS_CODEC_INT8: return "int8";
  case PS_CODEC_TOPK: return "topk";
  }
  return "unknown";
}

int ps__codec_parse(const char *s, ps__codec *out) {
  ps__codec c = {0};
  if (!s) return -1;
  if (!strcmp(s, "none")) c.kind = PS_CODEC_RAW;
  else if (!strcmp(s, "fp16")) c.kind = PS_CODEC_FP16;
  else if (!strcmp(s, "bf16")) c.kind = PS_CODEC_BF16;
  else if (!strcmp(s, "int8")) c.kind = PS_CODEC_INT8;
  else if (!strncmp(s, "topk:", 5)) {
    float f;
    if (ps__parse_float(s + 5, &f) || !(f > 0.0f) || !isfinite(f)) return -1;
    if (f >= 1.0f && (f != floorf(f) || f > 4294967295.0f)) return -1;
    c.kind = PS_CODEC_TOPK;
    c.topk = f;
  } else {
    return -1;
  }
  *out = c;
  return 0;
}

void ps__codec_format(const ps__codec *c, char *buf, size_t cap) {
  if (c->kind == PS_CODEC_TOPK) {
    for (int prec = 6; prec <= 9; prec++) { /* the shortest text that reads back the same */
      snprintf(buf, cap, "topk:%.*g", prec, (double)c->topk);
      float f;
      if (!ps__parse_float(buf + 5, &f) && f == c->topk) break;
    }
  } else
    snprintf(buf, cap, "%s", c->kind == PS_CODEC_RAW ? "none" : ps__codec_name(c->kind));
}

size_t ps__codec_topk_count(const ps__codec *c, size_t n) {
  if (n == 0) return 0;
  if (c->topk >= 1.0f) return (double)c->topk >= (double)n ? n : (size_t)c->topk;
  double k = ceil((double)c->topk * (double)n);
  return k >= (double)n ? n : k < 1 ? 1 : (size_t)k;
}

static size_t size_of(uint32_t kind, size_t n, size_t k) {
  switch (kind) {
  case PS_CODEC_RAW: return n > SIZE_MAX / 4 ? SIZE_MAX : n * 4;
  case PS_CODEC_FP16:
  case PS_CODEC_BF16: return n > SIZE_MAX / 2 ? SIZE_MAX : n * 2;
  case PS_CODEC_INT8: {
    size_t nb = n / PS_CODEC_INT8_BLOCK + (n % PS_CODEC_INT8_BLOCK != 0);
    return n > SIZE_MAX / 2 ? SIZE_MAX : n + 4 * nb;
  }
  case PS_CODEC_TOPK: return k > SIZE_MAX / 8 ? SIZE_MAX : k * 8;
  }
  return SIZE_MAX;
}

size_t ps__codec_size(const ps__codec *c, size_t n) {
  return size_of(c->kind, n, c->kind == PS_CODEC_TOPK ? ps__codec_topk_count(c, n) : 0);
}

/* ---------------------------------------------------------------- scalar conversions */

static inline uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
static inline float float_of(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

uint16_t ps__f32_to_f16(float x) {
  uint32_t u = bits_of(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) /* Inf, or NaN made quiet with the top of its payload (as F16C) */
    return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7bffu); /* >= 65520 would round to Inf: saturate */
  if (a < 0x38800000u) {
    /* Below fp16's smallest normal: adding 0.5 lines the f32 ulp up with fp16's
     * subnormal step (2^-24), so the FPU's round-to-nearest-even does the rounding. */
    float f = float_of(a) + 0.5f;
    return (uint16_t)(sign | (bits_of(f) - 0x3f000000u));
  }
  a += 0xfffu + ((a >> 13) & 1u) - (112u << 23); /* rebias; round to nearest even */
  return (uint16_t)(sign | (a >> 13));
}

float ps__f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
    return float_of(sign | bits_of(v));
  }
  if (e == 31) /* Inf, or NaN made quiet (as F16C) */
    return float_of(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0));
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t ps__f32_to_bf16(float x) {
  uint32_t u = bits_of(x), a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN (quiet) */
  uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
  if (a != 0x7f800000u && (r & 0x7f800000u) == 0x7f800000u) r = (u & 0x80000000u) | 0x7f7f0000u; /* saturate */
  return (uint16_t)(r >> 16);
}

float ps__bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

/* The error kept for a value: in - decoded, 0 for a non-finite input (it is refused
 * downstream; feeding it back would poison every later vector). */
static inline float err_of(float in, float dec) {
  float d = in - dec;
  return isfinite(in) ? d : 0.0f;
}

/* ---------------------------------------------------------------- vector dispatch */

/* What the CPU offers, asked once: F16C (with AVX) for fp16, AVX2 for int8 and bf16.
 * vec_allowed lets tests run the portable loops on the same CPU. */
enum { VEC_F16C = 1, VEC_AVX2 = 2 };
static int vec_allowed = 1;

static int vec_level(void) {
#ifdef HAVE_X86
  static int level = -1; /* a benign race: every thread computes the same answer */
  int l = __atomic_load_n(&level, __ATOMIC_RELAXED);
  if (l < 0) {
    __builtin_cpu_init();
    l = 0;
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) l |= VEC_F16C;
    if (__builtin_cpu_supports("avx2")) l |= VEC_AVX2;
    __atomic_store_n(&level, l, __ATOMIC_RELAXED);
  }
  return __atomic_load_n(&vec_allowed, __ATOMIC_RELAXED) ? l : 0;
#else
  return 0;
#endif
}

void ps__codec_set_vector(int on) { __atomic_store_n(&vec_allowed, on != 0, __ATOMIC_RELAXED); }

#ifdef HAVE_X86
#define TARGET_F16C __attribute__((target("avx,f16c")))
#define TARGET_AVX2 __attribute__((target("avx2,f16c")))
#endif

/* ---------------------------------------------------------------- fp16 */

static void f16_enc_scalar(const float *in, size_t n, uint8_t *out, float *err) {
  for (size_t i = 0; i < n; i++) {
    float x = in[i];
    uint16_t h = ps__f32_to_f16(x);
    ps__put_u16(out + 2 * i, h);
    if (err) err[i] = err_of(x, ps__f16_to_f32(h));
  }
}

static void f16_dec_scalar(const uint8_t *in, size_t n, float *out) {
  for (size_t i = 0; i < n; i++) out[i] = ps__f16_to_f32(ps__get_u16(in + 2 * i));
}

#ifdef HAVE_X86
/* Eight values: saturate finite values beyond fp16's range (min(65504, |x|) keeps a
 * NaN, its second operand; the max puts an Inf back), then the hardware's RNE. */
TARGET_F16C static inline __m128i f16_enc8(__m256 x, __m256 *fin) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 lim = _mm256_set1_ps(65504.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 a = _mm256_and_ps(x, absmask);
  if (_mm256_movemask_ps(_mm256_cmp_ps(a, lim, _CMP_LT_OQ)) == 0xff) { /* the usual case: all within range */
    *fin = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  __m256 c = _mm256_max_ps(_mm256_and_ps(_mm256_cmp_ps(a, inf, _CMP_EQ_OQ), inf), _mm256_min_ps(lim, a));
  *fin = _mm256_cmp_ps(a, inf, _CMP_LT_OQ);
  return _mm256_cvtps_ph(_mm256_or_ps(c, _mm256_andnot_ps(absmask, x)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

TARGET_F16C static void f16_enc_f16c(const float *in, size_t n, uint8_t *out, float *err) {
  size_t i = 0;
  __m256 fin;
  if (err) {
    for (; i + 8 <= n; i += 8) {
      __m256 x = _mm256_loadu_ps(in + i);
      __m128i h = f16_enc8(x, &fin);
      _mm_storeu_si128((__m128i *)(void *)(out + 2 * i), h);
      _mm256_storeu_ps(err + i, _mm256_and_ps(_mm256_sub_ps(x, _mm256_cvtph_ps(h)), fin));
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      __m128i h0 = f16_enc8(_mm256_loadu_ps(in + i), &fin), h1 = f16_enc8(_mm256_loadu_ps(in + i + 8), &fin);
      _mm_storeu_si128((__m128i *)(void *)(out + 2 * i), h0);
      _mm_storeu_si128((__m128i *)(void *)(out + 2 * i + 16), h1);
    }
  }
  f16_enc_scalar(in + i, n - i, out + 2 * i, err ? err + i : NULL);
}

TARGET_F16C static void f16_dec_f16c(const uint8_t *in, size_t n, float *out) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i h0 = _mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i));
    __m128i h1 = _mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i + 16));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h0));
    _mm256_storeu_ps(out + i + 8, _mm256_cvtph_ps(h1));
  }
  f16_dec_scalar(in + 2 * i, n - i, out + i);
}
#endif

static void f16_encode(const float *in, size_t n, uint8_t *out, float *err) {
#ifdef HAVE_X86
  if (vec_level() & VEC_F16C) {
    f16_enc_f16c(in, n, out, err);
    return;
  }
#endif
  f16_enc_scalar(in, n, out, err);
}

static void f16_decode(const uint8_t *in, size_t n, float *out) {
#ifdef HAVE_X86
  if (vec_level() & VEC_F16C) {
    f16_dec_f16c(in, n, out);
    return;
  }
#endif
  f16_dec_scalar(in, n, out);
}

/* ---------------------------------------------------------------- bf16 */

/* The portable loops: branch-free forms of the scalar conversions, which vectorise. */
static void bf16_enc_loop(const float *in, size_t n, uint8_t *out, float *err) {
  for (size_t i = 0; i < n; i++) {
    uint32_t u = bits_of(in[i]), a = u & 0x7fffffffu;
    uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
    uint32_t sat = (u & 0x80000000u) | 0x7f7f0000u;
    r = (a != 0x7f800000u && (r & 0x7f800000u) == 0x7f800000u) ? sat : r;
    r = a > 0x7f800000u ? u | 0x00400000u : r;
    if (err) err[i] = a < 0x7f800000u ? in[i] - float_of(r & 0xffff0000u) : 0.0f;
    ps__put_u16(out + 2 * i, (uint16_t)(r >> 16));
  }
}

static void bf16_dec_loop(const uint8_t *in, size_t n, float *out) {
  for (size_t i = 0; i < n; i++) out[i] = float_of((uint32_t)ps__get_u16(in + 2 * i) << 16);
}

#ifdef HAVE_X86
/* Eight values of bf16_enc_loop, as f32 bits rounded (the decoded value in the high
 * half); *fin gets the finite lanes. */
TARGET_AVX2 static inline __m256i bf16_enc8(__m256i u, __m256i *fin) {
  const __m256i absm = _mm256_set1_epi32(0x7fffffff), infb = _mm256_set1_epi32(0x7f800000);
  __m256i a = _mm256_and_si256(u, absm);
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                   _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  __m256i sat = _mm256_or_si256(_mm256_andnot_si256(absm, u), _mm256_set1_epi32(0x7f7f0000));
  __m256i over = _mm256_andnot_si256(_mm256_cmpeq_epi32(a, infb), _mm256_cmpeq_epi32(_mm256_and_si256(r, infb), infb));
  r = _mm256_or_si256(_mm256_andnot_si256(over, r), _mm256_and_si256(over, sat));
  __m256i nan = _mm256_cmpgt_epi32(a, infb);
  r = _mm256_or_si256(_mm256_andnot_si256(nan, r), _mm256_and_si256(nan, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000))));
  *fin = _mm256_cmpgt_epi32(infb, a);
  return r;
}

TARGET_AVX2 static void bf16_enc_avx2(const float *in, size_t n, uint8_t *out, float *err) {
  const __m256i hi = _mm256_set1_epi32((int)0xffff0000u), absm = _mm256_set1_epi32(0x7fffffff);
  const __m256i edge = _mm256_set1_epi32(0x7f7f7fff), half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 x0 = _mm256_loadu_ps(in + i), x1 = _mm256_loadu_ps(in + i + 8);
    __m256i u0 = _mm256_castps_si256(x0), u1 = _mm256_castps_si256(x1);
    __m256i big = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_and_si256(u0, absm), edge),
                                  _mm256_cmpgt_epi32(_mm256_and_si256(u1, absm), edge));
    __m256i f0, f1, r0, r1;
    if (_mm256_testz_si256(big, big)) { /* the usual case: finite, and no rounding reaches Inf */
      r0 = _mm256_add_epi32(u0, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u0, 16), one)));
      r1 = _mm256_add_epi32(u1, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u1, 16), one)));
      f0 = f1 = _mm256_set1_epi32(-1);
    } else {
      r0 = bf16_enc8(u0, &f0);
      r1 = bf16_enc8(u1, &f1);
    }
    if (err) {
      __m256 d0 = _mm256_castsi256_ps(_mm256_and_si256(r0, hi)), d1 = _mm256_castsi256_ps(_mm256_and_si256(r1, hi));
      _mm256_storeu_ps(err + i, _mm256_and_ps(_mm256_sub_ps(x0, d0), _mm256_castsi256_ps(f0)));
      _mm256_storeu_ps(err + i + 8, _mm256_and_ps(_mm256_sub_ps(x1, d1), _mm256_castsi256_ps(f1)));
    }
    __m256i h = _mm256_packus_epi32(_mm256_srli_epi32(r0, 16), _mm256_srli_epi32(r1, 16));
    _mm256_storeu_si256((__m256i *)(void *)(out + 2 * i), _mm256_permute4x64_epi64(h, 0xd8));
  }
  bf16_enc_loop(in + i, n - i, out + 2 * i, err ? err + i : NULL);
}

TARGET_AVX2 static void bf16_dec_avx2(const uint8_t *in, size_t n, float *out) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(const void *)(in + 2 * i)), 0xd8);
    __m256i z = _mm256_setzero_si256();
    _mm256_storeu_si256((__m256i *)(void *)(out + i), _mm256_unpacklo_epi16(z, h));
    _mm256_storeu_si256((__m256i *)(void *)(out + i + 8), _mm256_unpackhi_epi16(z, h));
  }
  bf16_dec_loop(in + 2 * i, n - i, out + i);
}
#endif

static void bf16_encode(const float *in, size_t n, uint8_t *out, float *err) {
#ifdef HAVE_X86
  if (vec_level() & VEC_AVX2) {
    bf16_enc_avx2(in, n, out, err);
    return;
  }
#endif
  bf16_enc_loop(in, n, out, err);
}

static void bf16_decode(const uint8_t *in, size_t n, float *out) {
#ifdef HAVE_X86
  if (vec_level() & VEC_AVX2) {
    bf16_dec_avx2(in, n, out);
    return;
  }
#endif
  bf16_dec_loop(in, n, out);
}

/* ---------------------------------------------------------------- int8 */

#define RNE_MAGIC 12582912.0f /* 1.5 * 2^23: (v + M) - M rounds |v| < 2^22 to nearest even */

/* max |x| of a block as f32 bits (NaN above every finite value and Inf). */
static uint32_t int8_maxbits(const float *x, size_t m) {
  uint32_t mx = 0;
  for (size_t i = 0; i < m; i++) {
    uint32_t u = bits_of(x[i]) & 0x7fffffffu;
    mx = u > mx ? u : mx;
  }
  return mx;
}

/* A block's scale from its max |x| bits; *inv gets 1 / scale, or 0 for a block sent as
 * zeros (all zero, or so small that no scale is representable) or as NaN (non-finite). */
static float int8_scale(uint32_t mb, float *inv) {
  *inv = 0.0f;
  if (mb >= 0x7f800000u) return NAN; /* the block decodes as NaN, refused downstream */
  float mx = float_of(mb), s = mx / 127.0f, v = 127.0f / mx;
  if (s == 0.0f || !isfinite(v)) return 0.0f;
  *inv = v;
  return s;
}

/* A block whose values are not quantised (inv == 0): zeros. The error is the value
 * itself where it is finite (nothing of it arrives), 0 where it is not. */
static void int8_block_flat(const float *x, size_t m, int8_t *q, float *err) {
  if (err)
    for (size_t i = 0; i < m; i++) err[i] = isfinite(x[i]) ? x[i] : 0.0f;
  memset(q, 0, m);
}

/* The portable loops of one block: its scale, then its values (4 + m bytes). */
static void int8_block_loop(const float *x, size_t m, uint8_t *out, float *err) {
  float inv, s = int8_scale(int8_maxbits(x, m), &inv);
  int8_t *q = (int8_t *)(out + 4);
  ps__put_u32(out, bits_of(s));
  if (inv == 0.0f) {
    int8_block_flat(x, m, q, err);
    return;
  }
  for (size_t i = 0; i < m; i++) {
    float v = x[i] * inv;
    v = v > 127.0f ? 127.0f : v;
    v = v < -127.0f ? -127.0f : v;
    v = (v + RNE_MAGIC) - RNE_MAGIC;
    q[i] = (int8_t)(int32_t)v;
  }
  if (err) /* every value of a quantised block is finite */
    for (size_t i = 0; i < m; i++) err[i] = x[i] - (float)q[i] * s;
}

/* 0 if q[0..m) is clean, else -1 (a -128). */
static int int8_dec_loop(const int8_t *q, size_t m, float s, float *out) {
  int bad = 0;
  for (size_t i = 0; i < m; i++) bad |= q[i] == -128;
  for (size_t i = 0; i < m; i++) out[i] = (float)q[i] * s;
  return bad ? -1 : 0;
}

#ifdef HAVE_X86
/* max |x| bits of a whole block (PS_CODEC_INT8_BLOCK values), as int8_maxbits. */
TARGET_AVX2 static inline uint32_t int8_maxbits_avx2(const float *x) {
  const __m256i absm = _mm256_set1_epi32(0x7fffffff);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
  for (size_t i = 0; i < PS_CODEC_INT8_BLOCK; i += 32) {
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)(x + i)), absm));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)(x + i + 8)), absm));
    m2 = _mm256_max_epu32(m2, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)(x + i + 16)), absm));
    m3 = _mm256_max_epu32(m3, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)(x + i + 24)), absm));
  }
  __m256i m = _mm256_max_epu32(_mm256_max_epu32(m0, m1), _mm256_max_epu32(m2, m3));
  __m128i t = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  t = _mm_max_epu32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_max_epu32(t, _mm_shuffle_epi32(t, 0xb1));
  return (uint32_t)_mm_cvtsi128_si32(t);
}

/* The values of a whole block of int8_block_loop, scale s = 1 / inv (inv != 0), into
 * q[0..PS_CODEC_INT8_BLOCK). cvtps_epi32 rounds to nearest even, as the magic number
 * does. The loop's clamps are left out: |x| <= max|x| makes |x * inv| < 127.5 (two
 * roundings of 1 + 2^-24 at most), so q is within -127..127 without them. */
TARGET_AVX2 static inline void int8_quant_avx2(const float *x, float s, float inv, uint8_t *q, float *err) {
  const __m256 vinv = _mm256_set1_ps(inv), vs = _mm256_set1_ps(s);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (size_t i = 0; i < PS_CODEC_INT8_BLOCK; i += 32) {
    __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
    __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, vinv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, vinv));
    __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, vinv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, vinv));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256((__m256i *)(void *)(q + i), _mm256_permutevar8x32_epi32(p, order));
    if (err) {
      _mm256_storeu_ps(err + i, _mm256_sub_ps(x0, _mm256_mul_ps(_mm256_cvtepi32_ps(q0), vs)));
      _mm256_storeu_ps(err + i + 8, _mm256_sub_ps(x1, _mm256_mul_ps(_mm256_cvtepi32_ps(q1), vs)));
      _mm256_storeu_ps(err + i + 16, _mm256_sub_ps(x2, _mm256_mul_ps(_mm256_cvtepi32_ps(q2), vs)));
      _mm256_storeu_ps(err + i + 24, _mm256_sub_ps(x3, _mm256_mul_ps(_mm256_cvtepi32_ps(q3), vs)));
    }
  }
}

/* One whole block: scale, then values, as int8_block_loop. */
TARGET_AVX2 static inline void int8_block_avx2(const float *x, uint32_t mb, uint8_t *out, float *err) {
  float inv, s = int8_scale(mb, &inv);
  ps__put_u32(out, bits_of(s));
  if (inv == 0.0f) int8_block_flat(x, PS_CODEC_INT8_BLOCK, (int8_t *)(out + 4), err);
  else int8_quant_avx2(x, s, inv, out + 4, err);
}

#define INT8_GROUP 4 /* blocks whose maxima are found before any of them is quantised */

/* nb whole blocks of in[] into out (4 + PS_CODEC_INT8_BLOCK bytes each). In groups of
 * INT8_GROUP blocks (16 KiB of input at most, still in L1 for the second pass): the
 * maxima of the group first, then each block's scale and values, so that one block's
 * horizontal maximum and divisions overlap the others' loads instead of stalling them. */
TARGET_AVX2 static void int8_enc_avx2(const float *in, size_t nb, uint8_t *out, float *err) {
  const size_t bs = PS_CODEC_INT8_BLOCK, os = 4 + PS_CODEC_INT8_BLOCK;
  size_t b = 0;
  for (; b + INT8_GROUP <= nb; b += INT8_GROUP) {
    uint32_t mb[INT8_GROUP];
    for (size_t j = 0; j < INT8_GROUP; j++) mb[j] = int8_maxbits_avx2(in + (b + j) * bs);
    for (size_t j = 0; j < INT8_GROUP; j++)
      int8_block_avx2(in + (b + j) * bs, mb[j], out + (b + j) * os, err ? err + (b + j) * bs : NULL);
  }
  for (; b < nb; b++)
    int8_block_avx2(in + b * bs, int8_maxbits_avx2(in + b * bs), out + b * os, err ? err + b * bs : NULL);
}

/* The values of a whole block of int8_dec_loop: 0, or -1 if a value is -128. */
TARGET_AVX2 static inline int int8_dec_block_avx2(const int8_t *q, float s, float *out) {
  const __m256 vs = _mm256_set1_ps(s);
  const __m256i m128 = _mm256_set1_epi8(-128);
  __m256i bad = _mm256_setzero_si256();
  for (size_t i = 0; i < PS_CODEC_INT8_BLOCK; i += 32) {
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(const void *)(q + i)), m128));
    /* sign-extending loads of 8 bytes each: no shuffles to split a 32-byte load */
    __m256i v0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(q + i)));
    __m256i v1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(q + i + 8)));
    __m256i v2 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(q + i + 16)));
    __m256i v3 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(q + i + 24)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(v0), vs));
    _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(v1), vs));
    _mm256_storeu_ps(out + i + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(v2), vs));
    _mm256_storeu_ps(out + i + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(v3), vs));
  }
  return _mm256_testz_si256(bad, bad) ? 0 : -1;
}
#endif

/* A block's scale is refused if negative (NaN, of either sign, stands for a block that
 * was not finite). */
static int int8_bad_scale(uint32_t sb) { return (sb & 0x80000000u) && (sb & 0x7fffffffu) <= 0x7f800000u; }

#ifdef HAVE_X86
/* nb whole blocks of in[] into out, in one call: the blocks decoded before the first
 * bad one (a negative scale or a -128), whose index is returned; nb if none is. */
TARGET_AVX2 static size_t int8_dec_avx2(const uint8_t *in, size_t nb, float *out) {
  for (size_t b = 0; b < nb; b++, in += 4 + PS_CODEC_INT8_BLOCK, out += PS_CODEC_INT8_BLOCK) {
    uint32_t sb = ps__get_u32(in);
    if (int8_bad_scale(sb) || int8_dec_block_avx2((const int8_t *)(in + 4), float_of(sb), out)) return b;
  }
  return nb;
}
#endif

static void int8_encode(const float *in, size_t n, uint8_t *out, float *err) {
  size_t i = 0;
#ifdef HAVE_X86
  if (vec_level() & VEC_AVX2) {
    size_t nb = n / PS_CODEC_INT8_BLOCK;
    int8_enc_avx2(in, nb, out, err);
    i = nb * PS_CODEC_INT8_BLOCK;
    out += nb * (4 + PS_CODEC_INT8_BLOCK);
  }
#endif
  for (; i < n; i += PS_CODEC_INT8_BLOCK) {
    size_t m = n - i < PS_CODEC_INT8_BLOCK ? n - i : PS_CODEC_INT8_BLOCK;
    int8_block_loop(in + i, m, out, err ? err + i : NULL);
    out += 4 + m;
  }
}

static int int8_decode(const uint8_t *in, size_t n, float *out) {
  size_t i = 0;
#ifdef HAVE_X86
  if (vec_level() & VEC_AVX2) {
    /* the whole blocks up to the first bad one; the loop below decodes the rest and
     * names what is wrong */
    size_t b = int8_dec_avx2(in, n / PS_CODEC_INT8_BLOCK, out);
    i = b * PS_CODEC_INT8_BLOCK;
    in += b * (4 + PS_CODEC_INT8_BLOCK);
  }
#endif
  for (; i < n; i += PS_CODEC_INT8_BLOCK) {
    size_t m = n - i < PS_CODEC_INT8_BLOCK ? n - i : PS_CODEC_INT8_BLOCK;
    uint32_t sb = ps__get_u32(in);
    if (int8_bad_scale(sb))
      return ps__fail(PS_ERR_PROTO, "int8 block %zu has a negative scale", i / PS_CODEC_INT8_BLOCK);
    if (int8_dec_loop((const int8_t *)(in + 4), m, float_of(sb), out + i))
      return ps__fail(PS_ERR_PROTO, "int8 block %zu holds -128 (values are -127..127)", i / PS_CODEC_INT8_BLOCK);
    in += 4 + m;
  }
  return 0;
}

/* ---------------------------------------------------------------- top-k */

/* The k-th largest of a[0..n) (1 <= k <= n); a is reordered. Quickselect with a
 * pseudo-random pivot: expected linear time whatever the input's order. */
static uint32_t kth_largest(uint32_t *a, size_t n, size_t k) {
  size_t lo = 0, hi = n - 1, want = k - 1; /* index in descending order */
  uint64_t rnd = 0x9e3779b97f4a7c15ull ^ n;
  while (lo < hi) {
    rnd ^= rnd << 13, rnd ^= rnd >> 7, rnd ^= rnd << 17;
    uint32_t pv = a[lo + (size_t)(rnd % (hi - lo + 1))];
    /* three-way partition: > pv | == pv | < pv */
    size_t lt = lo, i = lo, gt = hi;
    while (i <= gt) {
      if (a[i] > pv) {
        uint32_t t = a[i]; a[i] = a[lt]; a[lt] = t;
        lt++, i++;
      } else if (a[i] < pv) {
        uint32_t t = a[i]; a[i] = a[gt]; a[gt] = t;
        if (gt == 0) break;
        gt--;
      } else {
        i++;
      }
    }
    if (want < lt) hi = lt - 1;
    else if (want > gt) lo = gt + 1;
    else return pv;
  }
  return a[lo];
}

#define TOPK_BITS 11 /* radix of the first pass: sign-less f32 bits >> (31 - 11) */
#define TOPK_BUCKETS (1u << TOPK_BITS)
#define TOPK_LANES 4 /* histograms filled in turn, so repeated buckets do not serialise */

#ifdef HAVE_X86
/* The magnitudes of in[0..) whose top bits are bucket b, appended to cand (*c of them so
 * far), eight values at a time; the values done returned (the rest, fewer than 8, left). */
TARGET_AVX2 static size_t topk_bucket_avx2(const float *in, size_t n, uint32_t b, uint32_t *cand, size_t *c) {
  const __m256i absm = _mm256_set1_epi32(0x7fffffff), vb = _mm256_set1_epi32((int)b);
  size_t i = 0, cc = *c;
  for (; i + 8 <= n; i += 8) {
    __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)(in + i)), absm);
    unsigned hit = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_srli_epi32(a, 31 - TOPK_BITS), vb)));
    for (; hit; hit &= hit - 1) cand[cc++] = bits_of(in[i + (unsigned)__builtin_ctz(hit)]) & 0x7fffffffu;
  }
  *c = cc;
  return i;
}
#endif

/* The magnitude (f32 bits without the sign) of the k-th largest |in[i]|, 1 <= k < n, and
 * in *above how many are strictly larger. A histogram of the top bits finds the bucket
 * that holds it; a quickselect over that bucket's values finds it within. Magnitudes as
 * bits order NaN above Inf above every finite value. */
static int topk_threshold(const float *in, size_t n, size_t k, uint32_t *thr, size_t *above) {
  uint32_t *hist = ps__calloc((size_t)TOPK_LANES * TOPK_BUCKETS, sizeof *hist);
  if (!hist) return ps__fail(PS_ERR_NOMEM, "out of memory selecting the top %zu of %zu values", k, n);
  const unsigned sh = 31 - TOPK_BITS;
  size_t i = 0;
  for (; i + TOPK_LANES <= n; i += TOPK_LANES)
    for (unsigned l = 0; l < TOPK_LANES; l++) hist[l * TOPK_BUCKETS + ((bits_of(in[i + l]) & 0x7fffffffu) >> sh)]++;
  for (; i < n; i++) hist[(bits_of(in[i]) & 0x7fffffffu) >> sh]++;
  size_t hi_count = 0, cnt = 0; /* values in the buckets above b; values in b */
  uint32_t b = TOPK_BUCKETS;
  while (b-- > 0) {
    cnt = 0;
    for (unsigned l = 0; l < TOPK_LANES; l++) cnt += hist[l * TOPK_BUCKETS + b];
    if (hi_count + cnt >= k) break;
    hi_count += cnt;
  }
  free(hist);
  uint32_t *cand = ps__malloc((cnt ? cnt : 1) * sizeof *cand);
  if (!cand) return ps__fail(PS_ERR_NOMEM, "out of memory selecting the top %zu of %zu values", k, n);
  size_t c = 0;
  i = 0;
#ifdef HAVE_X86
  if (vec_level() & VEC_AVX2) i = topk_bucket_avx2(in, n, b, cand, &c);
#endif
  for (; i < n; i++) {
    uint32_t a = bits_of(in[i]) & 0x7fffffffu;
    if (a >> sh == b) cand[c++] = a;
  }
  PS_ASSERT(c == cnt);
  uint32_t t = kth_largest(cand, cnt, k - hi_count);
  size_t gt = 0;
  for (i = 0; i < cnt; i++) gt += cand[i] > t;
  free(cand);
  *thr = t;
  *above = hi_count + gt;
  return 0;
}

#ifdef HAVE_X86
/* Eight values at a time of topk_encode's pass: lanes at or above the threshold are
 * decided one by one, the others are not sent (their error is the value, if finite).
 * Returns the values done: all but a tail of fewer than 8, or where the pairs ran out
 * without error feedback. */
TARGET_AVX2 static size_t topk_pick_avx2(const float *in, size_t n, size_t k, uint32_t thr, size_t *need_eq,
                                         uint8_t *out, size_t *jp, float *err) {
  const __m256i absm = _mm256_set1_epi32(0x7fffffff), infb = _mm256_set1_epi32(0x7f800000);
  const __m256i below = _mm256_set1_epi32((int)thr - 1); /* a > thr - 1, signed: a < 2^31 */
  size_t i = 0, j = *jp, eq = *need_eq;
  for (; i + 8 <= n; i += 8) {
    if (!err && j == k) break;
    __m256 x = _mm256_loadu_ps(in + i);
    __m256i a = _mm256_and_si256(_mm256_castps_si256(x), absm);
    unsigned cand = thr ? (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a, below))) : 0xffu;
    unsigned sent = 0;
    for (; cand && j < k; cand &= cand - 1) { /* in[] is read before err (maybe in) is written */
      unsigned l = (unsigned)__builtin_ctz(cand);
      uint32_t u = bits_of(in[i + l]), al = u & 0x7fffffffu;
      if (al > thr || (al == thr && eq > 0)) {
        eq -= al == thr;
        ps__put_u32(out + 8 * j, (uint32_t)(i + l));
        ps__put_u32(out + 8 * j + 4, u);
        j++;
        sent |= 1u << l;
      }
    }
    if (err) {
      __m256 e = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(infb, a)));
      _mm256_storeu_ps(err + i, e);
      for (; sent; sent &= sent - 1) err[i + (unsigned)__builtin_ctz(sent)] = 0.0f;
    }
  }
  *jp = j;
  *need_eq = eq;
  return i;
}
#endif

/* The choice of top-k on the magnitudes of score[0, n): k, the threshold (bits of a
 * magnitude) and how many values equal to it are still to take, in index order. */
static int topk_choice(const ps__codec *c, const float *score, size_t n, size_t *k, uint32_t *thr,
                       size_t *need_eq) {
  *k = ps__codec_topk_count(c, n);
  if (n > UINT32_MAX) return ps__fail(PS_ERR_TOO_LARGE, "topk of %zu values: at most 2^32 - 1 per frame", n);
  *thr = 0;
  *need_eq = *k;
  if (*k && *k < n) {
    size_t above = 0;
    int rc = topk_threshold(score, n, *k, thr, &above);
    if (rc) return rc;
    *need_eq = *k - above;
  }
  return 0;
}

static int topk_encode(const ps__codec *c, const float *in, size_t n, uint8_t *out, size_t *len, float *err) {
  size_t k, need_eq;
  uint32_t thr;
  int rc = topk_choice(c, in, n, &k, &thr, &need_eq);
  if (rc) return rc;
  /* One pass: the pairs sent, and (error feedback) what was not sent is all error, what
   * was is exact. err may be in itself: each value is read before its error is written. */
  size_t j = 0, i = 0;
#ifdef HAVE_X86
  if (vec_level() & VEC_AVX2) i = topk_pick_avx2(in, n, k, thr, &need_eq, out, &j, err);
#endif
  for (; i < n; i++) {
    float x = in[i];
    uint32_t a = bits_of(x) & 0x7fffffffu;
    int take = j < k && (a > thr || (a == thr && need_eq > 0));
    if (take) {
      need_eq -= a == thr;
      ps__put_u32(out + 8 * j, (uint32_t)i);
      ps__put_u32(out + 8 * j + 4, bits_of(x));
      j++;
    } else if (!err && j == k) {
      break;
    }
    if (err) err[i] = take || a >= 0x7f800000u ? 0.0f : x;
  }
  PS_ASSERT(j == k);
  *len = 8 * k;
  return 0;
}

int ps__codec_encode_topk_by(const ps__codec *c, const float *in, const float *score, size_t n, uint8_t *out,
                              size_t *len, float *err) {
  if (c->kind != PS_CODEC_TOPK) return ps__fail(PS_ERR_INVALID, "%s is not topk", ps__codec_name(c->kind));
  size_t k, need_eq;
  uint32_t thr;
  int rc = topk_choice(c, score, n, &k, &thr, &need_eq);
  if (rc) return rc;
  /* As topk_encode's pass, the choice made on score[i] and the pair carrying in[i]. */
  size_t j = 0;
  for (size_t i = 0; i < n; i++) {
    float x = in[i];
    uint32_t a = bits_of(score[i]) & 0x7fffffffu;
    int take = j < k && (a > thr || (a == thr && need_eq > 0));
    if (take) {
      need_eq -= a == thr;
      ps__put_u32(out + 8 * j, (uint32_t)i);
      ps__put_u32(out + 8 * j + 4, bits_of(x));
      j++;
    } else if (!err && j == k) {
      break;
    }
    if (err) err[i] = take || !isfinite(x) ? 0.0f : x;
  }
  PS_ASSERT(j == k);
  *len = 8 * k;
  return 0;
}

static int topk_decode(const uint8_t *in, size_t len, float *out, size_t n) {
  if (len % 8) return ps__fail(PS_ERR_PROTO, "topk body of %zu bytes is not whole (index, value) pairs", len);
  size_t k = len / 8;
  if (k > n) return ps__fail(PS_ERR_PROTO, "topk body of %zu pairs for %zu values", k, n);
  memset(out, 0, n * sizeof *out);
  uint64_t next = 0; /* the smallest index allowed next */
  for (size_t j = 0; j < k; j++) {
    uint32_t idx = ps__get_u32(in + 8 * j);
    if (idx < next || idx >= n)
      return ps__fail(PS_ERR_PROTO, "topk pair %zu has index %u (%s)", j, idx,
                      idx >= n ? "out of range" : "indices must increase");
    out[idx] = float_of(ps__get_u32(in + 8 * j + 4));
    next = (uint64_t)idx + 1;
  }
  return 0;
}

/* ---------------------------------------------------------------- entry points */

int ps__codec_encode(const ps__codec *c, const float *in, size_t n, uint8_t *out, size_t *len, float *err) {
  switch (c->kind) {
  case PS_CODEC_RAW:
    for (size_t i = 0; i < n; i++) ps__put_u32(out + 4 * i, bits_of(in[i]));
    if (err) memset(err, 0, n * sizeof *err);
    *len = n * 4;
    return 0;
  case PS_CODEC_FP16:
    f16_encode(in, n, out, err);
    *len = n * 2;
    return 0;
  case PS_CODEC_BF16:
    bf16_encode(in, n, out, err);
    *len = n * 2;
    return 0;
  case PS_CODEC_INT8:
    int8_encode(in, n, out, err);
    *len = size_of(PS_CODEC_INT8, n, 0);
    return 0;
  case PS_CODEC_TOPK:
    return topk_encode(c, in, n, out, len, err);
  }
  return ps__fail(PS_ERR_INVALID, "unknown codec %u", c->kind);
}

int ps__codec_decode(uint32_t kind, const uint8_t *in, size_t len, float *out, size_t n) {
  if (!ps__codec_known(kind)) return ps__fail(PS_ERR_PROTO, "unknown codec %u", kind);
  if (kind == PS_CODEC_TOPK) return topk_decode(in, len, out, n);
  size_t want = size_of(kind, n, 0);
  if (len != want)
    return ps__fail(PS_ERR_PROTO, "%s values of %zu bytes where %zu values take %zu", ps__codec_name(kind), len, n,
                    want);
  switch (kind) {
  case PS_CODEC_RAW:
    for (size_t i = 0; i < n; i++) out[i] = float_of(ps__get_u32(in + 4 * i));
    return 0;
  case PS_CODEC_FP16: f16_decode(in, n, out); return 0;
  case PS_CODEC_BF16: bf16_decode(in, n, out); return 0;
  case PS_CODEC_INT8: return int8_decode(in, n, out);
  }
  return ps__fail(PS_ERR_PROTO, "unknown codec %u", kind);
}
