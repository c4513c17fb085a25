/*
 * huge_worker.c - requests large enough for the server's helper thread (server.c,
 * PAR_MIN_KEYS) must answer exactly what the same keys in small requests do.
 *
 * Two sparse tables with identical options ("big" and "small", plain sgd, async,
 * init=const) get the same operations, once at dim 2 and once at dim 1 (whose rows the
 * server keeps in its index): on "big" each is one call of N keys, on
 * "small" the same keys in calls of SMALL keys (served on the loop thread alone). The
 * keys repeat and mix rows that exist with rows that do not yet, and two calls name
 * only new rows (where the helper gives up and the loop thread creates the rows); one
 * push starts with mostly new rows and goes on with rows that exist, so the helper gives
 * up early and the rows that exist are applied in part by each thread. Gradients are
 * multiples of 1/10, so rounding makes a row's result depend on the order of its updates:
 * the big call must apply them in request order, as the small calls do. After each pull,
 * and at the end over every key touched, the two tables must agree bit for bit.
 * Exit status: 0 equal, 1 a call failed or the tables differ.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pshard.h"

#define CHECK(call)                                                                          \
  do {                                                                                       \
    int rc_ = (call);                                                                        \
    if (rc_) {                                                                               \
      fprintf(stderr, "huge_worker: %s failed: %s: %s\n", #call, ps_err_name(rc_), ps_errmsg()); \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

#define MAX_DIM 2
#define N 600000u    /* keys per big call, above PAR_MIN_KEYS */
#define SMALL 10000u /* keys per small call, below it */
#define SPAN 1000000u

static uint32_t tb, ts;
static ps_ctx *ctx;
static unsigned dim;

static void pull_both(const uint64_t *keys, size_t n, float *big, float *small) {
  CHECK(ps_pull(ctx, tb, keys, n, big, -1));
  for (size_t o = 0; o < n; o += SMALL) {
    size_t m = n - o < SMALL ? n - o : SMALL;
    CHECK(ps_pull(ctx, ts, keys + o, m, small + o * dim, -1));
  }
}

static void push_both(const uint64_t *keys, size_t n, const float *g) {
  CHECK(ps_push(ctx, tb, keys, n, g, 1, PS_LR_SCHEDULE, -1));
  for (size_t o = 0; o < n; o += SMALL) {
    size_t m = n - o < SMALL ? n - o : SMALL;
    CHECK(ps_push(ctx, ts, keys + o, m, g + o * dim, 1, PS_LR_SCHEDULE, -1));
  }
}

static int compare(const char *what, const uint64_t *keys, size_t n, const float *big, const float *small) {
  for (size_t i = 0; i < n * dim; i++) {
    if (memcmp(&big[i], &small[i], sizeof(float)) != 0) {
      fprintf(stderr, "huge_worker: %s: key %llu element %zu: big call %.9g, small calls %.9g\n", what,
              (unsigned long long)keys[i / dim], i % dim, (double)big[i], (double)small[i]);
      return 1;
    }
  }
  return 0;
}

static int run(void) {
  char nb[16], ns[16];
  snprintf(nb, sizeof nb, "big%u", dim);
  snprintf(ns, sizeof ns, "small%u", dim);
  const char *opts = "opt=sgd lr=0.5 mode=async init=const:0.25";
  CHECK(ps_table_declare(ctx, nb, PS_SPARSE, dim, opts, &tb));
  CHECK(ps_table_declare(ctx, ns, PS_SPARSE, dim, opts, &ts));
  uint64_t *keys = malloc(N * sizeof *keys), *all = malloc(SPAN * sizeof *all);
  float *g = malloc((size_t)N * MAX_DIM * sizeof *g), *big = malloc((size_t)SPAN * MAX_DIM * sizeof *big),
        *small = malloc((size_t)SPAN * MAX_DIM * sizeof *small);
  if (!keys || !all || !g || !big || !small) return 1;
  int bad = 0;

  /* Rows 0 .. 199999 exist (small pulls on both tables). */
  for (uint64_t i = 0; i < 200000; i++) all[i] = i;
  for (size_t o = 0; o < 200000; o += SMALL) {
    CHECK(ps_pull(ctx, tb, all + o, SMALL, big, -1));
    CHECK(ps_pull(ctx, ts, all + o, SMALL, small, -1));
  }
  /* A push over keys 0 .. 299999, each about twice, a third of them new. */
  for (uint32_t i = 0; i < N; i++) {
    keys[i] = ((uint64_t)i * 7919u) % 300000u;
    for (unsigned j = 0; j < dim; j++) g[(size_t)i * dim + (size_t)j] = (float)((keys[i] % 16) + (uint64_t)j + 1) / 10.0f;
  }
  push_both(keys, N, g);
  /* A pull over keys 0 .. 399999 (a sixth of them new) with repeats. */
  for (uint32_t i = 0; i < N; i++) keys[i] = ((uint64_t)i * 104729u + 13u) % 400000u;
  pull_both(keys, N, big, small);
  bad |= compare("mixed pull", keys, N, big, small);
  /* All new keys: a pull (400000 ..) and a push (after 700000 ..), with repeats. */
  for (uint32_t i = 0; i < N; i++) keys[i] = 400000u + (i % 300000u);
  pull_both(keys, N, big, small);
  bad |= compare("pull of new keys", keys, N, big, small);
  for (uint32_t i = 0; i < N; i++) keys[i] = 700000u + (i % 300000u);
  push_both(keys, N, g);
  /* Mostly new rows first (1000000 ..), two in three, then rows that exist, repeated
   * (also in the first part), with gradients that differ per position. */
  for (uint32_t i = 0; i < N; i++) {
    keys[i] = i < 60000u && i % 3 ? 1000000u + i : ((uint64_t)i * 7919u) % 250000u;
    for (unsigned j = 0; j < dim; j++) g[(size_t)i * dim + (size_t)j] = (float)((i % 29) + (uint32_t)j + 1) / 10.0f;
  }
  push_both(keys, N, g);
  pull_both(keys, N, big, small);
  bad |= compare("pull after a push that starts with new rows", keys, N, big, small);
  /* Everything, in small pulls from both tables. */
  for (uint64_t i = 0; i < SPAN; i++) all[i] = i;
  for (size_t o = 0; o < SPAN; o += SMALL) {
    CHECK(ps_pull(ctx, tb, all + o, SMALL, big + o * dim, -1));
    CHECK(ps_pull(ctx, ts, all + o, SMALL, small + o * dim, -1));
  }
  bad |= compare("final rows", all, SPAN, big, small);
  /* The pushes changed rows: the comparison is not of two untouched tables. */
  if (big[0] == 0.25f) {
    fprintf(stderr, "huge_worker: row 0 was not updated\n");
    bad = 1;
  }
  free(keys);
  free(all);
  free(g);
  free(big);
  free(small);
  if (bad) fprintf(stderr, "huge_worker: the tables of dim %u differ\n", dim);
  return bad;
}

int main(void) {
  CHECK(ps_ctx_open_env(&ctx));
  int bad = 0;
  for (dim = MAX_DIM; dim >= 1; dim--) bad |= run();
  ps_ctx_close(ctx);
  return bad;
}
