/*
 * test_client_ckpt.c - the worker library's and the command's side of checkpoints,
 * against a fake scheduler.
 *
 * The fake scheduler listens on an ephemeral loopback port; each connection gets a
 * thread that reads frames with bounded polls. It answers HELLO with a start clock (as
 * the scheduler of a restored job does) and a MEMBERSHIP naming one server at its own
 * address (so the worker's server link lands on the fake too, which ignores what comes
 * there), records every CHECKPOINT request (its clock and req_id), and answers one
 * with a request id as told: the checkpoint's id and directory, an error, a malformed
 * body, or nothing. Covered: the worker's clock starts at the HELLO reply's,
 * ps_checkpoint (what it sends, the id it returns, the errors it passes on, its
 * deadline), checkpoint_every (fire-and-forget requests at multiples of N, from rank 0
 * only), the new configuration keys, and `pshard checkpoint HOST:PORT`. Every wait is
 * bounded.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "common/common.h"
#include "proto/frame.h"
#include "proto/msg.h"
#include "pshard.h"

#define OK(call)                                                                                    \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, 0), "%s -> %s: %s", #call, ps_err_name(rc_), ps_errmsg());               \
  } while (0)

#define FAILS(code, call)                                                                           \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, (code)), "%s -> %s (%s), expected %s", #call, ps_err_name(rc_), ps_errmsg(), \
              ps_err_name(code));                                                                   \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- the fake scheduler */

enum { ANSWER = 0, ANSWER_ERROR = 1, ANSWER_GARBAGE = 2, ANSWER_NOTHING = 3 };

#define MAX_CONNS 8
#define MAX_SEEN 64

typedef struct fake {
  int lfd, port;
  int64_t start_clock; /* the HELLO reply's clock */
  uint32_t rank;       /* the rank it gives */
  int mode;            /* how it answers a CHECKPOINT with a request id */
  int stop;            /* atomic */
  pthread_t acceptor, conn_thread[MAX_CONNS];
  int conn_fd[MAX_CONNS], nconns;
  pthread_mutex_t mu;  /* what it saw */
  int nseen;
  int64_t seen_clock[MAX_SEEN];
  uint64_t seen_req_id[MAX_SEEN];
} fake;

typedef struct conn_arg {
  fake *f;
  int fd;
} conn_arg;

static int read_full(fake *f, int fd, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    if (__atomic_load_n(&f->stop, __ATOMIC_RELAXED)) return -1;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 50) <= 0) continue;
    ssize_t k = recv(fd, (char *)buf + got, n - got, 0);
    if (k <= 0) return -1;
    got += (size_t)k;
  }
  return 0;
}

static void send_frame(int fd, ps__frame_hdr *h, const void *body, size_t len) {
  uint8_t hdr[PS_FRAME_HDR_SIZE];
  h->payload_len = len;
  ps__frame_encode(h, hdr);
  if (send(fd, hdr, sizeof hdr, MSG_NOSIGNAL) != (ssize_t)sizeof hdr) return;
  if (len) (void)send(fd, body, len, MSG_NOSIGNAL);
}

static void send_membership(fake *f, int fd) {
  ps__member mem[2];
  memset(mem, 0, sizeof mem);
  mem[0].id = 2;
  mem[0].role = PS_ROLE_SERVER;
  mem[0].alive = 1;
  mem[0].port = (uint16_t)f->port;
  snprintf(mem[0].host, sizeof mem[0].host, "127.0.0.1");
  mem[1].id = 5;
  mem[1].role = PS_ROLE_WORKER;
  mem[1].alive = 1;
  mem[1].rank = f->rank;
  ps__membership m = {.epoch = 1, .servers_expected = 1, .workers_expected = 1, .started = 1, .n = 2, .m = mem};
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__membership_encode(&w, &m);
  ps__frame_hdr h = {.type = PS_MSG_MEMBERSHIP, .epoch = 1};
  if (!w.oom) send_frame(fd, &h, w.data, w.len);
  ps__wbuf_free(&w);
}

static void answer_checkpoint(fake *f, int fd, const ps__frame_hdr *q) {
  ps__frame_hdr r = {.type = PS_MSG_CHECKPOINT | PS_FRAME_REPLY, .req_id = q->req_id,
                     .clock = q->clock < 0 ? 77 : q->clock};
  if (f->mode == ANSWER_NOTHING) return;
  if (f->mode == ANSWER_ERROR) {
    static const char msg[] = "the job has no checkpoint directory (start the scheduler with --checkpoint-dir)";
    r.status = PS_ERR_CONFIG;
    send_frame(fd, &r, msg, sizeof msg - 1);
    return;
  }
  if (f->mode == ANSWER_GARBAGE) {
    send_frame(fd, &r, "xy", 2);
    return;
  }
  ps__ckpt_info info = {.id = 3};
  snprintf(info.dir, sizeof info.dir, "/ck/ckpt-3");
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__ckpt_info_encode(&w, &info);
  if (!w.oom) send_frame(fd, &r, w.data, w.len);
  ps__wbuf_free(&w);
}

static void *conn_main(void *arg) {
  conn_arg ca = *(conn_arg *)arg;
  free(arg);
  fake *f = ca.f;
  uint8_t hb[PS_FRAME_HDR_SIZE];
  static __thread uint8_t body[1 << 16];
  while (read_full(f, ca.fd, hb, sizeof hb) == 0) {
    ps__frame_hdr h;
    if (ps__frame_decode(hb, 1u << 20, &h) || h.payload_len > sizeof body) break;
    if (h.payload_len && read_full(f, ca.fd, body, (size_t)h.payload_len)) break;
    if (h.type == PS_MSG_HELLO) {
      ps__frame_hdr r = {.type = PS_MSG_HELLO | PS_FRAME_REPLY, .req_id = h.req_id, .table = 5, .batch = f->rank,
                         .clock = f->start_clock};
      send_frame(ca.fd, &r, NULL, 0);
      send_membership(f, ca.fd);
    } else if (h.type == PS_MSG_CHECKPOINT) {
      pthread_mutex_lock(&f->mu);
      if (f->nseen < MAX_SEEN) {
        f->seen_clock[f->nseen] = h.clock;
        f->seen_req_id[f->nseen] = h.req_id;
        f->nseen++;
      }
      pthread_mutex_unlock(&f->mu);
      if (h.req_id) answer_checkpoint(f, ca.fd, &h);
    }
    /* Anything else (heartbeats, metrics, clocks on the server link, LEAVE): ignored. */
  }
  return NULL;
}

static void *accept_main(void *arg) {
  fake *f = arg;
  while (!__atomic_load_n(&f->stop, __ATOMIC_RELAXED) && f->nconns < MAX_CONNS) {
    struct pollfd p = {.fd = f->lfd, .events = POLLIN};
    if (poll(&p, 1, 50) <= 0) continue;
    int fd = accept(f->lfd, NULL, NULL);
    if (fd < 0) continue;
    conn_arg *ca = malloc(sizeof *ca);
    cr_assert(not(eq(ptr, ca, NULL)));
    ca->f = f;
    ca->fd = fd;
    f->conn_fd[f->nconns] = fd;
    cr_assert(eq(int, pthread_create(&f->conn_thread[f->nconns], NULL, conn_main, ca), 0));
    f->nconns++;
  }
  return NULL;
}

static void fake_start(fake *f, int64_t start_clock, uint32_t rank, int mode) {
  memset(f, 0, sizeof *f);
  f->start_clock = start_clock;
  f->rank = rank;
  f->mode = mode;
  pthread_mutex_init(&f->mu, NULL);
  f->lfd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert(ge(int, f->lfd, 0));
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  cr_assert(eq(int, bind(f->lfd, (struct sockaddr *)&sa, sizeof sa), 0));
  cr_assert(eq(int, getsockname(f->lfd, (struct sockaddr *)&sa, &len), 0));
  cr_assert(eq(int, listen(f->lfd, 16), 0));
  f->port = ntohs(sa.sin_port);
  cr_assert(eq(int, pthread_create(&f->acceptor, NULL, accept_main, f), 0));
}

static void fake_stop(fake *f) {
  __atomic_store_n(&f->stop, 1, __ATOMIC_RELAXED);
  pthread_join(f->acceptor, NULL);
  for (int i = 0; i < f->nconns; i++) {
    pthread_join(f->conn_thread[i], NULL);
    close(f->conn_fd[i]);
  }
  close(f->lfd);
  pthread_mutex_destroy(&f->mu);
}

static void fake_addr(const fake *f, char *out, size_t cap) { snprintf(out, cap, "127.0.0.1:%d", f->port); }

/* A worker of the fake's job; extra key/value (NULL: none). */
static ps_ctx *open_worker(const fake *f, const char *key, const char *value) {
  ps_config *cfg;
  ps_ctx *ctx = NULL;
  char addr[64];
  fake_addr(f, addr, sizeof addr);
  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "scheduler", addr));
  OK(ps_config_set(cfg, "transport", "tcp"));
  OK(ps_config_set(cfg, "timeout_ms", "5000"));
  OK(ps_config_set(cfg, "connect_timeout_ms", "5000"));
  OK(ps_config_set(cfg, "heartbeat_ms", "100"));
  if (key) OK(ps_config_set(cfg, key, value));
  OK(ps_ctx_open(cfg, &ctx));
  ps_config_free(cfg);
  return ctx;
}

static int seen(fake *f, int i, int64_t *clock, uint64_t *req_id) {
  pthread_mutex_lock(&f->mu);
  int n = f->nseen;
  if (i < n) {
    *clock = f->seen_clock[i];
    *req_id = f->seen_req_id[i];
  }
  pthread_mutex_unlock(&f->mu);
  return n;
}

/* ---------------------------------------------------------------- the start clock */

Test(ckpt, a_restored_job_starts_at_the_hello_reply_clock, .timeout = 30) {
  fake f;
  fake_start(&f, 40, 0, ANSWER);
  ps_ctx *ctx = open_worker(&f, NULL, NULL);
  cr_assert(eq(i64, ps_ctx_clock(ctx), 40), "the worker resumes at the checkpoint's clock");
  double v;
  OK(ps_ctx_stat(ctx, "clock", &v));
  cr_assert(eq(dbl, v, 40.0));
  OK(ps_clock(ctx));
  cr_assert(eq(i64, ps_ctx_clock(ctx), 41));
  ps_ctx_close(ctx);
  fake_stop(&f);
}

/* ---------------------------------------------------------------- ps_checkpoint */

Test(ckpt, checkpoint_asks_at_the_callers_clock_and_returns_the_id, .timeout = 30) {
  fake f;
  fake_start(&f, 40, 0, ANSWER);
  ps_ctx *ctx = open_worker(&f, NULL, NULL);
  OK(ps_clock(ctx));
  OK(ps_clock(ctx));
  uint64_t id = 0;
  OK(ps_checkpoint(ctx, &id, 5000));
  cr_assert(eq(u64, id, 3));
  int64_t clock = 0;
  uint64_t req_id = 0;
  cr_assert(eq(int, seen(&f, 0, &clock, &req_id), 1));
  cr_assert(eq(i64, clock, 42), "the cut clock is the caller's");
  cr_assert(ne(u64, req_id, 0), "a ps_checkpoint waits for the answer: it needs a request id");
  OK(ps_checkpoint(ctx, NULL, -1)); /* id may be NULL; the context's timeout */
  cr_assert(eq(int, seen(&f, 1, &clock, &req_id), 2));
  FAILS(PS_ERR_INVALID, ps_checkpoint(NULL, &id, 1000));
  ps_ctx_close(ctx);
  fake_stop(&f);
}

Test(ckpt, checkpoint_passes_the_schedulers_error_on, .timeout = 30) {
  fake f;
  fake_start(&f, 0, 0, ANSWER_ERROR);
  ps_ctx *ctx = open_worker(&f, NULL, NULL);
  uint64_t id = 99;
  FAILS(PS_ERR_CONFIG, ps_checkpoint(ctx, &id, 5000));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "no checkpoint directory"), NULL)), "message: %s", ps_errmsg());
  cr_assert(eq(u64, id, 99), "*id is left alone on an error");
  /* The context is still usable. */
  OK(ps_clock(ctx));
  ps_ctx_close(ctx);
  fake_stop(&f);
}

Test(ckpt, checkpoint_refuses_a_malformed_answer, .timeout = 30) {
  fake f;
  fake_start(&f, 0, 0, ANSWER_GARBAGE);
  ps_ctx *ctx = open_worker(&f, NULL, NULL);
  FAILS(PS_ERR_PROTO, ps_checkpoint(ctx, NULL, 5000));
  ps_ctx_close(ctx);
  fake_stop(&f);
}

Test(ckpt, checkpoint_gives_up_at_its_deadline, .timeout = 30) {
  fake f;
  fake_start(&f, 0, 0, ANSWER_NOTHING);
  ps_ctx *ctx = open_worker(&f, NULL, NULL);
  double t0 = now_s();
  FAILS(PS_ERR_TIMEOUT, ps_checkpoint(ctx, NULL, 300));
  double dt = now_s() - t0;
  cr_assert(ge(dbl, dt, 0.25), "returned after %.3f s", dt);
  cr_assert(lt(dbl, dt, 3.0), "returned after %.3f s", dt);
  ps_ctx_close(ctx);
  fake_stop(&f);
}

/* ---------------------------------------------------------------- checkpoint_every */

Test(ckpt, checkpoint_every_asks_at_multiples_of_n_without_waiting, .timeout = 30) {
  fake f;
  fake_start(&f, 0, 0, ANSWER);
  ps_ctx *ctx = open_worker(&f, "checkpoint_every", "3");
  for (int i = 0; i < 7; i++) OK(ps_clock(ctx));
  /* Frames to the scheduler keep their order: once this answer is back, the fake has
   * read every CHECKPOINT the clocks sent before it. */
  OK(ps_checkpoint(ctx, NULL, 5000));
  int64_t clock;
  uint64_t req_id;
  cr_assert(eq(int, seen(&f, 0, &clock, &req_id), 3), "clocks 3 and 6, then ps_checkpoint at 7");
  cr_assert(eq(i64, clock, 3));
  cr_assert(eq(u64, req_id, 0), "fire-and-forget");
  seen(&f, 1, &clock, &req_id);
  cr_assert(eq(i64, clock, 6));
  cr_assert(eq(u64, req_id, 0));
  seen(&f, 2, &clock, &req_id);
  cr_assert(eq(i64, clock, 7));
  cr_assert(ne(u64, req_id, 0));
  ps_ctx_close(ctx);
  fake_stop(&f);
}

Test(ckpt, checkpoint_every_counts_from_a_restored_clock, .timeout = 30) {
  fake f;
  fake_start(&f, 10, 0, ANSWER);
  ps_ctx *ctx = open_worker(&f, "checkpoint_every", "4");
  for (int i = 0; i < 3; i++) OK(ps_clock(ctx)); /* 11, 12, 13 */
  OK(ps_checkpoint(ctx, NULL, 5000));
  int64_t clock;
  uint64_t req_id;
  cr_assert(eq(int, seen(&f, 0, &clock, &req_id), 2));
  cr_assert(eq(i64, clock, 12));
  cr_assert(eq(u64, req_id, 0));
  ps_ctx_close(ctx);
  fake_stop(&f);
}

Test(ckpt, checkpoint_every_is_rank_zeros, .timeout = 30) {
  fake f;
  fake_start(&f, 0, 1, ANSWER);
  ps_ctx *ctx = open_worker(&f, "checkpoint_every", "1");
  cr_assert(eq(int, ps_ctx_rank(ctx), 1));
  for (int i = 0; i < 4; i++) OK(ps_clock(ctx));
  OK(ps_checkpoint(ctx, NULL, 5000));
  int64_t clock;
  uint64_t req_id;
  cr_assert(eq(int, seen(&f, 0, &clock, &req_id), 1), "only the explicit request");
  cr_assert(eq(i64, clock, 4));
  ps_ctx_close(ctx);
  fake_stop(&f);
}

/* ---------------------------------------------------------------- configuration */

Test(ckpt, configuration_keys, .timeout = 30) {
  ps_config *cfg;
  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "checkpoint_every", "0"));
  OK(ps_config_set(cfg, "checkpoint_every", "100"));
  FAILS(PS_ERR_CONFIG, ps_config_set(cfg, "checkpoint_every", "often"));
  FAILS(PS_ERR_CONFIG, ps_config_set(cfg, "checkpoint_every", "-1"));
  FAILS(PS_ERR_CONFIG, ps_config_set(cfg, "checkpoint_every", "2000000000"));
  cr_assert(eq(str, (char *)ps_config_get(cfg, "checkpoint_every"), "100"), "unchanged after errors");
  OK(ps_config_set(cfg, "checkpoint_keep", "5"));
  FAILS(PS_ERR_CONFIG, ps_config_set(cfg, "checkpoint_keep", "five"));
  /* Directories longer than the host-name limit are fine; longer than a frame's are not. */
  char dir[1100];
  memset(dir, 'd', sizeof dir);
  dir[0] = '/';
  dir[200] = '\0';
  OK(ps_config_set(cfg, "checkpoint_dir", dir));
  OK(ps_config_set(cfg, "restore", dir));
  cr_assert(eq(str, (char *)ps_config_get(cfg, "restore"), dir));
  dir[200] = 'd';
  dir[1099] = '\0';
  FAILS(PS_ERR_CONFIG, ps_config_set(cfg, "checkpoint_dir", dir));
  FAILS(PS_ERR_CONFIG, ps_config_set(cfg, "restore", ""));
  ps_config_free(cfg);

  OK(ps_config_new(&cfg));
  setenv("PSHARD_CHECKPOINT_EVERY", "7", 1);
  setenv("PSHARD_CHECKPOINT_DIR", "/var/ckpt", 1);
  setenv("PSHARD_RESTORE", "/var/ckpt", 1);
  setenv("PSHARD_CHECKPOINT_KEEP", "2", 1);
  OK(ps_config_from_env(cfg));
  cr_assert(eq(str, (char *)ps_config_get(cfg, "checkpoint_every"), "7"));
  cr_assert(eq(str, (char *)ps_config_get(cfg, "checkpoint_dir"), "/var/ckpt"));
  cr_assert(eq(str, (char *)ps_config_get(cfg, "restore"), "/var/ckpt"));
  cr_assert(eq(str, (char *)ps_config_get(cfg, "checkpoint_keep"), "2"));
  setenv("PSHARD_CHECKPOINT_EVERY", "sometimes", 1);
  FAILS(PS_ERR_CONFIG, ps_config_from_env(cfg));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "PSHARD_CHECKPOINT_EVERY"), NULL)), "message: %s", ps_errmsg());
  unsetenv("PSHARD_CHECKPOINT_EVERY");
  unsetenv("PSHARD_CHECKPOINT_DIR");
  unsetenv("PSHARD_RESTORE");
  unsetenv("PSHARD_CHECKPOINT_KEEP");
  ps_config_free(cfg);
}

/* ---------------------------------------------------------------- pshard checkpoint */

/* Run the command with its stdout and stderr into out (NUL-terminated). Its status. */
static int run_trigger(int argc, char **argv, char *out, size_t cap) {
  char path[] = "/tmp/pshard-test-trigger-XXXXXX";
  int fd = mkstemp(path);
  cr_assert(ge(int, fd, 0));
  unlink(path);
  fflush(stdout);
  fflush(stderr);
  int o1 = dup(1), o2 = dup(2);
  dup2(fd, 1);
  dup2(fd, 2);
  int rc = ps_cli_checkpoint_trigger(argc, argv);
  fflush(stdout);
  fflush(stderr);
  dup2(o1, 1);
  dup2(o2, 2);
  close(o1);
  close(o2);
  ssize_t n = pread(fd, out, cap - 1, 0);
  out[n > 0 ? n : 0] = '\0';
  close(fd);
  return rc;
}

Test(ckpt, the_checkpoint_command, .timeout = 30) {
  fake f;
  char addr[64], out[4096];
  fake_start(&f, 0, 0, ANSWER);
  fake_addr(&f, addr, sizeof addr);
  char *ok_argv[] = {"checkpoint", addr, "--timeout", "5000", NULL};
  cr_assert(eq(int, run_trigger(4, ok_argv, out, sizeof out), 0), "output: %s", out);
  cr_assert(eq(str, out, "checkpoint 3 at clock 77 in /ck/ckpt-3\n"));
  int64_t clock;
  uint64_t req_id;
  cr_assert(eq(int, seen(&f, 0, &clock, &req_id), 1));
  cr_assert(eq(i64, clock, -1), "the command lets the scheduler pick the clock");
  cr_assert(ne(u64, req_id, 0));
  fake_stop(&f);

  fake_start(&f, 0, 0, ANSWER_ERROR);
  fake_addr(&f, addr, sizeof addr);
  char *err_argv[] = {"checkpoint", addr, NULL};
  cr_assert(eq(int, run_trigger(2, err_argv, out, sizeof out), 1));
  cr_assert(not(eq(ptr, strstr(out, "no checkpoint directory"), NULL)), "output: %s", out);
  fake_stop(&f);

  fake_start(&f, 0, 0, ANSWER_NOTHING);
  fake_addr(&f, addr, sizeof addr);
  char *slow_argv[] = {"checkpoint", "--timeout", "300", addr, NULL};
  double t0 = now_s();
  cr_assert(eq(int, run_trigger(4, slow_argv, out, sizeof out), 1));
  cr_assert(lt(dbl, now_s() - t0, 3.0));
  fake_stop(&f);
}

Test(ckpt, the_checkpoint_command_refuses_bad_usage, .timeout = 30) {
  char out[4096];
  char *none[] = {"checkpoint", NULL};
  cr_assert(eq(int, run_trigger(1, none, out, sizeof out), 2));
  cr_assert(not(eq(ptr, strstr(out, "HOST:PORT is required"), NULL)), "output: %s", out);
  char *bad_addr[] = {"checkpoint", "nowhere", NULL};
  cr_assert(eq(int, run_trigger(2, bad_addr, out, sizeof out), 2));
  char *bad_tmo[] = {"checkpoint", "127.0.0.1:1", "--timeout", "soon", NULL};
  cr_assert(eq(int, run_trigger(4, bad_tmo, out, sizeof out), 2));
  char *two[] = {"checkpoint", "127.0.0.1:1", "127.0.0.1:2", NULL};
  cr_assert(eq(int, run_trigger(3, two, out, sizeof out), 2));
  char *help[] = {"checkpoint", "--help", NULL};
  cr_assert(eq(int, run_trigger(2, help, out, sizeof out), 0));
  cr_assert(not(eq(ptr, strstr(out, "usage: pshard checkpoint"), NULL)));
}

/* ---------------------------------------------------------------- against the real scheduler */

/* Needs the scheduler's checkpoint handling (it refuses CHECKPOINT without a checkpoint
 * directory): enable once the scheduler's side is merged. */
Test(ckpt, a_job_without_a_checkpoint_directory_refuses, .timeout = 30) {
  ps_config *cfg;
  ps_ctx *ctx = NULL;
  OK(ps_config_new(&cfg));
  OK(ps_config_set(cfg, "embedded", "1"));
  OK(ps_config_set(cfg, "timeout_ms", "5000"));
  OK(ps_config_set(cfg, "connect_timeout_ms", "5000"));
  OK(ps_ctx_open(cfg, &ctx));
  ps_config_free(cfg);
  FAILS(PS_ERR_CONFIG, ps_checkpoint(ctx, NULL, 5000));
  ps_ctx_close(ctx);
}
