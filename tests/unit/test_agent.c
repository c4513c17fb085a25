/*
 * test_agent.c - the node agent against a fake scheduler, without a real one.
 *
 * The fake scheduler is a thread with a blocking TCP socket bound to an ephemeral
 * loopback port. It starts listening when told to (a bound socket that does not listen
 * refuses connections, so "not listening yet" needs no port race), answers HELLO with
 * an id and a rank (or a refusal, or nothing), sends a MEMBERSHIP and a reply the agent
 * does not handle itself, counts heartbeats, records LEAVE, and can close the
 * connection after some heartbeats. Its HELLO reply can carry a start clock, as a
 * restored job's scheduler's does. The agent runs on a private loop in the test's
 * thread; every wait is bounded. Covered: registration and what HELLO carries,
 * heartbeats and ticks, membership decode, the job-finished signal, frames passed to
 * the owner, LEAVE, retry while the scheduler does not listen, the connect deadline
 * (refused, and connected without an answer), a refused registration, and the
 * lost-scheduler callback, and the start clock of a restored job.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "agent/agent.h"
#include "common/common.h"
#include "pshard.h"

#define OK(call)                                                                                    \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, 0), "%s -> %s: %s", #call, ps_err_name(rc_), ps_errmsg());               \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- the fake scheduler */

enum { FAKE_ANSWER = 0, FAKE_SILENT = 1, FAKE_REFUSE = 2 };

typedef struct fake {
  int lfd, port;
  int listen_after_ms; /* < 0: never listen */
  int mode;            /* FAKE_* */
  int started;         /* the membership's started field */
  int close_after_hb;  /* > 0: close the connection after this many heartbeats */
  int64_t hello_clock; /* the HELLO reply's clock (a restored job's start clock) */
  int drop_first;      /* close the first connection after its HELLO, unanswered */
  int hellos;          /* HELLOs seen (atomic) */
  int stop;            /* set by the test (atomic) */
  /* what it saw (atomics) */
  int got_hello, heartbeats, got_leave;
  uint32_t leave_sender;
  ps__hello hello;
  uint64_t first_token; /* the first HELLO's token */
  pthread_t thread;
} fake;

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
  cr_assert(eq(long, (long)send(fd, hdr, sizeof hdr, MSG_NOSIGNAL), (long)sizeof hdr));
  if (len) cr_assert(eq(long, (long)send(fd, body, len, MSG_NOSIGNAL), (long)len));
}

static void send_membership(fake *f, int fd) {
  ps__member mem[2];
  memset(mem, 0, sizeof mem);
  mem[0].id = 2;
  mem[0].role = PS_ROLE_SERVER;
  mem[0].alive = 1;
  mem[0].port = 4321;
  snprintf(mem[0].host, sizeof mem[0].host, "127.0.0.1");
  mem[1].id = 7;
  mem[1].role = PS_ROLE_WORKER;
  mem[1].alive = 1;
  mem[1].rank = 3;
  ps__membership m = {.epoch = 5, .servers_expected = 1, .workers_expected = 1, .started = (uint8_t)f->started,
                      .n = 2, .m = mem};
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__membership_encode(&w, &m);
  cr_assert(eq(int, w.oom, 0));
  ps__frame_hdr h = {.type = PS_MSG_MEMBERSHIP, .epoch = 5};
  send_frame(fd, &h, w.data, w.len);
  ps__wbuf_free(&w);
}

static void serve(fake *f, int fd) {
  uint8_t hb[PS_FRAME_HDR_SIZE];
  static uint8_t body[1 << 16];
  while (read_full(f, fd, hb, sizeof hb) == 0) {
    ps__frame_hdr h;
    cr_assert(eq(int, ps__frame_decode(hb, 1u << 20, &h), 0), "bad frame from the agent: %s", ps_errmsg());
    cr_assert(le(u64, h.payload_len, sizeof body));
    if (h.payload_len && read_full(f, fd, body, (size_t)h.payload_len)) return;
    if (h.type == PS_MSG_HELLO) {
      cr_assert(eq(int, ps__hello_decode(body, (size_t)h.payload_len, &f->hello), 0));
      __atomic_store_n(&f->got_hello, 1, __ATOMIC_RELEASE);
      if (!f->first_token) f->first_token = f->hello.token;
      if (__atomic_add_fetch(&f->hellos, 1, __ATOMIC_RELEASE) == 1 && f->drop_first) return; /* as if it died */
      if (f->mode == FAKE_SILENT) continue;
      ps__frame_hdr r = {.type = PS_MSG_HELLO | PS_FRAME_REPLY, .req_id = h.req_id, .table = 7, .batch = 3,
                         .clock = f->hello_clock};
      if (f->mode == FAKE_REFUSE) r.status = PS_ERR_ROLE;
      send_frame(fd, &r, NULL, 0);
      if (f->mode == FAKE_REFUSE) continue;
      send_membership(f, fd);
      /* A reply to a request of the owner's own (a worker's DECLARE): passed through. */
      ps__frame_hdr d = {.type = PS_MSG_DECLARE | PS_FRAME_REPLY, .req_id = 55, .table = 9};
      send_frame(fd, &d, NULL, 0);
    } else if (h.type == PS_MSG_HEARTBEAT) {
      int n = __atomic_add_fetch(&f->heartbeats, 1, __ATOMIC_RELEASE);
      if (f->close_after_hb && n >= f->close_after_hb) return;
    } else if (h.type == PS_MSG_LEAVE) {
      __atomic_store_n(&f->leave_sender, h.sender, __ATOMIC_RELAXED);
      __atomic_store_n(&f->got_leave, 1, __ATOMIC_RELEASE);
    }
  }
}

static void *fake_main(void *arg) {
  fake *f = arg;
  if (f->listen_after_ms < 0) return NULL;
  for (int waited = 0; waited < f->listen_after_ms && !__atomic_load_n(&f->stop, __ATOMIC_RELAXED); waited += 10)
    usleep(10000);
  cr_assert(eq(int, listen(f->lfd, 4), 0));
  while (!__atomic_load_n(&f->stop, __ATOMIC_RELAXED)) {
    struct pollfd p = {.fd = f->lfd, .events = POLLIN};
    if (poll(&p, 1, 50) <= 0) continue;
    int fd = accept(f->lfd, NULL, NULL);
    if (fd < 0) continue;
    serve(f, fd);
    close(fd);
    if (f->drop_first && __atomic_load_n(&f->hellos, __ATOMIC_ACQUIRE) == 1) continue; /* and the next */
    break; /* one connection per test */
  }
  return NULL;
}

static void fake_start(fake *f, int listen_after_ms, int mode) {
  memset(f, 0, sizeof *f);
  f->listen_after_ms = listen_after_ms;
  f->mode = mode;
  f->started = 1;
  f->lfd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert(ge(int, f->lfd, 0));
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  cr_assert(eq(int, bind(f->lfd, (struct sockaddr *)&sa, sizeof sa), 0));
  cr_assert(eq(int, getsockname(f->lfd, (struct sockaddr *)&sa, &len), 0));
  f->port = ntohs(sa.sin_port);
}

static void fake_run(fake *f) { cr_assert(eq(int, pthread_create(&f->thread, NULL, fake_main, f), 0)); }

static void fake_stop(fake *f) {
  __atomic_store_n(&f->stop, 1, __ATOMIC_RELAXED);
  pthread_join(f->thread, NULL);
  close(f->lfd);
}

/* ---------------------------------------------------------------- the agent's owner */

typedef struct owner {
  uv_loop_t loop;
  ps__pool *pool;
  ps__agent agent;
  int registered, memberships, finished, lost, ticks, links_up, links_down, frames;
  uint32_t id, rank;
  int64_t start_clock; /* ps__agent_start_clock as seen in registered() */
  uint64_t epoch;
  uint32_t nmembers, server_port;
  int lost_status;
  char lost_msg[300];
  uint64_t frame_req_id;
} owner;

static void on_registered(void *arg, uint32_t id, uint32_t rank) {
  owner *o = arg;
  o->registered++;
  o->id = id;
  o->rank = rank;
  o->start_clock = ps__agent_start_clock(&o->agent);
}

static void on_membership(void *arg, const ps__membership *m) {
  owner *o = arg;
  o->memberships++;
  o->epoch = m->epoch;
  o->nmembers = m->n;
  for (uint32_t i = 0; i < m->n; i++)
    if (m->m[i].role == PS_ROLE_SERVER) o->server_port = m->m[i].port;
}

static void on_finished(void *arg) { ((owner *)arg)->finished++; }

static void on_lost(void *arg, int status, const char *msg) {
  owner *o = arg;
  o->lost++;
  o->lost_status = status;
  snprintf(o->lost_msg, sizeof o->lost_msg, "%s", msg);
}

static void on_tick(void *arg) { ((owner *)arg)->ticks++; }

static void on_link(void *arg, ps__conn *c, int status) {
  owner *o = arg;
  (void)status;
  if (c) o->links_up++;
  else o->links_down++;
}

static int on_header(void *arg, const ps__frame_hdr *h, ps__body *b) {
  (void)arg;
  (void)h;
  (void)b;
  return 0;
}

static void on_frame(void *arg, const ps__frame_hdr *h, ps__body *b) {
  owner *o = arg;
  (void)b;
  o->frames++;
  o->frame_req_id = h->req_id;
}

static void owner_init(owner *o, const fake *f, uint32_t connect_timeout_ms) {
  memset(o, 0, sizeof *o);
  cr_assert(eq(int, uv_loop_init(&o->loop), 0));
  o->pool = ps__pool_new(1u << 20);
  ps__agent_opts ao = {.sched_host = "127.0.0.1", .sched_port = f->port, .heartbeat_ms = 50,
                       .connect_timeout_ms = connect_timeout_ms, .retry_ms = 50, .pool = o->pool};
  /* What a server announces. */
  ao.hello.role = PS_ROLE_SERVER;
  ao.hello.port = 1234;
  ao.hello.pid = (uint32_t)getpid();
  ao.hello.caps = PS_CAP_PEER_MEM;
  snprintf(ao.hello.host, sizeof ao.hello.host, "127.0.0.1");
  snprintf(ao.hello.unix_path, sizeof ao.hello.unix_path, "/tmp/pshard-test.sock");
  snprintf(ao.hello.hostid, sizeof ao.hello.hostid, "host-a");
  ps__agent_cbs cb = {.arg = o, .registered = on_registered, .membership = on_membership, .finished = on_finished,
                      .lost = on_lost, .tick = on_tick, .link = on_link, .on_header = on_header,
                      .on_frame = on_frame};
  OK(ps__agent_init(&o->agent, &o->loop, &ao, &cb));
}

/* Run the loop until *flag >= want or max_s seconds passed; returns the elapsed time. */
static double run_until(owner *o, const int *flag, int want, double max_s) {
  double t0 = now_s();
  while (*flag < want && now_s() - t0 < max_s) {
    uv_run(&o->loop, UV_RUN_NOWAIT);
    usleep(2000);
  }
  return now_s() - t0;
}

static void owner_close(owner *o, int leave) {
  ps__agent_stop(&o->agent, leave);
  ps__loop_close_all(&o->loop);
  double t0 = now_s();
  while (uv_run(&o->loop, UV_RUN_NOWAIT) && now_s() - t0 < 5) usleep(1000);
  cr_assert(eq(int, uv_loop_close(&o->loop), 0), "handles left open on the loop");
  ps__pool_free(o->pool);
}

/* ---------------------------------------------------------------- tests */

Test(agent, registers_heartbeats_takes_membership_and_leaves, .timeout = 30) {
  fake f;
  owner o;
  fake_start(&f, 0, FAKE_ANSWER);
  fake_run(&f);
  owner_init(&o, &f, 5000);
  OK(ps__agent_start(&o.agent));
  run_until(&o, &o.frames, 1, 10);
  cr_assert(eq(int, o.registered, 1));
  cr_assert(eq(u32, o.id, 7));
  cr_assert(eq(u32, o.rank, 3));
  cr_assert(eq(u32, ps__agent_id(&o.agent), 7));
  cr_assert(eq(i64, o.start_clock, 0), "a job not restored starts at clock 0");
  cr_assert(eq(int, o.memberships, 1));
  cr_assert(eq(u64, o.epoch, 5));
  cr_assert(eq(u32, o.nmembers, 2));
  cr_assert(eq(u32, o.server_port, 4321));
  cr_assert(eq(int, o.finished, 0), "a started job is not finished");
  cr_assert(eq(int, o.frames, 1), "the owner's reply was not passed on");
  cr_assert(eq(u64, o.frame_req_id, 55));
  cr_assert(eq(int, o.links_up, 1));
  /* HELLO carried what the owner announced. */
  cr_assert(eq(int, __atomic_load_n(&f.got_hello, __ATOMIC_ACQUIRE), 1));
  cr_assert(eq(u8, f.hello.role, PS_ROLE_SERVER));
  cr_assert(eq(u16, f.hello.port, 1234));
  cr_assert(eq(u32, f.hello.pid, (uint32_t)getpid()));
  cr_assert(eq(u8, f.hello.caps, PS_CAP_PEER_MEM));
  cr_assert(eq(str, f.hello.unix_path, "/tmp/pshard-test.sock"));
  cr_assert(eq(str, f.hello.hostid, "host-a"));
  /* Heartbeats every 50 ms, each followed by a tick. */
  run_until(&o, &o.ticks, 4, 10);
  cr_assert(ge(int, o.ticks, 4));
  double t0 = now_s();
  while (__atomic_load_n(&f.heartbeats, __ATOMIC_ACQUIRE) < 3 && now_s() - t0 < 5) usleep(5000);
  cr_assert(ge(int, __atomic_load_n(&f.heartbeats, __ATOMIC_ACQUIRE), 3));
  /* LEAVE, sent with the id the scheduler gave. */
  owner_close(&o, 1);
  t0 = now_s();
  while (!__atomic_load_n(&f.got_leave, __ATOMIC_ACQUIRE) && now_s() - t0 < 5) usleep(5000);
  cr_assert(eq(int, __atomic_load_n(&f.got_leave, __ATOMIC_ACQUIRE), 1), "no LEAVE");
  cr_assert(eq(u32, f.leave_sender, 7));
  cr_assert(eq(int, o.lost, 0), "a stopped agent reported a loss: %s", o.lost_msg);
  fake_stop(&f);
}

/* A restored job's scheduler answers HELLO with the checkpoint's clock: the owner
 * finds it in the agent when registered() runs; a negative one is no clock. */
Test(agent, the_hello_reply_clock_is_the_start_clock, .timeout = 30) {
  static const int64_t clocks[] = {42, -5};
  static const int64_t want[] = {42, 0};
  for (int i = 0; i < 2; i++) {
    fake f;
    owner o;
    fake_start(&f, 0, FAKE_ANSWER);
    f.hello_clock = clocks[i];
    fake_run(&f);
    owner_init(&o, &f, 5000);
    cr_assert(eq(i64, ps__agent_start_clock(&o.agent), 0));
    OK(ps__agent_start(&o.agent));
    run_until(&o, &o.registered, 1, 10);
    cr_assert(eq(int, o.registered, 1));
    cr_assert(eq(i64, o.start_clock, want[i]), "HELLO reply clock %lld", (long long)clocks[i]);
    cr_assert(eq(i64, ps__agent_start_clock(&o.agent), want[i]));
    owner_close(&o, 1);
    fake_stop(&f);
  }
}

Test(agent, retries_while_the_scheduler_does_not_listen_yet, .timeout = 30) {
  fake f;
  owner o;
  fake_start(&f, 700, FAKE_ANSWER);
  fake_run(&f);
  owner_init(&o, &f, 10000);
  OK(ps__agent_start(&o.agent));
  int never = 0;
  run_until(&o, &never, 1, 0.3);
  cr_assert(eq(int, o.registered, 0));
  cr_assert(eq(int, ps__agent_refused(&o.agent), 1), "the first attempts were not refused");
  double dt = run_until(&o, &o.registered, 1, 10) + 0.3;
  cr_assert(eq(int, o.registered, 1), "not registered after %.2fs: %s", dt, o.lost_msg);
  cr_assert(ge(dbl, dt, 0.6), "registered after %.2fs, before the scheduler listened", dt);
  cr_assert(eq(int, ps__agent_refused(&o.agent), 0));
  cr_assert(eq(int, o.lost, 0));
  owner_close(&o, 1);
  fake_stop(&f);
}

Test(agent, gives_up_at_the_connect_deadline_when_refused, .timeout = 30) {
  fake f;
  owner o;
  fake_start(&f, -1, FAKE_ANSWER); /* bound, never listening: every attempt refused */
  fake_run(&f);
  owner_init(&o, &f, 500);
  OK(ps__agent_start(&o.agent));
  double dt = run_until(&o, &o.lost, 1, 10);
  cr_assert(eq(int, o.lost, 1));
  cr_assert(eq(int, o.lost_status, PS_ERR_UNAVAILABLE), "status %s", ps_err_name(o.lost_status));
  cr_assert(not(eq(ptr, strstr(o.lost_msg, "connection refused"), NULL)), "message: %s", o.lost_msg);
  cr_assert(ge(dbl, dt, 0.45), "gave up after %.2fs", dt);
  cr_assert(lt(dbl, dt, 3.0), "gave up after %.2fs", dt);
  cr_assert(eq(int, o.registered, 0));
  /* Nothing more happens after the loss. */
  int never = 0;
  run_until(&o, &never, 1, 0.2);
  cr_assert(eq(int, o.lost, 1));
  owner_close(&o, 1);
  fake_stop(&f);
}

Test(agent, gives_up_at_the_deadline_without_an_answer, .timeout = 30) {
  fake f;
  owner o;
  fake_start(&f, 0, FAKE_SILENT);
  fake_run(&f);
  owner_init(&o, &f, 400);
  OK(ps__agent_start(&o.agent));
  double dt = run_until(&o, &o.lost, 1, 10);
  cr_assert(eq(int, o.lost, 1));
  cr_assert(eq(int, o.lost_status, PS_ERR_TIMEOUT), "status %s: %s", ps_err_name(o.lost_status), o.lost_msg);
  cr_assert(not(eq(ptr, strstr(o.lost_msg, "register"), NULL)), "message: %s", o.lost_msg);
  cr_assert(ge(dbl, dt, 0.35), "gave up after %.2fs", dt);
  cr_assert(eq(int, o.registered, 0));
  cr_assert(eq(int, o.links_down, 1), "the owner was not told the connection is gone");
  owner_close(&o, 1);
  fake_stop(&f);
}

/* The scheduler goes away after the HELLO, unanswered (it died; one started again
 * listens on the same port): the agent connects again and registers, before its
 * deadline, instead of giving up. */
Test(agent, a_connection_lost_before_the_registration_is_tried_again, .timeout = 30) {
  fake f;
  owner o;
  fake_start(&f, 0, FAKE_ANSWER);
  f.drop_first = 1;
  fake_run(&f);
  owner_init(&o, &f, 5000);
  OK(ps__agent_start(&o.agent));
  run_until(&o, &o.registered, 1, 10);
  cr_assert(eq(int, o.lost, 0), "gave up: %s", o.lost_msg);
  cr_assert(eq(int, o.registered, 1));
  cr_assert(eq(int, __atomic_load_n(&f.hellos, __ATOMIC_ACQUIRE), 2));
  /* Both name the same node process: a scheduler that took the first gives its place back. */
  cr_assert(not(eq(u64, f.first_token, 0)));
  cr_assert(eq(u64, f.hello.token, f.first_token));
  owner_close(&o, 1);
  fake_stop(&f);
}

Test(agent, a_refused_registration_is_a_loss_with_its_status, .timeout = 30) {
  fake f;
  owner o;
  fake_start(&f, 0, FAKE_REFUSE);
  fake_run(&f);
  owner_init(&o, &f, 5000);
  OK(ps__agent_start(&o.agent));
  run_until(&o, &o.lost, 1, 10);
  cr_assert(eq(int, o.lost, 1));
  cr_assert(eq(int, o.lost_status, PS_ERR_ROLE), "status %s: %s", ps_err_name(o.lost_status), o.lost_msg);
  cr_assert(eq(int, o.registered, 0));
  owner_close(&o, 1);
  fake_stop(&f);
}

Test(agent, reports_a_lost_scheduler_once, .timeout = 30) {
  fake f;
  owner o;
  fake_start(&f, 0, FAKE_ANSWER);
  f.close_after_hb = 2;
  fake_run(&f);
  owner_init(&o, &f, 5000);
  OK(ps__agent_start(&o.agent));
  run_until(&o, &o.lost, 1, 10);
  cr_assert(eq(int, o.registered, 1));
  cr_assert(eq(int, o.lost, 1), "no loss reported");
  cr_assert(eq(int, o.lost_status, PS_ERR_UNAVAILABLE));
  cr_assert(not(eq(ptr, strstr(o.lost_msg, "lost the scheduler"), NULL)), "message: %s", o.lost_msg);
  cr_assert(eq(int, o.links_down, 1));
  int ticks = o.ticks, never = 0;
  run_until(&o, &never, 1, 0.3);
  cr_assert(eq(int, o.lost, 1), "the loss was reported twice");
  cr_assert(eq(int, o.ticks, ticks), "heartbeats went on after the loss");
  owner_close(&o, 1);
  fake_stop(&f);
}

Test(agent, signals_a_finished_job, .timeout = 30) {
  fake f;
  owner o;
  fake_start(&f, 0, FAKE_ANSWER);
  f.started = 2;
  fake_run(&f);
  owner_init(&o, &f, 5000);
  OK(ps__agent_start(&o.agent));
  run_until(&o, &o.finished, 1, 10);
  cr_assert(eq(int, o.memberships, 1));
  cr_assert(eq(int, o.finished, 1));
  owner_close(&o, 1);
  fake_stop(&f);
}

Test(agent, init_checks_its_arguments) {
  uv_loop_t loop;
  ps__agent a;
  cr_assert(eq(int, uv_loop_init(&loop), 0));
  ps__agent_opts o = {.sched_host = "127.0.0.1", .sched_port = 1};
  ps__agent_cbs none = {0};
  cr_assert(eq(int, ps__agent_init(&a, &loop, &o, &none), PS_ERR_INVALID));
  ps__agent_cbs cb = {.registered = on_registered, .membership = on_membership, .lost = on_lost};
  o.sched_port = 0;
  cr_assert(eq(int, ps__agent_init(&a, &loop, &o, &cb), PS_ERR_INVALID));
  o.sched_port = 1;
  o.sched_host = "";
  cr_assert(eq(int, ps__agent_init(&a, &loop, &o, &cb), PS_ERR_INVALID));
  cr_assert(eq(int, uv_loop_close(&loop), 0));
}
