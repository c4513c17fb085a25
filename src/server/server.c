/*
 * server.c - the parameter server: its loop, listeners, scheduler link and dispatch.
 *
 * Design. One loop thread owns all state. A server registers with the scheduler, then
 * accepts workers over TCP and (same host) AF_UNIX. Its tables, clocks and rounds are a
 * shard engine (shard/shard.h); this file gives the engine what it asks for (buffers,
 * timers, the helper thread, the round hooks of peer.c) and hands each worker frame to
 * the file of its family: push.c, pull.c, peer.c (values in the worker's memory) and
 * stats.c. Every key a request names must be owned by this server under the current
 * ring (else PS_ERR_MOVED); the ring comes with the scheduler's membership, which also
 * tells the engine which workers are live. With replicas R >= 2 a request must come to
 * the head of its keys' chain, and applied pushes go down the chain (repl.c).
 */
#include "server/server.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/common.h"
#include "common/config.h"
#include "proto/msg.h"
#include "server/server_int.h"

/* ------------------------------------------------------------------ replies */

typedef struct send_done {
  ps__pool *pool;
  void *buf;
  size_t len;
} send_done;

static void release_buf(void *arg, int status) {
  send_done *d = arg;
  (void)status;
  ps__pool_put(d->pool, d->buf, d->len);
  free(d);
}

void ps__srv_reply_pooled(ps__server *s, ps__conn *c, ps__frame_hdr *h, void *buf, size_t len) {
  send_done *d = ps__malloc(sizeof *d);
  uv_buf_t b = uv_buf_init(buf, 0);
  b.len = len;
  if (!d) {
    ps__pool_put(s->pool, buf, len);
    ps__conn_send_error(c, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  d->pool = s->pool;
  d->buf = buf;
  d->len = len;
  if (ps__conn_send(c, h, &b, len ? 1 : 0, release_buf, d) != 0) release_buf(d, PS_ERR_CLOSED);
}

void ps__srv_reply_ok(ps__conn *c, const ps__frame_hdr *req, uint8_t flags) {
  ps__frame_hdr h = {.type = (uint8_t)(req->type | PS_FRAME_REPLY), .req_id = req->req_id, .table = req->table,
                     .clock = req->clock, .flags = flags};
  ps__conn_send_ctrl(c, &h, NULL, 0);
}

void ps__srv_reply_err(ps__conn *c, const ps__frame_hdr *req, int err, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  ps__srv_repair_refused(c->loop->data, c, err, msg);
  ps__conn_send_error(c, req, err, msg);
}


void ps__srv_reply_verdict(ps__conn *c, const ps__frame_hdr *h, const ps__verdict *v) {
  if (v->status == PS__DROPPED)
    ps__srv_reply_ok(c, h, PS_FLAG_DROPPED); /* a late push under sync:M: counted, not applied */
  else {
    ps__srv_repair_refused(c->loop->data, c, v->err, v->msg);
    ps__conn_send_error(c, h, v->err, v->msg);
  }
}

/* ------------------------------------------------------------------ what the engine asks for */

static void *hook_alloc(void *arg, size_t n) { return ps__pool_get(((ps__server *)arg)->pool, n); }

/* A body the engine took may be a shared forward body (peer.c): its holders are counted. */
static void hook_release(void *arg, void *buf, size_t len) { ps__srv_fwd_buf_put(arg, buf, len); }

ps__par *ps__srv_par(ps__server *s, uint32_t nkeys) {
  if (nkeys < PS__PAR_MIN_KEYS || s->par_failed) return NULL;
  if (!s->par && !(s->par = ps__par_new())) {
    s->par_failed = 1;
    ps__log(PS_LOG_WARN, "cannot start a helper thread; huge requests stay on one thread");
  }
  return s->par;
}

static ps__par *hook_par(void *arg, uint32_t nkeys) { return ps__srv_par(arg, nkeys); }

static void agg_timeout(uv_timer_t *tm) {
  table_timer *tt = tm->data;
  tt->t->agg_armed = 0;
  ps__shard_agg_flush(tt->t);
}

/* The engine asks for an aggregation flush of t in ms (0: cancel). */
static void hook_arm_flush(void *arg, ps__table *t, uint32_t ms) {
  ps__server *s = arg;
  table_timer *tt = t->owner;
  if (!ms) {
    if (tt) uv_timer_stop(&tt->tm);
    return;
  }
  if (!tt) {
    if (!(tt = ps__calloc(1, sizeof *tt))) {
      ps__log(PS_LOG_WARN, "out of memory for the aggregation timer of table '%s'; it flushes by count", t->decl.name);
      return;
    }
    uv_timer_init(&s->loop, &tt->tm);
    tt->tm.data = tt;
    tt->t = t;
    t->owner = tt;
  }
  uv_timer_start(&tt->tm, agg_timeout, ms, 0);
}

/* Between polls for I/O, a step of every pending apply. */
static void apply_idle_cb(uv_idle_t *h) {
  ps__server *s = h->data;
  ps__shard_pending_idle(s->sh, PS__APPLY_STEP);
  if (s->sh->npending == 0) uv_idle_stop(&s->apply_idle);
}

void ps__srv_pending_check(ps__server *s) {
  if (s->sh->npending && !uv_is_active((uv_handle_t *)&s->apply_idle) && !s->stopping)
    uv_idle_start(&s->apply_idle, apply_idle_cb);
}

/* ------------------------------------------------------------------ worker connections */

static void on_create(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const ps__body *b) {
  ps__declare d;
  ps__verdict v;
  if (ps__declare_decode(b->buf, b->len, &d)) {
    ps__srv_reply_err(c, h, PS_ERR_PROTO, "%s", ps_errmsg());
    return;
  }
  int existed = ps__shard_table(s->sh, d.id) != NULL;
  if (ps__shard_create(s->sh, &d, &v) != PS__APPLIED) {
    ps__srv_reply_verdict(c, h, &v);
    return;
  }
  ps__table *nt = ps__shard_table(s->sh, d.id);
  char why[400];
  if (!existed && ps__srv_create_fits(s, nt, why, sizeof why)) {
    ps__shard_drop(s->sh, d.id);
    ps__log(PS_LOG_WARN, "%s: refused", why);
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "%s", why);
    return;
  }
  if (!existed) ps__srv_sync_table(s, nt); /* replicated sync rounds (repl_sync.c) */
  /* A restored job: a new table's rows come from the checkpoint. A table that cannot be
   * restored is dropped again (it has no timer yet: nothing was pushed to it). */
  int rc = existed ? 0 : ps__srv_restore_table(s, ps__shard_table(s->sh, d.id));
  if (rc) {
    char msg[600];
    snprintf(msg, sizeof msg, "%s", ps_errmsg());
    ps__shard_drop(s->sh, d.id);
    ps__log(PS_LOG_ERROR, "%s", msg);
    ps__srv_reply_err(c, h, rc, "%s", msg);
    return;
  }
  ps__srv_reply_ok(c, h, 0);
}

/* The dispatch table: one handler per request type a server takes (a request family's
 * file: push.c, pull.c, peer.c, stats.c); every other type is refused at its header. */
typedef void (*frame_handler)(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b);

static void on_push_sparse(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__srv_on_push(s, c, h, b, 0);
}
static void on_push_dense(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  if (h->xport == PS_XPORT_PEER_MEM)
    ps__srv_on_push_peer(s, c, h, b);
  else
    ps__srv_on_push(s, c, h, b, 1);
}
static void on_pull_sparse(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__srv_on_pull(s, c, h, b, 0);
}
static void on_pull_dense(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__srv_on_pull(s, c, h, b, 1);
}
static void on_clock(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)c, (void)b;
  ps__shard_clock(s->sh, h->sender, h->clock);
  ps__srv_answer_ready_pulls(s);
}
static void on_stats(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)b;
  ps__srv_on_stats(s, c, h);
}
static void on_create_frame(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  on_create(s, c, h, b);
}
static void on_forward_sparse(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__srv_on_forward(s, c, h, b, 0);
}
static void on_forward_dense(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__srv_on_forward(s, c, h, b, 1);
}
static void on_forward_agg(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__srv_on_forward_agg(s, c, h, b);
}
static void on_forward_round(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__srv_on_forward_round(s, c, h, b);
}
static void on_replayed(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__srv_on_replayed(s, c, h, b);
}
static void on_sync_rows(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__srv_on_sync_rows(s, c, h, b);
}
static void on_sync_done(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__srv_on_sync_done(s, c, h, b);
}

static const frame_handler dispatch[PS_MSG__MAX] = {
    [PS_MSG_CREATE] = on_create_frame, [PS_MSG_PUSH] = on_push_sparse,  [PS_MSG_PUSH_DENSE] = on_push_dense,
    [PS_MSG_PULL] = on_pull_sparse,    [PS_MSG_PULL_DENSE] = on_pull_dense, [PS_MSG_CLOCK] = on_clock,
    [PS_MSG_STATS] = on_stats,         [PS_MSG_FORWARD] = on_forward_sparse, [PS_MSG_FORWARD_DENSE] = on_forward_dense,
    [PS_MSG_FORWARD_AGG] = on_forward_agg, [PS_MSG_FORWARD_ROUND] = on_forward_round, [PS_MSG_REPLAYED] = on_replayed,
    [PS_MSG_SYNC_ROWS] = on_sync_rows, [PS_MSG_SYNC_DONE] = on_sync_done,
};

static int data_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)c, (void)b;
  if (h->type < PS_MSG__MAX && dispatch[h->type]) return 0;
  return ps__fail(PS_ERR_PROTO, "%s frame not accepted by a server", ps__frame_type_name(h->type));
}

static void data_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__server *s = c->loop->data;
  if (s->stopping) return;
  s->frames++;
  if (ps__frame_is_data(h->type) && !s->id) { /* it knows no key of its own before its registration's answer */
    ps__srv_reply_err(c, h, PS_ERR_UNAVAILABLE, "this server's registration has not been answered yet; send again");
    return;
  }
  if (ps__frame_is_data(h->type) && ps__srv_fenced(s)) {
    ps__srv_reply_err(c, h, PS_ERR_UNAVAILABLE, "server %u stood still and may have been replaced; send again", s->id);
    return;
  }
  uint64_t out0 = c->bytes_out + c->write_queue_bytes, t0 = s->count ? ps__now_ns() : 0;
  dispatch[h->type](s, c, h, b); /* on_header let only these types through */
  ps__srv_metrics_frame(s, c, h, s->count ? ps__now_ns() - t0 : 0);
  s->poll_extra_ns = ps__poll_extra_ns(h->payload_len + (c->bytes_out + c->write_queue_bytes - out0));
  if (ps__frame_is_forward(h->type) && h->xport == PS_XPORT_INLINE && h->payload_len < PS_POLL_CHAIN_MAX_BYTES)
    ps__srv_poll_chain(s);
}

static void data_on_close(ps__conn *c, int status) {
  ps__server *s = c->loop->data;
  (void)status;
  ps__srv_drop_pulls_of(s, c);
  ps__srv_repl_conn_closed(s, c);
  ps__shm_forget(s->shm, c);
  ps__srv_metrics_close(s, c);
}

static const ps__conn_ops data_ops = {data_on_header, data_on_frame, data_on_close};

static void on_accept(void *arg, ps__conn *c) { ps__srv_metrics_accept(arg, c); }


/* ------------------------------------------------------------------ scheduler link (agent/agent.h) */

static void server_shutdown(ps__server *s, int result);

static void agent_registered(void *arg, uint32_t id, uint32_t rank) {
  ps__server *s = arg;
  s->id = id;
  s->rank = rank;
  /* A table created before this answer (id 0) cached an ownership of no slice under the
   * current ring: what is this server's changed with its id, not with the ring. */
  s->ring_gen++;
  ps__log(PS_LOG_INFO, "registered as server %u (rank %u)", s->id, s->rank);
}

/* The scheduler's membership: the ring (every server it lists, dead ones too: their
 * keys are lost, not ours), the engine's live set, and the job's state. */
static void agent_membership(void *arg, const ps__membership *m) {
  ps__server *s = arg;
  if (m->epoch < s->epoch) return;
  if (m->epoch > s->epoch) ps__srv_agg_before_membership(s, m); /* under the chains of the old view */
  uint32_t *ids = ps__calloc(m->n ? m->n : 1, sizeof *ids);
  size_t nsrv = 0;
  if (!ids) {
    ps__log(PS_LOG_ERROR, "out of memory applying the membership of epoch %llu", (unsigned long long)m->epoch);
    return;
  }
  uint32_t live_workers = 0;
  for (uint32_t i = 0; i < m->n; i++) {
    const ps__member *x = &m->m[i];
    if (x->role == PS_ROLE_SERVER) ids[nsrv++] = x->id;
    if (x->role != PS_ROLE_WORKER) continue;
    live_workers += x->alive ? 1 : 0;
    ps__shard_member(s->sh, x->id, x->alive);
  }
  if (ps__srv_repl_membership(s, m))
    ps__log(PS_LOG_ERROR, "out of memory applying the membership of epoch %llu", (unsigned long long)m->epoch);
  ps__ring *ring = nsrv ? ps__ring_new(ids, nsrv, s->o.vnodes, m->epoch) : NULL;
  if (ring && ps__ring_set_replicas(ring, s->replicas)) {
    ps__log(PS_LOG_ERROR, "out of memory for the replica chains of epoch %llu", (unsigned long long)m->epoch);
    ps__ring_free(ring);
    ring = NULL;
  }
  if (ring) {
    ps__ring_free(s->ring);
    s->ring = ring;
    s->ring_gen++;
  }
  free(ids);
  s->epoch = m->epoch;
  ps__srv_sync_epoch(s); /* the REPLAYED lists that came before this membership */
  s->sh->started = m->started;
  ps__srv_repair_membership(s, m); /* copies to or from a replacement (repair.c) */
  if (m->started == 2) { /* the scheduler finished the job */
    ps__log(PS_LOG_INFO, "the job is finished; stopping");
    server_shutdown(s, 0);
    return;
  }
  if (s->o.stop_without_workers && m->started == 1 && !live_workers) {
    ps__log(PS_LOG_INFO, "every worker has left the job; a colocated server stops");
    server_shutdown(s, 0);
    return;
  }
  ps__shard_advance(s->sh);
  ps__srv_answer_ready_pulls(s);
}

static void agent_lost(void *arg, int status, const char *msg) {
  ps__server *s = arg;
  if (s->stopping) return;
  ps__log(PS_LOG_ERROR, "%s; stopping", msg);
  server_shutdown(s, status ? status : PS_ERR_UNAVAILABLE);
}

/* The scheduler went away: keep every table and keep serving, and wait for it. */
static void agent_detached(void *arg, const char *msg) {
  ps__server *s = arg;
  ps__log(PS_LOG_WARN, "%s; serving on, waiting up to %u ms for it to come back", msg, s->o.rejoin_ms);
}

/* Tell the scheduler which live workers have held a sync round back for a heartbeat
 * period or more: it removes one held longer than its heartbeat timeout (a worker that
 * registered and heartbeats but never clocks must not stall the job). */
static void report_laggards(ps__server *s) {
  ps__stall v[PS_STALL_MAX];
  if (!s->agent.conn || s->agent.rejoining || !s->id) return;
  size_t n = ps__sync_laggards(s->sh, ps__now_ms(), s->o.heartbeat_ms, v, PS_STALL_MAX);
  if (!n) return;
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__stall_encode(&w, v, n);
  ps__frame_hdr h = {.type = PS_MSG_STALL, .sender = s->id};
  if (!w.oom) ps__conn_send_ctrl(s->agent.conn, &h, w.data, w.len);
  ps__wbuf_free(&w);
}

/* Each heartbeat: unmap the workers' shared buffers they freed; the replication fence;
 * the workers holding sync rounds back. */
static void agent_tick(void *arg) {
  ps__shm_sweep(((ps__server *)arg)->shm);
  ps__srv_repl_tick(arg);
  ps__srv_ckpt_tick(arg);
  report_laggards(arg);
}

/* Frames of the scheduler's beyond what the agent handles: a checkpoint's requests. */
static int agent_on_header(void *arg, const ps__frame_hdr *h, ps__body *b) {
  (void)arg, (void)b;
  if (h->type == PS_MSG_CKPT) return 0;
  return ps__fail(PS_ERR_PROTO, "unexpected %s frame from the scheduler", ps__frame_type_name(h->type));
}

static void agent_on_frame(void *arg, const ps__frame_hdr *h, ps__body *b) {
  ps__server *s = arg;
  if (h->type == PS_MSG_CKPT && !s->stopping) ps__srv_on_ckpt(s, h, b);
}

static int agent_begin(ps__server *s) {
  ps__agent_opts o = {.sched_host = s->o.sched_host, .sched_port = s->o.sched_port,
                      .heartbeat_ms = s->o.heartbeat_ms, .connect_timeout_ms = s->o.connect_timeout_ms,
                      .pool = s->pool, .max_payload = 1u << 24, .rejoin_ms = s->o.rejoin_ms};
  o.hello.role = PS_ROLE_SERVER;
  o.hello.port = (uint16_t)s->tcp.port;
  o.hello.pid = (uint32_t)getpid();
  o.hello.join = (uint8_t)(s->o.join ? 1 : 0);
  snprintf(o.hello.host, sizeof o.hello.host, "%s", s->o.host);
  snprintf(o.hello.unix_path, sizeof o.hello.unix_path, "%s", s->unix_path);
  ps__hostid(o.hello.hostid, sizeof o.hello.hostid);
  if (s->unix_path[0] && ps__pm_usable()) o.hello.caps |= PS_CAP_PEER_MEM;
  ps__agent_cbs cb = {.arg = s, .registered = agent_registered, .membership = agent_membership, .lost = agent_lost,
                      .tick = agent_tick, .on_header = agent_on_header, .on_frame = agent_on_frame,
                      .detached = agent_detached};
  int rc = ps__agent_init(&s->agent, &s->loop, &o, &cb);
  if (rc) return rc;
  s->agent_inited = 1;
  return ps__agent_start(&s->agent);
}

static void server_shutdown(ps__server *s, int result) {
  if (s->stopping) return;
  s->stopping = 1;
  s->result = result;
  if (s->metrics_on) ps__srv_metrics_tick(s); /* the last figures, to the scheduler too */
  if (s->agent_inited) ps__agent_stop(&s->agent, result == 0); /* a requested stop leaves the job cleanly */
  ps__listener_close(&s->tcp);
  if (s->unix_path[0]) ps__listener_close(&s->unix_l);
  ps__frame_budget_close(&s->fb);
  ps__loop_close_all(&s->loop);
  if (s->mail) ps__mailbox_close(s->mail);
  s->mail = NULL;
}

static void do_stop(void *arg) { server_shutdown(arg, 0); }

void ps__srv_fail(ps__server *s, int status) { server_shutdown(s, status); }


/* ------------------------------------------------------------------ lifecycle */

/* ------------------------------------------------------------------ AF_UNIX socket files */

#define SOCKET_DIR "/tmp"
#define SOCKET_MIN_AGE_S 10

/* Nobody listens on the socket at path: a connection to it is refused. */
static int socket_dead(const char *path) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof a.sun_path) return 0;
  memcpy(a.sun_path, path, strlen(path) + 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  int dead = connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && errno == ECONNREFUSED;
  close(fd);
  return dead;
}

/* Remove the socket files in dir that servers killed before they could (SIGKILL, a
 * crash) left behind: pshard-PID-PORT-N.sock, a socket, this user's, of a process that
 * does not exist here, on which nobody listens (a server of another pid namespace
 * sharing /tmp, which containers on one host may do, still does), made SOCKET_MIN_AGE_S
 * ago or more (such a server may be between its bind and its listen). Anything else is
 * kept. Without this every killed server's file stays in /tmp. */
static void sweep_sockets(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  unsigned removed = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    int pid, port, n, end = 0;
    if (sscanf(e->d_name, "pshard-%d-%d-%d.sock%n", &pid, &port, &n, &end) != 3 || !end || e->d_name[end] ||
        pid <= 0 || pid == (int)getpid())
      continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue; /* alive, or not ours to know */
    char path[PS_PATH_MAX];
    struct stat st;
    if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path) continue;
    if (lstat(path, &st) || !S_ISSOCK(st.st_mode) || st.st_uid != getuid() ||
        st.st_mtime + SOCKET_MIN_AGE_S > time(NULL) || !socket_dead(path))
      continue;
    if (unlink(path) == 0) removed++;
  }
  closedir(d);
  if (removed) ps__log(PS_LOG_INFO, "removed %u socket file%s of servers no longer running from %s", removed,
                       removed == 1 ? "" : "s", dir);
}

int ps__server_create(const ps__server_opts *o, ps__server **out) {
  ps__server *s = ps__calloc(1, sizeof *s);
  int rc;
  if (!s) return ps__fail(PS_ERR_NOMEM, "out of memory");
  s->o = *o;
  s->pid = (int)getpid();
  s->ring_gen = 1;
  if (!s->o.host) s->o.host = "127.0.0.1";
  if (!s->o.heartbeat_ms) s->o.heartbeat_ms = 200;
  if (!s->o.vnodes) s->o.vnodes = 128;
  if (!s->o.max_payload) s->o.max_payload = 2048ull << 20;
  if (!s->o.connect_timeout_ms) s->o.connect_timeout_ms = 60000;
  if ((rc = ps__srv_limits(s))) {
    free(s);
    return rc;
  }
  uv_loop_init(&s->loop);
  s->loop.data = s;
  s->pool = ps__pool_new(1ull << 30);
  ps__shard_hooks hooks = {.arg = s, .alloc = hook_alloc, .release = hook_release, .arm_flush = hook_arm_flush,
                           .par = hook_par, .round_apply = ps__srv_round_apply, .round_done = ps__srv_round_done,
                           .cut = ps__srv_cut, .agg_applied = ps__srv_agg_applied,
                           .round_applied = ps__srv_round_applied};
  s->sh = ps__shard_new(&hooks);
  s->mail = ps__mailbox_new(&s->loop);
  uv_idle_init(&s->loop, &s->apply_idle);
  s->apply_idle.data = s;
  ps__frame_budget_init(&s->fb, &s->loop, s->o.frame_budget, s->o.frame_deadline_ms);
  if (!s->pool || !s->mail || !s->sh) {
    rc = ps__fail(PS_ERR_NOMEM, "out of memory");
    goto fail;
  }
  s->sh->mem_limit = s->o.memory_budget;
  ps__srv_fwd_buf_init(s);
  rc = ps__listen_tcp(&s->tcp, &s->loop, s->o.host, s->o.port, &data_ops, on_accept, s, s->pool, s->o.max_payload);
  if (rc) goto fail;
  s->tcp.budget = &s->fb;
  if (s->o.use_unix) {
    static int seq;
    sweep_sockets(SOCKET_DIR);
    snprintf(s->unix_path, sizeof s->unix_path, SOCKET_DIR "/pshard-%d-%d-%d.sock", (int)getpid(), s->tcp.port,
             __atomic_fetch_add(&seq, 1, __ATOMIC_RELAXED));
    if (ps__listen_unix(&s->unix_l, &s->loop, s->unix_path, &data_ops, on_accept, s, s->pool, s->o.max_payload)) {
      ps__log(PS_LOG_WARN, "no AF_UNIX listener: %s", ps_errmsg());
      s->unix_path[0] = '\0';
    } else {
      s->unix_l.budget = &s->fb;
    }
  }
  if (s->o.restore_dir && s->o.restore_dir[0] && (rc = ps__srv_restore_open(s, s->o.restore_dir))) goto fail;
  if ((rc = ps__srv_metrics_start(s))) goto fail;
  if ((rc = agent_begin(s))) goto fail;
  *out = s;
  return 0;
fail: {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  server_shutdown(s, rc);
  ps__server_destroy(s);
  return ps__fail(rc, "%s", msg);
}
}

int ps__server_port(const ps__server *s) { return s->tcp.port; }

int ps__server_http_port(const ps__server *s) { return s->http ? ps__http_port(s->http) : -1; }

/* With poll_us, the loop does not sleep for poll_us after a worker's frame: it polls
 * (epoll with no wait). A worker's next request usually follows within that (the other
 * half of a push and pull, the next batch), and a server asleep on an idle virtual CPU
 * pays the hypervisor's wake-up for it: tens of microseconds, several loopback round
 * trips. A frame that brought or answered with many bytes over the socket extends the
 * window by the time the worker needs for them (ps__poll_extra_ns: 0.5 ms per MiB, at
 * most 1 ms): a worker reading a 1 MiB reply sends its next request only after that.
 * Down a chain the window is longer after a small frame (ps__srv_poll_chain): a
 * member's next frame is the next forward, a round trip of the worker's later, and a
 * head's, after its forward's answer, the worker's next push; one more sleeping server
 * would add its wake-up to every small replicated push. (Not after large ones: on two
 * busy cores the polling takes the CPU their copies need.) A busy server never sleeps
 * anyway; an idle one polls once per burst. */
int ps__server_run(ps__server *s) {
  ps__block_sigpipe();
  uint64_t poll_ns = (uint64_t)s->o.poll_us * 1000u;
  if (poll_ns == 0 || sysconf(_SC_NPROCESSORS_ONLN) < 2) {
    uv_run(&s->loop, UV_RUN_DEFAULT);
    return s->result;
  }
  uint64_t seen = s->frames, last = 0;
  for (;;) {
    int more = uv_run(&s->loop, ps__now_ns() - last < poll_ns + s->poll_extra_ns ? UV_RUN_NOWAIT : UV_RUN_ONCE);
    if (!more) break;
    if (s->frames != seen) {
      seen = s->frames;
      last = ps__now_ns();
    }
  }
  return s->result;
}

void ps__server_stop(ps__server *s) {
  if (s && s->mail) ps__mailbox_post(s->mail, do_stop, s);
}

void ps__server_destroy(ps__server *s) {
  if (!s) return;
  server_shutdown(s, s->result);
  uv_run(&s->loop, UV_RUN_DEFAULT);
  uv_loop_close(&s->loop);
  ps__srv_free_pulls(s);
  ps__srv_repl_free(s);
  ps__srv_ckpt_stop(s);
  ps__srv_restore_free(s);
  ps__srv_metrics_free(s);
  for (size_t i = 0; s->sh && i < s->sh->ntables; i++)
    if (s->sh->tables[i]) free(s->sh->tables[i]->owner); /* its timer was closed with the loop */
  ps__shard_free(s->sh);
  ps__srv_fwd_body_sweep(s, 1); /* after the engine gave back the bodies it held */
  ps__ring_free(s->ring);
  ps__pool_free(s->pool);
  ps__par_free(s->par);
  free(s->pm_chunk);
  ps__shm_cache_free(s->shm);
  free(s);
}
