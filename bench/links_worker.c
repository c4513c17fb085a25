/*
 * links_worker.c - the worker of bench_links.py and tests/integration/test_netns.py: a
 * dense model trained by every worker of a job in sync mode, timed per step, or a bulk
 * pull timed alone (what a link carries).
 *
 * Usage: links_worker --mb M [--steps N] [--warmup W] [--compute-ms C] [--options "OPTS"]
 *        links_worker --mb M --pull-only [--steps N]
 * Train (the default): a dense table "w" of M MiB of floats (table options OPTS, e.g.
 * push_codec=fp16 pull_codec=fp16; the worker adds opt=sgd lr=0.5 mode=sync unless
 * OPTS says otherwise) fits w to a fixed target t (loss mean (w - t)^2, gradient
 * w - t). Each step pulls w, computes the gradient, sleeps C ms (the rest of a real
 * step's compute), pushes, and clocks. Rank 0 prints
 *   "loss L0 L1"                     (before the first step and after the last)
 *   "step_ms MEDIAN P90"             (over the steps after the W warm-up steps)
 *   "bytes PUSH_RAW PUSH_WIRE PULL_RAW PULL_WIRE"   (ps_ctx_stat of a codec table, whole
 *                                    run; 0 for a table without codecs)
 *   "payload PUSHED PULLED"          (ps_ctx_stat bytes_pushed, bytes_pulled: keys and values)
 * Pull only: a table of M MiB (mode=async), N timed pulls of all of it after one
 * untimed; prints "pull_gbps G" (payload Gbit/s of the median pull) and "pull_ms MED".
 * The job's address and the rest come from the PSHARD_* environment (ps_ctx_open_env).
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pshard.h"

#define CHECK(x)                                                                         \
  do {                                                                                   \
    int rc_ = (x);                                                                       \
    if (rc_) {                                                                           \
      fprintf(stderr, "links_worker: %s: %s: %s\n", #x, ps_err_name(rc_), ps_errmsg()); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The p-th percentile (0..100) of v[0..n), n >= 1; v is sorted. */
static double pct(double *v, int n, double p) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  int i = (int)ceil(p / 100.0 * n) - 1;
  return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

static double loss_of(const float *w, const float *t, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++) s += ((double)w[i] - t[i]) * ((double)w[i] - t[i]);
  return s / (double)n;
}

static void usage(void) {
  fprintf(stderr, "usage: links_worker --mb M [--steps N] [--warmup W] [--compute-ms C] [--options OPTS] "
                  "[--pull-only]\n");
  exit(2);
}

int main(int argc, char **argv) {
  double mb = 0, compute_ms = 0;
  int steps = 10, warmup = 2, pull_only = 0;
  const char *opts = "";
  static const struct option lo[] = {{"mb", 1, 0, 'm'},         {"steps", 1, 0, 's'},      {"warmup", 1, 0, 'w'},
                                     {"compute-ms", 1, 0, 'c'}, {"options", 1, 0, 'o'},    {"pull-only", 0, 0, 'p'},
                                     {0, 0, 0, 0}};
  for (int o; (o = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
    if (o == 'm') mb = atof(optarg);
    else if (o == 's') steps = atoi(optarg);
    else if (o == 'w') warmup = atoi(optarg);
    else if (o == 'c') compute_ms = atof(optarg);
    else if (o == 'o') opts = optarg;
    else if (o == 'p') pull_only = 1;
    else usage();
  }
  if (!(mb > 0 && mb <= 4096) || steps < 1 || steps > 100000 || warmup < 0 || warmup >= steps ||
      !(compute_ms >= 0 && compute_ms <= 600000))
    usage();
  size_t n = (size_t)(mb * 262144.0);
  if (n < 1) n = 1;
  float *w = malloc(n * sizeof *w), *g = malloc(n * sizeof *g), *t = malloc(n * sizeof *t);
  double *st = malloc((size_t)steps * sizeof *st);
  if (!w || !g || !t || !st) {
    fprintf(stderr, "links_worker: out of memory for %g MiB\n", mb);
    return 1;
  }
  ps_ctx *ctx;
  CHECK(ps_ctx_open_env(&ctx));
  int rank = ps_ctx_rank(ctx);
  uint32_t tid;
  char topts[1024];
  if (pull_only) {
    snprintf(topts, sizeof topts, "opt=sgd lr=0 mode=async init=const:0.5 %s", opts);
    CHECK(ps_table_declare(ctx, "bulk", PS_DENSE, n, topts, &tid));
    CHECK(ps_pull_range(ctx, tid, 0, n, w, -1)); /* connections up, pages touched */
    for (int s = 0; s < steps; s++) {
      double t0 = now();
      CHECK(ps_pull_range(ctx, tid, 0, n, w, -1));
      st[s] = now() - t0;
    }
    double med = pct(st, steps, 50);
    printf("pull_gbps %.4f\npull_ms %.3f\n", (double)n * 4 * 8 / med / 1e9, med * 1e3);
  } else {
    snprintf(topts, sizeof topts, "opt=sgd lr=0.5 mode=sync %s", opts);
    CHECK(ps_table_declare(ctx, "w", PS_DENSE, n, topts, &tid));
    for (size_t i = 0; i < n; i++) t[i] = (float)sin(0.37 * (double)i + 1.0);
    double l0 = -1, l1 = -1;
    for (int s = 0; s < steps; s++) {
      double t0 = now();
      CHECK(ps_pull_range(ctx, tid, 0, n, w, -1));
      if (s == 0) l0 = loss_of(w, t, n);
      for (size_t i = 0; i < n; i++) g[i] = w[i] - t[i];
      if (compute_ms > 0) usleep((useconds_t)(compute_ms * 1000));
      CHECK(ps_push_range(ctx, tid, 0, n, g, 1, PS_LR_SCHEDULE, -1));
      CHECK(ps_clock(ctx));
      st[s] = now() - t0;
    }
    CHECK(ps_pull_range(ctx, tid, 0, n, w, -1)); /* after the last round */
    l1 = loss_of(w, t, n);
    if (rank == 0) {
      double a = 0, b = 0, c = 0, d = 0, e = 0, f = 0;
      CHECK(ps_ctx_stat(ctx, "bytes_pushed", &e));
      CHECK(ps_ctx_stat(ctx, "bytes_pulled", &f));
      CHECK(ps_ctx_stat(ctx, "push_raw_bytes", &a));
      CHECK(ps_ctx_stat(ctx, "push_wire_bytes", &b));
      CHECK(ps_ctx_stat(ctx, "pull_raw_bytes", &c));
      CHECK(ps_ctx_stat(ctx, "pull_wire_bytes", &d));
      double med = pct(st + warmup, steps - warmup, 50), p90 = pct(st + warmup, steps - warmup, 90);
      printf("loss %.6g %.6g\nstep_ms %.3f %.3f\nbytes %.0f %.0f %.0f %.0f\npayload %.0f %.0f\n", l0, l1, med * 1e3,
             p90 * 1e3, a, b, c, d, e, f);
    }
  }
  fflush(stdout);
  CHECK(ps_barrier(ctx, -1)); /* nobody leaves while another still pulls */
  ps_ctx_close(ctx);
  free(w), free(g), free(t), free(st);
  return 0;
}
