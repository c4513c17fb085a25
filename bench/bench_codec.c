/*
 * bench_codec.c - encode + decode throughput of the value codecs (proto/codec.h)
 * against memcpy of the same buffer, measured in the same run, on one core.
 *
 * Usage: bench_codec [--repeats R] [--sizes-mb A,B,...] [--portable]
 *        (defaults: 7 repeats, 1 and 64 MiB; --portable times the portable loops only)
 * For each buffer size and codec (int8, fp16, bf16, topk:0.01) it times encoding the
 * f32 buffer, decoding it back into another, and encoding with error feedback, and
 * memcpy of the f32 buffer once into another. It prints MB/s of f32 data (medians over
 * the repeats, each repeat the best of a few calls; p10 the 10th percentile of
 * encode+decode) and the ratio encode+decode / memcpy. 1 MiB stays in cache, 64 MiB
 * does not: compare both. Inputs are normally distributed gradients (fixed seed).
 * Target: int8 and fp16 at >= 0.5x memcpy.
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "common/common.h"
#include "proto/codec.h"

/* Seconds of one call: 0 encode, 1 decode (of what enc holds, *len bytes), 2 encode
 * with error feedback into err. */
static double time_op(int op, const ps__codec *c, const float *in, size_t n, uint8_t *enc, size_t *len, float *out,
                      float *err) {
  double t0 = bench_now();
  if (op == 1) bench_check(ps__codec_decode(c->kind, enc, *len, out, n), "decode");
  else bench_check(ps__codec_encode(c, in, n, enc, len, op == 2 ? err : NULL), "encode");
  return bench_now() - t0;
}

static double time_memcpy(const float *in, size_t n, float *out) {
  double t0 = bench_now();
  memcpy(out, in, n * 4);
  __asm__ volatile("" : : "r"(out) : "memory");
  return bench_now() - t0;
}

int main(int argc, char **argv) {
  int repeats = 7, portable = 0;
  char sizes[128] = "1,64";
  static const struct option opts[] = {{"repeats", 1, 0, 'r'}, {"sizes-mb", 1, 0, 's'},
                                       {"portable", 0, 0, 'p'}, {0, 0, 0, 0}};
  for (int o; (o = getopt_long(argc, argv, "r:s:p", opts, NULL)) != -1;) {
    if (o == 'r') repeats = atoi(optarg);
    else if (o == 's') snprintf(sizes, sizeof sizes, "%s", optarg);
    else if (o == 'p') portable = 1;
    else {
      fprintf(stderr, "usage: bench_codec [--repeats R] [--sizes-mb A,B,...] [--portable]\n");
      return 2;
    }
  }
  if (repeats < 1 || repeats > 1000) {
    fprintf(stderr, "bench_codec: --repeats must be 1..1000\n");
    return 2;
  }
  const ps__codec codecs[] = {{PS_CODEC_INT8, 0}, {PS_CODEC_FP16, 0}, {PS_CODEC_BF16, 0}, {PS_CODEC_TOPK, 0.01f}};
  printf("# bench_codec: encode+decode MB/s of f32 data vs memcpy of the same buffer (one core)\n");
  if (portable) ps__codec_set_vector(0);
  printf("# kernels: %s; MB/s of f32 data, medians over %d repeats (p10: 10th percentile of enc+dec)\n",
         portable ? "portable loops only (--portable)" : "the CPU's vector kernels where it has them", repeats);
  printf("%-8s %-10s %12s %12s %12s %12s %12s %12s %8s\n", "size_MiB", "codec", "enc+dec", "p10_enc+dec", "encode",
         "decode", "enc+error", "memcpy", "ratio");
  for (char *tok = strtok(sizes, ","); tok; tok = strtok(NULL, ",")) {
    long mb = atol(tok);
    if (mb <= 0 || mb > 4096) {
      fprintf(stderr, "bench_codec: bad size '%s' (1..4096 MiB)\n", tok);
      return 2;
    }
    size_t n = (size_t)mb << 18; /* floats in mb MiB */
    float *in = malloc(n * 4), *out = malloc(n * 4), *err = malloc(n * 4);
    uint8_t *enc = malloc(n * 4 + 4 * (n / 256 + 1));
    if (!in || !out || !err || !enc) {
      fprintf(stderr, "bench_codec: out of memory for %ld MiB\n", mb);
      return 1;
    }
    uint64_t s = 42;
    for (size_t i = 0; i < n; i += 2) { /* Box-Muller, fixed seed */
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      double u1 = ((s >> 11) + 1.0) / 9007199254740993.0;
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      double u2 = (s >> 11) / 9007199254740992.0, r = sqrt(-2 * log(u1)) * 1e-3;
      in[i] = (float)(r * cos(6.283185307179586 * u2));
      if (i + 1 < n) in[i + 1] = (float)(r * sin(6.283185307179586 * u2));
    }
    memset(out, 0, n * 4);
    memset(err, 0, n * 4);
    memset(enc, 0, n * 4);
    int inner = mb >= 16 ? 1 : 5; /* best of a few calls per repeat for small buffers */
    double *mc = malloc((size_t)repeats * sizeof *mc), *cx = malloc((size_t)repeats * sizeof *cx);
    double *ce = malloc((size_t)repeats * sizeof *ce), *cd = malloc((size_t)repeats * sizeof *cd);
    double *cf = malloc((size_t)repeats * sizeof *cf);
    if (!mc || !cx || !ce || !cd || !cf) {
      fprintf(stderr, "bench_codec: out of memory\n");
      return 1;
    }
    for (int r = 0; r < repeats; r++) {
      double best = 1e30;
      for (int k = 0; k < inner; k++) {
        double t = time_memcpy(in, n, out);
        best = t < best ? t : best;
      }
      mc[r] = (double)n * 4 / best / 1e6;
    }
    double mc_med = bench_median(mc, (size_t)repeats);
    for (size_t ci = 0; ci < sizeof codecs / sizeof codecs[0]; ci++) {
      for (int r = 0; r < repeats; r++) {
        double best[3] = {1e30, 1e30, 1e30};
        size_t len = 0;
        for (int k = 0; k < inner; k++)
          for (int op = 0; op < 3; op++) { /* encode, decode what it wrote, encode with error */
            double t = time_op(op == 2 ? 2 : op, &codecs[ci], in, n, enc, &len, out, err);
            best[op] = t < best[op] ? t : best[op];
          }
        cx[r] = (double)n * 4 / (best[0] + best[1]) / 1e6;
        ce[r] = (double)n * 4 / best[0] / 1e6;
        cd[r] = (double)n * 4 / best[1] / 1e6;
        cf[r] = (double)n * 4 / best[2] / 1e6;
      }
      char name[PS_CODEC_NAME_MAX];
      ps__codec_format(&codecs[ci], name, sizeof name);
      double med = bench_median(cx, (size_t)repeats), p10 = bench_pct(cx, (size_t)repeats, 10);
      printf("%-8ld %-10s %12.0f %12.0f %12.0f %12.0f %12.0f %12.0f %8.2f\n", mb, name, med, p10,
             bench_median(ce, (size_t)repeats), bench_median(cd, (size_t)repeats), bench_median(cf, (size_t)repeats),
             mc_med, med / mc_med);
    }
    free(mc), free(cx), free(ce), free(cd), free(cf), free(in), free(out), free(err), free(enc);
  }
  return 0;
}
