/*
 * req.c - requests: their parts, completion, ps_req_wait / done / free, cancellation,
 * the deadline sweep, and blocking runs.
 *
 * A request (ps_req) has one part per node it talks to. Caller threads build it
 * (route.c, control.c) and post it to the loop (ps__req_post); from then on the loop
 * owns its parts: it sends them (link.c), matches replies, and finishes each part once
 * its reply arrived (or it failed) and its write completed. The last part completes
 * the request under its mutex, which wakes ps_req_wait. Cancel runs on the loop
 * (ps__mail_cancel) and is waited for by the caller, so that after ps_req_free the
 * library no longer touches the caller's buffers. Every part carries a deadline swept
 * by a loop timer (ps__sweep_tick), so every request ends.
 */
#include <stdio.h>
#include <string.h>

#include "client/client_int.h"

void ps__req_set_error(ps_req *r, int status, const char *msg) {
  pthread_mutex_lock(&r->mu);
  if (r->status == 0) {
    r->status = status;
    snprintf(r->msg, sizeof r->msg, "%.255s", msg ? msg : ps_strerror(status));
  }
  pthread_mutex_unlock(&r->mu);
}

/* Scatter routed pull rows back into the caller's order. */
static void req_scatter(ps_req *r) {
  const float *src = r->own_recv;
  size_t w = r->width;
  for (size_t j = 0; j < r->nkeys; j++) memcpy(r->out + (size_t)r->pos[j] * w, src + j * w, w * sizeof(float));
}

/* A pull's rows are in: scatter routed rows into caller order, and copy a
 * de-duplicated pull's distinct rows to every position that asked for them. */
void ps__req_rows_done(ps_req *r) {
  if (r->cx_table) { /* encoded replies first: they fill what the scatter reads */
    ps__cx_pull_done(r);
    if (r->status) return;
  }
  if (r->pos) req_scatter(r);
  if (r->dd_rows) {
    size_t w = r->dd_width;
    const float *rows = r->dd_rows;
    for (size_t j = 0; j < r->dd_n; j++) memcpy(r->dd_out + j * w, rows + (size_t)r->dd_idx[j] * w, w * 4);
  }
}


static void req_complete(ps_req *r) {
  if (r->counted) __atomic_sub_fetch(&r->ctx->outstanding, 1, __ATOMIC_RELEASE);
  if (r->canceled == 2) { /* detached (hello, queued fire-and-forget): nobody waits */
    ps__req_destroy(r);
    return;
  }
  if (r->status == 0 && !r->canceled) ps__req_rows_done(r);
  ps__req_observe(r);
  pthread_mutex_lock(&r->mu);
  __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE); /* read unlocked by ps_req_wait's poll */
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

int ps__part_pull_lent(const part *p) {
  return p->nchain > 1 && p->hdr.type == PS_MSG_PULL_DENSE && p->vx.xport == PS_XPORT_PEER_MEM && p->attempts;
}

/* Until the expiry its tail carries and the slack after it: before the deadline, and
 * sooner for a pull of a replicated table (PS_VX_CHAIN_PULL_MS), which stays lent while
 * it waits to be sent again (ps__part_submit). */
int ps__part_must_hold(const part *p) {
  return ps__vx_must_hold(&p->vx, p->sent || ps__part_pull_lent(p), p->vx.until + PS_VX_SLACK_MS);
}

/* A part is finished when its reply arrived (or it failed) and its write completed. */
void ps__part_finish(part *p) {
  if (p->finished) return;
  if (p->unanswered) ps__clock_unhold(p->req->ctx, p);
  if (!p->held && ps__part_must_hold(p)) {
    if (p->lk) {
      part_list_remove(&p->lk->inflight, p);
      p->lk = NULL;
    }
    p->held = 1;
    part_list_push(&p->req->ctx->held, p);
    return;
  }
  if (p->held) {
    p->held = 0;
    part_list_remove(&p->req->ctx->held, p);
  }
  p->finished = 1;
  /* A part that expects no reply (a queued fire-and-forget frame) finishes on its write
   * completion while still on the link's in-flight list; a detached request is freed
   * right below, so it must leave the list first. */
  if (p->lk) {
    part_list_remove(&p->lk->inflight, p);
    p->lk = NULL;
  }
  ps_req *r = p->req;
  if (--r->remaining == 0) req_complete(r);
}

void ps__part_fail(part *p, int status, const char *msg) {
  if (p->finished) return;
  ps__req_set_error(p->req, status, msg);
  p->reply_done = 1;
  /* A write still in flight holds the part (its callback argument) and the caller's
   * buffers: the part finishes in on_write_done, which every path that fails such a
   * part brings about soon by closing the connection (ECANCELED). Finishing it here
   * would let ps_req_free() free the request under the pending callback. */
  if (!p->sent) p->write_done = 1;
  if (p->write_done) ps__part_finish(p);
}


/* Fail parts whose deadline passed. A part whose payload is still being written
 * forces its connection closed (its buffers must be released). */
void ps__sweep_tick(uv_timer_t *t) {
  ps_ctx *ctx = t->data;
  uint64_t now = ps__now_ms();
  ps__clock_release(ctx);
  for (part *p = ctx->held; p;) { /* peer-memory parts whose buffers the server may no longer touch */
    part *next = p->next;
    if (!ps__part_must_hold(p)) ps__part_finish(p);
    p = next;
  }
  for (peer *l = ctx->links; l; l = l->next) {
    int close_conn = 0;
    for (part *p = l->queue_head; p;) {
      part *next = p->next;
      if (now >= p->deadline_ms) {
        ps__link_dequeue(l, p);
        ps__part_fail(p, PS_ERR_TIMEOUT, l->id == SCHED_LINK ? "deadline exceeded while the scheduler was away"
                                                            : "deadline exceeded waiting for a connection");
      }
      p = next;
    }
    for (part *p = l->inflight; p;) {
      part *next = p->next;
      if (now >= p->deadline_ms) {
        if (!p->write_done || l->reading == p) close_conn = 1;
        part_list_remove(&l->inflight, p);
        p->lk = NULL;
        char msg[96];
        snprintf(msg, sizeof msg, "no answer from node %u before the deadline", l->id);
        ps__part_fail(p, PS_ERR_TIMEOUT, msg);
      }
      p = next;
    }
    if (close_conn && l->conn) {
      l->conn->udata = NULL;
      ps__conn_close(l->conn, PS_ERR_TIMEOUT);
      l->conn = NULL;
      l->reading = NULL;
      ps__link_lost(ctx, l, PS_ERR_UNAVAILABLE, "connection reset after a deadline");
    }
  }
  ps__link_sweep(ctx, now);
}

/* ---- mail handlers (run on the loop) */

/* The request may be done before this runs (its parts handed to a link by the direct
 * path, and failed there), and its caller then waits in ps_req_free for submit_pending
 * to clear: the last access to r is the unlock below. */
void ps__mail_submit(void *arg) {
  ps_req *r = arg;
  ps_ctx *ctx = r->ctx;
  if (r->nparts == 0) {
    req_complete(r);
  } else {
    for (unsigned i = 0; i < r->nparts; i++)
      if (!r->parts[i].finished) ps__part_submit(ctx, &r->parts[i]); /* finished: answered on a lent link */
  }
  pthread_mutex_lock(&r->mu);
  r->submit_pending = 0;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

void ps__mail_cancel(void *arg) {
  ps_req *r = arg;
  for (unsigned i = 0; i < r->nparts; i++) {
    part *p = &r->parts[i];
    if (p->finished) continue;
    peer *l = p->lk;
    if (p->queued == 2) { /* waiting to go to its chain's head (link.c) */
      part_list_remove(&r->ctx->delayed, p);
      p->queued = 0;
    } else if (p->queued) {
      l = ps__link_find(r->ctx, p->target);
      if (l) {
        ps__link_dequeue(l, p);
      } else {
        p->prev = p->next = NULL;
        p->queued = 0;
      }
    } else if (l && ps__vx_lent(&p->vx, p->sent)) {
      /* The server may be copying from or into the caller's buffers: the part stays in
       * flight until its answer (or its deadline), which finishes it as canceled. */
      ps__req_set_error(r, PS_ERR_CANCELED, "canceled");
      continue;
    } else if (l) {
      if (l->reading == p && l->conn) {
        l->conn->body.discard = 1;
        l->conn->body.udata = NULL;
        l->reading = NULL;
      }
      /* A frame still being written stays on the in-flight list until its write ends
       * (on_write_done finishes it; ps__part_fail waits for that), so the deadline sweep
       * can still cut a write that never ends; a reply to it is discarded. Closing the
       * connection instead would fail every other request on it. */
      if (p->write_done) {
        part_list_remove(&l->inflight, p);
        p->lk = NULL;
      }
    }
    ps__part_fail(p, PS_ERR_CANCELED, "canceled");
  }
  pthread_mutex_lock(&r->mu);
  r->cancel_acked = 1;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

ps_req *ps__req_new(ps_ctx *ctx, unsigned nparts, unsigned nbufs) {
  ps_req *r = ps__calloc(1, sizeof *r);
  if (!r) return NULL;
  r->ctx = ctx;
  r->nparts = r->remaining = nparts;
  r->parts = ps__calloc(nparts ? nparts : 1, sizeof *r->parts);
  r->bufs = ps__calloc(nbufs ? nbufs : 1, sizeof *r->bufs);
  if (!r->parts || !r->bufs) {
    free(r->parts);
    free(r->bufs);
    free(r);
    return NULL;
  }
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  return r;
}

/* Scratch buffers for the caller's side, from a pool shared by the caller threads: a
 * large request partitioned over servers would otherwise touch fresh pages every call
 * (glibc maps every allocation of 32 MiB or more anew). */
void *ps__ubuf_get(ps_ctx *ctx, size_t n) {
  pthread_mutex_lock(&ctx->upool_mu);
  void *p = ps__pool_get(ctx->upool, n);
  pthread_mutex_unlock(&ctx->upool_mu);
  return p;
}

void ps__ubuf_put(ps_ctx *ctx, void *p, size_t n) {
  if (!p) return;
  pthread_mutex_lock(&ctx->upool_mu);
  ps__pool_put(ctx->upool, p, n);
  pthread_mutex_unlock(&ctx->upool_mu);
}

void ps__req_destroy(ps_req *r) {
  for (unsigned i = 0; r->parts && i < r->nparts; i++)
    if (r->parts[i].kb) ps__keep_part_done(r->ctx, &r->parts[i]);
  if (r->scratch) ps__ubuf_put(r->ctx, r->scratch, r->scratch_len);
  ps__ubuf_put(r->ctx, r->dd_rows, r->dd_rows_len);
  ps__ubuf_put(r->ctx, r->dd_block, r->dd_block_len);
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
  free(r->parts);
  free(r->bufs);
  free(r->own_keys);
  free(r->own_segs);
  free(r->cx_block);
  free(r);
}

void ps__part_init(ps_ctx *ctx, ps_req *r, unsigned i, uint32_t target, uint8_t type, uint32_t table,
                      uint64_t deadline_ms) {
  part *p = &r->parts[i];
  p->req = r;
  p->target = target;
  p->hdr.type = type;
  p->hdr.table = table;
  p->hdr.req_id = __atomic_add_fetch(&ctx->next_req_id, 1, __ATOMIC_RELAXED);
  p->hdr.lr = PS_LR_SCHEDULE;
  p->deadline_ms = deadline_ms;
}

int ps__req_post(ps_ctx *ctx, ps_req *r) {
  r->counted = 1;
  __atomic_add_fetch(&ctx->outstanding, 1, __ATOMIC_ACQ_REL);
  pthread_mutex_lock(&r->mu);
  r->submit_pending = 1;
  pthread_mutex_unlock(&r->mu);
  int rc = ps__mailbox_post(ctx->mail, ps__mail_submit, r);
  if (rc) {
    pthread_mutex_lock(&r->mu);
    r->submit_pending = 0;
    pthread_mutex_unlock(&r->mu);
    r->counted = 0;
    __atomic_sub_fetch(&ctx->outstanding, 1, __ATOMIC_RELEASE);
    return ps__fail(rc, "context is closed");
  }
  return 0;
}

#define SPIN_MAX_BYTES (64u * 1024u) /* ps_req_wait polls only for requests this small */

/* Payload bytes a request sends and expects back. */
static uint64_t req_bytes(const ps_req *r) {
  uint64_t n = 0;
  for (unsigned i = 0; i < r->nparts; i++) {
    const part *p = &r->parts[i];
    for (unsigned j = 0; j < p->nsend; j++) n += p->send[j].len;
    n += p->recv_len;
  }
  return n;
}

int ps_req_wait(ps_req *r, int timeout_ms) {
  if (!r) return ps__fail(PS_ERR_INVALID, "NULL request");
  uint64_t tmo = timeout_ms < 0 ? r->ctx->timeout_ms : (uint64_t)timeout_ms;
  struct timespec ts = ps__abs_after_ms(tmo);
  uint64_t t0 = ps__now_ns();
  /* Poll briefly before sleeping. A loopback reply comes within tens of microseconds,
   * and in a VM a thread woken on a halted CPU pays the hypervisor's wake-up (measured
   * here: a raw 4 KiB round trip of 80-100 us on an idle machine against 7-10 us on a
   * busy one). A request crosses two such wake-ups more than a raw round trip (caller to
   * I/O thread and back); keeping the caller's CPU awake removes the second. Not on a
   * single CPU, where the I/O thread could not run while we poll, and not for large
   * requests, whose transfer needs both CPUs of a small machine for longer than that. */
  uint64_t spin = r->ctx->spin_ns < tmo * 1000000u ? r->ctx->spin_ns : tmo * 1000000u; /* 0 polls */
  if (spin && req_bytes(r) > SPIN_MAX_BYTES) spin = 0;
  for (unsigned i = 1; spin && !__atomic_load_n(&r->done, __ATOMIC_ACQUIRE); i++) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if ((i & 63) == 0 && ps__now_ns() - t0 > spin) break;
  }
  pthread_mutex_lock(&r->mu);
  while (!r->done) {
    if (pthread_cond_timedwait(&r->cv, &r->mu, &ts) != 0 && !r->done) {
      pthread_mutex_unlock(&r->mu);
      __atomic_add_fetch(&r->ctx->wait_ns[r->kind], ps__now_ns() - t0, __ATOMIC_RELAXED);
      return ps__fail(PS_ERR_PENDING, "request still running after %llu ms", (unsigned long long)tmo);
    }
  }
  __atomic_add_fetch(&r->ctx->wait_ns[r->kind], ps__now_ns() - t0, __ATOMIC_RELAXED);
  int st = r->status;
  if (st) ps__fail(st, "%s", r->msg);
  pthread_mutex_unlock(&r->mu);
  return st;
}

int ps__req_wait_call(ps_req *r, int timeout_ms) {
  int rc = ps_req_wait(r, timeout_ms);
  /* A blocking call gives up at its deadline: that is a timeout, not a request the
   * caller may wait for again (the caller cancels it). */
  if (rc == PS_ERR_PENDING)
    rc = ps__fail(PS_ERR_TIMEOUT, "no answer within the call's deadline (%llu ms)",
                  (unsigned long long)(timeout_ms < 0 ? r->ctx->timeout_ms : (uint64_t)timeout_ms));
  return rc;
}

int ps_req_done(ps_req *r) {
  if (!r) return -1;
  pthread_mutex_lock(&r->mu);
  int done = r->done;
  pthread_mutex_unlock(&r->mu);
  return done;
}

/* Cancel a running request and wait until the loop has let go of its buffers. */
static void req_cancel_sync(ps_req *r) {
  pthread_mutex_lock(&r->mu);
  int done = r->done;
  r->canceled = 1;
  pthread_mutex_unlock(&r->mu);
  if (done) return;
  if (ps__mailbox_post(r->ctx->mail, ps__mail_cancel, r) != 0) return; /* loop gone: nothing runs */
  /* Wait for ps__mail_cancel itself, not for completion: it keeps reading the request
   * after its last part finished (and it may run after a normal completion). */
  pthread_mutex_lock(&r->mu);
  while (!r->cancel_acked) pthread_cond_wait(&r->cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
}

void ps_req_free(ps_req *r) {
  if (!r) return;
  req_cancel_sync(r);
  /* After a cancel the loop may still be finishing parts; wait for done, and for the
   * submission mail, which may come after a completion elsewhere. */
  pthread_mutex_lock(&r->mu);
  while (!r->done || r->submit_pending) pthread_cond_wait(&r->cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
  ps__req_destroy(r);
}


/* Blocking calls: on lent links when possible, else through the loop. reqs[] are
 * sent in order (a push then a pull of ps_push_pull). Parts left unanswered on lent
 * links that may be sent again go through the loop (reqs[] is reordered for that).
 * On timeout a request running on the loop is canceled. */
int ps__req_run_n(ps_ctx *ctx, ps_req **reqs, unsigned nreqs, int timeout_ms) {
  uint64_t tmo = timeout_ms < 0 ? ctx->timeout_ms : (uint64_t)timeout_ms;
  uint64_t t0 = ps__now_ns();
  int rc = 0;
  char msg[256] = "";
  if (ps__direct_run(ctx, reqs, nreqs, ps__now_ms() + tmo)) {
    uint64_t dt = ps__now_ns() - t0;
    unsigned left = 0;
    for (unsigned q = 0; q < nreqs; q++) {
      __atomic_add_fetch(&ctx->wait_ns[reqs[q]->kind], dt / nreqs, __ATOMIC_RELAXED);
      if (!reqs[q]->done) { /* parts to send again: through the loop, below, in order */
        reqs[left++] = reqs[q];
        continue;
      }
      if (reqs[q]->status && !rc) {
        rc = reqs[q]->status;
        snprintf(msg, sizeof msg, "%s", reqs[q]->msg);
      }
      ps__req_destroy(reqs[q]);
    }
    if (!left) {
      if (rc) ps__fail(rc, "%s", msg);
      return rc;
    }
    nreqs = left;
  }
  int direct_rc = rc;
  rc = 0;
  unsigned posted = 0;
  for (; posted < nreqs; posted++)
    if ((rc = ps__req_post(ctx, reqs[posted]))) break;
  for (unsigned q = posted; q < nreqs; q++) ps__req_destroy(reqs[q]);
  for (unsigned q = 0; q < posted; q++) {
    uint64_t spent = (ps__now_ns() - t0) / 1000000u;
    int left = spent >= tmo ? 0 : (int)(tmo - spent);
    int st = rc ? rc : ps__req_wait_call(reqs[q], left);
    if (st && !rc) {
      rc = st;
      snprintf(msg, sizeof msg, "%s", ps_errmsg());
    }
    ps_req_free(reqs[q]);
  }
  if (!rc && direct_rc) { /* a request answered on a lent link failed */
    rc = direct_rc;
    ps__fail(rc, "%s", msg);
    return rc;
  }
  if (rc) ps__fail(rc, "%s", msg[0] ? msg : ps_strerror(rc));
  return rc;
}

/* Run a request to completion within timeout_ms; cancel it on timeout. */
int ps__req_run(ps_ctx *ctx, ps_req *r, int timeout_ms) {
  if (r->kind != 2) return ps__req_run_n(ctx, &r, 1, timeout_ms);
  int rc = ps__req_post(ctx, r);
  if (rc) {
    ps__req_destroy(r);
    return rc;
  }
  rc = ps__req_wait_call(r, timeout_ms);
  char msg[256];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  ps_req_free(r);
  if (rc) ps__fail(rc, "%s", msg);
  return rc;
}

/* Called before the context is checked: a NULL ctx must reach ps__ctx_check (INVALID). */
uint64_t ps__deadline_for(ps_ctx *ctx, int timeout_ms) {
  uint64_t t = timeout_ms >= 0 ? (uint64_t)timeout_ms : ctx ? ctx->timeout_ms : 0;
  return ps__now_ms() + t + 50;
}

