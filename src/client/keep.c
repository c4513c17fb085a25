/*
 * keep.c - a worker's copies of its pushes to replicated sync tables, until every copy
 * of their keys holds their round.
 *
 * Under R >= 2 the head of a chain answers a sync push once it is in the round's
 * accumulator, and forwards the round only when it is applied (server/repl_sync.c).
 * Until then the head holds the only copy of the round's pushes, besides the workers.
 * So each worker keeps a copy of every push it sends to a sync table (its frame: header
 * and body, the values inline even when the push itself names the caller's buffers by
 * peer memory), made when the push is first sent, until a server's answer says the
 * push's round is on every copy: a push answer's clock is the clock before which every
 * round of the table is on every copy there, and a pull answered at clock c says the
 * same of the rounds before c's.
 *
 * When a server dies, the pushes kept for it (answered or not) are sent again to their
 * chains' new heads, with their identities, and every live server is told, in a
 * REPLAYED frame, which pushes to the dead server this worker had not seen reach every
 * copy: the new heads wait for them to rebuild the rounds the dead server had not
 * handed on. A push in flight is then sent twice (its copy, and the part itself to the
 * next member); the chain's windows apply it once.
 *
 * A push by peer memory is copied into a shared buffer (ps_alloc, kept for reuse), and
 * the push then names that copy instead of the caller's buffers: the head maps the
 * buffer once and reads the values there, which is cheaper than reading another
 * process's memory, and the copy costs nothing the failover did not cost already. The
 * buffer is held by the copy and by the part, until its request is destroyed (after
 * any time a server may still read it, ps__part_must_hold).
 *
 * Copies are made where the push is sent: on the loop thread, or on a caller's thread
 * that sends it on a lent link (direct.c). The list is under ctx->keep_mu; the failover
 * runs on the loop thread.
 */
#include <string.h>

#include "client/client_int.h"
#include "net/xport.h"

struct kbuf {
  kbuf *next; /* on ctx->kb_free */
  void *p;    /* ps_alloc */
  size_t cap;
  int refs;   /* the copy, the part that names it */
};

#define KBUF_UNIT ((size_t)64 << 10) /* sizes are multiples of this */
#define KBUF_FREE_MAX 8                   /* free buffers kept for reuse */

/* A shared buffer of len bytes or more, one holder; NULL: none (ps_alloc failed). keep_mu held. */
static kbuf *kbuf_get(ps_ctx *ctx, size_t len) {
  kbuf **best = NULL;
  for (kbuf **pp = &ctx->kb_free; *pp; pp = &(*pp)->next)
    if ((*pp)->cap >= len && (!best || (*pp)->cap < (*best)->cap)) best = pp;
  kbuf *b = best ? *best : NULL;
  if (b) {
    *best = b->next;
    ctx->kb_nfree--;
  } else {
    size_t cap = (len + KBUF_UNIT - 1) / KBUF_UNIT * KBUF_UNIT;
    void *m = (b = ps__calloc(1, sizeof *b)) ? ps_alloc(cap) : NULL;
    if (!m) {
      free(b);
      return NULL;
    }
    b->p = m;
    b->cap = cap;
  }
  b->next = NULL;
  b->refs = 1;
  return b;
}

/* One holder lets go of b. keep_mu held. */
static void kbuf_put(ps_ctx *ctx, kbuf *b) {
  if (!b || --b->refs > 0) return;
  if (ctx->kb_closed || ctx->kb_nfree >= KBUF_FREE_MAX) {
    ps_free(b->p);
    free(b);
    return;
  }
  b->next = ctx->kb_free;
  ctx->kb_free = b;
  ctx->kb_nfree++;
}

void ps__keep_part_done(ps_ctx *ctx, part *p) {
  pthread_mutex_lock(&ctx->keep_mu);
  kbuf_put(ctx, p->kb);
  pthread_mutex_unlock(&ctx->keep_mu);
  p->kb = NULL;
}

struct kept {
  kept *next;
  uint32_t server;   /* the server it was sent to, then the one that answered it */
  uint32_t every;    /* the table's clocks per round */
  ps__frame_hdr hdr; /* as sent: type, table, batch, clock, nkeys, lr, identity */
  uint32_t chain[PS_MAX_REPLICAS];
  unsigned nchain;
  uint8_t *body; /* malloc, or kb's memory */
  size_t len;
  kbuf *kb;
};

#define KEEP_MAX_BYTES ((size_t)1 << 30) /* beyond this, the oldest copies are let go (logged) */

/* keep_mu held. */
static void kept_free(ps_ctx *ctx, kept *k) {
  if (k->kb)
    kbuf_put(ctx, k->kb);
  else
    free(k->body);
  free(k);
}

static void keep_drop(ps_ctx *ctx, kept **pp) {
  kept *k = *pp;
  *pp = k->next;
  ctx->kept_bytes -= k->len;
  kept_free(ctx, k);
}

/* Let go of the copies of table's pushes answered by server whose round is before
 * `round_clock` (a clock; rounds before its round are on every copy). */
static void keep_release(ps_ctx *ctx, uint32_t server, uint32_t table, int64_t clock) {
  for (kept **pp = &ctx->kept; *pp;) {
    kept *k = *pp;
    int64_t e = k->every ? (int64_t)k->every : 1;
    if (k->server == server && k->hdr.table == table && k->hdr.clock / e < clock / e)
      keep_drop(ctx, pp);
    else
      pp = &k->next;
  }
}

/* A copy of push part p's frame (the values inline), or NULL (out of memory); of a
 * part by peer memory in a shared buffer when one can be had. */
static kept *keep_copy(ps_ctx *ctx, const part *p) {
  const uv_buf_t *v = p->send;
  unsigned nv = p->nsend;
  int pm = p->hdr.xport == PS_XPORT_PEER_MEM;
  if (pm) { /* segment list, peer-memory tail, then the caller's regions (route.c) */
    if (p->nsend < 1) return NULL;
    nv = p->hdr.nkeys / 2;
  }
  size_t len = pm ? v[0].len : 0;
  const uv_buf_t *vals = pm ? v + 2 : v;
  for (unsigned i = 0; i < nv; i++) len += vals[i].len;
  kept *k = ps__calloc(1, sizeof *k);
  if (k && pm) {
    pthread_mutex_lock(&ctx->keep_mu);
    k->kb = kbuf_get(ctx, len);
    pthread_mutex_unlock(&ctx->keep_mu);
  }
  uint8_t *body = !k ? NULL : k->kb ? k->kb->p : ps__malloc(len ? len : 1);
  if (!body) {
    free(k);
    return NULL;
  }
  size_t o = 0;
  if (pm) memcpy(body, v[0].base, v[0].len), o = v[0].len;
  for (unsigned i = 0; i < nv; i++) memcpy(body + o, vals[i].base, vals[i].len), o += vals[i].len;
  k->server = p->target;
  k->every = p->keep;
  k->hdr = p->hdr;
  k->hdr.xport = PS_XPORT_INLINE;
  k->hdr.payload_len = len;
  memcpy(k->chain, p->chain, sizeof k->chain);
  k->nchain = p->nchain;
  k->body = body;
  k->len = len;
  return k;
}

static kept *keep_find(ps_ctx *ctx, const ps__frame_hdr *h) {
  for (kept *k = ctx->kept; k; k = k->next)
    if (k->hdr.inc == h->inc && k->hdr.seq == h->seq && k->hdr.table == h->table) return k;
  return NULL;
}

/* keep_mu held. */
static void keep_add(ps_ctx *ctx, kept *k) {
  k->next = ctx->kept;
  ctx->kept = k;
  ctx->kept_bytes += k->len;
  while (ctx->kept_bytes > KEEP_MAX_BYTES && ctx->kept) {
    kept **pp = &ctx->kept;
    while ((*pp)->next) pp = &(*pp)->next; /* the oldest */
    ps__log(PS_LOG_WARN, "more than %zu MiB of pushes kept for a failover: letting the oldest go",
            KEEP_MAX_BYTES >> 20);
    keep_drop(ctx, pp);
  }
}

/* Part p, by peer memory, names the values of its copy k (in a shared buffer) instead
 * of the caller's buffers: its tail becomes the expiry, the buffer's hint and one
 * region (the caller's regions stay, for the part's sending again inline). */
static void keep_name(kept *k, part *p) {
  size_t seg = p->send[0].len;
  if (p->nsend != 2 || p->send[1].len < 32 || k->len < seg) return;
  uint8_t *t = (uint8_t *)p->send[1].base;
  uint64_t pair[2] = {(uint64_t)(uintptr_t)(k->body + seg), k->len - seg};
  uint64_t hint = ps__shm_hint(pair, 1);
  if (!hint) return;
  ps__put_u64(t + 8, hint);
  ps__put_u64(t + 16, pair[0]);
  ps__put_u64(t + 24, pair[1]);
  p->send[1].len = 32;
  p->hdr.flags |= PS_FLAG_KEPT;
  p->kb = k->kb;
  k->kb->refs++; /* keep_mu held */
}

void ps__keep_sent(ps_ctx *ctx, part *p) {
  if (!p->keep || !ps__frame_is_push_req(p->hdr.type)) return;
  kept *k = keep_copy(ctx, p); /* outside the lock: a MiB copy */
  pthread_mutex_lock(&ctx->keep_mu);
  ctx->any_keep = 1;
  if (k && k->kb && !p->kb && p->hdr.xport == PS_XPORT_PEER_MEM) keep_name(k, p);
  if (k) keep_add(ctx, k);
  pthread_mutex_unlock(&ctx->keep_mu);
  if (!k) ps__log(PS_LOG_WARN, "out of memory keeping a copy of a push: a failover may miss it");
}

void ps__keep_push(ps_ctx *ctx, part *p, const ps__frame_hdr *h) {
  if (!p->keep) return;
  pthread_mutex_lock(&ctx->keep_mu);
  ctx->any_keep = 1;
  if (!(h->flags & PS_FLAG_DROPPED)) {
    kept *k = keep_find(ctx, &p->hdr);
    if (k) {
      k->server = p->target;
    } else { /* a copy sent again after a failover (its own request's body), or none was made */
      pthread_mutex_unlock(&ctx->keep_mu);
      k = keep_copy(ctx, p);
      pthread_mutex_lock(&ctx->keep_mu);
      if (k && keep_find(ctx, &p->hdr)) { /* made meanwhile */
        kept_free(ctx, k);
        k = keep_find(ctx, &p->hdr);
        k->server = p->target;
      } else if (k) {
        keep_add(ctx, k);
      } else {
        ps__log(PS_LOG_WARN, "out of memory keeping a copy of a push: a failover may miss it");
      }
    }
  }
  keep_release(ctx, p->target, p->hdr.table, h->clock);
  pthread_mutex_unlock(&ctx->keep_mu);
}

void ps__keep_pull(ps_ctx *ctx, part *p, const ps__frame_hdr *h) {
  if (!p->keep) return;
  pthread_mutex_lock(&ctx->keep_mu);
  keep_release(ctx, p->target, p->hdr.table, h->clock);
  pthread_mutex_unlock(&ctx->keep_mu);
}

/* Send a kept push again, as a request nobody waits for, to its chain's head. */
static void keep_resend(ps_ctx *ctx, kept *k) {
  ps_req *r = ps__calloc(1, sizeof *r);
  if (r) {
    r->parts = ps__calloc(1, sizeof *r->parts);
    r->bufs = ps__calloc(1, sizeof *r->bufs);
  }
  if (!r || !r->parts || !r->bufs) {
    if (r) free(r->parts), free(r->bufs);
    free(r);
    pthread_mutex_lock(&ctx->keep_mu);
    kept_free(ctx, k);
    pthread_mutex_unlock(&ctx->keep_mu);
    ps__log(PS_LOG_WARN, "out of memory sending a push again after a failover");
    return;
  }
  r->ctx = ctx;
  r->nparts = r->remaining = 1;
  r->kind = 1;
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  r->canceled = 2; /* detached: freed by the loop when done */
  if (!k->kb) r->own_keys = k->body; /* taken */
  r->parts[0].kb = k->kb;              /* or its buffer's hold */
  r->bufs[0] = uv_buf_init((char *)k->body, (unsigned)k->len);
  part *p = &r->parts[0];
  p->req = r;
  p->hdr = k->hdr;
  p->hdr.req_id = __atomic_add_fetch(&ctx->next_req_id, 1, __ATOMIC_RELAXED);
  p->target = k->chain[0];
  memcpy(p->chain, k->chain, sizeof p->chain);
  p->nchain = k->nchain;
  p->keep = k->every;
  p->send = r->bufs;
  p->nsend = 1;
  p->deadline_ms = ps__now_ms() + ctx->timeout_ms;
  ps__part_submit(ctx, p);
}

static void put_entry(uint8_t *q, const ps__frame_hdr *h, const uint32_t *chain, unsigned nchain) {
  memset(q, 0, PS_REPLAYED_ENTRY);
  ps__put_u32(q, h->table);
  ps__put_u32(q + 4, h->batch);
  ps__put_u64(q + 8, (uint64_t)h->clock);
  ps__put_u64(q + 16, h->inc);
  ps__put_u32(q + 24, h->seq);
  ps__put_u32(q + 28, nchain);
  for (unsigned i = 0; i < nchain && i < PS_MAX_REPLICAS; i++) ps__put_u32(q + 32 + 4 * i, chain[i]);
}

void ps__keep_fail_over(ps_ctx *ctx, uint32_t dead, uint64_t epoch, part **moving, size_t nmoving) {
  if (__atomic_load_n(&ctx->replicas, __ATOMIC_RELAXED) < 2) return;
  pthread_mutex_lock(&ctx->keep_mu);
  size_t n = 0;
  for (kept *k = ctx->kept; k; k = k->next) n += k->server == dead;
  /* a push being moved is listed from its copy (made when it was sent), else here */
  uint8_t *listed = nmoving ? ps__calloc(nmoving, 1) : NULL;
  for (size_t i = 0; i < nmoving; i++) {
    const kept *k = moving[i]->keep ? keep_find(ctx, &moving[i]->hdr) : NULL;
    if (moving[i]->keep && !(k && k->server == dead) && listed) listed[i] = 1, n++;
  }
  if ((!n && !ctx->any_keep) || (nmoving && !listed)) { /* this worker never pushed to a replicated sync table */
    pthread_mutex_unlock(&ctx->keep_mu);
    if (nmoving && !listed) ps__log(PS_LOG_WARN, "out of memory telling the servers which pushes to server %u to wait for", dead);
    return;
  }
  size_t len = 8 + n * PS_REPLAYED_ENTRY;
  uint8_t *body = ps__malloc(len);
  if (!body) {
    pthread_mutex_unlock(&ctx->keep_mu);
    free(listed);
    ps__log(PS_LOG_WARN, "out of memory telling the servers which pushes to server %u to wait for", dead);
    return;
  }
  ps__put_u32(body, dead);
  ps__put_u32(body + 4, (uint32_t)n);
  size_t e = 0;
  for (size_t i = 0; i < nmoving; i++)
    if (listed[i]) put_entry(body + 8 + PS_REPLAYED_ENTRY * e++, &moving[i]->hdr, moving[i]->chain, moving[i]->nchain);
  free(listed);
  kept *gone = NULL;
  for (kept **pp = &ctx->kept; *pp;) {
    kept *k = *pp;
    if (k->server != dead) {
      pp = &k->next;
      continue;
    }
    put_entry(body + 8 + PS_REPLAYED_ENTRY * e++, &k->hdr, k->chain, k->nchain);
    *pp = k->next;
    ctx->kept_bytes -= k->len;
    k->next = gone;
    gone = k;
  }
  pthread_mutex_unlock(&ctx->keep_mu);
  size_t resent = 0;
  while (gone) {
    kept *k = gone;
    gone = k->next;
    keep_resend(ctx, k); /* takes k->body, or k->kb's hold */
    free(k);
    resent++;
  }
  if (resent) ps__log(PS_LOG_INFO, "server %u left the job; sending %zu push%s of unfinished rounds again", dead, resent,
                      resent == 1 ? "" : "es");
  /* To every live server: the new heads of the dead server's chains wait for it. It
   * carries the epoch of the membership that said the server left, so that a server
   * that has not had that membership yet keeps the list until it has (its catch-up
   * starts then). */
  ps__frame_hdr h = {.type = PS_MSG_REPLAYED, .sender = ctx->id, .epoch = epoch};
  ps__fire_servers(ctx, &h, body, len);
  free(body);
}

void ps__keep_free(ps_ctx *ctx) {
  pthread_mutex_lock(&ctx->keep_mu);
  while (ctx->kept) keep_drop(ctx, &ctx->kept);
  ctx->kb_closed = 1;
  while (ctx->kb_free) {
    kbuf *b = ctx->kb_free;
    ctx->kb_free = b->next;
    ps_free(b->p);
    free(b);
  }
  ctx->kb_nfree = 0;
  pthread_mutex_unlock(&ctx->keep_mu);
}
