/*
 * bench_metrics.c - what counting costs on the request path: the same pushes with
 * metrics=on and metrics=off, in one run.
 *
 * Two jobs run side by side, each a `pshard scheduler` and S `pshard server` processes:
 * one whose servers count (the default) and one started with PSHARD_METRICS=off, and
 * this process opens a worker context on each (metrics=on, metrics=off). Each round
 * measures both jobs, one after the other, the order swapped every round so that a
 * drift of the machine weighs on both alike:
 *   - latency: LAT_REPS blocking ps_push_range of a 4 KiB dense table (1024 floats,
 *     split over the S servers), each timed alone; p50 and p99 over every round's;
 *   - throughput: TPUT_REPS blocking ps_push_range of a 1 MiB dense table; MB/s (1e6)
 *     of each round's bytes over its time, the median over the rounds.
 * The tables are opt=sgd lr=0 mode=async: a push is applied at once and changes
 * nothing. The figures are printed for both settings with the ratio on/off (latency)
 * and off/on (throughput): above 1 is what counting costs. The spread of the per-round
 * ratios says how much of that is noise.
 *
 * usage: bench_metrics [--servers S] [--transports tcp,auto] [--rounds R]
 *                      [--lat-reps N] [--tput-reps N]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

#define LAT_BYTES 4096u
#define TPUT_BYTES (1u << 20)
#define ROUNDS_MAX 400

typedef struct side {
  bench_cluster c;
  ps_ctx *ctx;
  uint32_t lat_t, tput_t;
  double *lat;          /* every timed 4 KiB push of every round, seconds */
  size_t nlat;
  double mbps[ROUNDS_MAX]; /* each round's 1 MiB throughput */
  double p50[ROUNDS_MAX];  /* each round's 4 KiB median */
} side;

static float *grad_lat, *grad_tput;

static void side_open(side *s, int on, int S, const char *transport, int lat_reps, int rounds) {
  /* The servers and this context read PSHARD_METRICS when they start. */
  setenv("PSHARD_METRICS", on ? "on" : "off", 1);
  bench_cluster_start(&s->c, S, 1, transport);
  s->ctx = bench_open(&s->c, 0, 1, transport, "async");
  unsetenv("PSHARD_METRICS");
  bench_check(ps_table_declare(s->ctx, "lat", PS_DENSE, LAT_BYTES / 4, "opt=sgd lr=0 mode=async", &s->lat_t), "declare");
  bench_check(ps_table_declare(s->ctx, "tput", PS_DENSE, TPUT_BYTES / 4, "opt=sgd lr=0 mode=async", &s->tput_t),
              "declare");
  s->lat = malloc(sizeof *s->lat * (size_t)lat_reps * (size_t)rounds);
  if (!s->lat) bench_check(PS_ERR_NOMEM, "buffers");
  s->nlat = 0;
  for (int i = 0; i < 50; i++) { /* warm: connections, rows, pools */
    bench_check(ps_push_range(s->ctx, s->lat_t, 0, LAT_BYTES / 4, grad_lat, 1, -1, -1), "push 4 KiB");
    if (i < 10) bench_check(ps_push_range(s->ctx, s->tput_t, 0, TPUT_BYTES / 4, grad_tput, 1, -1, -1), "push 1 MiB");
  }
}

static void side_close(side *s) {
  ps_ctx_close(s->ctx);
  bench_cluster_stop(&s->c);
  free(s->lat);
}

static void side_round(side *s, int rd, int lat_reps, int tput_reps) {
  double *mine = s->lat + s->nlat;
  for (int i = 0; i < lat_reps; i++) {
    double t0 = bench_now();
    bench_check(ps_push_range(s->ctx, s->lat_t, 0, LAT_BYTES / 4, grad_lat, 1, -1, -1), "push 4 KiB");
    mine[i] = bench_now() - t0;
  }
  s->nlat += (size_t)lat_reps;
  double *copy = malloc(sizeof *copy * (size_t)lat_reps);
  if (!copy) bench_check(PS_ERR_NOMEM, "buffers");
  memcpy(copy, mine, sizeof *copy * (size_t)lat_reps);
  s->p50[rd] = bench_median(copy, (size_t)lat_reps);
  free(copy);
  double t0 = bench_now();
  for (int i = 0; i < tput_reps; i++)
    bench_check(ps_push_range(s->ctx, s->tput_t, 0, TPUT_BYTES / 4, grad_tput, 1, -1, -1), "push 1 MiB");
  s->mbps[rd] = (double)TPUT_BYTES * tput_reps / (bench_now() - t0) / 1e6;
}

/* The smallest and largest of n values. */
static void range(const double *v, int n, double *lo, double *hi) {
  *lo = *hi = v[0];
  for (int i = 1; i < n; i++) {
    if (v[i] < *lo) *lo = v[i];
    if (v[i] > *hi) *hi = v[i];
  }
}

int main(int argc, char **argv) {
  int S = 1, rounds = 8, lat_reps = 2000, tput_reps = 200;
  const char *transports_s = "tcp,auto";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--servers") && i + 1 < argc) S = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--transports") && i + 1 < argc) transports_s = argv[++i];
    else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--lat-reps") && i + 1 < argc) lat_reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--tput-reps") && i + 1 < argc) tput_reps = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: bench_metrics [--servers S] [--transports tcp,auto] [--rounds R] [--lat-reps N] "
                      "[--tput-reps N]\n");
      return 2;
    }
  }
  if (S < 1 || S > 16 || rounds < 2 || rounds > ROUNDS_MAX || lat_reps < 10 || lat_reps > 1000000 || tput_reps < 1 ||
      tput_reps > 100000) {
    fprintf(stderr, "bench_metrics: --servers 1..16, --rounds 2..%d, --lat-reps 10..1000000, --tput-reps 1..100000\n",
            ROUNDS_MAX);
    return 2;
  }
  grad_lat = malloc(LAT_BYTES);
  grad_tput = malloc(TPUT_BYTES);
  if (!grad_lat || !grad_tput) bench_check(PS_ERR_NOMEM, "buffers");
  for (unsigned i = 0; i < LAT_BYTES / 4; i++) grad_lat[i] = (float)(i & 255) * 1e-3f;
  for (unsigned i = 0; i < TPUT_BYTES / 4; i++) grad_tput[i] = (float)(i & 1023) * 1e-3f;

  printf("# bench_metrics: blocking dense pushes with counting on (metrics=on) and off (metrics=off), one worker,\n");
  printf("# %d server(s) per job, the two jobs side by side, %d rounds alternating which goes first.\n", S, rounds);
  printf("# 4 KiB: %d pushes a round, each timed (us); 1 MiB: %d pushes a round, MB/s = 1e6 B/s of the round.\n",
         lat_reps, tput_reps);
  printf("# ratio: on/off for latency, off/on for throughput (above 1: counting costs); range: per-round ratios.\n");
  printf("%-9s %-13s %10s %10s %8s  %s  %s\n", "transport", "figure", "on", "off", "ratio", "range", "median of the rounds' ratios");
  char buf[64];
  snprintf(buf, sizeof buf, "%s", transports_s);
  char *save = NULL;
  for (char *tr = strtok_r(buf, ",", &save); tr; tr = strtok_r(NULL, ",", &save)) {
    if (strcmp(tr, "tcp") && strcmp(tr, "auto")) {
      fprintf(stderr, "bench_metrics: unknown transport '%s' (tcp, auto)\n", tr);
      return 2;
    }
    static side on, off;
    side_open(&on, 1, S, tr, lat_reps, rounds);
    side_open(&off, 0, S, tr, lat_reps, rounds);
    for (int rd = 0; rd < rounds; rd++) {
      side *first = rd % 2 ? &off : &on, *second = rd % 2 ? &on : &off;
      side_round(first, rd, lat_reps, tput_reps);
      side_round(second, rd, lat_reps, tput_reps);
    }
    double r50[ROUNDS_MAX], rt[ROUNDS_MAX], lo, hi;
    for (int rd = 0; rd < rounds; rd++) {
      r50[rd] = on.p50[rd] / off.p50[rd];
      rt[rd] = off.mbps[rd] / on.mbps[rd];
    }
    double on50 = bench_pct(on.lat, on.nlat, 50), off50 = bench_pct(off.lat, off.nlat, 50);
    double on99 = bench_pct(on.lat, on.nlat, 99), off99 = bench_pct(off.lat, off.nlat, 99);
    double ont = bench_median(on.mbps, (size_t)rounds), offt = bench_median(off.mbps, (size_t)rounds);
    range(r50, rounds, &lo, &hi);
    double m50 = bench_median(r50, (size_t)rounds); /* the paired figure: each round's on against its off */
    printf("%-9s %-13s %10.1f %10.1f %8.3f  %.3f..%.3f  %.3f\n", tr, "4KiB_p50_us", on50 * 1e6, off50 * 1e6,
           on50 / off50, lo, hi, m50);
    printf("%-9s %-13s %10.1f %10.1f %8.3f\n", tr, "4KiB_p99_us", on99 * 1e6, off99 * 1e6, on99 / off99);
    range(rt, rounds, &lo, &hi);
    double mt = bench_median(rt, (size_t)rounds);
    printf("%-9s %-13s %10.0f %10.0f %8.3f  %.3f..%.3f  %.3f\n", tr, "1MiB_MB/s", ont, offt, offt / ont, lo, hi, mt);
    fflush(stdout);
    side_close(&on);
    side_close(&off);
  }
  free(grad_lat);
  free(grad_tput);
  return 0;
}
