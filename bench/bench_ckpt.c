/*
 * bench_ckpt.c - push latency while a checkpoint is taken, the time until it is
 * durable, the disk's own speed, and a fork-based snapshot of the same state, same run.
 *
 * pshard. A scheduler with a checkpoint directory (a temporary directory under /tmp),
 * one server process and one worker (this process). A sparse async table of dim 16
 * with adagrad (each row: 16 parameters and 16 accumulators, 128 bytes) is filled with
 * --gb GB (1e9 bytes) of state by pushes of 100k distinct keys. Then, --rounds times:
 * pushes of 1000 keys drawn uniformly from the table's keys, back to back, each timed,
 * for 2 s; a second thread calls ps_checkpoint on the same context (the server cuts
 * the table, which copies nothing; a writer thread sorts the rows and reads them while
 * the loop saves each row it is about to change before the writer has read it; the
 * file goes out through O_DIRECT and its own I/O thread, fsync, rename, then the
 * scheduler writes the manifest); the pushes go on until ps_checkpoint has returned,
 * and for 2 s more. With BENCH_LOG=FILE the cluster's log is kept there, with the
 * server's line saying where the write's time went (cut, sort, rows, fsync). A push is "during" a checkpoint if its interval overlaps
 * [request, manifest durable], "outside" otherwise. One more checkpoint follows with
 * no pushes meanwhile: the writer's time without the push stream competing for the cores.
 *
 * The disk: the same number of bytes as one checkpoint file written in 1 MiB blocks
 * and fsynced (as `dd bs=1M conv=fsync`) into the same directory, before pshard, between
 * pshard and the fork comparison, and after it; the median of the three is the disk's
 * figure (on a shared VM one such write can be 4x slower than the next).
 *
 * Fork-based snapshot. After the cluster has stopped, this process holds the same
 * rows (a flat array of the same 128-byte rows) and applies the same updates (adagrad
 * on 1000 uniform rows) at the rate the pshard pushes reached outside a checkpoint
 * (closed loop: an update starts no sooner than 1/rate after the previous one); for
 * --rounds rounds, after 2 s it fork()s and the child writes the array to a file
 * (1 MiB writes, fsync, rename, fsync of the directory) while the parent keeps
 * updating (copy-on-write), each update timed the same way. Its "during" runs from
 * the fork() call until the child is reaped.
 *
 * Targets: p99 push latency during a checkpoint <= 2x outside one; no push slower than
 * 100 ms; durable within 3 s per GB of state. Uniform keys are the worst case for
 * copy-on-write (nearly every update of 1000 rows touches 1000 distinct pages).
 *
 * usage: bench_ckpt [--gb G] [--rounds R]
 *   --gb      GB (1e9 bytes) of state: parameters + optimiser state (1)
 *   --rounds  checkpoints (and forks) measured (3)
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

#define DIM 16u
#define ROW_FLOATS (2u * DIM)               /* adagrad: parameters + accumulators */
#define ROW_BYTES (ROW_FLOATS * 4u)
#define FILL_BATCH 100000u                  /* keys per push while filling */
#define PUSH_KEYS 1000u                     /* keys per timed push */
#define PRE_S 2.0                           /* pushes before each checkpoint, seconds */
#define POST_S 2.0                          /* pushes after it is durable, seconds */
#define LR 0.01f
#define GRAD 1e-3f

static char g_dir[64];         /* the temporary directory; removed at exit */
static bench_cluster g_cluster;
static int g_cluster_up;

static void cleanup(void) {
  if (g_cluster_up) {
    g_cluster_up = 0;
    bench_cluster_stop(&g_cluster);
  }
  if (g_dir[0]) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd)) fprintf(stderr, "bench_ckpt: could not remove %s\n", g_dir);
    g_dir[0] = 0;
  }
}

static void die(const char *what) {
  fprintf(stderr, "bench_ckpt: %s: %s\n", what, strerror(errno));
  exit(1);
}

/* ---------------------------------------------------------------- samples */

typedef struct span {
  double t0, t1;
} span;

typedef struct spans {
  span *v;
  size_t n, cap;
} spans;

static void spans_add(spans *s, double t0, double t1) {
  if (s->n == s->cap) {
    s->cap = s->cap ? 2 * s->cap : 4096;
    s->v = realloc(s->v, s->cap * sizeof *s->v);
    if (!s->v) die("out of memory");
  }
  s->v[s->n++] = (span){t0, t1};
}

/* Latencies in ms, split into those overlapping one of the windows [w0[i], w1[i]]
 * ("during") and the rest. */
typedef struct lat {
  double *in, *out;
  size_t nin, nout;
} lat;

static void lat_split(const spans *s, const double *w0, const double *w1, int nw, lat *l) {
  l->in = malloc((s->n + 1) * sizeof *l->in);
  l->out = malloc((s->n + 1) * sizeof *l->out);
  if (!l->in || !l->out) die("out of memory");
  l->nin = l->nout = 0;
  for (size_t i = 0; i < s->n; i++) {
    int during = 0;
    for (int w = 0; w < nw && !during; w++) during = s->v[i].t1 > w0[w] && s->v[i].t0 < w1[w];
    double ms = (s->v[i].t1 - s->v[i].t0) * 1e3;
    if (during)
      l->in[l->nin++] = ms;
    else
      l->out[l->nout++] = ms;
  }
}

static double sum_d(const double *v, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++) s += v[i];
  return s;
}

static void print_lat_row(const char *name, double *v, size_t n) {
  printf("  %-34s %8zu %10.3f %10.3f %10.3f\n", name, n, bench_pct(v, n, 50), bench_pct(v, n, 99),
         bench_pct(v, n, 100));
}

static const char *verdict(int met) { return met ? "met" : "MISSED"; }

/* ---------------------------------------------------------------- the disk */

static void full_write(int fd, const char *p, size_t n, const char *what) {
  while (n) {
    ssize_t k = write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) die(what);
    p += k;
    n -= (size_t)k;
  }
}

/* GB/s of writing `bytes` in 1 MiB blocks and fsyncing, into dir (as dd conv=fsync). */
static double disk_gbps(const char *dir, size_t bytes) {
  char path[128];
  snprintf(path, sizeof path, "%s/dd.tmp", dir);
  size_t blk = (size_t)1 << 20;
  char *buf = malloc(blk);
  if (!buf) die("out of memory");
  uint64_t rng = 42;
  for (size_t i = 0; i < blk; i += 8) {
    uint64_t r = bench_rand(&rng);
    memcpy(buf + i, &r, 8);
  }
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) die("cannot create the disk test file");
  double t0 = bench_now();
  for (size_t at = 0; at < bytes; at += blk) full_write(fd, buf, bytes - at < blk ? bytes - at : blk, "disk test write");
  if (fsync(fd)) die("fsync of the disk test file");
  double t = bench_now() - t0;
  close(fd);
  unlink(path);
  free(buf);
  return (double)bytes / t / 1e9;
}

/* ---------------------------------------------------------------- pshard */

typedef struct ckpt_thread {
  ps_ctx *ctx;
  atomic_int done;
  int rc;
  char err[256];
  uint64_t id;
  double t_req, t_done;
} ckpt_thread;

static void *ckpt_main(void *arg) {
  ckpt_thread *k = arg;
  k->t_req = bench_now();
  k->rc = ps_checkpoint(k->ctx, &k->id, 600000);
  k->t_done = bench_now();
  if (k->rc) snprintf(k->err, sizeof k->err, "%s (%s)", ps_errmsg(), ps_err_name(k->rc));
  atomic_store(&k->done, 1);
  return NULL;
}

static uint64_t key_of(uint64_t i) { return i * 0x9e3779b97f4a7c15ull; }

static void timed_push(ps_ctx *ctx, uint32_t tid, uint64_t nrows, uint64_t *rng, uint64_t *keys, const float *g,
                       spans *s) {
  for (unsigned j = 0; j < PUSH_KEYS; j++) keys[j] = key_of(bench_rand(rng) % nrows);
  double t0 = bench_now();
  bench_check(ps_push(ctx, tid, keys, PUSH_KEYS, g, 1, -1, -1), "push");
  spans_add(s, t0, bench_now());
}

/* ---------------------------------------------------------------- fork-based snapshot */

static void adagrad_rows(float *rows, uint64_t nrows, uint64_t *rng) {
  for (unsigned j = 0; j < PUSH_KEYS; j++) {
    float *r = rows + (bench_rand(rng) % nrows) * ROW_FLOATS;
    for (unsigned d = 0; d < DIM; d++) {
      r[DIM + d] += GRAD * GRAD;
      r[d] -= LR * GRAD / (sqrtf(r[DIM + d]) + 1e-10f);
    }
  }
}

/* One update, paced: it starts no sooner than `interval` after the previous one's
 * start (*next); the wait is a sleep, so it leaves the core to the snapshot writer. */
static void paced_update(float *rows, uint64_t nrows, uint64_t *rng, double interval, double *next, spans *s) {
  double now = bench_now();
  if (now < *next) {
    struct timespec ts = {.tv_sec = (time_t)*next, .tv_nsec = (long)((*next - floor(*next)) * 1e9)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
    now = bench_now();
  }
  adagrad_rows(rows, nrows, rng);
  spans_add(s, now, bench_now());
  *next = now + interval;
}

/* The child: write the snapshot it sees, make it durable, exit 0 (1 on an error). */
static void fork_child_write(const char *dir, int r, const float *rows, size_t bytes) {
  char tmp[128], fin[128];
  snprintf(tmp, sizeof tmp, "%s/fork-%d.tmp", dir, r);
  snprintf(fin, sizeof fin, "%s/fork-%d.snap", dir, r);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) _exit(1);
  const char *p = (const char *)rows;
  size_t blk = (size_t)1 << 20;
  for (size_t at = 0; at < bytes;) {
    ssize_t k = write(fd, p + at, bytes - at < blk ? bytes - at : blk);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) _exit(1);
    at += (size_t)k;
  }
  if (fsync(fd) || close(fd) || rename(tmp, fin)) _exit(1);
  int dfd = open(dir, O_RDONLY | O_DIRECTORY);
  if (dfd < 0 || fsync(dfd)) _exit(1);
  _exit(0);
}

typedef struct fork_result {
  lat l;
  double fork_call_ms_max, durable_s[16];
  int rounds;
} fork_result;

static void run_fork(const char *dir, uint64_t nrows, int rounds, double rate, fork_result *fr) {
  size_t bytes = (size_t)nrows * ROW_BYTES;
  float *rows = malloc(bytes);
  if (!rows) die("out of memory for the fork comparison's rows");
  uint64_t rng = 7;
  for (size_t i = 0; i < (size_t)nrows * ROW_FLOATS; i++) /* every page resident, as the server's */
    rows[i] = (i % ROW_FLOATS) < DIM ? (float)((double)(bench_rand(&rng) >> 11) * 0x1p-53 * 0.02 - 0.01) : 0.0f;
  double interval = rate > 0 ? 1.0 / rate : 0, w0[16], w1[16];
  spans s = {0};
  memset(fr, 0, sizeof *fr);
  fr->rounds = rounds;
  double next = bench_now();
  for (int r = 0; r < rounds; r++) {
    for (double t0 = bench_now(); bench_now() - t0 < PRE_S;) paced_update(rows, nrows, &rng, interval, &next, &s);
    double tf = bench_now();
    pid_t pid = fork();
    double tf1 = bench_now();
    if (pid < 0) die("fork");
    if (pid == 0) fork_child_write(dir, r, rows, bytes);
    if ((tf1 - tf) * 1e3 > fr->fork_call_ms_max) fr->fork_call_ms_max = (tf1 - tf) * 1e3;
    spans_add(&s, tf, tf1); /* the fork() call itself stops the updates */
    int status = 0;
    for (;;) {
      paced_update(rows, nrows, &rng, interval, &next, &s);
      pid_t w = waitpid(pid, &status, WNOHANG);
      if (w == pid) break;
      if (w < 0) die("waitpid");
    }
    double td = bench_now();
    if (!WIFEXITED(status) || WEXITSTATUS(status)) {
      fprintf(stderr, "bench_ckpt: the forked snapshot writer failed\n");
      exit(1);
    }
    w0[r] = tf;
    w1[r] = td;
    fr->durable_s[r] = td - tf;
    char fin[128];
    snprintf(fin, sizeof fin, "%s/fork-%d.snap", dir, r);
    unlink(fin);
    for (double t0 = bench_now(); bench_now() - t0 < POST_S;) paced_update(rows, nrows, &rng, interval, &next, &s);
  }
  lat_split(&s, w0, w1, rounds, &fr->l);
  free(s.v);
  free(rows);
}

/* ---------------------------------------------------------------- main */

static void usage(void) {
  fprintf(stderr, "usage: bench_ckpt [--gb G] [--rounds R]\n"
                  "  --gb      GB (1e9 bytes) of state, parameters + optimiser state (1; 0.01..64)\n"
                  "  --rounds  checkpoints, and forks, measured (3; 1..16)\n");
}

int main(int argc, char **argv) {
  double gb = 1.0;
  int rounds = 3;
  for (int i = 1; i < argc; i++) {
    char *end = NULL;
    if (!strcmp(argv[i], "--gb") && i + 1 < argc) {
      gb = strtod(argv[++i], &end);
      if (!end || *end || !(gb >= 0.01 && gb <= 64)) {
        fprintf(stderr, "bench_ckpt: bad --gb '%s' (0.01..64)\n", argv[i]);
        return 2;
      }
    } else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
      long v = strtol(argv[++i], &end, 10);
      if (!end || *end || v < 1 || v > 16) {
        fprintf(stderr, "bench_ckpt: bad --rounds '%s' (1..16)\n", argv[i]);
        return 2;
      }
      rounds = (int)v;
    } else {
      usage();
      return 2;
    }
  }
  uint64_t nrows = (uint64_t)(gb * 1e9 / ROW_BYTES);
  double state = (double)nrows * ROW_BYTES;

  snprintf(g_dir, sizeof g_dir, "/tmp/pshard-bench-ckpt-XXXXXX");
  if (!mkdtemp(g_dir)) {
    g_dir[0] = 0;
    die("mkdtemp");
  }
  atexit(cleanup);
  char ckdir[128], keep[16];
  snprintf(ckdir, sizeof ckdir, "%s/ckpt", g_dir);
  if (mkdir(ckdir, 0755)) die("mkdir of the checkpoint directory");

  printf("# bench_ckpt: sparse async table, %llu rows x dim %u, adagrad: %.3f GB of state (parameters + "
         "accumulators, %u B a row); one server process, one worker; checkpoint directory under %s\n",
         (unsigned long long)nrows, DIM, state / 1e9, ROW_BYTES, g_dir);
  printf("# %d rounds of: %.0f s of pushes of %u uniform keys back to back, ps_checkpoint from a second thread, "
         "pushes until it returns, %.0f s more\n",
         rounds, PRE_S, PUSH_KEYS, POST_S);
  fflush(stdout);

  /* The checkpoint file holds a key beside every row, plus block headers. */
  size_t file_guess = (size_t)nrows * (ROW_BYTES + 8);
  double disk0 = disk_gbps(g_dir, file_guess);

  /* The scheduler reads its checkpoint directory and how many to keep from the
   * environment it inherits; keep every round's checkpoint so no removal is timed. */
  snprintf(keep, sizeof keep, "%d", rounds + 2);
  setenv("PSHARD_CHECKPOINT_DIR", ckdir, 1);
  setenv("PSHARD_CHECKPOINT_KEEP", keep, 1);
  bench_cluster_start(&g_cluster, 1, 1, "auto");
  g_cluster_up = 1;
  unsetenv("PSHARD_CHECKPOINT_DIR");
  unsetenv("PSHARD_CHECKPOINT_KEEP");
  ps_ctx *ctx = bench_open(&g_cluster, 0, 1, "auto", "async");
  uint32_t tid;
  char opts[96];
  snprintf(opts, sizeof opts, "opt=adagrad lr=%g mode=async init=uniform:0.01", (double)LR);
  bench_check(ps_table_declare(ctx, "ckpt", PS_SPARSE, DIM, opts, &tid), "declare");

  uint64_t *keys = malloc(FILL_BATCH * sizeof *keys);
  float *g = malloc((size_t)FILL_BATCH * DIM * sizeof *g);
  if (!keys || !g) die("out of memory");
  for (size_t i = 0; i < (size_t)FILL_BATCH * DIM; i++) g[i] = GRAD;
  double tf0 = bench_now();
  for (uint64_t base = 0; base < nrows; base += FILL_BATCH) {
    size_t n = nrows - base < FILL_BATCH ? (size_t)(nrows - base) : FILL_BATCH;
    for (size_t i = 0; i < n; i++) keys[i] = key_of(base + i);
    bench_check(ps_push(ctx, tid, keys, n, g, 1, -1, -1), "fill push");
  }
  double fill_s = bench_now() - tf0;
  char stats[8192];
  bench_check(ps_server_stats(ctx, 0, stats, sizeof stats, -1), "ps_server_stats");
  double payload = bench_stat_value(stats, "payload_bytes");
  size_t rss = bench_rss(g_cluster.server_pid[0]);
  printf("# filled in %.1f s; server: payload_bytes %.0f (%.3f GB), rss %.3f GB\n", fill_s, payload, payload / 1e9,
         (double)rss / 1e9);
  fflush(stdout);

  spans ps_sp = {0};
  uint64_t rng = 1;
  double w0[16], w1[16], file_gb[16];
  for (int r = 0; r < rounds; r++) {
    for (double t0 = bench_now(); bench_now() - t0 < PRE_S;) timed_push(ctx, tid, nrows, &rng, keys, g, &ps_sp);
    ckpt_thread k = {.ctx = ctx};
    pthread_t th;
    if (pthread_create(&th, NULL, ckpt_main, &k)) die("pthread_create");
    while (!atomic_load(&k.done)) timed_push(ctx, tid, nrows, &rng, keys, g, &ps_sp);
    pthread_join(th, NULL);
    if (k.rc) {
      fprintf(stderr, "bench_ckpt: ps_checkpoint failed: %s\n", k.err);
      exit(1);
    }
    w0[r] = k.t_req;
    w1[r] = k.t_done;
    char fpath[192];
    struct stat st;
    snprintf(fpath, sizeof fpath, "%s/ckpt-%llu/server-0.psck", ckdir, (unsigned long long)k.id);
    file_gb[r] = stat(fpath, &st) == 0 ? (double)st.st_size / 1e9 : NAN;
    printf("checkpoint %llu: request to durable manifest %.3f s; file %.3f GB: %.3f GB/s of file, %.3f GB/s of "
           "state\n",
           (unsigned long long)k.id, k.t_done - k.t_req, file_gb[r], file_gb[r] / (k.t_done - k.t_req),
           state / 1e9 / (k.t_done - k.t_req));
    fflush(stdout);
    for (double t0 = bench_now(); bench_now() - t0 < POST_S;) timed_push(ctx, tid, nrows, &rng, keys, g, &ps_sp);
  }
  /* The same checkpoint with no pushes: what the writer takes without the push stream. */
  double idle_s;
  {
    uint64_t id;
    double t0 = bench_now();
    bench_check(ps_checkpoint(ctx, &id, 600000), "ps_checkpoint (idle)");
    idle_s = bench_now() - t0;
    printf("checkpoint %llu, no pushes meanwhile: request to durable manifest %.3f s\n", (unsigned long long)id,
           idle_s);
  }
  ps_ctx_close(ctx);
  g_cluster_up = 0;
  bench_cluster_stop(&g_cluster);
  free(keys);
  free(g);

  /* The checkpoints' files go first: the disk is measured on the same free space. */
  char cmd[160];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", ckdir);
  if (system(cmd)) fprintf(stderr, "bench_ckpt: could not remove %s\n", ckdir);
  double disk1 = disk_gbps(g_dir, file_guess);

  lat pl;
  lat_split(&ps_sp, w0, w1, rounds, &pl);
  double rate = pl.nout ? (double)pl.nout / (sum_d(pl.out, pl.nout) / 1e3) : 0;
  double dur[16], fgb[16];
  for (int r = 0; r < rounds; r++) {
    dur[r] = w1[r] - w0[r];
    fgb[r] = file_gb[r];
  }
  double dur_med = bench_median(dur, (size_t)rounds), fgb_med = bench_median(fgb, (size_t)rounds);

  fork_result fr;
  run_fork(g_dir, nrows, rounds, rate, &fr);
  double fdur_med = bench_median(fr.durable_s, (size_t)rounds);
  double disk2 = disk_gbps(g_dir, file_guess), dv[3] = {disk0, disk1, disk2};
  double disk = bench_median(dv, 3);

  printf("\ndisk: %.3f GB written in 1 MiB blocks + fsync (as dd conv=fsync), same directory: %.3f GB/s before "
         "pshard, %.3f between pshard and the fork comparison, %.3f after; median %.3f GB/s\n",
         (double)file_guess / 1e9, disk0, disk1, disk2, disk);
  printf("\npush latency, ms (%u keys a push; pshard %.0f pushes/s outside a checkpoint; the fork comparison "
         "paced to that rate)\n",
         PUSH_KEYS, rate);
  printf("  %-34s %8s %10s %10s %10s\n", "", "n", "p50", "p99", "max");
  double p99_out = bench_pct(pl.out, pl.nout, 99), p99_in = bench_pct(pl.in, pl.nin, 99);
  double max_in = bench_pct(pl.in, pl.nin, 100);
  print_lat_row("pshard, outside a checkpoint", pl.out, pl.nout);
  print_lat_row("pshard, during a checkpoint", pl.in, pl.nin);
  double fp99_out = bench_pct(fr.l.out, fr.l.nout, 99), fp99_in = bench_pct(fr.l.in, fr.l.nin, 99);
  double fmax_in = bench_pct(fr.l.in, fr.l.nin, 100);
  print_lat_row("fork snapshot, outside one", fr.l.out, fr.l.nout);
  print_lat_row("fork snapshot, during one", fr.l.in, fr.l.nin);
  printf("  (the fork snapshot's \"during\" counts the fork() call itself, at most %.3f ms)\n", fr.fork_call_ms_max);

  double tgt_s = 3.0 * state / 1e9;
  printf("\nagainst the targets (%.3f GB of state)\n", state / 1e9);
  printf("  %-44s %10.2f x   target <= 2     %s\n", "pshard p99 during / outside", p99_in / p99_out,
         verdict(p99_in <= 2 * p99_out));
  printf("  %-44s %10.1f ms  target <= 100   %s\n", "pshard longest stall (slowest push, during)", max_in,
         verdict(max_in <= 100));
  printf("  %-44s %10.3f s   target <= %.2f  %s\n", "pshard request to durable (median)", dur_med, tgt_s,
         verdict(dur_med <= tgt_s));
  printf("  %-44s %10.3f GB/s  = %.2f of the disk's %.3f GB/s\n", "pshard checkpoint file / durable time",
         fgb_med / dur_med, fgb_med / dur_med / disk, disk);
  printf("  %-44s %10.3f s   target <= %.2f  %s\n", "pshard request to durable, no pushes", idle_s, tgt_s,
         verdict(idle_s <= tgt_s));
  printf("  %-44s %10.2f x   target <= 2     %s\n", "fork p99 during / outside", fp99_in / fp99_out,
         verdict(fp99_in <= 2 * fp99_out));
  printf("  %-44s %10.1f ms  target <= 100   %s\n", "fork longest stall (slowest update, during)", fmax_in,
         verdict(fmax_in <= 100));
  printf("  %-44s %10.3f s   target <= %.2f  %s\n", "fork() to durable (median)", fdur_med, tgt_s,
         verdict(fdur_med <= tgt_s));
  printf("  %-44s %10.3f GB/s  = %.2f of the disk\n", "fork snapshot bytes / durable time",
         state / 1e9 / fdur_med, state / 1e9 / fdur_med / disk);
  printf("  %-44s %10.2f x\n", "pshard durable time / fork's", dur_med / fdur_med);
  printf("  %-44s %10.2f x\n", "pshard longest stall / fork's", max_in / fmax_in);
  free(pl.in);
  free(pl.out);
  free(fr.l.in);
  free(fr.l.out);
  free(ps_sp.v);
  return 0;
}
