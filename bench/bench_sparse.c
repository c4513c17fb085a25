/*
 * bench_sparse.c - sparse row pull and push against Redis, same run.
 *
 * A sparse table of N rows (10M) of dim d (1, 8, 32, 128), populated first, then
 * requests of B keys (1k, 10k, 100k) drawn from a Zipf(1.1) distribution over the rows
 * (heavy-tailed: a few rows are very hot), scrambled over the key space. One worker
 * (this process), one server process. Figures per server: rows/s and GB/s (keys plus
 * values) over all requests, p50 and p99 latency per request. For dim 1 also one call
 * of 10M keys (target: push and pull each under 0.3 s).
 *
 * Peer: Redis (Debian's redis-server) on loopback holding the same rows as binary
 * values under keys "e:<row>": pulls are pipelined MGETs (1000 keys each, every MGET of
 * a request written before any reply is read), pushes pipelined SETs of the new row
 * values (a read-modify-write a naive user would do is not counted: SET only). The
 * ratio printed is pshard rows/s over Redis rows/s; target >= 5 for pulls.
 *
 * Both systems hold the rows at once, and the measurements run in --rounds (3) rounds of
 * pshard pull, pshard push, Redis MGET, Redis SET per batch size, --seconds (0.5) each:
 * every figure is the median over the rounds, and the ratio the median of each round's
 * ratio (its range is printed), so that a noisy minute does not fall on one system only.
 *
 * usage: bench_sparse [--rows N] [--dims 1,8,32,128] [--batches 1000,10000,100000]
 *                     [--transport tcp|auto] [--no-redis] [--seconds S] [--rounds R] [--big-only]
 *                     [--against BIN] [--once-cost] [--track-cost] [--finite-cost]
 *
 * --big-only: only the 10M-key calls at dim 1 (populate, then three pull/push pairs;
 * no batch sweep, no Redis), each run printed with the server's and this process's
 * CPU time, for quick before/after comparisons on a busy machine.
 *
 * --big-only --against BIN: the same calls on two servers at once, this build's and
 * one run from the pshard binary BIN (another build), each holding the same table;
 * --rounds rounds (after one unmeasured) of a pull and a push on each, the server that
 * goes first alternating. Prints each call's server CPU and wall time and, per figure,
 * both medians and the median of the rounds' ratios (this build / BIN): the calls
 * compared run seconds apart, so a machine whose load drifts between whole runs of
 * the benchmark does not decide the comparison.
 *
 * --once-cost: what exactly-once pushes cost the server (shard/once.h), measured on
 * the shard engine in this process (no sockets, whose noise would hide it): for each
 * dim and batch, async sgd pushes of Zipf keys over --rows rows, without an identity
 * (nothing checked or recorded) and with one (each push checked against its worker's
 * window and recorded), in alternating rounds of --seconds each; medians of pushes/s
 * and rows/s of both, and the cost in percent (target: at most 5).
 *
 * --track-cost: what keeping the changed-row sets of incremental checkpoints
 * (--checkpoint-full-every > 1) costs the same pushes: tracking off and on (as a
 * checkpoint's cut leaves a table) in alternating rounds; the cost in percent.
 *
 * --finite-cost: what the check of every pushed value for NaN and Inf costs the same
 * pushes: a table with nonfinite=allow (not checked) and one with the default
 * (nonfinite=refuse: every value scanned), in alternating rounds; the cost in percent.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "shard/shard.h"

#define ZIPF_S 1.1
#define POOL_KEYS (4u << 20)

static double g_seconds = 0.5; /* per (system, dim, batch, op) measurement, per round */
static int rounds = 3;
#define ROUNDS_MAX 9

typedef struct stats {
  double rows_s, gb_s, p50, p99;
} stats;

static stats summarize(double *lat, int n, double total_s, size_t rows, size_t bytes) {
  stats s;
  s.rows_s = (double)rows / total_s;
  s.gb_s = (double)bytes / total_s / 1e9;
  s.p99 = bench_pct(lat, (size_t)n, 99);
  s.p50 = bench_pct(lat, (size_t)n, 50);
  return s;
}

/* ---------------------------------------------------------------- redis client */

typedef struct rconn {
  int fd;
  char *rbuf;
  size_t rcap, rpos, rlen;
  char *wbuf;
  size_t wcap, wlen;
} rconn;

static void r_need(rconn *r, size_t n) {
  if (r->wlen + n <= r->wcap) return;
  while (r->wlen + n > r->wcap) r->wcap = r->wcap ? 2 * r->wcap : (1u << 20);
  r->wbuf = realloc(r->wbuf, r->wcap);
}
static void r_put(rconn *r, const void *p, size_t n) {
  r_need(r, n);
  memcpy(r->wbuf + r->wlen, p, n);
  r->wlen += n;
}
static void r_bulk(rconn *r, const void *p, size_t n) {
  char h[32];
  int k = snprintf(h, sizeof h, "$%zu\r\n", n);
  r_put(r, h, (size_t)k);
  r_put(r, p, n);
  r_put(r, "\r\n", 2);
}
static void r_arr(rconn *r, size_t n) {
  char h[32];
  int k = snprintf(h, sizeof h, "*%zu\r\n", n);
  r_put(r, h, (size_t)k);
}
static int key_str(uint64_t k, char *out) { return sprintf(out, "e:%llu", (unsigned long long)k); }

static void r_flush(rconn *r) {
  size_t off = 0;
  while (off < r->wlen) {
    ssize_t k = write(r->fd, r->wbuf + off, r->wlen - off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      perror("redis write");
      exit(1);
    }
    off += (size_t)k;
  }
  r->wlen = 0;
}

static void r_fill(rconn *r) {
  if (r->rpos > 0 && r->rpos == r->rlen) r->rpos = r->rlen = 0;
  if (r->rlen == r->rcap) {
    if (r->rpos > 0) {
      memmove(r->rbuf, r->rbuf + r->rpos, r->rlen - r->rpos);
      r->rlen -= r->rpos;
      r->rpos = 0;
    } else {
      r->rcap *= 2;
      r->rbuf = realloc(r->rbuf, r->rcap);
    }
  }
  ssize_t k = read(r->fd, r->rbuf + r->rlen, r->rcap - r->rlen);
  if (k <= 0) {
    fprintf(stderr, "redis: connection closed\n");
    exit(1);
  }
  r->rlen += (size_t)k;
}

/* Read one line (without CRLF) into a static view. */
static char *r_line(rconn *r, size_t *len) {
  for (;;) {
    char *s = r->rbuf + r->rpos;
    char *e = memchr(s, '\n', r->rlen - r->rpos);
    if (e) {
      *len = (size_t)(e - s) - 1;
      r->rpos = (size_t)(e - r->rbuf) + 1;
      return s;
    }
    r_fill(r);
  }
}

/* Read n raw bytes + CRLF into dst (NULL: skip). */
static void r_bytes(rconn *r, char *dst, size_t n) {
  size_t need = n + 2;
  while (need) {
    if (r->rpos == r->rlen) r_fill(r);
    size_t take = r->rlen - r->rpos;
    if (take > need) take = need;
    size_t data = need > 2 ? (take < need - 2 ? take : need - 2) : 0;
    if (dst && data) {
      memcpy(dst, r->rbuf + r->rpos, data);
      dst += data;
    }
    r->rpos += take;
    need -= take;
  }
}

/* Read a simple reply (+OK or :n); exits on an error reply. */
static void r_simple(rconn *r) {
  size_t n;
  char *l = r_line(r, &n);
  if (l[0] == '-') {
    fprintf(stderr, "redis error: %.*s\n", (int)n, l);
    exit(1);
  }
}

/* Read an MGET reply of n values of vlen bytes into out (missing: zero). */
static void r_mget_reply(rconn *r, char *out, size_t n, size_t vlen) {
  size_t ll;
  char *l = r_line(r, &ll);
  if (l[0] != '*' || (size_t)atol(l + 1) != n) {
    fprintf(stderr, "redis: unexpected MGET reply %.*s\n", (int)ll, l);
    exit(1);
  }
  for (size_t i = 0; i < n; i++) {
    l = r_line(r, &ll);
    long len = atol(l + 1);
    if (len < 0) {
      memset(out + i * vlen, 0, vlen);
      continue;
    }
    r_bytes(r, (size_t)len == vlen ? out + i * vlen : NULL, (size_t)len);
  }
}

static int free_port(void) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) || getsockname(fd, (struct sockaddr *)&sa, &len)) return 0;
  int p = ntohs(sa.sin_port);
  close(fd);
  return p;
}

/* With --transport auto pshard talks AF_UNIX to its same-host server; Redis then gets a
 * unix socket too (this path), so both sides use the same kind of transport. */
static char redis_unix[108];

static pid_t redis_start(int port) {
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open("/dev/null", 1);
    dup2(fd, 1);
    dup2(fd, 2);
    setpgid(0, 0);
    execlp("redis-server", "redis-server", "--port", ps, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--protected-mode", "no", "--unixsocket", redis_unix, "--unixsocketperm", "700", (char *)NULL);
    _exit(127);
  }
  return pid;
}

static void redis_connect(rconn *r, int port) {
  memset(r, 0, sizeof *r);
  r->rcap = 1u << 20;
  r->rbuf = malloc(r->rcap);
  for (int i = 0; i < 500; i++) {
    if (redis_unix[0]) {
      struct sockaddr_un su = {.sun_family = AF_UNIX};
      snprintf(su.sun_path, sizeof su.sun_path, "%s", redis_unix);
      r->fd = socket(AF_UNIX, SOCK_STREAM, 0);
      if (connect(r->fd, (struct sockaddr *)&su, sizeof su) == 0) return;
    } else {
      struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
      r->fd = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(r->fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
        int one = 1;
        setsockopt(r->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return;
      }
    }
    close(r->fd);
    usleep(20000);
  }
  fprintf(stderr, "bench_sparse: cannot reach redis-server on port %d (is it installed?)\n", port);
  exit(1);
}

static size_t redis_rss(int pid) { return bench_rss(pid); }

static void redis_populate(rconn *r, uint64_t nrows, unsigned dim) {
  size_t vlen = dim * 4;
  char *val = calloc(1, vlen);
  char ks[32];
  const uint64_t chunk = 10000;
  for (uint64_t base = 0; base < nrows; base += chunk) {
    uint64_t n = nrows - base < chunk ? nrows - base : chunk;
    r_arr(r, 1 + 2 * n);
    r_bulk(r, "MSET", 4);
    for (uint64_t i = 0; i < n; i++) {
      float v = (float)(base + i);
      memcpy(val, &v, 4);
      r_bulk(r, ks, (size_t)key_str(base + i, ks));
      r_bulk(r, val, vlen);
    }
    /* Keep a few MSETs in flight. */
    r_flush(r);
    if ((base / chunk) % 8 == 7)
      for (int j = 0; j < 8; j++) r_simple(r);
  }
  uint64_t sent = (nrows + chunk - 1) / chunk;
  for (uint64_t j = sent - sent % 8; j < sent; j++) r_simple(r);
  free(val);
}

static void redis_pull(rconn *r, const uint64_t *keys, size_t n, char *out, size_t vlen) {
  char ks[32];
  const size_t per = 1000;
  size_t ncmd = 0;
  for (size_t b = 0; b < n; b += per) {
    size_t m = n - b < per ? n - b : per;
    r_arr(r, 1 + m);
    r_bulk(r, "MGET", 4);
    for (size_t i = 0; i < m; i++) r_bulk(r, ks, (size_t)key_str(keys[b + i], ks));
    ncmd++;
  }
  r_flush(r);
  for (size_t b = 0; b < n; b += per) {
    size_t m = n - b < per ? n - b : per;
    r_mget_reply(r, out + b * vlen, m, vlen);
  }
}

static void redis_push(rconn *r, const uint64_t *keys, size_t n, const char *vals, size_t vlen) {
  char ks[32];
  for (size_t i = 0; i < n; i++) {
    r_arr(r, 3);
    r_bulk(r, "SET", 3);
    r_bulk(r, ks, (size_t)key_str(keys[i], ks));
    r_bulk(r, vals + i * vlen, vlen);
  }
  r_flush(r);
  for (size_t i = 0; i < n; i++) r_simple(r);
}

/* ---------------------------------------------------------------- measurement */

typedef struct ctx_args {
  ps_ctx *ctx;
  uint32_t tid;
  rconn *rc;
} ctx_args;

/* op: 0 pshard pull, 1 pshard push, 2 redis MGET, 3 redis SET. */
static stats measure(ctx_args *a, int op, const uint64_t *pool, size_t npool, size_t batch, unsigned dim) {
  size_t vlen = (size_t)dim * 4;
  float *buf = malloc(batch * vlen);
  for (size_t i = 0; i < batch * dim; i++) buf[i] = 1e-3f * (float)(i % 7);
  size_t maxreq = 100000;
  double *lat = malloc(sizeof *lat * maxreq);
  int n = 0;
  size_t off = 0;
  double t_start = bench_now(), total = 0;
  /* At least 5 requests, then until g_seconds have passed. */
  while (n < 5 || (bench_now() - t_start < g_seconds && (size_t)n < maxreq)) {
    if (off + batch > npool) off = (off + 7919) % (npool - batch);
    const uint64_t *keys = pool + off;
    off += batch;
    double t0 = bench_now();
    switch (op) {
    case 0: bench_check(ps_pull(a->ctx, a->tid, keys, batch, buf, -1), "ps_pull"); break;
    case 1: bench_check(ps_push(a->ctx, a->tid, keys, batch, buf, 1, -1, -1), "ps_push"); break;
    case 2: redis_pull(a->rc, keys, batch, (char *)buf, vlen); break;
    case 3: redis_push(a->rc, keys, batch, (const char *)buf, vlen); break;
    }
    double dt = bench_now() - t0;
    lat[n++] = dt;
    total += dt;
  }
  stats s = summarize(lat, n, total, (size_t)n * batch, (size_t)n * batch * (8 + vlen));
  free(lat);
  free(buf);
  return s;
}

static void print_row(const char *sys, const char *op, unsigned dim, size_t batch, stats s, double ratio,
                      const char *target) {
  printf("%-7s %-5s %4u %7zu %12.0f %8.3f %10.2f %10.2f", sys, op, dim, batch, s.rows_s, s.gb_s, s.p50 * 1e3,
         s.p99 * 1e3);
  if (ratio > 0)
    printf(" %8.2f  %s\n", ratio, target);
  else
    printf(" %8s  %s\n", "-", target);
  fflush(stdout);
}

/* ---- --once-cost, --track-cost, --finite-cost: the engine alone */

static void *oc_alloc(void *arg, size_t n) {
  (void)arg;
  return malloc(n ? n : 1);
}
static void oc_release(void *arg, void *buf, size_t n) {
  (void)arg, (void)n;
  free(buf);
}

/* Pushes per second of batch-key pushes to table id for g_seconds, with an identity
 * (inc 1, the next sequence) or without one. */
static double oc_run(ps__shard *sh, uint32_t id, const uint8_t *keys, const float *vals, size_t batch, unsigned dim,
                     int ident, uint32_t *seq) {
  ps__push p = {.table = id, .sender = 1, .batch = 1, .lr = -1.0f, .keys = keys, .nkeys = (uint32_t)batch,
                .vals = vals, .nvals = (uint64_t)batch * dim, .inc = ident ? 1 : 0};
  ps__verdict v;
  size_t n = 0;
  double t0 = bench_now(), t;
  do {
    p.seq = ident ? ++*seq : 0;
    if (ps__shard_push(sh, &p, NULL, &v) != PS__APPLIED) {
      fprintf(stderr, "bench_sparse: engine push failed: %s\n", v.msg);
      exit(1);
    }
    n++;
  } while ((t = bench_now() - t0) < g_seconds);
  return (double)n / t;
}

/* One of the engine-only comparisons: pushes to table A against pushes to table B (or
 * to A again, with an identity, or with `before` switching something on). */
typedef struct ec_variant {
  const char *title;          /* what is measured, for the first line */
  const char *a, *b;          /* the two columns' names */
  const char *name_a, *name_b; /* table name prefixes */
  const char *opts_a, *opts_b; /* table options; opts_b NULL: B pushes go to table A */
  int ident_b;                /* B's pushes carry an identity (inc 1, the next sequence) */
  void (*before)(ps__shard *sh, ps__table *t, int b); /* before each A (0) and B (1) run; NULL */
  void (*footer)(ps__shard *sh);                      /* a last line; NULL */
} ec_variant;

/* For each dim and batch: A and B in alternating rounds of --seconds, medians of both
 * and B's cost in percent. */
static int engine_cost(const ec_variant *ev, uint64_t nrows, const unsigned *dims, int nd, const size_t *batches,
                       int nb) {
  ps__shard_hooks hooks = {.alloc = oc_alloc, .release = oc_release};
  ps__shard *sh = ps__shard_new(&hooks);
  if (!sh) return 1;
  ps__shard_member(sh, 1, 1);
  ps__shard_set_started(sh, 1);
  bench_zipf z;
  bench_zipf_init(&z, nrows, ZIPF_S, 42);
  printf("%s on the shard engine (one thread, async sgd, Zipf(%.1f) keys over %llu rows), median of %d rounds of "
         "%.2f s each\n", ev->title, ZIPF_S, (unsigned long long)nrows, rounds, g_seconds);
  char la[32], lb[32], ra[32], rb[32];
  snprintf(la, sizeof la, "%s push/s", ev->a);
  snprintf(ra, sizeof ra, "%s rows/s", ev->a);
  snprintf(lb, sizeof lb, "%s push/s", ev->b);
  snprintf(rb, sizeof rb, "%s rows/s", ev->b);
  printf("%5s %8s | %14s %14s | %14s %14s | %7s\n", "dim", "batch", la, ra, lb, rb, "cost %");
  uint32_t seq = 0;
  for (int di = 0; di < nd; di++) {
    ps__declare d = {.id = 2 * (uint32_t)di + 1, .kind = PS_SPARSE, .size = dims[di]}, e;
    snprintf(d.name, sizeof d.name, "%s%u", ev->name_a, dims[di]);
    snprintf(d.options, sizeof d.options, "%s", ev->opts_a);
    ps__verdict v;
    int rc = ps__shard_create(sh, &d, &v) != PS__APPLIED;
    e = d;
    if (!rc && ev->opts_b) {
      e.id++;
      snprintf(e.name, sizeof e.name, "%s%u", ev->name_b, dims[di]);
      snprintf(e.options, sizeof e.options, "%s", ev->opts_b);
      rc = ps__shard_create(sh, &e, &v) != PS__APPLIED;
    }
    if (rc) {
      fprintf(stderr, "bench_sparse: %s\n", v.msg);
      return 1;
    }
    ps__table *t = ps__shard_table(sh, d.id);
    for (int bi = 0; bi < nb; bi++) {
      size_t batch = batches[bi];
      uint8_t *keys = malloc(batch * 8);
      float *vals = malloc(batch * dims[di] * sizeof(float));
      if (!keys || !vals) return 1;
      for (size_t i = 0; i < batch; i++) ps__put_u64(keys + 8 * i, bench_zipf_next(&z));
      for (size_t i = 0; i < batch * dims[di]; i++) vals[i] = 0.001f * (float)(i % 7);
      double ta[ROUNDS_MAX], tb[ROUNDS_MAX];
      oc_run(sh, d.id, keys, vals, batch, dims[di], 0, &seq); /* warm: rows created */
      if (e.id != d.id) oc_run(sh, e.id, keys, vals, batch, dims[di], 0, &seq);
      for (int r = 0; r < rounds; r++) {
        if (ev->before) ev->before(sh, t, 0);
        ta[r] = oc_run(sh, d.id, keys, vals, batch, dims[di], 0, &seq);
        if (ev->before) ev->before(sh, t, 1);
        tb[r] = oc_run(sh, e.id, keys, vals, batch, dims[di], ev->ident_b, &seq);
      }
      if (ev->before) ev->before(sh, t, 0);
      double ma = bench_median(ta, (size_t)rounds), mb = bench_median(tb, (size_t)rounds);
      printf("%5u %8zu | %14.0f %14.0f | %14.0f %14.0f | %7.2f\n", dims[di], batch, ma, ma * (double)batch, mb,
             mb * (double)batch, 100.0 * (ma - mb) / ma);
      fflush(stdout);
      free(keys);
      free(vals);
    }
  }
  if (ev->footer) ev->footer(sh);
  ps__shard_free(sh);
  return 0;
}

static void once_footer(ps__shard *sh) {
  printf("duplicates seen: %llu (expected 0)\n", (unsigned long long)sh->once.dups);
}

/* --track-cost: tracking of table t on or off, as a checkpoint's cut leaves it. */
static void tc_track(ps__shard *sh, ps__table *t, int on) {
  ps__snap_table s;
  if (ps__shard_snap(t, &s, on)) {
    fprintf(stderr, "bench_sparse: cut failed: %s\n", ps_errmsg());
    exit(1);
  }
  ps__shard_snap_release(sh, &s);
}

static void finite_footer(ps__shard *sh) {
  printf("pushes refused for non-finite values: %llu (expected 0)\n", (unsigned long long)sh->nonfinite_refused);
}

static const ec_variant EC_ONCE = {.title = "exactly-once bookkeeping", .a = "plain", .b = "once", .name_a = "once",
                                   .opts_a = "opt=sgd lr=0.001 mode=async", .ident_b = 1, .footer = once_footer};
static const ec_variant EC_TRACK = {.title = "changed-row tracking (incremental checkpoints)", .a = "plain",
                                    .b = "track", .name_a = "track", .opts_a = "opt=sgd lr=0.001 mode=async",
                                    .before = tc_track};
static const ec_variant EC_FINITE = {.title = "finite check of pushed values", .a = "allow", .b = "check",
                                     .name_a = "allow", .name_b = "check",
                                     .opts_a = "opt=sgd lr=0.001 mode=async nonfinite=allow",
                                     .opts_b = "opt=sgd lr=0.001 mode=async", .footer = finite_footer};

/* ---------------------------------------------------------------- --against */

/* One server of a side-by-side comparison: its cluster, worker context and table. */
typedef struct big_side {
  bench_cluster c;
  ps_ctx *ctx;
  uint32_t tid;
  float *vals;
  double t[4][ROUNDS_MAX]; /* pull cpu, pull wall, push cpu, push wall */
} big_side;

/* A cluster of one server run from binary bin, a dim-1 table in it filled with nrows
 * rows (pulls of 1M new keys, as in the main run). */
static void big_side_start(big_side *b, const char *bin, uint64_t nrows, size_t nbig, const char *transport) {
  char *old = getenv("PSHARD_BIN") ? strdup(getenv("PSHARD_BIN")) : NULL;
  setenv("PSHARD_BIN", bin, 1); /* bench_cluster_start runs the binary it names */
  bench_cluster_start(&b->c, 1, 1, transport);
  if (old) setenv("PSHARD_BIN", old, 1);
  else unsetenv("PSHARD_BIN");
  free(old);
  b->ctx = bench_open(&b->c, 0, 1, transport, "async");
  bench_check(ps_table_declare(b->ctx, "emb1", PS_SPARSE, 1, "opt=sgd lr=0.01 mode=async init=uniform:0.01", &b->tid),
              "declare");
  size_t chunk = 1u << 20;
  uint64_t *keys = malloc(chunk * 8);
  float *out = malloc(chunk * 4);
  for (uint64_t base = 0; base < nrows; base += chunk) {
    size_t n = nrows - base < chunk ? (size_t)(nrows - base) : chunk;
    for (size_t i = 0; i < n; i++) keys[i] = base + i;
    bench_check(ps_pull(b->ctx, b->tid, keys, n, out, -1), "populate pull");
  }
  free(keys);
  free(out);
  b->vals = malloc(nbig * 4);
}

/* The 10M-key calls on this build's server and on one run from binary `base`,
 * alternating (see --against at the top). */
static int big_against(const char *base, uint64_t nrows, const char *transport) {
  static big_side sd[2]; /* 0: this build, 1: base */
  const char *bins[2] = {bench_pshard_bin(), base};
  size_t nbig = nrows;
  uint64_t *big = malloc(nbig * sizeof *big);
  bench_zipf z;
  bench_zipf_init(&z, nrows, ZIPF_S, 42);
  for (size_t i = 0; i < POOL_KEYS; i++) bench_zipf_next(&z); /* the keys of the main run's 10M-key call */
  for (size_t i = 0; i < nbig; i++) big[i] = bench_zipf_next(&z);
  for (int s = 0; s < 2; s++) big_side_start(&sd[s], bins[s], nrows, nbig, transport);
  printf("# bench_sparse --big-only --against: %llu keys of dim 1 per call, Zipf(%.1f); transport %s\n"
         "# A = this build (%s), B = %s; %d rounds after one unmeasured, the first server alternating\n",
         (unsigned long long)nbig, ZIPF_S, transport, bins[0], bins[1], rounds);
  for (int r = -1; r < rounds; r++) {
    for (int o = 0; o < 2; o++) {
      int s = r & 1 ? 1 - o : o;
      big_side *b = &sd[s];
      pid_t sp = b->c.server_pid[0];
      for (size_t i = 0; i < nbig; i++) b->vals[i] = 1e-4f;
      double c0 = bench_cpu_s(sp), t0 = bench_now();
      bench_check(ps_pull(b->ctx, b->tid, big, nbig, b->vals, -1), "big pull");
      double c1 = bench_cpu_s(sp), t1 = bench_now();
      bench_check(ps_push(b->ctx, b->tid, big, nbig, b->vals, 1, -1, -1), "big push");
      double c2 = bench_cpu_s(sp), t2 = bench_now();
      if (r < 0) continue;
      b->t[0][r] = c1 - c0, b->t[1][r] = t1 - t0, b->t[2][r] = c2 - c1, b->t[3][r] = t2 - t1;
      printf("# round %d %c: pull %.3f s (server cpu %.3f s); push %.3f s (server cpu %.3f s)\n", r, "AB"[s],
             b->t[1][r], b->t[0][r], b->t[3][r], b->t[2][r]);
    }
  }
  static const char *what[4] = {"pull server cpu", "pull wall", "push server cpu", "push wall"};
  for (int k = 0; k < 4; k++) {
    double a[ROUNDS_MAX], bb[ROUNDS_MAX], q[ROUNDS_MAX], lo = 1e300, hi = 0;
    for (int r = 0; r < rounds; r++) {
      a[r] = sd[0].t[k][r], bb[r] = sd[1].t[k][r], q[r] = a[r] / bb[r];
      if (q[r] < lo) lo = q[r];
      if (q[r] > hi) hi = q[r];
    }
    printf("%-16s A median %.3f s, B median %.3f s; A/B median of rounds %.2f (%.2f-%.2f)\n", what[k],
           bench_median(a, (size_t)rounds), bench_median(bb, (size_t)rounds), bench_median(q, (size_t)rounds), lo, hi);
  }
  for (int s = 0; s < 2; s++) {
    ps_ctx_close(sd[s].ctx);
    bench_cluster_stop(&sd[s].c);
    free(sd[s].vals);
  }
  free(big);
  return 0;
}

int main(int argc, char **argv) {
  uint64_t nrows = 10000000;
  const char *dims_s = "1,8,32,128", *batches_s = "1000,10000,100000", *transport = "tcp";
  int use_redis = 1, big_only = 0, once_only = 0, track_only = 0, finite_only = 0;
  const char *against = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--rows") && i + 1 < argc) nrows = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--dims") && i + 1 < argc) dims_s = argv[++i];
    else if (!strcmp(argv[i], "--batches") && i + 1 < argc) batches_s = argv[++i];
    else if (!strcmp(argv[i], "--transport") && i + 1 < argc) transport = argv[++i];
    else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) g_seconds = atof(argv[++i]);
    else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--no-redis")) use_redis = 0;
    else if (!strcmp(argv[i], "--big-only")) big_only = 1;
    else if (!strcmp(argv[i], "--against") && i + 1 < argc) against = argv[++i];
    else if (!strcmp(argv[i], "--once-cost")) once_only = 1;
    else if (!strcmp(argv[i], "--track-cost")) track_only = 1;
    else if (!strcmp(argv[i], "--finite-cost")) finite_only = 1;
    else {
      fprintf(stderr, "usage: bench_sparse [--rows N] [--dims LIST] [--batches LIST] [--transport tcp|auto] "
                      "[--no-redis] [--seconds S] [--rounds R] [--big-only] [--against BIN] [--once-cost] "
                      "[--track-cost] [--finite-cost]\n");
      return 2;
    }
  }
  if (rounds < 1 || rounds > ROUNDS_MAX) {
    fprintf(stderr, "bench_sparse: --rounds takes 1 to %d\n", ROUNDS_MAX);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  unsigned dims[8];
  size_t batches[8];
  int nd = 0, nb = 0;
  char buf[128];
  snprintf(buf, sizeof buf, "%s", dims_s);
  for (char *s = strtok(buf, ","); s && nd < 8; s = strtok(NULL, ",")) dims[nd++] = (unsigned)atoi(s);
  snprintf(buf, sizeof buf, "%s", batches_s);
  for (char *s = strtok(buf, ","); s && nb < 8; s = strtok(NULL, ",")) batches[nb++] = (size_t)atol(s);
  if (against && !big_only) {
    fprintf(stderr, "bench_sparse: --against goes with --big-only\n");
    return 2;
  }
  if (against) return big_against(against, nrows, transport);
  if (once_only) return engine_cost(&EC_ONCE, nrows, dims, nd, batches, nb);
  if (track_only) return engine_cost(&EC_TRACK, nrows, dims, nd, batches, nb);
  if (finite_only) return engine_cost(&EC_FINITE, nrows, dims, nd, batches, nb);
  if (big_only) {
    dims[0] = 1;
    nd = 1;
    nb = 0;
    use_redis = 0;
  }

  /* One pool of Zipf keys shared by every measurement (and a 10M-key call for dim 1). */
  size_t npool = POOL_KEYS;
  uint64_t *pool = malloc(npool * sizeof *pool);
  bench_zipf z;
  bench_zipf_init(&z, nrows, ZIPF_S, 42);
  for (size_t i = 0; i < npool; i++) pool[i] = bench_zipf_next(&z);
  size_t nbig = nrows;
  uint64_t *big = malloc(nbig * sizeof *big);
  for (size_t i = 0; i < nbig; i++) big[i] = bench_zipf_next(&z);
  {
    /* Distinct keys in a 100k batch, for the reader. */
    size_t distinct = 0;
    uint8_t *seen = calloc((nrows + 7) / 8, 1);
    for (size_t i = 0; i < 100000; i++)
      if (!(seen[pool[i] >> 3] & (1u << (pool[i] & 7)))) {
        seen[pool[i] >> 3] |= (uint8_t)(1u << (pool[i] & 7));
        distinct++;
      }
    free(seen);
    printf("# bench_sparse: %llu rows, keys Zipf(%.1f) scrambled; a 100k-key batch has %zu distinct rows\n",
           (unsigned long long)nrows, ZIPF_S, distinct);
  }
  if (strcmp(transport, "tcp") != 0)
    snprintf(redis_unix, sizeof redis_unix, "/tmp/pshard-bench-redis-%d.sock", (int)getpid());
  printf("# pshard: 1 server process, transport %s, table opt=sgd mode=async; redis: redis-server on %s, "
         "pipelined MGET (1000 keys each) / SET\n",
         transport, redis_unix[0] ? "a unix socket (as pshard: same-host AF_UNIX)" : "TCP loopback");
  printf("# GB/s counts keys (8 B) and values; latency per request in ms; ratio = pshard rows/s / redis rows/s\n");
  printf("%-7s %-5s %4s %7s %12s %8s %10s %10s %8s  %s\n", "system", "op", "dim", "batch", "rows/s", "GB/s",
         "p50_ms", "p99_ms", "ratio", "target");
  fflush(stdout);

  for (int di = 0; di < nd; di++) {
    unsigned dim = dims[di];
    /* ---- pshard */
    bench_cluster c;
    bench_cluster_start(&c, 1, 1, transport);
    ps_ctx *ctx = bench_open(&c, 0, 1, transport, "async");
    uint32_t tid;
    char name[32], opts[96];
    snprintf(name, sizeof name, "emb%u", dim);
    snprintf(opts, sizeof opts, "opt=sgd lr=0.01 mode=async init=uniform:0.01");
    bench_check(ps_table_declare(ctx, name, PS_SPARSE, dim, opts, &tid), "declare");
    {
      size_t chunk = 1u << 20;
      uint64_t *keys = malloc(chunk * 8);
      float *out = malloc(chunk * dim * 4);
      double t0 = bench_now();
      for (uint64_t base = 0; base < nrows; base += chunk) {
        size_t n = nrows - base < chunk ? (size_t)(nrows - base) : chunk;
        for (size_t i = 0; i < n; i++) keys[i] = base + i;
        bench_check(ps_pull(ctx, tid, keys, n, out, -1), "populate pull");
      }
      double t = bench_now() - t0;
      printf("# dim %u: pshard populated %llu rows in %.2f s (%.0f rows/s, pulls of 1M new keys); server RSS %.0f MB\n",
             dim, (unsigned long long)nrows, t, (double)nrows / t, (double)bench_rss(c.server_pid[0]) / 1e6);
      fflush(stdout);
      free(keys);
      free(out);
    }
    ctx_args a = {.ctx = ctx, .tid = tid};
    if (dim == 1) {
      /* 10M keys in one call. */
      float *vals = malloc(nbig * 4);
      for (size_t i = 0; i < nbig; i++) vals[i] = 1e-4f;
      double tp[3], tq[3];
      pid_t spid = c.server_pid[0];
      for (int r = 0; r < 3; r++) {
        double s0 = bench_cpu_s(spid), w0 = bench_cpu_s(0), t0 = bench_now();
        bench_check(ps_pull(ctx, tid, big, nbig, vals, -1), "big pull");
        tp[r] = bench_now() - t0;
        double s1 = bench_cpu_s(spid), w1 = bench_cpu_s(0);
        t0 = bench_now();
        bench_check(ps_push(ctx, tid, big, nbig, vals, 1, -1, -1), "big push");
        tq[r] = bench_now() - t0;
        double s2 = bench_cpu_s(spid), w2 = bench_cpu_s(0);
        if (big_only)
          printf("# run %d: pull %.3f s (server cpu %.3f s, worker cpu %.3f s); push %.3f s (server cpu %.3f s, "
                 "worker cpu %.3f s)\n",
                 r, tp[r], s1 - s0, w1 - w0, tq[r], s2 - s1, w2 - w1);
      }
      printf("pshard  pull    1 %7zu one call: median %.3f s (%.0f rows/s)   target < 0.3 s\n", nbig,
             bench_median(tp, 3), (double)nbig / bench_median(tp, 3));
      printf("pshard  push    1 %7zu one call: median %.3f s (%.0f rows/s)   target < 0.3 s\n", nbig,
             bench_median(tq, 3), (double)nbig / bench_median(tq, 3));
      free(vals);
    }

    /* ---- redis, populated beside pshard: both hold the rows while the requests run */
    pid_t rpid = 0;
    rconn rc;
    if (use_redis) {
      int port = free_port();
      rpid = redis_start(port);
      redis_connect(&rc, port);
      double t0 = bench_now();
      redis_populate(&rc, nrows, dim);
      double t = bench_now() - t0;
      printf("# dim %u: redis populated %llu rows in %.2f s (MSET of 10k); redis RSS %.0f MB\n", dim,
             (unsigned long long)nrows, t, (double)redis_rss(rpid) / 1e6);
      fflush(stdout);
      a.rc = &rc;
    }
    /* Rounds of (pshard pull, pshard push, redis MGET, redis SET) per batch size,
     * interleaved, so that both systems see the same moments of a noisy machine. */
    static stats res[ROUNDS_MAX][8][4];
    for (int r = 0; r < rounds; r++)
      for (int bi = 0; bi < nb; bi++)
        for (int op = 0; op < (use_redis ? 4 : 2); op++) res[r][bi][op] = measure(&a, op, pool, npool, batches[bi], dim);
    ps_ctx_close(ctx);
    bench_cluster_stop(&c);
    if (use_redis) {
      close(rc.fd);
      kill(rpid, SIGTERM);
      if (redis_unix[0]) unlink(redis_unix);
      waitpid(rpid, NULL, 0);
    }
    for (int bi = 0; bi < nb; bi++) {
      stats med[4];
      double ratio[2] = {0, 0}, lo[2] = {1e300, 1e300}, hi[2] = {0, 0};
      for (int op = 0; op < (use_redis ? 4 : 2); op++) {
        double f[4][ROUNDS_MAX];
        for (int r = 0; r < rounds; r++)
          f[0][r] = res[r][bi][op].rows_s, f[1][r] = res[r][bi][op].gb_s, f[2][r] = res[r][bi][op].p50,
          f[3][r] = res[r][bi][op].p99;
        med[op] = (stats){bench_median(f[0], (size_t)rounds), bench_median(f[1], (size_t)rounds),
                          bench_median(f[2], (size_t)rounds), bench_median(f[3], (size_t)rounds)};
      }
      for (int op = 0; use_redis && op < 2; op++) {
        double q[ROUNDS_MAX];
        for (int r = 0; r < rounds; r++) {
          q[r] = res[r][bi][op].rows_s / res[r][bi][op + 2].rows_s;
          if (q[r] < lo[op]) lo[op] = q[r];
          if (q[r] > hi[op]) hi[op] = q[r];
        }
        ratio[op] = bench_median(q, (size_t)rounds);
      }
      char tp[64], tq[64];
      snprintf(tp, sizeof tp, ">= 5x redis MGET (rounds %.2f-%.2f)", lo[0], hi[0]);
      snprintf(tq, sizeof tq, "(vs redis SET; rounds %.2f-%.2f)", lo[1], hi[1]);
      print_row("pshard", "pull", dim, batches[bi], med[0], ratio[0], use_redis ? tp : ">= 5x redis MGET");
      print_row("pshard", "push", dim, batches[bi], med[1], ratio[1], use_redis ? tq : "(vs redis SET)");
      if (use_redis) {
        print_row("redis", "mget", dim, batches[bi], med[2], 0, "");
        print_row("redis", "set", dim, batches[bi], med[3], 0, "");
      }
    }
  }
  free(pool);
  free(big);
  return 0;
}
