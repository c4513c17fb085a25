/*
 * msg.c - control-frame bodies.
 */
#include "proto/msg.h"

#include <string.h>

#include "common/common.h"
#include "common/ring.h"

void ps__hello_encode(ps__wbuf *w, const ps__hello *h) {
  ps__wbuf_u8(w, h->role);
  ps__wbuf_u32(w, h->port);
  ps__wbuf_u32(w, h->pid);
  ps__wbuf_str(w, h->host);
  ps__wbuf_str(w, h->unix_path);
  ps__wbuf_str(w, h->hostid);
  ps__wbuf_u8(w, h->caps);
  /* Optional tail: absent means join 0 and token 0; a token comes after the join byte. */
  if (h->join || h->token) ps__wbuf_u8(w, h->join ? 1 : 0);
  if (h->token) ps__wbuf_u64(w, h->token);
}

int ps__hello_decode(const void *p, size_t n, ps__hello *h) {
  ps__rbuf r;
  ps__rbuf_init(&r, p, n);
  memset(h, 0, sizeof *h);
  h->role = ps__rbuf_u8(&r);
  uint32_t port = ps__rbuf_u32(&r);
  h->pid = ps__rbuf_u32(&r);
  ps__rbuf_str(&r, h->host, sizeof h->host);
  ps__rbuf_str(&r, h->unix_path, sizeof h->unix_path);
  ps__rbuf_str(&r, h->hostid, sizeof h->hostid);
  h->caps = ps__rbuf_u8(&r);
  if (!r.err && (r.off + 1 == n || r.off + 9 == n)) {
    int with_token = r.off + 9 == n;
    h->join = ps__rbuf_u8(&r);
    if (h->join > 1 || (!with_token && h->join != 1)) r.err = 1;
    if (with_token) {
      h->token = ps__rbuf_u64(&r);
      if (!h->token) r.err = 1;
    }
  }
  if (r.err || r.off != n) return ps__fail(PS_ERR_PROTO, "malformed hello body");
  if (h->role < PS_ROLE_SERVER || h->role > PS_ROLE_WORKER) return ps__fail(PS_ERR_PROTO, "bad role %u in hello", h->role);
  if (port > 65535) return ps__fail(PS_ERR_PROTO, "bad port %u in hello", port);
  h->port = (uint16_t)port;
  return 0;
}

/* id u32, role u8, alive u8, rank u32, port u32, three str (u32 length each), caps u8,
 * late u32. */
#define MEMBER_MIN_BYTES (4u + 1u + 1u + 4u + 4u + 3u * 4u + 1u + 4u)

void ps__membership_encode(ps__wbuf *w, const ps__membership *m) {
  ps__wbuf_u64(w, m->epoch);
  ps__wbuf_u32(w, m->servers_expected);
  ps__wbuf_u32(w, m->workers_expected);
  ps__wbuf_u8(w, m->started);
  ps__wbuf_u32(w, m->n);
  for (uint32_t i = 0; i < m->n; i++) {
    const ps__member *x = &m->m[i];
    ps__wbuf_u32(w, x->id);
    ps__wbuf_u8(w, x->role);
    /* bit 0 alive, bit 1 late, bit 2 syncing (older readers take any non-zero as alive) */
    ps__wbuf_u8(w, (uint8_t)((x->alive ? 1 : 0) | (x->late ? 2 : 0) | (x->syncing ? 4 : 0)));
    ps__wbuf_u32(w, x->rank);
    ps__wbuf_u32(w, x->port);
    ps__wbuf_str(w, x->host);
    ps__wbuf_str(w, x->unix_path);
    ps__wbuf_str(w, x->hostid);
    ps__wbuf_u8(w, x->caps);
    ps__wbuf_u32(w, x->late); /* the admission number that orders replacements (ring.h) */
  }
  if (m->replicas > 1) ps__wbuf_u8(w, m->replicas); /* optional: absent means 1 */
}

void ps__membership_clear(ps__membership *m) {
  free(m->m);
  memset(m, 0, sizeof *m);
}

int ps__membership_decode(const void *p, size_t n, ps__membership *m) {
  ps__rbuf r;
  ps__rbuf_init(&r, p, n);
  memset(m, 0, sizeof *m);
  m->epoch = ps__rbuf_u64(&r);
  m->servers_expected = ps__rbuf_u32(&r);
  m->workers_expected = ps__rbuf_u32(&r);
  m->started = ps__rbuf_u8(&r);
  uint32_t cnt = ps__rbuf_u32(&r);
  /* A member takes at least MEMBER_MIN_BYTES (three empty strings): a count the rest of
   * the body cannot hold fails before the member array (up to 1 MiB) is allocated. */
  if (r.err || cnt > PS_MAX_MEMBERS || cnt > (r.len - r.off) / MEMBER_MIN_BYTES)
    return ps__fail(PS_ERR_PROTO, "malformed membership body");
  m->m = ps__calloc(cnt ? cnt : 1, sizeof *m->m);
  if (!m->m) return ps__fail(PS_ERR_NOMEM, "out of memory");
  m->n = cnt;
  for (uint32_t i = 0; i < cnt; i++) {
    ps__member *x = &m->m[i];
    x->id = ps__rbuf_u32(&r);
    x->role = ps__rbuf_u8(&r);
    uint8_t st = ps__rbuf_u8(&r);
    x->alive = st & 1;
    x->late = (st >> 1) & 1;
    x->syncing = (st >> 2) & 1;
    if (st > 7) r.err = 1;
    x->rank = ps__rbuf_u32(&r);
    uint32_t port = ps__rbuf_u32(&r);
    x->port = (uint16_t)port;
    ps__rbuf_str(&r, x->host, sizeof x->host);
    ps__rbuf_str(&r, x->unix_path, sizeof x->unix_path);
    ps__rbuf_str(&r, x->hostid, sizeof x->hostid);
    x->caps = ps__rbuf_u8(&r);
    uint32_t late = ps__rbuf_u32(&r);
    if (port > 65535 || (late != 0) != (x->late != 0)) r.err = 1; /* the bit and the number agree */
    x->late = late;
  }
  m->replicas = 1;
  if (!r.err && r.off + 1 == n) {
    m->replicas = ps__rbuf_u8(&r);
    if (m->replicas < 2 || m->replicas > 3) r.err = 1;
  }
  if (r.err || r.off != n) {
    ps__membership_clear(m);
    return ps__fail(PS_ERR_PROTO, "malformed membership body");
  }
  return 0;
}

uint8_t ps__member_chain_state(const ps__member *x) {
  if (!x->alive) return PS_CHAIN_DEAD;
  return x->syncing ? PS_CHAIN_SYNCING : x->late ? PS_CHAIN_LATE : PS_CHAIN_LIVE;
}

void ps__declare_encode(ps__wbuf *w, const ps__declare *d) {
  ps__wbuf_u32(w, d->id);
  ps__wbuf_u8(w, d->kind);
  ps__wbuf_u64(w, d->size);
  ps__wbuf_str(w, d->name);
  ps__wbuf_str(w, d->options);
}

int ps__declare_decode(const void *p, size_t n, ps__declare *d) {
  ps__rbuf r;
  ps__rbuf_init(&r, p, n);
  memset(d, 0, sizeof *d);
  d->id = ps__rbuf_u32(&r);
  d->kind = ps__rbuf_u8(&r);
  d->size = ps__rbuf_u64(&r);
  ps__rbuf_str(&r, d->name, sizeof d->name);
  ps__rbuf_str(&r, d->options, sizeof d->options);
  if (r.err || r.off != n) return ps__fail(PS_ERR_PROTO, "malformed table declaration");
  if (!d->name[0]) return ps__fail(PS_ERR_INVALID, "empty table name");
  return 0;
}

/* ---------------------------------------------------------------- checkpoints */

void ps__ckpt_req_encode(ps__wbuf *w, const ps__ckpt_req *q) {
  ps__wbuf_u64(w, q->id);
  ps__wbuf_u64(w, (uint64_t)q->clock);
  ps__wbuf_u32(w, q->nservers);
  ps__wbuf_str(w, q->dir);
  ps__wbuf_u64(w, q->base);
  ps__wbuf_u32(w, q->track);
  ps__wbuf_u32(w, q->part);
}

int ps__ckpt_req_decode(const void *p, size_t n, ps__ckpt_req *q) {
  ps__rbuf r;
  ps__rbuf_init(&r, p, n);
  memset(q, 0, sizeof *q);
  q->id = ps__rbuf_u64(&r);
  q->clock = (int64_t)ps__rbuf_u64(&r);
  q->nservers = ps__rbuf_u32(&r);
  ps__rbuf_str(&r, q->dir, sizeof q->dir);
  q->base = ps__rbuf_u64(&r);
  q->track = ps__rbuf_u32(&r);
  q->part = ps__rbuf_u32(&r);
  if (r.err || r.off != n || q->track > 1 || q->part >= q->nservers) return ps__fail(PS_ERR_PROTO, "malformed checkpoint request");
  if (!q->dir[0]) return ps__fail(PS_ERR_INVALID, "checkpoint request without a directory");
  return 0;
}

void ps__ckpt_done_encode(ps__wbuf *w, const ps__ckpt_done *d) {
  ps__wbuf_u32(w, d->rank);
  ps__wbuf_str(w, d->name);
  ps__wbuf_u64(w, d->bytes);
  ps__wbuf_u64(w, d->checksum);
  ps__wbuf_u64(w, d->rows);
  ps__wbuf_u64(w, d->base);
}

int ps__ckpt_done_decode(const void *p, size_t n, ps__ckpt_done *d) {
  ps__rbuf r;
  ps__rbuf_init(&r, p, n);
  memset(d, 0, sizeof *d);
  d->rank = ps__rbuf_u32(&r);
  ps__rbuf_str(&r, d->name, sizeof d->name);
  d->bytes = ps__rbuf_u64(&r);
  d->checksum = ps__rbuf_u64(&r);
  d->rows = ps__rbuf_u64(&r);
  d->base = ps__rbuf_u64(&r);
  if (r.err || r.off != n) return ps__fail(PS_ERR_PROTO, "malformed checkpoint answer");
  return 0;
}

void ps__stall_encode(ps__wbuf *w, const ps__stall *v, size_t n) {
  ps__wbuf_u32(w, (uint32_t)n);
  for (size_t i = 0; i < n; i++) {
    ps__wbuf_u32(w, v[i].worker);
    ps__wbuf_u32(w, v[i].table);
    ps__wbuf_u64(w, (uint64_t)v[i].round);
    ps__wbuf_u64(w, v[i].held_ms);
    ps__wbuf_u32(w, v[i].clocked ? 1u : 0u);
    ps__wbuf_u32(w, 0);
  }
}

int ps__stall_decode(const void *p, size_t len, ps__stall *out, size_t *n) {
  ps__rbuf r;
  ps__rbuf_init(&r, p, len);
  *n = 0;
  uint32_t count = ps__rbuf_u32(&r);
  if (r.err || count > PS_STALL_MAX || len - r.off != (size_t)count * 32u)
    return ps__fail(PS_ERR_PROTO, "malformed stall report");
  for (uint32_t i = 0; i < count; i++) {
    out[i].worker = ps__rbuf_u32(&r);
    out[i].table = ps__rbuf_u32(&r);
    out[i].round = (int64_t)ps__rbuf_u64(&r);
    out[i].held_ms = ps__rbuf_u64(&r);
    uint32_t clocked = ps__rbuf_u32(&r), zero = ps__rbuf_u32(&r);
    if (clocked > 1 || zero) {
      *n = 0;
      return ps__fail(PS_ERR_PROTO, "malformed stall report");
    }
    out[i].clocked = clocked;
  }
  *n = count;
  return 0;
}

void ps__ckpt_info_encode(ps__wbuf *w, const ps__ckpt_info *i) {
  ps__wbuf_u64(w, i->id);
  ps__wbuf_str(w, i->dir);
}

int ps__ckpt_info_decode(const void *p, size_t n, ps__ckpt_info *i) {
  ps__rbuf r;
  ps__rbuf_init(&r, p, n);
  memset(i, 0, sizeof *i);
  i->id = ps__rbuf_u64(&r);
  ps__rbuf_str(&r, i->dir, sizeof i->dir);
  if (r.err || r.off != n) return ps__fail(PS_ERR_PROTO, "malformed checkpoint answer");
  return 0;
}
