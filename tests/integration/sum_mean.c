/*
 * sum_mean.c - one sync round of plain sgd, to pin down how pushes are combined.
 *
 * Every worker declares a dense table "d" (10 floats, slice=4, so it spans several
 * servers) and a sparse table "s" (dim 3), both "opt=sgd init=zero update=MODE lr=LR",
 * pushes one gradient per table for clock 0, clocks, pulls at clock 1 (which waits for
 * the round to be applied) and, on rank 0, writes the parameters to --out:
 *   d J VALUE         dense element J
 *   s KEY J VALUE     sparse row KEY, element J
 *   k K               the worker count it ran with
 * The gradients are dyadic numbers, so every sum below is exact in float32:
 *   dense   g_r[j] = (r+1) * (j+1) / 8
 *   sparse  key 0 is pushed by every worker, key 100+r only by worker r, key 7 only by
 *           even ranks; row value g_r[key][j] = (r+1) * (j+1) / 4 (key 7: twice that),
 *           and key 0 is listed twice in each push (repeats are summed).
 * The batch of worker r is --batch b, or b*(r+1) with --unequal.
 * Options: --update sum|mean --lr LR --batch b --unequal 0|1 --out FILE.
 * Exit status: 0 success, 1 a pshard call failed, 2 bad usage.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard.h"

#define CHECK(call)                                                                         \
  do {                                                                                      \
    int rc_ = (call);                                                                       \
    if (rc_) {                                                                              \
      fprintf(stderr, "sum_mean: %s failed: %s: %s\n", #call, ps_err_name(rc_), ps_errmsg()); \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

#define DENSE 10
#define DIM 3

int main(int argc, char **argv) {
  const char *update = "mean", *lr = "0.5", *out = NULL;
  int batch = 4, unequal = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const char *a = argv[i], *v = argv[i + 1];
    if (!strcmp(a, "--update")) update = v;
    else if (!strcmp(a, "--lr")) lr = v;
    else if (!strcmp(a, "--batch")) batch = atoi(v);
    else if (!strcmp(a, "--unequal")) unequal = atoi(v);
    else if (!strcmp(a, "--out")) out = v;
    else {
      fprintf(stderr, "sum_mean: unknown option %s\n", a);
      return 2;
    }
  }
  if (argc % 2 == 0) {
    fprintf(stderr, "sum_mean: options come in pairs\n");
    return 2;
  }
  ps_ctx *ctx;
  CHECK(ps_ctx_open_env(&ctx));
  int K = ps_ctx_num_workers(ctx), r = ps_ctx_rank(ctx);
  char opts[128];
  snprintf(opts, sizeof opts, "opt=sgd init=zero update=%s lr=%s", update, lr);
  char dopts[160];
  snprintf(dopts, sizeof dopts, "%s slice=4", opts);
  uint32_t td, ts;
  CHECK(ps_table_declare(ctx, "d", PS_DENSE, DENSE, dopts, &td));
  CHECK(ps_table_declare(ctx, "s", PS_SPARSE, DIM, opts, &ts));

  uint32_t b = (uint32_t)(unequal ? batch * (r + 1) : batch);
  float g[DENSE];
  for (int j = 0; j < DENSE; j++) g[j] = (float)((r + 1) * (j + 1)) / 8.0f;
  CHECK(ps_push_range(ctx, td, 0, DENSE, g, b, PS_LR_SCHEDULE, -1));

  uint64_t keys[4];
  float rows[4 * DIM];
  size_t n = 0;
  uint64_t mine[3] = {0, 100u + (uint64_t)r, 0};
  for (int q = 0; q < 3; q++) {
    keys[n] = mine[q];
    for (int j = 0; j < DIM; j++) rows[n * DIM + (size_t)j] = (float)((r + 1) * (j + 1)) / 4.0f;
    n++;
  }
  if (r % 2 == 0) {
    keys[n] = 7;
    for (int j = 0; j < DIM; j++) rows[n * DIM + (size_t)j] = (float)((r + 1) * (j + 1)) / 2.0f;
    n++;
  }
  CHECK(ps_push(ctx, ts, keys, n, rows, b, PS_LR_SCHEDULE, -1));
  CHECK(ps_clock(ctx));

  float d[DENSE];
  CHECK(ps_pull_range(ctx, td, 0, DENSE, d, -1));
  uint64_t all[2 + 64];
  size_t na = 0;
  all[na++] = 0;
  all[na++] = 7;
  for (int q = 0; q < K && q < 64; q++) all[na++] = 100u + (uint64_t)q;
  float *vals = calloc(na * DIM, sizeof *vals);
  if (!vals) return 1;
  CHECK(ps_pull(ctx, ts, all, na, vals, -1));
  if (r == 0 && out) {
    FILE *f = fopen(out, "w");
    if (!f) {
      fprintf(stderr, "sum_mean: cannot write %s\n", out);
      return 1;
    }
    fprintf(f, "k %d\n", K);
    for (int j = 0; j < DENSE; j++) fprintf(f, "d %d %.9g\n", j, (double)d[j]);
    for (size_t q = 0; q < na; q++)
      for (int j = 0; j < DIM; j++)
        fprintf(f, "s %llu %d %.9g\n", (unsigned long long)all[q], j, (double)vals[q * DIM + (size_t)j]);
    fclose(f);
  }
  free(vals);
  /* Nobody leaves before everybody pulled: a leave is a membership change. */
  CHECK(ps_barrier(ctx, -1));
  ps_ctx_close(ctx);
  return 0;
}
