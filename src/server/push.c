/*
 * push.c - pushes, and the checks every data request passes against the ring.
 *
 * A push frame is validated here (its table and kind, its keys or segments against
 * its values, ownership under the current ring: else PS_ERR_MOVED), handed to the
 * shard engine as a ps__push with its identity (worker, incarnation, sequence: a push
 * the engine applied before is answered as applied), and answered with the engine's
 * verdict. A dense push the engine applies after its acknowledgement keeps the
 * frame's body; the loop's idle handler (server.c) steps it along.
 */
#include <math.h>
#include <string.h>

#include "common/common.h"
#include "proto/codec.h"
#include "server/server_int.h"

ps__table *ps__srv_table_of(ps__server *s, ps__conn *c, const ps__frame_hdr *h, int kind) {
  ps__table *t = ps__shard_table(s->sh, h->table);
  if (!t) {
    ps__srv_reply_err(c, h, PS_ERR_NO_TABLE, "unknown table %u", h->table);
    return NULL;
  }
  if (t->spec.kind != kind) {
    ps__srv_reply_err(c, h, PS_ERR_INVALID, "table '%s' is %s; use the %s calls", t->decl.name,
                      t->spec.kind == PS_DENSE ? "dense" : "sparse", t->spec.kind == PS_DENSE ? "range" : "key");
    return NULL;
  }
  return t;
}

int ps__srv_dense_mine(ps__server *s, ps__table *t, uint64_t *lo, uint64_t *hi) {
  uint64_t nsl = (t->spec.size + t->spec.width - 1) / t->spec.width;
  size_t S = s->ring ? ps__ring_size(s->ring) : 0;
  if (S <= 1) {
    *lo = 0, *hi = nsl;
    return 0;
  }
  if (t->mine_gen != s->ring_gen) {
    uint32_t *order = ps__malloc(S * sizeof *order);
    if (!order || !ps__ring_dense_order(s->ring, t->id, order)) {
      free(order);
      return -1;
    }
    t->mine_lo = t->mine_hi = 0;
    for (size_t j = 0; j < S; j++) {
      if (ps__ring_server_at(s->ring, order[j]) == s->id) {
        t->mine_lo = ps__dense_run_start(j, nsl, S);
        t->mine_hi = ps__dense_run_start(j + 1, nsl, S);
        break;
      }
    }
    free(order);
    t->mine_gen = s->ring_gen;
  }
  *lo = t->mine_lo, *hi = t->mine_hi;
  return 0;
}

int64_t ps__srv_check_segments(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const uint8_t *keys) {
  uint64_t total = 0, lo = 0, hi = UINT64_MAX;
  int repl = s->replicas > 1 && s->ring && ps__ring_size(s->ring) > 1;
  s->next_hop = 0;
  s->push_unit = 0;
  if (!repl && h->nkeys && ps__srv_dense_mine(s, t, &lo, &hi)) {
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "out of memory");
    return -1;
  }
  for (uint32_t i = 0; i < h->nkeys; i += 2) {
    uint64_t off = ps__get_u64(keys + 8 * i), cnt = ps__get_u64(keys + 8 * (i + 1));
    if (cnt == 0 || off >= t->spec.size || cnt > t->spec.size - off) {
      ps__srv_reply_err(c, h, PS_ERR_RANGE, "range [%llu, +%llu) outside table '%s' of %llu floats",
                        (unsigned long long)off, (unsigned long long)cnt, t->decl.name,
                        (unsigned long long)t->spec.size);
      return -1;
    }
    uint64_t a = off / t->spec.width, b = (off + cnt - 1) / t->spec.width;
    if (a < lo || b >= hi) {
      ps__srv_reply_err(c, h, PS_ERR_MOVED, "slice %llu of table '%s' is not on this server (epoch %llu)",
                        (unsigned long long)(a < lo ? a : hi), t->decl.name, (unsigned long long)s->epoch);
      return -1;
    }
    total += cnt;
  }
  if (repl && ps__srv_route_segments(s, c, h, t, keys, &s->next_hop)) return -1;
  return (int64_t)total;
}

int ps__srv_check_keys(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const uint8_t *keys) {
  /* A server alone in its ring owns every key, so the keys are not read then. */
  s->next_hop = 0;
  s->push_unit = 0;
  if (!s->ring || ps__ring_size(s->ring) <= 1) return 0;
  if (s->replicas > 1) return ps__srv_route_keys(s, c, h, t, keys, &s->next_hop);
  for (uint32_t i = 0; i < h->nkeys; i++) {
    uint64_t key = ps__get_u64(keys + 8 * (size_t)i);
    if (ps__ring_owner(s->ring, h->table, key) != s->id) {
      ps__srv_reply_err(c, h, PS_ERR_MOVED, "key %llu of table '%s' is not on this server (epoch %llu)",
                        (unsigned long long)key, t->decl.name, (unsigned long long)s->epoch);
      return -1;
    }
  }
  return 0;
}

ps__push ps__srv_push_of(const ps__frame_hdr *h, const void *body, uint64_t nvals) {
  ps__push p = {.table = h->table, .sender = h->sender, .batch = h->batch, .clock = h->clock,
                .lr = h->lr >= 0 || isnan(h->lr) ? h->lr : -1.0f, /* NaN: refused */ .keys = body, .nkeys = h->nkeys,
                .vals = (const float *)((const uint8_t *)body + 8u * h->nkeys), .nvals = nvals,
                .inc = h->inc, .seq = h->seq};
  return p;
}

int ps__srv_push_shape(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const ps__push *p, int dense) {
  if (dense) {
    int64_t total = ps__srv_check_segments(s, c, h, t, p->keys);
    if (total < 0) return -1;
    if ((uint64_t)total != p->nvals) {
      ps__srv_reply_err(c, h, PS_ERR_SIZE, "push of %llu floats for segments covering %lld",
                        (unsigned long long)p->nvals, (long long)total);
      return -1;
    }
    return 0;
  }
  if (p->nvals != (uint64_t)h->nkeys * t->spec.width) {
    ps__srv_reply_err(c, h, PS_ERR_DIM, "push of %llu floats for %u keys of table '%s' with dim %u",
                      (unsigned long long)p->nvals, h->nkeys, t->decl.name, t->spec.width);
    return -1;
  }
  return ps__srv_check_keys(s, c, h, t, p->keys);
}

void ps__srv_push(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const ps__push *in, ps__owned *body,
                  int dense) {
  ps__table *t = ps__srv_table_of(s, c, h, dense ? PS_DENSE : PS_SPARSE);
  if (!t || ps__srv_push_shape(s, c, h, t, in, dense)) return;
  /* its window: the chain it came down (the ring checks above) */
  ps__push q = *in;
  q.unit = s->push_unit;
  const ps__push *p = &q;
  ps__verdict v;
  uint32_t next = s->next_hop;
  int sync_repl = s->replicas > 1 && ps__table_is_sync(t);
  if (sync_repl && ps__srv_sync_push(s, c, h, t, p)) return; /* a failover's catch-up took it */
  int agg = s->replicas > 1 && !p->replica && ps__table_aggregates(t);
  if (agg) ps__srv_agg_before(s, c, h, t, p);
  int st = ps__shard_push(s->sh, p, body, &v);
  if (agg && ps__srv_agg_after(s, c, h, t, &v)) {
    /* Replicated after aggregation (repl_agg.c): answered once its buffer was applied
     * here and reached the tail (this server, when its chain has no other live copy). */
  } else if (st != PS__APPLIED) {
    if (sync_repl && st != PS__DROPPED) ps__srv_sync_refused(s, t, p, &v);
    ps__srv_reply_verdict(c, h, &v);
    return;
  } else if (sync_repl) {
    /* Replicated after aggregation (repl_sync.c): the round goes down the chain once it
     * is applied; the answer says up to which clock every round is on every copy. */
    ps__frame_hdr r = {.type = (uint8_t)(h->type | PS_FRAME_REPLY), .req_id = h->req_id, .table = h->table,
                       .clock = ps__srv_sync_durable_clock(s, t), .flags = v.status == PS__DROPPED ? PS_FLAG_DROPPED : 0};
    ps__conn_send_ctrl(c, &r, NULL, 0);
    ps__srv_sync_pushed(s, t);
  } else if (next) {
    /* Replicated: the next member applies it too, and the answer comes back from the
     * tail. A push applied here before (sent again) is forwarded again: the tail may
     * not have it yet. The rate and step go with it (none for a duplicate or an empty
     * push: the member then takes its own). */
    int stepped = !v.dup && p->nkeys > 0;
    if (ps__srv_forward(s, c, h, p, next, stepped ? t->last_lr : p->lr, stepped ? t->step : 0))
      ps__srv_reply_err(c, h, PS_ERR_NOMEM, "%s", ps_errmsg());
  } else if (p->replica) {
    /* The tail: the worker hears from it at once (one hop fewer than through the chain),
     * and the members before it pass the answer up without answering again. */
    ps__srv_reply_ok(c, h, ps__srv_tail_answer(s, h, p->sender) ? PS_FLAG_TAIL : 0);
  } else {
    ps__srv_reply_ok(c, h, 0);
  }
  if (v.later) {
    /* acknowledged first: the worker's next request travels while this applies */
    ps__shard_pending_first(t);
    ps__srv_pending_check(s);
  }
}

/* The values an encoded push must decode to: keys x dim, or the segments' counts. 0 or
 * -1 (answered) when they cannot be counted or would not fit a frame as f32. */
static int encoded_count(ps__conn *c, const ps__frame_hdr *h, ps__table *t, const uint8_t *keys, int dense,
                         uint64_t *n) {
  uint64_t total = 0, limit = c->max_payload / 4u;
  if (!dense) {
    total = (uint64_t)h->nkeys * t->spec.width;
  } else {
    for (uint32_t i = 0; i + 1 < h->nkeys && total <= limit; i += 2) {
      uint64_t cnt = ps__get_u64(keys + 8 * (size_t)(i + 1));
      total += cnt > limit ? limit + 1 : cnt;
    }
  }
  if (total > limit || 8u * (uint64_t)h->nkeys + 4u * total > c->max_payload) {
    ps__srv_reply_err(c, h, PS_ERR_TOO_LARGE, "encoded push of table '%s' decodes past the frame limit of %llu bytes",
                      t->decl.name, (unsigned long long)c->max_payload);
    return -1;
  }
  *n = total;
  return 0;
}

/* A push whose values are encoded (hdr.codec): decoded into a pooled body of the raw
 * form, keys then f32 values, so that everything after this (the shape checks, the
 * engine, a replica's forward) sees one kind of push. Only the table's own push codec
 * is taken. NULL (answered, nothing changed) if it cannot be decoded. */
static void *decode_push(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const ps__body *b, int dense,
                         uint64_t *nvals, size_t *len) {
  ps__table *t = ps__srv_table_of(s, c, h, dense ? PS_DENSE : PS_SPARSE);
  if (!t) return NULL;
  if (h->codec != t->spec.push_codec.kind) {
    ps__srv_reply_err(c, h, PS_ERR_INVALID, "push encoded as %s to table '%s', whose push codec is %s",
                      ps__codec_name(h->codec), t->decl.name,
                      t->spec.push_codec.kind ? ps__codec_name(t->spec.push_codec.kind) : "none");
    return NULL;
  }
  size_t kb = 8u * (size_t)h->nkeys, vb = (size_t)h->payload_len - kb;
  uint64_t n;
  if (encoded_count(c, h, t, b->buf, dense, &n)) return NULL;
  *len = kb + 4u * (size_t)n;
  uint8_t *buf = ps__pool_get(s->pool, *len ? *len : 1);
  if (!buf) {
    ps__srv_reply_err(c, h, PS_ERR_NOMEM, "server out of memory decoding a push");
    return NULL;
  }
  memcpy(buf, b->buf, kb);
  if (ps__codec_decode(h->codec, (const uint8_t *)b->buf + kb, vb, (float *)(void *)(buf + kb), (size_t)n)) {
    ps__pool_put(s->pool, buf, *len ? *len : 1);
    ps__srv_reply_err(c, h, PS_ERR_PROTO, "push to table '%s': %s", t->decl.name, ps_errmsg());
    return NULL;
  }
  t->codec_push_raw += 4u * n;
  t->codec_push_wire += vb;
  *nvals = n;
  return buf;
}

void ps__srv_on_push(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b, int dense) {
  if (h->codec != PS_CODEC_RAW) {
    uint64_t n;
    size_t len;
    void *buf = decode_push(s, c, h, b, dense, &n, &len);
    if (!buf) return;
    ps__frame_hdr raw = *h;
    raw.codec = PS_CODEC_RAW;
    raw.payload_len = len;
    ps__push p = ps__srv_push_of(&raw, buf, n);
    ps__owned body = {buf, len ? len : 1};
    ps__srv_push(s, c, &raw, &p, &body, dense);
    if (body.buf) ps__pool_put(s->pool, buf, len ? len : 1);
    return;
  }
  uint64_t nvals = (h->payload_len - 8u * h->nkeys) / 4u;
  ps__push p = ps__srv_push_of(h, b->buf, nvals);
  ps__owned body = {b->buf, b->len};
  ps__srv_push(s, c, h, &p, &body, dense);
  if (!body.buf) b->buf = NULL; /* taken by the engine */
}
