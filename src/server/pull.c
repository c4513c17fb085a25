/*
 * pull.c - pulls: answered at once when the engine says the table is ready for the
 * pull's clock, else parked (with their request body) until a round, a clock or the
 * live set makes them ready (ps__srv_answer_ready_pulls after every such change).
 *
 * Dense replies go out straight from the parameter rows (ps__conn_send_now writes what
 * the socket takes at once and copies only the rest), or into the worker's memory
 * (peer.c). Sparse replies are copied into a pooled buffer; a large one is produced
 * while the socket drains what is ready, and a huge one is filled on two threads.
 */
#include <string.h>

#include "common/common.h"
#include "proto/codec.h"
#include "server/server_int.h"

/* A sparse pull reply of STREAM_MIN bytes or more is produced STREAM_CHUNK at a time
 * while the socket drains what is ready (ps__conn_send_produced). */
#define STREAM_MIN ((size_t)16 << 20)
#define STREAM_CHUNK ((size_t)256 << 10)

/* ---------------------------------------------------------------- dense replies */

/* The rows a dense pull reads, as regions: runs that are adjacent in memory are one
 * region (consecutive slices of an sgd table usually are). */
typedef struct regions_arg {
  ps__table *t;
  uv_buf_t *v;
  unsigned n, cap;
  uv_buf_t small[16];
} regions_arg;

static int region_slice(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos) {
  regions_arg *a = arg;
  (void)pos;
  float *row = ps__shard_row(a->t, slice);
  if (!row) return PS_ERR_NOMEM;
  char *p = (char *)(row + within);
  if (a->n && a->v[a->n - 1].base + a->v[a->n - 1].len == p) {
    a->v[a->n - 1].len += n * 4;
    return 0;
  }
  if (a->n == a->cap) {
    unsigned cap = a->cap * 2;
    uv_buf_t *v = a->v == a->small ? ps__malloc(cap * sizeof *v) : ps__realloc(a->v, cap * sizeof *v);
    if (!v) return PS_ERR_NOMEM;
    if (a->v == a->small) memcpy(v, a->small, sizeof a->small);
    a->v = v;
    a->cap = cap;
  }
  a->v[a->n] = uv_buf_init(p, 0);
  a->v[a->n].len = n * 4;
  a->n++;
  return 0;
}

/* The reply's bytes final so far while the pending push it waits on is applied. */
static size_t produce_apply(void *arg) {
  ps__table *t = arg;
  ps__shard_pending_step(t, PS__PRODUCE_STEP);
  return t->pend.active ? (size_t)t->pend.done * 4 : SIZE_MAX;
}

/* Send a dense pull's reply from the parameter rows themselves, so that the reply holds
 * the rows as they are now, never a later push's update. 0 or NOMEM. */
static int send_rows(ps__conn *c, const ps__frame_hdr *h, const uint8_t *keys, size_t blen, ps__table *t,
                     ps__frame_hdr *r) {
  regions_arg a = {.t = t, .cap = sizeof a.small / sizeof a.small[0]};
  ps__pending_apply *p = &t->pend;
  a.v = a.small;
  if (h->xport == PS_XPORT_PEER_MEM && c->peer_pid) {
    ps__shard_flush(t); /* one copy of the finished rows, no overlap to gain */
    int rc = ps__walk_slices(keys, h->nkeys, t->spec.width, region_slice, &a);
    int done = !rc && ps__srv_write_rows_to_peer(c, h, keys, blen, a.v, a.n, r);
    if (rc || done) {
      if (a.v != a.small) free(a.v);
      return rc;
    }
    a.n = 0; /* answered inline below */
  }
  /* A pull of exactly the ranges of the push being applied: the reply's values are the
   * push's in the same order, so byte i of the payload is final once p->done * 4 > i.
   * The rest of the apply then runs while the socket drains. Any other pull waits. */
  int same = p->active && p->nkeys == h->nkeys && !memcmp(p->keys, keys, 8u * (size_t)h->nkeys);
  if (!same) ps__shard_flush(t);
  int rc = ps__walk_slices(keys, h->nkeys, t->spec.width, region_slice, &a);
  if (!rc) {
    int st = same && p->active ? ps__conn_send_produced(c, r, a.v, a.n, (size_t)p->done * 4, produce_apply, t)
                               : ps__conn_send_now(c, r, a.v, a.n);
    if (st == PS_ERR_NOMEM) rc = PS_ERR_NOMEM;
  }
  ps__shard_flush(t); /* a failed send may leave it unfinished */
  if (a.v != a.small) free(a.v);
  return rc;
}

/* ---------------------------------------------------------------- sparse replies */

typedef struct rows_prod {
  ps__table *t;
  const uint8_t *keys;
  uint32_t nkeys, done, chunk;
  float *out;
  int oom;
} rows_prod;

/* Copy the next chunk of rows into the reply; returns the bytes final so far. */
static size_t produce_rows(void *arg) {
  rows_prod *p = arg;
  uint32_t end = p->nkeys - p->done < p->chunk ? p->nkeys : p->done + p->chunk;
  p->oom |= ps__shard_read_rows(p->t, p->keys, p->done, end, p->out);
  p->done = end;
  return (size_t)p->done * p->t->spec.width * 4;
}

static void answer_sparse(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const uint8_t *keys, ps__table *t,
                          ps__frame_hdr *r) {
  unsigned width = t->spec.width;
  size_t len = (size_t)h->nkeys * width * 4;
  float *out = len ? ps__pool_get(s->pool, len) : NULL;
  if (len && !out) {
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory for a %zu-byte reply", len);
    return;
  }
  ps__par *par = ps__srv_par(s, h->nkeys);
  if (par) {
    if (ps__shard_read_huge(t, par, keys, h->nkeys, out)) goto oom;
  } else if (len >= STREAM_MIN) {
    /* A large reply goes out while its rows are still being looked up. */
    rows_prod p = {.t = t, .keys = keys, .nkeys = h->nkeys, .out = out,
                   .chunk = (uint32_t)(STREAM_CHUNK / ((size_t)width * 4) + 1)};
    size_t ready = produce_rows(&p);
    uv_buf_t b = uv_buf_init((char *)out, 0);
    b.len = len;
    int st = ps__conn_send_produced(c, r, &b, 1, ready, produce_rows, &p);
    ps__pool_put(s->pool, out, len); /* what the socket did not take was copied */
    t->pulls++;
    if (p.oom && st == 0) {
      /* Rows that could not be created went out as zeros under status 0: end the
       * connection rather than let the worker use them. */
      ps__log(PS_LOG_ERROR, "out of memory creating rows for a pull of table '%s'; closing the connection",
              t->decl.name);
      ps__conn_close(c, PS_ERR_NOMEM);
    }
    return;
  } else if (ps__shard_read_rows(t, keys, 0, h->nkeys, out)) {
    goto oom;
  }
  t->pulls++;
  ps__srv_reply_pooled(s, c, r, out, len);
  return;
oom:
  ps__pool_put(s->pool, out, len);
  ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
}

/* ---------------------------------------------------------------- encoded replies */

typedef struct gather_arg {
  ps__table *t;
  float *out;
} gather_arg;

static int gather_slice(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos) {
  gather_arg *a = arg;
  float *row = ps__shard_row(a->t, slice);
  if (!row) return PS_ERR_NOMEM;
  memcpy(a->out + pos, row + within, n * 4);
  return 0;
}

/* A pull of a table with a pull codec (spec pull_codec=, proto/codec.h): the values are
 * gathered as f32 (the engine's rows, as they are now), encoded into a pooled buffer and
 * sent from there. n: the values the pull asks for. */
static void answer_encoded(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const uint8_t *keys, ps__table *t,
                           uint64_t n, ps__frame_hdr *r) {
  const ps__codec *cx = &t->spec.pull_codec;
  size_t rawlen = (size_t)n * 4, enclen = ps__codec_size(cx, (size_t)n), len = 0;
  float *raw = ps__pool_get(s->pool, rawlen ? rawlen : 1);
  uint8_t *enc = ps__pool_get(s->pool, enclen ? enclen : 1);
  int rc = raw && enc ? 0 : PS_ERR_NOMEM;
  if (!rc && t->spec.kind == PS_DENSE) {
    gather_arg a = {t, raw};
    ps__shard_flush(t); /* a push being applied finishes first */
    rc = ps__walk_slices(keys, h->nkeys, t->spec.width, gather_slice, &a);
  } else if (!rc) {
    ps__par *par = ps__srv_par(s, h->nkeys);
    rc = par ? ps__shard_read_huge(t, par, keys, h->nkeys, raw) : ps__shard_read_rows(t, keys, 0, h->nkeys, raw);
  }
  if (!rc) rc = ps__codec_encode(cx, raw, (size_t)n, enc, &len, NULL);
  ps__pool_put(s->pool, raw, rawlen ? rawlen : 1);
  if (rc) {
    ps__pool_put(s->pool, enc, enclen ? enclen : 1);
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory for an encoded reply");
    return;
  }
  PS_ASSERT(len == enclen); /* pull codecs have a fixed size */
  t->pulls++;
  t->codec_pull_raw += rawlen;
  t->codec_pull_wire += len;
  r->codec = (uint8_t)cx->kind;
  if (!len) {
    ps__pool_put(s->pool, enc, 1);
    ps__conn_send_ctrl(c, r, NULL, 0);
    return;
  }
  ps__srv_reply_pooled(s, c, r, enc, len);
}

/* Values a (checked) pull asks for. */
static uint64_t pull_count(const ps__frame_hdr *h, const uint8_t *keys, const ps__table *t) {
  if (t->spec.kind != PS_DENSE) return (uint64_t)h->nkeys * t->spec.width;
  uint64_t n = 0;
  for (uint32_t i = 0; i + 1 < h->nkeys; i += 2) n += ps__get_u64(keys + 8 * (size_t)(i + 1));
  return n;
}

/* ---------------------------------------------------------------- answering */

ps__frame_hdr ps__srv_pull_reply_hdr(ps__server *s, ps__table *t, const ps__frame_hdr *h) {
  /* Its clock tells a worker that fell behind a sync:M job where to resume. */
  int64_t at = ps__shard_pull_answered(s->sh, t, h->sender, h->clock);
  ps__frame_hdr r = {.type = (uint8_t)(h->type | PS_FRAME_REPLY), .req_id = h->req_id, .table = h->table,
                     .clock = at, .epoch = s->epoch};
  return r;
}

static void answer_pull(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const void *body, size_t blen);

/* Answer a pull; the bytes it queued are counted for its table (stats.c). */
void ps__srv_answer_pull(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const void *body, size_t blen) {
  uint64_t out0 = c->bytes_out + c->write_queue_bytes;
  answer_pull(s, c, h, body, blen);
  if (s->count && s->table_out && h->table < PS__MAX_TABLES) s->table_out[h->table] += c->bytes_out + c->write_queue_bytes - out0;
}

static void answer_pull(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const void *body, size_t blen) {
  ps__table *t = ps__shard_table(s->sh, h->table);
  if (!t) {
    ps__srv_reply_err(c, h, PS_ERR_NO_TABLE, "unknown table %u", h->table);
    return;
  }
  ps__verdict v; /* past the memory budget, a pull does not create rows */
  if (ps__shard_room(s->sh, t, body, h->nkeys, &v) != PS__APPLIED) {
    ps__srv_reply_verdict(c, h, &v);
    return;
  }
  ps__frame_hdr r = ps__srv_pull_reply_hdr(s, t, h);
  if (t->spec.pull_codec.kind != PS_CODEC_RAW && h->xport == PS_XPORT_INLINE) {
    answer_encoded(s, c, h, body, t, pull_count(h, body, t), &r);
    return;
  }
  if (t->spec.kind == PS_DENSE) {
    if (send_rows(c, h, body, blen, t, &r)) {
      ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
      return;
    }
    t->pulls++;
    return;
  }
  answer_sparse(s, c, h, body, t, &r);
}

void ps__srv_answer_ready_pulls(ps__server *s) {
  /* Each server starts at another of the ready pulls (its rank, modulo their number),
   * then takes the rest in order. In a sync job every server answers its waiting pulls
   * at the same moment, and two servers writing into one worker's memory at once
   * (process_vm_writev) contend for its page-table locks; staggered, each writes into
   * another worker's first. */
  unsigned ready = 0;
  for (pending_pull *p = s->pulls; p; p = p->next) {
    ps__verdict v;
    ready += ps__shard_pull(s->sh, p->h.table, p->h.clock, &v) != PS__WAIT;
  }
  unsigned skip = ready ? s->rank % ready : 0;
  for (int pass = 0; pass < 2 && ready; pass++) {
    unsigned seen = 0;
    pending_pull **pp = &s->pulls;
    while (*pp) {
      pending_pull *p = *pp;
      ps__verdict v;
      if (ps__shard_pull(s->sh, p->h.table, p->h.clock, &v) == PS__WAIT || (pass == 0 && seen++ < skip)) {
        pp = &p->next; /* not ready, or its turn is in the second pass */
        continue;
      }
      *pp = p->next;
      ps__srv_answer_pull(s, p->conn, &p->h, p->buf, p->len);
      ps__pool_put(s->pool, p->buf, p->len);
      free(p);
    }
    if (!skip) break;
  }
}

void ps__srv_drop_pulls_of(ps__server *s, ps__conn *c) {
  pending_pull **pp = &s->pulls;
  while (*pp) {
    pending_pull *p = *pp;
    if (!c || p->conn == c) {
      *pp = p->next;
      ps__pool_put(s->pool, p->buf, p->len);
      free(p);
    } else {
      pp = &p->next;
    }
  }
}

void ps__srv_free_pulls(ps__server *s) { ps__srv_drop_pulls_of(s, NULL); }

void ps__srv_on_pull(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b, int dense) {
  ps__table *t = ps__srv_table_of(s, c, h, dense ? PS_DENSE : PS_SPARSE);
  if (!t) return;
  if (h->payload_len != 8u * h->nkeys && h->xport != PS_XPORT_PEER_MEM) {
    ps__srv_reply_err(c, h, PS_ERR_SIZE, "pull request carries %llu bytes of values",
                      (unsigned long long)(h->payload_len - 8u * h->nkeys));
    return;
  }
  if (dense) {
    int64_t n = ps__srv_check_segments(s, c, h, t, b->buf);
    if (n < 0) return;
    if (h->xport == PS_XPORT_PEER_MEM && ps__srv_check_peer_pull(c, h, b, n)) return;
  } else if (ps__srv_check_keys(s, c, h, t, b->buf)) {
    return;
  }
  ps__verdict v;
  if (ps__shard_pull(s->sh, h->table, h->clock, &v) != PS__WAIT) {
    ps__srv_answer_pull(s, c, h, b->buf, b->len);
    return;
  }
  /* Wait until the table reaches this clock; keep the body. */
  pending_pull *p = ps__malloc(sizeof *p);
  if (!p) {
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory");
    return;
  }
  p->conn = c;
  p->h = *h;
  memset(&p->fused, 0, sizeof p->fused);
  p->buf = b->buf;
  p->len = b->len;
  b->buf = NULL; /* taken */
  p->next = s->pulls;
  s->pulls = p;
}
