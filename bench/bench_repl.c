/*
 * bench_repl.c - what chain replication costs, and how long a failover takes.
 *
 * Part 1 (cost): two jobs of S = 2 servers and one worker, async tables, one with
 * R = 1 and one with R = 2, measured in the same run: the latency of a 4 KiB dense push
 * (1024 floats, one chain: p50 and p99 over --iters pushes), the throughput of 1 MiB
 * dense pushes (the whole table, every chain) and of sparse pushes of 4096 rows of 16
 * floats, and the ratio R = 2 / R = 1 of each; with the transport `auto` (R = 1 then
 * also uses the same-host transports, which R >= 2 does not) and over TCP for both.
 *
 * Part 2 (failover): --kills jobs of S = 3, R = 3 per position of the victim in the
 * chain (head, middle, tail). In each, one worker pushes a single row of one chain in a
 * loop; a second thread SIGKILLs the server at the chosen position of that chain; the
 * failover time is from the kill to the first push that completed after it (a push in
 * flight then completes only once its part was moved to the next member or the chain
 * went on without the dead one). p50 and p99 per position. The scheduler notices a
 * killed server by its closed connection; the heartbeat settings (stated in the output)
 * matter only for a server that stops without closing it.
 *
 * Part 3 (sync): two jobs of S = 2 servers and K = 2 workers (threads of this process),
 * a sync table of 1 MiB (256 Ki floats), R = 1 and R = 2 in the same run: rounds per
 * second of pull, push and clock of the whole table by every worker, and their ratio
 * (replication after aggregation: one combined update per round goes down the chain,
 * and a pull waits until its round is on both copies), over TCP for both, then with the
 * same-host transports R = 1 can use and R = 2 does not.
 *
 * Usage: bench_repl [--iters N] [--kills N] [--rounds N] [--part cost|failover|sync|all]
 *                   [--transport tcp|auto]   (the sync part over that transport only)
 * Needs the pshard binary (PSHARD_BIN, else the build's).
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "common/ring.h"

static void set_replicas(int r) {
  char v[8];
  snprintf(v, sizeof v, "%d", r);
  setenv("PSHARD_REPLICAS", v, 1);
}

/* ------------------------------------------------------------------ cost */

typedef struct cost {
  double p50_us, p99_us, dense_mbs, sparse_rows_s;
  double direct_calls, tail_answers, calls; /* how the calls went (ps_ctx_stat, server stats) */
} cost;

static cost measure(int R, int iters, const char *xport) {
  cost out;
  bench_cluster c;
  set_replicas(R);
  bench_cluster_start(&c, 2, 1, xport);
  ps_ctx *ctx = bench_open(&c, 0, 1, xport, "async");
  uint32_t small, big, sp;
  const uint64_t nbig = 256u * 1024u; /* 1 MiB of floats */
  bench_check(ps_table_declare(ctx, "small", PS_DENSE, 1024, "opt=sgd lr=0.001", &small), "declare small");
  bench_check(ps_table_declare(ctx, "big", PS_DENSE, nbig, "opt=sgd lr=0.001", &big), "declare big");
  bench_check(ps_table_declare(ctx, "sp", PS_SPARSE, 16, "opt=sgd lr=0.001", &sp), "declare sp");
  float *g = calloc(nbig, sizeof *g);
  for (uint64_t i = 0; i < nbig; i++) g[i] = 1e-3f * (float)(i % 7);
  double *lat = malloc((size_t)iters * sizeof *lat);
  for (int i = 0; i < 200; i++) bench_check(ps_push_range(ctx, small, 0, 1024, g, 1, -1, -1), "push 4k");
  for (int i = 0; i < iters; i++) {
    double t0 = bench_now();
    bench_check(ps_push_range(ctx, small, 0, 1024, g, 1, -1, -1), "push 4k");
    lat[i] = (bench_now() - t0) * 1e6;
  }
  out.p50_us = bench_pct(lat, (size_t)iters, 50);
  out.p99_us = bench_pct(lat, (size_t)iters, 99);
  int nd = iters / 10 > 20 ? iters / 10 : 20;
  for (int i = 0; i < 5; i++) bench_check(ps_push_range(ctx, big, 0, nbig, g, 1, -1, -1), "push 1m");
  double t0 = bench_now();
  for (int i = 0; i < nd; i++) bench_check(ps_push_range(ctx, big, 0, nbig, g, 1, -1, -1), "push 1m");
  out.dense_mbs = (double)nd * (double)(nbig * 4) / (1024.0 * 1024.0) / (bench_now() - t0);
  enum { NR = 4096 };
  uint64_t *keys = malloc(NR * sizeof *keys), rng = 7;
  for (int i = 0; i < NR; i++) keys[i] = bench_rand(&rng) % 1000000u;
  for (int i = 0; i < 5; i++) bench_check(ps_push(ctx, sp, keys, NR, g, 1, -1, -1), "push rows");
  t0 = bench_now();
  for (int i = 0; i < nd; i++) {
    for (int k = 0; k < NR; k++) keys[k] = bench_rand(&rng) % 1000000u;
    bench_check(ps_push(ctx, sp, keys, NR, g, 1, -1, -1), "push rows");
  }
  out.sparse_rows_s = (double)nd * NR / (bench_now() - t0);
  out.calls = 200.0 + iters + 5 + nd + 5 + nd;
  out.direct_calls = out.tail_answers = 0;
  ps_ctx_stat(ctx, "direct_calls", &out.direct_calls);
  for (unsigned i = 0; i < 2; i++) {
    char buf[16384];
    if (ps_server_stats(ctx, i, buf, sizeof buf, 10000) == 0) out.tail_answers += bench_stat_value(buf, "tail_answers");
  }
  ps_ctx_close(ctx);
  bench_cluster_stop(&c);
  free(g);
  free(lat);
  free(keys);
  return out;
}

static void part_cost(int iters) {
  /* auto: R = 1 also takes the same-host transports (shared memory for dense values,
   * caller-thread I/O), which R >= 2 does not use; tcp: the same transport for both */
  const char *xports[2] = {"auto", "tcp"};
  for (int x = 0; x < 2; x++) {
    cost a = measure(1, iters, xports[x]), b = measure(2, iters, xports[x]);
    printf("cost of R = 2 against R = 1 (S = 2, one worker, async, same run, transport %s)\n", xports[x]);
    printf("  %-28s %12s %12s %10s\n", "", "R = 1", "R = 2", "R2 / R1");
    printf("  %-28s %12.1f %12.1f %+9.1f us\n", "4 KiB push p50 (us)", a.p50_us, b.p50_us, b.p50_us - a.p50_us);
    printf("  %-28s %12.1f %12.1f %+9.1f us\n", "4 KiB push p99 (us)", a.p99_us, b.p99_us, b.p99_us - a.p99_us);
    printf("  %-28s %12.1f %12.1f %9.2fx\n", "dense 1 MiB push (MiB/s)", a.dense_mbs, b.dense_mbs,
           b.dense_mbs / a.dense_mbs);
    printf("  %-28s %12.0f %12.0f %9.2fx\n", "sparse push (rows/s)", a.sparse_rows_s, b.sparse_rows_s,
           b.sparse_rows_s / a.sparse_rows_s);
    printf("  %-28s %12.0f %12.0f   (the run makes %.0f pushes)\n", "calls on the caller's thread", a.direct_calls, b.direct_calls, b.calls);
    printf("  %-28s %12s %12.0f   push parts answered by their chain's tail\n", "answered by the tail", "-",
           b.tail_answers);
  }
}

/* ------------------------------------------------------------------ sync rounds */

typedef struct sync_arg {
  const bench_cluster *c;
  int rounds;
  const char *xport;
  double secs;
  double in_place; /* the servers' pushes added to their round from a kept copy (STATS) */
} sync_arg;

static void *sync_worker(void *arg) {
  sync_arg *a = arg;
  const uint64_t n = 256u * 1024u;
  ps_ctx *ctx = bench_open(a->c, 0, 2, a->xport, "sync");
  uint32_t t;
  bench_check(ps_table_declare(ctx, "model", PS_DENSE, n, "opt=sgd lr=0.001 mode=sync", &t), "declare model");
  float *w = calloc(n, sizeof *w), *g = calloc(n, sizeof *g);
  for (uint64_t i = 0; i < n; i++) g[i] = 1e-3f * (float)(i % 7);
  for (int r = 0; r < 5; r++) { /* warm-up */
    bench_check(ps_pull_range(ctx, t, 0, n, w, -1), "pull");
    bench_check(ps_push_range(ctx, t, 0, n, g, 1, -1, -1), "push");
    bench_check(ps_clock(ctx), "clock");
  }
  double t0 = bench_now();
  for (int r = 0; r < a->rounds; r++) {
    bench_check(ps_pull_range(ctx, t, 0, n, w, -1), "pull");
    bench_check(ps_push_range(ctx, t, 0, n, g, 1, -1, -1), "push");
    bench_check(ps_clock(ctx), "clock");
  }
  bench_check(ps_pull_range(ctx, t, 0, n, w, -1), "pull");
  a->secs = bench_now() - t0;
  for (int i = 0; i < 2; i++) {
    char st[8192];
    double v = ps_server_stats(ctx, i, st, sizeof st, 5000) ? -1 : bench_stat_value(st, "peer_mem_kept_in_place");
    if (v > 0) a->in_place += v;
  }
  ps_ctx_close(ctx);
  free(w);
  free(g);
  return NULL;
}

/* Rounds per second; the CPU time per round of the two workers (this process, warm-up
 * included) and of the two servers into cpu_us[0..1]. */
static double sync_in_place; /* the last run's sync_arg.in_place, the larger of the two */

static double sync_rounds_s(int R, int rounds, const char *xport, double cpu_us[2]) {
  bench_cluster c;
  set_replicas(R);
  bench_cluster_start(&c, 2, 2, xport);
  double w0 = bench_cpu_s(0), s0 = bench_cpu_s(c.server_pid[0]) + bench_cpu_s(c.server_pid[1]);
  sync_arg a[2] = {{.c = &c, .rounds = rounds, .xport = xport}, {.c = &c, .rounds = rounds, .xport = xport}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, sync_worker, &a[i]);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  double n = rounds + 6; /* the warm-up's five and the last pull */
  cpu_us[0] = 1e6 * (bench_cpu_s(0) - w0) / n;
  cpu_us[1] = 1e6 * (bench_cpu_s(c.server_pid[0]) + bench_cpu_s(c.server_pid[1]) - s0) / n;
  bench_cluster_stop(&c);
  sync_in_place = a[0].in_place > a[1].in_place ? a[0].in_place : a[1].in_place;
  double s = a[0].secs > a[1].secs ? a[0].secs : a[1].secs;
  return rounds / s;
}

static void part_sync(int rounds, const char *only) {
  printf("sync rounds, replicated after aggregation (S = 2, K = 2 workers, 1 MiB table, %d rounds, median of 3)\n",
         rounds);
  printf("  %-34s %10s %10s %10s\n", "rounds per second", "R = 1", "R = 2", "R2 / R1");
  /* tcp: the same transport for both; auto: the same-host transports (peer memory for
   * pushes and pulls alike; under R >= 2 a pull's expiry is short, PS_VX_CHAIN_PULL_MS) */
  const char *xports[2] = {"tcp", "auto"};
  double cpu[2][2][2]; /* [transport][R - 1][workers, servers]: medians, us per round */
  for (int x = 0; x < 2; x++) {
    double r1[3], r2[3], c[2][2][3];
    if (only && strcmp(only, xports[x])) {
      memset(cpu[x], 0, sizeof cpu[x]);
      continue;
    }
    for (int k = 0; k < 3; k++) { /* alternated, medians: the machine is noisy */
      double u[2];
      r1[k] = sync_rounds_s(1, rounds, xports[x], u);
      c[0][0][k] = u[0], c[0][1][k] = u[1];
      r2[k] = sync_rounds_s(2, rounds, xports[x], u);
      c[1][0][k] = u[0], c[1][1][k] = u[1];
    }
    printf("  %-34s R = 2: %.0f push parts added to their round where the worker's kept copy lies (last run)\n",
           x ? "transport auto (same host)" : "transport tcp", sync_in_place);
    for (int r = 0; r < 2; r++)
      for (int w = 0; w < 2; w++) cpu[x][r][w] = bench_median(c[r][w], 3);
    double m1 = bench_median(r1, 3), m2 = bench_median(r2, 3);
    printf("  %-34s %10.1f %10.1f %9.2fx   (target >= 0.85x)\n",
           x ? "transport auto (same host)" : "transport tcp", m1, m2, m2 / m1);
  }
  /* Where the time goes: CPU per round against the round's wall time on this machine's
   * cores. With every process busy, a round cannot take less than its CPU / cores. */
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  printf("  CPU per round (us, medians; %ld cores)  workers R1  servers R1  workers R2  servers R2\n", cores);
  for (int x = 0; x < 2; x++)
    printf("  %-34s %10.0f  %10.0f  %10.0f  %10.0f\n", x ? "transport auto (same host)" : "transport tcp",
           cpu[x][0][0], cpu[x][0][1], cpu[x][1][0], cpu[x][1][1]);
}

/* ------------------------------------------------------------------ failover */

typedef struct killer {
  pid_t pid;
  double delay_s, at; /* at: when it killed, valid once fired */
  int fired;
} killer;

static void *kill_main(void *arg) {
  killer *k = arg;
  usleep((useconds_t)(k->delay_s * 1e6));
  k->at = bench_now();
  __atomic_store_n(&k->fired, 1, __ATOMIC_RELEASE);
  kill(k->pid, SIGKILL);
  return NULL;
}

/* One job: the failover time in seconds with the victim at chain position pos. */
static double one_failover(int pos, uint64_t seed) {
  bench_cluster c;
  set_replicas(3);
  bench_cluster_start(&c, 3, 1, "auto");
  ps_ctx *ctx = bench_open(&c, 0, 1, "auto", "async");
  uint32_t t;
  bench_check(ps_table_declare(ctx, "w", PS_SPARSE, 16, "opt=sgd lr=0.001", &t), "declare");
  uint32_t ids[3];
  pid_t pids[3];
  for (int i = 0; i < 3; i++) {
    char buf[8192];
    bench_check(ps_server_stats(ctx, i, buf, sizeof buf, 10000), "stats");
    ids[i] = (uint32_t)bench_stat_value(buf, "server");
    pids[i] = (pid_t)bench_stat_value(buf, "pid");
  }
  /* The servers' ring (sorted ids, 128 points each: the defaults) gives each key's chain. */
  uint32_t sorted[3] = {ids[0], ids[1], ids[2]};
  for (int i = 0; i < 3; i++)
    for (int j = i + 1; j < 3; j++)
      if (sorted[j] < sorted[i]) {
        uint32_t x = sorted[i];
        sorted[i] = sorted[j], sorted[j] = x;
      }
  ps__ring *r = ps__ring_new(sorted, 3, 128, 0);
  if (!r || ps__ring_set_replicas(r, 3)) bench_check(PS_ERR_NOMEM, "ring");
  uint64_t key = seed % 1000003u;
  uint32_t ch[PS_MAX_REPLICAS];
  ps__ring_chain(r, t, key, ch, 3);
  ps__ring_free(r);
  pid_t victim = 0;
  for (int i = 0; i < 3; i++)
    if (ids[i] == ch[pos]) victim = pids[i];
  if (!victim) bench_check(PS_ERR_INVALID, "victim");
  float g[16] = {1};
  for (int i = 0; i < 50; i++) bench_check(ps_push(ctx, t, &key, 1, g, 1, -1, -1), "push");
  killer k = {.pid = victim, .delay_s = 0.05 + (double)(seed % 50) * 1e-3};
  pthread_t th;
  pthread_create(&th, NULL, kill_main, &k);
  double done = 0;
  for (;;) {
    int rc = ps_push(ctx, t, &key, 1, g, 1, -1, 20000);
    double now = bench_now();
    bench_check(rc, "push across the failover");
    if (__atomic_load_n(&k.fired, __ATOMIC_ACQUIRE) && now > k.at) {
      done = now - k.at;
      break;
    }
  }
  pthread_join(th, NULL);
  ps_ctx_close(ctx);
  bench_cluster_stop(&c);
  return done;
}

static void part_failover(int kills) {
  static const char *names[] = {"head", "middle", "tail"};
  printf("failover (S = 3, R = 3, one worker pushing one row in a loop; SIGKILL of one server: the\n"
         "scheduler removes it when its connection closes; heartbeat 200 ms, timeout 20000 ms)\n");
  printf("  %-8s %6s %10s %10s %10s\n", "victim", "kills", "p50 (ms)", "p99 (ms)", "max (ms)");
  double *v = malloc((size_t)kills * sizeof *v);
  for (int pos = 0; pos < 3; pos++) {
    for (int i = 0; i < kills; i++) v[i] = one_failover(pos, (uint64_t)(pos * 1000 + i) * 7919u + 13u) * 1e3;
    double p50 = bench_pct(v, (size_t)kills, 50), p99 = bench_pct(v, (size_t)kills, 99);
    printf("  %-8s %6d %10.1f %10.1f %10.1f\n", names[pos], kills, p50, p99, v[kills - 1]);
    fflush(stdout);
  }
  free(v);
}

int main(int argc, char **argv) {
  int iters = 5000, kills = 20, rounds = 200;
  const char *part = "all", *only = NULL;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--kills")) kills = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--part")) part = argv[i + 1];
    else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--transport") && (!strcmp(argv[i + 1], "tcp") || !strcmp(argv[i + 1], "auto")))
      only = argv[i + 1];
    else {
      fprintf(stderr, "usage: bench_repl [--iters N] [--kills N] [--rounds N] [--part cost|failover|sync|all] "
                      "[--transport tcp|auto (sync: that one only)]\n");
      return 2;
    }
  }
  if (iters < 100 || kills < 1 || rounds < 10) {
    fprintf(stderr, "bench_repl: --iters must be at least 100, --kills at least 1 and --rounds at least 10\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  int all = !strcmp(part, "all");
  if (all || !strcmp(part, "cost")) part_cost(iters);
  if (all || !strcmp(part, "sync")) part_sync(rounds, only);
  if (all || !strcmp(part, "failover")) part_failover(kills);
  return 0;
}
