/*
 * codec.c - the value codecs of proto/codec.h: fp16, bf16, int8 and top-k, with the
 * error each leaves (for error feedback).
 *
 * The fp16 kernels use F16C when the CPU has it (__builtin_cpu_supports, asked once),
 * the int8 and bf16 kernels are plain loops compiled twice (target_clones: AVX2 and the
 * baseline), so one binary is fast on a current CPU and still runs on any x86-64. The
 * scalar conversions are the reference: every path gives the same bits.
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
#if !defined(__SANITIZE_ADDRESS__) && !defined(__clang__)
/* Two clones of a loop, picked at load time. Left out under ASan, whose build the
 * resolver would run before the sanitizer is up. */
#define CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef CLONES
#define CLONES
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
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
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
__attribute__((target("avx,f16c"))) static void f16_enc_f16c(const float *in, size_t n, uint8_t *out, float *err) {
  const __m256 lim = _mm256_set1_ps(65504.0f), inf = _mm256_set1_ps(INFINITY);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(in + i);
    __m256 a = _mm256_and_ps(x, absmask);
    __m256 fin = _mm256_cmp_ps(a, inf, _CMP_LT_OQ);
    /* finite and beyond the largest fp16 (RNE keeps up to 65519.99 at 65504): saturate */
    __m256 big = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_set1_ps(65520.0f), _CMP_GE_OQ), fin);
    __m256 sat = _mm256_or_ps(_mm256_andnot_ps(absmask, x), lim);
    __m128i h = _mm256_cvtps_ph(_mm256_blendv_ps(x, sat, big), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(void *)(out + 2 * i), h);
    if (err) _mm256_storeu_ps(err + i, _mm256_and_ps(_mm256_sub_ps(x, _mm256_cvtph_ps(h)), fin));
  }
  f16_enc_scalar(in + i, n - i, out + 2 * i, err ? err + i : NULL);
}

__attribute__((target("avx,f16c"))) static void f16_dec_f16c(const uint8_t *in, size_t n, float *out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(in + 2 * i))));
  f16_dec_scalar(in + 2 * i, n - i, out + i);
}

static int have_f16c(void) {
  static int have = -1; /* a benign race: every thread computes the same answer */
  int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
  if (h < 0) {
    __builtin_cpu_init();
    h = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    __atomic_store_n(&have, h, __ATOMIC_RELAXED);
  }
  return h;
}
#endif

static void f16_encode(const float *in, size_t n, uint8_t *out, float *err) {
#ifdef HAVE_X86
  if (have_f16c()) {
    f16_enc_f16c(in, n, out, err);
    return;
  }
#endif
  f16_enc_scalar(in, n, out, err);
}

static void f16_decode(const uint8_t *in, size_t n, float *out) {
#ifdef HAVE_X86
  if (have_f16c()) {
    f16_dec_f16c(in, n, out);
    return;
  }
#endif
  f16_dec_scalar(in, n, out);
}

/* ---------------------------------------------------------------- bf16 */

/* Branch-free forms of the scalar conversions, so that the loops vectorise. */
CLONES static void bf16_encode(const float *restrict in, size_t n, uint8_t *restrict out) {
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, in + i, 4);
    uint32_t a = u & 0x7fffffffu;
    uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
    uint32_t sat = (u & 0x80000000u) | 0x7f7f0000u;
    r = (a != 0x7f800000u && (r & 0x7f800000u) == 0x7f800000u) ? sat : r;
    r = a > 0x7f800000u ? u | 0x00400000u : r;
    uint16_t h = (uint16_t)(r >> 16);
    memcpy(out + 2 * i, &h, 2);
  }
}

CLONES static void bf16_decode(const uint8_t *restrict in, size_t n, float *restrict out) {
  for (size_t i = 0; i < n; i++) {
    uint16_t h;
    memcpy(&h, in + 2 * i, 2);
    uint32_t u = (uint32_t)h << 16;
    memcpy(out + i, &u, 4);
  }
}

static void bf16_err(const float *in, size_t n, const uint8_t *enc, float *err) {
  for (size_t i = 0; i < n; i++) {
    uint16_t h;
    memcpy(&h, enc + 2 * i, 2);
    err[i] = err_of(in[i], ps__bf16_to_f32(h));
  }
}

/* ---------------------------------------------------------------- int8 */

#define RNE_MAGIC 12582912.0f /* 1.5 * 2^23: (v + M) - M rounds |v| < 2^22 to nearest even */

/* max |x| of a block as f32 bits (NaN above every finite value and Inf). */
CLONES static uint32_t int8_maxbits(const float *restrict x, size_t m) {
  uint32_t mx = 0;
  for (size_t i = 0; i < m; i++) {
    uint32_t u;
    memcpy(&u, x + i, 4);
    u &= 0x7fffffffu;
    mx = u > mx ? u : mx;
  }
  return mx;
}

CLONES static void int8_quant(const float *restrict x, size_t m, float inv, int8_t *restrict q) {
  for (size_t i = 0; i < m; i++) {
    float v = x[i] * inv;
    v = v > 127.0f ? 127.0f : v;
    v = v < -127.0f ? -127.0f : v;
    v = (v + RNE_MAGIC) - RNE_MAGIC;
    q[i] = (int8_t)(int32_t)v;
  }
}

CLONES static void int8_dequant(const int8_t *restrict q, size_t m, float s, float *restrict out) {
  for (size_t i = 0; i < m; i++) out[i] = (float)q[i] * s;
}

/* One block: its scale, then its values, into out (4 + m bytes). */
static void int8_block_encode(const float *x, size_t m, uint8_t *out, float *err) {
  uint32_t mb = int8_maxbits(x, m);
  int8_t *q = (int8_t *)(out + 4);
  float s;
  if (mb >= 0x7f800000u) { /* a non-finite value: the block decodes as NaN, refused downstream */
    s = NAN;
    memset(q, 0, m);
  } else {
    float mx = float_of(mb);
    s = mx / 127.0f;
    float inv = 127.0f / mx;
    if (s == 0.0f || !isfinite(inv)) { /* zero, or so small that no scale is representable */
      s = 0.0f;
      memset(q, 0, m);
    } else {
      int8_quant(x, m, inv, q);
    }
  }
  ps__put_u32(out, bits_of(s));
  if (err)
    for (size_t i = 0; i < m; i++) err[i] = err_of(x[i], (float)q[i] * s);
}

static void int8_encode(const float *in, size_t n, uint8_t *out, float *err) {
  for (size_t i = 0; i < n; i += PS_CODEC_INT8_BLOCK) {
    size_t m = n - i < PS_CODEC_INT8_BLOCK ? n - i : PS_CODEC_INT8_BLOCK;
    int8_block_encode(in + i, m, out, err ? err + i : NULL);
    out += 4 + m;
  }
}

static int int8_decode(const uint8_t *in, size_t n, float *out) {
  for (size_t i = 0; i < n; i += PS_CODEC_INT8_BLOCK) {
    size_t m = n - i < PS_CODEC_INT8_BLOCK ? n - i : PS_CODEC_INT8_BLOCK;
    uint32_t sb = ps__get_u32(in);
    if ((sb & 0x80000000u) && (sb & 0x7fffffffu) <= 0x7f800000u)
      return ps__fail(PS_ERR_PROTO, "int8 block %zu has a negative scale", i / PS_CODEC_INT8_BLOCK);
    const int8_t *q = (const int8_t *)(in + 4);
    int bad = 0;
    for (size_t j = 0; j < m; j++) bad |= q[j] == -128;
    if (bad) return ps__fail(PS_ERR_PROTO, "int8 block %zu holds -128 (values are -127..127)", i / PS_CODEC_INT8_BLOCK);
    int8_dequant(q, m, float_of(sb), out + i);
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

static int topk_encode(const ps__codec *c, const float *in, size_t n, uint8_t *out, size_t *len, float *err) {
  size_t k = ps__codec_topk_count(c, n);
  if (n > UINT32_MAX) return ps__fail(PS_ERR_TOO_LARGE, "topk of %zu values: at most 2^32 - 1 per frame", n);
  uint32_t thr = 0;
  size_t need_eq = k; /* values equal to the threshold still to take, in index order */
  if (k && k < n) {
    uint32_t *mag = ps__malloc(n * sizeof *mag);
    if (!mag) return ps__fail(PS_ERR_NOMEM, "out of memory selecting the top %zu of %zu values", k, n);
    for (size_t i = 0; i < n; i++) mag[i] = bits_of(in[i]) & 0x7fffffffu;
    thr = kth_largest(mag, n, k);
    free(mag);
    size_t above = 0;
    for (size_t i = 0; i < n; i++) above += (bits_of(in[i]) & 0x7fffffffu) > thr;
    need_eq = k - above;
  }
  size_t j = 0;
  for (size_t i = 0; i < n && j < k; i++) {
    float x = in[i];
    uint32_t a = bits_of(x) & 0x7fffffffu;
    int take = a > thr || (a == thr && need_eq > 0);
    if (!take) continue;
    if (a == thr) need_eq--;
    ps__put_u32(out + 8 * j, (uint32_t)i);
    ps__put_u32(out + 8 * j + 4, bits_of(x));
    j++;
  }
  PS_ASSERT(j == k);
  if (err) { /* what was sent is exact; the rest is all error */
    size_t s = 0;
    for (size_t i = 0; i < n; i++) {
      float x = in[i];
      int sent = s < k && ps__get_u32(out + 8 * s) == i;
      s += (size_t)sent;
      err[i] = sent || !isfinite(x) ? 0.0f : x;
    }
  }
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
    bf16_encode(in, n, out);
    if (err) bf16_err(in, n, out, err);
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
