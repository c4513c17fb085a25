/*
 * bench_dense.c - dense push+pull throughput against the same-run physical limits.
 *
 * One worker (this process) and one server. For each tensor size, a dense table of that
 * many bytes (opt=sgd lr=0 mode=async, so a pull never waits for a round) gets R
 * iterations of push_range(whole tensor) then pull_range(whole tensor); the figure is
 * payload bytes moved (2 x size) over the median iteration time. Limits measured in the
 * same run: a raw TCP loopback stream and a raw AF_UNIX stream of messages of the same
 * size between two processes, and memcpy. For 4 KiB the figure is latency: the median
 * push+pull time against a raw TCP round trip of a 4 KiB request and a 4 KiB reply.
 *
 * Each size is measured two ways: "2 calls" is ps_push_range then ps_pull_range (two
 * round trips, each waiting for its answer), "push_pull" is one ps_push_pull_range
 * (the push and the pull go out back to back: one round trip).
 *
 * Deployments: "tcp" and "unix" use a separate `pshard server` process (transport tcp,
 * or auto = AF_UNIX for a same-host server); "shared" is "unix" with the worker's buffers
 * from ps_alloc (the server maps them and reads and writes the values in place);
 * "embedded" runs the server as a thread of this process (transport auto).
 *
 * Noise: the whole measurement (limit, pshard, limit) runs --rounds times (3), and the
 * figures are medians over the rounds; on this VM one run's ratio at 1 MiB over TCP can
 * differ from the next one's by 0.3.
 *
 * usage: bench_dense [--reps-scale F] [--sizes LIST] [--paths tcp,unix,shared,embedded] [--calls two,one]
 *                    [--rounds R]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

static size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return (size_t)v;
}

static void fmt_size(size_t n, char *out, size_t cap) {
  if (n >= (1u << 20))
    snprintf(out, cap, "%zuMiB", n >> 20);
  else
    snprintf(out, cap, "%zuKiB", n >> 10);
}

typedef struct result {
  double t_med, t_p99, gbps;
  double srv_cpu, cli_cpu; /* CPU seconds per iteration: server process, this process */
} result;

typedef struct sizerun {
  uint32_t tid;
  uint64_t n;
  float *g, *w;
  double *t;
  int nt, reps;
  int one_call;            /* ps_push_pull_range instead of push then pull */
  int shared;              /* g and w from ps_alloc */
  double srv_cpu, cli_cpu;
} sizerun;

static void size_setup(sizerun *z, ps_ctx *ctx, size_t bytes, double reps_scale, const char *path) {
  char name[48];
  memset(z, 0, sizeof *z);
  z->n = bytes / 4;
  snprintf(name, sizeof name, "dense_%s_%zu", path, bytes);
  bench_check(ps_table_declare(ctx, name, PS_DENSE, z->n, "opt=sgd lr=0 mode=async", &z->tid), "declare");
  z->shared = !strcmp(path, "shared");
  z->g = z->shared ? ps_alloc(bytes) : malloc(bytes);
  z->w = z->shared ? ps_alloc(bytes) : malloc(bytes);
  if (!z->g || !z->w) bench_check(PS_ERR_NOMEM, "buffers");
  for (uint64_t i = 0; i < z->n; i++) z->g[i] = (float)(i & 1023) * 1e-3f;
  memset(z->w, 0, bytes);
  z->reps = (int)(((double)(3u << 30) / (double)bytes) * reps_scale);
  if (z->reps < 15) z->reps = 15;
  if (z->reps > 3000) z->reps = 3000;
  z->t = malloc(sizeof *z->t * (size_t)z->reps);
  for (int i = 0; i < 3; i++) {
    bench_check(ps_push_range(ctx, z->tid, 0, z->n, z->g, 1, -1, -1), "push_range");
    bench_check(ps_pull_range(ctx, z->tid, 0, z->n, z->w, -1), "pull_range");
  }
}

/* Run `count` more iterations, recording their times and CPU use. */
static void size_block(sizerun *z, ps_ctx *ctx, int count, pid_t srv) {
  double s0 = srv ? bench_cpu_s(srv) : 0, c0 = bench_cpu_s(0);
  for (int i = 0; i < count && z->nt < z->reps; i++) {
    double t0 = bench_now();
    if (z->one_call) {
      bench_check(ps_push_pull_range(ctx, z->tid, 0, z->n, z->g, 1, -1, z->w, -1), "push_pull_range");
    } else {
      bench_check(ps_push_range(ctx, z->tid, 0, z->n, z->g, 1, -1, -1), "push_range");
      bench_check(ps_pull_range(ctx, z->tid, 0, z->n, z->w, -1), "pull_range");
    }
    z->t[z->nt++] = bench_now() - t0;
  }
  z->srv_cpu += srv ? bench_cpu_s(srv) - s0 : 0;
  z->cli_cpu += bench_cpu_s(0) - c0;
}

static result size_result(sizerun *z, size_t bytes) {
  result r;
  r.srv_cpu = z->srv_cpu / z->nt;
  r.cli_cpu = z->cli_cpu / z->nt;
  r.t_p99 = bench_pct(z->t, (size_t)z->nt, 99);
  r.t_med = bench_median(z->t, (size_t)z->nt);
  r.gbps = 2.0 * (double)bytes / r.t_med / 1e9;
  free(z->t);
  if (z->shared) {
    ps_free(z->g);
    ps_free(z->w);
  } else {
    free(z->g);
    free(z->w);
  }
  return r;
}

/* The raw exchange (push+pull's own pattern, bench_raw_exchange) for a message size, GB/s. */
static double xchg_of(int is_tcp, size_t bytes) {
  size_t it = ((size_t)256 << 20) / bytes;
  return bench_raw_exchange(!is_tcp, bytes, it < 5 ? 5 : it > 2000 ? 2000 : (int)it);
}

/* The limit for a message size: raw round trip (4 KiB and less) or raw stream GB/s. */
static double limit_of(int is_tcp, size_t bytes) {
  if (bytes <= 4096) return bench_raw_rtt(!is_tcp, bytes, bytes, 3000);
  return bench_raw_stream(!is_tcp, bytes, bytes * 16 > (512u << 20) ? bytes * 16 : (512u << 20));
}

int main(int argc, char **argv) {
  const char *sizes_s = "4K,256K,1M,4M,16M,64M";
  const char *paths_s = "tcp,unix,shared,embedded";
  double reps_scale = 1.0;
  const char *calls_s = "two,one";
  int rounds = 3;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--sizes") && i + 1 < argc) sizes_s = argv[++i];
    else if (!strcmp(argv[i], "--paths") && i + 1 < argc) paths_s = argv[++i];
    else if (!strcmp(argv[i], "--reps-scale") && i + 1 < argc) reps_scale = atof(argv[++i]);
    else if (!strcmp(argv[i], "--calls") && i + 1 < argc) calls_s = argv[++i];
    else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: bench_dense [--sizes 4K,256K,1M,...] [--paths tcp,unix,shared,embedded] [--reps-scale F] "
                      "[--calls two,one] [--rounds R]\n");
      return 2;
    }
  }
  if (rounds < 1 || rounds > 9) {
    fprintf(stderr, "bench_dense: --rounds takes 1 to 9\n");
    return 2;
  }
  size_t sizes[16];
  int nsizes = 0;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", sizes_s);
  for (char *s = strtok(buf, ","); s && nsizes < 16; s = strtok(NULL, ",")) sizes[nsizes++] = parse_size(s);

  printf("# bench_dense: dense push+pull of the whole tensor, 1 worker, 1 server (opt=sgd lr=0 mode=async)\n");
  printf("# GB/s = 2 x size / median iteration; limit = raw stream of the same message size between two\n");
  printf("# processes (tcp: TCP loopback; unix, shared, embedded: AF_UNIX), measured before and after each path's\n");
  printf("# run (the better of the two); 4 KiB: latency against a raw 4 KiB request / 4 KiB reply round trip.\n");
  printf("# cpu_us: CPU per iteration of the server process and of this (worker) process.\n");
  int calls[2], ncalls = 0;
  if (strstr(calls_s, "two")) calls[ncalls++] = 0;
  if (strstr(calls_s, "one")) calls[ncalls++] = 1;
  if (!ncalls) {
    fprintf(stderr, "bench_dense: --calls takes two, one or two,one\n");
    return 2;
  }
  printf("# calls: '2 calls' = ps_push_range + ps_pull_range; 'push_pull' = one ps_push_pull_range.\n");
  printf("# %d rounds (limit before, pshard, limit after); every figure is the median over the rounds, the\n"
         "# ratio the median of each round's ratio to its own limit, and ratio_range its range.\n", rounds);
  printf("# xchg: GB/s of a raw exchange, push+pull's own pattern with no parameter server: size bytes one way,\n"
         "# then size bytes back, each side sending from one buffer and receiving into another; vs_xchg: GB/s / xchg.\n");
  printf("%-9s %-9s %-7s %10s %10s %9s %9s %7s %11s %7s %7s %9s %9s %8s  %s\n", "path", "calls", "size", "med_us",
         "p99_us", "GB/s", "limit", "ratio", "ratio_range", "xchg", "vs_xchg", "srv_cpu_us", "wrk_cpu_us", "memcpy",
         "target");
  fflush(stdout);
  char pbuf[128];
  snprintf(pbuf, sizeof pbuf, "%s", paths_s);
  char *save = NULL;
  enum { ROUNDS_MAX = 9 };
  for (char *path = strtok_r(pbuf, ",", &save); path; path = strtok_r(NULL, ",", &save)) {
    int emb = !strcmp(path, "embedded");
    int is_tcp = !strcmp(path, "tcp");
    const char *transport = is_tcp ? "tcp" : "auto";
    static result res[ROUNDS_MAX][16][2];
    static double limit[ROUNDS_MAX][16], xchg[ROUNDS_MAX][16];
    double dc = 0, np = 0, nq = 0;
    for (int rd = 0; rd < rounds; rd++) {
      bench_cluster c;
      ps_ctx *ctx;
      /* Limits are measured before the context opens and after it closes (no fork while
       * the worker's I/O thread runs: copy-on-write faults would slow pshard down); the
       * better of the two is the round's limit. */
      double lim0[16], x0[16];
      for (int i = 0; i < nsizes; i++) {
        lim0[i] = limit_of(is_tcp, sizes[i]);
        x0[i] = sizes[i] > 4096 ? xchg_of(is_tcp, sizes[i]) : 0;
      }
      if (emb) {
        ctx = bench_open(NULL, 1, 1, transport, "async");
      } else {
        bench_cluster_start(&c, 1, 1, transport);
        ctx = bench_open(&c, 0, 1, transport, "async");
      }
      pid_t srv = emb ? 0 : c.server_pid[0];
      for (int i = 0; i < nsizes; i++) {
        for (int k = 0; k < ncalls; k++) {
          sizerun z;
          size_setup(&z, ctx, sizes[i], reps_scale, path);
          z.one_call = calls[k];
          size_block(&z, ctx, z.reps, srv);
          res[rd][i][k] = size_result(&z, sizes[i]);
        }
      }
      double x;
      if (!ps_ctx_stat(ctx, "direct_calls", &x)) dc += x;
      if (!ps_ctx_stat(ctx, "pushes", &x)) np += x;
      if (!ps_ctx_stat(ctx, "pulls", &x)) nq += x;
      ps_ctx_close(ctx);
      if (!emb) bench_cluster_stop(&c);
      for (int i = 0; i < nsizes; i++) {
        double l1 = limit_of(is_tcp, sizes[i]), x1 = sizes[i] > 4096 ? xchg_of(is_tcp, sizes[i]) : 0;
        limit[rd][i] = sizes[i] <= 4096 ? (lim0[i] < l1 ? lim0[i] : l1) : (lim0[i] > l1 ? lim0[i] : l1);
        xchg[rd][i] = x0[i] > x1 ? x0[i] : x1;
      }
    }
    printf("# %s: %.0f of %.0f requests ran on the caller's thread (lent links)\n", path, dc, np + nq);
    for (int i = 0; i < nsizes; i++) {
      size_t bytes = sizes[i];
      double mc = bench_memcpy(bytes);
      for (int k = 0; k < ncalls; k++) {
        /* Medians over the rounds: of each figure, and of each round's ratio to its own
         * limit (the ratio's range over the rounds is printed too). */
        double med[ROUNDS_MAX], p99[ROUNDS_MAX], gb[ROUNDS_MAX], sc[ROUNDS_MAX], cc[ROUNDS_MAX], lm[ROUNDS_MAX],
            ra[ROUNDS_MAX], xr[ROUNDS_MAX], lo = 1e300, hi = 0;
        for (int rd = 0; rd < rounds; rd++) {
          result r = res[rd][i][k];
          med[rd] = r.t_med, p99[rd] = r.t_p99, gb[rd] = r.gbps, sc[rd] = r.srv_cpu, cc[rd] = r.cli_cpu;
          lm[rd] = limit[rd][i];
          ra[rd] = bytes <= 4096 ? r.t_med / limit[rd][i] : r.gbps / limit[rd][i];
          xr[rd] = bytes <= 4096 ? 0 : r.gbps / xchg[rd][i];
          if (ra[rd] < lo) lo = ra[rd];
          if (ra[rd] > hi) hi = ra[rd];
        }
        size_t n = (size_t)rounds;
        double t_med = bench_median(med, n), t_p99 = bench_median(p99, n), gbps = bench_median(gb, n);
        double srv_cpu = bench_median(sc, n), cli_cpu = bench_median(cc, n), lim = bench_median(lm, n);
        double ratio = bench_median(ra, n), vs_x = bench_median(xr, n);
        const char *cl = calls[k] ? "push_pull" : "2 calls";
        char sz[16], range[48];
        fmt_size(bytes, sz, sizeof sz);
        snprintf(range, sizeof range, "%.2f-%.2f", lo, hi);
        if (bytes <= 4096) {
          printf("%-9s %-9s %-7s %10.1f %10.1f %9.3f %7.1fus %6.2fx %11s %7s %7s %9.1f %9.1f %8.1f  %s\n", path, cl,
                 sz, t_med * 1e6, t_p99 * 1e6, gbps, lim * 1e6, ratio, range, "-", "-", srv_cpu * 1e6, cli_cpu * 1e6,
                 mc, is_tcp ? "<= 2x raw TCP round trip" : "(vs raw AF_UNIX round trip)");
        } else {
          const char *tgt = bytes >= (1u << 20) ? (is_tcp ? ">= 0.80 of raw TCP" : ">= 0.60 of raw AF_UNIX") : "-";
          double xm[ROUNDS_MAX];
          for (int rd = 0; rd < rounds; rd++) xm[rd] = xchg[rd][i];
          printf("%-9s %-9s %-7s %10.1f %10.1f %9.3f %9.3f %7.2f %11s %7.3f %7.2f %9.1f %9.1f %8.1f  %s\n", path, cl,
                 sz, t_med * 1e6, t_p99 * 1e6, gbps, lim, ratio, range, bench_median(xm, n), vs_x, srv_cpu * 1e6,
                 cli_cpu * 1e6, mc, tgt);
        }
        fflush(stdout);
      }
    }
  }
  return 0;
}
