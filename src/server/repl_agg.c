/*
 * repl_agg.c - replication after aggregation: an async or ssp table that buffers its
 * pushes (agg_n, agg_ms) forwards each applied buffer down the chains, not each push.
 *
 * The head of a chain combines the pushes it accepts into the table's buffer as it does
 * without replicas, but answers none of them yet: each waits here (srv_aggw) with its
 * identity. When the engine applies the buffer (by count, by time, before a cut), its
 * agg_applied hook hands the buffer's rows over: they are cut by the chain of each row,
 * and each chain's rows go, as one FORWARD_AGG frame (proto/frame.h) with the rate, the
 * global batch and the step the head applied them with, to the live member after this
 * server. That member applies the same rows the same way (ps__shard_agg_replica), so
 * every copy takes the same step with the same numbers; it records the identities the
 * frame carries in its windows, forwards the rows on, and answers once the rows after it
 * are answered. Only when every frame of the buffer is answered does the head answer the
 * pushes in it: a push is acknowledged once the tail applied it, and replica traffic is
 * one buffer, not its pushes.
 *
 * A copy of a push that is still in the buffer (the worker re-sent it) waits with it. A
 * copy of a push whose buffer was applied is forwarded on its own, as without
 * aggregation (repl.c): the tail may not have it yet, and the windows apply it once.
 * When a frame cannot be delivered (the next member died), the buffer's pushes are
 * answered PS_ERR_UNAVAILABLE and their workers send them again.
 *
 * Everything here runs on the server's loop thread.
 */
#include <string.h>

#include "common/common.h"
#include "server/server_int.h"

struct srv_aggw {
  srv_aggw *next;
  ps__conn *c;     /* NULL: its connection closed */
  ps__frame_hdr h; /* the push to answer */
  uint32_t table;
  ps__push_id id;
  uint32_t chain;  /* the chain of its keys (PS_FWD_AGG_ID) */
};



/* A small cache of chain -> next member: a buffer's rows are of a few chains. */
typedef struct next_cache {
  uint32_t ck[16], next[16];
  int place[16];
  unsigned n;
} next_cache;

static int cached_place(const ps__srv_chains *x, next_cache *nc, uint32_t ck, uint32_t *next) {
  for (unsigned i = 0; i < nc->n; i++)
    if (nc->ck[i] == ck) {
      *next = nc->next[i];
      return nc->place[i];
    }
  int p = ps__srv_chain_place(x, ck, next);
  if (nc->n < 16) nc->ck[nc->n] = ck, nc->next[nc->n] = *next, nc->place[nc->n++] = p;
  return p;
}

/* ------------------------------------------------------------------ groups */

static void reply_to(ps__conn *c, const ps__frame_hdr *h, int status, const char *msg) {
  if (!c) return;
  if (status)
    ps__srv_reply_err(c, h, status, "%s", msg);
  else
    ps__srv_reply_ok(c, h, 0);
}

/* Finish g once no frame of it is being made or awaited: answer its pushes (head) or
 * the frame it came from (member). 1 when g was finished and freed. */
int ps__srv_group_maybe_done(ps__server *s, srv_fwd_group *g) {
  if (g->building || g->out) return 0;
  for (srv_aggw *w = g->waiters, *n; w; w = n) {
    n = w->next;
    reply_to(w->c, &w->h, g->status, g->msg);
    free(w);
  }
  reply_to(g->up, &g->up_hdr, g->status, g->msg);
  if (g->done) g->done(s, g);
  for (srv_fwd_group **pp = &s->groups; *pp; pp = &(*pp)->next)
    if (*pp == g) {
      *pp = g->next;
      break;
    }
  free(g);
  return 1;
}

void ps__srv_fwd_group_answer(ps__server *s, srv_fwd_group *g, int status, const char *msg) {
  if (g->out) g->out--;
  if (status && !g->status) {
    g->status = status;
    snprintf(g->msg, sizeof g->msg, "%s", msg ? msg : ps_strerror(status));
  }
  ps__srv_group_maybe_done(s, g);
}

srv_fwd_group *ps__srv_group_new(ps__server *s) {
  srv_fwd_group *g = ps__calloc(1, sizeof *g);
  if (!g) return NULL;
  g->building = 1;
  g->next = s->groups;
  s->groups = g;
  return g;
}

/* ------------------------------------------------------------------ frames */

/* Send rows [keys(i), row(i)] of one buffer and its push identities (ids: nids records
 * of PS_FWD_AGG_ID bytes) to the live member after this server in each row's chain, as
 * FORWARD_AGG frames of group g (each frame within the payload limit; the identities
 * with each member's last frame, so they are recorded only once all its rows are in).
 * Rows and identities of chains with no member after this server go nowhere. 0, or
 * PS_ERR_NOMEM (what was sent stays sent; g's status says it). */
typedef struct agg_rows {
  const ps__rowmap *m;   /* the head's buffer, or */
  const uint8_t *keys;   /* a frame's keys and rows */
  const float *rows;
  size_t n, w;           /* rows, floats per row */
} agg_rows;

static uint64_t rows_key(const agg_rows *a, size_t i) {
  return a->m ? ps__rowmap_key_at(a->m, i) : ps__get_u64(a->keys + 8 * i);
}
static const float *rows_row(const agg_rows *a, size_t i) {
  return a->m ? ps__rowmap_row_at(a->m, i) : a->rows + i * a->w;
}

static int send_to(ps__server *s, ps__table *t, const agg_rows *a, const uint32_t *nexts, const uint8_t *ids,
                   const uint32_t *id_next, uint32_t nids, uint32_t to, float lr, int per_row, double gb,
                   uint64_t step, srv_fwd_group *g) {
  size_t nr = 0, ni = 0;
  for (size_t i = 0; i < a->n; i++) nr += nexts[i] == to;
  for (uint32_t i = 0; i < nids; i++) ni += id_next[i] == to;
  size_t head = PS_FWD_PREFIX + PS_FWD_AGG_PREFIX, per = 8 + 4 * a->w;
  uint64_t cap = s->o.max_payload > head + ni * PS_FWD_AGG_ID ? s->o.max_payload - head - ni * PS_FWD_AGG_ID : 0;
  size_t chunk = cap / per;
  if (chunk == 0) return ps__fail(PS_ERR_TOO_LARGE, "an aggregation buffer's identities exceed the frame limit");
  if (chunk > UINT32_MAX) chunk = UINT32_MAX;
  size_t i = 0; /* the next row to look at */
  size_t left = nr;
  do {
    size_t k = left < chunk ? left : chunk;
    int last = k == left;
    size_t nid = last ? ni : 0;
    size_t len = head + nid * PS_FWD_AGG_ID + k * per;
    uint8_t *buf = ps__pool_get(s->pool, len);
    if (!buf) return ps__fail(PS_ERR_NOMEM, "out of memory forwarding an aggregation buffer");
    ps__fwd fw = {.epoch = s->epoch, .worker = 0, .step = step};
    ps__fwd_put(buf, &fw);
    uint64_t gbits;
    memcpy(&gbits, &gb, 8);
    ps__put_u32(buf + PS_FWD_PREFIX, (uint32_t)nid);
    ps__put_u32(buf + PS_FWD_PREFIX + 4, (uint32_t)per_row);
    ps__put_u64(buf + PS_FWD_PREFIX + 8, gbits);
    uint8_t *o = buf + head;
    for (uint32_t j = 0; nid && j < nids; j++)
      if (id_next[j] == to) memcpy(o, ids + (size_t)j * PS_FWD_AGG_ID, PS_FWD_AGG_ID), o += PS_FWD_AGG_ID;
    uint8_t *ko = o;
    float *vo = (float *)(void *)(o + 8 * k);
    size_t got = 0;
    for (; i < a->n && got < k; i++) {
      if (nexts[i] != to) continue;
      ps__put_u64(ko + 8 * got, rows_key(a, i));
      memcpy(vo + got * a->w, rows_row(a, i), 4 * a->w);
      got++;
    }
    ps__frame_hdr fh = {.type = PS_MSG_FORWARD_AGG, .table = t->id, .nkeys = (uint32_t)k, .lr = lr};
    g->out++;
    if (ps__srv_forward_frame(s, to, &fh, buf, len, 0, g)) {
      g->out--;
      return PS_ERR_NOMEM;
    }
    left -= k;
  } while (left);
  return 0;
}

/* Forward a buffer's rows and identities on from this server (a head: place 1; a
 * member: place 2, each row's chain checked). 0; -1 with *moved set for a row of a
 * chain this server is not so placed in; or an error code (g's status says it). */
static int agg_send(ps__server *s, ps__table *t, const agg_rows *a, const uint8_t *ids, uint32_t nids, int place,
                    float lr, int per_row, double gb, uint64_t step, srv_fwd_group *g, uint64_t *moved) {
  ps__srv_chains x;
  if (ps__srv_chains_init(&x, s, t)) return PS_ERR_NOMEM;
  uint32_t *nexts = ps__malloc((a->n + nids + 1) * sizeof *nexts);
  if (!nexts) {
    ps__srv_chains_free(&x);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  uint32_t *id_next = nexts + a->n;
  next_cache nc = {.n = 0};
  int rc = 0;
  for (size_t i = 0; i < a->n && !rc; i++) {
    uint64_t key = rows_key(a, i);
    if (x.order && key >= x.nsl) {
      *moved = key, rc = -1;
      break;
    }
    if (cached_place(&x, &nc, ps__srv_row_chain(&x, key), &nexts[i]) != place) *moved = key, rc = -1;
  }
  for (uint32_t i = 0; i < nids && !rc; i++) {
    uint32_t ck = ps__get_u32(ids + (size_t)i * PS_FWD_AGG_ID + 16);
    if (cached_place(&x, &nc, ck, &id_next[i]) != place) id_next[i] = 0; /* not this chain's: recorded here only */
  }
  /* one pass per distinct member to send to (a few) */
  for (size_t i = 0; !rc && i < a->n + nids; i++) {
    uint32_t to = nexts[i];
    if (!to) continue;
    int seen = 0;
    for (size_t j = 0; j < i && !seen; j++) seen = nexts[j] == to;
    if (!seen) rc = send_to(s, t, a, nexts, ids, id_next, nids, to, lr, per_row, gb, step, g);
  }
  free(nexts);
  ps__srv_chains_free(&x);
  if (rc > 0 && !g->status) {
    g->status = rc;
    snprintf(g->msg, sizeof g->msg, "%s", ps_errmsg());
  }
  return rc;
}

/* ------------------------------------------------------------------ the head */

static srv_aggw *waiter_new(ps__conn *c, const ps__frame_hdr *h, uint32_t table, const ps__push_id *id,
                            uint32_t chain) {
  srv_aggw *w = ps__calloc(1, sizeof *w);
  if (!w) return NULL;
  w->c = c, w->h = *h, w->table = table, w->id = *id, w->chain = chain;
  return w;
}

/* The waiter of push id of table in list l, or NULL. */
static srv_aggw *same_push(srv_aggw *l, uint32_t table, const ps__push_id *id) {
  for (; l; l = l->next)
    if (l->table == table && l->id.worker == id->worker && l->id.inc == id->inc && l->id.seq == id->seq) return l;
  return NULL;
}

void ps__srv_agg_before(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const ps__push *p) {
  ps__push_id id = {.worker = p->sender, .seq = p->seq, .inc = p->inc, .unit = p->unit};
  s->agg_cur = waiter_new(c, h, t->id, &id, ps__once_unit_chain(p->unit)); /* (the ring checks found it) */
}

int ps__srv_agg_after(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const ps__verdict *v) {
  srv_aggw *w = s->agg_cur;
  s->agg_cur = NULL;
  if (v->status != PS__APPLIED) {
    free(w);
    return 0;
  }
  if (v->dup) {
    /* A copy of a push still in the buffer waits with it; of one already applied, the
     * caller forwards it on its own (the buffer's frame may be lost: a copy that comes
     * to the next member first makes it refuse the buffer, whose pushes are then sent
     * again on their own, ps__shard_agg_replica). */
    srv_aggw *o = w ? same_push(s->aggw, t->id, &w->id) : NULL;
    if (o) {
      w->next = o->next;
      o->next = w;
      return 1;
    }
    free(w);
    return 0;
  }
  if (!s->agg_taken && !w) {
    /* out of memory: answered now (its copies miss it if this server dies before the
     * buffer is forwarded, as if the answer had been lost with it) */
    ps__srv_reply_ok(c, h, 0);
    return 1;
  }
  if (w) { /* into the buffer, which is still filling */
    w->next = s->aggw;
    s->aggw = w;
  }
  s->agg_taken = 0; /* else the buffer it filled was applied and handed on with it */
  return 1;
}

void ps__srv_agg_applied(void *arg, ps__table *t, const ps__rowmap *agg, int per_row, float lr, double gb,
                         uint64_t step) {
  ps__server *s = arg;
  if (s->replicas < 2) return;
  /* The buffer's pushes (and the one that filled it, if a push did) wait on its frames
   * (out of memory: on nothing, answered now). */
  srv_aggw *mine = NULL;
  uint32_t nids = 0;
  if (s->agg_cur && s->agg_cur->table == t->id) {
    mine = s->agg_cur;
    mine->next = NULL;
    s->agg_cur = NULL;
    s->agg_taken = 1;
    nids++;
  }
  for (srv_aggw **pp = &s->aggw; *pp;) {
    srv_aggw *w = *pp;
    if (w->table != t->id) {
      pp = &w->next;
      continue;
    }
    *pp = w->next;
    w->next = mine;
    mine = w;
    nids++;
  }
  srv_fwd_group *g = s->ring && ps__ring_size(s->ring) > 1 ? ps__srv_group_new(s) : NULL;
  if (!g) {
    for (srv_aggw *w = mine, *n; w; w = n) {
      n = w->next;
      reply_to(w->c, &w->h, 0, NULL);
      free(w);
    }
    if (s->ring && ps__ring_size(s->ring) > 1)
      ps__log(PS_LOG_ERROR, "table '%s': out of memory forwarding an aggregation buffer", t->decl.name);
    return;
  }
  g->waiters = mine;
  uint8_t *ids = ps__malloc((size_t)nids * PS_FWD_AGG_ID + 1);
  if (!ids) {
    g->status = PS_ERR_NOMEM;
    snprintf(g->msg, sizeof g->msg, "server out of memory forwarding an aggregation buffer");
  } else {
    uint8_t *o = ids;
    for (srv_aggw *w = mine; w; w = w->next, o += PS_FWD_AGG_ID) {
      ps__put_u32(o, w->id.worker);
      ps__put_u32(o + 4, w->id.seq);
      ps__put_u64(o + 8, w->id.inc);
      ps__put_u32(o + 16, w->chain);
      ps__put_u32(o + 20, 0);
    }
    agg_rows a = {.m = agg, .n = ps__rowmap_count(agg), .w = (size_t)t->spec.width + 1};
    uint64_t moved = 0;
    (void)agg_send(s, t, &a, ids, nids, 1, lr, per_row, gb, step, g, &moved);
    /* a row of a chain no longer headed here is not forwarded (its copies would be
     * behind, as after a lost forward): the buffer is applied before a membership can
     * move a head (ps__srv_agg_before_membership), so it holds none */
    free(ids);
  }
  g->building = 0;
  ps__srv_group_maybe_done(s, g);
}

/* ------------------------------------------------------------------ a member */

void ps__srv_on_forward_agg(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  ps__fwd fw;
  ps__table *t = ps__srv_forward_table(s, c, h, b, &fw);
  if (!t) return;
  if (!ps__table_aggregates(t) || !s->ring || ps__ring_size(s->ring) <= 1) {
    ps__srv_reply_err(c, h, PS_ERR_INVALID, "table '%s' does not aggregate pushes here", t->decl.name);
    return;
  }
  const uint8_t *body = b->buf;
  size_t head = PS_FWD_PREFIX + PS_FWD_AGG_PREFIX;
  if (h->payload_len < head) {
    ps__srv_reply_err(c, h, PS_ERR_SIZE, "aggregation forward of %llu bytes", (unsigned long long)h->payload_len);
    return;
  }
  uint32_t nids = ps__get_u32(body + PS_FWD_PREFIX), per_row = ps__get_u32(body + PS_FWD_PREFIX + 4);
  uint64_t gbits = ps__get_u64(body + PS_FWD_PREFIX + 8);
  double gb;
  memcpy(&gb, &gbits, 8);
  size_t w = (size_t)t->spec.width + 1;
  uint64_t need = head + (uint64_t)nids * PS_FWD_AGG_ID + (uint64_t)h->nkeys * (8 + 4 * w);
  if (need != h->payload_len || per_row > 1 || !(gb >= 0)) {
    ps__srv_reply_err(c, h, PS_ERR_SIZE, "aggregation forward of %llu bytes for %u ids and %u rows of dim %u",
                      (unsigned long long)h->payload_len, nids, h->nkeys, t->spec.width);
    return;
  }
  const uint8_t *ids = body + head, *keys = ids + (size_t)nids * PS_FWD_AGG_ID;
  const float *rows = (const float *)(const void *)(keys + 8 * (size_t)h->nkeys);
  srv_fwd_group *g = ps__srv_group_new(s);
  ps__push_id *pid = ps__malloc(((size_t)nids + 1) * sizeof *pid);
  if (!g || !pid) {
    free(pid);
    if (g) g->building = 0, ps__srv_group_maybe_done(s, g);
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  /* The rows' chains first (nothing applied for a frame of the wrong chains), then the
   * engine, then on down the chains. */
  agg_rows a = {.keys = keys, .rows = rows, .n = h->nkeys, .w = w};
  uint64_t moved = 0;
  int rc = 0;
  {
    ps__srv_chains x;
    if (ps__srv_chains_init(&x, s, t)) {
      rc = PS_ERR_NOMEM;
    } else {
      next_cache nc = {.n = 0};
      for (size_t i = 0; i < a.n && !rc; i++) {
        uint64_t key = rows_key(&a, i);
        uint32_t nx;
        if ((x.order && key >= x.nsl) || cached_place(&x, &nc, ps__srv_row_chain(&x, key), &nx) != 2) moved = key, rc = -1;
      }
      ps__srv_chains_free(&x);
    }
  }
  if (rc) {
    free(pid);
    g->building = 0;
    ps__srv_group_maybe_done(s, g);
    if (rc < 0)
      ps__srv_reply_err(c, h, PS_ERR_MOVED, "row %llu of table '%s' is not replicated on this server (epoch %llu)",
                        (unsigned long long)moved, t->decl.name, (unsigned long long)s->epoch);
    else
      ps__srv_reply_err(c, h, rc, "server out of memory");
    return;
  }
  for (uint32_t i = 0; i < nids; i++) {
    const uint8_t *r = ids + (size_t)i * PS_FWD_AGG_ID;
    pid[i] = (ps__push_id){.worker = ps__get_u32(r), .seq = ps__get_u32(r + 4), .inc = ps__get_u64(r + 8),
                           .unit = ps__once_unit(t->id, ps__get_u32(r + 16))};
  }
  ps__verdict v;
  if (ps__shard_agg_replica(s->sh, t, keys, rows, h->nkeys, (int)per_row, h->lr, gb, fw.step, pid, nids, &v) !=
      PS__APPLIED) {
    free(pid);
    g->building = 0;
    ps__srv_group_maybe_done(s, g);
    ps__srv_reply_verdict(c, h, &v);
    return;
  }
  free(pid);
  g->up = c;
  g->up_hdr = *h;
  (void)agg_send(s, t, &a, ids, nids, 2, h->lr, (int)per_row, gb, fw.step, g, &moved);
  g->building = 0;
  ps__srv_group_maybe_done(s, g);
}

/* By the head rule a chain's head moves only when it dies, but a server that was
 * paused past the heartbeat timeout learns of its own death from the membership that
 * moved its heads away. The pushes in a buffer here were taken as head: applied after
 * that membership, the buffer would not go down the chain (this server heads it no
 * more) and its pushes would be answered as applied on this copy alone. So when a
 * membership changes a server's place (a death, a replacement, a copy done), every
 * buffer is applied first and goes down the chains of the view it was taken under: the
 * next member applies it, or refuses it at the new epoch, and then its workers send its
 * pushes again, to the new head, which applies each once. A membership that changes
 * only workers leaves the buffers alone. */
void ps__srv_agg_before_membership(ps__server *s, const ps__membership *m) {
  if (s->replicas < 2 || !s->ring || ps__ring_size(s->ring) <= 1) return;
  int moved = 0;
  for (uint32_t i = 0; i < m->n && !moved; i++) {
    const ps__member *x = &m->m[i];
    if (x->role != PS_ROLE_SERVER) continue;
    uint32_t late;
    moved = ps__member_chain_state(x) != ps__srv_chain_member(s, x->id, &late) || x->late != late;
  }
  if (!moved) return;
  for (size_t i = 0; i < s->sh->ntables; i++) {
    ps__table *t = s->sh->tables[i];
    if (t && ps__table_aggregates(t)) ps__shard_agg_flush(t);
  }
}

/* ------------------------------------------------------------------ lifetime */

void ps__srv_agg_conn_closed(ps__server *s, ps__conn *c) {
  for (srv_aggw *w = s->aggw; w; w = w->next)
    if (w->c == c) w->c = NULL;
  for (srv_fwd_group *g = s->groups; g; g = g->next) {
    if (g->up == c) g->up = NULL;
    for (srv_aggw *w = g->waiters; w; w = w->next)
      if (w->c == c) w->c = NULL;
  }
}

size_t ps__srv_agg_pending(ps__server *s, ps__push_id **ids) {
  size_t n = 0;
  *ids = NULL;
  for (srv_aggw *w = s->aggw; w; w = w->next) n++;
  if (!n) return 0;
  if (!(*ids = ps__malloc(n * sizeof **ids))) return (size_t)-1;
  n = 0;
  for (srv_aggw *w = s->aggw; w; w = w->next) (*ids)[n++] = w->id;
  return n;
}

void ps__srv_agg_free(ps__server *s) {
  free(s->agg_cur);
  s->agg_cur = NULL;
  while (s->aggw) {
    srv_aggw *w = s->aggw;
    s->aggw = w->next;
    free(w);
  }
  while (s->groups) {
    srv_fwd_group *g = s->groups;
    s->groups = g->next;
    for (srv_aggw *w = g->waiters, *n; w; w = n) {
      n = w->next;
      free(w);
    }
    free(g);
  }
}
