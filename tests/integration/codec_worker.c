/*
 * codec_worker.c - sync training through the value codecs (test_codec.py).
 * Usage: codec_worker STEPS "DENSE OPTIONS" "SPARSE OPTIONS" [SLEEP_MS]
 * Two problems with a known answer, trained together by every worker:
 *   dense  "w", 300 floats in slices of 64: least squares y = x . w* on batches of 32
 *          examples drawn per (rank, step), x uniform in [-1, 1];
 *   sparse "e", 1000 keys of dim 8: each step 64 keys (with repeats) pulled and pushed
 *          the gradient e[k] - t[k] towards a fixed target row t[k].
 * Each step pulls both, pushes both, clocks, and sleeps SLEEP_MS (0). Rank 0 then prints
 *   "loss dense D0 D1 sparse S0 S1"  (losses before the first step and after the last)
 *   "w v0 v1 ... v299"               (the dense weights at the end)
 *   "bytes push_raw P push_wire Q pull_raw R pull_wire S" (ps_ctx_stat)
 *   "codec_lines N"                  (codec lines in server 0's STATS)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pshard.h"

#define CHECK(x)                                                                      \
  do {                                                                                \
    int rc_ = (x);                                                                    \
    if (rc_) {                                                                        \
      fprintf(stderr, "codec_worker: %s: %s: %s\n", #x, ps_err_name(rc_), ps_errmsg()); \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)

enum { D = 300, B = 32, KEYS = 1000, DIM = 8, NK = 64 };

static uint64_t rng_state;
static double unif(void) { /* [-1, 1) */
  rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
  return (double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static float wstar(int i) { return (float)sin(0.37 * i + 1.0); }
static float target(uint64_t k, int j) { return (float)cos(0.11 * (double)k + 0.7 * j); }

/* mean squared residual of w on a fixed evaluation batch */
static double dense_loss(const float *w) {
  uint64_t save = rng_state;
  rng_state = 0x1234567u;
  double s = 0;
  for (int e = 0; e < 256; e++) {
    double p = 0, y = 0;
    for (int i = 0; i < D; i++) {
      double x = unif();
      p += x * w[i];
      y += x * wstar(i);
    }
    s += (p - y) * (p - y);
  }
  rng_state = save;
  return s / 256;
}

static double sparse_loss(ps_ctx *ctx, uint32_t t) {
  static uint64_t keys[KEYS];
  static float rows[KEYS * DIM];
  for (int k = 0; k < KEYS; k++) keys[k] = (uint64_t)k;
  if (ps_pull(ctx, t, keys, KEYS, rows, -1)) return -1;
  double s = 0;
  for (int k = 0; k < KEYS; k++)
    for (int j = 0; j < DIM; j++) s += pow(rows[k * DIM + j] - target((uint64_t)k, j), 2);
  return s / KEYS;
}

int main(int argc, char **argv) {
  if (argc < 4) return 2;
  int steps = atoi(argv[1]), sleep_ms = argc > 4 ? atoi(argv[4]) : 0;
  ps_ctx *ctx;
  uint32_t tw, te;
  static float w[D], g[D], x[B][D], rows[NK * DIM], grads[NK * DIM];
  uint64_t keys[NK];
  CHECK(ps_ctx_open_env(&ctx));
  int rank = ps_ctx_rank(ctx);
  CHECK(ps_table_declare(ctx, "w", PS_DENSE, D, argv[2], &tw));
  CHECK(ps_table_declare(ctx, "e", PS_SPARSE, DIM, argv[3], &te));
  CHECK(ps_barrier(ctx, -1));
  double d0 = 0, s0 = 0;
  if (rank == 0) {
    CHECK(ps_pull_range(ctx, tw, 0, D, w, -1));
    d0 = dense_loss(w);
    s0 = sparse_loss(ctx, te);
  }
  for (int s = 0; s < steps; s++) {
    rng_state = 0x9e3779b97f4a7c15ull ^ ((uint64_t)rank << 32) ^ (uint64_t)(s + 1) * 0x2545f4914f6cdd1dull;
    CHECK(ps_pull_range(ctx, tw, 0, D, w, -1));
    memset(g, 0, sizeof g);
    for (int e = 0; e < B; e++) {
      double p = 0, y = 0;
      for (int i = 0; i < D; i++) {
        x[e][i] = (float)unif();
        p += x[e][i] * w[i];
        y += x[e][i] * wstar(i);
      }
      for (int i = 0; i < D; i++) g[i] += (float)((p - y) * x[e][i] / B);
    }
    CHECK(ps_push_range(ctx, tw, 0, D, g, B, PS_LR_SCHEDULE, -1));
    for (int k = 0; k < NK; k++) keys[k] = (uint64_t)((unif() + 1) * 0.5 * KEYS) % KEYS;
    CHECK(ps_pull(ctx, te, keys, NK, rows, -1));
    for (int k = 0; k < NK; k++)
      for (int j = 0; j < DIM; j++) grads[k * DIM + j] = rows[k * DIM + j] - target(keys[k], j);
    CHECK(ps_push(ctx, te, keys, NK, grads, 1, PS_LR_SCHEDULE, -1));
    CHECK(ps_clock(ctx));
    if (sleep_ms) usleep((useconds_t)sleep_ms * 1000);
  }
  CHECK(ps_barrier(ctx, -1));
  if (rank == 0) {
    CHECK(ps_pull_range(ctx, tw, 0, D, w, -1));
    printf("loss dense %.9g %.9g sparse %.9g %.9g\n", d0, dense_loss(w), s0, sparse_loss(ctx, te));
    printf("w");
    for (int i = 0; i < D; i++) printf(" %.9g", (double)w[i]);
    printf("\n");
    double v[4];
    const char *names[4] = {"push_raw_bytes", "push_wire_bytes", "pull_raw_bytes", "pull_wire_bytes"};
    for (int i = 0; i < 4; i++) CHECK(ps_ctx_stat(ctx, names[i], &v[i]));
    printf("bytes push_raw %.0f push_wire %.0f pull_raw %.0f pull_wire %.0f\n", v[0], v[1], v[2], v[3]);
    static char stats[65536];
    CHECK(ps_server_stats(ctx, 0, stats, sizeof stats, -1));
    int n = 0;
    for (const char *p = stats; (p = strstr(p, "codec ")); p++) n += p == stats || p[-1] == '\n';
    printf("codec_lines %d\n", n);
    fflush(stdout);
  }
  ps_ctx_close(ctx);
  return 0;
}
