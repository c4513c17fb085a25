/*
 * repair.c - bringing a chain back to R copies: the rows a replacement copies from the
 * tails of its chains, and the forwards it holds meanwhile.
 *
 * A replacement X takes a dead server's id (the scheduler's `--join`), so the ring and
 * every chain are unchanged; X is listed `syncing` and by the head rule (common/ring.h)
 * comes after every other live member of its chains. When a server T sees X syncing
 * in a membership, it is the *tail* of the chains in which X follows it, and in the
 * same loop step it
 *   - cuts every table without copying it (ps__shard_snap_keep),
 *   - encodes its exactly-once windows and each table's step and version,
 * and, the membership having made X the member after it, forwards every push it
 * applies from then on to X as well. It then streams the cut rows of those chains (key
 * and whole row: parameters and optimiser state) to X as SYNC_ROWS frames, one at a time
 * and each under the control-body limit, from the loop between other work, and ends
 * with SYNC_DONE (the windows, the steps). X answers the forwards from T at once but
 * holds them until T's SYNC_DONE; then it has T's rows, merges the windows and applies
 * the held forwards in their order. When every source (each server that held a copy
 * when X joined) is done, X sends SYNCED to the scheduler, which clears `syncing`.
 *
 * Failures: X dying is a syncing member dying (its sources drop their streams). A server
 * dying while X copies (a source, or any other) changes the tails of some of X's chains:
 * the scheduler's membership is the trigger, and X and every live source see the same
 * death in it. Each source then drops its stream to X, cut or done, and starts a new
 * one from a fresh cut (the new tails of the dead one's chains are among them); X drops
 * the dead source, and for every live one forgets the forwards it held and waits for
 * the new stream, whose rows overwrite those of the old (a later cut of the same
 * chains holds every key the earlier one did). A stream carries the epoch of its cut
 * (the header's clock), so X tells a frame of the old stream from one of the new, in
 * whichever order the membership and the frames come. X stops only when some chain of
 * it has no other live copy left (those rows are lost), or when no frame came for
 * REPAIR_STALL_MS. Once X said SYNCED it refuses new streams: it has every row.
 *
 * Sync tables: rounds are applied whole on this thread, so the cut falls between two
 * rounds. SYNC_DONE says, per chain copied, how many rounds its rows hold (the table's
 * version where T heads the chain, else the rounds forwarded to T); every later round
 * reaches X as a FORWARD_ROUND held with the other forwards, and is applied after the
 * rows (a round the chain holds already is skipped, as for any member). X answers held
 * forwards at once, so a pull waits for its round on every copy that holds its rows:
 * X counts in the durable clock once it applies forwards itself, after SYNC_DONE. X never
 * heads while syncing (the head rule), so no round starts here before the copy is in.
 *
 * This file is the replacement's side, the membership and the ticks; a tail's streams
 * out are in repair_out.c. Everything here runs on the server's loop thread.
 */
#include <string.h>

#include "common/common.h"
#include "proto/msg.h"
#include "server/repair_int.h"

#define REPAIR_STALL_MS 60000u    /* a replacement waits this long for a frame of a source */
#define REPAIR_HELD_MAX (1ull << 30) /* bytes of forwards a replacement holds, at most */
#define REPAIR_SYNCED_EVERY_MS 1000u

static srv_repair *repair_of(ps__server *s) {
  if (!s->repair) {
    s->repair = ps__calloc(1, sizeof *s->repair);
    if (s->repair) {
      s->repair->sink.closing = 1;
      s->repair->sink.loop = &s->loop;
      snprintf(s->repair->sink.peer, sizeof s->repair->sink.peer, "(held forward)");
    }
  }
  return s->repair;
}

/* Sets of server ids (small: a job's servers). */
static int ids_has(const uint32_t *v, size_t n, uint32_t id) {
  for (size_t i = 0; i < n; i++)
    if (v[i] == id) return 1;
  return 0;
}

int ps__rp_ids_add(uint32_t **v, size_t *n, uint32_t id) {
  if (ids_has(*v, *n, id)) return 0;
  uint32_t *nv = ps__realloc(*v, (*n + 1) * sizeof *nv);
  if (!nv) return PS_ERR_NOMEM;
  nv[(*n)++] = id;
  *v = nv;
  return 0;
}

static void ids_del(uint32_t *v, size_t *n, uint32_t id) {
  for (size_t i = 0; i < *n; i++)
    if (v[i] == id) {
      v[i] = v[--*n];
      return;
    }
}

/* Did a server that was live at the last membership die in m? Notes m's live servers. */
static int deaths_since(srv_repair *r, const ps__membership *m) {
  int died = 0;
  for (size_t i = 0; i < r->nlive && !died; i++) {
    int alive = 0;
    for (uint32_t j = 0; j < m->n && !alive; j++)
      alive = m->m[j].id == r->live[i] && m->m[j].alive;
    died = !alive;
  }
  uint32_t *v = ps__malloc((m->n ? m->n : 1) * sizeof *v);
  if (!v) return died; /* the old list stays: a death is seen again next time */
  size_t n = 0;
  for (uint32_t j = 0; j < m->n; j++)
    if (m->m[j].role == PS_ROLE_SERVER && m->m[j].alive) v[n++] = m->m[j].id;
  free(r->live);
  r->live = v;
  r->nlive = n;
  return died;
}

/* ------------------------------------------------------------------ the replacement: streams in */

static rp_src *src_of(srv_repair *r, uint32_t id) {
  for (size_t i = 0; i < r->nsrc; i++)
    if (r->src[i].id == id) return &r->src[i];
  return NULL;
}

static void held_free(ps__server *s, rp_src *q) {
  for (rp_held *x = q->head, *n; x; x = n) {
    n = x->next;
    ps__pool_put(s->pool, x->buf, x->len);
    free(x);
  }
  q->head = q->tail = NULL;
  s->repair->held_bytes -= q->held;
  q->held = 0;
}

int ps__srv_repair_syncing(const ps__server *s) { return s->repair && s->repair->syncing; }

int ps__srv_repair_hold(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  srv_repair *r = s->repair;
  if (!r || !r->syncing || s->replaying) return 0;
  rp_src *q = src_of(r, h->sender);
  if (!q || q->done || q->gone) return 0;
  ps__fwd fw;
  ps__fwd_get(b->buf, &fw);
  if (fw.epoch != s->epoch) return 0; /* refused as usual */
  if (r->held_bytes + b->len > REPAIR_HELD_MAX) {
    ps__srv_reply_err(c, h, PS_ERR_UNAVAILABLE, "server %u holds %llu bytes of forwards while it copies its rows; send again",
                      s->id, (unsigned long long)r->held_bytes);
    return 1;
  }
  rp_held *x = ps__malloc(sizeof *x);
  if (!x) {
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    return 1;
  }
  x->h = *h;
  x->buf = b->buf; /* the pooled body, taken */
  x->len = b->len;
  b->buf = NULL;
  x->next = NULL;
  if (q->tail) q->tail->next = x;
  else q->head = x;
  q->tail = x;
  q->held += x->len;
  r->held_bytes += x->len;
  ps__srv_reply_ok(c, h, 0); /* on this copy once the rows are in, which comes first */
  return 1;
}

void ps__srv_repair_refused(ps__server *s, ps__conn *c, int err, const char *msg) {
  srv_repair *r = s->repair;
  if (!r || !s->replaying || c != &r->sink) return;
  r->replay_refused++;
  ps__log(PS_LOG_ERROR, "a held forward, answered when it came, was refused when applied: %s: %s; this copy misses it",
          ps_strerror(err), msg);
}

/* Apply source q's held forwards, in their order, as if they came now. */
static void replay(ps__server *s, rp_src *q) {
  srv_repair *r = s->repair;
  s->replaying = 1;
  while (q->head) {
    rp_held *x = q->head;
    q->head = x->next;
    ps__body b;
    memset(&b, 0, sizeof b);
    b.buf = x->buf;
    b.len = x->len;
    ps__fwd fw;
    ps__fwd_get(x->buf, &fw);
    ps__put_u64(x->buf, s->epoch); /* checked when it came */
    if (x->h.type == PS_MSG_FORWARD || x->h.type == PS_MSG_FORWARD_DENSE)
      ps__srv_on_forward(s, &r->sink, &x->h, &b, x->h.type == PS_MSG_FORWARD_DENSE);
    else if (x->h.type == PS_MSG_FORWARD_AGG)
      ps__srv_on_forward_agg(s, &r->sink, &x->h, &b);
    else if (x->h.type == PS_MSG_FORWARD_ROUND)
      ps__srv_on_forward_round(s, &r->sink, &x->h, &b);
    if (b.buf) ps__pool_put(s->pool, b.buf, x->len);
    r->replayed++;
    r->held_bytes -= x->len;
    q->held -= x->len;
    free(x);
  }
  q->tail = NULL;
  s->replaying = 0;
}

/* A copy frame from h->sender: is it of the stream being taken from that source? A
 * stream cut later than the one being taken (the source cut again after a death) takes
 * its place: the rows of the old one are overwritten by it, its held forwards are in
 * its cut. 0 with *out, or -1 (answered). */
static int src_check(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const ps__body *b, rp_src **out) {
  srv_repair *r = s->repair;
  rp_src *q = r && r->syncing ? src_of(r, h->sender) : NULL;
  uint32_t stream = b->len >= 4 ? ps__get_u32(b->buf) : 0;
  uint64_t cut = h->clock > 0 ? (uint64_t)h->clock : 0;
  if (!q || q->gone) {
    ps__srv_reply_err(c, h, PS_ERR_UNAVAILABLE, "server %u is not copying rows from server %u (epoch %llu)", s->id,
                      h->sender, (unsigned long long)s->epoch);
    return -1;
  }
  if (q->done && stream == q->stream) {
    if (h->type == PS_MSG_SYNC_DONE) ps__srv_reply_ok(c, h, 0); /* its answer was lost: the same again */
    else ps__srv_reply_err(c, h, PS_ERR_UNAVAILABLE, "the copy of stream %u is complete here", stream);
    return -1;
  }
  if (r->synced || cut < q->min_epoch || (q->stream && stream != q->stream && cut < q->cut_epoch)) {
    ps__srv_reply_err(c, h, PS_ERR_UNAVAILABLE, "server %u does not take stream %u (cut at epoch %llu) from server %u: %s",
                      s->id, stream, (unsigned long long)cut, h->sender,
                      r->synced ? "it holds every copy already" : "a later copy replaces it");
    return -1;
  }
  if (stream != q->stream) {
    if (q->stream) {
      ps__log(PS_LOG_INFO, "server %u copies its rows here again (a fresh cut at epoch %llu)", q->id, (unsigned long long)cut);
      held_free(s, q);
      q->rows = 0;
    }
    q->done = 0;
    q->stream = stream;
    q->cut_epoch = cut;
  }
  *out = q;
  r->last_progress = uv_now(&s->loop);
  return 0;
}

void ps__srv_on_sync_rows(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  rp_src *q;
  if (src_check(s, c, h, b, &q)) return;
  ps__rbuf rb;
  ps__rbuf_init(&rb, b->buf, b->len);
  (void)ps__rbuf_u32(&rb); /* stream */
  uint32_t rf = ps__rbuf_u32(&rb), dlen = ps__rbuf_u32(&rb);
  ps__declare d;
  if (rb.err || dlen > b->len - rb.off || ps__declare_decode((const uint8_t *)b->buf + rb.off, dlen, &d)) {
    ps__srv_reply_err(c, h, PS_ERR_PROTO, "malformed sync-rows frame");
    return;
  }
  size_t off = rb.off + dlen;
  uint64_t per = 8 + 4 * (uint64_t)rf;
  if (d.id != h->table || rf == 0 || (b->len - off) != (uint64_t)h->batch * per) {
    ps__srv_reply_err(c, h, PS_ERR_PROTO, "sync-rows frame of %zu bytes for %u rows of %u floats", b->len, h->batch, rf);
    return;
  }
  ps__table *t = ps__shard_table(s->sh, d.id);
  if (!t) {
    ps__verdict v;
    char why[400];
    if (ps__shard_create(s->sh, &d, &v) != PS__APPLIED) {
      ps__srv_reply_verdict(c, h, &v);
      return;
    }
    t = ps__shard_table(s->sh, d.id);
    if (ps__srv_create_fits(s, t, why, sizeof why)) {
      ps__shard_drop(s->sh, d.id);
      ps__srv_reply_err(c, h, PS_ERR_NOMEM, "%s", why);
      return;
    }
  }
  if (ps__spec_row_floats(&t->spec) != rf) {
    ps__srv_reply_err(c, h, PS_ERR_DIM, "table '%s' has rows of %zu floats here, not %u", t->decl.name,
                      ps__spec_row_floats(&t->spec), rf);
    return;
  }
  const uint8_t *keys = (const uint8_t *)b->buf + off;
  const uint8_t *rows = keys + 8 * (size_t)h->batch;
  float *row = ps__malloc((size_t)rf * sizeof *row);
  if (!row) {
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  for (uint32_t i = 0; i < h->batch; i++) {
    memcpy(row, rows + (size_t)i * rf * 4, (size_t)rf * 4); /* the frame's floats may be unaligned */
    if (ps__shard_import(t, ps__get_u64(keys + 8 * (size_t)i), row)) {
      free(row);
      ps__srv_reply_err(c, h, PS_ERR_NOMEM, "out of memory for the rows of table '%s'", t->decl.name);
      return;
    }
  }
  free(row);
  q->rows += h->batch;
  s->repair->rows_in += h->batch;
  ps__srv_reply_ok(c, h, 0);
}

static void synced_send(ps__server *s) {
  srv_repair *r = s->repair;
  if (!s->agent.conn || s->agent.rejoining) return;
  ps__frame_hdr h = {.type = PS_MSG_SYNCED, .sender = s->id, .epoch = s->epoch};
  if (!ps__conn_send_ctrl(s->agent.conn, &h, NULL, 0)) r->synced_sent_at = uv_now(&s->loop);
}

void ps__srv_on_sync_done(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  rp_src *q;
  if (src_check(s, c, h, b, &q)) return;
  ps__rbuf rb;
  ps__rbuf_init(&rb, b->buf, b->len);
  (void)ps__rbuf_u32(&rb);
  uint32_t nt = ps__rbuf_u32(&rb);
  if (rb.err || nt > PS__MAX_TABLES || (uint64_t)nt * 24 > b->len - rb.off) {
    ps__srv_reply_err(c, h, PS_ERR_PROTO, "malformed sync-done frame");
    return;
  }
  /* Checked whole first: a malformed frame changes nothing. */
  size_t at = rb.off;
  for (uint32_t i = 0; i < nt && !rb.err; i++) {
    (void)ps__rbuf_u32(&rb);
    uint32_t nck = ps__rbuf_u32(&rb);
    (void)ps__rbuf_u64(&rb);
    (void)ps__rbuf_u64(&rb);
    if (rb.err || (uint64_t)nck * 16 > b->len - rb.off) rb.err = 1;
    else rb.off += (size_t)nck * 16;
  }
  uint32_t nw = rb.err ? 0 : ps__rbuf_u32(&rb);
  size_t clocks = rb.off;
  if (rb.err || (uint64_t)nw * 16 > b->len - rb.off) {
    ps__srv_reply_err(c, h, PS_ERR_PROTO, "malformed sync-done frame");
    return;
  }
  size_t windows = rb.off + (size_t)nw * 16;
  rb.off = at;
  for (uint32_t i = 0; i < nt; i++) {
    uint32_t id = ps__rbuf_u32(&rb), nck = ps__rbuf_u32(&rb);
    uint64_t step = ps__rbuf_u64(&rb);
    int64_t version = (int64_t)ps__rbuf_u64(&rb);
    ps__table *t = ps__shard_table(s->sh, id);
    if (t && step > t->step) t->step = step;
    /* A sync table: its rounds run on here from the source's (CLOCKs move them on), and
     * each chain copied holds the rounds of the cut; the later ones are held forwards. */
    if (t && ps__table_is_sync(t) && version > t->version) t->version = version;
    for (uint32_t j = 0; j < nck; j++) {
      uint32_t ck = ps__rbuf_u32(&rb);
      (void)ps__rbuf_u32(&rb);
      int64_t rounds = (int64_t)ps__rbuf_u64(&rb);
      if (t && ps__table_is_sync(t)) ps__srv_sync_set_chain_rounds(s, t, ck, rounds);
    }
  }
  int rc = ps__once_set_merge(&s->sh->once, (const uint8_t *)b->buf + windows, b->len - windows);
  if (rc) {
    ps__srv_reply_err(c, h, rc, "sync-done: %s", ps_errmsg());
    return;
  }
  rb.off = clocks;
  for (uint32_t i = 0; i < nw; i++) {
    uint32_t id = ps__rbuf_u32(&rb);
    (void)ps__rbuf_u32(&rb);
    int64_t clock = (int64_t)ps__rbuf_u64(&rb);
    ps__shard_clock(s->sh, id, clock); /* the larger of the two stays */
  }
  q->done = 1;
  ps__srv_reply_ok(c, h, 0);
  replay(s, q);
  ps__log(PS_LOG_INFO, "copied %llu rows from server %u", (unsigned long long)q->rows, q->id);
  srv_repair *r = s->repair;
  size_t left = 0;
  for (size_t i = 0; i < r->nsrc; i++) left += !r->src[i].done && !r->src[i].gone;
  if (!left) {
    r->synced = 1;
    ps__log(PS_LOG_INFO, "every copy is in (%llu rows); telling the scheduler", (unsigned long long)r->rows_in);
    synced_send(s);
  }
}

/* ------------------------------------------------------------------ membership and ticks */

/* This server is syncing and its sources are not known yet: every live server that holds
 * its copies now is one (each streams the chains it is the tail of, maybe none). */
static void in_begin(ps__server *s, const ps__membership *m) {
  srv_repair *r = s->repair;
  r->src = ps__calloc(m->n ? m->n : 1, sizeof *r->src);
  if (!r->src) {
    ps__log(PS_LOG_ERROR, "out of memory starting to copy rows; stopping");
    ps__srv_fail(s, PS_ERR_NOMEM);
    return;
  }
  for (uint32_t i = 0; i < m->n; i++) {
    const ps__member *x = &m->m[i];
    uint8_t st = ps__member_chain_state(x);
    if (x->role != PS_ROLE_SERVER || x->id == s->id || (st != PS_CHAIN_LIVE && st != PS_CHAIN_LATE)) continue;
    r->src[r->nsrc++].id = x->id;
  }
  r->syncing = 1;
  r->last_progress = uv_now(&s->loop);
  ps__log(PS_LOG_INFO, "this server replaces server %u: copying its rows from %zu server%s", s->id, r->nsrc,
          r->nsrc == 1 ? "" : "s");
  if (!r->nsrc) { /* nobody to copy from (cannot happen: the scheduler checks) */
    r->synced = 1;
    synced_send(s);
  }
}

/* Does some key range of this server have no live member but this (syncing) one? Its
 * rows had no copy left to come from. By the ring's routes, as the scheduler's check. */
static int rows_lost(ps__server *s) {
  for (size_t i = 0; s->ring && i < ps__ring_nroutes(s->ring); i++) {
    uint32_t c[PS_MAX_REPLICAS];
    size_t n = ps__ring_route(s->ring, i, c), mine = 0, other = 0;
    if (n > PS_MAX_REPLICAS) n = PS_MAX_REPLICAS;
    for (size_t j = 0; j < n; j++) {
      uint8_t st = ps__srv_chain_state(s, c[j]);
      if (c[j] == s->id) mine = 1;
      else other += st == PS_CHAIN_LIVE || st == PS_CHAIN_LATE;
    }
    if (mine && !other) return 1;
  }
  return 0;
}

/* As a syncing replacement, at a membership: sources that left are dropped, and after
 * any server's death every live source cuts again (it does so at the same membership),
 * so each is waited for anew unless its new stream came first. */
static void in_membership(ps__server *s, int died) {
  srv_repair *r = s->repair;
  size_t gone = 0, again = 0;
  for (size_t i = 0; i < r->nsrc; i++) {
    rp_src *q = &r->src[i];
    if (q->gone) continue;
    uint8_t st = ps__srv_chain_state(s, q->id);
    if (st != PS_CHAIN_LIVE && st != PS_CHAIN_LATE) {
      if (!q->done && !r->synced)
        ps__log(PS_LOG_WARN, "server %u left the job before its rows were copied here; they come from the chains' "
                "new tails", q->id);
      held_free(s, q);
      q->gone = 1;
      gone++;
      continue;
    }
    if (!died || r->synced || (q->stream && q->cut_epoch >= s->epoch)) continue;
    held_free(s, q);
    q->done = 0;
    q->rows = 0;
    q->stream = 0;
    q->cut_epoch = 0;
    q->min_epoch = s->epoch;
    again++;
  }
  if (r->synced) return;
  if (gone || again) {
    r->restarts++;
    r->last_progress = uv_now(&s->loop);
    ps__log(PS_LOG_INFO, "a server left the job while rows were copied here: copying again from %zu server%s (epoch %llu)",
            again, again == 1 ? "" : "s", (unsigned long long)s->epoch);
  }
  if (rows_lost(s)) {
    ps__log(PS_LOG_ERROR, "every other copy of some of this server's key ranges left the job before they were copied "
            "here; this replacement stops");
    ps__srv_fail(s, PS_ERR_UNAVAILABLE);
  }
}

/* Start the streams that must start (want), now that no checkpoint's cut is read, or
 * keep them wanted for the next tick. */
static void start_wanted(ps__server *s) {
  srv_repair *r = s->repair;
  size_t n = r->nwant;
  uint32_t todo[64];
  if (n > sizeof todo / sizeof *todo) n = sizeof todo / sizeof *todo;
  if (n) memcpy(todo, r->want, n * sizeof *todo);
  for (size_t i = 0; i < n; i++) {
    uint32_t x = todo[i];
    ids_del(r->want, &r->nwant, x); /* its chains' places count x as next while it is cut */
    if (ps__srv_chain_state(s, x) != PS_CHAIN_SYNCING) continue;
    int rc = ps__rp_out_start(s, x);
    if (rc) {
      /* A checkpoint's cut is being read (or memory ran out). The copy must start in
       * the same step as the forwards to the replacement, so until then nothing is
       * forwarded to it from here (ps__srv_repair_blocked): the cut will hold those
       * pushes. Tried again at the next tick. */
      if (ps__rp_ids_add(&r->want, &r->nwant, x)) ps__log(PS_LOG_ERROR, "out of memory for the copy to server %u", x);
      continue;
    }
    for (rp_out *o = r->outs; o; o = o->next)
      if (o->to == x) ps__rp_out_pump(s, o);
  }
}

void ps__srv_repair_membership(ps__server *s, const ps__membership *m) {
  if (s->replicas < 2) return;
  int self_syncing = s->self_state == PS_CHAIN_SYNCING;
  int any_syncing = 0;
  for (uint32_t i = 0; i < m->n; i++)
    any_syncing |= m->m[i].role == PS_ROLE_SERVER && m->m[i].alive && m->m[i].syncing && m->m[i].id != s->id;
  if (!s->repair && !self_syncing && !any_syncing) return;
  srv_repair *r = repair_of(s);
  if (!r) {
    ps__log(PS_LOG_ERROR, "out of memory for the copy of rows to or from a replacement");
    return;
  }
  int died = deaths_since(r, m);
  if (self_syncing) {
    if (!r->syncing) in_begin(s, m);
    else in_membership(s, died);
  } else if (r->syncing) { /* the scheduler took the copy as complete */
    for (size_t i = 0; i < r->nsrc; i++) held_free(s, &r->src[i]);
    free(r->src);
    r->src = NULL;
    r->nsrc = 0;
    r->syncing = 0;
    ps__log(PS_LOG_INFO, "this server holds its copies; it serves as a replacement");
  }
  /* Streams to replacements that died or are done; after a death, every stream to a
   * replacement still syncing starts again from a fresh cut (its tails changed). */
  for (rp_out *o = r->outs, *n; o; o = n) {
    n = o->next;
    int syncing = ps__srv_chain_state(s, o->to) == PS_CHAIN_SYNCING;
    if (syncing && !died) continue;
    if (syncing) {
      ps__log(PS_LOG_INFO, "a server left the job: copying to replacement server %u again from a fresh cut", o->to);
      r->restarts++;
      if (ps__rp_ids_add(&r->want, &r->nwant, o->to)) ps__log(PS_LOG_ERROR, "out of memory for the copy to server %u", o->to);
    }
    ps__rp_out_unlink(s, o);
    ps__rp_out_free(s, o);
  }
  for (size_t i = r->nserved; i-- > 0;) {
    uint32_t x = r->served[i];
    int syncing = ps__srv_chain_state(s, x) == PS_CHAIN_SYNCING;
    if (syncing && !died) continue;
    ids_del(r->served, &r->nserved, x);
    if (syncing) {
      ps__log(PS_LOG_INFO, "a server left the job: copying to replacement server %u again from a fresh cut", x);
      r->restarts++;
      if (ps__rp_ids_add(&r->want, &r->nwant, x)) ps__log(PS_LOG_ERROR, "out of memory for the copy to server %u", x);
    }
  }
  for (size_t i = r->nwant; i-- > 0;)
    if (ps__srv_chain_state(s, r->want[i]) != PS_CHAIN_SYNCING) ids_del(r->want, &r->nwant, r->want[i]);
  /* New replacements to copy to: this server holds its copies (not syncing itself). */
  if (self_syncing) {
    r->nwant = 0;
    return;
  }
  for (uint32_t i = 0; i < m->n; i++) {
    const ps__member *x = &m->m[i];
    if (x->role != PS_ROLE_SERVER || x->id == s->id || !x->alive || !x->syncing) continue;
    int have = ids_has(r->served, r->nserved, x->id);
    for (rp_out *o = r->outs; o && !have; o = o->next) have = o->to == x->id;
    if (!have && ps__rp_ids_add(&r->want, &r->nwant, x->id))
      ps__log(PS_LOG_ERROR, "out of memory for the copy to server %u", x->id);
  }
  start_wanted(s);
}

int ps__srv_repair_blocked(ps__server *s, uint32_t to) {
  srv_repair *r = s->repair;
  return r && ids_has(r->want, r->nwant, to) && ps__srv_chain_state(s, to) == PS_CHAIN_SYNCING;
}

void ps__srv_repair_tick(ps__server *s) {
  srv_repair *r = s->repair;
  if (!r) return;
  uint64_t now = uv_now(&s->loop);
  if (r->nwant && s->self_state != PS_CHAIN_SYNCING) start_wanted(s);
  for (rp_out *o = r->outs, *n; o; o = n) {
    n = o->next;
    ps__rp_out_pump(s, o);
  }
  if (r->syncing && !r->synced && now - r->last_progress > REPAIR_STALL_MS) {
    ps__log(PS_LOG_ERROR, "no copy of rows arrived for %u ms; this replacement stops", REPAIR_STALL_MS);
    ps__srv_fail(s, PS_ERR_TIMEOUT);
    return;
  }
  if (r->syncing && r->synced && now - r->synced_sent_at >= REPAIR_SYNCED_EVERY_MS) synced_send(s);
}

void ps__srv_repair_stats(ps__server *s, char *line, size_t cap) {
  srv_repair *r = s->repair;
  size_t left = 0;
  for (size_t i = 0; r && i < r->nsrc; i++) left += !r->src[i].done && !r->src[i].gone;
  size_t outs = 0;
  for (rp_out *o = r ? r->outs : NULL; o; o = o->next) outs++;
  snprintf(line, cap,
           "syncing %d\nrepair_sources_left %zu\nrepair_rows_in %llu\nrepair_forwards_held %llu\n"
           "repair_copies_out %zu\nrepair_copies_done %llu\nrepair_rows_out %llu\nrepair_restarts %llu\n"
           "catchups_running %zu\nrepair_replay_refused %llu\n",
           s->self_state == PS_CHAIN_SYNCING, left, (unsigned long long)(r ? r->rows_in : 0),
           (unsigned long long)(r ? r->replayed : 0), outs, (unsigned long long)(r ? r->streams_done : 0),
           (unsigned long long)(r ? r->rows_out : 0), (unsigned long long)(r ? r->restarts : 0),
           ps__srv_sync_catchups_running(s), (unsigned long long)(r ? r->replay_refused : 0));
}

void ps__srv_repair_free(ps__server *s) {
  srv_repair *r = s->repair;
  if (!r) return;
  while (r->outs) {
    rp_out *o = r->outs;
    r->outs = o->next;
    ps__rp_out_free(s, o);
  }
  for (size_t i = 0; i < r->nsrc; i++) held_free(s, &r->src[i]);
  free(r->src);
  free(r->want);
  free(r->served);
  free(r->live);
  free(r);
  s->repair = NULL;
}
