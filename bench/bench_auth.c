/*
 * bench_auth.c - what the job secret's handshake costs a connection, against a plain
 * connect in the same run.
 *
 * One loop holds a listener on 127.0.0.1 (TCP, ephemeral port) and opens --connects
 * connections to it, one at a time, alternating between two modes so that drift on a
 * shared machine hits both alike:
 *   plain   no secret: the time from ps__connect_tcp to its callback (TCP connect)
 *   auth    a secret: the same, where the callback runs once the handshake is done
 *           (TCP connect + AUTH_HELLO, its reply, AUTH_PROOF, its reply: two round
 *           trips and four HMAC-SHA256s)
 * and then, on one connection of each mode, --pings STATS-sized control round trips
 * (a frame and its answer): after the handshake a frame costs what it did before (the
 * only addition is one comparison of the sender per frame on the accepting side).
 * Prints p50 / p90 / p99 in microseconds for each, and the ratio auth / plain.
 *
 * usage: bench_auth [--connects N] [--pings N]   (defaults 400, 4000)
 *
 * For the steady state of a whole job, run an existing benchmark twice, without and
 * with PSHARD_SECRET in its environment (docs/benchmarks.md, "Authentication").
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "common/common.h"
#include "net/auth.h"
#include "net/net.h"

typedef struct bench {
  uv_loop_t loop;
  ps__pool *pool;
  ps__listener l;
  ps__conn *in, *out;
  int connected, answered;
} bench;

static int b_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)c, (void)h, (void)b;
  return 0;
}
static void b_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  bench *x = c->udata;
  (void)b;
  if (!x) return;
  if (c == x->in) { /* the accepting side answers */
    ps__frame_hdr r = {.type = (uint8_t)(h->type | PS_FRAME_REPLY), .req_id = h->req_id};
    ps__conn_send_ctrl(c, &r, NULL, 0);
  } else {
    x->answered++;
  }
}
static void b_close(ps__conn *c, int status) {
  bench *x = c->udata;
  (void)status;
  if (x && c == x->in) x->in = NULL;
  if (x && c == x->out) x->out = NULL;
}
static const ps__conn_ops ops = {b_header, b_frame, b_close};

static void on_accept(void *arg, ps__conn *c) {
  bench *x = arg;
  c->udata = x;
  x->in = c;
}
static void on_connect(void *arg, ps__conn *c, int status) {
  bench *x = arg;
  if (status || !c) {
    fprintf(stderr, "bench_auth: connect failed: %s\n", ps_strerror(status));
    exit(1);
  }
  x->out = c;
  x->connected = 1;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static void pct(const char *what, uint64_t *ns, size_t n, double *p50) {
  qsort(ns, n, sizeof *ns, cmp_u64);
  *p50 = ns[n / 2] / 1e3;
  printf("  %-28s p50 %8.1f us   p90 %8.1f us   p99 %8.1f us   (n=%zu)\n", what, ns[n / 2] / 1e3,
         ns[n * 9 / 10] / 1e3, ns[n * 99 / 100] / 1e3, n);
}

/* One connection in the current mode: its connect time (ns). */
static uint64_t connect_once(bench *x) {
  x->connected = 0;
  uint64_t t0 = ps__now_ns();
  if (ps__connect_tcp(&x->loop, "127.0.0.1", x->l.port, &ops, x, x->pool, 1u << 20, on_connect, x)) {
    fprintf(stderr, "bench_auth: %s\n", ps_errmsg());
    exit(1);
  }
  while (!x->connected || !x->in) uv_run(&x->loop, UV_RUN_ONCE);
  return ps__now_ns() - t0;
}

static void drop(bench *x) {
  if (x->out) ps__conn_close(x->out, 0);
  if (x->in) ps__conn_close(x->in, 0);
  while (x->out || x->in) uv_run(&x->loop, UV_RUN_ONCE);
}

static void pings(bench *x, uint64_t *ns, size_t n) {
  for (size_t i = 0; i < n; i++) {
    ps__frame_hdr h = {.type = PS_MSG_STATS, .req_id = i + 1};
    int want = x->answered + 1;
    uint64_t t0 = ps__now_ns();
    ps__conn_send_ctrl(x->out, &h, NULL, 0);
    while (x->answered < want) uv_run(&x->loop, UV_RUN_ONCE);
    ns[i] = ps__now_ns() - t0;
  }
}

static void mode(int secret) {
  static const char key[] = "bench-secret-0123456789abcdef";
  ps__auth_reset();
  if (secret && ps__auth_set_secret(key, sizeof key - 1)) exit(1);
}

int main(int argc, char **argv) {
  size_t connects = 400, npings = 4000;
  for (int i = 1; i + 1 < argc; i += 2) {
    uint64_t v;
    if (ps__parse_u64(argv[i + 1], &v) || v < 10) {
      fprintf(stderr, "bench_auth: bad value '%s'\n", argv[i + 1]);
      return 2;
    }
    if (!strcmp(argv[i], "--connects")) connects = v;
    else if (!strcmp(argv[i], "--pings")) npings = v;
    else {
      fprintf(stderr, "usage: bench_auth [--connects N] [--pings N]\n");
      return 2;
    }
  }
  unsetenv("PSHARD_SECRET"); /* the two modes are set here, not by the environment */
  unsetenv("PSHARD_SECRET_FILE");
  bench x;
  memset(&x, 0, sizeof x);
  uv_loop_init(&x.loop);
  x.pool = ps__pool_new(1u << 20);
  mode(0);
  if (ps__listen_tcp(&x.l, &x.loop, "127.0.0.1", 0, &ops, on_accept, &x, x.pool, 1u << 20)) {
    fprintf(stderr, "bench_auth: %s\n", ps_errmsg());
    return 1;
  }
  uint64_t *plain = calloc(connects, sizeof *plain), *auth = calloc(connects, sizeof *auth);
  uint64_t *pp = calloc(npings, sizeof *pp), *pa = calloc(npings, sizeof *pa);
  if (!plain || !auth || !pp || !pa) return 1;
  for (size_t i = 0; i < connects; i++) {
    mode(0);
    plain[i] = connect_once(&x);
    drop(&x);
    mode(1);
    auth[i] = connect_once(&x);
    drop(&x);
  }
  mode(0);
  connect_once(&x);
  pings(&x, pp, npings);
  drop(&x);
  mode(1);
  connect_once(&x);
  pings(&x, pa, npings);
  drop(&x);
  double a50, p50, q50, r50;
  printf("bench_auth: loopback TCP, one loop, %zu connects and %zu round trips per mode\n", connects, npings);
  pct("connect (plain)", plain, connects, &p50);
  pct("connect + handshake (auth)", auth, connects, &a50);
  printf("  handshake adds %.1f us at p50 (x%.2f)\n", a50 - p50, a50 / p50);
  pct("round trip (plain)", pp, npings, &q50);
  pct("round trip (auth)", pa, npings, &r50);
  printf("  round trip auth / plain at p50: x%.3f\n", r50 / q50);
  ps__listener_close(&x.l);
  uv_run(&x.loop, UV_RUN_DEFAULT);
  uv_loop_close(&x.loop);
  ps__pool_free(x.pool);
  free(plain), free(auth), free(pp), free(pa);
  return 0;
}
