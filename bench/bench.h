/*
 * bench.h - shared helpers of the pshard benchmarks: timing and percentiles, a local
 * cluster of `pshard scheduler` and `pshard server` processes whose pids we know (for
 * RSS), the same-run physical limits (raw TCP and AF_UNIX streams and round trips,
 * memcpy), and a Zipf key generator.
 *
 * Every benchmark prints units, medians over repeats and its ratio to a limit or peer
 * measured in the same run (STYLE.md, benchmarks). Nothing here runs in `make test`.
 */
#ifndef PS_BENCH_H
#define PS_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "pshard.h"

double bench_now(void);
/* Median and percentile (0..100) of n doubles; v is sorted in place. */
double bench_median(double *v, size_t n);
double bench_pct(double *v, size_t n, double p);

/* Die with a message if rc != 0. */
void bench_check(int rc, const char *what);

/* ---------------------------------------------------------------- local cluster */

typedef struct bench_cluster {
  char dir[64];
  char addr[64];        /* scheduler HOST:PORT */
  pid_t sched_pid;
  pid_t server_pid[16];
  int nservers, nworkers;
  int colocated;        /* the K workers bring the servers (colocate=1): no server processes */
} bench_cluster;

/* Path of the pshard binary (env PSHARD_BIN, else the build tree's). */
const char *bench_pshard_bin(void);
/* Start a scheduler for S servers and K workers and S server processes
 * (transport "auto" or "tcp"). Their output goes to DIR/log. */
void bench_cluster_start(bench_cluster *c, int S, int K, const char *transport);
/* A scheduler for K workers that each run a colocated server (K servers in all). */
void bench_cluster_start_colocated(bench_cluster *c, int K);
void bench_cluster_stop(bench_cluster *c);
/* Open a worker context on the cluster (c != NULL), or embedded with S servers
 * (c == NULL). mode: job consistency mode ("async", "sync"), transport "auto"/"tcp". */
ps_ctx *bench_open(const bench_cluster *c, int embedded_servers, int workers, const char *transport,
                   const char *mode);

/* Resident set size of a process in bytes (VmRSS), or 0. */
size_t bench_rss(pid_t pid);
/* CPU seconds used so far by a process, all threads (pid 0 = this process). */
double bench_cpu_s(pid_t pid);
/* Value of "key value" in a ps_server_stats text, or -1. */
double bench_stat_value(const char *text, const char *key);

/* ---------------------------------------------------------------- limits */

/* One-direction stream of `msg` bytes per write, `total` bytes, between two processes
 * over TCP loopback (unix = 0) or an AF_UNIX stream socket (unix = 1). GB/s (1e9). The
 * receiver reads into a reused buffer of msg bytes. */
double bench_raw_stream(int unix_sock, size_t msg, size_t total);
/* Median round trip in seconds of a `req`-byte request answered by a `resp`-byte reply
 * over TCP loopback (unix = 0) or AF_UNIX, between two processes, TCP_NODELAY. */
double bench_raw_rtt(int unix_sock, size_t req, size_t resp, int iters);
/* The raw form of a push+pull: `bytes` one way, then `bytes` back, between two processes,
 * each side sending from one buffer and receiving into another (a worker pushes from its
 * gradient and pulls into its parameters; a server receives into a request body and
 * answers from its rows). GB/s (1e9) of 2 x bytes over the median exchange. */
double bench_raw_exchange(int unix_sock, size_t bytes, int iters);
/* memcpy bandwidth GB/s between two warm buffers of n bytes (counts bytes copied). */
double bench_memcpy(size_t n);

/* ---------------------------------------------------------------- keys */

/* Zipf(s) over [0, n) by rejection-inversion (Hormann & Derflinger), scrambled with a
 * bijection of [0, n) so hot keys are spread over the key space. */
typedef struct bench_zipf {
  uint64_t n;
  double s, hx0, hn, q;
  uint64_t rng;
  uint64_t mul, add;
} bench_zipf;
void bench_zipf_init(bench_zipf *z, uint64_t n, double s, uint64_t seed);
uint64_t bench_zipf_next(bench_zipf *z);
uint64_t bench_rand(uint64_t *state);

#endif
