/*
 * bench_memory.c - server resident memory per stored parameter.
 *
 * A sparse table of N rows (10M) x dim 16 with adagrad (so each row is 16 parameters
 * and 16 accumulator floats: payload = N x 16 x 2 x 4 bytes) is filled by one worker
 * with pushes of B distinct keys each (100k), in async mode, on one server process.
 * Printed: the server's RSS (VmRSS of /proc/PID/status) before the table and after,
 * the server's own accounting (ps_server_stats: store_bytes, payload_bytes), and the
 * ratios RSS / payload (target <= 1.3) and store / payload.
 *
 * usage: bench_memory [--rows N] [--dim D] [--batch B] [--opt adagrad] [--transport T]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"

int main(int argc, char **argv) {
  uint64_t nrows = 10000000;
  unsigned dim = 16;
  size_t batch = 100000;
  const char *opt = "adagrad", *transport = "auto";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--rows") && i + 1 < argc) nrows = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--dim") && i + 1 < argc) dim = (unsigned)atoi(argv[++i]);
    else if (!strcmp(argv[i], "--batch") && i + 1 < argc) batch = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--opt") && i + 1 < argc) opt = argv[++i];
    else if (!strcmp(argv[i], "--transport") && i + 1 < argc) transport = argv[++i];
    else {
      fprintf(stderr, "usage: bench_memory [--rows N] [--dim D] [--batch B] [--opt O] [--transport T]\n");
      return 2;
    }
  }
  unsigned nstate = !strcmp(opt, "sgd") ? 0 : (!strcmp(opt, "adam") || !strcmp(opt, "ftrl")) ? 2 : 1;
  bench_cluster c;
  bench_cluster_start(&c, 1, 1, transport);
  ps_ctx *ctx = bench_open(&c, 0, 1, transport, "async");
  pid_t srv = c.server_pid[0];
  usleep(200000);
  size_t rss0 = bench_rss(srv);
  uint32_t tid;
  char opts[96];
  snprintf(opts, sizeof opts, "opt=%s lr=0.01 mode=async init=uniform:0.01", opt);
  bench_check(ps_table_declare(ctx, "mem", PS_SPARSE, dim, opts, &tid), "declare");
  uint64_t *keys = malloc(batch * 8);
  float *g = malloc(batch * dim * 4);
  for (size_t i = 0; i < batch * dim; i++) g[i] = 1e-3f;
  double t0 = bench_now();
  for (uint64_t base = 0; base < nrows; base += batch) {
    size_t n = nrows - base < batch ? (size_t)(nrows - base) : batch;
    /* Distinct keys spread over the id space (as hashed feature ids are). */
    for (size_t i = 0; i < n; i++) keys[i] = (base + i) * 0x9e3779b97f4a7c15ull;
    bench_check(ps_push(ctx, tid, keys, n, g, 1, -1, -1), "push");
  }
  double t = bench_now() - t0;
  usleep(200000);
  size_t rss1 = bench_rss(srv);
  char stats[8192];
  bench_check(ps_server_stats(ctx, 0, stats, sizeof stats, -1), "ps_server_stats");
  double store = bench_stat_value(stats, "store_bytes");
  double payload = bench_stat_value(stats, "payload_bytes");
  double rows = bench_stat_value(stats, "rows");
  double expect = (double)nrows * dim * (1 + nstate) * 4;
  printf("# bench_memory: sparse table of %llu rows x dim %u, opt=%s (%u state floats per parameter), filled by "
         "pushes of %zu distinct keys in %.1f s; one server process\n",
         (unsigned long long)nrows, dim, opt, nstate, batch, t);
  printf("rows %.0f\n", rows);
  printf("payload_bytes %.0f (parameters + optimiser state; expected %.0f)\n", payload, expect);
  printf("store_bytes %.0f (server accounting: row chunks + index)\n", store);
  printf("server_rss_idle_bytes %zu\n", rss0);
  printf("server_rss_bytes %zu\n", rss1);
  printf("%-28s %8.3f   target <= 1.30\n", "rss / payload", (double)rss1 / expect);
  printf("%-28s %8.3f\n", "(rss - idle rss) / payload", (double)(rss1 - rss0) / expect);
  printf("%-28s %8.3f\n", "store / payload", store / expect);
  printf("%-28s %8.1f\n", "rss bytes per parameter", (double)rss1 / ((double)nrows * dim));
  free(keys);
  free(g);
  ps_ctx_close(ctx);
  bench_cluster_stop(&c);
  return 0;
}
