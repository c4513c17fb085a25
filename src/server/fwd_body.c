/*
 * fwd_body.c - the bodies of frames down a chain that name their values in this
 * server's memory (repl.c, repl_sync.c): where they live, and how long they stay.
 *
 * A sync round's update, and a worker's dense push read by peer memory, go to a
 * member on this host by peer memory (design.md, "Forwards by peer memory"). Their
 * frames' bodies come from a few buffers of ps_alloc (a sealed memfd mapped shared;
 * at most 8, or PSHARD_FORWARD_BUFFERS), kept for reuse, so that the member maps each
 * file once and applies the values in place; when none is free, or the frame is
 * large, from the pool (a round's: the member then reads it with process_vm_readv; a
 * push's is sent with its values). A push's body is held by the engine too, while it
 * applies it after the answer, so a shared buffer counts its holders. A body the
 * member may still read, though its frame was given up on (the member written off,
 * its connection lost), is held until the frame's expiry and PS_VX_SLACK_MS have
 * passed.
 *
 * Everything here runs on the server's loop thread.
 */
#include "common/common.h"
#include "server/server_int.h"

/* A body a server may still read by peer memory (it did not answer: written off, or
 * its connection lost), kept until the frame's expiry and PS_VX_SLACK_MS after it. */
struct srv_held {
  srv_held *next;
  void *buf;
  size_t len;
  uint64_t until; /* ps__now_ms */
};

/* Shared forward bodies: only for frames up to this size (larger ones, rare, go in
 * pooled memory and are read with process_vm_readv), in sizes of powers of two, and
 * let go of after a minute unused. */
#define SHBUF_MAX_BYTES ((size_t)32 << 20)
#define SHBUF_MIN_BYTES ((size_t)64 << 10)
#define SHBUF_IDLE_MS 60000
#define NSHBUF (sizeof ((ps__server *)0)->shbufs / sizeof ((ps__server *)0)->shbufs[0])

void ps__srv_fwd_buf_init(ps__server *s) {
  const char *v = getenv("PSHARD_FORWARD_BUFFERS");
  char *end = NULL;
  long n = v && *v ? strtol(v, &end, 10) : (long)NSHBUF;
  if (v && *v && (*end || n < 0 || n > (long)NSHBUF)) {
    ps__log(PS_LOG_WARN, "PSHARD_FORWARD_BUFFERS=%s is not a number from 0 to %zu: %zu used", v, NSHBUF, NSHBUF);
    n = (long)NSHBUF;
  }
  s->nshbufs = (size_t)n;
}

void *ps__srv_fwd_buf_shared(ps__server *s, size_t len) {
  size_t best = NSHBUF, slot = NSHBUF;
  for (size_t i = 0; len <= SHBUF_MAX_BYTES && i < s->nshbufs; i++) {
    if (s->shbufs[i].refs) continue;
    if (s->shbufs[i].p && s->shbufs[i].cap >= len) {
      if (best == NSHBUF || s->shbufs[i].cap < s->shbufs[best].cap) best = i;
    } else if (slot == NSHBUF || !s->shbufs[i].p) {
      slot = i; /* empty, or free and too small: taken over */
    }
  }
  if (best == NSHBUF && slot < NSHBUF) {
    size_t cap = SHBUF_MIN_BYTES;
    while (cap < len) cap *= 2;
    ps_free(s->shbufs[slot].p);
    s->shbufs[slot].p = ps_alloc(cap);
    s->shbufs[slot].cap = cap;
    if (s->shbufs[slot].p) best = slot;
  }
  if (best == NSHBUF) return NULL;
  s->shbufs[best].refs = 1;
  return s->shbufs[best].p;
}

void *ps__srv_fwd_buf(ps__server *s, size_t len, int shared) {
  void *b = shared ? ps__srv_fwd_buf_shared(s, len) : NULL;
  return b ? b : ps__pool_get(s->pool, len);
}

int ps__srv_fwd_buf_ref(ps__server *s, const void *buf) {
  for (size_t i = 0; buf && i < NSHBUF; i++)
    if (s->shbufs[i].p == buf && s->shbufs[i].refs) {
      s->shbufs[i].refs++;
      return 1;
    }
  return 0;
}

void ps__srv_fwd_buf_put(ps__server *s, void *buf, size_t len) {
  for (size_t i = 0; buf && i < NSHBUF; i++)
    if (s->shbufs[i].p == buf) {
      if (s->shbufs[i].refs > 0 && --s->shbufs[i].refs == 0) s->shbufs[i].used_ms = uv_now(&s->loop);
      return;
    }
  ps__pool_put(s->pool, buf, len);
}

void ps__srv_fwd_buf_counts(const ps__server *s, size_t *allocated, size_t *busy) {
  *allocated = *busy = 0;
  for (size_t i = 0; i < NSHBUF; i++) {
    *allocated += s->shbufs[i].p != NULL;
    *busy += s->shbufs[i].p && s->shbufs[i].refs;
  }
}

/* Let go of the shared bodies unused for a minute (all: the server stops). */
static void shbuf_sweep(ps__server *s, int all) {
  uint64_t now = uv_now(&s->loop);
  for (size_t i = 0; i < NSHBUF; i++)
    if (s->shbufs[i].p && (all || (!s->shbufs[i].refs && now - s->shbufs[i].used_ms >= SHBUF_IDLE_MS))) {
      ps_free(s->shbufs[i].p);
      s->shbufs[i].p = NULL;
      s->shbufs[i].refs = 0;
    }
}

void ps__srv_fwd_buf_hold(ps__server *s, void *buf, size_t len, uint64_t until) {
  srv_held *h = ps__now_ms() < until ? ps__malloc(sizeof *h) : NULL;
  if (!h) { /* (out of memory: the expiry is checked before every read, so at worst late) */
    ps__srv_fwd_buf_put(s, buf, len);
    return;
  }
  *h = (srv_held){s->pm_held, buf, len, until};
  s->pm_held = h;
}

/* Give back the kept bodies whose expiry passed (all: the server stops). */
static void held_sweep(ps__server *s, int all) {
  uint64_t now = all ? UINT64_MAX : ps__now_ms();
  for (srv_held **pp = &s->pm_held; *pp;) {
    srv_held *h = *pp;
    if (h->until > now) {
      pp = &h->next;
      continue;
    }
    *pp = h->next;
    ps__srv_fwd_buf_put(s, h->buf, h->len);
    free(h);
  }
}

void ps__srv_fwd_body_sweep(ps__server *s, int all) {
  held_sweep(s, all);
  shbuf_sweep(s, all);
}
