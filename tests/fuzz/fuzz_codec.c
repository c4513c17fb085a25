/*
 * fuzz_codec.c - fuzz target for the value decoders (proto/codec.c).
 *
 * An input is: byte 0 the codec (any value: unknown ones must be refused), bytes 1-4
 * the value count n (u32 little-endian, taken modulo 2^16), the rest the encoded body.
 * Besides "does not crash or read out of bounds", the target checks what the decoders
 * promise:
 *  - decode returns 0 or PS_ERR_PROTO; an unknown codec is refused;
 *  - an accepted fp16, bf16, int8 or raw body has exactly the codec's size for n, and
 *    a topk body at most n pairs (at most n nonzero values decoded);
 *  - encoding what was decoded and decoding again gives the same values (fp16, bf16,
 *    raw: bit for bit; topk: the same nonzero values), and the error the encoder
 *    reports plus what decodes is the input (finite values);
 *  - the body read as f32 values, encoded by every codec, decodes, and the error it
 *    reports plus the decoded value is the value again.
 * A violated property aborts with a message, which libFuzzer and the replay driver
 * report as a crash.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "proto/codec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "fuzz_codec: property violated at %s:%d: %s\n", __FILE__,       \
              __LINE__, #cond);                                                      \
      abort();                                                                       \
    }                                                                                \
  } while (0)

/* |a - b| within the rounding of the subtraction the encoder made */
static int close_to(float in, float dec, float err) {
  double d = (double)dec + (double)err - (double)in;
  return fabs(d) <= 1e-6 * (fabs((double)in) + fabs((double)dec)) + 1e-30;
}

/* Encode x[0..n) with c, decode it, check the reported error. */
static void encode_checked(const ps__codec *c, const float *x, size_t n) {
  size_t cap = ps__codec_size(c, n), len = 0;
  uint8_t *buf = malloc(cap ? cap : 1);
  float *err = malloc((n ? n : 1) * sizeof *err), *dec = malloc((n ? n : 1) * sizeof *dec);
  CHECK(buf && err && dec);
  CHECK(ps__codec_encode(c, x, n, buf, &len, err) == 0);
  CHECK(len <= cap);
  CHECK(ps__codec_decode(c->kind, buf, len, dec, n) == 0);
  for (size_t i = 0; i < n; i++)
    if (isfinite(x[i]) && isfinite(dec[i])) CHECK(close_to(x[i], dec[i], err[i]));
  free(buf), free(err), free(dec);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 5) return 0;
  uint32_t kind = data[0];
  size_t n = (size_t)(ps__get_u32(data + 1) & 0xffffu);
  const uint8_t *body = data + 5;
  size_t len = size - 5;
  float *out = malloc((n ? n : 1) * sizeof *out);
  CHECK(out);
  int rc = ps__codec_decode(kind, body, len, out, n);
  CHECK(rc == 0 || rc == PS_ERR_PROTO);
  if (!ps__codec_known(kind)) CHECK(rc == PS_ERR_PROTO);
  if (rc == 0) {
    ps__codec c = {kind, 0};
    if (kind == PS_CODEC_TOPK) {
      size_t nz = 0;
      for (size_t i = 0; i < n; i++) nz += out[i] != 0.0f;
      CHECK(len % 8 == 0 && len / 8 <= n && nz <= len / 8);
      c.topk = len / 8 ? (float)(len / 8) : 1.0f;
    } else {
      CHECK(len == ps__codec_size(&c, n));
    }
    if (n) {
      /* encode what was decoded; fixed-point for the exact codecs */
      size_t cap = ps__codec_size(&c, n), elen = 0;
      uint8_t *buf = malloc(cap ? cap : 1);
      float *again = malloc(n * sizeof *again);
      CHECK(buf && again);
      CHECK(ps__codec_encode(&c, out, n, buf, &elen, NULL) == 0);
      CHECK(ps__codec_decode(kind, buf, elen, again, n) == 0);
      if (kind == PS_CODEC_TOPK) {
        /* chosen on another vector (the values reversed): the pairs decode, and each
         * value is sent whole or kept whole as its error */
        float *score = malloc(n * sizeof *score), *err = malloc(n * sizeof *err), *dec = malloc(n * sizeof *dec);
        size_t slen = 0;
        CHECK(score && err && dec);
        for (size_t i = 0; i < n; i++) score[i] = out[n - 1 - i];
        CHECK(ps__codec_encode_topk_by(&c, out, score, n, buf, &slen, err) == 0);
        CHECK(slen == elen && ps__codec_decode(kind, buf, slen, dec, n) == 0);
        for (size_t i = 0; i < n; i++)
          if (isfinite(out[i])) CHECK(dec[i] + err[i] == out[i] && (dec[i] == 0.0f || err[i] == 0.0f));
        free(score), free(err), free(dec);
      }
      for (size_t i = 0; i < n; i++) {
        if (isnan(out[i])) {
          CHECK(isnan(again[i]) || kind == PS_CODEC_TOPK || kind == PS_CODEC_INT8);
          continue;
        }
        if (kind == PS_CODEC_INT8) {
          if (isfinite(out[i]) && isfinite(again[i])) {
            double tol = 1e-6 * fabs((double)out[i]) + 1e-30;
            /* a decoded int8 block re-quantises onto itself, up to float rounding of the scale */
            CHECK(fabs((double)again[i] - (double)out[i]) <= tol + fabs((double)out[i]) / 127.0);
          }
        } else if (kind == PS_CODEC_TOPK && out[i] == 0.0f) {
          CHECK(again[i] == 0.0f);
        } else {
          CHECK(memcmp(&again[i], &out[i], 4) == 0);
        }
      }
      free(buf), free(again);
    }
  }
  free(out);
  /* the body as floats through every encoder */
  size_t nf = len / 4;
  if (nf) {
    float *x = malloc(nf * sizeof *x);
    CHECK(x);
    memcpy(x, body, nf * 4);
    ps__codec cs[] = {{PS_CODEC_RAW, 0}, {PS_CODEC_FP16, 0}, {PS_CODEC_BF16, 0}, {PS_CODEC_INT8, 0},
                      {PS_CODEC_TOPK, 0.25f}, {PS_CODEC_TOPK, 3}};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) encode_checked(&cs[i], x, nf);
    free(x);
  }
  return 0;
}
