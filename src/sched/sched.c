/*
 * sched.c - the scheduler.
 *
 * One loop thread owns everything. Nodes connect and send HELLO; the scheduler gives
 * each a node id and a rank within its role. When the expected servers and workers
 * have registered the job starts: a MEMBERSHIP frame (epoch, members, liveness) goes to
 * every node. Any later change (a node dies, leaves or joins) bumps the epoch and is
 * broadcast again. A node is dead when its connection closes or when it has sent
 * nothing for heartbeat_timeout_ms. Barriers complete when every live worker arrived;
 * a death re-checks them so no barrier waits on a dead worker.
 */
#include "sched/sched.h"

#include <string.h>

#include "common/config.h"
#include "common/ring.h"
#include "net/auth.h"
#include "sched/sched_int.h"

/* Short local names for the shared state (sched_int.h). */
typedef ps__sched_node node;
typedef ps__sched_table table_entry;
typedef ps__sched_metric metric;

static node *node_by_conn(ps__sched *s, ps__conn *c) {
  for (size_t i = 0; i < s->nnodes; i++)
    if (s->nodes[i].conn == c) return &s->nodes[i];
  return NULL;
}

static node *node_by_id(ps__sched *s, uint32_t id) {
  for (size_t i = 0; i < s->nnodes; i++)
    if (s->nodes[i].m.id == id) return &s->nodes[i];
  return NULL;
}

int ps__sched_server_alive(const ps__sched *s, uint32_t id) {
  for (size_t i = 0; i < s->nnodes; i++)
    if (s->nodes[i].m.id == id) return s->nodes[i].m.alive && s->nodes[i].m.role == PS_ROLE_SERVER;
  return 0;
}

size_t ps__sched_count_alive(ps__sched *s, uint8_t role) {
  size_t n = 0;
  for (size_t i = 0; i < s->nnodes; i++) n += s->nodes[i].m.alive && s->nodes[i].m.role == role;
  return n;
}

static void broadcast_membership(ps__sched *s) {
  ps__membership m;
  ps__wbuf w;
  memset(&m, 0, sizeof m);
  m.epoch = s->epoch;
  m.servers_expected = s->o.servers;
  m.workers_expected = s->o.workers;
  m.started = (uint8_t)s->started;
  m.replicas = (uint8_t)s->o.replicas;
  m.n = (uint32_t)s->nnodes;
  m.m = ps__calloc(s->nnodes ? s->nnodes : 1, sizeof *m.m);
  if (!m.m) return;
  for (size_t i = 0; i < s->nnodes; i++) m.m[i] = s->nodes[i].m;
  ps__wbuf_init(&w);
  ps__membership_encode(&w, &m);
  free(m.m);
  if (w.oom) return;
  for (size_t i = 0; i < s->nnodes; i++) {
    node *n = &s->nodes[i];
    if (!n->m.alive || !n->conn) continue;
    ps__frame_hdr h = {.type = PS_MSG_MEMBERSHIP, .epoch = s->epoch};
    ps__conn_send_ctrl(n->conn, &h, w.data, w.len);
  }
  ps__wbuf_free(&w);
}

/* A change of the job's membership: kept in the state (state.c) before any node hears
 * of it, so that no node ever sees a membership a restarted scheduler lacks; then the
 * answer r on c (if any) and the membership to every node, once the job started (or
 * always: a replacement's admission and its copy's end). */
static void announce(ps__sched *s, ps__conn *c, ps__frame_hdr *r, int always) {
  ps__sched_state_save(s);
  if (c) ps__conn_send_ctrl(c, r, NULL, 0);
  if (s->started || always) broadcast_membership(s);
}

static void maybe_start(ps__sched *s) {
  if (s->started) return;
  if (ps__sched_count_alive(s, PS_ROLE_SERVER) >= s->o.servers && ps__sched_count_alive(s, PS_ROLE_WORKER) >= s->o.workers) {
    s->started = 1;
    ps__log(PS_LOG_INFO, "job started: %u servers, %u workers", s->o.servers, s->o.workers);
  }
}

static void check_barriers(ps__sched *s) {
  /* A barrier completes when every live worker waits in it. Sequences are per worker
   * and advance in step, so the smallest waiting sequence is the one to check. */
  int64_t seq = -1;
  size_t alive = 0, waiting = 0;
  for (size_t i = 0; i < s->nnodes; i++) {
    node *n = &s->nodes[i];
    if (!n->m.alive || n->m.role != PS_ROLE_WORKER) continue;
    alive++;
    if (n->barrier_seq >= 0) {
      waiting++;
      if (seq < 0 || n->barrier_seq < seq) seq = n->barrier_seq;
    }
  }
  if (alive == 0 || waiting < alive) return;
  for (size_t i = 0; i < s->nnodes; i++) {
    node *n = &s->nodes[i];
    if (!n->m.alive || n->m.role != PS_ROLE_WORKER || n->barrier_seq != seq) continue;
    ps__frame_hdr h = {.type = PS_MSG_BARRIER | PS_FRAME_REPLY, .req_id = n->barrier_req, .clock = seq};
    ps__conn_send_ctrl(n->conn, &h, NULL, 0);
    n->barrier_seq = -1;
    n->barrier_done = seq;
  }
}

static void do_stop(void *arg);

/* Is there a chain (the R servers that hold a key range) that contains server `id` (any
 * chain when id is 0) and would have no head (ring.h, the head rule: no live member that
 * holds a copy) without `id`? 1 also when out of memory. */
static int chain_without_copy(ps__sched *s, uint32_t id) {
  uint32_t *ids = ps__calloc(s->nnodes ? s->nnodes : 1, sizeof *ids);
  size_t k = 0;
  if (!ids) return 1;
  for (size_t i = 0; i < s->nnodes; i++)
    if (s->nodes[i].m.role == PS_ROLE_SERVER) ids[k++] = s->nodes[i].m.id;
  ps__ring *r = k ? ps__ring_new(ids, k, s->o.vnodes, s->epoch) : NULL;
  free(ids);
  int lost = 0;
  if (!r || ps__ring_set_replicas(r, s->o.replicas)) {
    ps__ring_free(r);
    return 1;
  }
  for (size_t i = 0; i < ps__ring_nroutes(r) && !lost; i++) {
    uint32_t c[PS_MAX_REPLICAS];
    uint8_t st[PS_MAX_REPLICAS];
    size_t m = ps__ring_route(r, i, c), has = id == 0;
    if (m > PS_MAX_REPLICAS) m = PS_MAX_REPLICAS;
    for (size_t j = 0; j < m; j++) {
      const node *x = node_by_id(s, c[j]);
      if (id && c[j] == id) has = 1;
      st[j] = (id && c[j] == id) || !x ? PS_CHAIN_DEAD : ps__member_chain_state(&x->m);
    }
    lost = has && ps__chain_head(st, NULL, m) < 0; /* whether it has one, not which */
  }
  ps__ring_free(r);
  return lost;
}

/* Would removing server n leave a chain with no live member? With R = 1 every server is
 * the last copy of its keys, but a dead one is removed anyway (its keys fail loudly);
 * this guards replicated jobs only. */
static int last_copy(ps__sched *s, const node *n) { return s->o.replicas >= 2 && chain_without_copy(s, n->m.id); }

int ps__sched_every_range_live(ps__sched *s) { return s->o.replicas >= 2 && !chain_without_copy(s, 0); }

static void finish_tick(uv_timer_t *t) { do_stop(t->data); }

static void mark_dead(ps__sched *s, node *n, const char *why) {
  if (!n->m.alive) return;
  if (n->m.role == PS_ROLE_WORKER && s->started && strcmp(why, "left the job")) s->worker_failed = 1; /* before: a new one takes its rank */
  n->m.alive = 0;
  n->m.syncing = 0;
  n->dead_ms = ps__now_ms();
  n->barrier_seq = -1;
  s->epoch++;
  ps__log(strcmp(why, "left the job") ? PS_LOG_WARN : PS_LOG_INFO, "%s %u (rank %u) removed: %s; epoch %llu", n->m.role == PS_ROLE_SERVER ? "server" : "worker",
          n->m.id, n->m.rank, why, (unsigned long long)s->epoch);
  if (n->conn) {
    ps__sched_task_drop_waiters(s, n->conn, 0);
    n->conn->udata = NULL;
    ps__conn_close(n->conn, PS_ERR_CLOSED);
    n->conn = NULL;
  }
  if (n->m.role == PS_ROLE_WORKER) ps__sched_task_requeue(s, n->m.id);
  if (n->m.role == PS_ROLE_SERVER) ps__sched_ckpt_node_dead(s, n, why);
  if (s->o.exit_when_done && s->started && !s->finished && n->m.role == PS_ROLE_WORKER &&
      ps__sched_count_alive(s, PS_ROLE_WORKER) == 0) {
    /* The job is over: tell the servers (started = 2), then stop shortly after. */
    s->finished = 1;
    s->started = 2;
    s->result = s->worker_failed ? 1 : 0;
    ps__log(PS_LOG_INFO, "every worker has left; the job is finished");
    uv_timer_start(&s->finish_timer, finish_tick, 300, 0);
  }
  announce(s, NULL, NULL, 0);
  check_barriers(s);
}

/* A node registered before (by this scheduler, or by the one whose state it restarted
 * from) comes back after its connection broke: it names its id in `sender`. */
static void retake(ps__sched *s, ps__conn *c, const ps__frame_hdr *h, const ps__hello *hello, node *n);

static void on_rejoin(ps__sched *s, ps__conn *c, const ps__frame_hdr *h, const ps__hello *hello) {
  node *n = NULL;
  for (size_t i = 0; i < s->nnodes && !n; i++)
    if (s->nodes[i].m.id == h->sender) n = &s->nodes[i];
  const char *why = !n ? "is not a member of this job (did the scheduler lose its state?)"
                   : n->m.role != hello->role ? "registered with another role"
                   : !n->m.alive ? "was removed from the job"
                   : n->conn ? "is connected already" : NULL;
  if (why) {
    char msg[200];
    snprintf(msg, sizeof msg, "node %u %s", h->sender, why);
    ps__conn_send_error(c, h, PS_ERR_UNAVAILABLE, msg);
    ps__conn_close_after_flush(c, PS_ERR_UNAVAILABLE);
    return;
  }
  retake(s, c, h, hello, n);
}

/* A registered node that is not connected (its connection broke, or this scheduler
 * restarted from its state) is back on connection c. */
static void retake(ps__sched *s, ps__conn *c, const ps__frame_hdr *h, const ps__hello *hello, node *n) {
  n->conn = c;
  c->udata = n;
  ps__conn_auth_bind(c, n->m.id);
  n->last_seen_ms = ps__now_ms();
  n->m.port = hello->port;
  memcpy(n->m.host, hello->host, sizeof n->m.host);
  memcpy(n->m.unix_path, hello->unix_path, sizeof n->m.unix_path);
  n->m.caps = hello->caps;
  if (h->sender)
    ps__log(PS_LOG_INFO, "%s %u (rank %u) came back from %s", hello->role == PS_ROLE_SERVER ? "server" : "worker",
            n->m.id, n->m.rank, c->peer);
  else
    ps__log(PS_LOG_WARN, "%s %u (rank %u) registered again from %s: the answer to its registration was lost; it keeps its id and rank",
            hello->role == PS_ROLE_SERVER ? "server" : "worker", n->m.id, n->m.rank, c->peer);
  ps__frame_hdr r = {.type = PS_MSG_HELLO | PS_FRAME_REPLY, .req_id = h->req_id, .table = n->m.id,
                     .batch = n->m.rank, .epoch = s->epoch, .clock = s->start_clock};
  s->epoch++;
  announce(s, c, &r, 0);
}

static void admit(ps__sched *s, ps__conn *c, const ps__frame_hdr *h, const ps__hello *hello);

/* Node n (its id set) is the process that sent hello on c from now on: alive, at the
 * addresses and with the token hello names. */
static void take_place(node *n, ps__conn *c, const ps__hello *hello) {
  n->conn = c;
  c->udata = n; /* only used as a marker; lookups go through node_by_conn */
  ps__conn_auth_bind(c, n->m.id); /* its frames name this node from now on */
  n->m.alive = 1;
  n->m.port = hello->port;
  memcpy(n->m.host, hello->host, sizeof n->m.host);
  memcpy(n->m.unix_path, hello->unix_path, sizeof n->m.unix_path);
  memcpy(n->m.hostid, hello->hostid, sizeof n->m.hostid);
  n->m.caps = hello->caps;
  n->token = hello->token;
  n->last_seen_ms = ps__now_ms();
  n->barrier_seq = -1;
}

static void refuse_hello(ps__conn *c, const ps__frame_hdr *h, int err, const char *msg) {
  ps__log(PS_LOG_WARN, "refused a node from %s: %s", c->peer, msg);
  ps__conn_send_error(c, h, err, msg);
  ps__conn_close_after_flush(c, err);
}

/* A server registers as a replacement (pshard server --join): it takes the id and rank
 * of the dead server that died first and still has a live copy of each of its key
 * ranges, so the ring (and so every key's place) is unchanged. It is late (it heads a
 * chain only when none of the members that were there before is left) and syncing (it
 * holds no copy until the chains' tails have copied their rows to it, which it says
 * with SYNCED). One replacement syncs at a time. */
static void on_join(ps__sched *s, ps__conn *c, const ps__frame_hdr *h, const ps__hello *hello) {
  char msg[240];
  if (hello->role != PS_ROLE_SERVER) {
    refuse_hello(c, h, PS_ERR_INVALID, "only a server joins as a replacement");
    return;
  }
  if (!s->started) {
    /* Before the start nothing is to be copied: it registers as any server does, in a
     * dead one's rank or the next (so a launcher may start every server with --join,
     * and one that restarts takes its own place back). */
    admit(s, c, h, hello);
    return;
  }
  if (s->o.replicas < 2) {
    refuse_hello(c, h, PS_ERR_UNAVAILABLE, "the job keeps one copy of every key (replicas 1): a dead server's rows are lost, and a replacement has nothing to copy");
    return;
  }
  node *n = NULL;
  size_t dead = 0;
  for (size_t i = 0; i < s->nnodes; i++) {
    node *x = &s->nodes[i];
    if (x->m.role != PS_ROLE_SERVER) continue;
    if (x->m.alive && x->m.syncing) {
      snprintf(msg, sizeof msg, "server %u is still copying its rows as a replacement; join again once it is done", x->m.id);
      refuse_hello(c, h, PS_ERR_UNAVAILABLE, msg);
      return;
    }
    if (x->m.alive) continue;
    dead++;
    if (chain_without_copy(s, x->m.id)) continue; /* its keys have no live copy to copy from */
    if (!n || x->dead_ms < n->dead_ms) n = x;
  }
  if (!n) {
    refuse_hello(c, h, PS_ERR_UNAVAILABLE, dead ? "no dead server of the job has a live copy of its keys left: there is nothing to copy"
                                                : "no server of the job is dead: a replacement takes a dead server's place (the job has its servers)");
    return;
  }
  uint32_t late = 0; /* its admission number: after every replacement before it (ring.h) */
  for (size_t i = 0; i < s->nnodes; i++)
    if (s->nodes[i].m.late > late) late = s->nodes[i].m.late;
  take_place(n, c, hello);
  n->m.late = late + 1;
  n->m.syncing = 1;
  n->last_copy_warned = 0;
  s->epoch++;
  ps__log(PS_LOG_INFO, "server %u (rank %u) replaced by a new server from %s; it copies its rows; epoch %llu", n->m.id,
          n->m.rank, c->peer, (unsigned long long)s->epoch);
  ps__frame_hdr r = {.type = PS_MSG_HELLO | PS_FRAME_REPLY, .req_id = h->req_id, .table = n->m.id,
                     .batch = n->m.rank, .epoch = s->epoch, .clock = s->start_clock};
  announce(s, c, &r, 1);
}

/* A replacement has every copy it waited for: it holds its chains' rows from now on. */
static void on_synced(ps__sched *s, node *n, const ps__frame_hdr *h) {
  if (n->m.role != PS_ROLE_SERVER || !n->m.syncing) return;
  n->m.syncing = 0;
  s->epoch++;
  ps__log(PS_LOG_INFO, "server %u (rank %u) has copied its rows (at its epoch %llu); epoch %llu", n->m.id, n->m.rank,
          (unsigned long long)h->epoch, (unsigned long long)s->epoch);
  /* (Told first, and the scheduler dead before its state said so, the members would see
   * the replacement hold its copies, then copying again, and forward it nothing until it
   * said so again.) */
  announce(s, NULL, NULL, 1);
}

static void on_hello(ps__sched *s, ps__conn *c, const ps__frame_hdr *h, const ps__body *b) {
  ps__hello hello;
  if (node_by_conn(s, c)) {
    ps__conn_send_error(c, h, PS_ERR_PROTO, "already registered");
    return;
  }
  if (ps__hello_decode(b->buf, b->len, &hello)) {
    ps__conn_send_error(c, h, PS_ERR_PROTO, ps_errmsg());
    ps__conn_close_after_flush(c, PS_ERR_PROTO);
    return;
  }
  if (c->authed && c->auth_role != hello.role) { /* the handshake said which role it is */
    ps__conn_send_error(c, h, PS_ERR_AUTH, "hello names another role than the connection authenticated as");
    ps__conn_close_after_flush(c, PS_ERR_AUTH);
    return;
  }
  if (h->sender) {
    on_rejoin(s, c, h, &hello);
    return;
  }
  if (hello.join) {
    on_join(s, c, h, &hello);
    return;
  }
  /* The same process registering again: its first registration was taken (and, by the
   * scheduler this one restarted from, saved), but the answer was lost. */
  for (size_t i = 0; hello.token && i < s->nnodes; i++) {
    node *x = &s->nodes[i];
    if (x->token == hello.token && x->m.role == hello.role && x->m.alive && !x->conn) {
      retake(s, c, h, &hello, x);
      return;
    }
  }
  admit(s, c, h, &hello);
}

/* The place of a node of this role that died before the job started, the lowest rank
 * first, or NULL. Such a node held nothing yet (no push, no table, no task reaches a
 * node before the start), so a new one takes its rank, and the job starts once every
 * rank is held again, instead of waiting for the dead one forever. */
static node *vacancy(ps__sched *s, uint8_t role) {
  node *v = NULL;
  if (s->started) return NULL;
  for (size_t i = 0; i < s->nnodes; i++) {
    node *x = &s->nodes[i];
    if (x->m.role == role && !x->m.alive && (!v || x->m.rank < v->m.rank)) v = x;
  }
  return v;
}

/* A new node registers: in the place of one that died before the start, or in a new
 * place (the next rank). */
static void admit(ps__sched *s, ps__conn *c, const ps__frame_hdr *h, const ps__hello *hello) {
  node *n = vacancy(s, hello->role);
  if (n) {
    uint32_t old = n->m.id, rank = n->m.rank;
    free(n->prom);
    free(n->hist);
    memset(n, 0, sizeof *n);
    n->m.rank = rank;
    n->m.id = s->next_id++;
    ps__log(PS_LOG_INFO, "%s %u died before the job started: a new one takes its rank %u",
            hello->role == PS_ROLE_SERVER ? "server" : "worker", old, rank);
  } else if (hello->role == PS_ROLE_SERVER && s->nserver_ranks >= s->o.servers) {
    /* Moving keys to a new server needs migration, which is not built yet: taking it
     * into the ring would lose the rows it became the owner of. */
    ps__conn_send_error(c, h, PS_ERR_UNAVAILABLE, "the job already has its servers; adding a server to a running job is not supported");
    ps__conn_close_after_flush(c, PS_ERR_UNAVAILABLE);
    return;
  }
  if (!n && s->nnodes == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 16;
    node *nn = ps__realloc(s->nodes, cap * sizeof *nn);
    if (!nn) {
      ps__conn_send_error(c, h, PS_ERR_NOMEM, "scheduler out of memory");
      return;
    }
    s->nodes = nn;
    s->cap = cap;
  }
  if (!n) {
    n = &s->nodes[s->nnodes++];
    memset(n, 0, sizeof *n);
    n->m.id = s->next_id++;
    n->m.rank = hello->role == PS_ROLE_SERVER ? s->nserver_ranks++ : s->nworker_ranks++;
  }
  n->m.role = hello->role;
  take_place(n, c, hello);
  ps__log(PS_LOG_INFO, "%s %u registered as rank %u from %s", hello->role == PS_ROLE_SERVER ? "server" : "worker",
          n->m.id, n->m.rank, c->peer);
  ps__frame_hdr r = {.type = PS_MSG_HELLO | PS_FRAME_REPLY, .req_id = h->req_id, .sender = 0,
                     .table = n->m.id, .batch = n->m.rank, .epoch = s->epoch, .clock = s->start_clock};
  maybe_start(s);
  if (s->started) s->epoch++;
  announce(s, c, &r, 0);
}

static void on_declare(ps__sched *s, ps__conn *c, const ps__frame_hdr *h, const ps__body *b) {
  ps__declare d;
  ps__table_spec spec;
  char err[256];
  if (ps__declare_decode(b->buf, b->len, &d)) {
    ps__conn_send_error(c, h, PS_ERR_PROTO, ps_errmsg());
    return;
  }
  int rc = ps__table_spec_parse(&spec, d.name, d.kind, d.size, d.options, err, sizeof err);
  if (rc) {
    ps__conn_send_error(c, h, rc, err);
    return;
  }
  for (size_t i = 0; i < s->ntables; i++) {
    table_entry *t = &s->tables[i];
    if (strcmp(t->d.name, d.name)) continue;
    if (memcmp(&t->spec, &spec, sizeof spec)) {
      /* Both declarations, and in a restored job the likely cause. */
      char msg[2 * PS_OPTS_MAX + PS_NAME_MAX + 256];
      snprintf(msg, sizeof msg, "table '%s' already declared as %s %llu '%s', not as %s %llu '%s'%s", d.name,
               t->d.kind == 1 ? "dense" : "sparse", (unsigned long long)t->d.size, t->d.options,
               d.kind == 1 ? "dense" : "sparse", (unsigned long long)d.size, d.options,
               s->o.restore_dir && s->o.restore_dir[0] ? " (a restored job declares its tables as its checkpoint has them)" : "");
      ps__conn_send_error(c, h, PS_ERR_CONFLICT, msg);
      return;
    }
    ps__frame_hdr r = {.type = PS_MSG_DECLARE | PS_FRAME_REPLY, .req_id = h->req_id, .table = t->d.id};
    ps__conn_send_ctrl(c, &r, NULL, 0);
    return;
  }
  table_entry *nt = ps__realloc(s->tables, (s->ntables + 1) * sizeof *nt);
  if (!nt) {
    ps__conn_send_error(c, h, PS_ERR_NOMEM, "scheduler out of memory");
    return;
  }
  s->tables = nt;
  d.id = 1; /* after the largest id: a restored registry keeps its ids */
  for (size_t i = 0; i < s->ntables; i++)
    if (s->tables[i].d.id >= d.id) d.id = s->tables[i].d.id + 1;
  s->tables[s->ntables].d = d;
  s->tables[s->ntables].spec = spec;
  s->ntables++;
  ps__sched_state_save(s); /* the table is kept before its id is given out */
  ps__frame_hdr r = {.type = PS_MSG_DECLARE | PS_FRAME_REPLY, .req_id = h->req_id, .table = d.id};
  ps__conn_send_ctrl(c, &r, NULL, 0);
}

static void on_metric(ps__sched *s, node *n, const ps__frame_hdr *h, const ps__body *b) {
  ps__rbuf r;
  char name[64];
  ps__rbuf_init(&r, b->buf, b->len);
  ps__rbuf_str(&r, name, sizeof name);
  double v = ps__rbuf_f64(&r);
  if (r.err) return;
  for (size_t i = 0; i < s->nmetrics; i++) {
    metric *m = &s->metrics[i];
    if (m->node == n->m.id && !strcmp(m->name, name)) {
      m->value = v;
      m->clock = h->clock;
      m->count++;
      return;
    }
  }
  if (n->nmetrics >= PS__METRICS_PER_NODE || s->nmetrics >= PS__METRICS_MAX) {
    /* A METRIC has no reply: the refusal is logged (once per node) and counted. */
    s->metrics_refused++;
    if (!n->metrics_warned) {
      n->metrics_warned = 1;
      ps__log(PS_LOG_WARN, "node %u: metric '%s' refused: at most %u metric names per node and %u in all are kept "
              "(counted in STATS as metrics_refused)", n->m.id, name, PS__METRICS_PER_NODE, PS__METRICS_MAX);
    }
    return;
  }
  if (s->nmetrics == s->mcap) {
    size_t cap = s->mcap ? s->mcap * 2 : 32;
    metric *mm = ps__realloc(s->metrics, cap * sizeof *mm);
    if (!mm) return;
    s->metrics = mm;
    s->mcap = cap;
  }
  metric *m = &s->metrics[s->nmetrics++];
  n->nmetrics++;
  memset(m, 0, sizeof *m);
  m->node = n->m.id;
  snprintf(m->name, sizeof m->name, "%s", name);
  m->value = v;
  m->clock = h->clock;
  m->count = 1;
}

/* A server's report of the workers its sync rounds wait for (proto/msg.h, ps__stall).
 * One that held a round longer than the heartbeat timeout while another worker waited
 * is removed as a dead worker is: it is told why, its connection closes, the new
 * membership takes it out of every round's expected set, and what it sends later is
 * refused (a server refuses its pushes, this scheduler its rejoin). */
static void on_stall(ps__sched *s, node *from, const ps__body *b) {
  ps__stall v[PS_STALL_MAX];
  size_t k;
  if (ps__stall_decode(b->buf, b->len, v, &k)) {
    ps__log(PS_LOG_WARN, "server %u: %s", from->m.id, ps_errmsg());
    return;
  }
  for (size_t i = 0; i < k; i++) {
    uint32_t limit = v[i].clocked ? s->o.stall_timeout_ms : s->o.heartbeat_timeout_ms;
    if (limit == UINT32_MAX || v[i].held_ms <= limit) continue;
    node *w = NULL;
    for (size_t j = 0; j < s->nnodes && !w; j++)
      if (s->nodes[j].m.id == v[i].worker) w = &s->nodes[j];
    if (!w || !w->m.alive || w->m.role != PS_ROLE_WORKER) continue;
    char why[200];
    snprintf(why, sizeof why, "stalled: round %lld of table %u on server %u waited %llu ms for its clock (%s %u ms)",
             (long long)v[i].round, v[i].table, from->m.id, (unsigned long long)v[i].held_ms,
             v[i].clocked ? "stall timeout" : "it never clocked; heartbeat timeout", limit);
    if (w->conn) { /* it hears why, then the close */
      char msg[320];
      int len = snprintf(msg, sizeof msg, "worker %u removed from the job: %s", w->m.id, why);
      ps__frame_hdr e = {.type = PS_MSG_ERROR, .status = PS_ERR_UNAVAILABLE};
      ps__conn_send_ctrl(w->conn, &e, msg, (size_t)len);
      ps__sched_task_drop_waiters(s, w->conn, 0);
      w->conn->udata = NULL;
      ps__conn_close_after_flush(w->conn, PS_ERR_UNAVAILABLE);
      w->conn = NULL;
    }
    mark_dead(s, w, why);
  }
}

static void on_stats(ps__sched *s, ps__conn *c, const ps__frame_hdr *h) {
  ps__wbuf w;
  char line[256];
  ps__wbuf_init(&w);
  int n = snprintf(line, sizeof line,
                   "epoch %llu\nstarted %d\nservers_alive %zu\nworkers_alive %zu\nservers_expected %u\n"
                   "workers_expected %u\n",
                   (unsigned long long)s->epoch, s->started, ps__sched_count_alive(s, PS_ROLE_SERVER),
                   ps__sched_count_alive(s, PS_ROLE_WORKER), s->o.servers, s->o.workers);
  ps__wbuf_bytes(&w, line, (size_t)n);
  if (s->tk.init) {
    n = snprintf(line, sizeof line, "tasks partitions=%u epochs=%u epoch=%u done=%u handed=%llu completed=%llu requeued=%llu\n",
                 s->tk.parts, s->tk.epochs, s->tk.epoch, s->tk.ndone, (unsigned long long)s->tk.handed,
                 (unsigned long long)s->tk.completed, (unsigned long long)s->tk.requeued);
    ps__wbuf_bytes(&w, line, (size_t)n);
  }
  if (s->o.checkpoint_dir) {
    n = snprintf(line, sizeof line, "checkpoints taken=%llu failed=%llu in_progress=%d\n",
                 (unsigned long long)s->ck.taken, (unsigned long long)s->ck.failed, s->ck.phase != PS__CKPT_IDLE);
    ps__wbuf_bytes(&w, line, (size_t)n);
  }
  for (size_t i = 0; i < s->nnodes; i++) { /* who is in the job, and where (pshard stats, pshard top) */
    const ps__member *m = &s->nodes[i].m;
    /* a replacement's line goes on with late=1, syncing= and its admission number, which
     * orders it after the replacements before it (other lines end at alive=) */
    char repl[64] = "";
    if (m->late) snprintf(repl, sizeof repl, " late=1 syncing=%u admission=%u", (unsigned)m->syncing, (unsigned)m->late);
    n = snprintf(line, sizeof line, "node %u role=%s rank=%u addr=%s:%u alive=%u%s\n", m->id,
                 m->role == PS_ROLE_SERVER ? "server" : m->role == PS_ROLE_WORKER ? "worker" : "other", m->rank,
                 m->host[0] ? m->host : "-", (unsigned)m->port, (unsigned)m->alive, repl);
    ps__wbuf_bytes(&w, line, (size_t)n);
  }
  size_t shown = s->nmetrics < PS__STATS_METRICS ? s->nmetrics : PS__STATS_METRICS;
  for (size_t i = 0; i < shown; i++) {
    metric *m = &s->metrics[i];
    n = snprintf(line, sizeof line, "metric node=%u name=%s value=%.9g clock=%lld count=%llu\n", m->node, m->name,
                 m->value, (long long)m->clock, (unsigned long long)m->count);
    ps__wbuf_bytes(&w, line, (size_t)n);
  }
  n = snprintf(line, sizeof line, "metrics %zu\nmetrics_omitted %zu\nmetrics_refused %llu\n", s->nmetrics,
               s->nmetrics - shown, (unsigned long long)s->metrics_refused);
  ps__wbuf_bytes(&w, line, (size_t)n);
  ps__frame_hdr r = {.type = PS_MSG_STATS | PS_FRAME_REPLY, .req_id = h->req_id};
  if (!w.oom) ps__conn_send_ctrl(c, &r, w.data, w.len);
  ps__wbuf_free(&w);
}

static int sched_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  /* The only requests the scheduler makes are CKPT to its servers. */
  if (h->type == (PS_MSG_CKPT | PS_FRAME_REPLY)) return 0;
  if (h->type & PS_FRAME_REPLY) return ps__fail(PS_ERR_PROTO, "unexpected %s reply", ps__frame_type_name(h->type));
  switch (h->type) {
  case PS_MSG_HELLO: case PS_MSG_HEARTBEAT: case PS_MSG_DECLARE: case PS_MSG_BARRIER:
  case PS_MSG_METRIC: case PS_MSG_LEAVE: case PS_MSG_STATS: case PS_MSG_TASK_INIT:
  case PS_MSG_TASK_NEXT: case PS_MSG_TASK_DONE: case PS_MSG_CHECKPOINT: case PS_MSG_STALL:
  case PS_MSG_NODE_METRICS:
  case PS_MSG_SYNCED:
    return 0;
  default:
    return ps__fail(PS_ERR_PROTO, "%s frame not accepted by the scheduler", ps__frame_type_name(h->type));
  }
}

static void sched_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__sched *s = c->loop->data;
  node *n = node_by_conn(s, c);
  if (h->type == PS_MSG_HELLO) {
    on_hello(s, c, h, b);
    return;
  }
  if (h->type == PS_MSG_STATS) {
    on_stats(s, c, h);
    return;
  }
  if (h->type == PS_MSG_CHECKPOINT) { /* from a worker or from a tool such as the CLI */
    if (n) n->last_seen_ms = ps__now_ms();
    ps__sched_ckpt_request(s, c, h, b);
    return;
  }
  if (!n) {
    ps__conn_send_error(c, h, PS_ERR_PROTO, "not registered: send hello first");
    ps__conn_close_after_flush(c, PS_ERR_PROTO);
    return;
  }
  n->last_seen_ms = ps__now_ms();
  switch (h->type) {
  case PS_MSG_HEARTBEAT:
    break;
  case PS_MSG_CKPT | PS_FRAME_REPLY:
    if (n->m.role == PS_ROLE_SERVER) ps__sched_ckpt_reply(s, n, h, b);
    break;
  case PS_MSG_DECLARE:
    on_declare(s, c, h, b);
    break;
  case PS_MSG_BARRIER:
    if (n->m.role != PS_ROLE_WORKER) {
      ps__conn_send_error(c, h, PS_ERR_ROLE, "only workers take part in barriers");
      break;
    }
    if (h->clock <= n->barrier_done) { /* a retry of a barrier it already passed */
      ps__frame_hdr r = {.type = PS_MSG_BARRIER | PS_FRAME_REPLY, .req_id = h->req_id, .clock = h->clock};
      ps__conn_send_ctrl(c, &r, NULL, 0);
      break;
    }
    n->barrier_seq = h->clock;
    n->barrier_req = h->req_id;
    check_barriers(s);
    break;
  case PS_MSG_METRIC:
    on_metric(s, n, h, b);
    break;
  case PS_MSG_STALL:
    if (n->m.role == PS_ROLE_SERVER) on_stall(s, n, b);
    break;
  case PS_MSG_SYNCED:
    on_synced(s, n, h);
    break;
  case PS_MSG_LEAVE:
    n->left = n->m.alive;
    mark_dead(s, n, "left the job");
    break;
  case PS_MSG_NODE_METRICS:
    ps__sched_metrics_frame(s, n, b);
    break;
  case PS_MSG_TASK_INIT:
    ps__sched_on_task_init(s, c, h);
    break;
  case PS_MSG_TASK_NEXT:
  case PS_MSG_TASK_DONE:
    if (n->m.role != PS_ROLE_WORKER) {
      ps__conn_send_error(c, h, PS_ERR_ROLE, "only workers take tasks");
      break;
    }
    if (h->type == PS_MSG_TASK_NEXT)
      ps__sched_on_task_next(s, n, c, h);
    else
      ps__sched_on_task_done(s, n, c, h);
    break;
  default:
    break;
  }
}

static void sched_on_close(ps__conn *c, int status) {
  ps__sched *s = c->loop->data;
  if (s->stopping) return;
  ps__sched_task_drop_waiters(s, c, 0);
  ps__sched_ckpt_conn_closed(s, c);
  node *n = node_by_conn(s, c);
  if (n) {
    n->conn = NULL;
    mark_dead(s, n, status == PS_ERR_CLOSED ? "connection closed" : ps_strerror(status));
  }
}

static const ps__conn_ops sched_ops = {sched_on_header, sched_on_frame, sched_on_close};

static void on_accept(void *arg, ps__conn *c) { (void)arg; (void)c; }

/* A check this late means the scheduler itself did not run (SIGSTOP, a suspended VM,
 * heavy swapping): several periods, or half the timeout when that is shorter, but
 * never less than two periods. */
static uint64_t paused_after_ms(const ps__sched *s) {
  uint64_t p = s->o.heartbeat_ms, t = s->o.heartbeat_timeout_ms / 2, lim = 4 * p;
  if (t < lim) lim = t;
  return lim < 2 * p ? 2 * p : lim;
}

/* The liveness check, every heartbeat_ms. After a pause of the scheduler the gap since
 * a node was last seen is measured on a clock that ran while nobody could be heard
 * (the heartbeats sent meanwhile wait unread in the sockets, and the loop runs timers
 * before it reads), so every node counts as seen now: liveness is then judged by what
 * arrives after the resume, and a node that really went silent is removed one
 * timeout later. */
static void hb_tick(uv_timer_t *t) {
  ps__sched *s = t->data;
  uint64_t now = ps__now_ms();
  if (now - s->hb_last_ms > paused_after_ms(s)) {
    ps__log(PS_LOG_WARN, "the scheduler was paused for %llu ms; liveness is judged afresh",
            (unsigned long long)(now - s->hb_last_ms));
    for (size_t i = 0; i < s->nnodes; i++)
      if (s->nodes[i].m.alive) s->nodes[i].last_seen_ms = now;
    /* Workers waiting for a task did not wait the pause either. */
    uint64_t paused = now - s->hb_last_ms;
    for (ps__task_waiter *w = s->tk.waiters; w; w = w->next) w->deadline_ms += paused;
  }
  s->hb_last_ms = now;
  for (size_t i = 0; i < s->nnodes; i++) {
    node *n = &s->nodes[i];
    if (!n->m.alive || now - n->last_seen_ms <= s->o.heartbeat_timeout_ms) continue;
    if (n->m.role == PS_ROLE_SERVER && last_copy(s, n)) {
      /* Removing a silent server that holds the last live copy of some keys would lose
       * them for good; it may only be paused. Its clients wait (and time out). */
      if (!n->last_copy_warned)
        ps__log(PS_LOG_WARN, "server %u (rank %u) is silent, but it holds the last live copy of some keys: not removed",
                n->m.id, n->m.rank);
      n->last_copy_warned = 1;
      continue;
    }
    mark_dead(s, n, "missed heartbeats");
  }
  ps__sched_task_drop_waiters(s, NULL, 1);
}

int ps__sched_create(const ps__sched_opts *o, ps__sched **out) {
  ps__sched *s = ps__calloc(1, sizeof *s);
  if (!s) return ps__fail(PS_ERR_NOMEM, "out of memory");
  s->o = *o;
  if (!s->o.host) s->o.host = "127.0.0.1";
  if (!s->o.heartbeat_ms) s->o.heartbeat_ms = 200;
  if (!s->o.heartbeat_timeout_ms) s->o.heartbeat_timeout_ms = 3000;
  if (!s->o.stall_timeout_ms) s->o.stall_timeout_ms = 60000;
  if (!s->o.max_payload) s->o.max_payload = 2048ull << 20;
  if (!s->o.checkpoint_keep) s->o.checkpoint_keep = 3;
  if (!s->o.checkpoint_timeout_ms) s->o.checkpoint_timeout_ms = PS__CKPT_DEADLINE_MS;
  if (!s->o.checkpoint_full_every) s->o.checkpoint_full_every = 1;
  if (!s->o.replicas) s->o.replicas = s->o.servers >= 2 ? 2 : 1; /* a second copy whenever there can be one */
  if (!s->o.vnodes) s->o.vnodes = 128;
  if (s->o.replicas > PS_MAX_REPLICAS || s->o.replicas > s->o.servers) {
    unsigned r = s->o.replicas, n = s->o.servers;
    free(s);
    if (r > PS_MAX_REPLICAS) return ps__fail(PS_ERR_CONFIG, "replicas %u: at most %d copies are supported", r, PS_MAX_REPLICAS);
    return ps__fail(PS_ERR_CONFIG, "replicas %u needs at least %u servers (the job has %u)", r, r, n);
  }
  s->next_id = 1;
  s->epoch = 1;
  uv_loop_init(&s->loop);
  s->loop.data = s;
  if (ps__sched_state_load(s)) { /* a restarted scheduler: its job's members, tables, tasks */
    char msg[512];
    snprintf(msg, sizeof msg, "%s", ps_errmsg());
    uv_loop_close(&s->loop);
    free(s->nodes);
    free(s->tables);
    free(s->tk.state);
    free(s->tk.owner);
    free(s);
    return ps__fail(PS_ERR_CORRUPT, "%s", msg);
  }
  s->pool = ps__pool_new(16u << 20);
  s->mail = ps__mailbox_new(&s->loop);
  ps__auth_self_set(&s->loop, PS_ROLE_SCHEDULER, 0);
  int rc = ps__listen_tcp(&s->listener, &s->loop, s->o.host, o->port, &sched_ops, on_accept, s, s->pool,
                          s->o.max_payload);
  if (rc || !s->pool || !s->mail) {
    if (!rc) rc = ps__fail(PS_ERR_NOMEM, "out of memory");
    char msg[512];
    snprintf(msg, sizeof msg, "%s", ps_errmsg());
    ps__sched_destroy(s);
    return ps__fail(rc, "%s", msg);
  }
  uv_timer_init(&s->loop, &s->hb_timer);
  s->hb_timer.data = s;
  uv_timer_init(&s->loop, &s->finish_timer);
  s->finish_timer.data = s;
  rc = ps__sched_ckpt_init(s);
  if (rc) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", ps_errmsg());
    ps__sched_destroy(s);
    return ps__fail(rc, "%s", msg);
  }
  rc = ps__sched_metrics_start(s);
  if (rc) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", ps_errmsg());
    ps__sched_destroy(s);
    return ps__fail(rc, "%s", msg);
  }
  s->hb_last_ms = ps__now_ms();
  uv_timer_start(&s->hb_timer, hb_tick, s->o.heartbeat_ms, s->o.heartbeat_ms);
  *out = s;
  return 0;
}

int ps__sched_port(const ps__sched *s) { return s->listener.port; }

int ps__sched_http_port(const ps__sched *s) { return s->http ? ps__http_port(s->http) : -1; }

static void walk_close(uv_handle_t *h, void *arg) {
  (void)arg;
  if (uv_is_closing(h)) return;
  if (h->type == UV_TCP || h->type == UV_NAMED_PIPE) {
    ps__conn *c = h->data;
    ps__sched *s = h->loop->data;
    if (h != &s->listener.h.handle && c) {
      ps__conn_close(c, 0);
      return;
    }
  }
  if (h->type == UV_ASYNC) return; /* the mailbox closes itself */
  uv_close(h, NULL);
}

static void do_stop(void *arg) {
  ps__sched *s = arg;
  if (s->stopping) return;
  s->stopping = 1;
  ps__listener_close(&s->listener);
  uv_timer_stop(&s->hb_timer);
  uv_timer_stop(&s->finish_timer);
  uv_walk(&s->loop, walk_close, NULL);
  ps__mailbox_close(s->mail);
  s->mail = NULL;
}

int ps__sched_run(ps__sched *s) {
  ps__block_sigpipe();
  uv_run(&s->loop, UV_RUN_DEFAULT);
  return s->result;
}

void ps__sched_stop(ps__sched *s) {
  if (s && s->mail) ps__mailbox_post(s->mail, do_stop, s);
}

void ps__sched_destroy(ps__sched *s) {
  if (!s) return;
  if (!s->stopping) {
    s->stopping = 1;
    if (s->listener.loop) ps__listener_close(&s->listener);
    if (s->mail) ps__mailbox_close(s->mail);
    s->mail = NULL;
    uv_walk(&s->loop, walk_close, NULL);
  }
  uv_run(&s->loop, UV_RUN_DEFAULT);
  uv_loop_close(&s->loop);
  ps__auth_self_clear(&s->loop);
  ps__pool_free(s->pool);
  ps__sched_metrics_free(s);
  free(s->nodes);
  free(s->tables);
  free(s->metrics);
  while (s->tk.waiters) {
    ps__task_waiter *w = s->tk.waiters;
    s->tk.waiters = w->next;
    free(w);
  }
  free(s->tk.state);
  free(s->tk.owner);
  ps__sched_ckpt_free(s);
  free(s);
}
