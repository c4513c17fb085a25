/*
 * conn_int.h - what conn.c (framed connections) and conn_fault.c (fault injection on
 * them) share; nothing outside these two files includes it.
 *
 * conn.c keeps the read and write paths; it tests c->fq inline and calls into
 * conn_fault.c only when a fault rule is armed (ps__fault_on) or c->fq is set, so the
 * path with no fault armed stays one predictable branch. conn_fault.c calls back into
 * conn.c only through the four functions declared last. All of it runs on the
 * connection's loop thread.
 */
#ifndef PS_NET_CONN_INT_H
#define PS_NET_CONN_INT_H

#include <string.h>

#include "common/fault.h"
#include "net/net.h"

/* A connection's fault state. It outlives the connection until its timers are closed:
 * refs counts the connection and each initialised timer. The fault machinery allocates
 * with plain malloc, so that alloc rules never count or fail its own allocations. */
struct ps__fault_q {
  ps__conn *conn;
  int refs;
  uv_timer_t out_timer, in_timer;
  int timers_init;
  struct ps__held_frame *head, *tail; /* frames to send held back, in order */
  int close_after;        /* ps__conn_close_after_flush waits for the queue: status + 1 */
  int in_pending;         /* the frame being read has in_act to apply when complete */
  int in_held;            /* a received frame waits for in_timer; reading is stopped */
  ps__fault_act in_act;
};

/* Forget the body of the frame being read (not c->cur). */
static inline void ps__conn_reset_body(ps__conn *c) {
  memset(&c->body, 0, sizeof c->body);
  c->in_body = 0;
  c->cur_iov = 0;
  c->cur_off = 0;
  c->body_left = 0;
  c->body_cap = 0;
  c->growing = 0;
  c->body_err = 0;
}

/* The owner's callbacks, marked for alloc fault rules with the frame's type. */
static inline int ps__conn_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  if (!ps__fault_on()) return c->ops->on_header(c, h, b);
  int prev = ps__fault_scope_begin(h->type);
  int rc = c->ops->on_header(c, h, b);
  ps__fault_scope_end(prev);
  return rc;
}

static inline void ps__conn_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  if (!ps__fault_on()) {
    c->ops->on_frame(c, h, b);
    return;
  }
  int prev = ps__fault_scope_begin(h->type);
  c->ops->on_frame(c, h, b);
  ps__fault_scope_end(prev);
}

/* ---------------------------------------------------------------- conn_fault.c */

/* The fault hook of every send: decide, and take the frame over when anything fired
 * or frames are held before it. Returns 1 if taken (its callback, if any, will be
 * called), 0 to send it normally, -1 when it can be neither (no memory to queue it
 * behind held frames). A produced payload is finished first. */
int ps__conn_fault_send(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs, size_t ready,
                        ps__produce_fn produce, void *parg, ps__send_cb cb, void *arg);
/* The fault hook of a received header (c->cur): learn who this node is from the
 * registration going by, decide, and drop the frame here (1: its body is discarded and
 * the owner never sees it) or note what to do once it is complete (0). */
int ps__conn_fault_recv(ps__conn *c);
/* The frame being read is complete and c->fq->in_pending is set: hold it for its
 * delay, or deliver it (twice if a dup rule fired). */
void ps__conn_fault_complete(ps__conn *c);
/* ps__conn_close_after_flush with c->fq set: 1 if frames are held, and the connection
 * then closes once they went; 0 to close now. */
int ps__conn_fault_hold_close(ps__conn *c, int status);
/* ps__conn_close with c->fq set: stop the timers. */
void ps__conn_fault_stop(ps__conn *c);
/* The connection is being freed: cancel what is still held and let go of c->fq. */
void ps__conn_fault_release(ps__conn *c);
/* Connections' fault states allocated and not yet freed, in this process (for tests:
 * every one is freed once its connection and timers are closed). */
size_t ps__conn_fault_states(void);

/* ---------------------------------------------------------------- conn.c, for conn_fault.c */

/* Hand the complete frame (c->cur and c->body) to the owner once, then reset the body. */
void ps__conn_deliver(ps__conn *c);
/* Start reading again after a held frame and consume what the staging buffer holds;
 * closes the connection if reading cannot start. */
void ps__conn_read_on(ps__conn *c);
/* Protocol violation: answer with an error frame, then close. */
void ps__conn_reject(ps__conn *c, const ps__frame_hdr *h, int err, const char *msg);
/* Write bytes the connection takes over (freed when written). 0 or an error (bytes
 * freed, cb not called). */
int ps__conn_write_owned(ps__conn *c, uint8_t *bytes, size_t len, ps__send_cb cb, void *arg);

#endif
