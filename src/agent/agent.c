/*
 * agent.c - the node agent (agent.h): connect to the scheduler with retry until the
 * deadline, HELLO, heartbeats, membership decode, LEAVE, and the loss of the scheduler.
 *
 * Runs on its owner's loop thread. The agent owns the scheduler connection (its udata
 * is the agent) and reports upward only through ps__agent_cbs. Once it gave up (lost)
 * or was stopped it starts nothing new: a connection that completes later is closed.
 */
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "agent/agent.h"
#include "common/common.h"
#include "net/auth.h"

#define AGENT_HEARTBEAT_MS 200u
#define AGENT_CONNECT_TIMEOUT_MS 60000u
#define AGENT_RETRY_MS 200u
#define AGENT_MAX_PAYLOAD (1u << 24)

static int agent_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b);
static void agent_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b);
static void agent_on_close(ps__conn *c, int status);
static const ps__conn_ops agent_ops = {agent_on_header, agent_on_frame, agent_on_close};

static int agent_done(const ps__agent *a) { return a->stopped || a->lost; }

static void timer_stop_close(uv_timer_t *t) {
  uv_timer_stop(t);
  if (!uv_is_closing((uv_handle_t *)t)) uv_close((uv_handle_t *)t, NULL);
}

/* Give up for good: no more connection attempts, the owner hears lost(status, msg). */
static void agent_give_up(ps__agent *a, int status, const char *msg) {
  if (agent_done(a)) return;
  a->lost = 1;
  uv_timer_stop(&a->hb_timer);
  uv_timer_stop(&a->retry_timer);
  uv_timer_stop(&a->deadline_timer);
  if (a->conn) {
    ps__conn *c = a->conn;
    a->conn = NULL;
    c->udata = NULL; /* its on_close reports nothing more */
    ps__conn_close(c, status);
    if (a->cb.link) a->cb.link(a->cb.arg, NULL, status);
  }
  a->cb.lost(a->cb.arg, status, msg);
}

static void on_connected(void *arg, ps__conn *c, int status);

static int agent_connect(ps__agent *a) {
  /* The handshake presents this node (its id once registered: a rejoin names it). */
  ps__auth_self_set(a->loop, a->o.hello.role, a->id);
  return ps__connect_tcp(a->loop, a->sched_host, a->o.sched_port, &agent_ops, a, a->o.pool, a->o.max_payload,
                         on_connected, a);
}

static void retry_tick(uv_timer_t *t) {
  ps__agent *a = t->data;
  if (agent_done(a)) return;
  if (agent_connect(a)) {
    char msg[300];
    snprintf(msg, sizeof msg, "cannot connect to the scheduler at %s:%d: %s", a->sched_host, a->o.sched_port,
             ps_errmsg());
    agent_give_up(a, PS_ERR_UNAVAILABLE, msg);
  }
}

/* Refused for a while (no scheduler there yet, or a wrong address): say so once, so a
 * node pointed at a dead scheduler is not silent until its deadline. On stderr when the
 * program set no log function (a library is otherwise quiet). */
#define AGENT_SAY_WAITING_MS 3000u
static void say_waiting(ps__agent *a) {
  uint64_t now = ps__now_ms();
  if (!a->refused_since_ms) a->refused_since_ms = now;
  if (a->said_waiting || now - a->refused_since_ms < AGENT_SAY_WAITING_MS) return;
  a->said_waiting = 1;
  uint64_t left = a->deadline_ms > now ? (a->deadline_ms - now + 999) / 1000 : 0;
  char msg[300];
  snprintf(msg, sizeof msg,
           "the scheduler at %s:%d refuses connections (not started yet, or a wrong address); retrying for %llu s "
           "more (connect_timeout_ms)",
           a->sched_host, a->o.sched_port, (unsigned long long)left);
  if (ps__log_enabled(PS_LOG_WARN)) ps__log(PS_LOG_WARN, "%s", msg);
  else fprintf(stderr, "pshard: %s\n", msg);
}

static void refused_give_up(ps__agent *a) {
  char msg[300];
  snprintf(msg, sizeof msg, "cannot reach the scheduler at %s:%d: connection refused (retried for %u ms)",
           a->sched_host, a->o.sched_port, a->o.connect_timeout_ms);
  agent_give_up(a, PS_ERR_UNAVAILABLE, msg);
}

static void deadline_tick(uv_timer_t *t) {
  ps__agent *a = t->data;
  if (agent_done(a) || a->registered) return;
  if (a->rejoining) {
    char msg[300];
    snprintf(msg, sizeof msg, "lost the scheduler at %s:%d, which did not take this node back within %u ms",
             a->sched_host, a->o.sched_port, a->o.rejoin_ms);
    agent_give_up(a, PS_ERR_UNAVAILABLE, msg);
    return;
  }
  if (!a->conn && !a->connected_once) {
    refused_give_up(a);
    return;
  }
  char msg[300];
  snprintf(msg, sizeof msg, "could not register with the scheduler at %s:%d within %u ms (no answer)", a->sched_host,
           a->o.sched_port, a->o.connect_timeout_ms);
  agent_give_up(a, PS_ERR_TIMEOUT, msg);
}

static void hb_tick(uv_timer_t *t) {
  ps__agent *a = t->data;
  if (a->stopped) return;
  if (a->conn) {
    ps__frame_hdr h = {.type = PS_MSG_HEARTBEAT, .sender = a->id};
    ps__conn_send_ctrl(a->conn, &h, NULL, 0);
  }
  if (a->cb.tick) a->cb.tick(a->cb.arg);
}

static void send_hello(ps__agent *a) {
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__hello_encode(&w, &a->o.hello);
  /* A rejoin names the node the scheduler registered before (sender = its id). */
  ps__frame_hdr h = {.type = PS_MSG_HELLO, .req_id = 1, .sender = a->rejoining ? a->id : 0};
  int rc = w.oom ? ps__fail(PS_ERR_NOMEM, "out of memory") : ps__conn_send_ctrl(a->conn, &h, w.data, w.len);
  ps__wbuf_free(&w);
  if (rc) {
    char msg[300];
    snprintf(msg, sizeof msg, "cannot send the registration to the scheduler: %s", ps_errmsg());
    agent_give_up(a, rc, msg);
  }
}

static void on_connected(void *arg, ps__conn *c, int status) {
  ps__agent *a = arg;
  if (agent_done(a)) {
    if (c) {
      c->udata = NULL;
      ps__conn_close(c, 0);
    }
    return;
  }
  if (status == PS_ERR_AUTH) { /* retrying would not change the secret */
    char msg[300];
    snprintf(msg, sizeof msg, "cannot register with the scheduler at %s:%d: authentication failed (this node and "
             "the scheduler need the same job secret and job id)", a->sched_host, a->o.sched_port);
    agent_give_up(a, PS_ERR_AUTH, msg);
    return;
  }
  if (status || !c) {
    /* The scheduler may not listen yet (launchers start every rank at once): retry
     * until the deadline, where deadline_tick gives up. */
    if ((status == PS_ERR_UNAVAILABLE || !c) && ps__now_ms() < a->deadline_ms) {
      __atomic_store_n(&a->refused, 1, __ATOMIC_RELAXED);
      say_waiting(a);
      uv_timer_start(&a->retry_timer, retry_tick, a->o.retry_ms, 0);
      return;
    }
    if (status == PS_ERR_UNAVAILABLE || !c) {
      refused_give_up(a);
      return;
    }
    char msg[300];
    snprintf(msg, sizeof msg, "cannot reach the scheduler at %s:%d: %s", a->sched_host, a->o.sched_port,
             ps_strerror(status));
    agent_give_up(a, PS_ERR_UNAVAILABLE, msg);
    return;
  }
  __atomic_store_n(&a->refused, 0, __ATOMIC_RELAXED);
  a->refused_since_ms = 0;
  a->said_waiting = 0;
  a->conn = c;
  a->connected_once = 1;
  if (a->cb.link) a->cb.link(a->cb.arg, c, 0);
  if (agent_done(a) || !a->conn) return;
  send_hello(a);
  if (agent_done(a)) return;
  uv_timer_start(&a->hb_timer, hb_tick, a->o.heartbeat_ms, a->o.heartbeat_ms);
}

static int agent_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__agent *a = c->udata;
  if (!a) {
    b->discard = 1;
    return 0;
  }
  if (h->type == (PS_MSG_HELLO | PS_FRAME_REPLY) || h->type == PS_MSG_MEMBERSHIP || h->type == PS_MSG_ERROR) return 0;
  if (a->cb.on_header) return a->cb.on_header(a->cb.arg, h, b);
  return ps__fail(PS_ERR_PROTO, "unexpected %s frame from the scheduler", ps__frame_type_name(h->type));
}

static void on_hello_reply(ps__agent *a, const ps__frame_hdr *h, const ps__body *b) {
  if (h->status) {
    char msg[300];
    if (b->buf && b->len)
      snprintf(msg, sizeof msg, "the scheduler refused the registration: %.*s", (int)(b->len < 250 ? b->len : 250),
               (const char *)b->buf);
    else
      snprintf(msg, sizeof msg, "the scheduler refused the registration: %s", ps_strerror(h->status));
    agent_give_up(a, h->status, msg);
    return;
  }
  if (a->rejoining && (h->table != a->id || h->batch != a->rank)) {
    char msg[200];
    snprintf(msg, sizeof msg, "the scheduler took this node back as %u (rank %u), not %u (rank %u)", h->table,
             h->batch, a->id, a->rank);
    agent_give_up(a, PS_ERR_PROTO, msg);
    return;
  }
  if (a->rejoining) {
    a->rejoining = 0;
    a->rejoins++;
    ps__log(PS_LOG_INFO, "the scheduler at %s:%d took node %u back", a->sched_host, a->o.sched_port, a->id);
  }
  a->id = h->table;
  a->rank = h->batch;
  ps__auth_self_set(a->loop, a->o.hello.role, a->id); /* the loop's later connections present it */
  /* A restored job resumes at its checkpoint's clock; a negative one is not a clock. */
  a->start_clock = h->clock > 0 ? h->clock : 0;
  a->registered = 1;
  uv_timer_stop(&a->deadline_timer);
  a->cb.registered(a->cb.arg, a->id, a->rank);
}

static void on_membership(ps__agent *a, const ps__body *b) {
  ps__membership m;
  if (ps__membership_decode(b->buf, b->len, &m)) {
    ps__log(PS_LOG_ERROR, "bad membership frame from the scheduler: %s", ps_errmsg());
    return;
  }
  a->cb.membership(a->cb.arg, &m);
  int finished = m.started == 2;
  ps__membership_clear(&m);
  if (finished && a->cb.finished && !a->stopped) a->cb.finished(a->cb.arg);
}

static void agent_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__agent *a = c->udata;
  if (!a || a->lost) return;
  if (h->type == (PS_MSG_HELLO | PS_FRAME_REPLY)) {
    if (!a->stopped) on_hello_reply(a, h, b);
  } else if (h->type == PS_MSG_MEMBERSHIP) {
    if (!a->stopped) on_membership(a, b);
  } else if (h->type == PS_MSG_ERROR) {
    ps__log(PS_LOG_ERROR, "scheduler: %.*s", (int)b->len, b->buf ? (const char *)b->buf : "");
  } else if (a->cb.on_frame) {
    a->cb.on_frame(a->cb.arg, h, b);
  }
}

static void agent_on_close(ps__conn *c, int status) {
  ps__agent *a = c->udata;
  if (!a) return;
  if (a->conn == c) a->conn = NULL;
  if (a->cb.link) a->cb.link(a->cb.arg, NULL, status);
  if (agent_done(a)) return;
  uv_timer_stop(&a->hb_timer);
  char msg[160];
  snprintf(msg, sizeof msg, "lost the scheduler (%s)", ps_strerror(status ? status : PS_ERR_CLOSED));
  if (!a->registered && ps__now_ms() < a->deadline_ms) {
    /* Lost before the registration (or the rejoin) was answered: the scheduler went
     * away, since a refusal comes as an answer first. Try again until the deadline to
     * register, as while it did not listen yet; one started again takes the node. */
    uv_timer_start(&a->retry_timer, retry_tick, a->o.retry_ms, 0);
    return;
  }
  if (a->registered && a->o.rejoin_ms) {
    /* Wait for it: a restarted scheduler takes its nodes back (sched.c, its state file). */
    a->registered = 0;
    a->rejoining = 1;
    a->deadline_ms = ps__now_ms() + a->o.rejoin_ms;
    if (a->cb.detached) a->cb.detached(a->cb.arg, msg);
    uv_timer_start(&a->deadline_timer, deadline_tick, a->o.rejoin_ms, 0);
    uv_timer_start(&a->retry_timer, retry_tick, a->o.retry_ms, 0);
    return;
  }
  agent_give_up(a, PS_ERR_UNAVAILABLE, msg);
}

/* The registration's token: random, so that no other process names this one's node. */
static uint64_t new_token(void) {
  uint64_t t = 0;
  if (getrandom(&t, sizeof t, GRND_NONBLOCK) != (ssize_t)sizeof t) { /* no entropy yet: time, pid and address */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    t = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 40) ^ (uint64_t)(uintptr_t)&t;
    t ^= t >> 31;
    t *= 0x9e3779b97f4a7c15ull;
  }
  return t ? t : 1;
}

int ps__agent_init(ps__agent *a, uv_loop_t *loop, const ps__agent_opts *o, const ps__agent_cbs *cb) {
  memset(a, 0, sizeof *a);
  if (!cb || !cb->registered || !cb->membership || !cb->lost)
    return ps__fail(PS_ERR_INVALID, "node agent: registered, membership and lost callbacks are required");
  if (!o->sched_host || !*o->sched_host || strlen(o->sched_host) >= sizeof a->sched_host || o->sched_port <= 0 ||
      o->sched_port > 65535)
    return ps__fail(PS_ERR_INVALID, "node agent: bad scheduler address");
  a->loop = loop;
  a->o = *o;
  a->cb = *cb;
  snprintf(a->sched_host, sizeof a->sched_host, "%s", o->sched_host);
  a->o.sched_host = a->sched_host;
  if (!a->o.heartbeat_ms) a->o.heartbeat_ms = AGENT_HEARTBEAT_MS;
  if (!a->o.connect_timeout_ms) a->o.connect_timeout_ms = AGENT_CONNECT_TIMEOUT_MS;
  if (!a->o.retry_ms) a->o.retry_ms = AGENT_RETRY_MS;
  if (!a->o.max_payload) a->o.max_payload = AGENT_MAX_PAYLOAD;
  if (!a->o.hello.token) a->o.hello.token = new_token();
  uv_timer_init(loop, &a->hb_timer);
  uv_timer_init(loop, &a->retry_timer);
  uv_timer_init(loop, &a->deadline_timer);
  a->hb_timer.data = a->retry_timer.data = a->deadline_timer.data = a;
  return 0;
}

int ps__agent_start(ps__agent *a) {
  if (agent_done(a)) return ps__fail(PS_ERR_CLOSED, "node agent stopped");
  a->deadline_ms = ps__now_ms() + a->o.connect_timeout_ms;
  int rc = agent_connect(a);
  if (rc) return rc;
  uv_timer_start(&a->deadline_timer, deadline_tick, a->o.connect_timeout_ms, 0);
  return 0;
}

void ps__agent_stop(ps__agent *a, int leave) {
  if (a->stopped) return;
  a->stopped = 1;
  timer_stop_close(&a->hb_timer);
  timer_stop_close(&a->retry_timer);
  timer_stop_close(&a->deadline_timer);
  ps__conn *c = a->conn;
  if (!c) return;
  if (leave && a->registered) {
    ps__frame_hdr h = {.type = PS_MSG_LEAVE, .sender = a->id};
    ps__conn_send_ctrl(c, &h, NULL, 0);
    ps__conn_close_after_flush(c, 0);
  } else {
    ps__conn_close(c, 0);
  }
}

uint32_t ps__agent_id(const ps__agent *a) { return a->id; }

int64_t ps__agent_start_clock(const ps__agent *a) { return a->start_clock; }

int ps__agent_refused(const ps__agent *a) { return __atomic_load_n(&a->refused, __ATOMIC_RELAXED); }

static void close_one(uv_handle_t *h, void *arg) {
  (void)arg;
  if (uv_is_closing(h)) return;
  if ((h->type == UV_TCP || h->type == UV_NAMED_PIPE) && h->data) {
    ps__conn_close(h->data, 0);
    return;
  }
  if (h->type == UV_ASYNC) return;
  uv_close(h, NULL);
}

void ps__loop_close_all(uv_loop_t *loop) {
  ps__auth_self_clear(loop);
  uv_walk(loop, close_one, NULL);
}
