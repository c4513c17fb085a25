/*
 * bench_bigtable.c - throughput on a big table against the same on a table ten times
 * smaller, in the same run: the cost of cache and TLB misses as a table grows.
 *
 * Two sparse tables of dim 1 (--opt, adagrad by default: a parameter and its
 * accumulator per row) on one server process, "small" of --small rows (10^7) and "big"
 * of --big rows (10^8), reached by one worker (this process) over loopback. Each table
 * is filled first by pushes of --load-batch (100k) new keys each (every key creates a
 * row): the load rate, new rows per second, is printed per table (target >= 5 M rows/s
 * per server). Then pulls and pushes of B keys (1k, 10k, 100k) drawn from a Zipf(1.1)
 * distribution over each table's rows, scrambled over its keys, in --rounds (3) rounds
 * of (small pull, big pull, small push, big push) per batch size, --seconds (0.5) each:
 * rows/s, p50 and p99 per request, medians over the rounds, and the per-row cost at the
 * big size over the small one (small rows/s / big rows/s, the median of each round's
 * ratio, with its range; target <= 1.5). Every figure also per CPU second of the work
 * (the server process's CPU time; in engine mode this thread's): on a shared machine
 * a busy moment stretches the wall clock, not the CPU time, so the CPU figures are the
 * ones to compare across runs.
 *
 * --load-only: the load phase alone (the two fills), without the requests after it.
 *
 * --engine: the same on the shard engine in this process (no server, no sockets): the
 * store's and the optimiser's cost apart from the wire's. The load lines then also say
 * how much of the tables' next indexes this thread faulted in itself (the part the row
 * map's helper thread had not reached in time). Pushes go through
 * ps__shard_push (async), pulls through ps__shard_read_rows, as a server's loop calls
 * them.
 *
 * usage: bench_bigtable [--small N] [--big N] [--opt O] [--batches LIST] [--load-batch B]
 *                       [--seconds S] [--rounds R] [--transport tcp|auto] [--engine] [--load-only]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "shard/shard.h"

#define ZIPF_S 1.1
#define POOL_KEYS (2u << 20)
#define ROUNDS_MAX 9
#define NBATCH_MAX 8

static double g_seconds = 0.5;
static int g_rounds = 3;

/* What the measurements run against: a server over the wire, or the engine here. */
typedef struct target {
  ps_ctx *ctx;       /* server mode */
  pid_t server;      /* server mode: the server process, whose CPU time is counted */
  ps__shard *sh;     /* engine mode */
  uint32_t tid[2];   /* small, big */
  uint8_t *kbuf;     /* engine: keys in wire order */
  float *obuf;       /* engine: pull output */
} target;

typedef struct table_keys {
  uint64_t rows;
  uint64_t *pool; /* Zipf keys over [0, rows) */
} table_keys;

/* CPU seconds of the work measured: the server process's (all its threads), or in
 * engine mode this thread's. On a shared machine a busy minute stretches the wall
 * clock, not these. */
static double work_cpu(const target *g) {
  if (!g->sh) return bench_cpu_s(g->server);
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *bt_alloc(void *arg, size_t n) {
  (void)arg;
  return malloc(n ? n : 1);
}
static void bt_release(void *arg, void *buf, size_t n) {
  (void)arg, (void)n;
  free(buf);
}

static void engine_push(target *g, int which, const uint64_t *keys, size_t n, const float *vals) {
  for (size_t i = 0; i < n; i++) ps__put_u64(g->kbuf + 8 * i, keys[i]);
  ps__push p = {.table = g->tid[which], .sender = 1, .batch = 1, .lr = -1.0f, .keys = g->kbuf,
                .nkeys = (uint32_t)n, .vals = vals, .nvals = (uint64_t)n};
  ps__verdict v;
  if (ps__shard_push(g->sh, &p, NULL, &v) != PS__APPLIED) {
    fprintf(stderr, "bench_bigtable: engine push failed: %s\n", v.msg);
    exit(1);
  }
  ps__shard_agg_flush(ps__shard_table(g->sh, g->tid[which]));
}

static void engine_pull(target *g, int which, const uint64_t *keys, size_t n, float *out) {
  for (size_t i = 0; i < n; i++) ps__put_u64(g->kbuf + 8 * i, keys[i]);
  if (ps__shard_read_rows(ps__shard_table(g->sh, g->tid[which]), g->kbuf, 0, (uint32_t)n, out)) {
    fprintf(stderr, "bench_bigtable: engine pull out of memory\n");
    exit(1);
  }
}

static void do_push(target *g, int which, const uint64_t *keys, size_t n, const float *vals) {
  if (g->sh) engine_push(g, which, keys, n, vals);
  else bench_check(ps_push(g->ctx, g->tid[which], keys, n, vals, 1, -1, -1), "ps_push");
}

static void do_pull(target *g, int which, const uint64_t *keys, size_t n, float *out) {
  if (g->sh) engine_pull(g, which, keys, n, out);
  else bench_check(ps_pull(g->ctx, g->tid[which], keys, n, out, -1), "ps_pull");
}

/* Fill table `which` with keys 0 .. rows-1 by pushes of `batch` new keys; rows/s, and
 * rows per CPU second into *per_cpu. */
static double fill(target *g, int which, uint64_t rows, size_t batch, double *per_cpu) {
  uint64_t *keys = malloc(batch * sizeof *keys);
  float *vals = malloc(batch * sizeof *vals);
  if (!keys || !vals) exit(1);
  for (size_t i = 0; i < batch; i++) vals[i] = 1e-3f;
  double t0 = bench_now(), c0 = work_cpu(g);
  for (uint64_t base = 0; base < rows; base += batch) {
    size_t n = rows - base < batch ? (size_t)(rows - base) : batch;
    for (size_t i = 0; i < n; i++) keys[i] = base + i;
    do_push(g, which, keys, n, vals);
  }
  double t = bench_now() - t0;
  *per_cpu = (double)rows / (work_cpu(g) - c0);
  free(keys);
  free(vals);
  return (double)rows / t;
}

typedef struct result {
  double rows_s, rows_cpu_s, p50, p99; /* rows per second of wall clock and of CPU time */
} result;

/* Requests of `batch` keys from the table's pool for g_seconds (at least 5). */
static result measure(target *g, int which, const table_keys *tk, int push, size_t batch) {
  float *buf = malloc(batch * sizeof *buf);
  size_t maxreq = 200000;
  double *lat = malloc(maxreq * sizeof *lat);
  if (!buf || !lat) exit(1);
  for (size_t i = 0; i < batch; i++) buf[i] = 1e-3f * (float)(i % 7);
  size_t n = 0, off = (size_t)which * 7919;
  double t_start = bench_now(), total = 0, c0 = work_cpu(g);
  while (n < 5 || (bench_now() - t_start < g_seconds && n < maxreq)) {
    if (off + batch > POOL_KEYS) off = (off + 7919) % (POOL_KEYS - batch);
    const uint64_t *keys = tk->pool + off;
    off += batch;
    double t0 = bench_now();
    if (push) do_push(g, which, keys, batch, buf);
    else do_pull(g, which, keys, batch, buf);
    double dt = bench_now() - t0;
    lat[n++] = dt;
    total += dt;
  }
  double cpu = work_cpu(g) - c0;
  result r = {.rows_s = (double)(n * batch) / total, .rows_cpu_s = (double)(n * batch) / (cpu > 0 ? cpu : 1e-9),
              .p50 = bench_pct(lat, n, 50), .p99 = bench_pct(lat, n, 99)};
  free(lat);
  free(buf);
  return r;
}

int main(int argc, char **argv) {
  uint64_t rows[2] = {10000000, 100000000};
  const char *opt = "adagrad", *batches_s = "1000,10000,100000", *transport = "tcp";
  size_t load_batch = 100000;
  int engine = 0, load_only = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--small") && i + 1 < argc) rows[0] = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--big") && i + 1 < argc) rows[1] = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--opt") && i + 1 < argc) opt = argv[++i];
    else if (!strcmp(argv[i], "--batches") && i + 1 < argc) batches_s = argv[++i];
    else if (!strcmp(argv[i], "--load-batch") && i + 1 < argc) load_batch = (size_t)strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) g_seconds = atof(argv[++i]);
    else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) g_rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--transport") && i + 1 < argc) transport = argv[++i];
    else if (!strcmp(argv[i], "--engine")) engine = 1;
    else if (!strcmp(argv[i], "--load-only")) load_only = 1;
    else {
      fprintf(stderr, "usage: bench_bigtable [--small N] [--big N] [--opt O] [--batches LIST] [--load-batch B] "
                      "[--seconds S] [--rounds R] [--transport tcp|auto] [--engine] [--load-only]\n");
      return 2;
    }
  }
  size_t batches[NBATCH_MAX], maxb = load_batch;
  int nb = 0;
  char buf[128];
  snprintf(buf, sizeof buf, "%s", batches_s);
  for (char *s = strtok(buf, ","); s && nb < NBATCH_MAX; s = strtok(NULL, ",")) {
    batches[nb] = (size_t)strtoull(s, NULL, 10);
    if (batches[nb] == 0 || batches[nb] > POOL_KEYS / 2) {
      fprintf(stderr, "bench_bigtable: a batch takes 1 to %u keys\n", POOL_KEYS / 2);
      return 2;
    }
    if (batches[nb] > maxb) maxb = batches[nb];
    nb++;
  }
  if (g_rounds < 1 || g_rounds > ROUNDS_MAX || rows[0] == 0 || rows[1] == 0 || load_batch == 0 ||
      load_batch > (1u << 24) || rows[0] > ((uint64_t)1 << 32) - 1 || rows[1] > ((uint64_t)1 << 32) - 1) {
    fprintf(stderr, "bench_bigtable: --rounds 1 to %d, --small/--big 1 to 2^32-1, --load-batch 1 to 2^24\n",
            ROUNDS_MAX);
    return 2;
  }

  table_keys tk[2];
  for (int w = 0; w < 2; w++) {
    bench_zipf z;
    bench_zipf_init(&z, rows[w], ZIPF_S, 42 + (uint64_t)w);
    tk[w].rows = rows[w];
    tk[w].pool = malloc(POOL_KEYS * sizeof *tk[w].pool);
    if (!tk[w].pool) return 1;
    for (size_t i = 0; i < POOL_KEYS; i++) tk[w].pool[i] = bench_zipf_next(&z);
  }

  target g = {0};
  bench_cluster c;
  char opts[96];
  snprintf(opts, sizeof opts, "opt=%s lr=0.01 mode=async init=uniform:0.01", opt);
  const char *names[2] = {"small", "big"};
  if (engine) {
    ps__shard_hooks hooks = {.alloc = bt_alloc, .release = bt_release};
    g.sh = ps__shard_new(&hooks);
    g.kbuf = malloc(maxb * 8);
    if (!g.sh || !g.kbuf) return 1;
    ps__shard_member(g.sh, 1, 1);
    ps__shard_set_started(g.sh, 1);
    for (int w = 0; w < 2; w++) {
      ps__declare d = {.id = (uint32_t)w + 1, .kind = PS_SPARSE, .size = 1};
      snprintf(d.name, sizeof d.name, "%s", names[w]);
      snprintf(d.options, sizeof d.options, "%s", opts);
      ps__verdict v;
      if (ps__shard_create(g.sh, &d, &v) != PS__APPLIED) {
        fprintf(stderr, "bench_bigtable: %s\n", v.msg);
        return 1;
      }
      g.tid[w] = d.id;
    }
  } else {
    bench_cluster_start(&c, 1, 1, transport);
    g.ctx = bench_open(&c, 0, 1, transport, "async");
    g.server = c.server_pid[0];
    for (int w = 0; w < 2; w++) bench_check(ps_table_declare(g.ctx, names[w], PS_SPARSE, 1, opts, &g.tid[w]), "declare");
  }
  printf("# bench_bigtable: dim-1 sparse tables of %llu (small) and %llu (big) rows, opt=%s mode=async, %s; keys "
         "Zipf(%.1f) scrambled over each table's rows\n",
         (unsigned long long)rows[0], (unsigned long long)rows[1], opt,
         engine ? "on the shard engine in this process (no sockets)" : "one server process, one worker over loopback",
         ZIPF_S);
  fflush(stdout);
  for (int w = 0; w < 2; w++) {
    double rc, r = fill(&g, w, rows[w], load_batch, &rc);
    printf("load %-5s %11llu rows by pushes of %zu new keys: %6.2f M rows/s, %6.2f M rows per %s CPU second   "
           "target >= 5 M rows/s per server",
           names[w], (unsigned long long)rows[w], load_batch, r / 1e6, rc / 1e6, engine ? "engine" : "server");
    if (!engine) printf("; server RSS %.0f MB", (double)bench_rss(c.server_pid[0]) / 1e6);
    if (engine) {
      ps__rowmap_next nx;
      ps__rowmap_next_state(ps__shard_table(g.sh, g.tid[w])->params, &nx);
      printf("; next indexes faulted in by this thread itself %.0f MiB", (double)nx.own / (1 << 20));
    }
    printf("\n");
    fflush(stdout);
  }

  if (load_only) goto done;
  printf("# rows/s over the wall clock and per CPU second of the %s; cost x = small rows/s / big rows/s (the "
         "per-row cost at the big size over the small one; target <= 1.5), median of the rounds' ratios [range]\n",
         engine ? "engine thread" : "server process");
  printf("%-5s %7s | %11s %11s %7s %7s | %11s %11s %7s %7s | %18s %18s\n", "op", "batch", "small rows/s", "/cpu-s",
         "p50_ms", "p99_ms", "big rows/s", "/cpu-s", "p50_ms", "p99_ms", "cost x (wall)", "cost x (cpu)");
  static result res[ROUNDS_MAX][NBATCH_MAX][2][2]; /* round, batch, op, table */
  for (int r = 0; r < g_rounds; r++)
    for (int bi = 0; bi < nb; bi++)
      for (int op = 0; op < 2; op++)
        for (int w = 0; w < 2; w++) {
          int ww = (r + bi) % 2 ? 1 - w : w; /* alternate which table goes first */
          res[r][bi][op][ww] = measure(&g, ww, &tk[ww], op, batches[bi]);
        }
  for (int bi = 0; bi < nb; bi++)
    for (int op = 0; op < 2; op++) {
      double f[2][4][ROUNDS_MAX], q[2][ROUNDS_MAX], lo[2] = {1e300, 1e300}, hi[2] = {0, 0}, mq[2];
      for (int r = 0; r < g_rounds; r++) {
        for (int w = 0; w < 2; w++) {
          f[w][0][r] = res[r][bi][op][w].rows_s;
          f[w][1][r] = res[r][bi][op][w].rows_cpu_s;
          f[w][2][r] = res[r][bi][op][w].p50;
          f[w][3][r] = res[r][bi][op][w].p99;
        }
        q[0][r] = res[r][bi][op][0].rows_s / res[r][bi][op][1].rows_s;
        q[1][r] = res[r][bi][op][0].rows_cpu_s / res[r][bi][op][1].rows_cpu_s;
        for (int k = 0; k < 2; k++) {
          if (q[k][r] < lo[k]) lo[k] = q[k][r];
          if (q[k][r] > hi[k]) hi[k] = q[k][r];
        }
      }
      size_t n = (size_t)g_rounds;
      double med[2][4];
      for (int w = 0; w < 2; w++)
        for (int k = 0; k < 4; k++) med[w][k] = bench_median(f[w][k], n);
      for (int k = 0; k < 2; k++) mq[k] = bench_median(q[k], n);
      printf("%-5s %7zu | %11.0f %11.0f %7.3f %7.3f | %11.0f %11.0f %7.3f %7.3f | %5.2f [%4.2f-%4.2f] %5.2f "
             "[%4.2f-%4.2f]\n",
             op ? "push" : "pull", batches[bi], med[0][0], med[0][1], med[0][2] * 1e3, med[0][3] * 1e3, med[1][0],
             med[1][1], med[1][2] * 1e3, med[1][3] * 1e3, mq[0], lo[0], hi[0], mq[1], lo[1], hi[1]);
    }
done:
  if (engine) {
    ps__shard_free(g.sh);
    free(g.kbuf);
  } else {
    ps_ctx_close(g.ctx);
    bench_cluster_stop(&c);
  }
  for (int w = 0; w < 2; w++) free(tk[w].pool);
  return 0;
}
