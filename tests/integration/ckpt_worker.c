/*
 * ckpt_worker.c - a deterministic sync-mode worker for the checkpoint tests.
 *
 * Four tables: a dense one with adam ("da"), a dense one with adagrad ("dg"), a sparse
 * one with adam ("sa") and a sparse one with adagrad ("sg"). At clock t worker r pulls
 * its rows, pushes gradients that depend only on (r, t, key, element) and on the values
 * it pulled, then calls ps_clock. So a job that trains to clock N+M and a job that
 * trains to N, checkpoints, and resumes from the checkpoint to N+M must end with
 * bit-identical parameters, whatever the number of servers.
 *
 * The worker starts at ps_ctx_clock (past 0 in a restored job) and trains until its
 * clock is --steps N. With --ckpt-at C, rank 0 calls ps_checkpoint once its clock is C
 * (C may equal N: a checkpoint after the last step); C may be a comma-separated list
 * of increasing clocks, one checkpoint at each. At the end rank 0 prints every
 * parameter of every table as a hex float ("%a"), one "table index value" per line,
 * into --out FILE.
 *
 * For the fault tests: --fill MB adds a fifth table, a dense one with adam ("fill") of
 * MB megabytes of state on the servers (values and both moments), so that writing a
 * checkpoint takes a while; at clock t every worker pushes into one eighth of it, and
 * --out gets its values' FNV-1a hash and every 4096th value rather than all of them.
 * --step-ms T sleeps T ms before each step, so that a job runs long enough to be
 * paused or killed in the middle.
 *
 * --first-opt OPT declares "da" and "sa" with optimiser OPT instead of adam (sgd: an
 * async job of one worker is then bit-for-bit repeatable under replication too, where a
 * chain member may number adam's steps otherwise).
 *
 * Options: --steps N --ckpt-at C[,C...] --dense D --dim d --keyspace V --fill MB
 * --step-ms T --first-opt OPT --out FILE.
 * Connection settings come from the environment (PSHARD_*).
 * Exit status: 0 success, 1 a pshard call failed (message on stderr), 2 bad usage.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pshard.h"

/* Until the worker library's checkpoint call is in the tree, the program still links
 * (the reference is then NULL and a checkpoint request fails clearly). */

#define CHECK(call)                                                                                   \
  do {                                                                                                \
    int rc_ = (call);                                                                                 \
    if (rc_) {                                                                                        \
      fprintf(stderr, "ckpt_worker: %s failed: %s: %s\n", #call, ps_err_name(rc_), ps_errmsg());      \
      exit(1);                                                                                        \
    }                                                                                                 \
  } while (0)

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* A gradient element in [-1, 1) from (rank, clock, key, element). */
static float grad(int r, int64_t t, uint64_t key, int j) {
  uint64_t h = mix(mix(mix((uint64_t)r + 1) ^ (uint64_t)t) ^ key) ^ (uint64_t)j;
  return (float)((double)(h >> 11) / 4503599627370496.0 - 1.0);
}

enum { MAX_CKPTS = 16 };

/* "C[,C...]" into at[], increasing; the count, or -1 when malformed. */
static int parse_clocks(const char *v, int64_t *at) {
  int n = 0;
  while (*v) {
    char *end;
    long long c = strtoll(v, &end, 10);
    if (end == v || c < 0 || n == MAX_CKPTS || (n && c <= at[n - 1]) || (*end && *end != ',')) return -1;
    at[n++] = c;
    v = *end ? end + 1 : end;
  }
  return n;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

/* The fill table's part at clock t: one eighth of its n elements, in turn. */
static void fill_window(uint64_t n, int64_t t, uint64_t *lo, uint64_t *len) {
  uint64_t w = (n + 7) / 8;
  *lo = (uint64_t)(t % 8) * w;
  *len = *lo >= n ? 0 : (n - *lo < w ? n - *lo : w);
}

int main(int argc, char **argv) {
  int64_t steps = 10, ckpt_at[MAX_CKPTS];
  int nckpt = 0, step_ms = 0;
  int dense = 16, dim = 4;
  uint64_t fill_mb = 0;
  uint64_t keyspace = 64;
  const char *out = NULL, *first_opt = "adam";
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) {
      fprintf(stderr, "ckpt_worker: option %s needs a value\n", a);
      return 2;
    }
    if (!strcmp(a, "--steps")) steps = atoll(v);
    else if (!strcmp(a, "--ckpt-at")) {
      if ((nckpt = parse_clocks(v, ckpt_at)) < 0) {
        fprintf(stderr, "ckpt_worker: --ckpt-at wants increasing clocks C[,C...] (at most %d)\n", MAX_CKPTS);
        return 2;
      }
    } else if (!strcmp(a, "--fill")) fill_mb = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--step-ms")) step_ms = atoi(v);
    else if (!strcmp(a, "--dense")) dense = atoi(v);
    else if (!strcmp(a, "--dim")) dim = atoi(v);
    else if (!strcmp(a, "--keyspace")) keyspace = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--out")) out = v;
    else if (!strcmp(a, "--first-opt")) first_opt = v;
    else {
      fprintf(stderr, "ckpt_worker: unknown option %s\n", a);
      return 2;
    }
    i++;
  }
  if (dense < 1 || dim < 1 || keyspace < 64 || steps < 0 || fill_mb > 4096 || step_ms < 0 || step_ms > 60000) {
    fprintf(stderr, "ckpt_worker: bad sizes\n");
    return 2;
  }
  ps_ctx *ctx;
  CHECK(ps_ctx_open_env(&ctx));
  int r = ps_ctx_rank(ctx);
  uint32_t da, dg, sa, sg;
  char first[64];
  snprintf(first, sizeof first, "opt=%s lr=0.01", first_opt);
  CHECK(ps_table_declare(ctx, "da", PS_DENSE, (uint64_t)dense, first, &da));
  CHECK(ps_table_declare(ctx, "dg", PS_DENSE, (uint64_t)dense, "opt=adagrad lr=0.1", &dg));
  CHECK(ps_table_declare(ctx, "sa", PS_SPARSE, (uint64_t)dim, first, &sa));
  CHECK(ps_table_declare(ctx, "sg", PS_SPARSE, (uint64_t)dim, "opt=adagrad lr=0.1", &sg));
  /* Adam keeps three floats per element: the value and its two moments. */
  uint64_t nfill = fill_mb * (1u << 20) / 12;
  uint32_t fl = 0;
  if (nfill) CHECK(ps_table_declare(ctx, "fill", PS_DENSE, nfill, "opt=adam lr=0.01", &fl));
  float *fw = nfill ? malloc(((nfill + 7) / 8) * 4) : NULL;

  enum { NK = 6 };
  float *w = calloc((size_t)dense, 4), *g = calloc((size_t)dense, 4);
  float *rows = calloc(NK * (size_t)dim, 4), *grows = calloc(NK * (size_t)dim, 4);
  uint64_t keys[NK];
  int64_t t0 = ps_ctx_clock(ctx);
  printf("rank %d starts at clock %lld\n", r, (long long)t0);
  fflush(stdout);
  int next_ckpt = 0;
  while (next_ckpt < nckpt && ckpt_at[next_ckpt] < t0) next_ckpt++;
  for (int64_t t = t0;; t++) {
    if (next_ckpt < nckpt && t == ckpt_at[next_ckpt] && r == 0) {
      next_ckpt++;
      uint64_t id = 0;
      CHECK(ps_checkpoint(ctx, &id, 120000));
      printf("checkpoint %llu at clock %lld\n", (unsigned long long)id, (long long)t);
      fflush(stdout);
    }
    if (t >= steps) break;
    if (step_ms) sleep_ms(step_ms);
    if (nfill) {
      uint64_t lo, len;
      fill_window(nfill, t, &lo, &len);
      for (uint64_t q = 0; q < len; q++) fw[q] = grad(r, t, lo + q + 1000u, 0);
      if (len) CHECK(ps_push_range(ctx, fl, lo, len, fw, 1, PS_LR_SCHEDULE, -1));
    }
    uint32_t dt[2] = {da, dg}, st[2] = {sa, sg};
    for (int k = 0; k < 2; k++) {
      CHECK(ps_pull_range(ctx, dt[k], 0, (uint64_t)dense, w, -1));
      for (int j = 0; j < dense; j++) g[j] = grad(r, t, (uint64_t)k, j) + 0.01f * w[j];
      CHECK(ps_push_range(ctx, dt[k], 0, (uint64_t)dense, g, 1, PS_LR_SCHEDULE, -1));
    }
    /* NK distinct keys (stride 7, keyspace >= 64). */
    uint64_t base = mix((uint64_t)r * 1000003u + (uint64_t)t) % keyspace;
    for (int q = 0; q < NK; q++) keys[q] = (base + (uint64_t)q * 7u) % keyspace;
    for (int k = 0; k < 2; k++) {
      CHECK(ps_pull(ctx, st[k], keys, NK, rows, -1));
      for (int q = 0; q < NK; q++)
        for (int j = 0; j < dim; j++)
          grows[q * dim + j] = grad(r, t, keys[q] + 100u * (uint64_t)k, j) + 0.01f * rows[q * dim + j];
      CHECK(ps_push(ctx, st[k], keys, NK, grows, 1, PS_LR_SCHEDULE, -1));
    }
    CHECK(ps_clock(ctx));
  }
  if (r == 0 && out) {
    FILE *f = fopen(out, "w");
    if (!f) {
      fprintf(stderr, "ckpt_worker: cannot write %s\n", out);
      return 1;
    }
    const char *dn[2] = {"da", "dg"}, *sn[2] = {"sa", "sg"};
    uint32_t dt[2] = {da, dg}, st[2] = {sa, sg};
    for (int k = 0; k < 2; k++) {
      CHECK(ps_pull_range(ctx, dt[k], 0, (uint64_t)dense, w, -1));
      for (int j = 0; j < dense; j++) fprintf(f, "%s %d %a\n", dn[k], j, (double)w[j]);
    }
    uint64_t *all = malloc(keyspace * 8);
    float *vals = malloc(keyspace * (size_t)dim * 4);
    for (uint64_t q = 0; q < keyspace; q++) all[q] = q;
    for (int k = 0; k < 2; k++) {
      CHECK(ps_pull(ctx, st[k], all, keyspace, vals, -1));
      for (uint64_t q = 0; q < keyspace * (uint64_t)dim; q++) fprintf(f, "%s %llu %a\n", sn[k], (unsigned long long)q, (double)vals[q]);
    }
    free(all);
    free(vals);
    /* The fill table by windows: its hash over the values' bytes, and a sample. */
    uint64_t hash = 14695981039346656037ull;
    for (int64_t k = 0; k < 8 && nfill; k++) {
      uint64_t lo, len;
      fill_window(nfill, k, &lo, &len);
      if (!len) continue;
      CHECK(ps_pull_range(ctx, fl, lo, len, fw, -1));
      const unsigned char *bytes = (const unsigned char *)fw;
      for (uint64_t q = 0; q < len * 4; q++) hash = (hash ^ bytes[q]) * 1099511628211ull;
      for (uint64_t q = 0; q < len; q++)
        if ((lo + q) % 4096 == 0) fprintf(f, "fill %llu %a\n", (unsigned long long)(lo + q), (double)fw[q]);
    }
    if (nfill) fprintf(f, "fill hash %016llx\n", (unsigned long long)hash);
    fclose(f);
  }
  printf("rank %d done at clock %lld\n", r, (long long)ps_ctx_clock(ctx));
  free(w);
  free(g);
  free(rows);
  free(grows);
  free(fw);
  ps_ctx_close(ctx);
  return 0;
}
