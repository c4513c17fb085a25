/*
 * budget_worker.c - a worker that runs into a server's limits, for test_budget.py.
 * Usage:
 *   budget_worker nan STEPS      async dense table "w" of 8 floats (init=const:1 lr=0.1):
 *                                STEPS pushes of ones; push 5 holds a NaN and push 7 a
 *                                rate of +Inf, each must be refused with PS_ERR_INVALID
 *                                (printed as "refused: ..."); prints "w X" for each
 *                                value and the server's nonfinite_refused line
 *   budget_worker nan-sync STEPS sync dense table "s" of two slices (2 x 65536 floats,
 *                                init=const:1 lr=0.1): STEPS rounds of a pull, a push of
 *                                ones and a clock; round 3's push holds a NaN in each
 *                                slice and must be refused ("refused: ..."); prints "s MIN
 *                                MAX" of the final values and each server's
 *                                nonfinite_refused and peer_mem_kept_in_place lines
 *   budget_worker create SIZE    declare a dense table of SIZE floats: prints the answer
 *   budget_worker grow DIM       async sparse table of dim DIM: pushes of 1000 new keys
 *                                until refused (prints "refused after K keys: ..."), then
 *                                a push and a pull of key 0, which must still work
 *   budget_worker metrics N      report N metrics of distinct names
 * Exits 0 when everything went as described, 1 otherwise.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard.h"

#define CHECK(x)                                                                      \
  do {                                                                                \
    int rc_ = (x);                                                                    \
    if (rc_) {                                                                        \
      fprintf(stderr, "budget_worker: %s: %s: %s\n", #x, ps_err_name(rc_), ps_errmsg()); \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)

static int run_nan(ps_ctx *ctx, int steps) {
  uint32_t t;
  float g[8], w[8];
  char stats[16384];
  CHECK(ps_table_declare(ctx, "w", PS_DENSE, 8, "init=const:1 lr=0.1 mode=async", &t));
  int refused = 0;
  for (int s = 0; s < steps; s++) {
    for (int i = 0; i < 8; i++) g[i] = 1.0f;
    float lr = PS_LR_SCHEDULE;
    if (s == 5) g[3] = NAN;
    if (s == 7) lr = INFINITY;
    int rc = ps_push_range(ctx, t, 0, 8, g, 1, lr, -1);
    if (s == 5 || s == 7) {
      if (rc != PS_ERR_INVALID) {
        fprintf(stderr, "budget_worker: push %d was answered %s, not PS_ERR_INVALID\n", s, ps_err_name(rc));
        return 1;
      }
      printf("refused: %s\n", ps_errmsg());
      refused++;
      continue;
    }
    CHECK(rc);
  }
  CHECK(ps_pull_range(ctx, t, 0, 8, w, -1));
  for (int i = 0; i < 8; i++) printf("w %.6f\n", (double)w[i]);
  CHECK(ps_server_stats(ctx, 0, stats, sizeof stats, -1));
  const char *p = strstr(stats, "nonfinite_refused ");
  if (!p) return 1;
  printf("%.*s\n", (int)strcspn(p, "\n"), p);
  fflush(stdout);
  return refused == 2 ? 0 : 1;
}

static int print_stat(const char *stats, int server, const char *name) {
  const char *p = strstr(stats, name);
  if (!p) return 1;
  printf("server %d %.*s\n", server, (int)strcspn(p, "\n"), p);
  return 0;
}

static int nan_sync_rounds(ps_ctx *ctx, uint32_t t, uint64_t n, float *g, float *w, int steps) {
  int refused = 0;
  for (int s = 0; s < steps; s++) {
    CHECK(ps_pull_range(ctx, t, 0, n, w, -1));
    for (uint64_t i = 0; i < n; i++) g[i] = 1.0f;
    if (s == 3) g[3] = g[n / 2 + 3] = NAN;
    int rc = ps_push_range(ctx, t, 0, n, g, 1, PS_LR_SCHEDULE, -1);
    if (s == 3) {
      if (rc != PS_ERR_INVALID) {
        fprintf(stderr, "budget_worker: push %d was answered %s, not PS_ERR_INVALID\n", s, ps_err_name(rc));
        return 1;
      }
      printf("refused: %s\n", ps_errmsg());
      refused++;
    } else {
      CHECK(rc);
    }
    CHECK(ps_clock(ctx));
  }
  CHECK(ps_pull_range(ctx, t, 0, n, w, -1));
  float lo = w[0], hi = w[0];
  for (uint64_t i = 1; i < n; i++) lo = w[i] < lo ? w[i] : lo, hi = w[i] > hi ? w[i] : hi;
  printf("s %.6f %.6f\n", (double)lo, (double)hi);
  char stats[16384];
  for (int i = 0; i < 2; i++) {
    CHECK(ps_server_stats(ctx, i, stats, sizeof stats, -1));
    if (print_stat(stats, i, "nonfinite_refused ") || print_stat(stats, i, "peer_mem_kept_in_place ")) return 1;
  }
  fflush(stdout);
  return refused == 1 ? 0 : 1;
}

static int run_nan_sync(ps_ctx *ctx, int steps) {
  const uint64_t n = 2 * 65536;
  uint32_t t;
  CHECK(ps_table_declare(ctx, "s", PS_DENSE, n, "init=const:1 lr=0.1 mode=sync", &t));
  float *g = malloc(n * sizeof *g), *w = malloc(n * sizeof *w);
  int rc = g && w ? nan_sync_rounds(ctx, t, n, g, w, steps) : 1;
  free(g);
  free(w);
  return rc;
}

static int run_create(ps_ctx *ctx, uint64_t size) {
  uint32_t t;
  int rc = ps_table_declare(ctx, "huge", PS_DENSE, size, "opt=adam", &t);
  printf("declare: %s: %s\n", ps_err_name(rc), rc ? ps_errmsg() : "");
  fflush(stdout);
  return rc == PS_ERR_NOMEM ? 0 : 1;
}

static int run_grow(ps_ctx *ctx, unsigned dim) {
  uint32_t t;
  enum { B = 1000 };
  uint64_t keys[B];
  float *g = calloc((size_t)B * dim, sizeof *g), *out = calloc(dim, sizeof *out);
  if (!g || !out) return 1;
  CHECK(ps_table_declare(ctx, "e", PS_SPARSE, dim, "mode=async lr=0.5 init=zero", &t));
  for (size_t i = 0; i < (size_t)B * dim; i++) g[i] = 1.0f;
  uint64_t next = 0;
  int rc = 0;
  while (next < 100000000ull) {
    for (int i = 0; i < B; i++) keys[i] = next + (uint64_t)i;
    rc = ps_push(ctx, t, keys, B, g, 1, PS_LR_SCHEDULE, -1);
    if (rc) break;
    next += B;
  }
  printf("refused after %llu keys: %s: %s\n", (unsigned long long)next, ps_err_name(rc), ps_errmsg());
  if (rc != PS_ERR_NOMEM) return 1;
  uint64_t k0 = 0, fresh = next + 5;
  CHECK(ps_push(ctx, t, &k0, 1, g, 1, PS_LR_SCHEDULE, -1));
  CHECK(ps_pull(ctx, t, &k0, 1, out, -1));
  printf("key 0: %.3f\n", (double)out[0]); /* two steps of 0.5 from 0 */
  rc = ps_pull(ctx, t, &fresh, 1, out, -1);
  printf("pull of a new key: %s\n", ps_err_name(rc));
  fflush(stdout);
  free(g);
  free(out);
  return rc == PS_ERR_NOMEM ? 0 : 1;
}

static int run_metrics(ps_ctx *ctx, int n) {
  char name[64];
  for (int i = 0; i < n; i++) {
    snprintf(name, sizeof name, "m%d", i);
    CHECK(ps_metric(ctx, name, (double)i));
  }
  CHECK(ps_barrier(ctx, -1)); /* the metrics went before this */
  printf("reported %d\n", n);
  fflush(stdout);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: budget_worker nan STEPS | nan-sync STEPS | create SIZE | grow DIM | metrics N\n");
    return 2;
  }
  ps_ctx *ctx;
  CHECK(ps_ctx_open_env(&ctx));
  int rc = 2;
  if (!strcmp(argv[1], "nan")) rc = run_nan(ctx, atoi(argv[2]));
  else if (!strcmp(argv[1], "nan-sync")) rc = run_nan_sync(ctx, atoi(argv[2]));
  else if (!strcmp(argv[1], "create")) rc = run_create(ctx, strtoull(argv[2], NULL, 10));
  else if (!strcmp(argv[1], "grow")) rc = run_grow(ctx, (unsigned)atoi(argv[2]));
  else if (!strcmp(argv[1], "metrics")) rc = run_metrics(ctx, atoi(argv[2]));
  ps_ctx_close(ctx);
  return rc;
}
