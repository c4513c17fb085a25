/*
 * conn.c - framed connections over libuv streams (TCP and AF_UNIX alike).
 *
 * All functions run on the connection's loop thread. See net.h for the read path
 * (staging buffer for headers and small bodies, direct reads into destinations for
 * large ones) and the write path (one scatter/gather uv_write per frame).
 *
 * Fault injection (common/fault.h) hooks in where a header has been read and where a
 * frame is handed over to be sent; when no rule is armed that is one test of a global
 * flag, inline. What it does with a frame (drop, delay, duplicate) is in conn_fault.c,
 * which shares struct ps__fault_q and a few helpers with this file through conn_int.h.
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "common/common.h"
#include "common/fault.h"
#include "net/auth.h"
#include "net/conn_int.h"
#include "net/net.h"
#include "proto/msg.h"

#define STAGE_CAP (256u * 1024u)
#define DIRECT_MIN (32u * 1024u) /* bodies with this much left are read in place */
#define DISCARD_CAP (64u * 1024u)
#define GROW_FIRST (64u * 1024u) /* a pooled body starts this large, then doubles as bytes come */
#define UNIX_SNDBUF (1 << 20) /* see ps__conn_start */

typedef struct write_req {
  uv_write_t req;
  ps__conn *conn;
  ps__send_cb cb;
  void *arg;
  size_t bytes;
  void *owned;       /* copied control body, freed on completion */
  void *pooled;      /* copied remainder of a ps__conn_send_now frame, back to the pool */
  size_t pooled_len;
  uint8_t hdr[PS_FRAME_HDR_SIZE];
} write_req;

int ps__uv_err(int e) {
  switch (e) {
  case 0: return PS_OK;
  case UV_ENOMEM: return PS_ERR_NOMEM;
  case UV_ETIMEDOUT: return PS_ERR_TIMEOUT;
  case UV_ECANCELED: return PS_ERR_CANCELED;
  case UV_EOF:
  case UV_ECONNRESET:
  case UV_EPIPE: return PS_ERR_CLOSED;
  case UV_ECONNREFUSED:
  case UV_ENOENT:
  case UV_EHOSTUNREACH:
  case UV_ENETUNREACH: return PS_ERR_UNAVAILABLE;
  default: return PS_ERR_IO;
  }
}

static size_t conns_live; /* atomic: connections allocated and not freed, in this process */

size_t ps__conn_live(void) { return __atomic_load_n(&conns_live, __ATOMIC_RELAXED); }

ps__conn *ps__conn_alloc(uv_loop_t *loop, const ps__conn_ops *ops, void *udata, ps__pool *pool,
                         uint64_t max_payload) {
  ps__conn *c = ps__calloc(1, sizeof *c);
  if (!c) return NULL;
  c->stage = ps__malloc(STAGE_CAP);
  if (!c->stage) {
    free(c);
    return NULL;
  }
  __atomic_fetch_add(&conns_live, 1, __ATOMIC_RELAXED);
  c->stage_cap = STAGE_CAP;
  c->loop = loop;
  c->ops = ops;
  c->udata = udata;
  c->pool = pool;
  c->max_payload = max_payload;
  c->h.handle.data = c;
  return c;
}

/* ------------------------------------------------------------------ frame budget */

static void partial_unlink(ps__conn *c) {
  ps__frame_budget *b = c->budget;
  if (!c->plinked) return;
  if (c->pprev) c->pprev->pnext = c->pnext;
  else b->partial = c->pnext;
  if (c->pnext) c->pnext->pprev = c->pprev;
  c->pnext = c->pprev = NULL;
  c->plinked = 0;
}

/* The bytes c's frame holds leave the budget (delivered, or the connection is gone). */
static void budget_give(ps__conn *c) {
  if (c->budget) c->budget->used -= c->held;
  c->held = 0;
}

/* Count n more bytes for c's frame: 0, or PS_ERR_NOMEM (with a message) over the limit.
 * A body of at most GROW_FIRST bytes is counted but never refused: like the staging
 * buffer, it is a connection's fixed cost, and the control and small data frames of
 * well-behaved peers go on while large partial frames fill the budget. */
static int budget_take(ps__conn *c, uint64_t n) {
  ps__frame_budget *b = c->budget;
  if (!b) return 0;
  if (b->limit && b->used + n > b->limit && c->cur.payload_len > GROW_FIRST) {
    b->refused++;
    return ps__fail(PS_ERR_NOMEM,
                    "%s frame of %llu bytes refused: the server's partial frames hold %llu MiB of its %llu MiB "
                    "(frame_budget_mb); send again later",
                    ps__frame_type_name(c->cur.type), (unsigned long long)c->cur.payload_len,
                    (unsigned long long)(b->used >> 20), (unsigned long long)(b->limit >> 20));
  }
  b->used += n;
  c->held += n;
  if (b->used > b->peak) b->peak = b->used;
  return 0;
}

/* Connections whose frame began more than deadline_ms ago are closed. */
static void budget_timer_cb(uv_timer_t *t) {
  ps__frame_budget *b = t->data;
  uint64_t now = uv_now(t->loop);
  for (ps__conn *c = b->partial, *next; c; c = next) {
    next = c->pnext;
    if (c->closing || now - c->since_ms <= b->deadline_ms) continue;
    b->expired++;
    ps__log(PS_LOG_WARN, "closing connection from %s: a %s frame begun %llu ms ago is not complete (%llu of %llu body "
            "bytes; frame_deadline_ms %u)", c->peer, ps__frame_type_name(c->cur.type),
            (unsigned long long)(now - c->since_ms),
            (unsigned long long)(c->in_body ? c->cur.payload_len - c->body_left : 0),
            (unsigned long long)(c->in_body ? c->cur.payload_len : 0), b->deadline_ms);
    partial_unlink(c);
    ps__conn_close(c, PS_ERR_TIMEOUT);
  }
  if (!b->partial) uv_timer_stop(t);
}

/* After bytes were consumed: is c in the middle of a frame (a deadline runs) or not? */
static void partial_update(ps__conn *c) {
  ps__frame_budget *b = c->budget;
  if (!b || !b->deadline_ms || c->closing) return;
  int partial = (c->in_body || c->rpos != c->wpos) && !(c->fq && c->fq->in_held);
  if (partial && !c->plinked) {
    c->since_ms = uv_now(c->loop);
    c->pprev = NULL;
    c->pnext = b->partial;
    if (b->partial) b->partial->pprev = c;
    b->partial = c;
    c->plinked = 1;
    if (b->timer_init && !uv_is_active((uv_handle_t *)&b->timer)) {
      uint64_t every = b->deadline_ms / 4 ? b->deadline_ms / 4 : 1;
      uv_timer_start(&b->timer, budget_timer_cb, every > 1000 ? 1000 : every, every > 1000 ? 1000 : every);
    }
  } else if (!partial && c->plinked) {
    partial_unlink(c);
  }
}

void ps__frame_budget_init(ps__frame_budget *b, uv_loop_t *loop, uint64_t limit, uint32_t deadline_ms) {
  memset(b, 0, sizeof *b);
  b->limit = limit;
  b->deadline_ms = deadline_ms;
  if (uv_timer_init(loop, &b->timer) == 0) {
    b->timer.data = b;
    b->timer_init = 1;
  }
}

void ps__frame_budget_close(ps__frame_budget *b) {
  if (b->timer_init && !uv_is_closing((uv_handle_t *)&b->timer)) uv_close((uv_handle_t *)&b->timer, NULL);
}

static void conn_free_cb(uv_handle_t *h) {
  ps__conn *c = h->data;
  if (c->budget) {
    partial_unlink(c);
    budget_give(c);
  }
  if (c->body.buf) ps__pool_put(c->pool, c->body.buf, c->body_cap ? c->body_cap : c->body.len);
  if (c->fq) ps__conn_fault_release(c);
  if (c->ops && c->ops->on_close) c->ops->on_close(c, c->close_status);
  ps__conn_free_unopened(c);
}

void ps__conn_free_unopened(ps__conn *c) {
  free(c->discard_buf);
  free(c->stage);
  free(c);
  __atomic_fetch_sub(&conns_live, 1, __ATOMIC_RELAXED);
}

void ps__conn_close(ps__conn *c, int status) {
  if (!c || c->closing) return;
  c->closing = 1;
  c->close_status = status;
  uv_read_stop(&c->h.stream);
  if (c->fq) ps__conn_fault_stop(c);
  if (c->hs) ps__auth_stop(c);
  uv_close(&c->h.handle, conn_free_cb);
}

static void shutdown_cb(uv_shutdown_t *req, int status) {
  ps__conn *c = req->data;
  (void)status;
  free(req);
  int st = c->close_status;
  c->closing = 0;
  ps__conn_close(c, st);
}

void ps__conn_close_after_flush(ps__conn *c, int status) {
  if (!c || c->closing) return;
  uv_read_stop(&c->h.stream);
  if (c->fq && ps__conn_fault_hold_close(c, status)) return;
  uv_shutdown_t *req = ps__malloc(sizeof *req);
  if (!req) {
    ps__conn_close(c, status);
    return;
  }
  req->data = c;
  c->close_status = status;
  if (uv_shutdown(req, &c->h.stream, shutdown_cb) != 0) {
    free(req);
    ps__conn_close(c, status);
    return;
  }
  c->closing = 1; /* no further reads or sends; shutdown_cb finishes the close */
  /* The fault timers close now, with their callbacks: a loop-wide walk meanwhile skips
   * this closing connection and would close them without (conn_fault.c's state leaked). */
  if (c->fq) ps__conn_fault_stop(c);
}

/* ------------------------------------------------------------------ writing */

static void write_cb(uv_write_t *req, int status) {
  write_req *w = (write_req *)req;
  ps__conn *c = w->conn;
  c->write_queue_bytes -= w->bytes;
  if (status == 0) {
    c->bytes_out += w->bytes;
    c->frames_out++;
  }
  if (w->cb) w->cb(w->arg, ps__uv_err(status));
  free(w->owned);
  ps__pool_put(c->pool, w->pooled, w->pooled_len);
  free(w);
  if (status != 0 && status != UV_ECANCELED) ps__conn_close(c, ps__uv_err(status));
}

/* For conn_fault.c's held frames (see conn_int.h). */
int ps__conn_write_owned(ps__conn *c, uint8_t *bytes, size_t len, ps__send_cb cb, void *arg) {
  write_req *w = calloc(1, sizeof *w);
  if (!w) {
    free(bytes);
    return PS_ERR_NOMEM;
  }
  w->conn = c;
  w->cb = cb;
  w->arg = arg;
  w->owned = bytes;
  w->bytes = len;
  uv_buf_t b = uv_buf_init((char *)bytes, 0);
  b.len = len;
  int rc = uv_write(&w->req, &c->h.stream, &b, 1, write_cb);
  if (rc != 0) {
    free(bytes);
    free(w);
    return ps__uv_err(rc);
  }
  c->write_queue_bytes += len;
  return 0;
}

static int send_impl(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs,
                     ps__send_cb cb, void *arg, void *owned) {
  uv_buf_t iov[1 + 2 * PS_BODY_MAX_IOV];
  uv_buf_t *v = iov;
  uint64_t total = 0;
  if (c->closing) {
    free(owned);
    return ps__fail(PS_ERR_CLOSED, "connection to %s is closed", c->peer);
  }
  int taken = ps__fault_on() ? ps__conn_fault_send(c, h, bufs, nbufs, SIZE_MAX, NULL, NULL, cb, arg) : 0;
  if (taken) {
    free(owned);
    return taken > 0 ? 0 : ps__fail(PS_ERR_NOMEM, "out of memory sending a frame");
  }
  write_req *w = ps__calloc(1, sizeof *w);
  if (nbufs + 1 > sizeof iov / sizeof iov[0]) v = ps__malloc((nbufs + 1) * sizeof *v);
  if (!w || !v) {
    free(w);
    if (v != iov) free(v);
    free(owned);
    return ps__fail(PS_ERR_NOMEM, "out of memory sending a frame");
  }
  for (unsigned i = 0; i < nbufs; i++) {
    v[i + 1] = bufs[i];
    total += bufs[i].len;
  }
  h->payload_len = total;
  ps__frame_encode(h, w->hdr);
  v[0] = uv_buf_init((char *)w->hdr, PS_FRAME_HDR_SIZE);
  w->conn = c;
  w->cb = cb;
  w->arg = arg;
  w->owned = owned;
  w->bytes = PS_FRAME_HDR_SIZE + total;
  int rc = uv_write(&w->req, &c->h.stream, v, nbufs + 1, write_cb);
  if (v != iov) free(v);
  if (rc != 0) {
    free(w->owned);
    free(w);
    return ps__fail(ps__uv_err(rc), "write to %s failed: %s", c->peer, uv_strerror(rc));
  }
  c->write_queue_bytes += w->bytes;
  return 0;
}

int ps__conn_send(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs,
                  ps__send_cb cb, void *arg) {
  return send_impl(c, h, bufs, nbufs, cb, arg, NULL);
}

/* A frame as regions v[0..n) with v[i] at frame offset off[i] (off[n] = frame length). */
typedef struct frame_view {
  const uv_buf_t *v;
  const size_t *off;
  unsigned n;
  uv_buf_t *scratch; /* room for n regions */
} frame_view;

/* The region holding frame byte x (x < frame length): the last region starting at or
 * before x, which is never an empty one (an empty region starts where the next does). */
static unsigned region_of(const frame_view *f, size_t x) {
  unsigned lo = 0, hi = f->n - 1;
  while (lo < hi) {
    unsigned mid = (lo + hi + 1) / 2;
    if (f->off[mid] <= x) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* Write frame bytes [a, b) with one non-blocking writev. Bytes written or a libuv error. */
static int try_range(ps__conn *c, const frame_view *f, size_t a, size_t b) {
  unsigned i = region_of(f, a), j = region_of(f, b - 1), k = 0;
  for (unsigned r = i; r <= j; r++) {
    size_t lo = r == i ? a - f->off[r] : 0, hi = r == j ? b - f->off[r] : f->v[r].len;
    if (hi == lo) continue;
    f->scratch[k] = uv_buf_init(f->v[r].base + lo, 0);
    f->scratch[k++].len = hi - lo;
  }
  return uv_try_write(&c->h.stream, f->scratch, k);
}

/* Copy frame bytes [a, b) into dst. */
static void copy_range(const frame_view *f, size_t a, size_t b, uint8_t *dst) {
  for (unsigned r = region_of(f, a); a < b; r++) {
    size_t lo = a - f->off[r], len = f->v[r].len - lo;
    if (len > b - a) len = b - a;
    memcpy(dst, f->v[r].base + lo, len);
    dst += len;
    a += len;
  }
}

/* Bytes of the unsent tail copied per step while the socket drains (see below). */
#define TAIL_STEP (256u * 1024u)

int ps__conn_send_now(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs) {
  return ps__conn_send_produced(c, h, bufs, nbufs, SIZE_MAX, NULL, NULL);
}

/* One ps__conn_send_produced under way: its frame, and how far it got. */
typedef struct produced_send {
  frame_view f;
  size_t end;      /* frame length */
  size_t final;    /* frame bytes before this one may be read */
  size_t head;     /* frame bytes written so far, straight from the regions */
  size_t cut;      /* frame bytes from here on are copied into rest */
  uint8_t *rest;   /* pooled copy of the unsent part (rest_cap bytes), or NULL */
  size_t rest_cap;
  size_t base;     /* frame offset of rest[0] */
  int rc;          /* the last libuv result, for the message of a failed write */
} produced_send;

/* Write what the socket takes now, straight from the regions (uv_try_write refuses
 * with UV_EAGAIN while earlier writes are queued, which keeps frames in order). What
 * it does not take must be copied before returning. The copy runs from the end of the
 * frame backwards, a step at a time, and between steps the socket is offered the
 * front again: the peer drains it meanwhile, so the copy overlaps the transfer and
 * covers only what did not go out directly. A produced payload: only bytes before
 * `final` may be read; while the socket takes no more of them, produce() makes more
 * final, and the copying starts only once all is final. 0 or an error. */
static int write_or_copy(ps__conn *c, produced_send *s, ps__produce_fn produce, void *arg) {
  while (s->head < s->cut) {
    size_t upto = s->cut < s->final ? s->cut : s->final;
    s->rc = s->head < upto ? try_range(c, &s->f, s->head, upto) : UV_EAGAIN;
    if (s->rc > 0) {
      s->head += (size_t)s->rc;
      continue;
    }
    if (s->rc != UV_EAGAIN && s->rc != UV_ENOSYS && s->rc != 0) return ps__uv_err(s->rc);
    if (s->final < s->end) {
      size_t more = produce(arg);
      PS_ASSERT(more > s->final - PS_FRAME_HDR_SIZE);
      s->final = more >= s->end - PS_FRAME_HDR_SIZE ? s->end : PS_FRAME_HDR_SIZE + more;
      continue;
    }
    if (!s->rest) {
      s->rest_cap = s->end - s->head;
      s->base = s->head;
      s->rest = ps__pool_get(c->pool, s->rest_cap);
      if (!s->rest) return PS_ERR_NOMEM;
    }
    size_t step = s->cut - s->head < TAIL_STEP ? s->cut - s->head : TAIL_STEP;
    copy_range(&s->f, s->cut - step, s->cut, s->rest + (s->cut - step - s->base));
    s->cut -= step;
  }
  return 0;
}

/* After write_or_copy: report its error, or queue the copied rest of the frame. */
static int queue_rest(ps__conn *c, produced_send *s, int err) {
  c->bytes_out += s->head;
  if (err) {
    ps__pool_put(c->pool, s->rest, s->rest_cap);
    /* Part of the frame may be out: the stream cannot carry another frame. */
    if (s->head > 0) ps__conn_close(c, err);
    return err == PS_ERR_NOMEM ? ps__fail(err, "out of memory for a %zu-byte reply", s->end)
                               : ps__fail(err, "write to %s failed: %s", c->peer, uv_strerror(s->rc));
  }
  if (s->head == s->end) {
    c->frames_out++;
    ps__pool_put(c->pool, s->rest, s->rest_cap);
    return 0;
  }
  write_req *w = ps__calloc(1, sizeof *w);
  if (!w) {
    ps__pool_put(c->pool, s->rest, s->rest_cap);
    if (s->head > 0) ps__conn_close(c, PS_ERR_NOMEM);
    return ps__fail(PS_ERR_NOMEM, "out of memory sending a frame");
  }
  w->conn = c;
  w->pooled = s->rest;
  w->pooled_len = s->rest_cap;
  w->bytes = s->end - s->head;
  uv_buf_t b = uv_buf_init((char *)s->rest + (s->head - s->base), 0);
  b.len = s->end - s->head;
  int rc = uv_write(&w->req, &c->h.stream, &b, 1, write_cb);
  if (rc != 0) {
    ps__pool_put(c->pool, s->rest, s->rest_cap);
    free(w);
    if (s->head > 0) ps__conn_close(c, ps__uv_err(rc));
    return ps__fail(ps__uv_err(rc), "write to %s failed: %s", c->peer, uv_strerror(rc));
  }
  c->write_queue_bytes += w->bytes;
  return 0;
}

int ps__conn_send_produced(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs, size_t ready,
                           ps__produce_fn produce, void *arg) {
  uint8_t hdr[PS_FRAME_HDR_SIZE];
  uv_buf_t iov[1 + 2 * PS_BODY_MAX_IOV], scratch_small[1 + 2 * PS_BODY_MAX_IOV];
  size_t off_small[2 + 2 * PS_BODY_MAX_IOV];
  uv_buf_t *v = iov, *scratch = scratch_small;
  size_t *off = off_small;
  unsigned n = nbufs + 1;
  if (c->closing) return ps__fail(PS_ERR_CLOSED, "connection to %s is closed", c->peer);
  int taken = ps__fault_on() ? ps__conn_fault_send(c, h, bufs, nbufs, ready, produce, arg, NULL, NULL) : 0;
  if (taken) return taken > 0 ? 0 : ps__fail(PS_ERR_NOMEM, "out of memory sending a frame");
  if (n > sizeof iov / sizeof iov[0]) {
    v = ps__malloc(n * sizeof *v);
    scratch = ps__malloc(n * sizeof *scratch);
    off = ps__malloc((n + 1) * sizeof *off);
    if (!v || !scratch || !off) {
      free(v);
      free(scratch);
      free(off);
      return ps__fail(PS_ERR_NOMEM, "out of memory sending a frame");
    }
  }
  v[0] = uv_buf_init((char *)hdr, PS_FRAME_HDR_SIZE);
  off[0] = 0;
  for (unsigned i = 0; i < nbufs; i++) v[i + 1] = bufs[i];
  for (unsigned i = 0; i < n; i++) off[i + 1] = off[i] + v[i].len;
  size_t end = off[n];
  h->payload_len = end - PS_FRAME_HDR_SIZE;
  ps__frame_encode(h, hdr);
  produced_send s = {.f = {v, off, n, scratch}, .end = end, .cut = end};
  s.final = ready >= end - PS_FRAME_HDR_SIZE || !produce ? end : PS_FRAME_HDR_SIZE + ready;
  int err = write_or_copy(c, &s, produce, arg);
  if (v != iov) {
    free(v);
    free(scratch);
    free(off);
  }
  return queue_rest(c, &s, err);
}

int ps__conn_send_ctrl(ps__conn *c, ps__frame_hdr *h, const void *body, size_t len) {
  void *copy = NULL;
  uv_buf_t b;
  if (len) {
    copy = ps__malloc(len);
    if (!copy) return ps__fail(PS_ERR_NOMEM, "out of memory");
    memcpy(copy, body, len);
  }
  b = uv_buf_init(copy, (unsigned)len);
  return send_impl(c, h, &b, len ? 1 : 0, NULL, NULL, copy);
}

int ps__conn_send_error(ps__conn *c, const ps__frame_hdr *req, int status, const char *msg) {
  ps__frame_hdr h;
  memset(&h, 0, sizeof h);
  if (req && req->req_id) {
    h.type = (uint8_t)(req->type | PS_FRAME_REPLY);
    h.req_id = req->req_id;
    h.table = req->table;
    h.clock = req->clock;
  } else {
    h.type = PS_MSG_ERROR;
  }
  h.status = status;
  size_t n = msg ? strlen(msg) : 0;
  if (n > 1024) n = 1024;
  return ps__conn_send_ctrl(c, &h, msg, n);
}

/* ------------------------------------------------------------------ reading */

static void process_stage(ps__conn *c);
static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *out);
static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

/* Hand the complete frame to the owner, then reset (see conn_int.h). */
void ps__conn_deliver(ps__conn *c) {
  ps__body *b = &c->body;
  ps__frame_hdr h = c->cur;
  budget_give(c);
  if (!b->discard && c->ops->on_frame) ps__conn_on_frame(c, &h, b);
  if (b->buf) ps__pool_put(c->pool, b->buf, b->len);
  ps__conn_reset_body(c);
}

static void finish_frame(ps__conn *c) {
  c->bytes_in += PS_FRAME_HDR_SIZE + c->cur.payload_len;
  c->frames_in++;
  if (c->plinked) c->since_ms = uv_now(c->loop); /* what follows is the next frame */
  if (c->fq && c->fq->in_pending) {
    ps__conn_fault_complete(c);
    return;
  }
  ps__conn_deliver(c);
}

void ps__conn_read_on(ps__conn *c) {
  int rc = uv_read_start(&c->h.stream, alloc_cb, read_cb);
  if (rc) {
    ps__conn_close(c, ps__uv_err(rc));
    return;
  }
  process_stage(c);
}

/* Protocol violation (see conn_int.h). */
void ps__conn_reject(ps__conn *c, const ps__frame_hdr *h, int err, const char *msg) {
  if (c->hs) {
    ps__auth_refuse(c, msg); /* before authentication every refusal is the same */
    return;
  }
  ps__log(PS_LOG_WARN, "closing connection from %s: %s", c->peer, msg);
  if (!c->closing) {
    ps__conn_send_error(c, h, err, msg);
    ps__conn_close_after_flush(c, err);
  }
}

/* A pooled body is full and more of it is coming: double it (up to the payload), within
 * the budget. 0, or an error with a message (c->body_err is set). */
static int body_grow(ps__conn *c) {
  ps__body *b = &c->body;
  size_t want = c->body_cap * 2 > b->len ? b->len : c->body_cap * 2;
  int rc = budget_take(c, want - c->body_cap);
  void *nb = rc ? NULL : ps__pool_grow(c->pool, b->buf, c->body_cap, want);
  if (!nb) {
    if (!rc) rc = ps__fail(PS_ERR_NOMEM, "no memory for a %llu-byte body", (unsigned long long)b->len);
    budget_give(c); /* the frame is refused: what it held goes back at once */
    c->body_err = rc;
    return rc;
  }
  b->buf = nb;
  c->body_cap = want;
  b->iov_small[0].base = nb;
  b->iov_small[0].len = want;
  c->growing = want < b->len;
  return 0;
}

/* Copy up to n bytes from src into the body destinations. Returns bytes consumed; a
 * body that could not grow sets c->body_err and stops. */
static size_t body_fill(ps__conn *c, const uint8_t *src, size_t n) {
  ps__body *b = &c->body;
  size_t used = 0;
  while (used < n && c->body_left > 0) {
    size_t take;
    if (b->discard) {
      take = n - used;
      if (take > c->body_left) take = (size_t)c->body_left;
    } else {
      if (c->growing && c->cur_off == b->iov[0].len && body_grow(c)) break;
      uv_buf_t *d = &b->iov[c->cur_iov];
      take = d->len - c->cur_off;
      if (take > n - used) take = n - used;
      memcpy(d->base + c->cur_off, src + used, take);
      c->cur_off += take;
      if (c->cur_off == d->len && !c->growing) {
        c->cur_iov++;
        c->cur_off = 0;
      }
    }
    used += take;
    c->body_left -= take;
  }
  return used;
}

static void skip_empty_iov(ps__conn *c) {
  while (!c->body.discard && c->cur_iov < c->body.niov && c->body.iov[c->cur_iov].len == 0) c->cur_iov++;
}

/* Start a body after a header: ask the owner for destinations. 0 or error. */
static int begin_body(ps__conn *c) {
  ps__body *b = &c->body;
  ps__conn_reset_body(c);
  int rc = ps__conn_on_header(c, &c->cur, b);
  if (rc != 0) return rc;
  c->in_body = 1;
  c->body_left = c->cur.payload_len;
  if (b->discard || c->cur.payload_len == 0) return 0;
  if (b->niov == 0) {
    /* A header's length reserves nothing by itself: the body starts small (or in a
     * buffer the pool holds already) and grows as its bytes arrive (body_grow). */
    size_t len = c->cur.payload_len, cap = len;
    void *buf = len > GROW_FIRST && (!c->budget || !c->budget->limit || c->budget->used + len <= c->budget->limit)
                    ? ps__pool_cached(c->pool, len) : NULL;
    if (!buf && len > GROW_FIRST) cap = GROW_FIRST;
    int rc = budget_take(c, cap);
    if (rc) {
      ps__pool_put(c->pool, buf, len);
      return rc;
    }
    if (!buf && !(buf = ps__pool_get(c->pool, cap))) {
      budget_give(c);
      return ps__fail(PS_ERR_NOMEM, "no memory for a %llu-byte body", (unsigned long long)len);
    }
    b->buf = buf;
    b->len = len;
    c->body_cap = cap;
    c->growing = cap < len;
    b->iov_small[0] = uv_buf_init(b->buf, (unsigned)0);
    b->iov_small[0].len = cap;
    b->iov = b->iov_small;
    b->niov = 1;
  } else {
    uint64_t sum = 0;
    for (unsigned i = 0; i < b->niov; i++) sum += b->iov[i].len;
    if (sum != c->cur.payload_len)
      return ps__fail(PS_ERR_SIZE, "%s body of %llu bytes where %llu were expected",
                      ps__frame_type_name(c->cur.type), (unsigned long long)c->cur.payload_len,
                      (unsigned long long)sum);
  }
  skip_empty_iov(c);
  return 0;
}

/* Consume the staging buffer: headers and small bodies. */
static void process_stage(ps__conn *c) {
  while (!c->closing && !(c->fq && c->fq->in_held)) {
    size_t avail = c->wpos - c->rpos;
    if (c->in_body) {
      if (c->body_left > 0) {
        if (avail == 0) break;
        c->rpos += body_fill(c, c->stage + c->rpos, avail);
        if (c->body_err) {
          char msg[512];
          snprintf(msg, sizeof msg, "%s", ps_errmsg());
          ps__frame_hdr h = c->cur;
          ps__conn_reject(c, &h, c->body_err, msg);
          return;
        }
        skip_empty_iov(c);
      }
      if (c->body_left == 0) finish_frame(c);
      continue;
    }
    if (avail < PS_FRAME_HDR_SIZE) break;
    int rc = ps__frame_decode(c->stage + c->rpos, c->max_payload, &c->cur);
    if (rc != 0) {
      ps__conn_reject(c, NULL, rc, ps_errmsg());
      return;
    }
    c->rpos += PS_FRAME_HDR_SIZE;
    if (c->auth_inbound && ps__auth_sender(c, &c->cur)) return;
    if (ps__fault_on() && ps__conn_fault_recv(c)) continue;
    rc = begin_body(c);
    if (rc != 0) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", ps_errmsg()[0] ? ps_errmsg() : ps_strerror(rc));
      ps__frame_hdr h = c->cur;
      ps__conn_reset_body(c);
      ps__conn_reject(c, &h, rc, msg);
      return;
    }
  }
  if (c->rpos == c->wpos) c->rpos = c->wpos = 0;
  partial_update(c);
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *out) {
  ps__conn *c = h->data;
  (void)suggested;
  c->direct = 0;
  if (c->in_body && c->body_left >= DIRECT_MIN && c->rpos == c->wpos) {
    if (c->body.discard) {
      if (!c->discard_buf) c->discard_buf = ps__malloc(DISCARD_CAP);
      if (c->discard_buf) {
        size_t n = c->body_left < DISCARD_CAP ? (size_t)c->body_left : DISCARD_CAP;
        *out = uv_buf_init((char *)c->discard_buf, (unsigned)n);
        c->direct = 1;
        return;
      }
    } else if (!(c->growing && c->cur_off == c->body.iov[0].len)) {
      /* (a full growing body takes its next bytes through the staging buffer, where
       * body_fill grows it, or refuses the frame) */
      uv_buf_t *d = &c->body.iov[c->cur_iov];
      size_t n = d->len - c->cur_off;
      if (n > (1u << 30)) n = 1u << 30;
      out->base = d->base + c->cur_off;
      out->len = n;
      c->direct = 1;
      return;
    }
  }
  if (c->rpos > 0 && c->rpos == c->wpos) c->rpos = c->wpos = 0;
  if (c->stage_cap - c->wpos < 4096 && c->rpos > 0) {
    memmove(c->stage, c->stage + c->rpos, c->wpos - c->rpos);
    c->wpos -= c->rpos;
    c->rpos = 0;
  }
  out->base = (char *)c->stage + c->wpos;
  out->len = c->stage_cap - c->wpos;
}

static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  ps__conn *c = s->data;
  (void)buf;
  if (nread < 0) {
    ps__conn_close(c, nread == UV_EOF ? PS_ERR_CLOSED : ps__uv_err((int)nread));
    return;
  }
  if (nread == 0 || c->closing) return;
  if (c->direct) {
    c->direct = 0;
    if (!c->body.discard) {
      c->cur_off += (size_t)nread;
      if (c->cur_off == c->body.iov[c->cur_iov].len && !c->growing) {
        c->cur_iov++;
        c->cur_off = 0;
      }
    }
    c->body_left -= (uint64_t)nread;
    skip_empty_iov(c);
    if (c->body_left == 0) finish_frame(c);
    partial_update(c);
    return;
  }
  c->wpos += (size_t)nread;
  process_stage(c);
}

int ps__conn_start(ps__conn *c) {
  struct sockaddr_storage ss;
  int len = sizeof ss;
  if (!c->is_unix) {
    uv_tcp_nodelay(&c->h.tcp, 1);
    if (uv_tcp_getpeername(&c->h.tcp, (struct sockaddr *)&ss, &len) == 0) {
      char ip[64] = "?";
      int port = 0;
      if (ss.ss_family == AF_INET) {
        uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof ip);
        port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
      } else if (ss.ss_family == AF_INET6) {
        uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof ip);
        port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
      }
      snprintf(c->peer, sizeof c->peer, "%s:%d", ip, port);
    }
  } else {
    if (!c->peer[0]) snprintf(c->peer, sizeof c->peer, "unix socket");
    /* Who is at the other end, as the kernel saw it connect: peer-memory transfers
     * (peermem.c) go to this process only, whatever a frame claims. */
    uv_os_fd_t fd;
    struct ucred cr;
    socklen_t crlen = sizeof cr;
    if (uv_fileno(&c->h.handle, &fd) == 0 && getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &crlen) == 0 &&
        cr.pid > 0) {
      c->peer_pid = cr.pid;
      c->peer_uid = cr.uid;
    }
    /* An AF_UNIX sender may have only SO_SNDBUF bytes in flight, 208 KiB by default:
     * a large frame then goes out in many small pieces. Raise it (the kernel doubles the
     * value and caps it at net.core.wmem_max); never lower it. TCP is left to the
     * kernel's autotuning, which did as well as any fixed size on loopback. */
    int cur = 0;
    if (uv_send_buffer_size(&c->h.handle, &cur) == 0 && cur < 2 * UNIX_SNDBUF) {
      int want = UNIX_SNDBUF;
      uv_send_buffer_size(&c->h.handle, &want);
    }
  }
  int rc = uv_read_start(&c->h.stream, alloc_cb, read_cb);
  return rc ? ps__fail(ps__uv_err(rc), "cannot read from %s: %s", c->peer, uv_strerror(rc)) : 0;
}

/* ------------------------------------------------------------------ lending the socket */

int ps__conn_pause(ps__conn *c) {
  uv_os_fd_t fd;
  /* Writes the kernel has taken may still await their callbacks: those run on the loop
   * without touching the socket. */
  if (c->closing || c->in_body || c->rpos != c->wpos || uv_stream_get_write_queue_size(&c->h.stream) != 0) return -1;
  if (c->fq && (c->fq->head || c->fq->in_held)) return -1; /* frames held by fault injection */
  if (uv_fileno(&c->h.handle, &fd) != 0) return -1;
  uv_read_stop(&c->h.stream);
  return (int)fd;
}

int ps__conn_resume(ps__conn *c, const void *pre, size_t n) {
  if (c->closing) return PS_ERR_CLOSED;
  if (n > c->stage_cap) return ps__fail(PS_ERR_PROTO, "%zu bytes left over on a lent connection", n);
  if (n) {
    memcpy(c->stage, pre, n);
    c->rpos = 0;
    c->wpos = n;
  }
  int rc = uv_read_start(&c->h.stream, alloc_cb, read_cb);
  if (rc) return ps__fail(ps__uv_err(rc), "cannot read from %s: %s", c->peer, uv_strerror(rc));
  if (n) process_stage(c);
  return 0;
}
