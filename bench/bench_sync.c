/*
 * bench_sync.c - a synchronous dense round against MPI_Allreduce, same run.
 *
 * K worker processes (forked from this one) each contribute a gradient of N floats per
 * step to a dense table in sync mode (opt=sgd): push_range(all), ps_clock, pull_range
 * (all), which returns once the round is applied on every server - the PS equivalent
 * of one all-reduce. S = 1 server, or S = K servers with the tensor's slices spread
 * evenly over them (design.md section 4), as K server processes or as a server
 * colocated in each worker process (S = Kc, colocate=1). The step time is the slowest
 * worker's, median over steps, then the median over --runs fresh clusters.
 *
 * Peer: bench_mpi_allreduce under `mpirun -np K --oversubscribe` (Open MPI), run twice:
 * with glibc's default allocation thresholds, and with MALLOC_MMAP_THRESHOLD_ and
 * MALLOC_TRIM_THRESHOLD_ raised (Open MPI's large temporaries then reuse warm heap
 * pages instead of fresh mmap pages); the ratio is against the better of the two.
 *
 * Bytes per step: every PS worker sends 4N and receives 4N (payload), whatever S; the
 * servers together receive and send K x 4N, each 4N x K / S. A ring all-reduce sends
 * and receives 2 (K-1)/K x 4N per rank. Both are printed beside the times.
 *
 * This machine has 2 cores: K workers, S servers and a scheduler are oversubscribed,
 * as are the K MPI ranks.
 *
 * usage: bench_sync [--floats 1M,16M] [--workers 2,4] [--steps N] [--mpirun PATH] [--layouts 1,K,Kc] [--no-mpi]
 *                   [--runs R]
 *   --runs     fresh clusters (and mpirun calls) per configuration, interleaved (3); the
 *              table shows the median over them: on this VM one cluster's rounds can be
 *              twice as slow as the next one's, for the whole run
 *   --layouts  which server layouts to run: 1 (one server process), K (K server processes),
 *              Kc (a server colocated in each worker process); Ks and Kcs: K and Kc with
 *              the workers' buffers from ps_alloc (shared with the servers of the host:
 *              a server reads the gradients and writes the pulled values in place)
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

#ifndef MPI_BENCH_DEFAULT
#define MPI_BENCH_DEFAULT "bench_mpi_allreduce"
#endif

/* Per step of one worker: the whole round, then its push, clock and pull calls. The
 * pull includes waiting for the other workers' pushes and the servers' update. */
#define NPH 4

/* One worker: run steps, write its step and phase times (after warm-up) to fd. */
static void worker(const bench_cluster *c, int K, uint64_t n, int steps, int shared, int fd) {
  ps_ctx *ctx = bench_open(c, 0, K, "auto", "sync");
  uint32_t tid;
  bench_check(ps_table_declare(ctx, "grad", PS_DENSE, n, "opt=sgd lr=0.0001 mode=sync", &tid), "declare");
  float *g = shared ? ps_alloc(n * 4) : malloc(n * 4), *w = shared ? ps_alloc(n * 4) : malloc(n * 4);
  if (!g || !w) _exit(1);
  for (uint64_t i = 0; i < n; i++) g[i] = (float)(i % 89) * 1e-3f;
  memset(w, 0, n * 4);
  int warm = 3;
  double *t = malloc(sizeof *t * NPH * (size_t)(steps + warm));
  bench_check(ps_barrier(ctx, -1), "barrier");
  for (int s = 0; s < warm + steps; s++) {
    double t0 = bench_now();
    bench_check(ps_push_range(ctx, tid, 0, n, g, 1, -1, -1), "push_range");
    double t1 = bench_now();
    bench_check(ps_clock(ctx), "clock");
    double t2 = bench_now();
    bench_check(ps_pull_range(ctx, tid, 0, n, w, -1), "pull_range");
    double t3 = bench_now();
    double *o = t + NPH * (size_t)s;
    o[0] = t3 - t0, o[1] = t1 - t0, o[2] = t2 - t1, o[3] = t3 - t2;
  }
  bench_check(ps_barrier(ctx, -1), "barrier");
  if (write(fd, t + NPH * warm, sizeof *t * NPH * (size_t)steps) < 0) _exit(1);
  ps_ctx_close(ctx);
  _exit(0);
}

/* Median over steps of the slowest worker's step time; ph: medians over workers and
 * steps of the push and pull calls. */
static double run_ps(int K, int S, int colocated, int shared, uint64_t n, int steps, double ph[2]) {
  bench_cluster c;
  if (colocated) bench_cluster_start_colocated(&c, K);
  else bench_cluster_start(&c, S, K, "auto");
  int fds[8][2];
  pid_t pids[8];
  for (int k = 0; k < K; k++) {
    if (pipe(fds[k])) exit(1);
    pids[k] = fork();
    if (pids[k] == 0) {
      close(fds[k][0]);
      worker(&c, K, n, steps, shared, fds[k][1]);
    }
    close(fds[k][1]);
  }
  double *t = calloc((size_t)steps, sizeof *t), *tk = malloc(sizeof *tk * NPH * (size_t)steps);
  double *push = malloc(sizeof *push * (size_t)(K * steps)), *pull = malloc(sizeof *pull * (size_t)(K * steps));
  for (int k = 0; k < K; k++) {
    size_t got = 0, want = sizeof *tk * NPH * (size_t)steps;
    while (got < want) {
      ssize_t r = read(fds[k][0], (char *)tk + got, want - got);
      if (r <= 0) break;
      got += (size_t)r;
    }
    close(fds[k][0]);
    if (got != want) {
      fprintf(stderr, "bench_sync: worker %d failed (see %s/log)\n", k, c.dir);
      exit(1);
    }
    for (int s = 0; s < steps; s++) {
      if (tk[NPH * s] > t[s]) t[s] = tk[NPH * s];
      push[k * steps + s] = tk[NPH * s + 1];
      pull[k * steps + s] = tk[NPH * s + 3];
    }
  }
  ph[0] = bench_median(push, (size_t)(K * steps));
  ph[1] = bench_median(pull, (size_t)(K * steps));
  free(push);
  free(pull);
  for (int k = 0; k < K; k++) waitpid(pids[k], NULL, 0);
  bench_cluster_stop(&c);
  double m = bench_median(t, (size_t)steps);
  free(t);
  free(tk);
  return m;
}

static double run_mpi(const char *mpirun, const char *prog, int K, uint64_t n, int steps, int big_thresholds) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd,
           "%s %s --allow-run-as-root --oversubscribe -np %d --mca btl self,vader %s %s %llu %d 2>/dev/null",
           big_thresholds ? "MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=8589934592" : "", mpirun, K,
           big_thresholds ? "-x MALLOC_MMAP_THRESHOLD_ -x MALLOC_TRIM_THRESHOLD_" : "", prog, (unsigned long long)n,
           steps);
  FILE *f = popen(cmd, "r");
  if (!f) return -1;
  char line[256];
  double v = -1;
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, "median_s ", 9)) v = atof(line + 9);
  pclose(f);
  return v;
}

int main(int argc, char **argv) {
  const char *floats_s = "1M,16M", *workers_s = "2,4", *mpirun = "mpirun";
  const char *prog = getenv("BENCH_MPI") ? getenv("BENCH_MPI") : MPI_BENCH_DEFAULT;
  const char *layouts = "1,K,Kc,Ks,Kcs";
  int steps = 15, no_mpi = 0, runs = 3;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--floats") && i + 1 < argc) floats_s = argv[++i];
    else if (!strcmp(argv[i], "--workers") && i + 1 < argc) workers_s = argv[++i];
    else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--mpirun") && i + 1 < argc) mpirun = argv[++i];
    else if (!strcmp(argv[i], "--layouts") && i + 1 < argc) layouts = argv[++i];
    else if (!strcmp(argv[i], "--no-mpi")) no_mpi = 1;
    else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: bench_sync [--floats 1M,16M] [--workers 2,4] [--steps N] [--mpirun PATH] [--layouts 1,K,Kc,Ks,Kcs] [--no-mpi] [--runs R]\n");
      return 2;
    }
  }
  signal(SIGPIPE, SIG_IGN);
  uint64_t sizes[8];
  int ks[8], ns = 0, nk = 0;
  char buf[128];
  snprintf(buf, sizeof buf, "%s", floats_s);
  for (char *s = strtok(buf, ","); s && ns < 8; s = strtok(NULL, ",")) {
    char *e;
    double v = strtod(s, &e);
    if (*e == 'M' || *e == 'm') v *= 1 << 20;
    if (*e == 'K' || *e == 'k') v *= 1 << 10;
    sizes[ns++] = (uint64_t)v;
  }
  snprintf(buf, sizeof buf, "%s", workers_s);
  for (char *s = strtok(buf, ","); s && nk < 8; s = strtok(NULL, ",")) ks[nk++] = atoi(s);

  printf("# bench_sync: sync round (push, aggregate, pull) of N floats per worker vs MPI_Allreduce, %d steps, "
         "median of the slowest worker/rank; then the median over %d runs (fresh clusters, interleaved)\n", steps, runs);
  printf("# MB/worker: payload each worker sends (= receives) per step; MB/server: what each server receives "
         "(= sends): a dense table is spread evenly, to one slice; ring: 2(K-1)/K x 4N per rank\n");
  printf("# xproc_MB: bytes copied from one process to another per step, all processes together: 2 K 4N with "
         "server processes, 2 (K-1) 4N with colocated servers (a worker's part for its own server stays in its "
         "process), 2 (K-1) 4N for a ring all-reduce (mpi_x)\n");
  printf("# S = Kc: the K workers each run a colocated server (colocate=1) instead of K server processes\n");
  printf("# S = Ks, Kcs: the same with the workers' gradient and pull buffers from ps_alloc (memory shared with the "
         "servers of the host, which read and write it in place instead of the kernel copying it)\n");
  printf("# push_ms / pull_ms: medians over workers and steps of one worker's push call and pull call (the pull "
         "waits for every worker's push and the update)\n");
  printf("%2s %4s %8s %10s %10s %10s %9s %9s %9s %9s %8s %8s %8s %8s %8s  %s\n", "K", "S", "floats", "pshard_ms",
         "mpi_ms", "mpi_big_ms", "MB/wrk", "MB/srv", "ring_MB", "xproc_MB", "mpi_x", "push_ms", "pull_ms", "ratio",
         "vs_best", "target");
  fflush(stdout);
  enum { RUNS_MAX = 32 };
  if (runs < 1 || runs > RUNS_MAX) runs = runs < 1 ? 1 : RUNS_MAX;
  for (int ki = 0; ki < nk; ki++) {
    int K = ks[ki];
    for (int si = 0; si < ns; si++) {
      uint64_t n = sizes[si];
      enum { NL = 5 };
      static const char *names[NL] = {"1", "K", "Kc", "Ks", "Kcs"}, *tags[NL] = {"", "", "c", "s", "cs"};
      static const int colo_of[NL] = {0, 0, 1, 0, 1}, shared_of[NL] = {0, 0, 0, 1, 1};
      double mpi_r[RUNS_MAX], big_r[RUNS_MAX], ps_r[NL][RUNS_MAX], push_r[NL][RUNS_MAX], pull_r[NL][RUNS_MAX];
      int Ss[NL] = {1, K, K, K, K}, on[NL];
      for (int j = 0; j < NL; j++) {
        const char *name = names[j];
        char lay[64], want[8];
        snprintf(lay, sizeof lay, ",%s,", layouts);
        snprintf(want, sizeof want, ",%s,", name);
        on[j] = strstr(lay, want) != NULL;
      }
      for (int r = 0; r < runs; r++) {
        mpi_r[r] = no_mpi ? -1 : run_mpi(mpirun, prog, K, n, steps, 0);
        big_r[r] = no_mpi ? -1 : run_mpi(mpirun, prog, K, n, steps, 1);
        for (int j = 0; j < NL; j++) {
          if (!on[j]) continue;
          double ph[2];
          ps_r[j][r] = run_ps(K, Ss[j], colo_of[j], shared_of[j], n, steps, ph);
          push_r[j][r] = ph[0], pull_r[j][r] = ph[1];
        }
      }
      double mpi = bench_median(mpi_r, (size_t)runs), mpi_big = bench_median(big_r, (size_t)runs);
      double best = mpi > 0 && (mpi_big <= 0 || mpi < mpi_big) ? mpi : mpi_big;
      double mb = 4.0 * (double)n / 1e6;
      for (int j = 0; j < NL; j++) {
        if (!on[j]) continue;
        int S = Ss[j], colo = colo_of[j];
        double ps = bench_median(ps_r[j], (size_t)runs);
        double xproc = (colo ? 2.0 * (K - 1) : 2.0 * K) * mb;
        printf("%2d %2d%-2s %7.0fM %10.2f %10.2f %10.2f %9.1f %9.1f %9.1f %9.1f %8.1f %8.1f %8.1f %8.2f %8.2f  %s\n", K,
               S, tags[j], (double)n / (1 << 20), ps * 1e3, mpi * 1e3, mpi_big * 1e3, mb, mb * K / S,
               2.0 * (K - 1) / K * mb, xproc, 2.0 * (K - 1) * mb, bench_median(push_r[j], (size_t)runs) * 1e3,
               bench_median(pull_r[j], (size_t)runs) * 1e3, mpi > 0 ? ps / mpi : 0, best > 0 ? ps / best : 0,
               S == K ? "<= 1.5x all-reduce (S = K)" : "");
        fflush(stdout);
      }
    }
  }
  return 0;
}
