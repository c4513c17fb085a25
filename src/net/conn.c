/*
 * conn.c - framed connections over libuv streams (TCP and AF_UNIX alike).
 *
 * All functions run on the connection's loop thread. See net.h for the read path
 * (staging buffer for headers and small bodies, direct reads into destinations for
 * large ones) and the write path (one scatter/gather uv_write per frame).
 *
 * Fault injection (common/fault.h) hooks in where a header has been read and where a
 * frame is handed over to be sent; when no rule is armed that is one test of a global
 * flag. A dropped received frame is read and discarded; a delayed one is read whole,
 * then the connection stops reading until a timer hands it to the owner, so later
 * frames keep their order; a duplicated one is given to the owner twice. A frame to
 * send that is dropped, delayed or duplicated is copied into a per-connection queue
 * (struct ps__fault_q) that a timer writes out in order, and every later frame on that
 * connection waits in the queue behind it. A dropped frame's send callback reports
 * success: the frame is lost past the sender, as on a network.
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "common/common.h"
#include "common/fault.h"
#include "net/net.h"
#include "proto/msg.h"

_Static_assert((int)PS__FAULT_SCHEDULER == (int)PS_ROLE_SCHEDULER && (int)PS__FAULT_SERVER == (int)PS_ROLE_SERVER &&
                   (int)PS__FAULT_WORKER == (int)PS_ROLE_WORKER,
               "fault.h numbers roles as msg.h does");

#define STAGE_CAP (256u * 1024u)
#define DIRECT_MIN (32u * 1024u) /* bodies with this much left are read in place */
#define DISCARD_CAP (64u * 1024u)
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

ps__conn *ps__conn_alloc(uv_loop_t *loop, const ps__conn_ops *ops, void *udata, ps__pool *pool,
                         uint64_t max_payload) {
  ps__conn *c = ps__calloc(1, sizeof *c);
  if (!c) return NULL;
  c->stage = ps__malloc(STAGE_CAP);
  if (!c->stage) {
    free(c);
    return NULL;
  }
  c->stage_cap = STAGE_CAP;
  c->loop = loop;
  c->ops = ops;
  c->udata = udata;
  c->pool = pool;
  c->max_payload = max_payload;
  c->h.handle.data = c;
  return c;
}

static void fault_q_close(ps__conn *c);
static void fault_q_release(ps__conn *c);

static void conn_free_cb(uv_handle_t *h) {
  ps__conn *c = h->data;
  if (c->body.buf) ps__pool_put(c->pool, c->body.buf, c->body.len);
  if (c->fq) fault_q_release(c);
  if (c->ops && c->ops->on_close) c->ops->on_close(c, c->close_status);
  free(c->discard_buf);
  free(c->stage);
  free(c);
}

void ps__conn_close(ps__conn *c, int status) {
  if (!c || c->closing) return;
  c->closing = 1;
  c->close_status = status;
  uv_read_stop(&c->h.stream);
  if (c->fq) fault_q_close(c);
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

static int fault_hold_close(ps__conn *c, int status);

void ps__conn_close_after_flush(ps__conn *c, int status) {
  if (!c || c->closing) return;
  uv_read_stop(&c->h.stream);
  if (c->fq && fault_hold_close(c, status)) return;
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

/* ------------------------------------------------------------------ fault injection */

/* A frame to send held back, as bytes (header and payload). */
typedef struct held_frame {
  struct held_frame *next;
  uint64_t due_ms;    /* not before (ps__now_ms); 0: as soon as the frames before it went */
  uint8_t *bytes;     /* NULL for a dropped frame: only its callback is left */
  size_t len;
  ps__send_cb cb;
  void *arg;
} held_frame;

/* A connection's fault state. It outlives the connection until its timers are closed:
 * refs counts the connection and each initialised timer. The fault machinery allocates
 * with plain malloc, so that alloc rules never count or fail its own allocations. */
struct ps__fault_q {
  ps__conn *conn;
  int refs;
  uv_timer_t out_timer, in_timer;
  int timers_init;
  held_frame *head, *tail;
  int close_after;        /* ps__conn_close_after_flush waits for the queue: status + 1 */
  int in_pending;         /* the frame being read has in_act to apply when complete */
  int in_held;            /* a received frame waits for in_timer; reading is stopped */
  ps__fault_act in_act;
};

static void fq_unref(struct ps__fault_q *q) {
  if (--q->refs == 0) free(q);
}

static void fq_timer_closed(uv_handle_t *h) { fq_unref(h->data); }

static void out_timer_cb(uv_timer_t *t);
static void in_timer_cb(uv_timer_t *t);

/* The connection's fault state, created on first use; NULL when out of memory (the
 * fault is then not injected). */
static struct ps__fault_q *fq_get(ps__conn *c) {
  if (c->fq) return c->fq;
  struct ps__fault_q *q = calloc(1, sizeof *q);
  if (!q) {
    ps__log(PS_LOG_WARN, "fault: no memory to inject a fault on the connection to %s", c->peer);
    return NULL;
  }
  q->conn = c;
  q->refs = 3;
  uv_timer_init(c->loop, &q->out_timer);
  uv_timer_init(c->loop, &q->in_timer);
  q->out_timer.data = q->in_timer.data = q;
  q->timers_init = 1;
  c->fq = q;
  return q;
}

/* ps__conn_close: stop the timers. The held frames are cancelled in conn_free_cb, with
 * the writes libuv cancels. */
static void fault_q_close(ps__conn *c) {
  struct ps__fault_q *q = c->fq;
  if (!q->timers_init) return;
  q->timers_init = 0;
  /* A handle closed by someone else (a loop-wide walk) never calls us back: then leak q
   * rather than free memory libuv still uses. The connection's own handle is older
   * than its timers, so a walk in handle order reaches it, and us, first. */
  if (!uv_is_closing((uv_handle_t *)&q->out_timer)) uv_close((uv_handle_t *)&q->out_timer, fq_timer_closed);
  if (!uv_is_closing((uv_handle_t *)&q->in_timer)) uv_close((uv_handle_t *)&q->in_timer, fq_timer_closed);
}

/* conn_free_cb: cancel what is still held and let go of q. */
static void fault_q_release(ps__conn *c) {
  struct ps__fault_q *q = c->fq;
  c->fq = NULL;
  q->conn = NULL;
  while (q->head) {
    held_frame *f = q->head;
    q->head = f->next;
    if (f->cb) f->cb(f->arg, PS_ERR_CANCELED);
    free(f->bytes);
    free(f);
  }
  q->tail = NULL;
  fq_unref(q);
}

static void fq_push(struct ps__fault_q *q, held_frame *f) {
  f->next = NULL;
  if (q->tail) q->tail->next = f;
  else q->head = f;
  q->tail = f;
}

/* Start the out timer for the frame at the head of the queue. */
static void fq_kick(struct ps__fault_q *q) {
  if (!q->head || !q->timers_init) return;
  uint64_t now = ps__now_ms();
  uv_timer_start(&q->out_timer, out_timer_cb, q->head->due_ms > now ? q->head->due_ms - now : 0, 0);
}

/* Write held bytes (owned; freed when written). 0 or an error (bytes freed). */
static int write_owned(ps__conn *c, uint8_t *bytes, size_t len, ps__send_cb cb, void *arg) {
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

/* Write the held frames that are due, in order. */
static void out_timer_cb(uv_timer_t *t) {
  struct ps__fault_q *q = t->data;
  ps__conn *c = q->conn;
  while (c && !c->closing && q->head) {
    held_frame *f = q->head;
    uint64_t now = ps__now_ms();
    if (f->due_ms > now) {
      fq_kick(q);
      return;
    }
    q->head = f->next;
    if (!q->head) q->tail = NULL;
    c->write_queue_bytes -= f->len;
    if (!f->bytes) {
      if (f->cb) f->cb(f->arg, 0); /* dropped: lost after the sender */
    } else {
      int rc = write_owned(c, f->bytes, f->len, f->cb, f->arg);
      if (rc) {
        if (f->cb) f->cb(f->arg, rc);
        free(f);
        ps__conn_close(c, rc);
        return;
      }
    }
    free(f);
  }
  if (c && !c->closing && !q->head && q->close_after) {
    int st = q->close_after - 1;
    q->close_after = 0;
    ps__conn_close_after_flush(c, st);
  }
}

/* ps__conn_close_after_flush with frames held: close once they went. 1 if so. */
static int fault_hold_close(ps__conn *c, int status) {
  if (!c->fq->head) return 0;
  c->fq->close_after = status + 1;
  return 1;
}

/* The fault hook of every send: decide, and take the frame over when anything fired
 * or frames are held before it. Returns 1 if taken (its callback, if any, will be
 * called), 0 to send it normally, -1 when it can be neither (no memory to queue it
 * behind held frames). A produced payload is finished first. */
static int fault_send(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs, size_t ready,
                      ps__produce_fn produce, void *parg, ps__send_cb cb, void *arg) {
  ps__fault_act act;
  size_t plen = 0;
  if (h->type == PS_MSG_HELLO && nbufs == 1) {
    ps__hello hello;
    if (ps__hello_decode(bufs[0].base, bufs[0].len, &hello) == 0) ps__fault_self_hello(hello.role);
  }
  int fired = ps__fault_frame(PS__FAULT_OUT, h->type, &act);
  if (!fired && !(c->fq && c->fq->head)) return 0;
  struct ps__fault_q *q = fq_get(c);
  if (!q) return 0;
  for (unsigned i = 0; i < nbufs; i++) plen += bufs[i].len;
  if (produce)
    while (ready < plen) {
      size_t more = produce(parg);
      PS_ASSERT(more > ready);
      ready = more;
    }
  held_frame *f = calloc(1, sizeof *f), *d = NULL;
  uint8_t *bytes = act.drop ? NULL : malloc(PS_FRAME_HDR_SIZE + plen);
  if (act.dup) d = calloc(1, sizeof *d);
  if (!f || (!act.drop && !bytes) || (act.dup && !act.drop && (!d || !(d->bytes = malloc(PS_FRAME_HDR_SIZE + plen))))) {
    free(f);
    free(bytes);
    if (d) free(d->bytes);
    free(d);
    /* It cannot go ahead of held frames: fail it as a send without memory fails. */
    if (q->head) return -1;
    ps__log(PS_LOG_WARN, "fault: no memory to inject a fault on the connection to %s", c->peer);
    return 0;
  }
  if (bytes) {
    h->payload_len = plen;
    ps__frame_encode(h, bytes);
    size_t off = PS_FRAME_HDR_SIZE;
    for (unsigned i = 0; i < nbufs; i++) {
      if (bufs[i].len) memcpy(bytes + off, bufs[i].base, bufs[i].len);
      off += bufs[i].len;
    }
  }
  f->due_ms = act.delay_ms ? ps__now_ms() + act.delay_ms : 0;
  f->bytes = bytes;
  f->len = bytes ? PS_FRAME_HDR_SIZE + plen : 0;
  f->cb = cb;
  f->arg = arg;
  fq_push(q, f);
  c->write_queue_bytes += f->len;
  if (d && !act.drop) {
    memcpy(d->bytes, bytes, PS_FRAME_HDR_SIZE + plen);
    d->len = f->len;
    fq_push(q, d);
    c->write_queue_bytes += d->len;
  } else {
    free(d);
  }
  if (!uv_is_active((uv_handle_t *)&q->out_timer)) fq_kick(q);
  return 1;
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
  int taken = ps__fault_on() ? fault_send(c, h, bufs, nbufs, SIZE_MAX, NULL, NULL, cb, arg) : 0;
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

int ps__conn_send_produced(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs, size_t ready,
                           ps__produce_fn produce, void *arg) {
  uint8_t hdr[PS_FRAME_HDR_SIZE];
  uv_buf_t iov[1 + 2 * PS_BODY_MAX_IOV], scratch_small[1 + 2 * PS_BODY_MAX_IOV];
  size_t off_small[2 + 2 * PS_BODY_MAX_IOV];
  uv_buf_t *v = iov, *scratch = scratch_small;
  size_t *off = off_small;
  unsigned n = nbufs + 1;
  if (c->closing) return ps__fail(PS_ERR_CLOSED, "connection to %s is closed", c->peer);
  int taken = ps__fault_on() ? fault_send(c, h, bufs, nbufs, ready, produce, arg, NULL, NULL) : 0;
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
  frame_view f = {v, off, n, scratch};

  /* Write what the socket takes now, straight from the regions (uv_try_write refuses
   * with UV_EAGAIN while earlier writes are queued, which keeps frames in order). What
   * it does not take must be copied before returning. The copy runs from the end of the
   * frame backwards, a step at a time, and between steps the socket is offered the
   * front again: the peer drains it meanwhile, so the copy overlaps the transfer and
   * covers only what did not go out directly. A produced payload: only bytes before
   * `final` may be read; while the socket takes no more of them, produce() makes more
   * final, and the copying starts only once all is final. */
  size_t head = 0, cut = end, base = 0;
  size_t final = ready >= end - PS_FRAME_HDR_SIZE || !produce ? end : PS_FRAME_HDR_SIZE + ready;
  uint8_t *rest = NULL;
  size_t rest_cap = 0;
  int rc = 0, err = 0;
  while (head < cut) {
    size_t upto = cut < final ? cut : final;
    rc = head < upto ? try_range(c, &f, head, upto) : UV_EAGAIN;
    if (rc > 0) {
      head += (size_t)rc;
      continue;
    }
    if (rc != UV_EAGAIN && rc != UV_ENOSYS && rc != 0) {
      err = ps__uv_err(rc);
      break;
    }
    if (final < end) {
      size_t more = produce(arg);
      PS_ASSERT(more > final - PS_FRAME_HDR_SIZE);
      final = more >= end - PS_FRAME_HDR_SIZE ? end : PS_FRAME_HDR_SIZE + more;
      continue;
    }
    if (!rest) {
      rest_cap = end - head;
      base = head;
      rest = ps__pool_get(c->pool, rest_cap);
      if (!rest) {
        err = PS_ERR_NOMEM;
        break;
      }
    }
    size_t step = cut - head < TAIL_STEP ? cut - head : TAIL_STEP;
    copy_range(&f, cut - step, cut, rest + (cut - step - base));
    cut -= step;
  }
  if (v != iov) {
    free(v);
    free(scratch);
    free(off);
  }
  c->bytes_out += head;
  if (err) {
    ps__pool_put(c->pool, rest, rest_cap);
    /* Part of the frame may be out: the stream cannot carry another frame. */
    if (head > 0) ps__conn_close(c, err);
    return err == PS_ERR_NOMEM ? ps__fail(err, "out of memory for a %zu-byte reply", end)
                               : ps__fail(err, "write to %s failed: %s", c->peer, uv_strerror(rc));
  }
  if (head == end) {
    c->frames_out++;
    ps__pool_put(c->pool, rest, rest_cap);
    return 0;
  }
  write_req *w = ps__calloc(1, sizeof *w);
  if (!w) {
    ps__pool_put(c->pool, rest, rest_cap);
    if (head > 0) ps__conn_close(c, PS_ERR_NOMEM);
    return ps__fail(PS_ERR_NOMEM, "out of memory sending a frame");
  }
  w->conn = c;
  w->pooled = rest;
  w->pooled_len = rest_cap;
  w->bytes = end - head;
  uv_buf_t b = uv_buf_init((char *)rest + (head - base), 0);
  b.len = end - head;
  rc = uv_write(&w->req, &c->h.stream, &b, 1, write_cb);
  if (rc != 0) {
    ps__pool_put(c->pool, rest, rest_cap);
    free(w);
    if (head > 0) ps__conn_close(c, ps__uv_err(rc));
    return ps__fail(ps__uv_err(rc), "write to %s failed: %s", c->peer, uv_strerror(rc));
  }
  c->write_queue_bytes += w->bytes;
  return 0;
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

static void reset_body(ps__conn *c) {
  memset(&c->body, 0, sizeof c->body);
  c->in_body = 0;
  c->cur_iov = 0;
  c->cur_off = 0;
  c->body_left = 0;
}

/* The owner's callbacks, marked for alloc fault rules with the frame's type. */
static int call_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  if (!ps__fault_on()) return c->ops->on_header(c, h, b);
  int prev = ps__fault_scope_begin(h->type);
  int rc = c->ops->on_header(c, h, b);
  ps__fault_scope_end(prev);
  return rc;
}

static void call_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  if (!ps__fault_on()) {
    c->ops->on_frame(c, h, b);
    return;
  }
  int prev = ps__fault_scope_begin(h->type);
  c->ops->on_frame(c, h, b);
  ps__fault_scope_end(prev);
}

static void reject(ps__conn *c, const ps__frame_hdr *h, int err, const char *msg);
static void fault_replay(ps__conn *c, const ps__frame_hdr *h, const uint8_t *bytes, size_t len);
static void process_stage(ps__conn *c);
static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *out);
static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

/* The body as one copy (plain malloc; see struct ps__fault_q), for a duplicate. */
static uint8_t *body_copy(const ps__conn *c, size_t *len) {
  const ps__body *b = &c->body;
  size_t n = (size_t)c->cur.payload_len, off = 0;
  *len = n;
  if (b->discard) {
    *len = 0;
    return NULL;
  }
  uint8_t *p = malloc(n ? n : 1);
  if (!p) return NULL;
  for (unsigned i = 0; i < b->niov && off < n; i++) {
    memcpy(p + off, b->iov[i].base, b->iov[i].len);
    off += b->iov[i].len;
  }
  return p;
}

/* Hand the complete frame to the owner (twice if a dup rule fired), then reset. */
static void deliver(ps__conn *c, int dup) {
  ps__body *b = &c->body;
  ps__frame_hdr h = c->cur;
  size_t dlen = 0;
  uint8_t *copy = NULL;
  if (dup && !b->discard && !(copy = body_copy(c, &dlen)))
    ps__log(PS_LOG_WARN, "fault: no memory to duplicate a frame from %s", c->peer);
  if (!b->discard && c->ops->on_frame) call_on_frame(c, &h, b);
  if (b->buf) ps__pool_put(c->pool, b->buf, b->len);
  reset_body(c);
  if (copy && !c->closing) fault_replay(c, &h, copy, dlen);
  free(copy);
}

static void finish_frame(ps__conn *c) {
  c->bytes_in += PS_FRAME_HDR_SIZE + c->cur.payload_len;
  c->frames_in++;
  struct ps__fault_q *q = c->fq;
  if (q && q->in_pending) {
    q->in_pending = 0;
    if (q->in_act.delay_ms && q->timers_init) {
      /* Hold it; read nothing more until it is delivered, so later frames stay behind. */
      q->in_held = 1;
      uv_read_stop(&c->h.stream);
      uv_timer_start(&q->in_timer, in_timer_cb, q->in_act.delay_ms, 0);
      return;
    }
    deliver(c, q->in_act.dup);
    return;
  }
  deliver(c, 0);
}

static void in_timer_cb(uv_timer_t *t) {
  struct ps__fault_q *q = t->data;
  ps__conn *c = q->conn;
  if (!c || !q->in_held) return;
  q->in_held = 0;
  if (c->closing) {
    if (c->body.buf) ps__pool_put(c->pool, c->body.buf, c->body.len);
    reset_body(c);
    return;
  }
  deliver(c, q->in_act.dup);
  if (c->closing || q->close_after || q->in_held) return;
  int rc = uv_read_start(&c->h.stream, alloc_cb, read_cb);
  if (rc) {
    ps__conn_close(c, ps__uv_err(rc));
    return;
  }
  process_stage(c);
}

/* A duplicate of a received frame: the owner sees its header and body again. */
static void fault_replay(ps__conn *c, const ps__frame_hdr *h, const uint8_t *bytes, size_t len) {
  ps__body *b = &c->body;
  c->cur = *h;
  int rc = call_on_header(c, h, b);
  if (rc) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", ps_errmsg()[0] ? ps_errmsg() : ps_strerror(rc));
    reset_body(c);
    reject(c, h, rc, msg);
    return;
  }
  if (!b->discard && len) {
    if (b->niov == 0) {
      if (!(b->buf = ps__pool_get(c->pool, len))) {
        reset_body(c);
        reject(c, h, PS_ERR_NOMEM, "no memory for a duplicated frame's body");
        return;
      }
      b->len = len;
      memcpy(b->buf, bytes, len);
    } else {
      size_t off = 0;
      for (unsigned i = 0; i < b->niov; i++) off += b->iov[i].len;
      if (off != len) {
        reset_body(c);
        reject(c, h, PS_ERR_SIZE, "a duplicated frame's body does not fit where its owner put it");
        return;
      }
      off = 0;
      for (unsigned i = 0; i < b->niov; i++) {
        memcpy(b->iov[i].base, bytes + off, b->iov[i].len);
        off += b->iov[i].len;
      }
    }
  }
  if (!b->discard && c->ops->on_frame) call_on_frame(c, h, b);
  if (b->buf) ps__pool_put(c->pool, b->buf, b->len);
  reset_body(c);
}

/* The fault hook of a received header (c->cur): learn who this node is from the
 * registration going by, decide, and drop the frame here (1: its body is discarded and
 * the owner never sees it) or note what to do once it is complete (0). */
static int fault_recv(ps__conn *c) {
  const ps__frame_hdr *h = &c->cur;
  ps__fault_act act;
  if (h->type == PS_MSG_HELLO) ps__fault_self_scheduler();
  else if (h->type == (PS_MSG_HELLO | PS_FRAME_REPLY) && h->status == 0) ps__fault_self_registered(h->batch, h->table);
  if (!ps__fault_frame(PS__FAULT_IN, h->type, &act)) return 0;
  if (act.drop) {
    reset_body(c);
    c->in_body = 1;
    c->body_left = h->payload_len;
    c->body.discard = 1;
    return 1;
  }
  struct ps__fault_q *q = fq_get(c);
  if (q) {
    q->in_pending = 1;
    q->in_act = act;
  }
  return 0;
}

/* Protocol violation: answer with an error frame, then close. */
static void reject(ps__conn *c, const ps__frame_hdr *h, int err, const char *msg) {
  ps__log(PS_LOG_WARN, "closing connection from %s: %s", c->peer, msg);
  if (!c->closing) {
    ps__conn_send_error(c, h, err, msg);
    ps__conn_close_after_flush(c, err);
  }
}

/* Copy up to n bytes from src into the body destinations. Returns bytes consumed. */
static size_t body_fill(ps__conn *c, const uint8_t *src, size_t n) {
  ps__body *b = &c->body;
  size_t used = 0;
  while (used < n && c->body_left > 0) {
    size_t take;
    if (b->discard) {
      take = n - used;
      if (take > c->body_left) take = (size_t)c->body_left;
    } else {
      uv_buf_t *d = &b->iov[c->cur_iov];
      take = d->len - c->cur_off;
      if (take > n - used) take = n - used;
      memcpy(d->base + c->cur_off, src + used, take);
      c->cur_off += take;
      if (c->cur_off == d->len) {
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
  reset_body(c);
  int rc = call_on_header(c, &c->cur, b);
  if (rc != 0) return rc;
  c->in_body = 1;
  c->body_left = c->cur.payload_len;
  if (b->discard || c->cur.payload_len == 0) return 0;
  if (b->niov == 0) {
    b->buf = ps__pool_get(c->pool, c->cur.payload_len);
    if (!b->buf) return ps__fail(PS_ERR_NOMEM, "no memory for a %llu-byte body", (unsigned long long)c->cur.payload_len);
    b->len = c->cur.payload_len;
    b->iov_small[0] = uv_buf_init(b->buf, (unsigned)0);
    b->iov_small[0].len = b->len;
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
        skip_empty_iov(c);
      }
      if (c->body_left == 0) finish_frame(c);
      continue;
    }
    if (avail < PS_FRAME_HDR_SIZE) break;
    int rc = ps__frame_decode(c->stage + c->rpos, c->max_payload, &c->cur);
    if (rc != 0) {
      reject(c, NULL, rc, ps_errmsg());
      return;
    }
    c->rpos += PS_FRAME_HDR_SIZE;
    if (ps__fault_on() && fault_recv(c)) continue;
    rc = begin_body(c);
    if (rc != 0) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", ps_errmsg()[0] ? ps_errmsg() : ps_strerror(rc));
      ps__frame_hdr h = c->cur;
      reset_body(c);
      reject(c, &h, rc, msg);
      return;
    }
  }
  if (c->rpos == c->wpos) c->rpos = c->wpos = 0;
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
    } else {
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
      if (c->cur_off == c->body.iov[c->cur_iov].len) {
        c->cur_iov++;
        c->cur_off = 0;
      }
    }
    c->body_left -= (uint64_t)nread;
    skip_empty_iov(c);
    if (c->body_left == 0) finish_frame(c);
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

