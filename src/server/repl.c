/*
 * repl.c - chain replication: which requests a server takes under replicas R >= 2, the
 * forwarding of applied pushes to the next server of their chain, and the fence of a
 * server that may have been replaced while it stood still.
 *
 * Every key range has a chain: its owner on the ring, then the next R-1 distinct
 * servers clockwise (ring.h; a dense table's run j, then runs j+1 .. j+R-1). The ring
 * keeps dead servers, so chains never change; a chain's head is its first live member.
 * A worker sends each request part to the head of one chain (the client routes by
 * chain). The head applies a push through the engine, in its order, then forwards the
 * push itself (keys, values, the worker's identity, the rate and step it applied) to
 * the next live member as a FORWARD frame carrying the ring epoch; each member applies
 * it and forwards it on; the tail answers, and the answers go back up the chain. The
 * worker's push is acknowledged only when the tail has applied it. A member whose epoch
 * differs refuses a forward (PS_ERR_MOVED), so a head that lost its place applies
 * nothing further down. A push the head applied before (a re-sent one, after a
 * failover) is forwarded again: the tail may not have it yet, and the members' windows
 * (shard/once.h) apply it once.
 *
 * Everything here runs on the server's loop thread.
 */
#include <string.h>

#include "common/common.h"
#include "server/server_int.h"

/* A forward waiting for its answer (or for the connection to its server). */
struct srv_fwd {
  srv_fwd *next;
  uint64_t req_id;      /* on the connection to `to` */
  uint32_t to;
  ps__conn *up;         /* where the answer goes (a worker, or the previous server); NULL: closed */
  ps__frame_hdr up_hdr; /* the request answered */
  ps__frame_hdr hdr;    /* the FORWARD frame */
  void *buf;            /* its body: prefix, keys, values (pooled) */
  size_t len;
  uint64_t born_ms;
  int sent;
  srv_fwd_group *grp;   /* frames sent together: the answer goes to the group (repl_agg.c) */
  unsigned attempts;    /* times the group redirected it */
  uint64_t retry_at;    /* unsent: send it again at this time (uv_now) */
  /* By peer memory: the values, buf[pm_off .. len), may be named instead of sent to a
   * server of this host (pm_off 0: never). Such a frame carries, after buf[0 ..
   * pm_off), the tail pm_tail: until, the hint of buf's shared buffer (or 0), the
   * values' address and length. */
  size_t pm_off;
  int pm_own;        /* pm_off was set: the frame's transport is chosen at each send */
  uint8_t pm_tail[32];
  uint64_t pm_until; /* the latest expiry sent (ps__now_ms): nobody reads buf after it */
  int pm_out;        /* sent so, and not answered yet by the server it went to */
  int pm_hold;       /* a server it went to so may still read buf: kept when freed */
};

/* Another server, as a destination of forwards. */
struct srv_peer {
  uint32_t id;
  int alive;
  uint8_t state;   /* PS_CHAIN_*: the head rule's view of it (ring.h) */
  uint32_t late;   /* its admission number as a replacement (0: not one) */
  char host[PS_HOST_MAX];
  uint16_t port;
  char unix_path[PS_PATH_MAX]; /* on this host: its AF_UNIX socket (empty: TCP) */
  ps__conn *conn;
  int connecting;
  int no_pm; /* it could not read this server's memory: values inline on this connection */
};

static void fwd_answer(ps__server *s, srv_fwd *f, int status, uint8_t flags, const char *msg);
static void fwd_resend_due(ps__server *s);
static void fwd_send(ps__server *s, srv_peer *p, srv_fwd *f);
static void fwd_body_free(ps__server *s, srv_fwd *f);
static void peer_connect(ps__server *s, srv_peer *p);

#define FWD_ABANDON_MS 60000   /* a forward unanswered this long is forgotten (its worker re-sent it) */
#define FWD_MAX_REDIRECTS 100 /* a frame re-addressed this often is answered with its last error */
#define FWD_REDIRECT_MS 20    /* and waits this long before it is sent again */

static srv_peer *peer_of(ps__server *s, uint32_t id) {
  for (size_t i = 0; i < s->npeers; i++)
    if (s->peers[i]->id == id) return s->peers[i];
  return NULL;
}

/* A connection being opened to server id (the callback finds its peer by id). */
typedef struct peer_dial {
  ps__server *s;
  uint32_t id;
} peer_dial;

int ps__srv_server_alive(ps__server *s, uint32_t id) {
  if (id == s->id) return 1;
  srv_peer *p = peer_of(s, id);
  return p && p->alive;
}

uint8_t ps__srv_chain_member(ps__server *s, uint32_t id, uint32_t *late) {
  if (id == s->id) {
    *late = s->self_late;
    return s->self_state ? s->self_state : PS_CHAIN_LIVE;
  }
  srv_peer *p = peer_of(s, id);
  *late = p ? p->late : 0;
  return p && p->alive ? p->state : PS_CHAIN_DEAD;
}

uint8_t ps__srv_chain_state(ps__server *s, uint32_t id) {
  uint32_t late;
  return ps__srv_chain_member(s, id, &late);
}

/* ------------------------------------------------------------------ which requests are ours */

/* The chain's head and the member after `self` (0: none), by the head rule (ring.h):
 * a replacement comes after every member there before it, and a syncing one last. */
void ps__srv_chain_places(ps__server *s, const uint32_t *c, size_t n, uint32_t *head, int *has_self, uint32_t *next) {
  uint8_t st[PS_MAX_REPLICAS], ord[PS_MAX_REPLICAS];
  uint32_t late[PS_MAX_REPLICAS];
  *head = 0, *has_self = 0, *next = 0;
  if (n > PS_MAX_REPLICAS) n = PS_MAX_REPLICAS;
  for (size_t k = 0; k < n; k++) st[k] = ps__srv_chain_member(s, c[k], &late[k]);
  size_t m = ps__chain_order(st, late, n, ord);
  if (m && st[ord[0]] != PS_CHAIN_SYNCING) *head = c[ord[0]];
  for (size_t j = 0; j < m; j++)
    if (c[ord[j]] == s->id) {
      *has_self = 1;
      *next = j + 1 < m ? c[ord[j + 1]] : 0;
    }
  /* a replacement whose copy from here could not start yet gets nothing from here */
  if (*next && ps__srv_repair_blocked(s, *next)) *next = 0;
}

uint32_t ps__srv_peer_id(ps__server *s, size_t i) { return s->peers[i]->id; }

/* A request's chain: a worker's request must come to the chain's head, a forward to
 * a member after it. 0 with *next (the member to forward to, 0: this is the tail), or
 * -1 (answered with MOVED). */
static int chain_ok(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const uint32_t *ch, size_t n,
                    uint32_t *next, const char *what, unsigned long long which) {
  uint32_t head;
  int mine;
  ps__srv_chain_places(s, ch, n, &head, &mine, next);
  int fwd = ps__frame_is_forward(h->type);
  if (mine && (fwd ? head != s->id : head == s->id)) return 0;
  ps__srv_reply_err(c, h, PS_ERR_MOVED, "%s %llu of table '%s' is not %s on this server (epoch %llu; its head is server %u)",
                    what, which, t->decl.name, fwd ? "replicated" : "headed", (unsigned long long)s->epoch, head);
  return -1;
}

int ps__srv_route_keys(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const uint8_t *keys,
                       uint32_t *next) {
  *next = 0;
  if (h->nkeys == 0) return 0;
  size_t route = ps__ring_route_index(s->ring, h->table, ps__get_u64(keys));
  for (uint32_t i = 1; i < h->nkeys; i++) {
    uint64_t key = ps__get_u64(keys + 8 * (size_t)i);
    if (ps__ring_route_index(s->ring, h->table, key) != route) {
      ps__srv_reply_err(c, h, PS_ERR_MOVED, "key %llu of table '%s' belongs to another chain than key %llu (epoch %llu)",
                        (unsigned long long)key, t->decl.name, (unsigned long long)ps__get_u64(keys),
                        (unsigned long long)s->epoch);
      return -1;
    }
  }
  uint32_t ch[PS_MAX_REPLICAS];
  size_t n = ps__ring_route(s->ring, route, ch);
  s->push_unit = ps__once_unit(t->id, (uint32_t)route);
  return chain_ok(s, c, h, t, ch, n, next, "key", (unsigned long long)ps__get_u64(keys));
}

int ps__srv_route_segments(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const uint8_t *keys,
                           uint32_t *next) {
  *next = 0;
  if (h->nkeys == 0) return 0;
  size_t S = ps__ring_size(s->ring);
  uint64_t nsl = (t->spec.size + t->spec.width - 1) / t->spec.width;
  uint32_t *order = ps__malloc(S * sizeof *order);
  if (!order || !ps__ring_dense_order(s->ring, t->id, order)) {
    free(order);
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "out of memory");
    return -1;
  }
  size_t run = SIZE_MAX;
  for (uint32_t i = 0; i < h->nkeys; i += 2) {
    uint64_t off = ps__get_u64(keys + 8 * i), cnt = ps__get_u64(keys + 8 * (i + 1));
    size_t a = ps__dense_run(off / t->spec.width, nsl, S), b = ps__dense_run((off + cnt - 1) / t->spec.width, nsl, S);
    if (run == SIZE_MAX) run = a;
    if (a != run || b != run) {
      free(order);
      ps__srv_reply_err(c, h, PS_ERR_MOVED, "range [%llu, +%llu) of table '%s' spans several chains (epoch %llu)",
                        (unsigned long long)off, (unsigned long long)cnt, t->decl.name, (unsigned long long)s->epoch);
      return -1;
    }
  }
  uint32_t ch[PS_MAX_REPLICAS];
  size_t n = ps__ring_dense_chain(s->ring, order, run, ch);
  free(order);
  s->push_unit = ps__once_unit(t->id, PS_FWD_DENSE_CHAIN | (uint32_t)run);
  uint64_t first = ps__get_u64(keys) / t->spec.width;
  return chain_ok(s, c, h, t, ch, n, next, "slice", (unsigned long long)first);
}

/* ------------------------------------------------------------------ chains of rows (repl_agg.c, repl_sync.c) */

int ps__srv_chains_init(ps__srv_chains *x, ps__server *s, ps__table *t) {
  memset(x, 0, sizeof *x);
  x->s = s, x->t = t;
  x->S = ps__ring_size(s->ring);
  x->nroutes = ps__ring_nroutes(s->ring);
  if (t->spec.kind == PS_DENSE) {
    x->nsl = (t->spec.size + t->spec.width - 1) / t->spec.width;
    x->order = ps__malloc(x->S * sizeof *x->order);
    if (!x->order || !ps__ring_dense_order(s->ring, t->id, x->order)) {
      free(x->order);
      x->order = NULL;
      return ps__fail(PS_ERR_NOMEM, "out of memory");
    }
  }
  return 0;
}

void ps__srv_chains_free(ps__srv_chains *x) { free(x->order); }

/* The chain of a row: its ring route, or PS_FWD_DENSE_CHAIN | its dense run. */
uint32_t ps__srv_row_chain(const ps__srv_chains *x, uint64_t key) {
  if (x->order) return PS_FWD_DENSE_CHAIN | (uint32_t)ps__dense_run(key < x->nsl ? key : x->nsl - 1, x->nsl, x->S);
  return (uint32_t)ps__ring_route_index(x->s->ring, x->t->id, key);
}

/* A chain's servers into ch (n, 0 for a chain number that is not one). */
size_t ps__srv_chain_servers(const ps__srv_chains *x, uint32_t ck, uint32_t *ch) {
  if (x->order) return (ck & PS_FWD_DENSE_CHAIN) && (ck & ~PS_FWD_DENSE_CHAIN) < x->S
                           ? ps__ring_dense_chain(x->s->ring, x->order, ck & ~PS_FWD_DENSE_CHAIN, ch)
                           : 0;
  return ck < x->nroutes ? ps__ring_route(x->s->ring, ck, ch) : 0;
}

/* This server's place in chain ck: 1 at its head, 2 after it, 0 not in it (or not a
 * chain); *next the live member after this server (0: none). */
int ps__srv_chain_place(const ps__srv_chains *x, uint32_t ck, uint32_t *next) {
  uint32_t ch[PS_MAX_REPLICAS], head;
  int mine;
  *next = 0;
  size_t n = ps__srv_chain_servers(x, ck, ch);
  if (!n) return 0;
  ps__srv_chain_places(x->s, ch, n, &head, &mine, next);
  return !mine ? 0 : head == x->s->id ? 1 : 2;
}

/* ------------------------------------------------------------------ the fence */

/* A server whose loop stood still for fence_ms (stopped, or stalled) may have been
 * declared dead and replaced by the next member of its chains meanwhile: it serves no
 * data request until its scheduler link has been seen alive for a heartbeat after. */
static uint64_t fence_ms(const ps__server *s) { return 4ull * s->o.heartbeat_ms; }

int ps__srv_fenced(ps__server *s) {
  if (s->replicas < 2) return 0;
  uint64_t now = uv_now(&s->loop);
  if (!s->fenced && s->last_tick_ms && now - s->last_tick_ms > fence_ms(s)) {
    s->fenced = 1;
    s->fenced_at = now;
    ps__log(PS_LOG_WARN, "this server stood still for %llu ms; it serves nothing until the scheduler confirms it",
            (unsigned long long)(now - s->last_tick_ms));
  }
  return s->fenced;
}

void ps__srv_repl_tick(ps__server *s) {
  uint64_t now = uv_now(&s->loop);
  (void)ps__srv_fenced(s);
  s->last_tick_ms = now;
  if (s->fenced && s->agent.conn && !s->agent.rejoining && now - s->fenced_at >= s->o.heartbeat_ms) {
    s->fenced = 0;
    ps__log(PS_LOG_INFO, "the scheduler still lists this server; serving again");
  }
  fwd_resend_due(s);
  ps__srv_sync_tick(s);
  ps__srv_repair_tick(s);
  /* Forwards nobody will answer (a frame lost on the way; the worker sent its push again). */
  for (srv_fwd **pp = &s->fwds; *pp;) {
    srv_fwd *f = *pp;
    if (now - f->born_ms < FWD_ABANDON_MS) {
      pp = &f->next;
      continue;
    }
    *pp = f->next;
    if (f->grp) fwd_answer(s, f, PS_ERR_TIMEOUT, 0, "the next copy of these keys did not answer; send again");
    fwd_body_free(s, f);
    free(f);
  }
  ps__srv_fwd_body_sweep(s, 0);
}

void ps__srv_repl_lag(ps__server *s, uint64_t *n, uint64_t *bytes, uint64_t *oldest_ms) {
  uint64_t now = uv_now(&s->loop), k = 0, b = 0, age = 0;
  for (const srv_fwd *f = s->fwds; f; f = f->next) {
    k++;
    b += f->len;
    if (now - f->born_ms > age) age = now - f->born_ms;
  }
  *n = k;
  *bytes = b;
  *oldest_ms = age;
}

/* ------------------------------------------------------------------ forwards */

/* The answer to forward f (flags: the next member's answer's): to its group, or to
 * the request it came from. A worker the tail answered itself (PS_FLAG_TAIL) is not
 * answered again; the member before this one is told so. */
static void fwd_answer(ps__server *s, srv_fwd *f, int status, uint8_t flags, const char *msg) {
  if (f->grp) {
    srv_fwd_group *g = f->grp;
    f->grp = NULL;
    ps__srv_fwd_group_answer(s, g, status, msg);
    return;
  }
  if (!f->up) return;
  if (status)
    ps__srv_reply_err(f->up, &f->up_hdr, status, "%s", msg);
  else if (!(flags & PS_FLAG_TAIL) || ps__frame_is_forward(f->up_hdr.type))
    ps__srv_reply_ok(f->up, &f->up_hdr, flags & PS_FLAG_TAIL);
}

int ps__srv_tail_answer(ps__server *s, const ps__frame_hdr *h, uint32_t worker) {
  const ps__fwd *up = s->fwd_up;
  if (!up || !up->up_req || !up->head || s->replaying) return 0;
  for (srv_metlink *l = s->links; l; l = l->next) {
    if (l->node != worker) continue;
    uint8_t type = h->type == PS_MSG_FORWARD_DENSE ? PS_MSG_PUSH_DENSE : PS_MSG_PUSH;
    ps__frame_hdr r = {.type = (uint8_t)(type | PS_FRAME_REPLY), .req_id = up->up_req, .table = h->table,
                       .clock = h->clock, .flags = PS_FLAG_TAIL, .batch = up->head};
    if (ps__conn_send_ctrl(l->conn, &r, NULL, 0)) return 0;
    s->tail_answers++;
    return 1;
  }
  return 0;
}

static void fwd_unlink(ps__server *s, srv_fwd *f) {
  for (srv_fwd **pp = &s->fwds; *pp; pp = &(*pp)->next)
    if (*pp == f) {
      *pp = f->next;
      return;
    }
}

/* Give back forward f's body, or keep it while a server may still read it. */
static void fwd_body_free(ps__server *s, srv_fwd *f) {
  if (f->pm_out || f->pm_hold)
    ps__srv_fwd_buf_hold(s, f->buf, f->len, f->pm_until + PS_VX_SLACK_MS);
  else
    ps__srv_fwd_buf_put(s, f->buf, f->len);
}

static void fwd_free(ps__server *s, srv_fwd *f) {
  fwd_unlink(s, f);
  fwd_body_free(s, f);
  free(f);
}

/* The server forward f went to by peer memory will not answer it (written off, its
 * connection lost, another epoch): it may still read the body until the expiry, and
 * the frame goes on with its values. */
static void fwd_pm_lost(srv_fwd *f) {
  if (f->pm_out) f->pm_hold = 1;
  f->pm_out = 0;
  f->pm_off = 0;
}

/* A frame of a group that re-addresses its frames (a sync round's) that could not be
 * delivered: 1 when the group sent it elsewhere or will send it again (re-stamped with
 * the current epoch, after FWD_REDIRECT_MS), 0 when it is to be answered. */
static int fwd_redirect(ps__server *s, srv_fwd *f, int status) {
  srv_fwd_group *g = f->grp;
  uint32_t to;
  if (!g || !g->redirect || f->attempts >= FWD_MAX_REDIRECTS || !g->redirect(s, g, f->buf, f->len, status, &to))
    return 0;
  fwd_pm_lost(f);
  f->attempts++;
  f->to = to;
  f->sent = 0;
  f->req_id = ++s->fwd_seq;
  f->hdr.req_id = f->req_id;
  ps__put_u64(f->buf, s->epoch); /* the ps__fwd prefix's epoch */
  f->retry_at = uv_now(&s->loop) + FWD_REDIRECT_MS;
  return 1;
}

/* Fail every forward to server id (gone, or its connection lost): the worker sends its
 * push again, to the chain's new head if need be, and the windows apply it once; a
 * sync round's frame is re-addressed by its group. */
static void fwd_fail_to(ps__server *s, uint32_t id, const char *why) {
  char msg[200];
  snprintf(msg, sizeof msg, "server %u, the next copy of these keys, %s; send again", id, why);
  for (srv_fwd *f = s->fwds, *next; f; f = next) {
    next = f->next;
    if (f->to != id) continue;
    fwd_pm_lost(f);
    if (fwd_redirect(s, f, PS_ERR_UNAVAILABLE)) continue;
    fwd_answer(s, f, PS_ERR_UNAVAILABLE, 0, msg);
    fwd_free(s, f);
  }
}

static int fwd_is_due(const srv_fwd *f, uint64_t now) { return !f->sent && f->retry_at && f->retry_at <= now; }

static void fwd_resend(ps__server *s, srv_fwd *f) {
  srv_peer *p = peer_of(s, f->to);
  if (!p || !p->alive) return; /* the next membership fails it over */
  if (p->conn)
    fwd_send(s, p, f);
  else if (!p->connecting)
    peer_connect(s, p);
}

/* Send the re-addressed frames whose wait is over (each tick, and on a new membership),
 * the oldest first (s->fwds is newest first): a member applies a chain's rounds in
 * order, and refuses one that comes before the round it waits for (repl_sync.c). */
static void fwd_resend_due(ps__server *s) {
  uint64_t now = uv_now(&s->loop);
  size_t n = 0, k = 0;
  for (srv_fwd *f = s->fwds; f; f = f->next) n += fwd_is_due(f, now);
  if (!n) return;
  srv_fwd **due = ps__malloc(n * sizeof *due);
  if (!due) { /* in list order: a round refused for its order is sent again later */
    for (srv_fwd *f = s->fwds; f; f = f->next)
      if (fwd_is_due(f, now)) fwd_resend(s, f);
    return;
  }
  for (srv_fwd *f = s->fwds; f; f = f->next)
    if (fwd_is_due(f, now)) due[k++] = f;
  while (k-- > 0) fwd_resend(s, due[k]);
  free(due);
}

/* Send forward f on p's connection: its values named (by peer memory) where it allows
 * that and p is a server of this host that can read them, else with them. */
static void fwd_send(ps__server *s, srv_peer *p, srv_fwd *f) {
  uv_buf_t b[2] = {uv_buf_init(f->buf, 0), uv_buf_init((char *)f->pm_tail, 0)};
  unsigned nb = 1;
  b[0].len = f->len;
  if (f->pm_own) f->hdr.xport = PS_XPORT_INLINE;
  if (f->pm_off && !p->no_pm && ps__pm_usable() && ps__vx_link_peer(p->conn, PS_CAP_PEER_MEM)) {
    uint64_t until = ps__now_ms() + PS_FWD_PM_MS;
    uint64_t pair[2] = {(uint64_t)(uintptr_t)((uint8_t *)f->buf + f->pm_off), f->len - f->pm_off};
    if (until > f->pm_until) f->pm_until = until;
    ps__put_u64(f->pm_tail, until);
    ps__put_u64(f->pm_tail + 8, ps__shm_hint(pair, 1)); /* a shared body: read in place */
    ps__put_u64(f->pm_tail + 16, pair[0]);
    ps__put_u64(f->pm_tail + 24, pair[1]);
    b[0].len = f->pm_off;
    b[1].len = sizeof f->pm_tail;
    nb = 2;
    f->hdr.xport = PS_XPORT_PEER_MEM;
    f->pm_out = 1;
    s->pm_fwd_out++;
  }
  f->sent = 1;
  if (ps__conn_send(p->conn, &f->hdr, b, nb, NULL, NULL) != 0) f->sent = 0; /* the close fails it */
}

static void peer_connect(ps__server *s, srv_peer *p);

static int peer_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)c, (void)b;
  uint8_t t = h->type & (uint8_t)~PS_FRAME_REPLY;
  if (h->type == PS_MSG_ERROR || ps__frame_is_forward(t) || t == PS_MSG_SYNC_ROWS || t == PS_MSG_SYNC_DONE) return 0;
  return ps__fail(PS_ERR_PROTO, "unexpected %s frame from a server", ps__frame_type_name(h->type));
}

static void peer_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__server *s = c->loop->data;
  if (h->type == PS_MSG_ERROR || !(h->type & PS_FRAME_REPLY)) return;
  for (srv_fwd *f = s->fwds; f; f = f->next) {
    if (f->req_id != h->req_id) continue;
    if (f->len < PS_POLL_CHAIN_MAX_BYTES) ps__srv_poll_chain(s);
    f->pm_out = 0; /* it answered: it reads the body no more */
    if (f->pm_own && f->hdr.xport == PS_XPORT_PEER_MEM && c->udata &&
        (h->status == PS_ERR_UNAVAILABLE || h->status == PS_ERR_TIMEOUT)) {
      /* It could not read the values where they are (or not in time): they go with the
       * frame, at once, to the same server. */
      srv_peer *p = c->udata;
      if (h->status == PS_ERR_UNAVAILABLE && !p->no_pm) {
        p->no_pm = 1;
        ps__log(PS_LOG_INFO, "server %u could not read this server's memory (%.*s); its forwards carry their values",
                p->id, (int)(b->len < 200 ? b->len : 200), b->buf ? (const char *)b->buf : "");
      }
      f->pm_off = 0;
      f->req_id = ++s->fwd_seq;
      f->hdr.req_id = f->req_id;
      s->pm_fwd_inline++;
      fwd_send(s, p, f);
      return;
    }
    /* The next copy out of memory did not apply it, while this one did: the push is to
     * be sent again (the windows apply it once), not failed with copies that differ. */
    int status = h->status == PS_ERR_NOMEM ? PS_ERR_UNAVAILABLE : h->status;
    if ((status == PS_ERR_MOVED || status == PS_ERR_UNAVAILABLE) && fwd_redirect(s, f, status)) return;
    char msg[300];
    if (h->status == PS_ERR_NOMEM)
      snprintf(msg, sizeof msg, "server %u, the next copy of these keys, is out of memory (%.*s); send again", f->to,
               (int)(b->len < 200 ? b->len : 200), b->buf ? (const char *)b->buf : "");
    else
      snprintf(msg, sizeof msg, "%.*s", (int)(b->len < 256 ? b->len : 256), b->buf ? (const char *)b->buf : "");
    fwd_answer(s, f, status, h->flags, msg[0] ? msg : ps_strerror(status));
    fwd_free(s, f);
    return;
  }
  /* an answer to a forward already answered (a duplicate) or forgotten */
}

static void peer_on_close(ps__conn *c, int status) {
  ps__server *s = c->loop->data;
  srv_peer *p = c->udata;
  (void)status;
  if (!p || s->stopping) return;
  p->conn = NULL;
  fwd_fail_to(s, p->id, "could not be reached");
}

static const ps__conn_ops peer_ops = {peer_on_header, peer_on_frame, peer_on_close};

static void on_peer_connected(void *arg, ps__conn *c, int status) {
  peer_dial *d = arg;
  ps__server *s = d->s;
  srv_peer *p = peer_of(s, d->id);
  free(d);
  if (s->stopping || !p || !p->alive) {
    if (p) p->connecting = 0;
    if (c) ps__conn_close(c, 0);
    return;
  }
  p->connecting = 0;
  if (status || !c) {
    fwd_fail_to(s, p->id, "could not be reached");
    return;
  }
  p->conn = c;
  p->no_pm = 0;
  for (srv_fwd *f = s->fwds; f; f = f->next)
    if (f->to == p->id && !f->sent) fwd_send(s, p, f);
}

static void peer_connect(ps__server *s, srv_peer *p) {
  peer_dial *d = ps__malloc(sizeof *d);
  p->connecting = 1;
  if (d) *d = (peer_dial){s, p->id};
  int rc = !d;
  if (d && p->unix_path[0])
    rc = ps__connect_unix(&s->loop, p->unix_path, &peer_ops, p, s->pool, s->o.max_payload, on_peer_connected, d);
  else if (d)
    rc = ps__connect_tcp(&s->loop, p->host, p->port, &peer_ops, p, s->pool, s->o.max_payload, on_peer_connected, d);
  if (rc) {
    free(d);
    p->connecting = 0;
    fwd_fail_to(s, p->id, "could not be reached");
  }
}

/* Register forward f (its answer's destination, group or up, already set) to server
 * `to` (peer pe): header hdr, body buf (pooled, len bytes; taken); sent now, or once
 * the connection to pe is up. */
static void fwd_add(ps__server *s, srv_peer *pe, srv_fwd *f, uint32_t to, const ps__frame_hdr *hdr, void *buf,
                    size_t len) {
  f->req_id = ++s->fwd_seq;
  f->to = to;
  f->buf = buf;
  f->len = len;
  f->born_ms = uv_now(&s->loop);
  f->hdr = *hdr;
  f->hdr.sender = s->id;
  f->hdr.req_id = f->req_id;
  f->hdr.payload_len = len;
  f->next = s->fwds;
  s->fwds = f;
  s->forwards++;
  s->forward_bytes += len;
  if (pe->conn)
    fwd_send(s, pe, f);
  else if (!pe->connecting)
    peer_connect(s, pe);
}

int ps__srv_forward_frame(ps__server *s, uint32_t to, const ps__frame_hdr *hdr, void *buf, size_t len,
                          size_t pm_off, srv_fwd_group *g) {
  srv_peer *pe = peer_of(s, to);
  srv_fwd *f = pe ? ps__calloc(1, sizeof *f) : NULL;
  if (!f) {
    ps__srv_fwd_buf_put(s, buf, len);
    return ps__fail(PS_ERR_NOMEM, "out of memory forwarding to server %u", to);
  }
  f->grp = g;
  f->pm_off = pm_off < len ? pm_off : 0;
  f->pm_own = f->pm_off != 0;
  fwd_add(s, pe, f, to, hdr, buf, len);
  return 0;
}

int ps__srv_forward(ps__server *s, ps__conn *up, const ps__frame_hdr *uh, const ps__push *p, uint32_t to,
                    float lr, uint64_t step) {
  srv_peer *pe = peer_of(s, to);
  int dense = uh->type == PS_MSG_PUSH_DENSE || uh->type == PS_MSG_FORWARD_DENSE;
  /* A worker's peer-memory dense push that the head read into a shared buffer in the
   * shape of this forward (peer.c): the forward is that buffer, one more holder of it,
   * and to a member of this host it names the values there, which the member applies
   * in place (else it carries them). */
  srv_fwd *f = pe ? ps__calloc(1, sizeof *f) : NULL;
  int by_body = f && dense && s->pm_body && !p->replica && p->keys == s->pm_body + PS_FWD_PREFIX &&
                ps__srv_fwd_buf_ref(s, s->pm_body);
  size_t kb = (size_t)p->nkeys * 8u, len = PS_FWD_PREFIX + kb + (size_t)p->nvals * 4u;
  uint8_t *buf = by_body ? s->pm_body : f ? ps__pool_get(s->pool, len) : NULL;
  if (by_body) {
    f->pm_off = PS_FWD_PREFIX + kb;
    f->pm_own = 1;
  }
  if (!buf) {
    free(f);
    return ps__fail(PS_ERR_NOMEM, "out of memory forwarding a push to server %u", to);
  }
  /* the worker's request, for the tail's answer: this push's own at the head, else the
   * one the forward being served carries */
  ps__fwd fw = {.epoch = s->epoch, .worker = p->sender, .step = step, .head = s->id,
               .up_req = (uh->flags & PS_FLAG_TAIL) ? uh->req_id : 0};
  if (p->replica) {
    fw.head = s->fwd_up ? s->fwd_up->head : 0;
    fw.up_req = s->fwd_up ? s->fwd_up->up_req : 0;
  }
  ps__fwd_put(buf, &fw);
  if (!by_body) {
    memcpy(buf + PS_FWD_PREFIX, p->keys, kb);
    memcpy(buf + PS_FWD_PREFIX + kb, p->vals, len - PS_FWD_PREFIX - kb);
  }
  f->up = up;
  f->up_hdr = *uh;
  ps__frame_hdr fh = {.type = dense ? PS_MSG_FORWARD_DENSE : PS_MSG_FORWARD, .table = p->table, .batch = p->batch,
                      .clock = p->clock, .nkeys = p->nkeys, .lr = lr, .inc = p->inc, .seq = p->seq};
  fwd_add(s, pe, f, to, &fh, buf, len);
  return 0;
}

int ps__srv_forward_admit(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const ps__body *b, ps__fwd *fw) {
  ps__fwd_get(b->buf, fw);
  if (fw->epoch != s->epoch) {
    s->forwards_refused++;
    ps__srv_reply_err(c, h, PS_ERR_MOVED, "forward of epoch %llu refused: this server is at epoch %llu",
                      (unsigned long long)fw->epoch, (unsigned long long)s->epoch);
    return -1;
  }
  if (!ps__srv_server_alive(s, h->sender) || h->sender == s->id) {
    ps__srv_reply_err(c, h, PS_ERR_MOVED, "forward from server %u, which is not a live member of the job", h->sender);
    return -1;
  }
  return 0;
}

ps__table *ps__srv_forward_table(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b, ps__fwd *fw) {
  if (ps__srv_repair_hold(s, c, h, b)) return NULL; /* a replacement copying its rows (repair.c) */
  if (ps__srv_forward_admit(s, c, h, b, fw)) return NULL;
  ps__table *t = ps__shard_table(s->sh, h->table);
  if (!t) ps__srv_reply_err(c, h, PS_ERR_NO_TABLE, "unknown table %u", h->table);
  return t;
}

void ps__srv_on_forward(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b, int dense) {
  ps__fwd fw;
  ps__frame_hdr ih;
  const float *in_place = NULL;
  if (dense && h->xport == PS_XPORT_PEER_MEM && (ps__fwd_get(b->buf, &fw), fw.epoch == s->epoch)) {
    /* The values are in the sender's memory: applied where they are, or read first, so
     * that whatever follows (held by a replacement, applied, forwarded on) has them
     * inline. (At another epoch it is refused below, unread.) */
    size_t pre = PS_FWD_PREFIX + 8u * (size_t)h->nkeys;
    if (b->len < pre) {
      ps__srv_reply_err(c, h, PS_ERR_SIZE, "peer-memory forward of %zu bytes", b->len);
      return;
    }
    const void *at;
    ih = *h;
    if (ps__srv_fwd_values(s, c, &ih, b, pre, &at)) return;
    in_place = at;
    h = &ih;
  }
  if (ps__srv_repair_hold(s, c, h, b)) return; /* a replacement copying its rows (repair.c) */
  if (ps__srv_forward_admit(s, c, h, b, &fw)) return;
  uint8_t *body = (uint8_t *)b->buf + PS_FWD_PREFIX;
  uint64_t nvals = (h->payload_len - PS_FWD_PREFIX - 8u * h->nkeys) / 4u;
  ps__push p = ps__srv_push_of(h, body, nvals);
  p.sender = fw.worker;
  p.replica = 1;
  p.step = fw.step;
  p.lr = h->lr >= 0 ? h->lr : -1.0f;
  /* The engine may take a dense body (applied after the answer): it is the pooled
   * frame body, of which the keys are an offset; hand it over whole. Values in place
   * are the sender's until this answers: applied before it, not taken. */
  ps__owned own = {in_place ? NULL : b->buf, b->len};
  if (in_place) p.vals = in_place;
  s->fwd_up = &fw;
  ps__srv_push(s, c, h, &p, &own, dense);
  s->fwd_up = NULL;
  if (in_place) return;
  if (!own.buf) b->buf = NULL;
}

/* ------------------------------------------------------------------ membership */

int ps__srv_repl_membership(ps__server *s, const ps__membership *m) {
  char hostid[PS_HOST_MAX] = "";
  ps__srv_sync_before(s);
  for (uint32_t i = 0; i < m->n; i++) {
    const ps__member *x = &m->m[i];
    if (x->role != PS_ROLE_SERVER || x->id == s->id) continue;
    srv_peer *p = peer_of(s, x->id);
    if (!p) {
      srv_peer **np = ps__realloc(s->peers, (s->npeers + 1) * sizeof *np);
      if (!np) return PS_ERR_NOMEM;
      s->peers = np;
      if (!(p = ps__calloc(1, sizeof *p))) return PS_ERR_NOMEM;
      p->id = x->id;
      s->peers[s->npeers++] = p;
    }
    snprintf(p->host, sizeof p->host, "%s", x->host);
    p->port = x->port;
    /* A server of this host is reached on its AF_UNIX socket, as the workers reach it. */
    if (!hostid[0]) ps__hostid(hostid, sizeof hostid);
    snprintf(p->unix_path, sizeof p->unix_path, "%s",
             s->o.use_unix && x->unix_path[0] && !strcmp(x->hostid, hostid) ? x->unix_path : "");
    if (p->alive && !x->alive) {
      p->alive = 0;
      fwd_fail_to(s, p->id, "left the job");
      if (p->conn) {
        p->conn->udata = NULL;
        ps__conn_close(p->conn, 0);
        p->conn = NULL;
      }
    }
    p->alive = x->alive;
    p->state = ps__member_chain_state(x);
    p->late = x->late;
  }
  for (uint32_t i = 0; i < m->n; i++)
    if (m->m[i].id == s->id && m->m[i].role == PS_ROLE_SERVER) {
      s->self_state = ps__member_chain_state(&m->m[i]);
      s->self_late = m->m[i].late;
    }
  s->replicas = m->replicas ? m->replicas : 1;
  ps__srv_sync_after(s);
  fwd_resend_due(s);
  return 0;
}

void ps__srv_repl_conn_closed(ps__server *s, ps__conn *c) {
  for (srv_fwd *f = s->fwds; f; f = f->next)
    if (f->up == c) f->up = NULL;
  ps__srv_agg_conn_closed(s, c);
}

void ps__srv_repl_free(ps__server *s) {
  ps__srv_repair_free(s);
  ps__srv_agg_free(s);
  ps__srv_sync_free(s);
  while (s->fwds) {
    srv_fwd *f = s->fwds;
    s->fwds = f->next;
    ps__srv_fwd_buf_put(s, f->buf, f->len);
    free(f);
  }
  for (size_t i = 0; i < s->npeers; i++) free(s->peers[i]);
  free(s->peers);
  s->peers = NULL;
  s->npeers = 0;
}

/* ------------------------------------------------------------------ which rows are whose */

int ps__srv_rows_init(ps__server *s, ps__srv_rows *r, int member) {
  memset(r, 0, sizeof *r);
  r->self = s->id;
  r->member = member;
  size_t S = s->ring ? ps__ring_size(s->ring) : 0;
  if (s->replicas < 2 || S <= 1) return 0; /* every row held here is this server's */
  uint32_t *ids = ps__malloc(S * sizeof *ids);
  r->live = ps__malloc(S * sizeof *r->live);
  if (!ids || !r->live) goto oom;
  if (!(r->state = ps__malloc(S)) || !(r->late = ps__malloc(S * sizeof *r->late))) goto oom;
  for (size_t i = 0; i < S; i++) {
    ids[i] = ps__ring_server_at(s->ring, i);
    if (!ps__srv_server_alive(s, ids[i])) continue;
    r->state[r->nlive] = ps__srv_chain_member(s, ids[i], &r->late[r->nlive]);
    r->live[r->nlive++] = ids[i];
  }
  /* The same servers, vnodes and R give the same ring: a copy another thread may read. */
  r->ring = ps__ring_new(ids, S, s->o.vnodes, s->epoch);
  if (!r->ring || ps__ring_set_replicas(r->ring, s->replicas)) goto oom;
  r->nroutes = ps__ring_nroutes(r->ring);
  if (!(r->route_ok = ps__malloc(r->nroutes ? r->nroutes : 1))) goto oom;
  for (size_t i = 0; i < r->nroutes; i++) {
    uint32_t ch[PS_MAX_REPLICAS];
    r->route_ok[i] = (uint8_t)ps__srv_rows_chain(r, ch, ps__ring_route(r->ring, i, ch));
  }
  free(ids);
  return 0;
oom:
  free(ids);
  ps__srv_rows_free(r);
  return ps__fail(PS_ERR_NOMEM, "out of memory");
}

int ps__srv_rows_chain(const ps__srv_rows *r, const uint32_t *ch, size_t n) {
  uint8_t st[PS_MAX_REPLICAS];
  uint32_t late[PS_MAX_REPLICAS];
  if (n > PS_MAX_REPLICAS) n = PS_MAX_REPLICAS;
  for (size_t k = 0; k < n; k++) {
    if (r->member && ch[k] == r->self) return 1; /* dead or alive: a member holds the rows */
    st[k] = PS_CHAIN_DEAD;
    late[k] = 0;
    for (size_t i = 0; i < r->nlive; i++)
      if (r->live[i] == ch[k]) st[k] = r->state[i], late[k] = r->late[i];
  }
  if (r->member) return 0;
  int head = ps__chain_head(st, late, n); /* the head writes the rows (the head rule, ring.h) */
  return head >= 0 && ch[head] == r->self;
}

int ps__srv_rows_dense(const ps__srv_rows *r, uint32_t table, uint8_t *runs) {
  size_t S = ps__ring_size(r->ring);
  uint32_t *order = ps__malloc(S * sizeof *order);
  if (!order || !ps__ring_dense_order(r->ring, table, order)) {
    free(order);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  for (size_t j = 0; j < S; j++) {
    uint32_t ch[PS_MAX_REPLICAS];
    runs[j] = (uint8_t)ps__srv_rows_chain(r, ch, ps__ring_dense_chain(r->ring, order, j, ch));
  }
  free(order);
  return 0;
}

void ps__srv_rows_free(ps__srv_rows *r) {
  ps__ring_free(r->ring);
  free(r->live);
  free(r->state);
  free(r->late);
  free(r->route_ok);
  memset(r, 0, sizeof *r);
}
