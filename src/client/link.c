/*
 * link.c - links: one per server and one to the scheduler, all on the loop thread.
 *
 * A link connects on demand (AF_UNIX on the same host when the server offers it, else
 * TCP), queues parts while connecting, sends them, matches replies by request id and
 * reads pull replies straight into their destination. Links whose server left the job
 * fail what they hold. Lending: an idle link may be lent to a caller thread for the
 * fast path (direct.c); the loop takes it back before it sends on it. Membership from
 * the scheduler is applied here: new links, dead servers, the ring.
 *
 * Re-sending. Each push gets its identity when first sent (the context's incarnation,
 * the link's next sequence number; shard/once.h) and keeps it. A push or pull whose
 * connection fails goes back to the head of its link's queue, in the order the parts
 * were made, and is sent again on a new connection; a push unanswered retry_ms after
 * its write (doubling per attempt, up to 8 times) is sent again on the same
 * connection. Both end at the request's deadline. The server answers a push it has
 * applied already as applied; a reply to any attempt completes the part (same req_id),
 * and later ones are discarded. After a lost connection the link tells the server the
 * last clock it sent again, once the re-sent parts are written: a CLOCK on the old
 * connection may have been lost with it.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "client/client_int.h"

peer *ps__link_find(ps_ctx *ctx, uint32_t id) {
  for (peer *l = ctx->links; l; l = l->next)
    if (l->id == id) return l;
  return NULL;
}

/* Take a part off its link's queue of parts waiting for the connection. */
void ps__link_dequeue(peer *l, part *p) {
  if (p->prev)
    p->prev->next = p->next;
  else
    l->queue_head = p->next;
  if (p->next)
    p->next->prev = p->prev;
  else
    l->queue_tail = p->prev;
  p->prev = p->next = NULL;
  p->queued = 0;
}

/* How long a push waits for its reply before it is sent again: retry_ms, doubled for
 * each attempt after the first, at most 8 times as long. */
static uint64_t attempt_wait(const ps_ctx *ctx, const part *p) {
  unsigned k = p->attempts > 4 ? 3 : p->attempts ? p->attempts - 1 : 0;
  return (uint64_t)ctx->retry_ms << k;
}

int ps__part_may_resend(const ps_ctx *ctx, const part *p, uint64_t now) {
  uint8_t t = p->hdr.type;
  /* Not once the context failed (the scheduler refused it): calls fail from then on. */
  return ctx->retry_ms && !__atomic_load_n(&ctx->failed, __ATOMIC_RELAXED) && !p->finished && !p->reply_done &&
         now < p->deadline_ms &&
         /* a replicated peer-memory push may go to the next copy: a server that reads
          * the worker's buffers after the call returned reads a push every copy has
          * applied already; a pull too, once the server it went to may no longer
          * write into them (route.c, link_takes_pm; ps__part_submit) */
         (p->vx.xport == PS_XPORT_INLINE || (p->nchain > 1 && (t == PS_MSG_PUSH_DENSE || t == PS_MSG_PULL_DENSE))) &&
         (t == PS_MSG_PUSH || t == PS_MSG_PUSH_DENSE || t == PS_MSG_PULL || t == PS_MSG_PULL_DENSE);
}

#define RECONNECT_MS 200 /* a failed connect of a link with parts to send again: next try */

static int by_req_id(const void *a, const void *b) {
  uint64_t x = (*(part *const *)a)->hdr.req_id, y = (*(part *const *)b)->hdr.req_id;
  return x < y ? -1 : x > y;
}

static void queue_front(peer *l, part *p) {
  p->queued = 1;
  p->prev = NULL;
  p->next = l->queue_head;
  if (l->queue_head)
    l->queue_head->prev = p;
  else
    l->queue_tail = p;
  l->queue_head = p;
}

static void link_connect(ps_ctx *ctx, peer *l);
static void delayed_sweep(ps_ctx *ctx, uint64_t now);

void ps__link_lost(ps_ctx *ctx, peer *l, int status, const char *why) {
  if (l->id == SCHED_LINK || !l->alive || ctx->closing) {
    ps__link_fail_all(l, status, why);
    return;
  }
  uint64_t now = ps__now_ms();
  size_t n = 0, k = 0;
  for (part *p = l->inflight; p; p = p->next) n++;
  part **again = n ? ps__malloc(n * sizeof *again) : NULL;
  while (l->inflight) {
    part *p = l->inflight;
    part_list_remove(&l->inflight, p);
    p->lk = NULL;
    if (!again || !ps__part_may_resend(ctx, p, now)) {
      ps__part_fail(p, status, why);
    } else if (ps__part_pull_lent(p)) {
      ps__part_reroute(ctx, p, 1); /* after its server may no longer write (ps__part_submit) */
    } else if (p->wpend) {
      p->resend = 1; /* once its write callback ran (on_write_done) */
    } else {
      p->sent = 0;
      again[k++] = p;
    }
  }
  l->reading = NULL;
  /* Back at the head of the queue, in the order they were made: the server sees a
   * worker's pushes in their order, and a CLOCK queued after them stays after them. */
  if (k) qsort(again, k, sizeof *again, by_req_id);
  for (size_t i = k; i-- > 0;) queue_front(l, again[i]);
  free(again);
  l->lost = 1;
  if (k) ps__log(PS_LOG_WARN, "%s; sending %zu request%s to server %u again", why, k, k == 1 ? "" : "s", l->id);
  if (l->queue_head && !l->conn && !l->connecting) link_connect(ctx, l);
}

void ps__link_sweep(ps_ctx *ctx, uint64_t now) {
  delayed_sweep(ctx, now);
  for (peer *l = ctx->links; l; l = l->next) {
    if (l->id == SCHED_LINK) continue;
    if (l->reconnect_ms && now >= l->reconnect_ms) {
      l->reconnect_ms = 0;
      if (__atomic_load_n(&ctx->failed, __ATOMIC_RELAXED))
        ps__link_fail_all(l, PS_ERR_UNAVAILABLE, "the worker left the job");
      else if (l->alive && l->queue_head && !l->conn && !l->connecting)
        link_connect(ctx, l);
    }
    if (!l->conn || !ctx->retry_ms) continue;
    for (part *p = l->inflight; p; p = p->next) {
      if (!p->attempt_ms || now < p->attempt_ms || !p->write_done || l->reading == p || !ps__part_may_resend(ctx, p, now))
        continue;
      ps__log(PS_LOG_INFO, "no answer from server %u to push %u within %llu ms; sending it again", l->id, p->hdr.seq,
              (unsigned long long)attempt_wait(ctx, p));
      ps__part_send(ctx, l, p); /* stays where it is in the list */
      if (!l->conn) break;
    }
  }
}

void ps__link_fail_all(peer *l, int status, const char *why) {
  while (l->queue_head) {
    part *p = l->queue_head;
    ps__link_dequeue(l, p);
    ps__part_fail(p, status, why);
  }
  while (l->inflight) {
    part *p = l->inflight;
    part_list_remove(&l->inflight, p);
    p->lk = NULL;
    ps__part_fail(p, status, why);
  }
  l->reading = NULL;
}

static void on_write_done(void *arg, int status) {
  part *p = arg;
  ps_ctx *ctx = p->req->ctx;
  p->wpend--;
  p->write_done = p->wpend == 0;
  if (p->resend) { /* its connection went while this was being written */
    if (!p->write_done || p->finished) return;
    p->resend = 0;
    if (ps__part_may_resend(ctx, p, ps__now_ms())) {
      p->sent = 0;
      if (p->nchain > 1 && ps__part_reroute(ctx, p, 1)) return;
      ps__part_submit(ctx, p);
    } else {
      ps__part_fail(p, PS_ERR_UNAVAILABLE, "the connection to the server was lost");
    }
    return;
  }
  if (status != 0 && !p->finished) {
    /* The connection closes: link_lost sends the part again or fails it. */
    if (p->lk && (p->wpend || ps__part_may_resend(ctx, p, ps__now_ms()))) return;
    char msg[128];
    snprintf(msg, sizeof msg, "sending to node %u failed: %s", p->target, ps_strerror(status));
    if (p->lk) part_list_remove(&p->lk->inflight, p);
    p->lk = NULL;
    ps__part_fail(p, (status == PS_ERR_CANCELED || status == PS_ERR_CLOSED) ? PS_ERR_UNAVAILABLE : status, msg);
    return;
  }
  if (!p->write_done) return;
  if (p->reply_done) {
    ps__part_finish(p);
  } else if (status == 0 && ctx->retry_ms && ps__frame_is_push_req(p->hdr.type)) {
    p->attempt_ms = ps__now_ms() + attempt_wait(ctx, p);
  }
}


/* May the tail of replicated push p's chain answer it on its own link (PS_FLAG_TAIL)?
 * Only when the loop reads every member's link: lent ones are taken back here. */
static int tail_may_answer(ps_ctx *ctx, const part *p) {
  if (p->nchain < 2 || !ps__frame_is_push_req(p->hdr.type)) return 0;
  for (unsigned k = 0; k < p->nchain && k < PS_MAX_REPLICAS; k++) {
    peer *m = p->chain[k] == p->target ? NULL : ps__link_find(ctx, p->chain[k]);
    if (m && m->alive && m->conn && !ps__link_take(ctx, m)) return 0;
  }
  return 1;
}

void ps__part_send(ps_ctx *ctx, peer *l, part *p) {
  p->hdr.sender = ctx->id;
  if (tail_may_answer(ctx, p))
    p->hdr.flags |= PS_FLAG_TAIL;
  else
    p->hdr.flags &= (uint8_t)~PS_FLAG_TAIL;
  if (ps__frame_is_push_req(p->hdr.type) && !p->hdr.inc) { /* its identity, kept when sent again */
    p->hdr.inc = ctx->incarnation;
    p->hdr.seq = __atomic_add_fetch(&ctx->push_seq, 1, __ATOMIC_RELAXED);
    if (p->keep) {
      ps__keep_sent(ctx, p);
      p->unanswered = 1;
      ctx->keep_unanswered++;
    }
  }
  if (p->lk != l) { /* a push sent again on its connection is on the list already */
    p->lk = l;
    part_list_push(&l->inflight, p);
  }
  if (p->attempts++) __atomic_add_fetch(&ctx->resent, 1, __ATOMIC_RELAXED);
  p->sent = 1;
  p->write_done = 0;
  p->attempt_ms = 0;
  p->wpend++;
  int rc = ps__conn_send(l->conn, &p->hdr, p->send, p->nsend, on_write_done, p);
  if (rc != 0) {
    p->wpend--; /* nothing more in flight: the callback will not run */
    p->write_done = p->wpend == 0;
    /* A connection being closed: link_lost sends it again or fails it. */
    if (rc == PS_ERR_CLOSED && ps__part_may_resend(ctx, p, ps__now_ms())) return;
    part_list_remove(&l->inflight, p);
    p->lk = NULL;
    ps__part_fail(p, PS_ERR_UNAVAILABLE, ps_errmsg());
  }
}

/* ---- lent links
 *
 * A blocking data call whose servers' links are idle does its own socket I/O on the
 * caller's thread (ps__direct_run, below): one write and one wake-up when the reply
 * arrives, like a raw round trip, instead of crossing to the I/O thread and back.
 * The loop lends a link at an idle point (nothing in flight, queued, half read or
 * unsent) and stops reading it. Callers use lent links only while no request of the
 * context is running on the loop (ctx->outstanding == 0), so frames go out in the
 * order of the calls that made them. When the loop must send on a lent link it takes
 * it back: at once if no caller is using it, else when that caller is done
 * (want_back, then ps__mail_reclaim). A caller whose I/O failed mid-frame marks the link
 * broken: the loop closes that connection and opens a new one when next needed.
 * Lending state and the link list's structure are under ctx->lend_mu. */

/* Loop, lend_mu held. */
static void link_try_lend(peer *l) {
  if (l->lent || !l->lend_wanted || l->id == SCHED_LINK || !l->conn || !l->alive || l->inflight || l->queue_head)
    return;
  int fd = ps__conn_pause(l->conn);
  if (fd < 0) return;
  l->fd = fd;
  l->lent = 1;
  l->lend_wanted = 0;
}

static void mail_lend(void *arg) {
  ps_ctx *ctx = arg;
  pthread_mutex_lock(&ctx->lend_mu);
  ctx->lend_posted = 0;
  /* Under replicas a chain's tail may answer a push on its own link (PS_FLAG_TAIL): no
   * link is lent while a request runs on the loop. */
  if (__atomic_load_n(&ctx->replicas, __ATOMIC_RELAXED) < 2 || __atomic_load_n(&ctx->outstanding, __ATOMIC_ACQUIRE) == 0)
    for (peer *l = ctx->links; l; l = l->next) link_try_lend(l);
  pthread_cond_broadcast(&ctx->lend_cv);
  pthread_mutex_unlock(&ctx->lend_mu);
}

/* Loop: a link a caller gave back resumes on the loop (or is closed if broken). */
static void link_resume(peer *l) {
  if (!l->conn) return;
  size_t n = l->dlen - l->doff;
  int rc = l->broken || !l->alive ? PS_ERR_CLOSED : ps__conn_resume(l->conn, l->dbuf + l->doff, n);
  l->doff = l->dlen = 0;
  l->broken = 0;
  if (rc) {
    l->conn->udata = NULL;
    ps__conn_close(l->conn, PS_ERR_UNAVAILABLE);
    l->conn = NULL;
    l->lost = 1; /* a clock written by a caller may be lost with it */
  }
}


/* Send what waited for a link: on a new connection or on a link given back. */
static void link_flush(ps_ctx *ctx, peer *l) {
  if (!l->queue_head) return;
  if (!l->conn) {
    if (!l->connecting) link_connect(ctx, l);
    return;
  }
  while (l->queue_head) {
    part *p = l->queue_head;
    ps__link_dequeue(l, p);
    ps__part_send(ctx, l, p);
  }
}

/* Loop: l, no longer lent, is the loop's again: resume it and send what waited for it
 * (or fail that if its server left). */
static void link_fail_over(ps_ctx *ctx, peer *l, uint64_t epoch, const char *why);
static void link_returned(ps_ctx *ctx, peer *l) {
  link_resume(l);
  if (l->fail_over_due) {
    /* Its server left while a caller used it: what ps__on_membership left for now (the
     * parts sent again, the kept pushes and the REPLAYED list) happens here, even if a
     * replacement with its id came meanwhile. */
    char msg[96];
    snprintf(msg, sizeof msg, "server %u left the job", l->id);
    link_fail_over(ctx, l, l->left_epoch, msg);
  }
  if (l->alive)
    link_flush(ctx, l);
  else
    ps__link_fail_all(l, PS_ERR_UNAVAILABLE, "server left the job");
}

/* A lent link no caller is using can go back to the loop. lend_mu held. */
int ps__link_idle_lent(const peer *l) { return l->lent && !l->busy; }

/* Loop: take l back if it is lent; what waited for it goes first. Returns 1 when the
 * loop may send on l now; 0 when a caller is using it (it comes back through
 * ps__mail_reclaim) or its connection had to be closed. */
int ps__link_take(ps_ctx *ctx, peer *l) {
  int resume = 0, ok = 1;
  pthread_mutex_lock(&ctx->lend_mu);
  if (ps__link_idle_lent(l)) {
    l->lent = 0;
    l->want_back = 0;
    resume = 1;
  } else if (l->lent) {
    l->want_back = 1;
    ok = 0;
  }
  pthread_mutex_unlock(&ctx->lend_mu);
  if (resume) link_returned(ctx, l);
  return ok && l->conn != NULL;
}

void ps__mail_reclaim(void *arg) {
  ps_ctx *ctx = arg;
  for (peer *l = ctx->links; l; l = l->next) {
    int resume = 0;
    pthread_mutex_lock(&ctx->lend_mu);
    if (ps__link_idle_lent(l) && (l->want_back || l->broken || !l->alive)) {
      l->lent = 0;
      l->want_back = 0;
      resume = 1;
    }
    pthread_mutex_unlock(&ctx->lend_mu);
    if (resume) link_returned(ctx, l);
  }
}

/* The head of a replicated part's chain by the head rule (common/ring.h): its first
 * live member that was there before any replacement, else its live replacement that
 * holds a copy and was admitted first (0: none). */
uint32_t ps__part_head(ps_ctx *ctx, const part *p) {
  uint8_t st[PS_MAX_REPLICAS];
  uint32_t late[PS_MAX_REPLICAS];
  unsigned n = p->nchain < PS_MAX_REPLICAS ? p->nchain : PS_MAX_REPLICAS;
  for (unsigned k = 0; k < n; k++) {
    peer *l = ps__link_find(ctx, p->chain[k]);
    st[k] = l && l->alive ? ps__member_chain_state(&l->m) : PS_CHAIN_DEAD;
    late[k] = l ? l->m.late : 0;
  }
  int h = ps__chain_head(st, late, n);
  return h >= 0 ? p->chain[h] : 0;
}

#define REROUTE_WAIT_MS 50 /* a part refused by its chain's member waits this long */

static void part_delay(ps_ctx *ctx, part *p, uint64_t at) {
  p->retry_at_ms = at;
  p->queued = 2;
  p->prev = NULL;
  p->next = ctx->delayed;
  if (ctx->delayed) ctx->delayed->prev = p;
  ctx->delayed = p;
}

int ps__part_reroute(ps_ctx *ctx, part *p, int later) {
  uint64_t now = ps__now_ms();
  if ((p->nchain < 2 && !later) || !ps__part_may_resend(ctx, p, now)) return 0;
  p->sent = 0;
  p->reply_done = 0;
  if (p->wpend) {
    p->resend = 1; /* on_write_done sends it again, after the wait */
    return 1;
  }
  if (!later) {
    ps__part_submit(ctx, p);
    return 1;
  }
  part_delay(ctx, p, now + REROUTE_WAIT_MS);
  return 1;
}

/* Loop: the delayed parts due now go to their chain's head; late ones fail. */
static void delayed_sweep(ps_ctx *ctx, uint64_t now) {
  for (part *p = ctx->delayed, *next; p; p = next) {
    next = p->next;
    if (now < p->retry_at_ms && now < p->deadline_ms) continue;
    part_list_remove(&ctx->delayed, p);
    p->queued = 0;
    if (now >= p->deadline_ms)
      ps__part_fail(p, PS_ERR_TIMEOUT, "no copy of these keys answered before the deadline");
    else
      ps__part_submit(ctx, p);
  }
}

void ps__part_submit(ps_ctx *ctx, part *p) {
  /* A replicated pull sent before by peer memory: the member it went to may still write
   * into the caller's buffers (one written off while it stood still may resume, and
   * copy until the expiry). Sent again once it may not (it answered, its process is
   * gone, or the expiry and its slack passed), and inline. */
  if (ps__part_pull_lent(p)) {
    if (ps__vx_must_hold(&p->vx, 1, p->vx.until + PS_VX_SLACK_MS)) {
      part_delay(ctx, p, ps__now_ms() + REROUTE_WAIT_MS);
      return;
    }
    memset(&p->vx, 0, sizeof p->vx);
    p->vx.xport = p->hdr.xport = PS_XPORT_INLINE;
    p->nsend = 1; /* its segment list alone (route.c, dense_start) */
  }
  if (p->nchain > 1) {
    uint32_t head = ps__part_head(ctx, p);
    if (head) p->target = head;
  }
  peer *l = ps__link_find(ctx, p->target);
  if (!l || !l->alive) {
    if (p->nchain > 1) {
      char msg[160];
      snprintf(msg, sizeof msg, "every server holding a copy of these keys has left the job (their chain's head was server %u)",
               p->chain[0]);
      ps__part_fail(p, PS_ERR_UNAVAILABLE, msg);
      return;
    }
    char msg[160];
    snprintf(msg, sizeof msg, "server %u, which holds these keys, has left the job; without replicas its shard is lost",
             p->target);
    ps__part_fail(p, PS_ERR_UNAVAILABLE, msg);
    return;
  }
  if (l->conn && ps__link_take(ctx, l)) {
    ps__part_send(ctx, l, p);
    return;
  }
  p->queued = 1;
  p->prev = l->queue_tail;
  p->next = NULL;
  if (l->queue_tail)
    l->queue_tail->next = p;
  else
    l->queue_head = p;
  l->queue_tail = p;
  if (!l->conn && !l->connecting) link_connect(ctx, l);
}

static int link_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b);
static void link_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b);
static void link_on_close(ps__conn *c, int status);
static const ps__conn_ops link_ops = {link_on_header, link_on_frame, link_on_close};

typedef struct conn_arg {
  ps_ctx *ctx;
  uint32_t id;
} conn_arg;

static void on_link_connected(void *arg, ps__conn *c, int status) {
  conn_arg *ca = arg;
  ps_ctx *ctx = ca->ctx;
  peer *l = ps__link_find(ctx, ca->id);
  free(ca);
  if (!l) {
    if (c) ps__conn_close(c, 0);
    return;
  }
  l->connecting = 0;
  if (status || !c) {
    char msg[160];
    snprintf(msg, sizeof msg, "cannot connect to server %u at %s:%u: %s", l->id, l->m.host, l->m.port,
             ps_strerror(status));
    /* What may be sent again waits for another try (the sweep), until its deadline. */
    uint64_t now = ps__now_ms();
    for (part *p = l->queue_head; p;) {
      part *next = p->next;
      if (!l->alive || !ps__part_may_resend(ctx, p, now)) {
        ps__link_dequeue(l, p);
        ps__part_fail(p, PS_ERR_UNAVAILABLE, msg);
      }
      p = next;
    }
    if (l->queue_head) l->reconnect_ms = now + RECONNECT_MS;
    return;
  }
  if (!l->alive || ctx->closing) {
    ps__conn_close(c, 0);
    ps__link_fail_all(l, PS_ERR_UNAVAILABLE, "server left the job");
    return;
  }
  c->udata = l;
  l->conn = c;
  /* Peer memory where this worker allows it and the connection and the server do. */
  __atomic_store_n(&l->pm, ctx->peer_mem ? ps__vx_link_peer(c, l->m.caps) : 0, __ATOMIC_RELAXED);
  link_flush(ctx, l);
  int64_t clk = __atomic_load_n(&ctx->clock_sent, __ATOMIC_RELAXED);
  if (l->lost && clk > 0 && l->conn) {
    /* After what is sent again: a CLOCK lost with the old connection would hold a sync
     * round forever; a repeated one changes nothing (the server keeps the larger). */
    ps__frame_hdr h = {.type = PS_MSG_CLOCK, .clock = clk, .sender = ctx->id};
    ps__conn_send_ctrl(l->conn, &h, NULL, 0);
  }
  l->lost = 0;
}

static void link_connect(ps_ctx *ctx, peer *l) {
  /* The scheduler link sends on the node agent's connection: while that is down (the
   * scheduler restarts) its parts wait in its queue, until the agent is taken back
   * (ps__sched_flush), their deadline, or the agent gives up (ps__sched_fail). */
  if (l->id == SCHED_LINK) return;
  conn_arg *ca = ps__malloc(sizeof *ca);
  int rc;
  if (!ca) {
    ps__link_fail_all(l, PS_ERR_NOMEM, "out of memory");
    return;
  }
  ca->ctx = ctx;
  ca->id = l->id;
  l->connecting = 1;
  if (ctx->use_unix && l->m.unix_path[0] && !strcmp(l->m.hostid, ctx->hostid))
    rc = ps__connect_unix(&ctx->loop, l->m.unix_path, &link_ops, NULL, ctx->pool, ctx->max_payload, on_link_connected, ca);
  else
    rc = ps__connect_tcp(&ctx->loop, l->m.host, l->m.port, &link_ops, NULL, ctx->pool, ctx->max_payload,
                         on_link_connected, ca);
  if (rc) {
    free(ca);
    l->connecting = 0;
    ps__link_fail_all(l, rc, ps_errmsg());
  }
}

static part *inflight_find(peer *l, uint64_t req_id) {
  for (part *p = l->inflight; p; p = p->next)
    if (p->hdr.req_id == req_id) return p;
  return NULL;
}

#define FAIL_OVER_YIELD_MS 10000 /* how long callers give back links the loop wants after a death */

/* Membership from the scheduler (through the node agent): links for new servers,
 * dead servers' links failed and closed, counts and the ring of a newer epoch. */
/* Server l left the job: its replicated parts go to their chains' next live member at
 * once (the windows of shard/once.h apply a push there once, should l have forwarded
 * it already); the others fail. epoch: the membership's that said so. */
static void link_fail_over(ps_ctx *ctx, peer *l, uint64_t epoch, const char *why) {
  l->fail_over_due = 0;
  /* What follows (parts sent again, kept pushes, the REPLAYED list) goes on links a
   * caller may hold, in a call that waits for the new heads, which wait for it. */
  __atomic_store_n(&ctx->yield_until_ms, ps__now_ms() + FAIL_OVER_YIELD_MS, __ATOMIC_RELAXED);
  /* The survivors may hear of the death after this worker: its CLOCKs wait for its
   * pushes to replicated sync tables to be answered for a while (ps__mail_fire). */
  ctx->clock_guard_ms = ps__now_ms() + CLOCK_GUARD_MS;
  /* The pushes to replicated sync tables among them: the new heads wait for them. */
  size_t nkeep = 0, ki = 0;
  for (part *p = l->queue_head; p; p = p->next) nkeep += p->keep && ps__frame_is_push_req(p->hdr.type);
  for (part *p = l->inflight; p; p = p->next) nkeep += p->keep && ps__frame_is_push_req(p->hdr.type);
  part **keeps = nkeep ? ps__malloc(nkeep * sizeof *keeps) : NULL;
  for (part *p = l->queue_head; keeps && p; p = p->next)
    if (p->keep && ps__frame_is_push_req(p->hdr.type)) keeps[ki++] = p;
  for (part *p = l->inflight; keeps && p; p = p->next)
    if (p->keep && ps__frame_is_push_req(p->hdr.type)) keeps[ki++] = p;
  part *moved = NULL;
  while (l->queue_head) {
    part *p = l->queue_head;
    ps__link_dequeue(l, p);
    if (p->nchain > 1) {
      p->next = moved;
      moved = p;
    } else {
      ps__part_fail(p, PS_ERR_UNAVAILABLE, why);
    }
  }
  while (l->inflight) {
    part *p = l->inflight;
    part_list_remove(&l->inflight, p);
    p->lk = NULL;
    if (p->nchain > 1 && p->wpend) {
      p->resend = 1; /* on_write_done submits it, to the new head */
    } else if (p->nchain > 1) {
      p->next = moved;
      moved = p;
    } else {
      ps__part_fail(p, PS_ERR_UNAVAILABLE, why);
    }
  }
  l->reading = NULL;
  size_t n = 0;
  for (part *p = moved; p; p = p->next) n++;
  part **v = n ? ps__malloc(n * sizeof *v) : NULL;
  size_t k = 0;
  for (part *p = moved, *next; p; p = next) {
    next = p->next;
    p->next = p->prev = NULL;
    if (v) v[k++] = p;
    else ps__part_fail(p, PS_ERR_NOMEM, "out of memory");
  }
  if (k) qsort(v, k, sizeof *v, by_req_id); /* in the order they were made */
  for (size_t i = 0; i < k; i++)
    if (!ps__part_reroute(ctx, v[i], 0)) ps__part_fail(v[i], PS_ERR_UNAVAILABLE, why);
  if (k) ps__log(PS_LOG_WARN, "%s; sending %zu request%s to the next copy", why, k, k == 1 ? "" : "s");
  free(v);
  /* (the parts' headers are read before any of them could finish: on this thread) */
  ps__keep_fail_over(ctx, l->id, epoch, keeps, ki);
  free(keeps);
}

void ps__on_membership(ps_ctx *ctx, const ps__membership *mp) {
  const ps__membership m = *mp;
  uint32_t *ids = ps__calloc(m.n ? m.n : 1, sizeof *ids);
  size_t nsrv = 0, nalive = 0;
  int nwork = 0;
  if (!ids) return;
  for (uint32_t i = 0; i < m.n; i++) {
    ps__member *x = &m.m[i];
    if (x->role == PS_ROLE_WORKER && x->alive) nwork++;
    if (x->role != PS_ROLE_SERVER) continue;
    peer *l = ps__link_find(ctx, x->id);
    if (!l && x->alive) {
      l = ps__calloc(1, sizeof *l);
      if (!l) continue;
      l->id = x->id;
      l->fd = -1;
      pthread_mutex_lock(&ctx->lend_mu); /* callers walk the list */
      l->next = ctx->links->next; /* keep the scheduler link first */
      ctx->links->next = l;
      pthread_mutex_unlock(&ctx->lend_mu);
    }
    /* The ring keeps servers that died: without replication their shards are lost,
     * and requests for those keys must fail (PS_ERR_UNAVAILABLE) rather than move to a
     * survivor that would silently recreate them from the initialiser. */
    ids[nsrv++] = x->id;
    if (x->alive) nalive++;
    if (!l) continue;
    l->m = *x;
    if (x->alive) {
      if (!l->alive) l->lost = 1; /* a replacement of a dead server: it missed our CLOCKs, sent on connecting */
      l->alive = 1;
    } else if (l->alive) {
      pthread_mutex_lock(&ctx->lend_mu);
      l->alive = 0; /* a caller using the link finishes first; ps__mail_reclaim closes it */
      int in_use = l->lent && l->busy;
      if (ps__link_idle_lent(l)) l->lent = 0;
      pthread_mutex_unlock(&ctx->lend_mu);
      if (in_use) { /* when the caller gives it back (link_returned) */
        l->fail_over_due = 1;
        l->left_epoch = m.epoch;
        continue;
      }
      char msg[96];
      snprintf(msg, sizeof msg, "server %u left the job", x->id);
      link_fail_over(ctx, l, m.epoch, msg);
      if (l->conn) {
        l->conn->udata = NULL;
        ps__conn_close(l->conn, 0);
        l->conn = NULL;
      }
    }
  }
  ps__ring *ring = nsrv ? ps__ring_new(ids, nsrv, ctx->vnodes, m.epoch) : NULL;
  free(ids);
  if (ring && ps__ring_set_replicas(ring, m.replicas)) {
    ps__ring_free(ring);
    ring = NULL;
  }
  pthread_mutex_lock(&ctx->mu);
  if (m.epoch >= ctx->epoch) {
    ctx->epoch = m.epoch;
    __atomic_store_n(&ctx->replicas, m.replicas ? m.replicas : 1, __ATOMIC_RELAXED);
    ctx->started = m.started;
    ctx->nworkers = nwork;
    ctx->nservers = (int)nalive;
    if (ring) {
      ps__ring **rt = ps__realloc(ctx->retired, (ctx->nretired + 1) * sizeof *rt);
      if (rt) {
        ctx->retired = rt;
        if (ctx->ring) ctx->retired[ctx->nretired++] = ctx->ring;
        ctx->ring = ring;
        ring = NULL;
      }
    }
  }
  pthread_cond_broadcast(&ctx->cv);
  pthread_mutex_unlock(&ctx->mu);
  ps__ring_free(ring);
}

/* A replicated pull by peer memory that a call gave back with its link after a death
 * (direct.c, direct_yield) waits on ctx->delayed for its server to answer or expire
 * (ps__part_submit): that server's answer, when it comes on l, is the pull's answer. */
static part *lent_pull_adopt(ps_ctx *ctx, peer *l, uint64_t req_id) {
  int pid = __atomic_load_n(&l->pm, __ATOMIC_RELAXED);
  part *p = ctx->delayed;
  while (p && !(p->hdr.req_id == req_id && ps__part_pull_lent(p) && pid && p->vx.pid == pid)) p = p->next;
  if (!p) return NULL;
  part_list_remove(&ctx->delayed, p);
  p->queued = 0;
  p->sent = p->write_done = 1; /* written whole before the call gave its link back */
  p->lk = l;
  part_list_push(&l->inflight, p);
  return p;
}

/* A reply's header on link l: find its part and where its body goes. */
static int link_header(ps_ctx *ctx, peer *l, const ps__frame_hdr *h, ps__body *b) {
  if (h->type == PS_MSG_ERROR) return 0;
  if (!(h->type & PS_FRAME_REPLY)) return ps__fail(PS_ERR_PROTO, "unexpected %s request", ps__frame_type_name(h->type));
  part *p = inflight_find(l, h->req_id);
  if (!p && ps__frame_is_tail_answer(h)) {
    /* A replicated push answered by its chain's tail: the request is among those sent
     * to the chain's head (batch), unless it has been sent elsewhere since. */
    peer *hl = ps__link_find(ctx, h->batch);
    p = hl ? inflight_find(hl, h->req_id) : NULL;
  }
  if (!p) p = lent_pull_adopt(ctx, l, h->req_id);
  if (!p || p->reply_done) {
    b->discard = 1; /* a reply to a canceled or timed-out request */
    return 0;
  }
  /* A pull's values: in the body (read straight into the destination), or already
   * written by the server (peer memory). */
  int written = 0, bad = 0;
  if (h->status == 0 && p->recv && (bad = ps__cx_reply_check(p, h) ? PS_ERR_PROTO
                                          : ps__vx_reply(&p->vx, h, p->recv_len, &written) ? PS_ERR_SIZE : 0)) {
    p->vx.answered = 1;
    part_list_remove(&l->inflight, p);
    p->lk = NULL;
    ps__part_fail(p, bad, ps_errmsg());
    b->discard = 1;
    return 0;
  }
  if (h->status == 0 && p->recv && !written) {
    b->iov = p->recv;
    b->niov = p->nrecv;
    l->reading = p;
  }
  b->udata = p;
  return 0;
}

static int link_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  peer *l = c->udata;
  if (!l) {
    b->discard = 1;
    return 0;
  }
  return link_header(c->loop->data, l, h, b);
}

int ps__sched_on_header(void *arg, const ps__frame_hdr *h, ps__body *b) {
  ps_ctx *ctx = arg;
  return link_header(ctx, ctx->sched, h, b);
}

/* A successful reply to p (loop or lent link): what it tells the context. */
void ps__part_reply_ok(ps_ctx *ctx, part *p, const ps__frame_hdr *h) {
  p->reply_table = h->table;
  p->reply_clock = h->clock;
  uint8_t t = h->type & (uint8_t)~PS_FRAME_REPLY;
  ps__tcount *tc = p->req->tc; /* set only for pulls and pushes, when counting */
  if (tc) __atomic_add_fetch(&tc->received, 1, __ATOMIC_RELAXED);
  if (t == PS_MSG_PULL || t == PS_MSG_PULL_DENSE) {
    /* A worker behind the table's applied rounds (sync:M straggler, late joiner)
     * resumes at the round the servers are at. */
    int64_t cur = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED);
    while (h->clock > cur && !__atomic_compare_exchange_n(&ctx->clock, &cur, h->clock, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    if (h->clock > cur) __atomic_add_fetch(&ctx->fast_forwards, 1, __ATOMIC_RELAXED);
    if (ctx->count) {
      uint64_t n = ps__vx_written(&p->vx, h) ? p->recv_len : h->payload_len;
      __atomic_add_fetch(&ctx->bytes_pulled, n, __ATOMIC_RELAXED);
      if (tc) __atomic_add_fetch(&tc->pulled_bytes, n, __ATOMIC_RELAXED);
    }
    if (p->keep) ps__keep_pull(ctx, p, h);
  } else if (t == PS_MSG_PUSH || t == PS_MSG_PUSH_DENSE) {
    /* One push goes to every server as one part each: count the push, not its parts. */
    if ((h->flags & PS_FLAG_DROPPED) && !__atomic_exchange_n(&p->req->dropped, 1, __ATOMIC_RELAXED))
      __atomic_add_fetch(&ctx->dropped_pushes, 1, __ATOMIC_RELAXED);
    if (p->keep) ps__keep_push(ctx, p, h);
  }
}

/* Ask the loop to lend idle links that callers want (from any thread). */
void ps__post_lend(ps_ctx *ctx) {
  int post = 0;
  pthread_mutex_lock(&ctx->lend_mu);
  if (!ctx->lend_posted) ctx->lend_posted = post = 1;
  pthread_mutex_unlock(&ctx->lend_mu);
  if (post && ps__mailbox_post(ctx->mail, mail_lend, ctx) != 0) {
    pthread_mutex_lock(&ctx->lend_mu);
    ctx->lend_posted = 0;
    pthread_mutex_unlock(&ctx->lend_mu);
  }
}

/* A whole reply arrived on link l: finish its part. */
static void link_frame(ps_ctx *ctx, peer *l, const ps__frame_hdr *h, ps__body *b) {
  if (h->type == PS_MSG_ERROR) {
    ps__log(PS_LOG_ERROR, "node %u: %.*s", l->id, (int)b->len, b->buf ? (const char *)b->buf : "");
    return;
  }
  part *p = b->udata;
  l->reading = NULL;
  if (!p) return;
  p->vx.answered = 1;
  if (p->lk) part_list_remove(&p->lk->inflight, p); /* l, or the head's link for a tail's answer */
  p->lk = NULL;
  if (h->status) {
    char msg[300];
    snprintf(msg, sizeof msg, "%.*s", (int)(b->len < 256 ? b->len : 256), b->buf ? (const char *)b->buf : "");
    /* A member of a chain that is not its head (yet: its membership is behind ours; or
     * any more), or one that could not reach the next copy: after a short wait, the
     * chain's head under the membership then. */
    /* A server not ready for it (its registration unanswered, it stood still) says
     * UNAVAILABLE: sent again after the same wait, replicated or not. */
    if ((h->status == PS_ERR_UNAVAILABLE || (h->status == PS_ERR_MOVED && p->nchain > 1)) && ps__part_reroute(ctx, p, 1)) {
      if (p->unanswered) ctx->clock_guard_ms = ps__now_ms() + CLOCK_GUARD_MS; /* memberships disagree */
      return;
    }
    ps__part_fail(p, h->status, msg[0] ? msg : ps_strerror(h->status));
    return;
  }
  ps__part_reply_ok(ctx, p, h);
  if (l->lend_wanted && !l->inflight && !l->queue_head) ps__post_lend(ctx);
  if (p->stats_buf) {
    size_t n = b->len < p->stats_cap - 1 ? b->len : p->stats_cap - 1;
    p->stats_len = b->len;
    if (n) memcpy(p->stats_buf, b->buf, n);
    p->stats_buf[n] = '\0';
  }
  p->reply_done = 1;
  if (p->write_done) ps__part_finish(p);
}

static void link_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  peer *l = c->udata;
  if (l) link_frame(c->loop->data, l, h, b);
}

void ps__sched_on_frame(void *arg, const ps__frame_hdr *h, ps__body *b) {
  ps_ctx *ctx = arg;
  link_frame(ctx, ctx->sched, h, b);
}

/* Link l's connection is gone: send again or fail what it holds. */
static void link_closed(ps_ctx *ctx, peer *l, int status) {
  /* The server closed the connection (or died): it no longer serves any frame of it,
   * so its peer-memory parts need not be held (ps__part_finish). */
  if (status == PS_ERR_CLOSED)
    for (part *p = l->inflight; p; p = p->next) p->vx.answered = 1;
  l->conn = NULL;
  __atomic_store_n(&l->pm, 0, __ATOMIC_RELAXED);
  char msg[160];
  snprintf(msg, sizeof msg, "connection to %s %u closed: %s", l->id == SCHED_LINK ? "scheduler" : "server", l->id,
           ps_strerror(status));
  ps__link_lost(ctx, l, status ? PS_ERR_UNAVAILABLE : PS_ERR_CANCELED, msg);
}

static void link_on_close(ps__conn *c, int status) {
  peer *l = c->udata;
  if (l) link_closed(c->loop->data, l, status);
}

void ps__sched_flush(ps_ctx *ctx) { link_flush(ctx, ctx->sched); }

void ps__sched_fail(ps_ctx *ctx, int status, const char *why) { ps__link_fail_all(ctx->sched, status, why); }

/* The node agent's scheduler connection came up (c) or went away (NULL): the
 * scheduler link sends on it; the parts it carried fail with it (the agent reports
 * the loss), and those made later wait for the next one (link_connect). */
void ps__sched_on_link(void *arg, ps__conn *c, int status) {
  ps_ctx *ctx = arg;
  if (c)
    ctx->sched->conn = c;
  else if (ctx->sched->conn)
    link_closed(ctx, ctx->sched, status);
}
