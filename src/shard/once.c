/*
 * once.c - the windows of applied push sequence numbers (once.h), their set in the
 * engine and their encoding.
 *
 * Sequences compare in serial-number order (RFC 1982), so a worker's 32-bit counter
 * may wrap: s is newer than high when (int32_t)(s - high) > 0. The bitmap is a ring
 * indexed by s % PS__ONCE_WINDOW; moving high forward clears the bits of the
 * sequences it skips, so a set bit always means "applied" for a sequence inside the
 * window. The encoding is relative to high instead (bit i = sequence high - i), which
 * does not depend on the ring's layout or size.
 */
#include "shard/once.h"

#include <string.h>

#include "common/common.h"

#define W PS__ONCE_WINDOW

static inline int bit_get(const ps__once *w, uint32_t s) { return (int)((w->bits[(s % W) / 64] >> (s % 64)) & 1u); }
static inline void bit_set(ps__once *w, uint32_t s) { w->bits[(s % W) / 64] |= 1ull << (s % 64); }
static inline void bit_clear(ps__once *w, uint32_t s) { w->bits[(s % W) / 64] &= ~(1ull << (s % 64)); }

int ps__once_check(const ps__once *w, uint64_t inc, uint32_t seq) {
  if (!w->any || inc > w->inc) return PS__ONCE_NEW;
  if (inc < w->inc) return PS__ONCE_STALE;
  int32_t d = (int32_t)(seq - w->high);
  if (d > 0) return PS__ONCE_NEW;
  if (d <= -(int32_t)W) return PS__ONCE_TOO_OLD;
  return bit_get(w, seq) ? PS__ONCE_DUP : PS__ONCE_NEW;
}

void ps__once_mark(ps__once *w, uint64_t inc, uint32_t seq) {
  if (!w->any || inc != w->inc) {
    memset(w->bits, 0, sizeof w->bits);
    w->any = 1;
    w->inc = inc;
    w->high = seq;
    bit_set(w, seq);
    return;
  }
  int32_t d = (int32_t)(seq - w->high);
  if (d > 0) {
    if ((uint32_t)d >= W) {
      memset(w->bits, 0, sizeof w->bits);
    } else {
      for (uint32_t s = w->high + 1; s != seq; s++) bit_clear(w, s); /* the skipped ones */
    }
    w->high = seq;
  }
  bit_set(w, seq);
}

/* ---------------------------------------------------------------- the set */

static size_t slot_of(uint32_t worker, uint64_t unit, size_t cap) {
  return (size_t)ps__mix64(worker ^ ps__mix64(unit)) & (cap - 1);
}

ps__once *ps__once_find(const ps__once_set *s, uint32_t worker, uint64_t unit) {
  if (!s->cap) return NULL;
  for (size_t i = slot_of(worker, unit, s->cap);; i = (i + 1) & (s->cap - 1)) {
    ps__once *w = s->slot[i];
    if (!w || (w->worker == worker && w->unit == unit)) return w;
  }
}

/* Put w (not in s) into the table of cap slots. */
static void slot_put(ps__once **slot, size_t cap, ps__once *w) {
  size_t i = slot_of(w->worker, w->unit, cap);
  while (slot[i]) i = (i + 1) & (cap - 1);
  slot[i] = w;
}

ps__once *ps__once_get(ps__once_set *s, uint32_t worker, uint64_t unit) {
  ps__once *w = ps__once_find(s, worker, unit);
  if (w) return w;
  if (2 * (s->n + 1) > s->cap) { /* at most half full */
    size_t cap = s->cap ? 2 * s->cap : 16;
    ps__once **slot = ps__calloc(cap, sizeof *slot);
    if (!slot) return NULL;
    for (size_t i = 0; i < s->cap; i++)
      if (s->slot[i]) slot_put(slot, cap, s->slot[i]);
    free(s->slot);
    s->slot = slot;
    s->cap = cap;
  }
  if (!(w = ps__calloc(1, sizeof *w))) return NULL;
  w->worker = worker;
  w->unit = unit;
  slot_put(s->slot, s->cap, w);
  s->n++;
  return w;
}

void ps__once_set_clear(ps__once_set *s) {
  for (size_t i = 0; i < s->cap; i++) free(s->slot[i]);
  free(s->slot);
  s->slot = NULL;
  s->cap = s->n = 0;
}

/* ---------------------------------------------------------------- encoding */

void ps__once_encode(const ps__once *w, ps__wbuf *out) {
  uint8_t bytes[W / 8];
  memset(bytes, 0, sizeof bytes);
  if (w->any)
    for (uint32_t i = 0; i < W; i++)
      if (bit_get(w, w->high - i)) bytes[i / 8] |= (uint8_t)(1u << (i % 8));
  ps__wbuf_u32(out, w->worker);
  ps__wbuf_u64(out, w->unit);
  ps__wbuf_u8(out, (uint8_t)(w->any != 0));
  ps__wbuf_u64(out, w->any ? w->inc : 0);
  ps__wbuf_u32(out, w->any ? w->high : 0);
  ps__wbuf_u32(out, W);
  ps__wbuf_bytes(out, bytes, sizeof bytes);
}

int ps__once_decode(ps__rbuf *in, ps__once *w) {
  uint32_t worker = ps__rbuf_u32(in);
  uint64_t unit = ps__rbuf_u64(in);
  uint8_t any = ps__rbuf_u8(in);
  uint64_t inc = ps__rbuf_u64(in);
  uint32_t high = ps__rbuf_u32(in), nbits = ps__rbuf_u32(in);
  if (in->err) return ps__fail(PS_ERR_CORRUPT, "push window: truncated");
  if (any > 1) return ps__fail(PS_ERR_CORRUPT, "push window of worker %u: bad flag %u", worker, any);
  if (nbits % 64 || nbits > PS__ONCE_MAX_BITS)
    return ps__fail(PS_ERR_CORRUPT, "push window of worker %u: bad width %u", worker, nbits);
  if (nbits < W)
    return ps__fail(PS_ERR_CORRUPT, "push window of worker %u is %u sequences wide; this server needs %u", worker,
                    nbits, W);
  if (in->len - in->off < nbits / 8) return ps__fail(PS_ERR_CORRUPT, "push window of worker %u: truncated", worker);
  const uint8_t *bytes = in->p + in->off;
  in->off += nbits / 8;
  memset(w, 0, sizeof *w);
  w->worker = worker;
  w->unit = unit;
  if (!any) {
    if (inc || high) return ps__fail(PS_ERR_CORRUPT, "push window of worker %u: empty, with a position", worker);
    for (uint32_t i = 0; i < nbits / 8; i++)
      if (bytes[i]) return ps__fail(PS_ERR_CORRUPT, "push window of worker %u: empty, with bits set", worker);
    return 0;
  }
  if (!(bytes[0] & 1u))
    return ps__fail(PS_ERR_CORRUPT, "push window of worker %u: its highest sequence is not marked", worker);
  w->any = 1;
  w->inc = inc;
  w->high = high;
  for (uint32_t i = 0; i < W; i++) /* bits past W are older than this window: dropped */
    if (bytes[i / 8] & (1u << (i % 8))) bit_set(w, high - i);
  return 0;
}

#define FORMAT 2 /* 1: windows without their unit */

void ps__once_set_encode(const ps__once_set *s, ps__wbuf *out) {
  ps__wbuf_u8(out, FORMAT);
  ps__wbuf_u32(out, (uint32_t)s->n);
  for (size_t i = 0; i < s->cap; i++)
    if (s->slot[i]) ps__once_encode(s->slot[i], out);
}

static int has_unit(const uint64_t *units, size_t n, uint64_t unit) {
  if (!units) return 1;
  for (size_t i = 0; i < n; i++)
    if (units[i] == unit) return 1;
  return 0;
}

/* Unmark (inc, seq) in a copy of a window; its highest moves down to the highest still
 * marked. */
static void unmark(ps__once *w, uint64_t inc, uint32_t seq) {
  if (!w->any || inc != w->inc) return;
  int32_t d = (int32_t)(seq - w->high);
  if (d > 0 || d <= -(int32_t)W) return;
  bit_clear(w, seq);
  if (seq != w->high) return;
  for (uint32_t k = 1; k < W; k++)
    if (bit_get(w, w->high - k)) {
      w->high -= k;
      return;
    }
  memset(w->bits, 0, sizeof w->bits);
  w->any = 0, w->inc = 0, w->high = 0;
}

int ps__once_set_encode_except(const ps__once_set *s, const uint64_t *units, size_t nunits, const ps__push_id *ex,
                               size_t n, ps__wbuf *out) {
  if (!n && !units) {
    ps__once_set_encode(s, out);
    return 0;
  }
  ps__once *tmp = ps__malloc(sizeof *tmp);
  if (!tmp) return ps__fail(PS_ERR_NOMEM, "out of memory encoding push windows");
  uint32_t count = 0;
  for (size_t i = 0; i < s->cap; i++) count += s->slot[i] && has_unit(units, nunits, s->slot[i]->unit);
  ps__wbuf_u8(out, FORMAT);
  ps__wbuf_u32(out, count);
  for (size_t i = 0; i < s->cap; i++) {
    const ps__once *w = s->slot[i];
    if (!w || !has_unit(units, nunits, w->unit)) continue;
    int touched = 0;
    for (size_t j = 0; j < n && !touched; j++) touched = ex[j].worker == w->worker && ex[j].unit == w->unit;
    if (!touched) {
      ps__once_encode(w, out);
      continue;
    }
    *tmp = *w;
    for (size_t j = 0; j < n; j++)
      if (ex[j].worker == w->worker && ex[j].unit == w->unit) unmark(tmp, ex[j].inc, ex[j].seq);
    ps__once_encode(tmp, out);
  }
  free(tmp);
  return 0;
}

int ps__once_set_decode(ps__once_set *s, const void *p, size_t len) {
  ps__rbuf in;
  ps__rbuf_init(&in, p, len);
  uint8_t format = ps__rbuf_u8(&in);
  uint32_t n = ps__rbuf_u32(&in);
  if (in.err) return ps__fail(PS_ERR_CORRUPT, "push windows: truncated");
  if (format != FORMAT) return ps__fail(PS_ERR_CORRUPT, "push windows: unknown format %u", format);
  if (n > PS__ONCE_MAX_WORKERS) return ps__fail(PS_ERR_CORRUPT, "push windows: %u windows (at most %u)", n, PS__ONCE_MAX_WORKERS);
  ps__once_set fresh = {0};
  ps__once tmp;
  int rc = 0;
  for (uint32_t i = 0; i < n && !rc; i++) {
    if ((rc = ps__once_decode(&in, &tmp))) break;
    if (tmp.worker == 0) {
      rc = ps__fail(PS_ERR_CORRUPT, "push windows: worker id 0");
    } else if (ps__once_find(&fresh, tmp.worker, tmp.unit)) {
      rc = ps__fail(PS_ERR_CORRUPT, "push windows: worker %u twice in unit %llx", tmp.worker,
                    (unsigned long long)tmp.unit);
    } else {
      ps__once *w = ps__once_get(&fresh, tmp.worker, tmp.unit);
      if (!w) rc = ps__fail(PS_ERR_NOMEM, "out of memory for push windows");
      else *w = tmp;
    }
  }
  if (!rc && in.off != in.len)
    rc = ps__fail(PS_ERR_CORRUPT, "push windows: %zu bytes after the last window", in.len - in.off);
  if (rc) {
    ps__once_set_clear(&fresh);
    return rc;
  }
  uint64_t dups = s->dups, stale = s->stale;
  ps__once_set_clear(s);
  *s = fresh;
  s->dups = dups, s->stale = stale;
  return 0;
}

int ps__once_set_merge(ps__once_set *s, const void *p, size_t len) {
  ps__once_set in;
  memset(&in, 0, sizeof in);
  int rc = ps__once_set_decode(&in, p, len);
  if (rc) return rc;
  for (size_t i = 0; i < in.cap && !rc; i++) {
    const ps__once *w = in.slot[i];
    if (!w || !w->any) continue;
    ps__once *d = ps__once_get(s, w->worker, w->unit);
    if (!d) {
      rc = ps__fail(PS_ERR_NOMEM, "out of memory merging exactly-once windows");
      break;
    }
    /* Oldest first, so the window's high moves up over sequences it marks. */
    for (uint32_t k = W; k-- > 0;) {
      uint32_t seq = w->high - k;
      if (bit_get(w, seq) && ps__once_check(d, w->inc, seq) == PS__ONCE_NEW) ps__once_mark(d, w->inc, seq);
    }
  }
  ps__once_set_clear(&in);
  return rc;
}
