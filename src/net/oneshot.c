/*
 * oneshot.c - a blocking one-request, one-reply exchange (see oneshot.h).
 *
 * A private loop holds one connection and one deadline timer. The first of four
 * events ends the exchange: the reply arrives (on_frame), the connection fails or
 * closes (connect callback, on_close), or the deadline passes (timer). It records the
 * outcome and stops the loop; every handle is then closed and the loop run until they
 * are gone, so nothing outlives the call. The outcome's message is kept in the
 * exchange itself, since the connection code writes its own messages to the thread's
 * error buffer while it closes.
 */
#include "net/oneshot.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <time.h>

#include "common/common.h"
#include "net/net.h"

#define HOST_MAX 128
/* Error frames carry at most 1 KiB of text (ps__conn_send_error): they are read whatever
 * max_reply says, so a small limit does not hide the peer's message. */
#define ERROR_BODY_MAX 4096u

typedef struct oneshot {
  uv_loop_t loop;
  uv_timer_t timer;
  const char *addr;
  ps__frame_hdr req;
  const void *body;
  size_t len;
  uint64_t timeout_ms;
  uint64_t max_reply;
  /* outcome */
  int done;
  int rc;
  char msg[512];
  ps__frame_hdr reply;
  uint8_t *out; /* the reply body, NUL-terminated; owned until handed to the caller */
  size_t out_len;
} oneshot;

static void finish(oneshot *o, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Record the outcome (the first one wins) and stop the loop. */
static void finish(oneshot *o, int rc, const char *fmt, ...) {
  if (o->done) return;
  o->done = 1;
  o->rc = rc;
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->msg, sizeof o->msg, fmt, ap);
    va_end(ap);
  }
  uv_timer_stop(&o->timer);
  uv_stop(&o->loop);
}

/* Does h answer our request? A connection-level error frame (PS_MSG_ERROR, sent when
 * the peer rejects what we sent before it could read a request id) answers it too. */
static int answers(const oneshot *o, const ps__frame_hdr *h) {
  if (h->type == PS_MSG_ERROR) return 1;
  return h->type == (uint8_t)(o->req.type | PS_FRAME_REPLY) && h->req_id == o->req.req_id;
}

static int on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  oneshot *o = c->udata;
  if (o->done || !answers(o, h)) {
    b->discard = 1;
    return 0;
  }
  if (h->status == 0 && h->payload_len > o->max_reply) {
    /* Only when max_reply is below ERROR_BODY_MAX: the connection refuses longer
     * frames at their header. */
    finish(o, PS_ERR_TOO_LARGE, "reply from %s has %llu bytes, more than the %llu allowed", o->addr,
           (unsigned long long)h->payload_len, (unsigned long long)o->max_reply);
    b->discard = 1;
    return 0;
  }
  o->out = ps__malloc((size_t)h->payload_len + 1);
  if (!o->out) return ps__fail(PS_ERR_NOMEM, "no memory for a %llu-byte reply", (unsigned long long)h->payload_len);
  o->out[h->payload_len] = '\0';
  if (h->payload_len > 0) {
    b->iov_small[0] = uv_buf_init((char *)o->out, 0);
    b->iov_small[0].len = (size_t)h->payload_len;
    b->iov = b->iov_small;
    b->niov = 1;
  }
  return 0;
}

static void on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  oneshot *o = c->udata;
  (void)b;
  if (o->done || !answers(o, h)) return;
  if (h->status != 0) {
    int st = h->status > 0 && h->status < PS_ERR__COUNT ? h->status : PS_ERR_PROTO;
    finish(o, st, "%s answered with an error (%s): %.*s", o->addr, ps_err_name(h->status),
           (int)(h->payload_len > 300 ? 300 : h->payload_len), o->out ? (const char *)o->out : "");
    return;
  }
  if (h->type == PS_MSG_ERROR) {
    finish(o, PS_ERR_PROTO, "%s sent an error frame with status 0", o->addr);
    return;
  }
  o->reply = *h;
  o->out_len = (size_t)h->payload_len;
  finish(o, 0, NULL);
}

static void on_close(ps__conn *c, int status) {
  oneshot *o = c->udata;
  if (o->done) return;
  switch (status) {
  case PS_ERR_TOO_LARGE:
    finish(o, status, "reply from %s is larger than the %llu bytes allowed", o->addr,
           (unsigned long long)o->max_reply);
    break;
  case 0:
  case PS_ERR_CLOSED:
    finish(o, PS_ERR_CLOSED, "%s closed the connection without replying", o->addr);
    break;
  default:
    finish(o, status, "connection to %s failed before the reply: %s", o->addr, ps_strerror(status));
    break;
  }
}

static const ps__conn_ops oneshot_ops = {on_header, on_frame, on_close};

static void on_connected(void *arg, ps__conn *c, int status) {
  oneshot *o = arg;
  if (status != 0 || !c) {
    if (status == PS_ERR_UNAVAILABLE)
      finish(o, status, "cannot connect to %s: connection refused or host unreachable", o->addr);
    else if (status == PS_ERR_CANCELED)
      finish(o, PS_ERR_TIMEOUT, "cannot connect to %s within %llu ms", o->addr, (unsigned long long)o->timeout_ms);
    else
      finish(o, status ? status : PS_ERR_IO, "cannot connect to %s: %s", o->addr, ps_strerror(status ? status : PS_ERR_IO));
    return;
  }
  if (o->done) return; /* the teardown closes c */
  ps__frame_hdr h = o->req;
  int rc = ps__conn_send_ctrl(c, &h, o->body, o->len);
  if (rc) finish(o, rc, "cannot send the request to %s: %s", o->addr, ps_errmsg());
}

static void on_deadline(uv_timer_t *t) {
  oneshot *o = t->data;
  finish(o, PS_ERR_TIMEOUT, "no reply from %s within %llu ms", o->addr, (unsigned long long)o->timeout_ms);
}

/* Close every handle of the private loop: connections through the connection code
 * (which frees them), the timer directly. */
static void close_handle(uv_handle_t *h, void *arg) {
  (void)arg;
  if (uv_is_closing(h)) return;
  if ((h->type == UV_TCP || h->type == UV_NAMED_PIPE) && h->data) {
    ps__conn_close(h->data, 0);
    return;
  }
  uv_close(h, NULL);
}

/* SIGPIPE is blocked in this thread while the exchange runs; one raised by a write to a
 * peer that hung up stays pending and is taken back here, unless it was pending before. */
typedef struct sigpipe_guard {
  sigset_t old;
  int was_pending;
} sigpipe_guard;

static void sigpipe_block(sigpipe_guard *g) {
  sigset_t set, pending;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &set, &g->old);
  sigemptyset(&pending);
  sigpending(&pending);
  g->was_pending = sigismember(&pending, SIGPIPE) == 1;
}

static void sigpipe_restore(sigpipe_guard *g) {
  sigset_t set, pending;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  sigemptyset(&pending);
  sigpending(&pending);
  if (!g->was_pending && sigismember(&pending, SIGPIPE) == 1) {
    const struct timespec zero = {0, 0};
    while (sigtimedwait(&set, NULL, &zero) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

int ps__oneshot(const char *addr, const ps__frame_hdr *req, const void *body, size_t len,
                uint64_t timeout_ms, uint64_t max_reply, ps__frame_hdr *reply, void **out,
                size_t *out_len) {
  char host[HOST_MAX];
  int port, rc;
  oneshot o;
  sigpipe_guard guard;

  if (out) *out = NULL;
  if (out_len) *out_len = 0;
  if (!addr || !req || !out || !out_len || (len && !body))
    return ps__fail(PS_ERR_INVALID, "ps__oneshot: NULL argument");
  if (timeout_ms == 0) return ps__fail(PS_ERR_INVALID, "ps__oneshot: timeout must be > 0");
  if (ps__parse_hostport(addr, host, sizeof host, &port) || port <= 0 || port > 65535)
    return ps__fail(PS_ERR_CONFIG, "bad address '%s' (HOST:PORT expected)", addr);

  memset(&o, 0, sizeof o);
  o.addr = addr;
  o.req = *req;
  if (o.req.req_id == 0) o.req.req_id = 1;
  o.body = body;
  o.len = len;
  o.timeout_ms = timeout_ms;
  o.max_reply = max_reply;
  rc = uv_loop_init(&o.loop);
  if (rc) return ps__fail(ps__uv_err(rc), "cannot create an event loop: %s", uv_strerror(rc));
  sigpipe_block(&guard);
  uv_timer_init(&o.loop, &o.timer);
  o.timer.data = &o;
  uv_timer_start(&o.timer, on_deadline, timeout_ms, 0);

  rc = ps__connect_tcp(&o.loop, host, port, &oneshot_ops, &o, NULL,
                       max_reply > ERROR_BODY_MAX ? max_reply : ERROR_BODY_MAX, on_connected, &o);
  if (rc) {
    char msg[sizeof o.msg];
    snprintf(msg, sizeof msg, "%s", ps_errmsg());
    finish(&o, rc, "%s", msg);
  } else {
    uv_run(&o.loop, UV_RUN_DEFAULT);
  }
  /* uv_run returns only once finish() stopped it: the timer is always armed before. */
  PS_ASSERT(o.done);
  uv_walk(&o.loop, close_handle, NULL);
  /* The first run may only clear a stop that finish() requested before the loop ran. */
  while (uv_run(&o.loop, UV_RUN_DEFAULT) != 0) {
  }
  rc = uv_loop_close(&o.loop);
  PS_ASSERT(rc == 0);
  sigpipe_restore(&guard);

  if (o.rc != 0) {
    free(o.out);
    return ps__fail(o.rc, "%s", o.msg);
  }
  if (reply) *reply = o.reply;
  if (o.out_len == 0) {
    free(o.out);
    o.out = NULL;
  }
  *out = o.out;
  *out_len = o.out_len;
  return 0;
}
