/*
 * modes_worker.c - a worker for the consistency-model tests (issue 4).
 *
 * It uses only the public API and takes its connection settings from the environment
 * (PSHARD_*, through ps_ctx_open_env). Two tables: a dense vector "w" (--dense D) and a
 * sparse table "emb" with rows of --sparse-dim floats. Each step is: pull the dense
 * vector and this step's sparse rows, "compute" (optionally sleep), push a synthetic
 * gradient, advance the clock. The gradients are constants chosen so the tests can
 * predict the parameters exactly:
 *
 *   dense element j:         s * (1 + j % 4) * f
 *   sparse row element j:    s * (1 + j) * f
 *
 * where s is this worker's --grad entry (or --slow-grad for the slowed worker) and
 * f = clock + 1 with --clock-grad 1, else 1. The worker's index is PSHARD_WORKER_INDEX
 * (set by `pshard run`, and by the tests) or, if unset, its rank. Options that take a
 * comma list (--batch, --grad) pick entry index % length.
 *
 * The step loop runs while the clock is below --steps; a sync:M straggler whose pull
 * fast-forwarded it stops early, and one whose pull fast-forwarded it to the end pushes
 * nothing more. At the end every worker makes sure the servers have handled its CLOCK
 * frames (a STATS round trip to each) and passes a barrier; rank 0 then prints every
 * parameter (--print-params 1) and every server's ps_server_stats text between
 * "server-stats I begin" and "server-stats I end" lines, and every worker prints its
 * counters on one "wstats key=value ..." line.
 *
 * Options
 *   --steps N --dense D --sparse-dim d --keyspace V --keys M (per step; 0 = all V)
 *   --dense-opt S --sparse-opt S   table options (default "opt=sgd lr=0.1")
 *   --mode M          add mode=M to both tables' options (else the job's mode applies)
 *   --batch LIST --grad LIST --clock-grad 0|1
 *   --clock-batch 0|1 multiply the batch by (clock + 1)
 *   --slow-index I --slow-ms T     worker index I sleeps T ms per step between its pull
 *                                  and its push (a slow compute)
 *   --slow-grad V     the slowed worker's gradient scale
 *   --slow-late 0|1   the slowed worker, before each push, waits until every server has
 *                     applied the round of its clock for each sync table, so that under
 *                     sync:M its push is certainly late (waits at most --timeout-ms)
 *   --sleep-ms T      every worker sleeps T ms per step (after its clock)
 *   --skip-clocks N   advance the clock N times before the first step, without pushing,
 *                     then make sure every server has seen those clocks
 *   --start-barrier 0|1   pass a barrier before the first step
 *   --allow-clock-errors 0|1  a push failing with PS_ERR_CLOCK is counted
 *                     (push_rejected=) instead of stopping the worker
 *   --trace 0|1       after each step's pull print "trace index I clock C dense0 X sparse0 Y"
 *                     (dense element 0, and element 0 of sparse row 0 when --keys is 0)
 *   --progress 0|1    print "index I step T" after each step
 *   --poll-ms T       after the steps, pull dense element 0 every 5 ms for up to T ms and
 *                     print "poll t=SECONDS dense0=X" whenever it changes (t from the end
 *                     of the last push); stop 100 ms after the first change
 *   --print-params 0|1  rank 0 prints "param w J X" and "param emb K J X" at the end
 *   --hold-ms T       sleep T ms before leaving (to let a test talk to the servers)
 *   --timeout-ms T    deadline of each blocking call (default: the context's)
 * Exit status: 0 success, 1 a pshard call failed (message on stderr), 2 bad usage.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pshard.h"

#define MAX_LIST 64

typedef struct opts {
  int steps, dense, dim, keys, clock_grad, clock_batch, slow_index, slow_ms, slow_late, sleep_ms, start_barrier;
  int allow_clock_errors, trace, progress, poll_ms, print_params, hold_ms, timeout_ms;
  long skip_clocks;
  uint64_t keyspace;
  const char *dense_opt, *sparse_opt, *mode;
  double slow_grad;
  int has_slow_grad;
  double grad[MAX_LIST], batch[MAX_LIST];
  int ngrad, nbatch;
} opts;

static int index_g = -1;

static void fail(const char *what, int rc) {
  fprintf(stderr, "modes_worker %d: %s failed: %s: %s\n", index_g, what, ps_err_name(rc), ps_errmsg());
  fflush(stderr);
  exit(1);
}

#define CHECK(call)                  \
  do {                               \
    int rc_ = (call);                \
    if (rc_) fail(#call, rc_);       \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_ms(int ms) {
  if (ms > 0) usleep((useconds_t)ms * 1000u);
}

static int parse_list(const char *v, double *out, int *n) {
  char *end;
  *n = 0;
  for (;;) {
    if (*n == MAX_LIST) return -1;
    out[(*n)++] = strtod(v, &end);
    if (end == v) return -1;
    if (*end == '\0') return 0;
    if (*end != ',') return -1;
    v = end + 1;
  }
}

/* "every=N" in a table's options, else 1. */
static long every_of(const char *opt) {
  const char *p = opt ? strstr(opt, "every=") : NULL;
  return p && (p == opt || p[-1] == ' ') ? strtol(p + 6, NULL, 10) : 1;
}

/* Wait until every server reports, for table `name` if it is a sync table, a version
 * (rounds applied) above round clock/every. */
static void wait_rounds_applied(ps_ctx *ctx, const char *name, long every, int64_t clock, int timeout_ms) {
  static char buf[1 << 16];
  char needle[96];
  snprintf(needle, sizeof needle, " name=%s ", name);
  double deadline = now_s() + (timeout_ms > 0 ? timeout_ms : 30000) / 1000.0;
  int64_t need = clock / (every > 0 ? every : 1) + 1;
  for (int s = 0; s < ps_ctx_num_servers(ctx); s++) {
    for (;;) {
      CHECK(ps_server_stats(ctx, s, buf, sizeof buf, -1));
      char *line = strstr(buf, needle);
      if (!line) break; /* not on this server */
      char *mode = strstr(line, "mode=sync"), *ver = strstr(line, " version=");
      char *eol = strchr(line, '\n');
      if (!mode || (eol && mode > eol) || !ver) break; /* not a sync table */
      if (strtoll(ver + 9, NULL, 10) >= need) break;
      if (now_s() > deadline) {
        fprintf(stderr, "modes_worker %d: server %d never applied round %lld of '%s'\n", index_g, s,
                (long long)(need - 1), name);
        exit(1);
      }
      usleep(2000);
    }
  }
}

/* Make sure every server has handled this worker's CLOCK frames: a STATS request travels
 * on the same connection and is answered after them. (A barrier alone does not order
 * them: it goes through the scheduler, on another connection.) */
static void flush_clocks(ps_ctx *ctx, int timeout_ms) {
  char tmp[256];
  for (int s = 0; s < ps_ctx_num_servers(ctx); s++) CHECK(ps_server_stats(ctx, s, tmp, sizeof tmp, timeout_ms));
}

static void usage(FILE *f) {
  fprintf(f, "usage: modes_worker [--steps N] [--dense D] [--sparse-dim d] [--keyspace V] [--keys M]\n"
             "  [--dense-opt S] [--sparse-opt S] [--mode M] [--batch LIST] [--grad LIST] [--clock-grad 0|1]\n"
             "  [--clock-batch 0|1]\n"
             "  [--slow-index I] [--slow-ms T] [--slow-grad V] [--slow-late 0|1] [--sleep-ms T]\n"
             "  [--skip-clocks N] [--start-barrier 0|1] [--allow-clock-errors 0|1] [--trace 0|1]\n"
             "  [--progress 0|1] [--poll-ms T] [--print-params 0|1] [--hold-ms T] [--timeout-ms T]\n"
             "(see the comment at the top of modes_worker.c)\n");
}

int main(int argc, char **argv) {
  opts o = {.steps = 20, .dense = 8, .dim = 2, .keyspace = 16, .slow_index = -1, .timeout_ms = -1,
            .dense_opt = "opt=sgd lr=0.1", .sparse_opt = "opt=sgd lr=0.1", .grad = {1}, .ngrad = 1,
            .batch = {4}, .nbatch = 1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--help")) {
      usage(stdout);
      return 0;
    }
    if (!v) {
      fprintf(stderr, "modes_worker: option %s needs a value\n", a);
      return 2;
    }
    char *end = NULL;
    long n = strtol(v, &end, 10);
    int is_int = end != v && *end == '\0';
    int bad = 0;
#define INT_OPT(flag, field)   \
  else if (!strcmp(a, flag)) { \
    bad = !is_int || n < 0;    \
    o.field = (int)n;          \
  }
    if (0) {}
    INT_OPT("--steps", steps)
    INT_OPT("--dense", dense)
    INT_OPT("--sparse-dim", dim)
    INT_OPT("--keys", keys)
    INT_OPT("--clock-grad", clock_grad)
    INT_OPT("--clock-batch", clock_batch)
    INT_OPT("--slow-ms", slow_ms)
    INT_OPT("--slow-late", slow_late)
    INT_OPT("--sleep-ms", sleep_ms)
    INT_OPT("--start-barrier", start_barrier)
    INT_OPT("--allow-clock-errors", allow_clock_errors)
    INT_OPT("--trace", trace)
    INT_OPT("--progress", progress)
    INT_OPT("--poll-ms", poll_ms)
    INT_OPT("--print-params", print_params)
    INT_OPT("--hold-ms", hold_ms)
    INT_OPT("--timeout-ms", timeout_ms)
    else if (!strcmp(a, "--slow-index")) {
      bad = !is_int;
      o.slow_index = (int)n;
    } else if (!strcmp(a, "--skip-clocks")) {
      bad = !is_int || n < 0;
      o.skip_clocks = n;
    } else if (!strcmp(a, "--keyspace")) {
      bad = !is_int || n < 1;
      o.keyspace = (uint64_t)n;
    } else if (!strcmp(a, "--dense-opt")) o.dense_opt = v;
    else if (!strcmp(a, "--sparse-opt")) o.sparse_opt = v;
    else if (!strcmp(a, "--mode")) o.mode = v;
    else if (!strcmp(a, "--slow-grad")) {
      o.slow_grad = strtod(v, &end);
      bad = end == v || *end;
      o.has_slow_grad = 1;
    } else if (!strcmp(a, "--grad")) bad = parse_list(v, o.grad, &o.ngrad) != 0;
    else if (!strcmp(a, "--batch")) bad = parse_list(v, o.batch, &o.nbatch) != 0;
    else {
      fprintf(stderr, "modes_worker: unknown option %s\n", a);
      usage(stderr);
      return 2;
    }
#undef INT_OPT
    if (bad) {
      fprintf(stderr, "modes_worker: bad value '%s' for %s\n", v, a);
      return 2;
    }
    i++;
  }
  if (o.keys == 0 || (uint64_t)o.keys > o.keyspace) o.keys = (int)o.keyspace;

  char dopt[512], sopt[512];
  snprintf(dopt, sizeof dopt, "%s%s%s", o.dense_opt, o.mode ? " mode=" : "", o.mode ? o.mode : "");
  snprintf(sopt, sizeof sopt, "%s%s%s", o.sparse_opt, o.mode ? " mode=" : "", o.mode ? o.mode : "");

  ps_ctx *ctx;
  CHECK(ps_ctx_open_env(&ctx));
  int rank = ps_ctx_rank(ctx), K = ps_ctx_num_workers(ctx);
  const char *idx_env = getenv("PSHARD_WORKER_INDEX");
  int index = idx_env && *idx_env ? atoi(idx_env) : rank;
  index_g = index;
  int slow = index == o.slow_index;
  double scale = slow && o.has_slow_grad ? o.slow_grad : o.grad[index % o.ngrad];
  uint32_t batch = (uint32_t)o.batch[index % o.nbatch];
  CHECK(ps_metric(ctx, "worker_index", index));

  uint32_t tw = 0, te = 0;
  if (o.dense > 0) CHECK(ps_table_declare(ctx, "w", PS_DENSE, (uint64_t)o.dense, dopt, &tw));
  if (o.dim > 0) CHECK(ps_table_declare(ctx, "emb", PS_SPARSE, (uint64_t)o.dim, sopt, &te));

  size_t dim = (size_t)o.dim, nk = (size_t)o.keys;
  float *w = calloc((size_t)o.dense + 1, 4), *gw = calloc((size_t)o.dense + 1, 4);
  float *rows = calloc(nk * dim + 1, 4), *grows = calloc(nk * dim + 1, 4);
  uint64_t *keys = calloc(nk + 1, 8);
  if (!w || !gw || !rows || !grows || !keys) {
    fprintf(stderr, "modes_worker: out of memory\n");
    return 1;
  }

  for (long i = 0; i < o.skip_clocks; i++) CHECK(ps_clock(ctx));
  if (o.skip_clocks) flush_clocks(ctx, o.timeout_ms);
  if (o.start_barrier) CHECK(ps_barrier(ctx, o.timeout_ms));

  long push_rejected = 0, steps_done = 0;
  double t_start = now_s(), t_last_push = t_start;
  for (;;) {
    int64_t c = ps_ctx_clock(ctx);
    if (c >= o.steps + o.skip_clocks) break;
    uint64_t start = ((uint64_t)c * 13u + (uint64_t)index * 5u) % o.keyspace;
    for (size_t m = 0; m < nk; m++) keys[m] = (start + m) % o.keyspace;
    if (o.dense > 0) CHECK(ps_pull_range(ctx, tw, 0, (uint64_t)o.dense, w, o.timeout_ms));
    if (nk && dim) CHECK(ps_pull(ctx, te, keys, nk, rows, o.timeout_ms));
    if (o.trace) {
      /* With all keys pulled, find row 0. */
      float s0 = 0;
      for (size_t m = 0; m < nk; m++)
        if (keys[m] == 0 && dim) s0 = rows[m * dim];
      printf("trace index %d clock %lld dense0 %.9g sparse0 %.9g\n", index, (long long)c,
             o.dense > 0 ? (double)w[0] : 0.0, (double)s0);
      fflush(stdout);
    }
    /* A sync:M straggler's pull may have moved its clock to the servers' round. */
    c = ps_ctx_clock(ctx);
    if (c >= o.steps + o.skip_clocks) break;
    if (slow) sleep_ms(o.slow_ms);
    double f = o.clock_grad ? (double)(c - o.skip_clocks + 1) : 1.0;
    uint32_t b = o.clock_batch ? batch * (uint32_t)(c - o.skip_clocks + 1) : batch;
    for (int j = 0; j < o.dense; j++) gw[j] = (float)(scale * (1 + j % 4) * f);
    for (size_t m = 0; m < nk; m++)
      for (size_t j = 0; j < dim; j++) grows[m * dim + j] = (float)(scale * (double)(1 + j) * f);
    if (slow && o.slow_late) {
      if (o.dense > 0) wait_rounds_applied(ctx, "w", every_of(dopt), c, o.timeout_ms);
      if (nk && dim) wait_rounds_applied(ctx, "emb", every_of(sopt), c, o.timeout_ms);
    }
    int rc;
    if (o.dense > 0) {
      rc = ps_push_range(ctx, tw, 0, (uint64_t)o.dense, gw, b, PS_LR_SCHEDULE, o.timeout_ms);
      if (rc == PS_ERR_CLOCK && o.allow_clock_errors) push_rejected++;
      else if (rc) fail("ps_push_range", rc);
    }
    if (nk && dim) {
      rc = ps_push(ctx, te, keys, nk, grows, b, PS_LR_SCHEDULE, o.timeout_ms);
      if (rc == PS_ERR_CLOCK && o.allow_clock_errors) push_rejected++;
      else if (rc) fail("ps_push", rc);
    }
    t_last_push = now_s();
    CHECK(ps_clock(ctx));
    steps_done++;
    if (o.progress) {
      printf("index %d step %lld\n", index, (long long)c);
      fflush(stdout);
    }
    sleep_ms(o.sleep_ms);
  }
  double elapsed = now_s() - t_start;

  if (o.poll_ms > 0 && o.dense > 0) {
    float last = 0;
    int first = 1;
    double t0 = t_last_push, end = t0 + o.poll_ms / 1000.0;
    while (now_s() < end) {
      float v;
      CHECK(ps_pull_range(ctx, tw, 0, 1, &v, o.timeout_ms));
      if (first || v != last) {
        printf("poll t=%.4f dense0=%.9g\n", now_s() - t0, (double)v);
        fflush(stdout);
        if (!first && now_s() + 0.1 < end) end = now_s() + 0.1;
      }
      first = 0;
      last = v;
      sleep_ms(5);
    }
  }

  /* After the barrier every server has seen every worker's last clock, so the rank 0
   * report below sees every round that the job completed. */
  flush_clocks(ctx, o.timeout_ms);
  CHECK(ps_barrier(ctx, o.timeout_ms));
  if (rank == 0) {
    if (o.print_params && o.dense > 0) {
      CHECK(ps_pull_range(ctx, tw, 0, (uint64_t)o.dense, w, o.timeout_ms));
      for (int j = 0; j < o.dense; j++) printf("param w %d %.9g\n", j, (double)w[j]);
    }
    if (o.print_params && dim) {
      size_t n = (size_t)o.keyspace;
      uint64_t *all = malloc(n * 8);
      float *vals = malloc(n * dim * 4);
      if (!all || !vals) return 1;
      for (size_t q = 0; q < n; q++) all[q] = q;
      CHECK(ps_pull(ctx, te, all, n, vals, o.timeout_ms));
      for (size_t q = 0; q < n; q++)
        for (size_t j = 0; j < dim; j++) printf("param emb %zu %zu %.9g\n", q, j, (double)vals[q * dim + j]);
      free(all);
      free(vals);
    }
    static char buf[1 << 16];
    for (int s = 0; s < ps_ctx_num_servers(ctx); s++) {
      CHECK(ps_server_stats(ctx, s, buf, sizeof buf, o.timeout_ms));
      printf("server-stats %d begin\n%s%sserver-stats %d end\n", s, buf,
             buf[0] && buf[strlen(buf) - 1] != '\n' ? "\n" : "", s);
    }
  }
  static const char *const names[] = {"uptime_s", "pull_wait_s", "push_wait_s", "other_wait_s", "compute_s",
                                      "pulls", "pushes", "bytes_pushed", "bytes_pulled", "dropped_pushes",
                                      "fast_forwards", "clock"};
  printf("wstats index=%d rank=%d workers=%d steps=%ld elapsed_s=%.6f push_rejected=%ld", index, rank, K, steps_done,
         elapsed, push_rejected);
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    double v;
    CHECK(ps_ctx_stat(ctx, names[i], &v));
    printf(" %s=%.6f", names[i], v);
  }
  printf("\n");
  fflush(stdout);
  sleep_ms(o.hold_ms);
  free(w);
  free(gw);
  free(rows);
  free(grows);
  free(keys);
  ps_ctx_close(ctx);
  return 0;
}
