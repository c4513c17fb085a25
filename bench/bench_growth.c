/*
 * bench_growth.c - request latency while a sparse table grows, against the same table
 * with an index sized for its final rows up front, in the same run.
 *
 * On the shard engine in this process (no sockets, whose noise would hide it), two
 * sparse tables of dim D: "grow", a plain table, and "fixed", whose row map reserved
 * an index for --to rows before the run (ps__rowmap_reserve), so it never grows its
 * index. Both are filled to --from rows first; then, until they hold --to rows, each
 * step pushes B new keys to each table (every key creates a row: the table grows B
 * rows a push) and pulls B keys drawn uniformly from the rows present, from each
 * table, the four requests in an order alternating with each step so that a noisy
 * moment falls on both. Printed per table and request kind: p50, p99, p99.9 and the
 * worst latency in ms, the p99 ratio of grow to fixed (target <= 2) and the worst
 * request of grow (target < 50 ms) with what the table was doing then, and the
 * requests that ran while rows moved to a grown index apart (their p50 and p99 against
 * fixed's in the same steps); also the index growths seen, the bytes per row at the
 * end, and how much of the next indexes this thread faulted in itself (the rest was
 * the row map's helper thread's). The same figures in this thread's CPU time
 * (CLOCK_THREAD_CPUTIME_ID, which counts page faults but not the time the thread waited
 * for a core) tell a pause of the table from a busy machine's.
 *
 * usage: bench_growth [--from N] [--to N] [--dim D] [--opt O] [--batch B]
 *        defaults: --from 1000000 --to 100000000 --dim 1 --opt sgd --batch 1000
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "shard/shard.h"

static void *gb_alloc(void *arg, size_t n) {
  (void)arg;
  return malloc(n ? n : 1);
}
static void gb_release(void *arg, void *buf, size_t n) {
  (void)arg, (void)n;
  free(buf);
}

static uint64_t key_of(uint64_t i) { return i * 0x9e3779b97f4a7c15ull; }

typedef struct gb_table {
  uint32_t id;
  ps__table *t;
  double *push_ms, *pull_ms; /* per step */
  double *push_cpu, *pull_cpu; /* per step, this thread's CPU time, ms */
} gb_table;

static double cpu_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* The p-th percentile of v[i] over the steps i where sel[i] == want (copied: v stays). */
static double pct_where(const double *v, const unsigned char *sel, unsigned char want, size_t n, double p,
                        size_t *count) {
  double *w = malloc((n ? n : 1) * sizeof *w);
  size_t k = 0;
  if (!w) exit(1);
  for (size_t i = 0; i < n; i++)
    if (sel[i] == want) w[k++] = v[i];
  double r = k ? bench_pct(w, k, p) : 0.0;
  free(w);
  *count = k;
  return r;
}

static void push_new(ps__shard *sh, gb_table *g, uint8_t *keys, const float *vals, uint64_t base, size_t b,
                     unsigned dim) {
  for (size_t i = 0; i < b; i++) ps__put_u64(keys + 8 * i, key_of(base + i));
  ps__push p = {.table = g->id, .sender = 1, .batch = 1, .lr = -1.0f, .keys = keys, .nkeys = (uint32_t)b,
                .vals = vals, .nvals = (uint64_t)b * dim};
  ps__verdict v;
  if (ps__shard_push(sh, &p, NULL, &v) != PS__APPLIED) {
    fprintf(stderr, "bench_growth: push failed: %s\n", v.msg);
    exit(1);
  }
  ps__shard_agg_flush(g->t); /* an async table's buffered push applied: its rows exist */
}

static double timed_push(ps__shard *sh, gb_table *g, uint8_t *keys, const float *vals, uint64_t base, size_t b,
                         unsigned dim, double *cpu) {
  double t0 = bench_now(), c0 = cpu_ms();
  push_new(sh, g, keys, vals, base, b, dim);
  *cpu = cpu_ms() - c0;
  return (bench_now() - t0) * 1e3;
}

static double timed_pull(gb_table *g, const uint8_t *keys, size_t b, float *out, double *cpu) {
  double t0 = bench_now(), c0 = cpu_ms();
  if (ps__shard_read_rows(g->t, keys, 0, (uint32_t)b, out)) {
    fprintf(stderr, "bench_growth: pull failed (out of memory)\n");
    exit(1);
  }
  *cpu = cpu_ms() - c0;
  return (bench_now() - t0) * 1e3;
}

static void report(const char *what, double *grow, double *fixed, size_t n, double *p99_ratio, double *worst) {
  double gw = 0, fw = 0;
  for (size_t i = 0; i < n; i++) {
    if (grow[i] > gw) gw = grow[i];
    if (fixed[i] > fw) fw = fixed[i];
  }
  double g50 = bench_pct(grow, n, 50), g99 = bench_pct(grow, n, 99), g999 = bench_pct(grow, n, 99.9);
  double f50 = bench_pct(fixed, n, 50), f99 = bench_pct(fixed, n, 99), f999 = bench_pct(fixed, n, 99.9);
  printf("%-6s %-6s %9.3f %9.3f %9.3f %9.2f\n", what, "grow", g50, g99, g999, gw);
  printf("%-6s %-6s %9.3f %9.3f %9.3f %9.2f\n", what, "fixed", f50, f99, f999, fw);
  *p99_ratio = g99 / f99;
  *worst = gw;
}

int main(int argc, char **argv) {
  uint64_t from = 1000000, to = 100000000;
  unsigned dim = 1;
  size_t batch = 1000;
  const char *opt = "sgd";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--from") && i + 1 < argc) from = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--to") && i + 1 < argc) to = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--dim") && i + 1 < argc) dim = (unsigned)atoi(argv[++i]);
    else if (!strcmp(argv[i], "--opt") && i + 1 < argc) opt = argv[++i];
    else if (!strcmp(argv[i], "--batch") && i + 1 < argc) batch = (size_t)atol(argv[++i]);
    else {
      fprintf(stderr, "usage: bench_growth [--from N] [--to N] [--dim D] [--opt O] [--batch B]\n");
      return 2;
    }
  }
  if (dim == 0 || batch == 0 || batch > 1000000 || from < batch || to <= from || to > UINT32_MAX) {
    fprintf(stderr, "bench_growth: need dim > 0, 0 < batch <= 1000000, batch <= from < to < 2^32\n");
    return 2;
  }
  ps__shard_hooks hooks = {.alloc = gb_alloc, .release = gb_release};
  ps__shard *sh = ps__shard_new(&hooks);
  if (!sh) return 1;
  ps__shard_member(sh, 1, 1);
  ps__shard_set_started(sh, 1);
  gb_table tabs[2];
  const char *names[2] = {"grow", "fixed"};
  size_t steps = (size_t)((to - from) / batch);
  for (int k = 0; k < 2; k++) {
    ps__declare d = {.id = (uint32_t)k + 1, .kind = PS_SPARSE, .size = dim};
    snprintf(d.name, sizeof d.name, "%s", names[k]);
    snprintf(d.options, sizeof d.options, "opt=%s lr=0.01 mode=async", opt);
    ps__verdict v;
    if (ps__shard_create(sh, &d, &v) != PS__APPLIED) {
      fprintf(stderr, "bench_growth: %s\n", v.msg);
      return 1;
    }
    tabs[k].id = d.id;
    tabs[k].t = ps__shard_table(sh, d.id);
    tabs[k].push_ms = malloc(steps * sizeof(double));
    tabs[k].pull_ms = malloc(steps * sizeof(double));
    tabs[k].push_cpu = malloc(steps * sizeof(double));
    tabs[k].pull_cpu = malloc(steps * sizeof(double));
    if (!tabs[k].push_ms || !tabs[k].pull_ms || !tabs[k].push_cpu || !tabs[k].pull_cpu) return 1;
  }
  if (ps__rowmap_reserve(tabs[1].t->params, (size_t)(to + to / 16))) { /* never near full */
    fprintf(stderr, "bench_growth: cannot reserve an index for %llu rows\n", (unsigned long long)to);
    return 1;
  }
  uint8_t *keys = malloc(batch * 8), *pkeys = malloc(batch * 8);
  float *vals = malloc(batch * dim * sizeof(float)), *out = malloc(batch * ps__spec_row_floats(&tabs[0].t->spec) * 4);
  if (!keys || !pkeys || !vals || !out) return 1;
  for (size_t i = 0; i < batch * dim; i++) vals[i] = 1e-3f;
  double t0 = bench_now();
  for (uint64_t base = 0; base < from; base += batch)
    for (int k = 0; k < 2; k++) push_new(sh, &tabs[k], keys, vals, base, batch, dim);
  printf("# bench_growth: shard engine, two sparse tables of dim %u (opt=%s, async), filled to %llu rows in %.1f s; "
         "then %zu steps, each a push of %zu new keys and a pull of %zu present keys (uniform) per table, until "
         "%llu rows; 'fixed' reserved its index for %llu rows up front\n",
         dim, opt, (unsigned long long)from, bench_now() - t0, steps, batch, batch, (unsigned long long)to,
         (unsigned long long)to);
  uint64_t rng = 42, base = from;
  size_t growths = 0, was_moving = 0;
  unsigned char *state = malloc(steps ? steps : 1); /* per step: 0 steady, 1 rows moving, 2 a growth began */
  if (!state) return 1;
  t0 = bench_now();
  for (size_t s = 0; s < steps; s++, base += batch) {
    for (size_t i = 0; i < batch; i++) ps__put_u64(pkeys + 8 * i, key_of(bench_rand(&rng) % base));
    int first = (int)(s & 1);
    for (int j = 0; j < 2; j++) {
      gb_table *g = &tabs[j ^ first];
      g->push_ms[s] = timed_push(sh, g, keys, vals, base, batch, dim, &g->push_cpu[s]);
    }
    for (int j = 0; j < 2; j++) {
      gb_table *g = &tabs[j ^ first ^ 1];
      g->pull_ms[s] = timed_pull(g, pkeys, batch, out, &g->pull_cpu[s]);
    }
    size_t mv = ps__rowmap_moving(tabs[0].t->params);
    state[s] = mv && !was_moving ? 2 : mv ? 1 : 0;
    if (mv && !was_moving) growths++;
    was_moving = mv;
  }
  double run_s = bench_now() - t0;
  printf("run of %.1f s; the index of 'grow' grew %zu times, 'fixed' never (rows still moving at the end: %zu)\n",
         run_s, growths, ps__rowmap_moving(tabs[1].t->params));
  printf("%-6s %-6s %9s %9s %9s %9s   (ms per request of %zu keys)\n", "op", "table", "p50", "p99", "p99.9",
         "worst", batch);
  /* Before report() sorts the arrays: the worst request and the moving steps apart. */
  static const char *what[3] = {"steady", "rows moving", "the growth began"};
  size_t wi = 0, wk = 0;
  for (size_t i = 0; i < steps; i++) {
    if (tabs[0].push_ms[i] > tabs[0].push_ms[wi] && tabs[0].push_ms[i] >= tabs[0].pull_ms[wk]) wi = i, wk = i;
    if (tabs[0].pull_ms[i] > tabs[0].pull_ms[wk] && tabs[0].pull_ms[i] > tabs[0].push_ms[wi]) wk = i, wi = i;
  }
  size_t nmov, nfix;
  for (int op = 0; op < 2; op++) {
    double *g = op ? tabs[0].pull_ms : tabs[0].push_ms, *f = op ? tabs[1].pull_ms : tabs[1].push_ms;
    for (unsigned char st = 0; st < 2; st++) {
      unsigned char *sel = malloc(steps ? steps : 1);
      if (!sel) return 1;
      for (size_t i = 0; i < steps; i++) sel[i] = state[i] ? 1 : 0;
      double g50 = pct_where(g, sel, st, steps, 50, &nmov), g99 = pct_where(g, sel, st, steps, 99, &nmov);
      double f50 = pct_where(f, sel, st, steps, 50, &nfix), f99 = pct_where(f, sel, st, steps, 99, &nfix);
      printf("%s, %-11s (%6zu steps): grow p50 %.3f p99 %.3f, fixed p50 %.3f p99 %.3f ms\n", op ? "pull" : "push",
             st ? "rows moving" : "steady", nmov, g50, g99, f50, f99);
      free(sel);
    }
  }
  printf("worst request of grow: step %zu (%llu rows), %.2f ms, %s; fixed in that step: push %.2f, pull %.2f ms\n", wi,
         (unsigned long long)(from + (uint64_t)wi * batch), tabs[0].push_ms[wi] > tabs[0].pull_ms[wi] ? tabs[0].push_ms[wi] : tabs[0].pull_ms[wi],
         what[state[wi]], tabs[1].push_ms[wi], tabs[1].pull_ms[wi]);
  free(state);
  double rpush, rpull, wpush, wpull;
  report("push", tabs[0].push_ms, tabs[1].push_ms, steps, &rpush, &wpush);
  report("pull", tabs[0].pull_ms, tabs[1].pull_ms, steps, &rpull, &wpull);
  printf("%-36s %8.2f   target <= 2\n", "p99 grow / fixed, push", rpush);
  printf("%-36s %8.2f   target <= 2\n", "p99 grow / fixed, pull", rpull);
  printf("%-36s %8.2f   target < 50\n", "worst request while growing (ms)", wpush > wpull ? wpush : wpull);
  printf("the same in CPU time of this thread (ms per request):\n");
  double cpush, cpull, xpush, xpull;
  report("push", tabs[0].push_cpu, tabs[1].push_cpu, steps, &cpush, &xpush);
  report("pull", tabs[0].pull_cpu, tabs[1].pull_cpu, steps, &cpull, &xpull);
  printf("%-36s %8.2f / %.2f\n", "p99 grow / fixed in CPU time, push / pull", cpush, cpull);
  printf("%-36s %8.2f\n", "worst request of grow in CPU time (ms)", xpush > xpull ? xpush : xpull);
  for (int k = 0; k < 2; k++) {
    ps__rowmap_use u;
    ps__rowmap_usage(tabs[k].t->params, &u);
    printf("bytes per row, %-6s %8.2f (index %.2f)\n", names[k], (double)u.total / (double)u.rows,
           (double)u.index / (double)u.rows);
  }
  ps__rowmap_next nx;
  ps__rowmap_next_state(tabs[0].t->params, &nx);
  printf("next indexes of 'grow' faulted in by this thread itself: %.1f MiB (the rest by the helper thread)\n",
         (double)nx.own / (1 << 20));
  for (int k = 0; k < 2; k++) {
    free(tabs[k].push_ms);
    free(tabs[k].pull_ms);
    free(tabs[k].push_cpu);
    free(tabs[k].pull_cpu);
  }
  free(keys);
  free(pkeys);
  free(vals);
  free(out);
  ps__shard_free(sh);
  return 0;
}
