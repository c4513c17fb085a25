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
 * --engine: the row store alone, in this process (no server, no sockets): a row map of
 * the table's row width filled with N distinct keys, and its memory apart (rows,
 * parameters, optimiser state, keys, index, spare chunk room), exact: bytes per row and
 * the ratio to key + payload, the floor of any layout that keeps both. Fast enough for
 * 10^8 rows; the figures are ps__rowmap_usage's, which counts every allocation.
 * --reserve (with --engine): the index is sized for the N rows before the fill
 * (ps__rowmap_reserve, as a table loaded by requests as large as itself is), with
 * room to stay below the point where the next index would be prepared; no growth, no
 * old index beside the new one, so the peak is the end's figure. For 10^9 rows.
 *
 * usage: bench_memory [--rows N] [--dim D] [--batch B] [--opt adagrad] [--transport T] [--engine [--reserve]]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "store/store.h"

/* --engine: fill a row map with nrows keys, print its memory apart. */
static int engine_bytes(uint64_t nrows, unsigned dim, unsigned nstate, const char *opt, int reserve) {
  size_t rf = (size_t)dim * (1 + nstate);
  ps__rowmap *m = ps__rowmap_new(rf);
  if (!m) return 1;
  double t0 = bench_now();
  /* The next index is prepared from 15/16 of the rows an index holds: keep below it. */
  if (reserve && ps__rowmap_reserve(m, (size_t)(nrows + nrows / 15 + 4096))) {
    fprintf(stderr, "bench_memory: cannot reserve an index for %llu rows\n", (unsigned long long)nrows);
    return 1;
  }
  for (uint64_t i = 0; i < nrows; i++)
    if (!ps__rowmap_upsert(m, i * 0x9e3779b97f4a7c15ull, NULL)) {
      fprintf(stderr, "bench_memory: out of memory at row %llu\n", (unsigned long long)i);
      return 1;
    }
  double t = bench_now() - t0;
  ps__rowmap_use u;
  ps__rowmap_usage(m, &u);
  double n = (double)u.rows, params = n * dim * 4, state = (double)u.payload - params;
  printf("# bench_memory --engine: row map of %llu rows x dim %u, opt=%s (%zu floats per row), filled in %.1f s "
         "(%.2f M rows/s)%s; exact accounting\n", (unsigned long long)nrows, dim, opt, rf, t, n / t / 1e6,
         reserve ? ", index reserved first" : "");
  printf("%-12s %14s %10s\n", "part", "bytes", "per row");
  printf("%-12s %14.0f %10.2f\n", "parameters", params, params / n);
  printf("%-12s %14.0f %10.2f\n", "optim_state", state, state / n);
  printf("%-12s %14zu %10.2f\n", "keys", u.keys, (double)u.keys / n);
  printf("%-12s %14zu %10.2f\n", "index", u.index, (double)u.index / n);
  printf("%-12s %14zu %10.2f\n", "spare", u.spare, (double)u.spare / n);
  printf("%-12s %14zu %10.2f\n", "total", u.total, (double)u.total / n);
  printf("%-28s %8.3f   (rows still moving to a new index: %zu)\n", "total / (key + payload)",
         (double)u.total / (double)(u.keys + u.payload), ps__rowmap_moving(m));
  printf("%-28s %8.3f\n", "total / payload", (double)u.total / (double)u.payload);
  size_t rss = bench_rss(getpid());
  printf("%-28s %14zu %10.2f   (this process, the map and the benchmark)\n", "rss", rss, (double)rss / n);
  ps__rowmap_free(m);
  return 0;
}

int main(int argc, char **argv) {
  uint64_t nrows = 10000000;
  unsigned dim = 16;
  size_t batch = 100000;
  const char *opt = "adagrad", *transport = "auto";
  int engine = 0, reserve = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--rows") && i + 1 < argc) nrows = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--dim") && i + 1 < argc) dim = (unsigned)atoi(argv[++i]);
    else if (!strcmp(argv[i], "--batch") && i + 1 < argc) batch = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--opt") && i + 1 < argc) opt = argv[++i];
    else if (!strcmp(argv[i], "--transport") && i + 1 < argc) transport = argv[++i];
    else if (!strcmp(argv[i], "--engine")) engine = 1;
    else if (!strcmp(argv[i], "--reserve")) reserve = 1;
    else {
      fprintf(stderr, "usage: bench_memory [--rows N] [--dim D] [--batch B] [--opt O] [--transport T] [--engine [--reserve]]\n");
      return 2;
    }
  }
  unsigned nstate = !strcmp(opt, "sgd") ? 0 : (!strcmp(opt, "adam") || !strcmp(opt, "ftrl")) ? 2 : 1;
  if (dim == 0 || nrows == 0) {
    fprintf(stderr, "bench_memory: --rows and --dim must be positive\n");
    return 2;
  }
  if (reserve && !engine) {
    fprintf(stderr, "bench_memory: --reserve goes with --engine\n");
    return 2;
  }
  if (engine) return engine_bytes(nrows, dim, nstate, opt, reserve);
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
