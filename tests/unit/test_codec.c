/*
 * test_codec.c - the value codecs (proto/codec.h): round trips within each codec's
 * stated bound (fp16 and bf16 exact on the values they represent), rounding to nearest
 * even, saturation, top-k's choice of values (by magnitude, or on a score), error
 * feedback conserving the gradient
 * over many steps, decoders refusing short, long and malformed bodies, and the vector
 * kernels giving the portable loops' bits (int8 over groups of blocks of every sort).
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "proto/codec.h"

static uint64_t rng = 88172645463325252ull;
static uint64_t next_u64(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return rng;
}
/* uniform in [-1, 1) */
static float unif(void) { return (float)((double)(next_u64() >> 11) / 9007199254740992.0 * 2.0 - 1.0); }

static float f32_of(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}
static uint32_t bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

static const ps__codec FP16 = {PS_CODEC_FP16, 0}, BF16 = {PS_CODEC_BF16, 0}, INT8 = {PS_CODEC_INT8, 0};

/* Encode then decode n values; the decoded values into out, the encoded size returned. */
static size_t round_trip(const ps__codec *c, const float *in, size_t n, float *out) {
  size_t cap = ps__codec_size(c, n), len = 0;
  uint8_t *buf = malloc(cap ? cap : 1);
  cr_assert(buf != NULL);
  cr_assert(eq(int, ps__codec_encode(c, in, n, buf, &len, NULL), 0), "%s", ps_errmsg());
  cr_assert(eq(sz, len, cap));
  cr_assert(eq(int, ps__codec_decode(c->kind, buf, len, out, n), 0), "%s", ps_errmsg());
  free(buf);
  return len;
}

/* ---------------------------------------------------------------- fp16 */

Test(codec, fp16_is_exact_on_every_value_it_represents) {
  /* every fp16 bit pattern but NaN, through the vector path (blocks of 8) and back */
  float *in = malloc(65536 * sizeof *in), *out = malloc(65536 * sizeof *out);
  size_t n = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;
    in[n++] = ps__f16_to_f32((uint16_t)h);
  }
  round_trip(&FP16, in, n, out);
  for (size_t i = 0; i < n; i++)
    cr_assert(eq(u32, bits(out[i]), bits(in[i])), "value %a came back as %a", (double)in[i], (double)out[i]);
  free(in);
  free(out);
}

Test(codec, fp16_rounds_to_nearest_even_and_saturates) {
  struct { float in, want; } t[] = {
      {1.0f + 0x1p-11f, 1.0f},                    /* halfway: to the even neighbour */
      {1.0f + 3 * 0x1p-11f, 1.0f + 0x1p-9f},      /* halfway: up to even */
      {1.0f + 0x1p-11f + 0x1p-20f, 1.0f + 0x1p-10f}, /* above halfway: up */
      {0x1p-25f, 0.0f},                           /* half the smallest subnormal: to 0 (even) */
      {0x1p-25f * 3, 0x1p-23f},                   /* 1.5 steps: to 2 steps */
      {65519.0f, 65504.0f},                       /* below the rounding edge */
      {65520.0f, 65504.0f},                       /* would round to Inf: saturates */
      {-1e10f, -65504.0f},
      {FLT_MAX, 65504.0f},
      {INFINITY, INFINITY},
      {-INFINITY, -INFINITY},
  };
  size_t n = sizeof t / sizeof t[0];
  float in[16], out[16];
  for (size_t i = 0; i < n; i++) {
    in[i] = t[i].in;
    cr_assert(eq(u32, bits(ps__f16_to_f32(ps__f32_to_f16(t[i].in))), bits(t[i].want)), "scalar %a", (double)t[i].in);
  }
  for (size_t i = n; i < 16; i++) in[i] = t[i - n].in; /* 16: both the 8-wide path and the tail */
  round_trip(&FP16, in, 16, out);
  for (size_t i = 0; i < 16; i++)
    cr_assert(eq(u32, bits(out[i]), bits(t[i % n].want)), "vector %a gave %a", (double)in[i], (double)out[i]);
  float nan_in[9], nan_out[9];
  for (int i = 0; i < 9; i++) nan_in[i] = NAN;
  round_trip(&FP16, nan_in, 9, nan_out);
  for (int i = 0; i < 9; i++) cr_assert(isnan(nan_out[i]));
}

Test(codec, fp16_vector_and_scalar_paths_agree) {
  enum { N = 4099 };
  float *in = malloc(N * sizeof *in), *out = malloc(N * sizeof *out);
  for (size_t i = 0; i < N; i++) in[i] = f32_of((uint32_t)next_u64()); /* every exponent, NaNs too */
  round_trip(&FP16, in, N, out);
  for (size_t i = 0; i < N; i++) {
    float want = ps__f16_to_f32(ps__f32_to_f16(in[i]));
    cr_assert(eq(u32, bits(out[i]), bits(want)), "%a: vector %a, scalar %a", (double)in[i], (double)out[i], (double)want);
  }
  free(in);
  free(out);
}

Test(codec, fp16_relative_error_bound) {
  enum { N = 10000 };
  float in[N], out[N];
  for (size_t i = 0; i < N; i++) in[i] = unif() * 1000.0f;
  round_trip(&FP16, in, N, out);
  for (size_t i = 0; i < N; i++)
    if (fabsf(in[i]) >= 0x1p-14f) cr_assert(fabsf(out[i] - in[i]) <= fabsf(in[i]) * 0x1p-11f, "%g -> %g", in[i], out[i]);
}

/* ---------------------------------------------------------------- bf16 */

Test(codec, bf16_exact_rne_and_bounded) {
  enum { N = 5000 };
  float in[N], out[N];
  for (size_t i = 0; i < N; i++) in[i] = f32_of((uint32_t)(next_u64() & 0xffff0000u)); /* representable */
  round_trip(&BF16, in, N, out);
  for (size_t i = 0; i < N; i++)
    if (!isnan(in[i])) cr_assert(eq(u32, bits(out[i]), bits(in[i])));
  for (size_t i = 0; i < N; i++) in[i] = unif() * 1e6f;
  round_trip(&BF16, in, N, out);
  for (size_t i = 0; i < N; i++) cr_assert(fabsf(out[i] - in[i]) <= fabsf(in[i]) * 0x1p-8f, "%g -> %g", in[i], out[i]);
  float t[] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, FLT_MAX, -FLT_MAX, INFINITY, NAN};
  float o[6];
  round_trip(&BF16, t, 6, o);
  cr_assert(eq(u32, bits(o[0]), bits(1.0f)));
  cr_assert(eq(u32, bits(o[1]), bits(1.0f + 0x1p-6f)));
  cr_assert(eq(u32, bits(o[2]), 0x7f7f0000u), "FLT_MAX saturates: %a", (double)o[2]);
  cr_assert(eq(u32, bits(o[3]), 0xff7f0000u));
  cr_assert(isinf(o[4]) && isnan(o[5]));
}

/* ---------------------------------------------------------------- int8 */

Test(codec, int8_within_half_a_step_per_block) {
  size_t sizes[] = {0, 1, 255, 256, 257, 1000, 4096 + 3};
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
    size_t n = sizes[si];
    float *in = malloc((n + 1) * sizeof *in), *out = malloc((n + 1) * sizeof *out);
    for (size_t i = 0; i < n; i++) in[i] = unif() * (float)(1 + (i / 256) * 100); /* blocks of other scales */
    size_t len = round_trip(&INT8, in, n, out);
    cr_assert(eq(sz, len, n + 4 * ((n + 255) / 256)));
    for (size_t b = 0; b < n; b += 256) {
      size_t m = n - b < 256 ? n - b : 256;
      float mx = 0;
      for (size_t i = 0; i < m; i++) mx = fmaxf(mx, fabsf(in[b + i]));
      float step = mx / 127.0f;
      for (size_t i = 0; i < m; i++)
        cr_assert(fabsf(out[b + i] - in[b + i]) <= step * 0.5f * (1 + 1e-5f) + 1e-30f, "n=%zu value %zu: %g -> %g (step %g)",
                  n, b + i, in[b + i], out[b + i], step);
    }
    free(in);
    free(out);
  }
  float z[300] = {0}, zo[300];
  z[299] = -3.0f; /* a zero block, then one value in the next block */
  round_trip(&INT8, z, 300, zo);
  for (int i = 0; i < 299; i++) cr_assert(eq(flt, zo[i], 0.0f));
  cr_assert(eq(flt, zo[299], -3.0f));
}

Test(codec, int8_carries_nonfinite_blocks_as_nan) {
  float in[260], out[260];
  for (int i = 0; i < 260; i++) in[i] = 1.0f;
  in[3] = INFINITY;
  round_trip(&INT8, in, 260, out);
  for (int i = 0; i < 256; i++) cr_assert(isnan(out[i]), "value %d of the Inf block: %g", i, out[i]);
  for (int i = 256; i < 260; i++) cr_assert(eq(flt, out[i], 1.0f));
}

/* ---------------------------------------------------------------- topk */

static int by_mag_desc(const void *a, const void *b) {
  float x = fabsf(*(const float *)a), y = fabsf(*(const float *)b);
  return x < y ? 1 : x > y ? -1 : 0;
}

Test(codec, topk_keeps_the_k_largest_magnitudes) {
  enum { N = 3000 };
  float in[N], out[N], sorted[N];
  for (size_t i = 0; i < N; i++) in[i] = unif() * 10.0f;
  struct { float f; size_t k; } t[] = {{0.01f, 30}, {0.5f, 1500}, {1.0f, 1}, {7.0f, 7}, {5000.0f, N}, {1e-9f, 1}};
  for (size_t ti = 0; ti < sizeof t / sizeof t[0]; ti++) {
    ps__codec c = {PS_CODEC_TOPK, t[ti].f};
    cr_assert(eq(sz, ps__codec_topk_count(&c, N), t[ti].k), "topk:%g", t[ti].f);
    size_t len = ps__codec_size(&c, N), got;
    uint8_t *buf = malloc(len);
    cr_assert(eq(int, ps__codec_encode(&c, in, N, buf, &got, NULL), 0));
    cr_assert(eq(sz, got, 8 * t[ti].k));
    for (size_t j = 1; j < t[ti].k; j++) cr_assert(ps__get_u32(buf + 8 * j) > ps__get_u32(buf + 8 * (j - 1)), "sorted");
    cr_assert(eq(int, ps__codec_decode(PS_CODEC_TOPK, buf, got, out, N), 0), "%s", ps_errmsg());
    memcpy(sorted, in, sizeof in);
    qsort(sorted, N, sizeof *sorted, by_mag_desc);
    float kth = fabsf(sorted[t[ti].k - 1]);
    size_t kept = 0;
    for (size_t i = 0; i < N; i++) {
      if (out[i] != 0.0f) {
        kept++;
        cr_assert(eq(u32, bits(out[i]), bits(in[i])), "kept values are exact");
        cr_assert(fabsf(in[i]) >= kth);
      } else {
        cr_assert(fabsf(in[i]) <= kth, "dropped %g while keeping down to %g", in[i], kth);
      }
    }
    cr_assert(eq(sz, kept, t[ti].k));
    free(buf);
  }
}

Test(codec, topk_ties_go_to_the_lower_index) {
  float in[10] = {1, -5, 5, 0, 5, -5, 2, 0, 0, 5};
  ps__codec c = {PS_CODEC_TOPK, 3};
  uint8_t buf[24];
  size_t len;
  cr_assert(eq(int, ps__codec_encode(&c, in, 10, buf, &len, NULL), 0));
  cr_assert(eq(u32, ps__get_u32(buf), 1));
  cr_assert(eq(u32, ps__get_u32(buf + 8), 2));
  cr_assert(eq(u32, ps__get_u32(buf + 16), 4));
}

/* topk chosen on a score: the k largest |score| (ties: the lower index, NaN first),
 * each pair carrying the value, the error the value where not sent. */
Test(codec, topk_by_chooses_on_the_score_and_sends_the_values) {
  float in[8] = {100, -1, 2, 50, -3, 4, 5, 6}, score[8] = {0.1f, -9, 3, 0.2f, -3, NAN, 1, 3}, err[8];
  ps__codec c = {PS_CODEC_TOPK, 4};
  uint8_t buf[32];
  size_t len;
  cr_assert(eq(int, ps__codec_encode_topk_by(&c, in, score, 8, buf, &len, err), 0), "%s", ps_errmsg());
  cr_assert(eq(sz, len, 32));
  uint32_t want[4] = {1, 2, 4, 5}; /* NaN and -9, then of three 3s the two lower indices */
  for (int j = 0; j < 4; j++) {
    cr_assert(eq(u32, ps__get_u32(buf + 8 * j), want[j]), "pair %d", j);
    cr_assert(eq(u32, ps__get_u32(buf + 8 * j + 4), bits(in[want[j]])), "pair %d carries the value", j);
  }
  float want_err[8] = {100, 0, 0, 50, 0, 0, 5, 6};
  for (int i = 0; i < 8; i++) cr_assert(eq(flt, err[i], want_err[i]), "err[%d]", i);
  /* err may be in itself; the decoder reads the pairs as any topk body */
  float dec[8];
  cr_assert(eq(int, ps__codec_encode_topk_by(&c, in, score, 8, buf, &len, in), 0));
  for (int i = 0; i < 8; i++) cr_assert(eq(flt, in[i], want_err[i]), "in-place err[%d]", i);
  cr_assert(eq(int, ps__codec_decode(PS_CODEC_TOPK, buf, len, dec, 8), 0), "%s", ps_errmsg());
  cr_assert(eq(flt, dec[1], -1.0f));
  cr_assert(eq(flt, dec[0], 0.0f));
  /* k of n >= n: everything; another codec: refused */
  ps__codec all = {PS_CODEC_TOPK, 1.0f};
  float one[1] = {7}, sc1[1] = {0};
  cr_assert(eq(int, ps__codec_encode_topk_by(&all, one, sc1, 1, buf, &len, NULL), 0));
  cr_assert(eq(sz, len, 8));
  cr_assert(eq(int, ps__codec_encode_topk_by(&INT8, one, sc1, 1, buf, &len, NULL), PS_ERR_INVALID));
}

/* ---------------------------------------------------------------- error feedback */

/* Over many steps, what was sent plus what is still held equals what was produced. */
static void check_conservation(const ps__codec *c) {
  enum { N = 700, STEPS = 300 };
  float *g = malloc(N * sizeof *g), *resid = calloc(N, sizeof *resid), *dec = malloc(N * sizeof *dec);
  double *produced = calloc(N, sizeof *produced), *sent = calloc(N, sizeof *sent), *mag = calloc(N, sizeof *mag);
  size_t cap = ps__codec_size(c, N) > N * 4 ? ps__codec_size(c, N) : N * 4;
  uint8_t *buf = malloc(cap);
  for (int s = 0; s < STEPS; s++) {
    for (size_t i = 0; i < N; i++) {
      g[i] = unif() * (i % 7 == 0 ? 10.0f : 0.01f);
      produced[i] += g[i];
      mag[i] += fabs(g[i]);
      resid[i] += g[i]; /* the corrected gradient, then what it leaves */
    }
    size_t len;
    cr_assert(eq(int, ps__codec_encode(c, resid, N, buf, &len, resid), 0));
    cr_assert(eq(int, ps__codec_decode(c->kind, buf, len, dec, N), 0), "%s", ps_errmsg());
    for (size_t i = 0; i < N; i++) sent[i] += dec[i];
  }
  double worst = 0, held = 0;
  for (size_t i = 0; i < N; i++) {
    double d = fabs(sent[i] + resid[i] - produced[i]);
    cr_assert(d <= 1e-5 * mag[i] + 1e-6, "%s value %zu: sent %g + held %g != produced %g", ps__codec_name(c->kind), i,
              sent[i], (double)resid[i], produced[i]);
    worst = d > worst ? d : worst;
    held += fabs(resid[i]);
  }
  cr_assert(held < 1e30);
  free(g), free(resid), free(dec), free(produced), free(sent), free(mag), free(buf);
}

/* The same with topk chosen on a score unrelated to the values (the choice moves what
 * is sent when, never how much in all). */
static void check_conservation_by_score(const ps__codec *c) {
  enum { N = 500, STEPS = 200 };
  float *g = malloc(N * sizeof *g), *resid = calloc(N, sizeof *resid), *dec = malloc(N * sizeof *dec);
  float *score = malloc(N * sizeof *score);
  double *produced = calloc(N, sizeof *produced), *sent = calloc(N, sizeof *sent), *mag = calloc(N, sizeof *mag);
  uint8_t *buf = malloc(ps__codec_size(c, N));
  for (int s = 0; s < STEPS; s++) {
    for (size_t i = 0; i < N; i++) {
      g[i] = unif() * (i % 5 == 0 ? 3.0f : 0.02f);
      produced[i] += g[i];
      mag[i] += fabs(g[i]);
      resid[i] += g[i];
      score[i] = unif();
    }
    size_t len;
    cr_assert(eq(int, ps__codec_encode_topk_by(c, resid, score, N, buf, &len, resid), 0));
    cr_assert(eq(int, ps__codec_decode(c->kind, buf, len, dec, N), 0), "%s", ps_errmsg());
    for (size_t i = 0; i < N; i++) sent[i] += dec[i];
  }
  for (size_t i = 0; i < N; i++) {
    double d = fabs(sent[i] + resid[i] - produced[i]);
    cr_assert(d <= 1e-5 * mag[i] + 1e-6, "value %zu: sent %g + held %g != produced %g", i, sent[i], (double)resid[i],
              produced[i]);
  }
  free(g), free(resid), free(dec), free(score), free(produced), free(sent), free(mag), free(buf);
}

Test(codec, error_feedback_conserves_the_gradient) {
  ps__codec topk = {PS_CODEC_TOPK, 0.01f}, topk_n = {PS_CODEC_TOPK, 5};
  check_conservation(&FP16);
  check_conservation(&BF16);
  check_conservation(&INT8);
  check_conservation(&topk);
  check_conservation(&topk_n);
  check_conservation_by_score(&topk);
  check_conservation_by_score(&topk_n);
}

Test(codec, error_feedback_skips_nonfinite_inputs) {
  float in[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, err[9];
  in[2] = NAN;
  in[8] = INFINITY;
  const ps__codec *cs[] = {&FP16, &BF16, &INT8};
  uint8_t buf[64];
  size_t len;
  for (int k = 0; k < 3; k++) {
    cr_assert(eq(int, ps__codec_encode(cs[k], in, 9, buf, &len, err), 0));
    cr_assert(eq(flt, err[2], 0.0f));
    cr_assert(eq(flt, err[8], 0.0f));
  }
}

/* ---------------------------------------------------------------- refusals */

Test(codec, decoders_refuse_wrong_sizes_and_garbage) {
  uint8_t buf[4096];
  float out[2048];
  memset(buf, 0, sizeof buf);
  /* fixed-size codecs: any length but the one of n values */
  uint32_t kinds[] = {PS_CODEC_RAW, PS_CODEC_FP16, PS_CODEC_BF16, PS_CODEC_INT8};
  for (int k = 0; k < 4; k++) {
    ps__codec c = {kinds[k], 0};
    size_t want = ps__codec_size(&c, 300);
    cr_assert(eq(int, ps__codec_decode(kinds[k], buf, want, out, 300), 0));
    cr_assert(eq(int, ps__codec_decode(kinds[k], buf, want - 1, out, 300), PS_ERR_PROTO), "%s short", ps__codec_name(kinds[k]));
    cr_assert(strstr(ps_errmsg(), "bytes where") != NULL, "%s", ps_errmsg());
    cr_assert(eq(int, ps__codec_decode(kinds[k], buf, want + 1, out, 300), PS_ERR_PROTO), "%s long", ps__codec_name(kinds[k]));
    cr_assert(eq(int, ps__codec_decode(kinds[k], buf, 0, out, 300), PS_ERR_PROTO));
  }
  cr_assert(eq(int, ps__codec_decode(PS_CODEC__MAX, buf, 0, out, 0), PS_ERR_PROTO));
  cr_assert(strstr(ps_errmsg(), "unknown codec") != NULL);
  /* int8: a negative scale, a -128 */
  ps__put_u32(buf, bits(-1.0f));
  cr_assert(eq(int, ps__codec_decode(PS_CODEC_INT8, buf, 4 + 10, out, 10), PS_ERR_PROTO));
  cr_assert(strstr(ps_errmsg(), "negative scale") != NULL);
  ps__put_u32(buf, bits(1.0f));
  buf[4 + 5] = 0x80;
  cr_assert(eq(int, ps__codec_decode(PS_CODEC_INT8, buf, 4 + 10, out, 10), PS_ERR_PROTO));
  cr_assert(strstr(ps_errmsg(), "-128") != NULL);
  /* int8 over many blocks, on both paths: the first bad block is the one named */
  for (int vec = 0; vec < 2; vec++) {
    ps__codec_set_vector(vec);
    memset(buf, 0, sizeof buf);
    for (int b = 0; b < 6; b++) ps__put_u32(buf + 260 * b, bits(0.5f));
    buf[260 * 2 + 4 + 100] = 0x80;     /* block 2: a -128 */
    ps__put_u32(buf + 260 * 4, bits(-2.0f)); /* block 4: a negative scale */
    cr_assert(eq(int, ps__codec_decode(PS_CODEC_INT8, buf, 260 * 6, out, 256 * 6), PS_ERR_PROTO));
    cr_assert(strstr(ps_errmsg(), "block 2 holds -128") != NULL, "%s", ps_errmsg());
    buf[260 * 2 + 4 + 100] = 0;
    cr_assert(eq(int, ps__codec_decode(PS_CODEC_INT8, buf, 260 * 6, out, 256 * 6), PS_ERR_PROTO));
    cr_assert(strstr(ps_errmsg(), "block 4 has a negative scale") != NULL, "%s", ps_errmsg());
    for (int i = 0; i < 256 * 4; i++) cr_assert(eq(flt, out[i], 0.0f)); /* the blocks before it decoded */
    ps__put_u32(buf + 260 * 4, bits(0.5f));
    buf[260 * 5 + 4 + 3] = 2;
    cr_assert(eq(int, ps__codec_decode(PS_CODEC_INT8, buf, 260 * 6, out, 256 * 6), 0));
    cr_assert(eq(flt, out[256 * 5 + 3], 1.0f));
  }
  ps__codec_set_vector(1);
  /* topk: not whole pairs, more pairs than values, indices out of order or range */
  memset(buf, 0, sizeof buf);
  cr_assert(eq(int, ps__codec_decode(PS_CODEC_TOPK, buf, 12, out, 10), PS_ERR_PROTO));
  cr_assert(eq(int, ps__codec_decode(PS_CODEC_TOPK, buf, 8 * 11, out, 10), PS_ERR_PROTO));
  ps__put_u32(buf, 3);
  ps__put_u32(buf + 8, 3); /* repeated */
  cr_assert(eq(int, ps__codec_decode(PS_CODEC_TOPK, buf, 16, out, 10), PS_ERR_PROTO));
  cr_assert(strstr(ps_errmsg(), "increase") != NULL);
  ps__put_u32(buf + 8, 10); /* == n */
  cr_assert(eq(int, ps__codec_decode(PS_CODEC_TOPK, buf, 16, out, 10), PS_ERR_PROTO));
  cr_assert(strstr(ps_errmsg(), "out of range") != NULL);
  ps__put_u32(buf + 8, 9);
  ps__put_u32(buf + 12, bits(2.5f));
  cr_assert(eq(int, ps__codec_decode(PS_CODEC_TOPK, buf, 16, out, 10), 0));
  cr_assert(eq(flt, out[9], 2.5f));
  cr_assert(eq(flt, out[0], 0.0f));
  /* random garbage never crashes, and refuses or decodes within n */
  for (int t = 0; t < 2000; t++) {
    size_t len = next_u64() % 600, n = next_u64() % 300;
    for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)next_u64();
    for (uint32_t k = 0; k < PS_CODEC__MAX + 1; k++) {
      int rc = ps__codec_decode(k, buf, len, out, n);
      cr_assert(rc == 0 || rc == PS_ERR_PROTO);
    }
  }
}

Test(codec, parse_and_format) {
  struct { const char *s; uint32_t kind; float f; } ok[] = {
      {"none", PS_CODEC_RAW, 0}, {"fp16", PS_CODEC_FP16, 0}, {"bf16", PS_CODEC_BF16, 0},
      {"int8", PS_CODEC_INT8, 0}, {"topk:0.01", PS_CODEC_TOPK, 0.01f}, {"topk:100", PS_CODEC_TOPK, 100}};
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    ps__codec c;
    char back[PS_CODEC_NAME_MAX];
    cr_assert(eq(int, ps__codec_parse(ok[i].s, &c), 0), "%s", ok[i].s);
    cr_assert(eq(u32, c.kind, ok[i].kind));
    cr_assert(eq(flt, c.topk, ok[i].f));
    ps__codec_format(&c, back, sizeof back);
    cr_assert(eq(str, back, (char *)ok[i].s));
  }
  const char *bad[] = {"", "raw", "fp32", "topk", "topk:", "topk:0", "topk:-1", "topk:1.5", "topk:nan", "topk:inf",
                       "int8 ", "FP16", "topk:1e20"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ps__codec c;
    cr_assert(eq(int, ps__codec_parse(bad[i], &c), -1), "'%s' accepted", bad[i]);
  }
}

/* ---------------------------------------------------------------- table options */

#include "proto/spec.h"

Test(codec, table_options_push_codec_and_pull_codec) {
  ps__table_spec s;
  char err[256];
  cr_assert(eq(int, ps__table_spec_parse(&s, "t", PS_SPARSE, 8, "push_codec=topk:0.01 pull_codec=fp16", err, sizeof err), 0),
            "%s", err);
  cr_assert(eq(u32, s.push_codec.kind, PS_CODEC_TOPK));
  cr_assert(eq(flt, s.push_codec.topk, 0.01f));
  cr_assert(eq(u32, s.pull_codec.kind, PS_CODEC_FP16));
  cr_assert(eq(int, ps__table_spec_parse(&s, "t", PS_DENSE, 8, "", err, sizeof err), 0));
  cr_assert(eq(u32, s.push_codec.kind, PS_CODEC_RAW));
  cr_assert(eq(u32, s.pull_codec.kind, PS_CODEC_RAW));
  cr_assert(eq(int, ps__table_spec_parse(&s, "t", PS_DENSE, 8, "pull_codec=topk:5", err, sizeof err), PS_ERR_CONFIG));
  cr_assert(strstr(err, "pushes only") != NULL, "%s", err);
  cr_assert(eq(int, ps__table_spec_parse(&s, "t", PS_DENSE, 8, "push_codec=zip", err, sizeof err), PS_ERR_CONFIG));
  cr_assert(strstr(err, "push_codec") != NULL, "%s", err);
  cr_assert(eq(int, ps__table_spec_parse(&s, "t", PS_DENSE, 8, "push_codec=fp16 push_codec=int8", err, sizeof err),
               PS_ERR_CONFIG));
  /* the same options in any order give the same bytes (declarations are compared so) */
  ps__table_spec a, b;
  cr_assert(eq(int, ps__table_spec_parse(&a, "t", PS_DENSE, 8, "push_codec=int8 pull_codec=bf16 lr=0.1", err, sizeof err), 0));
  cr_assert(eq(int, ps__table_spec_parse(&b, "t", PS_DENSE, 8, "lr=0.1 pull_codec=bf16 push_codec=int8", err, sizeof err), 0));
  cr_assert(memcmp(&a, &b, sizeof a) == 0);
}

/* ---------------------------------------------------------------- vector and portable paths */

/* n values of one of a few kinds: any bits (NaN and Inf included), near fp16's and
 * bf16's limits, ties, tiny and subnormal, gradients with a rare non-finite. */
static void fill_kind(float *in, size_t n, int kind) {
  for (size_t i = 0; i < n; i++) {
    uint32_t r = (uint32_t)next_u64();
    switch (kind) {
    case 0: in[i] = f32_of(r); break;
    case 1: in[i] = f32_of((r & 0x80000000u) | (0x47700000u + (r >> 1) % 0x00200000u)); break;
    case 2: in[i] = f32_of((r & 0x80000000u) | (0x7f7f0000u + (r >> 1) % 0x00010000u)); break;
    case 3: in[i] = (float)((int)(r % 7) - 3); break;
    case 4: in[i] = f32_of((r & 0x80000000u) | ((r >> 1) % 0x00900000u)); break;
    case 6: /* int8 blocks of every sort side by side: zero, subnormal (no scale), NaN, Inf, gradient */
      switch ((i / 256) % 5) {
      case 0: in[i] = 0.0f; break;
      case 1: in[i] = f32_of((r & 0x80000000u) | ((r >> 1) % 0x00800000u)); break;
      case 2: in[i] = i % 256 == 77 ? NAN : unif(); break;
      case 3: in[i] = i % 256 == 200 ? INFINITY : unif() * 1e3f; break;
      default: in[i] = unif() * 1e-3f; break;
      }
      break;
    default: in[i] = r % 997 == 0 ? (r & 1 ? NAN : -INFINITY) : unif() * 1e-2f; break;
    }
  }
}

Test(codec, vector_kernels_give_the_portable_bits) {
  enum { N = 2100 };
  float *in = malloc(N * sizeof *in), *ea = malloc(N * sizeof *ea), *eb = malloc(N * sizeof *eb);
  float *da = malloc(N * sizeof *da), *db = malloc(N * sizeof *db);
  uint8_t *ba = malloc(N * 8), *bb = malloc(N * 8);
  const ps__codec cs[] = {FP16, BF16, INT8, {PS_CODEC_TOPK, 0.01f}, {PS_CODEC_TOPK, 0.4f}, {PS_CODEC_TOPK, 9}};
  /* int8 encodes whole blocks four at a time: a group and some, groups and a tail */
  size_t sizes[] = {N, 1, 7, 255, 256, 1031, 1024, 1280 + 3, 1792};
  for (int kind = 0; kind < 7; kind++)
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
      size_t n = sizes[si];
      fill_kind(in, n, kind);
      for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        size_t la, lb;
        ps__codec_set_vector(0);
        cr_assert(eq(int, ps__codec_encode(&cs[c], in, n, ba, &la, ea), 0));
        cr_assert(eq(int, ps__codec_decode(cs[c].kind, ba, la, da, n), 0), "%s", ps_errmsg());
        ps__codec_set_vector(1);
        cr_assert(eq(int, ps__codec_encode(&cs[c], in, n, bb, &lb, eb), 0));
        cr_assert(eq(int, ps__codec_decode(cs[c].kind, ba, la, db, n), 0), "%s", ps_errmsg());
        cr_assert(eq(sz, la, lb));
        cr_assert(eq(int, memcmp(ba, bb, la), 0), "%s kind %d n %zu: encodings differ", ps__codec_name(cs[c].kind), kind, n);
        for (size_t i = 0; i < n; i++) {
          cr_assert(eq(u32, bits(ea[i]), bits(eb[i])), "%s kind %d value %zu (%g): errors differ",
                    ps__codec_name(cs[c].kind), kind, i, in[i]);
          cr_assert(eq(u32, bits(da[i]), bits(db[i])), "%s kind %d value %zu: decodings differ",
                    ps__codec_name(cs[c].kind), kind, i);
        }
        /* the error is in itself too (as the client uses it) */
        memcpy(ea, in, n * sizeof *in);
        cr_assert(eq(int, ps__codec_encode(&cs[c], ea, n, bb, &lb, ea), 0));
        cr_assert(eq(int, memcmp(ba, bb, la), 0));
        cr_assert(eq(int, memcmp(ea, eb, n * sizeof *ea), 0), "%s kind %d n %zu: in-place errors differ",
                  ps__codec_name(cs[c].kind), kind, n);
      }
    }
  free(in), free(ea), free(eb), free(da), free(db), free(ba), free(bb);
}

Test(codec, int8_nonfinite_block_keeps_its_finite_values_as_error) {
  float in[300], err[300];
  uint8_t buf[400];
  size_t len;
  for (int i = 0; i < 300; i++) in[i] = (float)(i + 1);
  in[10] = NAN;
  cr_assert(eq(int, ps__codec_encode(&INT8, in, 300, buf, &len, err), 0));
  cr_assert(eq(flt, err[10], 0.0f));
  for (int i = 0; i < 256; i++)
    if (i != 10) cr_assert(eq(flt, err[i], in[i]), "value %d of the NaN block: error %g", i, err[i]);
  for (int i = 256; i < 300; i++) cr_assert(fabsf(err[i]) <= 300.0f / 127.0f, "value %d: error %g", i, err[i]);
}

Test(codec, fp16_nan_halves_decode_quiet_on_every_path) {
  uint8_t h[32];
  for (int i = 0; i < 16; i++) ps__put_u16(h + 2 * i, (uint16_t)(0x7c01 + i * 17)); /* signalling NaNs */
  float a[16], b[16];
  ps__codec_set_vector(0);
  cr_assert(eq(int, ps__codec_decode(PS_CODEC_FP16, h, 32, a, 16), 0));
  ps__codec_set_vector(1);
  cr_assert(eq(int, ps__codec_decode(PS_CODEC_FP16, h, 32, b, 16), 0));
  for (int i = 0; i < 16; i++) {
    cr_assert(isnan(a[i]) && (bits(a[i]) & 0x400000u), "value %d: %08x", i, bits(a[i]));
    cr_assert(eq(u32, bits(a[i]), bits(b[i])));
  }
}
