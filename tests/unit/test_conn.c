/*
 * test_conn.c - the connection layer's write paths, and what a dense pull reply holds.
 *
 * ps__conn_send_now borrows its payload regions only for the call: what the socket
 * takes at once goes straight from them, the rest is copied. The conn tests wrap one end
 * of an AF_UNIX socketpair (with a small send buffer, so most of a large frame is left
 * over) in a ps__conn on a private loop, overwrite and free the regions right after the
 * call, and read the other end raw: the frame must carry the regions as they were, in
 * order with the frames around it. The server tests run a job in this process and check
 * that a dense pull answered from the parameter rows never holds a later push's update.
 * Every loop is bounded.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "common/common.h"
#include "net/net.h"
#include "proto/frame.h"
#include "pshard.h"

#define OK(call)                                                                                    \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, 0), "%s -> %s: %s", #call, ps_err_name(rc_), ps_errmsg());               \
  } while (0)

/* ---------------------------------------------------------------- a conn on one end of a socketpair */

typedef struct rig {
  uv_loop_t loop;
  ps__pool *pool;
  ps__conn *conn;
  int peer;        /* the raw other end, non-blocking */
  int closed;
  uint8_t *got;    /* bytes read from the peer end */
  size_t ngot, cap;
} rig;

static int no_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)c, (void)h, (void)b;
  return PS_ERR_PROTO;
}
static void no_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) { (void)c, (void)h, (void)b; }
static void on_close(ps__conn *c, int status) {
  rig *r = c->udata;
  (void)status;
  r->closed = 1;
}
static const ps__conn_ops rig_ops = {no_header, no_frame, on_close};

static void rig_open(rig *r, int sndbuf) {
  int fds[2];
  memset(r, 0, sizeof *r);
  cr_assert(eq(int, uv_loop_init(&r->loop), 0));
  cr_assert(eq(int, socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0));
  r->pool = ps__pool_new(64u << 20);
  r->conn = ps__conn_alloc(&r->loop, &rig_ops, r, r->pool, 1u << 30);
  cr_assert(r->pool && r->conn);
  cr_assert(eq(int, uv_pipe_init(&r->loop, &r->conn->h.pipe, 0), 0));
  cr_assert(eq(int, uv_pipe_open(&r->conn->h.pipe, fds[0]), 0));
  r->conn->is_unix = 1;
  OK(ps__conn_start(r->conn));
  int cur = 0, want = 2 << 20;
  long wmem_max = 0;
  FILE *fp = fopen("/proc/sys/net/core/wmem_max", "r");
  if (fp) {
    if (fscanf(fp, "%ld", &wmem_max) == 1 && 2 * wmem_max < want) want = (int)(2 * wmem_max);
    fclose(fp);
  }
  cr_assert(eq(int, uv_send_buffer_size(&r->conn->h.handle, &cur), 0));
  if (wmem_max > 0) cr_assert(ge(int, cur, want), "ps__conn_start leaves an AF_UNIX send buffer of %d bytes", cur);
  /* after ps__conn_start, which raises it */
  if (sndbuf) cr_assert(eq(int, setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf), 0));
  r->peer = fds[1];
  cr_assert(eq(int, fcntl(r->peer, F_SETFL, O_NONBLOCK), 0));
}

/* Run the loop and read the peer end until `want` bytes arrived in all. */
static void rig_drain(rig *r, size_t want) {
  if (r->cap < want) {
    r->got = realloc(r->got, want);
    r->cap = want;
    cr_assert(r->got != NULL);
  }
  for (long spins = 0; r->ngot < want; spins++) {
    cr_assert(lt(long, spins, 10000000L), "stuck after %zu of %zu bytes", r->ngot, want);
    uv_run(&r->loop, UV_RUN_NOWAIT);
    ssize_t n = read(r->peer, r->got + r->ngot, want - r->ngot);
    int again = n >= 0 || errno == EAGAIN || errno == EWOULDBLOCK;
    cr_assert(again, "read: %s", strerror(errno));
    if (n > 0) r->ngot += (size_t)n;
  }
  uv_run(&r->loop, UV_RUN_NOWAIT); /* write callbacks */
}

static void rig_close(rig *r) {
  ps__conn_close(r->conn, 0);
  uv_run(&r->loop, UV_RUN_DEFAULT);
  cr_assert(r->closed);
  cr_assert(eq(int, uv_loop_close(&r->loop), 0));
  ps__pool_free(r->pool);
  close(r->peer);
  free(r->got);
}

static uint8_t pattern(size_t i) { return (uint8_t)(i * 2654435761u >> 13); }

/* A frame of `nregions` regions (every fifth empty) totalling about `bytes`; the regions
 * are overwritten and freed as soon as ps__conn_send_now returns. A control frame goes
 * out before and after it. */
static void check_send_now(int sndbuf, unsigned nregions, size_t bytes) {
  rig r;
  rig_open(&r, sndbuf);
  uv_buf_t *v = calloc(nregions, sizeof *v);
  size_t total = 0;
  cr_assert(v != NULL);
  for (unsigned i = 0; i < nregions; i++) {
    size_t len = i % 5 == 4 ? 0 : (bytes / nregions / 4 + i % 13) * 4; /* whole floats */
    v[i] = uv_buf_init(malloc(len ? len : 1), 0);
    v[i].len = len;
    for (size_t k = 0; k < len; k++) v[i].base[k] = (char)pattern(total + k);
    total += len;
  }
  ps__frame_hdr a = {.type = PS_MSG_STATS | PS_FRAME_REPLY, .req_id = 1};
  ps__frame_hdr h = {.type = PS_MSG_PULL_DENSE | PS_FRAME_REPLY, .req_id = 2, .table = 3, .clock = 4};
  ps__frame_hdr b = {.type = PS_MSG_STATS | PS_FRAME_REPLY, .req_id = 3};
  OK(ps__conn_send_ctrl(r.conn, &a, "before", 6));
  OK(ps__conn_send_now(r.conn, &h, v, nregions));
  for (unsigned i = 0; i < nregions; i++) {
    memset(v[i].base, 0xee, v[i].len);
    free(v[i].base);
  }
  free(v);
  OK(ps__conn_send_ctrl(r.conn, &b, "after", 5));
  size_t want = 3 * PS_FRAME_HDR_SIZE + 6 + total + 5;
  rig_drain(&r, want);

  ps__frame_hdr g;
  const uint8_t *p = r.got;
  OK(ps__frame_decode(p, 1u << 30, &g));
  cr_assert(eq(u64, g.req_id, 1));
  cr_assert(eq(int, memcmp(p + PS_FRAME_HDR_SIZE, "before", 6), 0));
  p += PS_FRAME_HDR_SIZE + 6;
  OK(ps__frame_decode(p, 1u << 30, &g));
  cr_assert(eq(u64, g.req_id, 2));
  cr_assert(eq(u32, g.table, 3));
  cr_assert(eq(u64, g.payload_len, total));
  p += PS_FRAME_HDR_SIZE;
  for (size_t k = 0; k < total; k++)
    cr_assert(eq(u8, p[k], pattern(k)), "payload byte %zu of %zu: the frame changed after the call", k, total);
  p += total;
  OK(ps__frame_decode(p, 1u << 30, &g));
  cr_assert(eq(u64, g.req_id, 3));
  cr_assert(eq(int, memcmp(p + PS_FRAME_HDR_SIZE, "after", 5), 0));
  cr_assert(eq(u64, r.conn->frames_out, 3));
  cr_assert(eq(u64, r.conn->bytes_out, want));
  cr_assert(eq(sz, r.conn->write_queue_bytes, 0));
  rig_close(&r);
}

Test(conn, send_now_small_socket_buffer_copies_the_rest) { check_send_now(16 << 10, 37, 3u << 20); }

Test(conn, send_now_many_regions) { check_send_now(64 << 10, 2500, 8u << 20); }

Test(conn, send_now_fits_at_once) { check_send_now(0, 3, 20000); }

Test(conn, send_now_empty_payload) { check_send_now(0, 0, 0); }

/* A frame sent with ps__conn_send_now while an earlier frame still waits in the queue
 * goes after it, whole. */
Test(conn, send_now_behind_a_queued_frame) {
  rig r;
  rig_open(&r, 16 << 10);
  size_t big = 2u << 20;
  uint8_t *first = malloc(big), *second = malloc(big);
  cr_assert(first && second);
  for (size_t k = 0; k < big; k++) first[k] = 1, second[k] = (uint8_t)pattern(k);
  uv_buf_t b1 = uv_buf_init((char *)first, (unsigned)big);
  uv_buf_t b2 = uv_buf_init((char *)second, (unsigned)big);
  ps__frame_hdr h1 = {.type = PS_MSG_PULL | PS_FRAME_REPLY, .req_id = 1};
  ps__frame_hdr h2 = {.type = PS_MSG_PULL | PS_FRAME_REPLY, .req_id = 2};
  OK(ps__conn_send(r.conn, &h1, &b1, 1, NULL, NULL)); /* borrowed until written */
  cr_assert(gt(sz, r.conn->write_queue_bytes, 0));
  OK(ps__conn_send_now(r.conn, &h2, &b2, 1));
  memset(second, 0xee, big);
  rig_drain(&r, 2 * (PS_FRAME_HDR_SIZE + big));
  ps__frame_hdr g;
  OK(ps__frame_decode(r.got, 1u << 30, &g));
  cr_assert(eq(u64, g.req_id, 1));
  const uint8_t *p = r.got + PS_FRAME_HDR_SIZE + big;
  OK(ps__frame_decode(p, 1u << 30, &g));
  cr_assert(eq(u64, g.req_id, 2));
  for (size_t k = 0; k < big; k++) cr_assert(eq(u8, p[PS_FRAME_HDR_SIZE + k], pattern(k)), "byte %zu", k);
  free(first);
  free(second);
  rig_close(&r);
}

Test(conn, send_now_on_a_closed_conn_fails) {
  rig r;
  rig_open(&r, 0);
  ps__conn_close(r.conn, 0);
  char x[8] = {0};
  uv_buf_t b = uv_buf_init(x, sizeof x);
  ps__frame_hdr h = {.type = PS_MSG_PULL | PS_FRAME_REPLY, .req_id = 1};
  cr_assert(eq(int, ps__conn_send_now(r.conn, &h, &b, 1), PS_ERR_CLOSED));
  uv_run(&r.loop, UV_RUN_DEFAULT);
  cr_assert(r.closed);
  cr_assert(eq(int, uv_loop_close(&r.loop), 0));
  ps__pool_free(r.pool);
  close(r.peer);
}

/* ---------------------------------------------------------------- a connect cut by a loop's teardown */

typedef struct connect_seen {
  int calls, status;
  ps__conn *conn;
} connect_seen;

static void note_connect(void *arg, ps__conn *c, int status) {
  connect_seen *s = arg;
  s->calls++;
  s->status = status;
  s->conn = c;
}

static void closed_quietly(ps__conn *c, int status) { (void)c, (void)status; }
static const ps__conn_ops connect_ops = {no_header, no_frame, closed_quietly};

static void close_every_handle(uv_handle_t *h, void *arg) {
  (void)arg;
  if (uv_is_closing(h)) return;
  if ((h->type == UV_TCP || h->type == UV_NAMED_PIPE) && h->data) {
    ps__conn_close(h->data, 0);
    return;
  }
  uv_close(h, NULL);
}

/* A context closed while its connect to the scheduler is still pending (ps_ctx_open
 * giving up at connect_timeout_ms) walks the loop and closes the connecting handle;
 * libuv then cancels the connect from inside that close. The connect callback must see
 * the failure once and must not close the handle a second time. (Regression test: the
 * second uv_close aborted the process, seen as a crash of ctx::open_errors.) */
Test(conn, connect_pending_at_teardown_fails_once) {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  cr_assert(eq(int, bind(lfd, (struct sockaddr *)&sa, sizeof sa), 0));
  cr_assert(eq(int, listen(lfd, 4), 0));
  cr_assert(eq(int, getsockname(lfd, (struct sockaddr *)&sa, &len), 0));
  for (int unix_path = 0; unix_path < 2; unix_path++) {
    uv_loop_t loop;
    cr_assert(eq(int, uv_loop_init(&loop), 0));
    ps__pool *pool = ps__pool_new(1u << 20);
    connect_seen seen = {0};
    char path[108] = "";
    if (unix_path) {
      snprintf(path, sizeof path, "/tmp/pshard-test-conn-%d.sock", (int)getpid());
      OK(ps__connect_unix(&loop, path, &connect_ops, NULL, pool, 1u << 20, note_connect, &seen));
    } else {
      OK(ps__connect_tcp(&loop, "127.0.0.1", ntohs(sa.sin_port), &connect_ops, NULL, pool, 1u << 20, note_connect, &seen));
    }
    uv_walk(&loop, close_every_handle, NULL); /* before the loop ever ran the connect */
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert(eq(int, seen.calls, 1));
    cr_assert(not(eq(int, seen.status, 0)));
    cr_assert(eq(ptr, seen.conn, NULL));
    cr_assert(eq(int, uv_loop_close(&loop), 0));
    ps__pool_free(pool);
  }
  close(lfd);
}

/* ---------------------------------------------------------------- dense pull replies from a server */

static ps_ctx *open_embedded(void) {
  ps_config *cfg;
  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "embedded", "1"));
  OK(ps_config_set(cfg, "workers", "1"));
  OK(ps_config_set(cfg, "timeout_ms", "20000"));
  OK(ps_config_set(cfg, "connect_timeout_ms", "10000"));
  ps_ctx *ctx = NULL;
  OK(ps_ctx_open(cfg, &ctx));
  ps_config_free(cfg);
  return ctx;
}

static void expect_all(const float *x, uint64_t n, float want, const char *what) {
  for (uint64_t i = 0; i < n; i++)
    cr_assert(eq(flt, x[i], want), "%s: element %llu of %llu is %g, expected %g", what, (unsigned long long)i,
              (unsigned long long)n, (double)x[i], (double)want);
}

/* A pull followed at once by a push on the same connection: the server answers the pull
 * before it applies the push, and the reply (larger than any socket buffer, so partly
 * copied) holds the rows as they were, not partly updated; the next pull sees the push
 * whole. Several slice layouts, including a range that starts and ends inside slices. */
Test(dense_reply, pull_then_push_never_tears) {
  ps_ctx *ctx = open_embedded();
  const uint64_t n = 6u << 20; /* 24 MiB of floats */
  const char *opts[] = {"opt=sgd lr=1 mode=async init=const:5", "opt=sgd lr=1 mode=async init=const:5 slice=1000",
                        "opt=momentum lr=1 momentum=0 mode=async init=const:5"};
  float *g = malloc(n * 4), *a = malloc(n * 4), *b = malloc(n * 4);
  cr_assert(g && a && b);
  for (uint64_t i = 0; i < n; i++) g[i] = 1.0f;
  for (unsigned k = 0; k < sizeof opts / sizeof opts[0]; k++) {
    char name[16];
    uint32_t tid;
    snprintf(name, sizeof name, "t%u", k);
    OK(ps_table_declare(ctx, name, PS_DENSE, n, opts[k], &tid));
    uint64_t off = k == 1 ? 333 : 0, cnt = k == 1 ? n - 1000 : n;
    for (int round = 0; round < 3; round++) {
      ps_req *pull, *push, *pull2;
      OK(ps_pull_range_start(ctx, tid, off, cnt, a, &pull));
      OK(ps_push_range_start(ctx, tid, off, cnt, g, 1, -1, &push));
      OK(ps_pull_range_start(ctx, tid, off, cnt, b, &pull2));
      OK(ps_req_wait(pull, 20000));
      OK(ps_req_wait(push, 20000));
      OK(ps_req_wait(pull2, 20000));
      ps_req_free(pull);
      ps_req_free(push);
      ps_req_free(pull2);
      expect_all(a, cnt, 5.0f - (float)round, "pull before the push");
      expect_all(b, cnt, 4.0f - (float)round, "pull after the push");
    }
  }
  free(g);
  free(a);
  free(b);
  ps_ctx_close(ctx);
}

/* A dense push is acknowledged first and applied a step at a time; whatever comes next
 * for the table finishes it first: a pull of other ranges, another push, a push of part
 * of the range followed by a pull of all of it. */
Test(dense_reply, pending_push_is_finished_before_other_requests) {
  ps_ctx *ctx = open_embedded();
  const uint64_t n = 4u << 20;
  float *g = malloc(n * 4), *a = malloc(n * 4);
  cr_assert(g && a);
  for (uint64_t i = 0; i < n; i++) g[i] = 1.0f;
  uint32_t tid;
  OK(ps_table_declare(ctx, "pend", PS_DENSE, n, "opt=sgd lr=1 mode=async init=const:5", &tid));
  ps_req *r1, *r2, *r3;

  OK(ps_push_range_start(ctx, tid, 0, n, g, 1, -1, &r1));
  OK(ps_pull_range_start(ctx, tid, 1000, n - 5000, a, &r2));
  OK(ps_req_wait(r1, 20000));
  OK(ps_req_wait(r2, 20000));
  ps_req_free(r1);
  ps_req_free(r2);
  expect_all(a, n - 5000, 4.0f, "pull of a sub-range after a push of all");

  OK(ps_push_range_start(ctx, tid, 0, n, g, 1, -1, &r1));
  OK(ps_push_range_start(ctx, tid, 0, n, g, 1, -1, &r2));
  OK(ps_pull_range_start(ctx, tid, 0, n, a, &r3));
  OK(ps_req_wait(r1, 20000));
  OK(ps_req_wait(r2, 20000));
  OK(ps_req_wait(r3, 20000));
  ps_req_free(r1);
  ps_req_free(r2);
  ps_req_free(r3);
  expect_all(a, n, 2.0f, "pull after two pushes");

  const uint64_t off = 70000, cnt = 200000;
  OK(ps_push_range_start(ctx, tid, off, cnt, g, 1, -1, &r1));
  OK(ps_pull_range_start(ctx, tid, 0, n, a, &r2));
  OK(ps_req_wait(r1, 20000));
  OK(ps_req_wait(r2, 20000));
  ps_req_free(r1);
  ps_req_free(r2);
  expect_all(a, off, 2.0f, "before the pushed part");
  expect_all(a + off, cnt, 1.0f, "the pushed part");
  expect_all(a + off + cnt, n - off - cnt, 2.0f, "after the pushed part");
  free(g);
  free(a);
  ps_ctx_close(ctx);
}
