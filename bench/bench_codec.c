/*
 * bench_codec.c - encode + decode throughput of the value codecs (proto/codec.h)
 * against memcpy of the same buffer, measured in the same run, on one core.
 *
 * Usage: bench_codec [--repeats R] [--sizes-mb A,B,...]   (defaults: 7 repeats, 1 and 64 MiB)
 * For each buffer size and codec (int8, fp16, bf16, topk:0.01) it times encoding the
 * f32 buffer and decoding it back into another (error feedback off), and memcpy of the
 * f32 buffer once into another; it prints MB/s of f32 data (median and 10th percentile over the
 * repeats, each repeat the best of a few calls) and the ratio codec / memcpy. Inputs are
 * normally distributed gradients (fixed seed). Target: int8 and fp16 at >= 0.5x memcpy.
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "common/common.h"
#include "proto/codec.h"

static double time_codec(const ps__codec *c, const float *in, size_t n, uint8_t *enc, float *out) {
  double t0 = bench_now();
  size_t len = 0;
  bench_check(ps__codec_encode(c, in, n, enc, &len, NULL), "encode");
  bench_check(ps__codec_decode(c->kind, enc, len, out, n), "decode");
  return bench_now() - t0;
}

static double time_memcpy(const float *in, size_t n, float *out) {
  double t0 = bench_now();
  memcpy(out, in, n * 4);
  __asm__ volatile("" : : "r"(out) : "memory");
  return bench_now() - t0;
}

int main(int argc, char **argv) {
  int repeats = 7;
  char sizes[128] = "1,64";
  static const struct option opts[] = {{"repeats", 1, 0, 'r'}, {"sizes-mb", 1, 0, 's'}, {0, 0, 0, 0}};
  for (int o; (o = getopt_long(argc, argv, "r:s:", opts, NULL)) != -1;) {
    if (o == 'r') repeats = atoi(optarg);
    else if (o == 's') snprintf(sizes, sizeof sizes, "%s", optarg);
    else {
      fprintf(stderr, "usage: bench_codec [--repeats R] [--sizes-mb A,B,...]\n");
      return 2;
    }
  }
  if (repeats < 1 || repeats > 1000) {
    fprintf(stderr, "bench_codec: --repeats must be 1..1000\n");
    return 2;
  }
  const ps__codec codecs[] = {{PS_CODEC_INT8, 0}, {PS_CODEC_FP16, 0}, {PS_CODEC_BF16, 0}, {PS_CODEC_TOPK, 0.01f}};
  printf("# bench_codec: encode+decode MB/s of f32 data vs memcpy of the same buffer (one core)\n");
  printf("%-8s %-10s %12s %12s %12s %8s\n", "size_MiB", "codec", "median_MB/s", "p10_MB/s", "memcpy_MB/s", "ratio");
  for (char *tok = strtok(sizes, ","); tok; tok = strtok(NULL, ",")) {
    long mb = atol(tok);
    if (mb <= 0 || mb > 4096) {
      fprintf(stderr, "bench_codec: bad size '%s' (1..4096 MiB)\n", tok);
      return 2;
    }
    size_t n = (size_t)mb << 18; /* floats in mb MiB */
    float *in = malloc(n * 4), *out = malloc(n * 4);
    uint8_t *enc = malloc(n * 4 + 4 * (n / 256 + 1));
    if (!in || !out || !enc) {
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
    memset(enc, 0, n * 4);
    int inner = mb >= 16 ? 1 : 5; /* best of a few calls per repeat for small buffers */
    double *mc = malloc((size_t)repeats * sizeof *mc), *cx = malloc((size_t)repeats * sizeof *cx);
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
        double best = 1e30;
        for (int k = 0; k < inner; k++) {
          double t = time_codec(&codecs[ci], in, n, enc, out);
          best = t < best ? t : best;
        }
        cx[r] = (double)n * 4 / best / 1e6;
      }
      char name[PS_CODEC_NAME_MAX];
      ps__codec_format(&codecs[ci], name, sizeof name);
      double med = bench_median(cx, (size_t)repeats);
      printf("%-8ld %-10s %12.0f %12.0f %12.0f %8.2f\n", mb, name, med, bench_pct(cx, (size_t)repeats, 10), mc_med,
             med / mc_med);
    }
    free(mc), free(cx), free(in), free(out), free(enc);
  }
  return 0;
}
