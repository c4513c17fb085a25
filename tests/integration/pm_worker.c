/*
 * pm_worker.c - large dense pushes and pulls, to compare peer memory with the socket.
 *
 * Every worker declares three dense tables of N floats (slices of 64Ki floats, spread
 * over the servers), all "opt=sgd init=zero lr=0.5":
 *   "sum"   mode=sync update=sum: whole-table pushes (a streamed peer-memory push on a
 *           same-host server), plus a range that starts and ends inside slices;
 *   "mean"  mode=sync update=mean, batch 4 (r+1): the batch-weighted mean;
 *   "async" mode=async: pushes applied one by one (a staged peer-memory push).
 * It runs --steps rounds: push to each table, clock, pull each whole table. The
 * gradients are dyadic (g_r[j] = (r+1) ((j mod 7) + 1) / 16, range: 1/8), so every sum
 * is exact in float32 in any order, and the results must not depend on the transport.
 * Rank 0 writes to --out, per table, the FNV-1a hash of the pulled bytes and a few
 * elements; every worker prints "peer_mem_parts N" (ps_ctx_stat) on stdout.
 * Options: --floats N (default 1.5M) --steps S (3) --out FILE --lag-ms L (rank 1 waits L
 * ms before each clock, so rank 0's pulls wait for the round at the servers: they are
 * then written by the round's fused update). Rank 0 also prints each server's
 * "fused_pulls N" (ps_server_stats).
 *
 * --hold FILE instead checks that a canceled peer-memory pull keeps the caller's buffer
 * while the server may still write into it: after one pull it prints "ready" and waits
 * for FILE to appear (the test stops the server meanwhile), starts a pull of table
 * "async", frees the request at once and prints "freed after MS ms" (it must block
 * until the request's deadline, timeout_ms), fills the buffer with a marker, prints
 * "released", and after 1.5 s (the test resumes the server meanwhile, which must find
 * the request expired) prints "intact" if the marker is still there, else "overwritten".
 * --shared 1: the gradient and pull buffers come from ps_alloc (shared with the servers of
 * the host, which then read and write them in place); rank 0 also prints each server's
 * "shared_requests N". --shared 2: the same, with new buffers from ps_alloc before every
 * push and pull (the old ones freed), so that the servers keep mapping new files and
 * dropping freed ones (more than the 64 a connection keeps).
 * Exit status: 0 success, 1 a pshard call failed, 2 bad usage.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pshard.h"

#define CHECK(call)                                                                            \
  do {                                                                                         \
    int rc_ = (call);                                                                          \
    if (rc_) {                                                                                 \
      fprintf(stderr, "pm_worker: %s failed: %s: %s\n", #call, ps_err_name(rc_), ps_errmsg()); \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

static uint64_t fnv(const void *p, size_t n) {
  const uint8_t *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* A new ps_alloc buffer with p's n floats; p freed. */
static float *renew(float *p, uint64_t n) {
  float *q = ps_alloc(n * 4);
  if (!q) {
    fprintf(stderr, "pm_worker: ps_alloc failed: %s\n", ps_errmsg());
    exit(1);
  }
  memcpy(q, p, n * 4);
  ps_free(p);
  return q;
}

int main(int argc, char **argv) {
  uint64_t n = 1536u << 10;
  int steps = 3;
  const char *out = NULL, *hold = NULL;
  int lag_ms = 0, shared = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--floats")) n = strtoull(argv[i + 1], NULL, 10);
    else if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--out")) out = argv[i + 1];
    else if (!strcmp(argv[i], "--hold")) hold = argv[i + 1];
    else if (!strcmp(argv[i], "--lag-ms")) lag_ms = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--shared")) shared = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "pm_worker: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (argc % 2 == 0 || n < 200000) {
    fprintf(stderr, "pm_worker: options come in pairs; --floats at least 200000\n");
    return 2;
  }
  ps_ctx *ctx;
  CHECK(ps_ctx_open_env(&ctx));
  int r = ps_ctx_rank(ctx);
  const char *names[3] = {"sum", "mean", "async"};
  const char *opts[3] = {"opt=sgd init=zero lr=0.5 mode=sync update=sum",
                         "opt=sgd init=zero lr=0.5 mode=sync update=mean",
                         "opt=sgd init=zero lr=0.5 mode=async"};
  uint32_t tid[3];
  for (int t = 0; t < 3; t++) CHECK(ps_table_declare(ctx, names[t], PS_DENSE, n, opts[t], &tid[t]));
  float *g = shared ? ps_alloc(n * 4) : malloc(n * 4), *w = shared ? ps_alloc(n * 4) : malloc(n * 4);
  if (!g || !w) return 1;
  for (uint64_t j = 0; j < n; j++) g[j] = (float)((r + 1) * (int)(j % 7 + 1)) / 16.0f;
  if (hold) {
    CHECK(ps_pull_range(ctx, tid[2], 0, n, w, -1));
    printf("ready\n");
    fflush(stdout);
    for (int i = 0; i < 3000; i++) { /* 30 s at most */
      FILE *f = fopen(hold, "r");
      if (f) {
        fclose(f);
        break;
      }
      struct timespec ts = {0, 10000000};
      nanosleep(&ts, NULL);
    }
    ps_req *req;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CHECK(ps_pull_range_start(ctx, tid[2], 0, n, w, &req));
    ps_req_free(req);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("freed after %.0f ms\n", (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6);
    for (uint64_t j = 0; j < n; j++) w[j] = 12345.0f;
    printf("released\n");
    fflush(stdout);
    struct timespec ts = {1, 500000000};
    nanosleep(&ts, NULL);
    uint64_t bad = 0;
    for (uint64_t j = 0; j < n; j++) bad += w[j] != 12345.0f;
    printf("%s\n", bad ? "overwritten" : "intact");
    double parts = 0;
    CHECK(ps_ctx_stat(ctx, "peer_mem_parts", &parts));
    printf("peer_mem_parts %.0f\n", parts);
    fflush(stdout);
    free(g);
    free(w);
    ps_ctx_close(ctx);
    return 0;
  }
  uint64_t lo = 1000, cnt = n - 100000; /* starts and ends inside a slice */
  CHECK(ps_barrier(ctx, -1));
  uint64_t h[3] = {0};
  for (int s = 0; s < steps; s++) {
    if (shared == 2) g = renew(g, n), w = renew(w, n);
    CHECK(ps_push_range(ctx, tid[0], 0, n, g, 1, -1, -1));
    CHECK(ps_push_range(ctx, tid[0], lo, cnt, g + lo, 1, -1, -1));
    CHECK(ps_push_range(ctx, tid[1], 0, n, g, (uint32_t)(4 * (r + 1)), -1, -1));
    CHECK(ps_push_range(ctx, tid[2], 0, n, g, 1, -1, -1));
    if (r == 1 && lag_ms > 0) {
      struct timespec ts = {lag_ms / 1000, (long)(lag_ms % 1000) * 1000000L};
      nanosleep(&ts, NULL);
    }
    CHECK(ps_clock(ctx));
    for (int t = 0; t < 3; t++) {
      if (shared == 2) w = renew(w, n);
      CHECK(ps_pull_range(ctx, tid[t], 0, n, w, -1));
      h[t] = fnv(w, n * 4);
    }
  }
  CHECK(ps_barrier(ctx, -1)); /* every async push is in */
  double parts = 0, sparts = 0;
  CHECK(ps_ctx_stat(ctx, "peer_mem_parts", &parts));
  CHECK(ps_ctx_stat(ctx, "shared_parts", &sparts));
  printf("peer_mem_parts %.0f\nshared_parts %.0f\n", parts, sparts);
  for (int i = 0; r == 0 && i < ps_ctx_num_servers(ctx); i++) {
    char st[4096];
    CHECK(ps_server_stats(ctx, i, st, sizeof st, -1));
    const char *f = strstr(st, "fused_pulls ");
    printf("server %d fused_pulls %lld\n", i, f ? atoll(f + 12) : -1LL);
    const char *sh = strstr(st, "shared_requests ");
    printf("server %d shared_requests %lld\n", i, sh ? atoll(sh + 16) : -1LL);
  }
  fflush(stdout);
  if (r == 0 && out) {
    FILE *f = fopen(out, "w");
    if (!f) return 1;
    for (int t = 0; t < 3; t++) {
      CHECK(ps_pull_range(ctx, tid[t], 0, n, w, -1));
      if (t < 2 && fnv(w, n * 4) != h[t]) {
        fprintf(stderr, "pm_worker: table %s changed after its last round\n", names[t]);
        return 1;
      }
      h[t] = fnv(w, n * 4); /* async: after every push (the barrier) */
      fprintf(f, "%s %016llx %.9g %.9g %.9g %.9g\n", names[t], (unsigned long long)h[t], w[0], w[lo], w[n / 2],
              w[n - 1]);
    }
    fclose(f);
  }
  if (shared) {
    ps_free(g);
    ps_free(w);
  } else {
    free(g);
    free(w);
  }
  ps_ctx_close(ctx);
  return 0;
}
