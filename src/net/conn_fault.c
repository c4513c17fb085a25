/*
 * conn_fault.c - fault injection (common/fault.h) on framed connections (conn.c).
 *
 * conn.c calls in here where a header has been read and where a frame is handed over
 * to be sent, only when a rule is armed (one test of a global flag), and at the end of
 * a received frame or a close only when the connection has fault state (c->fq). A
 * dropped received frame is read and discarded; a delayed one is read whole, then the
 * connection stops reading until a timer hands it to the owner, so later frames keep
 * their order; a duplicated one is given to the owner twice. A frame to send that is
 * dropped, delayed or duplicated is copied into a per-connection queue (struct
 * ps__fault_q) that a timer writes out in order, and every later frame on that
 * connection waits in the queue behind it. A dropped frame's send callback reports
 * success: the frame is lost past the sender, as on a network. Everything runs on the
 * connection's loop thread.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "common/fault.h"
#include "net/conn_int.h"
#include "net/net.h"
#include "proto/msg.h"

_Static_assert((int)PS__FAULT_SCHEDULER == (int)PS_ROLE_SCHEDULER && (int)PS__FAULT_SERVER == (int)PS_ROLE_SERVER &&
                   (int)PS__FAULT_WORKER == (int)PS_ROLE_WORKER,
               "fault.h numbers roles as msg.h does");

/* ------------------------------------------------------------------ the connection's fault state */

/* A frame to send held back, as bytes (header and payload). */
typedef struct ps__held_frame {
  struct ps__held_frame *next;
  uint64_t due_ms;    /* not before (ps__now_ms); 0: as soon as the frames before it went */
  uint8_t *bytes;     /* NULL for a dropped frame: only its callback is left */
  size_t len;
  ps__send_cb cb;
  void *arg;
} held_frame;

static size_t fq_live; /* atomic: fault states allocated and not freed */

size_t ps__conn_fault_states(void) { return __atomic_load_n(&fq_live, __ATOMIC_RELAXED); }

static void fq_unref(struct ps__fault_q *q) {
  if (--q->refs == 0) {
    free(q);
    __atomic_fetch_sub(&fq_live, 1, __ATOMIC_RELAXED);
  }
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
  __atomic_fetch_add(&fq_live, 1, __ATOMIC_RELAXED);
  q->conn = c;
  q->refs = 3;
  uv_timer_init(c->loop, &q->out_timer);
  uv_timer_init(c->loop, &q->in_timer);
  q->out_timer.data = q->in_timer.data = q;
  q->timers_init = 1;
  c->fq = q;
  return q;
}

/* The held frames are cancelled in ps__conn_fault_release, with the writes libuv
 * cancels. */
void ps__conn_fault_stop(ps__conn *c) {
  struct ps__fault_q *q = c->fq;
  if (!q->timers_init) return;
  q->timers_init = 0;
  /* A handle closed by someone else (a loop-wide walk) never calls us back: then leak q
   * rather than free memory libuv still uses. The connection's own handle is older
   * than its timers, so a walk in handle order reaches it, and us, first. */
  if (!uv_is_closing((uv_handle_t *)&q->out_timer)) uv_close((uv_handle_t *)&q->out_timer, fq_timer_closed);
  if (!uv_is_closing((uv_handle_t *)&q->in_timer)) uv_close((uv_handle_t *)&q->in_timer, fq_timer_closed);
}

void ps__conn_fault_release(ps__conn *c) {
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

/* ------------------------------------------------------------------ sending */

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
      int rc = ps__conn_write_owned(c, f->bytes, f->len, f->cb, f->arg);
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

int ps__conn_fault_hold_close(ps__conn *c, int status) {
  if (!c->fq->head) return 0;
  c->fq->close_after = status + 1;
  return 1;
}

int ps__conn_fault_send(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs, size_t ready,
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

/* ------------------------------------------------------------------ receiving */

static void fault_replay(ps__conn *c, const ps__frame_hdr *h, const uint8_t *bytes, size_t len);

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
  ps__frame_hdr h = c->cur;
  size_t dlen = 0;
  uint8_t *copy = NULL;
  if (dup && !c->body.discard && !(copy = body_copy(c, &dlen)))
    ps__log(PS_LOG_WARN, "fault: no memory to duplicate a frame from %s", c->peer);
  ps__conn_deliver(c);
  if (copy && !c->closing) fault_replay(c, &h, copy, dlen);
  free(copy);
}

void ps__conn_fault_complete(ps__conn *c) {
  struct ps__fault_q *q = c->fq;
  q->in_pending = 0;
  if (q->in_act.delay_ms && q->timers_init) {
    /* Hold it; read nothing more until it is delivered, so later frames stay behind. */
    q->in_held = 1;
    uv_read_stop(&c->h.stream);
    uv_timer_start(&q->in_timer, in_timer_cb, q->in_act.delay_ms, 0);
    return;
  }
  deliver(c, q->in_act.dup);
}

static void in_timer_cb(uv_timer_t *t) {
  struct ps__fault_q *q = t->data;
  ps__conn *c = q->conn;
  if (!c || !q->in_held) return;
  q->in_held = 0;
  if (c->closing) {
    if (c->body.buf) ps__pool_put(c->pool, c->body.buf, c->body.len);
    ps__conn_reset_body(c);
    return;
  }
  deliver(c, q->in_act.dup);
  if (c->closing || q->close_after || q->in_held) return;
  ps__conn_read_on(c);
}

/* A duplicate of a received frame: the owner sees its header and body again. */
static void fault_replay(ps__conn *c, const ps__frame_hdr *h, const uint8_t *bytes, size_t len) {
  ps__body *b = &c->body;
  c->cur = *h;
  int rc = ps__conn_on_header(c, h, b);
  if (rc) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", ps_errmsg()[0] ? ps_errmsg() : ps_strerror(rc));
    ps__conn_reset_body(c);
    ps__conn_reject(c, h, rc, msg);
    return;
  }
  if (!b->discard && len) {
    if (b->niov == 0) {
      if (!(b->buf = ps__pool_get(c->pool, len))) {
        ps__conn_reset_body(c);
        ps__conn_reject(c, h, PS_ERR_NOMEM, "no memory for a duplicated frame's body");
        return;
      }
      b->len = len;
      memcpy(b->buf, bytes, len);
    } else {
      size_t off = 0;
      for (unsigned i = 0; i < b->niov; i++) off += b->iov[i].len;
      if (off != len) {
        ps__conn_reset_body(c);
        ps__conn_reject(c, h, PS_ERR_SIZE, "a duplicated frame's body does not fit where its owner put it");
        return;
      }
      off = 0;
      for (unsigned i = 0; i < b->niov; i++) {
        memcpy(b->iov[i].base, bytes + off, b->iov[i].len);
        off += b->iov[i].len;
      }
    }
  }
  if (!b->discard && c->ops->on_frame) ps__conn_on_frame(c, h, b);
  if (b->buf) ps__pool_put(c->pool, b->buf, b->len);
  ps__conn_reset_body(c);
}

int ps__conn_fault_recv(ps__conn *c) {
  const ps__frame_hdr *h = &c->cur;
  ps__fault_act act;
  if (h->type == PS_MSG_HELLO) ps__fault_self_scheduler();
  else if (h->type == (PS_MSG_HELLO | PS_FRAME_REPLY) && h->status == 0) ps__fault_self_registered(h->batch, h->table);
  if (!ps__fault_frame(PS__FAULT_IN, h->type, &act)) return 0;
  if (act.drop) {
    ps__conn_reset_body(c);
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
