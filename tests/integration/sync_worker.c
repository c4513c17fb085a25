/*
 * sync_worker.c - a deterministic training worker used by the integration tests.
 *
 * It trains a linear regression on synthetic data that every worker generates the same
 * way. At step t the global batch is examples [t*G, (t+1)*G) with G = K*b; worker r
 * takes [t*G + r*b, t*G + (r+1)*b). So K workers with batch b see exactly the examples
 * that one worker with batch K*b sees, and in sync mode they must end with the same
 * parameters. Two tables: a dense weight vector (--dense D) and a sparse embedding
 * table (--sparse-dim d) whose rows feed the prediction through a fixed vector u.
 *
 *   pred(x) = w . x_dense + sum_{k in keys(x)} e_k . u
 *
 * Options: --steps N --batch b --dense D --sparse-dim d --keys M (per example)
 *   --keyspace V --dense-opt "opt=sgd lr=0.1" --sparse-opt "..." --out FILE (rank 0
 *   writes final parameters) --sleep-ms N (per step, to let tests kill a worker)
 *   --seed S --hang-at N (the worker of rank --hang-rank R, default K-1, pushes step N,
 *   prints "hanging at step N rank R pid P" and then sleeps without ever calling
 *   ps_clock: a stand-in for a worker that dies or stalls in the middle of a round)
 *   --progress 1 (print "rank R step T" after each step).
 *   Connection settings come from the environment (PSHARD_*).
 * Exit status: 0 success, 1 a pshard call failed (message on stderr), 2 bad usage.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pshard.h"

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
static double unif(uint64_t a, uint64_t b) { return (double)(mix(a * 0x100000001b3ull ^ mix(b)) >> 11) / 9007199254740992.0; }

typedef struct {
  int steps, batch, dense, dim, keys, sleep_ms, hang_at, hang_rank, progress;
  uint64_t keyspace, seed;
  const char *dense_opt, *sparse_opt, *out;
} opts;

#define CHECK(call)                                                                                   \
  do {                                                                                                \
    int rc_ = (call);                                                                                 \
    if (rc_) {                                                                                        \
      fprintf(stderr, "worker: %s failed: %s: %s\n", #call, ps_err_name(rc_), ps_errmsg());           \
      exit(1);                                                                                        \
    }                                                                                                 \
  } while (0)

/* Feature j of example i (dense part) and its sparse keys. */
static double xval(const opts *o, uint64_t i, int j) { return unif(o->seed + i, (uint64_t)j) * 2 - 1; }
static uint64_t key_of(const opts *o, uint64_t i, int m) {
  /* Heavy-ish tail: square of a uniform concentrates on small ids. */
  double u = unif(o->seed + 7 * i + 3, (uint64_t)m + 1000);
  return (uint64_t)(u * u * (double)o->keyspace);
}
static double label(const opts *o, uint64_t i) {
  double y = 0;
  for (int j = 0; j < o->dense; j++) y += xval(o, i, j) * (unif(999, (uint64_t)j) - 0.5);
  for (int m = 0; m < o->keys; m++) y += (double)(key_of(o, i, m) % 7) * 0.1;
  return y;
}

int main(int argc, char **argv) {
  opts o = {.steps = 50, .batch = 8, .dense = 32, .dim = 4, .keys = 3, .keyspace = 1000, .seed = 1,
            .dense_opt = "opt=sgd lr=0.05", .sparse_opt = "opt=adagrad lr=0.1", .out = NULL,
            .hang_at = -1, .hang_rank = -1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) {
      fprintf(stderr, "worker: option %s needs a value\n", a);
      return 2;
    }
    if (!strcmp(a, "--steps")) o.steps = atoi(v);
    else if (!strcmp(a, "--batch")) o.batch = atoi(v);
    else if (!strcmp(a, "--dense")) o.dense = atoi(v);
    else if (!strcmp(a, "--sparse-dim")) o.dim = atoi(v);
    else if (!strcmp(a, "--keys")) o.keys = atoi(v);
    else if (!strcmp(a, "--keyspace")) o.keyspace = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--seed")) o.seed = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--dense-opt")) o.dense_opt = v;
    else if (!strcmp(a, "--sparse-opt")) o.sparse_opt = v;
    else if (!strcmp(a, "--out")) o.out = v;
    else if (!strcmp(a, "--sleep-ms")) o.sleep_ms = atoi(v);
    else if (!strcmp(a, "--hang-at")) o.hang_at = atoi(v);
    else if (!strcmp(a, "--hang-rank")) o.hang_rank = atoi(v);
    else if (!strcmp(a, "--progress")) o.progress = atoi(v);
    else {
      fprintf(stderr, "worker: unknown option %s\n", a);
      return 2;
    }
    i++;
  }
  ps_ctx *ctx;
  CHECK(ps_ctx_open_env(&ctx));
  int K = ps_ctx_num_workers(ctx), r = ps_ctx_rank(ctx);
  if (o.hang_rank < 0) o.hang_rank = K - 1;
  uint32_t tw = 0, te = 0;
  if (o.dense > 0) CHECK(ps_table_declare(ctx, "w", PS_DENSE, (uint64_t)o.dense, o.dense_opt, &tw));
  if (o.dim > 0) CHECK(ps_table_declare(ctx, "emb", PS_SPARSE, (uint64_t)o.dim, o.sparse_opt, &te));

  size_t nk = (size_t)o.batch * (size_t)o.keys;
  float *w = calloc((size_t)o.dense + 1, 4), *gw = calloc((size_t)o.dense + 1, 4);
  double *gwd = calloc((size_t)o.dense + 1, 8);
  uint64_t *ukeys = calloc(nk + 1, 8);
  float *rows = calloc((nk + 1) * (size_t)o.dim, 4), *grows = calloc((nk + 1) * (size_t)o.dim, 4);
  double *growsd = calloc((nk + 1) * (size_t)o.dim, 8);
  double *u = calloc((size_t)o.dim + 1, 8);
  for (int j = 0; j < o.dim; j++) u[j] = unif(4242, (uint64_t)j) + 0.5;
  int K0 = K; /* the example split uses the starting worker count */
  for (int t = 0; t < o.steps; t++) {
    uint64_t first = (uint64_t)t * (uint64_t)K0 * (uint64_t)o.batch + (uint64_t)r * (uint64_t)o.batch;
    /* unique keys of the batch, in first-seen order */
    size_t nu = 0;
    for (int e = 0; e < o.batch; e++)
      for (int m = 0; m < o.keys; m++) {
        uint64_t k = key_of(&o, first + (uint64_t)e, m);
        size_t q;
        for (q = 0; q < nu && ukeys[q] != k; q++) {}
        if (q == nu) ukeys[nu++] = k;
      }
    if (o.dense > 0) CHECK(ps_pull_range(ctx, tw, 0, (uint64_t)o.dense, w, -1));
    if (o.dim > 0 && nu) CHECK(ps_pull(ctx, te, ukeys, nu, rows, -1));
    memset(gwd, 0, sizeof(double) * (size_t)o.dense);
    memset(growsd, 0, sizeof(double) * nu * (size_t)o.dim);
    double loss = 0;
    for (int e = 0; e < o.batch; e++) {
      uint64_t i = first + (uint64_t)e;
      double pred = 0;
      for (int j = 0; j < o.dense; j++) pred += (double)w[j] * xval(&o, i, j);
      size_t idx[64];
      for (int m = 0; m < o.keys && m < 64; m++) {
        uint64_t k = key_of(&o, i, m);
        size_t q;
        for (q = 0; ukeys[q] != k; q++) {}
        idx[m] = q;
        for (int j = 0; j < o.dim; j++) pred += (double)rows[q * (size_t)o.dim + (size_t)j] * u[j];
      }
      double err = pred - label(&o, i);
      loss += 0.5 * err * err;
      for (int j = 0; j < o.dense; j++) gwd[j] += err * xval(&o, i, j);
      for (int m = 0; m < o.keys && m < 64; m++)
        for (int j = 0; j < o.dim; j++) growsd[idx[m] * (size_t)o.dim + (size_t)j] += err * u[j];
    }
    for (int j = 0; j < o.dense; j++) gw[j] = (float)(gwd[j] / o.batch);
    for (size_t q = 0; q < nu * (size_t)o.dim; q++) grows[q] = (float)(growsd[q] / o.batch);
    if (o.dense > 0) CHECK(ps_push_range(ctx, tw, 0, (uint64_t)o.dense, gw, (uint32_t)o.batch, PS_LR_SCHEDULE, -1));
    if (o.dim > 0) CHECK(ps_push(ctx, te, ukeys, nu, grows, (uint32_t)o.batch, PS_LR_SCHEDULE, -1));
    if (t == o.hang_at && r == o.hang_rank) {
      printf("hanging at step %d rank %d pid %d\n", t, r, (int)getpid());
      fflush(stdout);
      for (;;) pause();
    }
    CHECK(ps_clock(ctx));
    CHECK(ps_metric(ctx, "loss", loss / o.batch));
    if (o.progress) {
      printf("rank %d step %d\n", r, t);
      fflush(stdout);
    }
    if (o.sleep_ms > 0) usleep((useconds_t)o.sleep_ms * 1000);
  }
  /* Final parameters: pull at the final clock (all rounds applied). */
  if (r == 0 && o.out) {
    FILE *f = fopen(o.out, "w");
    if (!f) {
      fprintf(stderr, "worker: cannot write %s\n", o.out);
      return 1;
    }
    if (o.dense > 0) {
      CHECK(ps_pull_range(ctx, tw, 0, (uint64_t)o.dense, w, -1));
      for (int j = 0; j < o.dense; j++) fprintf(f, "w %d %.9g\n", j, (double)w[j]);
    }
    if (o.dim > 0) {
      /* every key any worker could have touched */
      size_t n = (size_t)o.keyspace;
      uint64_t *all = malloc(n * 8);
      float *vals = malloc(n * (size_t)o.dim * 4);
      for (size_t q = 0; q < n; q++) all[q] = q;
      CHECK(ps_pull(ctx, te, all, n, vals, -1));
      for (size_t q = 0; q < n; q++)
        for (int j = 0; j < o.dim; j++) fprintf(f, "e %zu %d %.9g\n", q, j, (double)vals[q * (size_t)o.dim + (size_t)j]);
      free(all);
      free(vals);
    }
    fclose(f);
  }
  printf("worker %d of %d done after %d steps\n", r, K, o.steps);
  free(w); free(gw); free(gwd); free(ukeys); free(rows); free(grows); free(growsd); free(u);
  ps_ctx_close(ctx);
  return 0;
}
