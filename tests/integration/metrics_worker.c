/*
 * metrics_worker.c - a worker for the metrics and dashboard tests: STEPS steps, each a
 * pull and a push of KEYS sparse rows (dim 8) and a dense pull and push of 1024
 * floats, a loss reported with ps_metric, SLEEP_MS of "compute", and ps_clock. It
 * prints "http_port P" (its colocated server's /metrics port, -1 for none) at the start
 * and "pushes N pulls M" (the requests it made) at the end.
 * Usage: metrics_worker STEPS KEYS SLEEP_MS
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "pshard.h"

#define CHECK(x)                                                                 \
  do {                                                                           \
    int rc_ = (x);                                                               \
    if (rc_) {                                                                   \
      fprintf(stderr, "metrics_worker: %s: %s: %s\n", #x, ps_err_name(rc_), ps_errmsg()); \
      return 1;                                                                  \
    }                                                                            \
  } while (0)

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: metrics_worker STEPS KEYS SLEEP_MS\n");
    return 2;
  }
  int steps = atoi(argv[1]), nkeys = atoi(argv[2]), sleep_ms = atoi(argv[3]);
  if (steps < 1 || nkeys < 1 || nkeys > 4096 || sleep_ms < 0) return 2;
  ps_ctx *ctx;
  uint32_t emb, w;
  CHECK(ps_ctx_open_env(&ctx));
  double http_port;
  CHECK(ps_ctx_stat(ctx, "http_port", &http_port)); /* a colocated server's /metrics, -1: none */
  printf("http_port %.0f\n", http_port);
  fflush(stdout);
  CHECK(ps_table_declare(ctx, "emb", PS_SPARSE, 8, "opt=adagrad lr=0.1", &emb));
  CHECK(ps_table_declare(ctx, "w", PS_DENSE, 1024, "opt=sgd lr=0.01", &w));
  uint64_t *keys = malloc((size_t)nkeys * sizeof *keys);
  float *rows = malloc((size_t)nkeys * 8 * sizeof *rows), dense[1024];
  if (!keys || !rows) return 1;
  long pushes = 0, pulls = 0;
  for (int t = 0; t < steps; t++) {
    for (int i = 0; i < nkeys; i++) keys[i] = (uint64_t)(t * 7919 + i * 104729) % 100000;
    CHECK(ps_pull(ctx, emb, keys, (size_t)nkeys, rows, 10000));
    CHECK(ps_pull_range(ctx, w, 0, 1024, dense, 10000));
    pulls += 2;
    for (int i = 0; i < nkeys * 8; i++) rows[i] = 0.01f * (float)((i % 7) - 3);
    for (int i = 0; i < 1024; i++) dense[i] = 0.001f;
    CHECK(ps_push(ctx, emb, keys, (size_t)nkeys, rows, 32, PS_LR_SCHEDULE, 10000));
    CHECK(ps_push_range(ctx, w, 0, 1024, dense, 32, PS_LR_SCHEDULE, 10000));
    pushes += 2;
    CHECK(ps_metric(ctx, "loss", 1.0 / sqrt(1.0 + t)));
    if (sleep_ms) usleep((useconds_t)sleep_ms * 1000);
    CHECK(ps_clock(ctx));
  }
  printf("pushes %ld pulls %ld\n", pushes, pulls);
  fflush(stdout);
  free(keys);
  free(rows);
  ps_ctx_close(ctx);
  return 0;
}
