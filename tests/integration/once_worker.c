/*
 * once_worker.c - a worker that counts: every push adds exactly 1 to every key of a
 * counter table, so the table's values say how many pushes the servers applied. For
 * the exactly-once tests (test_once.py).
 *
 * One sparse table "count" (dim 1, sgd with lr 1, update=sum, zero init, the mode of
 * --mode, and the options of --opts) and keys 1..--keys (spread over the servers by the
 * ring); with --dense, a dense table "count" of --keys floats in slices of 2 instead
 * (spread over the servers by runs); with --floats N (and --dense), that table has N
 * floats in 16 runs (large parts: same-host pushes then go by peer memory) and the
 * values line has one value per run, -1 for a run whose floats differ. Each push sends the gradient -1 for every key. In sync mode each push is followed by ps_clock and a
 * pull (which waits for the round). After
 * --pushes pushes (rc printed for each that failed), a barrier, then (with --wait-file
 * PATH, once PATH exists: a reader started with --pushes 0 pulls when told) a pull of
 * every key. With --start-file PATH the table is declared (and the pushes begin) only once
 * PATH exists (at most 5 minutes), the worker being registered meanwhile. Output, one
 * line each:
 *   push N rc=NAME ms=ELAPSED msg=...      for a push that did not return PS_OK
 *   acked N                                pushes that returned PS_OK
 *   direct_calls N                         of the calls, those done on the caller's thread
 *   values a,b,c,...                       the keys' values after the barrier
 * Exit status: 0 when the script ran, 1 when the context, the table or the final pull
 * failed, 2 bad usage. Connection settings come from the environment (PSHARD_*).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pshard.h"

#define MAX_KEYS 64
#define RUNS 16 /* --floats: values reported per run */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void pause_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  if (ms) nanosleep(&ts, NULL);
}

static const char *wait_file; /* --wait-file: the final pull waits for it to exist */

/* Wait for path to exist, at most 5 minutes; 0 or PS_ERR_TIMEOUT. */
static int wait_for_file(const char *path) {
  double until = now_ms() + 300e3;
  while (now_ms() < until) {
    FILE *f = fopen(path, "r");
    if (f) {
      fclose(f);
      return 0;
    }
    pause_ms(20);
  }
  fprintf(stderr, "once_worker: %s did not appear\n", path);
  return PS_ERR_TIMEOUT;
}

/* Before the final pull: the barrier (called again while it times out: a worker that
 * only reads waits there for the whole run, maybe across a restart of the scheduler), then, with --wait-file, that file (at
 * most 5 minutes). */
static int final_sync(ps_ctx *ctx) {
  double until = now_ms() + 300e3;
  int rc;
  /* (a scheduler restarted meanwhile fails the call: UNAVAILABLE, and again) */
  while (((rc = ps_barrier(ctx, -1)) == PS_ERR_TIMEOUT || rc == PS_ERR_UNAVAILABLE) && now_ms() < until) pause_ms(50);
  if (rc || !wait_file) return rc;
  return wait_for_file(wait_file);
}

/* "direct_calls N": blocking calls done on the caller's thread. */
static void print_direct(ps_ctx *ctx) {
  double v = 0;
  if (ps_ctx_stat(ctx, "direct_calls", &v) == 0) printf("direct_calls %.0f\n", v);
}

/* --floats: pushes of -1 to all n floats (in sync mode each followed by a clock and a
 * pull, as below), then the values per run. */
static int count_big(ps_ctx *ctx, uint32_t t, uint64_t n, int pushes, int sleep_ms, int sync) {
  float *grads = malloc(n * sizeof *grads), *vals = malloc(n * sizeof *vals);
  if (!grads || !vals) {
    fprintf(stderr, "once_worker: out of memory\n");
    free(grads), free(vals);
    return 1;
  }
  for (uint64_t k = 0; k < n; k++) grads[k] = -1.0f;
  int acked = 0, rc;
  for (int i = 0; i < pushes; i++) {
    double t0 = now_ms();
    if ((rc = ps_push_range(ctx, t, 0, n, grads, 1, PS_LR_SCHEDULE, -1)) == 0) acked++;
    else printf("push %d rc=%s ms=%.0f msg=%s\n", i, ps_err_name(rc), now_ms() - t0, ps_errmsg());
    if (sync && (rc = ps_clock(ctx))) printf("clock %d rc=%s msg=%s\n", i, ps_err_name(rc), ps_errmsg());
    if (sync && !rc && (rc = ps_pull_range(ctx, t, 0, n, vals, -1)))
      printf("pull %d rc=%s msg=%s\n", i, ps_err_name(rc), ps_errmsg());
    pause_ms(sleep_ms);
    fflush(stdout);
  }
  printf("acked %d\n", acked);
  print_direct(ctx);
  fflush(stdout);
  if ((rc = final_sync(ctx)) || (rc = ps_pull_range(ctx, t, 0, n, vals, -1))) {
    fprintf(stderr, "once_worker: final barrier or pull: %s: %s\n", ps_err_name(rc), ps_errmsg());
    free(grads), free(vals);
    return 1;
  }
  printf("values");
  for (uint64_t r = 0, w = n / RUNS; r < RUNS; r++) {
    float v = vals[r * w];
    for (uint64_t k = r * w; k < (r + 1) * w; k++)
      if (vals[k] != v) v = -1.0f;
    printf("%c%g", r ? ',' : ' ', v);
  }
  printf("\n");
  free(grads), free(vals);
  return 0;
}

int main(int argc, char **argv) {
  const char *mode = "async", *extra = "", *start_file = NULL;
  int pushes = 10, nkeys = 8, sleep_ms = 0, dense = 0;
  long floats = 0;
  for (int i = 1; i < argc; i += 2) {
    if (!strcmp(argv[i], "--dense")) {
      dense = 1;
      i--;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "once_worker: %s needs a value\n", argv[i]);
      return 2;
    }
    if (!strcmp(argv[i], "--mode")) mode = argv[i + 1];
    else if (!strcmp(argv[i], "--pushes")) pushes = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--keys")) nkeys = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--sleep-ms")) sleep_ms = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--floats")) floats = atol(argv[i + 1]);
    else if (!strcmp(argv[i], "--opts")) extra = argv[i + 1];
    else if (!strcmp(argv[i], "--wait-file")) wait_file = argv[i + 1];
    else if (!strcmp(argv[i], "--start-file")) start_file = argv[i + 1];
    else {
      fprintf(stderr, "once_worker: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (nkeys < 1 || nkeys > MAX_KEYS || pushes < 0) {
    fprintf(stderr, "once_worker: --keys 1..%d, --pushes >= 0\n", MAX_KEYS);
    return 2;
  }
  if (floats && (!dense || floats < RUNS || floats % RUNS)) {
    fprintf(stderr, "once_worker: --floats needs --dense and a multiple of %d\n", RUNS);
    return 2;
  }
  int sync = !strncmp(mode, "sync", 4);
  ps_ctx *ctx;
  int rc = ps_ctx_open_env(&ctx);
  if (rc) {
    fprintf(stderr, "once_worker: ps_ctx_open_env: %s: %s\n", ps_err_name(rc), ps_errmsg());
    return 1;
  }
  if (start_file && wait_for_file(start_file)) {
    ps_ctx_close(ctx);
    return 1;
  }
  char opts[384];
  uint32_t t;
  char slice[32] = " slice=2 ";
  if (floats) snprintf(slice, sizeof slice, " slice=%ld ", floats / RUNS);
  snprintf(opts, sizeof opts, "opt=sgd lr=1 init=zero update=sum mode=%s%s%s", mode, dense ? slice : " ", extra);
  if ((rc = ps_table_declare(ctx, "count", dense ? PS_DENSE : PS_SPARSE, dense ? (uint64_t)(floats ? floats : nkeys) : 1,
                             opts, &t))) {
    fprintf(stderr, "once_worker: ps_table_declare: %s: %s\n", ps_err_name(rc), ps_errmsg());
    ps_ctx_close(ctx);
    return 1;
  }
  if (floats) {
    rc = count_big(ctx, t, (uint64_t)floats, pushes, sleep_ms, sync);
    ps_ctx_close(ctx);
    return rc;
  }
  uint64_t keys[MAX_KEYS];
  float grads[MAX_KEYS], vals[MAX_KEYS];
  for (int k = 0; k < nkeys; k++) keys[k] = (uint64_t)k + 1, grads[k] = -1.0f;
  int acked = 0;
  for (int i = 0; i < pushes; i++) {
    double t0 = now_ms();
    rc = dense ? ps_push_range(ctx, t, 0, (uint64_t)nkeys, grads, 1, PS_LR_SCHEDULE, -1)
               : ps_push(ctx, t, keys, (size_t)nkeys, grads, 1, PS_LR_SCHEDULE, -1);
    if (rc == 0) acked++;
    else printf("push %d rc=%s ms=%.0f msg=%s\n", i, ps_err_name(rc), now_ms() - t0, ps_errmsg());
    /* BSP: the pull of the next clock waits for this round, so no worker runs ahead of
     * the rounds the servers hold (8). */
    if (sync && (rc = ps_clock(ctx))) printf("clock %d rc=%s msg=%s\n", i, ps_err_name(rc), ps_errmsg());
    if (sync && !rc &&
        (rc = dense ? ps_pull_range(ctx, t, 0, (uint64_t)nkeys, vals, -1) : ps_pull(ctx, t, keys, (size_t)nkeys, vals, -1)))
      printf("pull %d rc=%s msg=%s\n", i, ps_err_name(rc), ps_errmsg());
    if (sleep_ms) {
      struct timespec ts = {sleep_ms / 1000, (long)(sleep_ms % 1000) * 1000000L};
      nanosleep(&ts, NULL);
    }
    fflush(stdout);
  }
  printf("acked %d\n", acked);
  print_direct(ctx);
  fflush(stdout);
  if ((rc = final_sync(ctx)) ||
      (rc = dense ? ps_pull_range(ctx, t, 0, (uint64_t)nkeys, vals, -1) : ps_pull(ctx, t, keys, (size_t)nkeys, vals, -1))) {
    fprintf(stderr, "once_worker: final barrier or pull: %s: %s\n", ps_err_name(rc), ps_errmsg());
    ps_ctx_close(ctx);
    return 1;
  }
  printf("values");
  for (int k = 0; k < nkeys; k++) printf("%c%g", k ? ',' : ' ', vals[k]);
  printf("\n");
  ps_ctx_close(ctx);
  return 0;
}
