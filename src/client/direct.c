/*
 * direct.c - the caller-thread fast path: blocking calls on lent links.
 *
 * A blocking data call whose servers' links are idle does its own socket I/O on the
 * caller's thread: one write and one wake-up when the reply arrives, like a raw round
 * trip, instead of crossing to the I/O thread and back. The loop lends idle links
 * (link.c); this file claims them, writes the frames with sendmsg, reads the replies
 * with recv/readv (straight into the destination for large bodies), and gives the
 * links back. Runs only on callers' threads; the lending state is under ctx->lend_mu.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "client/client_int.h"

/* ---- caller-side I/O on lent links (see "lent links" above) */

#define DBUF_CAP (64u * 1024u)      /* a borrower's read buffer */
#define DIRECT_READ_MIN (16u * 1024u) /* body bytes read straight into the destination */
#define DL_MAXPARTS 2               /* parts of one call on one link (push + pull) */

typedef struct dcall dcall;

typedef struct dlink {
  peer *l;
  int fd;
  dcall *call;                  /* the call it serves */
  int listen;                   /* read for the whole call: a chain's tail may answer a
                                 * part of another link on it (PS_FLAG_TAIL) */
  part *parts[DL_MAXPARTS];
  unsigned nparts, pending;     /* parts on this link; replies still awaited */
  uint8_t hdrs[DL_MAXPARTS][PS_FRAME_HDR_SIZE];
  struct iovec *iov;            /* what is left to write: iov_small or allocated */
  struct iovec iov_small[8];
  unsigned niov, iov_at;
  /* the frame being read */
  int in_body, discard;
  ps__frame_hdr cur;
  part *cur_p;
  struct dlink *cur_owner;      /* the link cur_p was sent on (this one, or its head's) */
  const uv_buf_t *dst;
  unsigned ndst, dst_i;
  size_t dst_off;
  uint64_t left;
  uv_buf_t errbuf;
  char errtxt[512];
  int failed;                   /* a mid-frame failure: the link is broken */
  int released;                 /* given back before the call ended (its server left) */
  uint64_t moved;               /* bytes written and read so far (progress) */
} dlink;

/* The links of one call: a tail's answer may come on another link than its part's. */
struct dcall {
  dlink *dl;
  unsigned n;
  unsigned left; /* replies still awaited on all of them */
};

/* May a caller claim lent link l now? lend_mu held. */
static int link_claimable(const peer *l) { return ps__link_idle_lent(l) && !l->want_back && !l->broken; }

static void dl_init(dlink *d, peer *l) {
  memset(d, 0, sizeof *d);
  d->l = l;
  d->fd = l->fd;
}

/* Account n bytes just placed into the current destination. */
static void dl_advance(dlink *d, size_t n) {
  d->left -= n;
  if (d->discard) return;
  d->dst_off += n;
  while (d->dst_i < d->ndst && d->dst_off >= d->dst[d->dst_i].len) {
    d->dst_off -= d->dst[d->dst_i].len;
    d->dst_i++;
  }
}

/* Copy up to n staged bytes into the current body. Returns bytes used. */
static size_t dl_fill(dlink *d, const uint8_t *src, size_t n) {
  size_t used = 0;
  while (used < n && d->left > 0) {
    size_t take = n - used;
    if (take > d->left) take = (size_t)d->left;
    if (!d->discard) {
      const uv_buf_t *b = &d->dst[d->dst_i];
      if (take > b->len - d->dst_off) take = b->len - d->dst_off;
      memcpy(b->base + d->dst_off, src + used, take);
    }
    dl_advance(d, take);
    used += take;
  }
  return used;
}

/* A whole reply frame arrived on d. */
static void dl_frame_done(ps_ctx *ctx, dlink *d) {
  part *p = d->cur_p;
  d->in_body = 0;
  if (!p) return; /* a late reply to an earlier call, or an error notice */
  d->cur_owner->pending--;
  d->call->left--;
  p->reply_done = 1;
  p->vx.answered = 1;
  if (d->cur.status) {
    size_t n = d->cur.payload_len < sizeof d->errtxt - 1 ? (size_t)d->cur.payload_len : sizeof d->errtxt - 1;
    d->errtxt[n] = '\0';
    /* A member that is not its chain's head (any more), or could not reach the next
     * copy: the loop sends the part to the head under its membership then; a server
     * not ready for it (UNAVAILABLE): the loop sends it there again after a wait. */
    if ((d->cur.status == PS_ERR_MOVED && p->nchain > 1) || d->cur.status == PS_ERR_UNAVAILABLE) {
      p->reply_done = 0;
      if (ps__part_may_resend(ctx, p, ps__now_ms())) {
        p->again = 1;
        return;
      }
      p->reply_done = 1;
    }
    ps__req_set_error(p->req, d->cur.status, n ? d->errtxt : ps_strerror(d->cur.status));
    return;
  }
  if (p->status == 0) ps__part_reply_ok(ctx, p, &d->cur);
}

/* Start reading the body of d->cur: pick its destination. 0, or a ps_err code. */
static int dl_begin(dlink *d) {
  const ps__frame_hdr *h = &d->cur;
  d->cur_p = NULL;
  d->discard = 1;
  d->dst = NULL;
  d->ndst = d->dst_i = 0;
  d->dst_off = 0;
  d->left = h->payload_len;
  d->in_body = 1;
  if (h->type == PS_MSG_ERROR) {
    ps__log(PS_LOG_WARN, "server %u sent an error notice on a lent link", d->l->id);
    return PS_ERR_CLOSED; /* the server is about to close this connection */
  }
  if (!(h->type & PS_FRAME_REPLY)) return ps__fail(PS_ERR_PROTO, "unexpected %s request from server %u", ps__frame_type_name(h->type), d->l->id);
  part *p = NULL;
  dlink *owner = d;
  for (unsigned i = 0; i < d->nparts; i++)
    if (d->parts[i]->hdr.req_id == h->req_id && !d->parts[i]->reply_done && !d->parts[i]->again) p = d->parts[i];
  if (!p && ps__frame_is_tail_answer(h))
    for (unsigned j = 0; j < d->call->n && !p; j++) { /* a chain's tail answering for its head (batch) */
      dlink *o = &d->call->dl[j];
      for (unsigned i = 0; o->l->id == h->batch && i < o->nparts; i++)
        if (o->parts[i]->hdr.req_id == h->req_id && !o->parts[i]->reply_done && !o->parts[i]->again)
          p = o->parts[i], owner = o;
    }
  if (!p) return 0; /* a reply to an earlier call that timed out: dropped */
  d->cur_p = p;
  d->cur_owner = owner;
  if (h->status) {
    d->errbuf = uv_buf_init(d->errtxt, sizeof d->errtxt - 1);
    if (h->payload_len <= d->errbuf.len) {
      d->errbuf.len = (size_t)h->payload_len;
      d->dst = &d->errbuf;
      d->ndst = 1;
      d->discard = 0;
    }
    return 0;
  }
  /* A pull's values: in the body, or already written by the server (net/xport.h). */
  int written = 0;
  if (p->recv && ps__cx_reply_check(p, h)) {
    ps__req_set_error(p->req, PS_ERR_PROTO, ps_errmsg());
    p->status = PS_ERR_PROTO;
    return 0;
  }
  if (p->recv && ps__vx_reply(&p->vx, h, p->recv_len, &written)) {
    ps__req_set_error(p->req, PS_ERR_SIZE, ps_errmsg());
    p->status = PS_ERR_SIZE;
    return 0;
  }
  if (p->recv && !written) {
    d->dst = p->recv;
    d->ndst = p->nrecv;
    d->discard = 0;
    while (d->dst_i < d->ndst && d->dst[d->dst_i].len == 0) d->dst_i++;
  }
  return 0;
}

/* A read that returned got <= 0: 0 if nothing is there yet, else the link's error. */
static int dl_read_end(const peer *l, ssize_t got) {
  if (got == 0) return ps__fail(PS_ERR_CLOSED, "server %u closed the connection", l->id);
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
  if (errno == ECONNRESET) return ps__fail(PS_ERR_CLOSED, "server %u reset the connection", l->id);
  return ps__fail(PS_ERR_IO, "reading from server %u: %s", l->id, strerror(errno));
}

/* Read what is available on d. 0 (progress or nothing to read yet), or a ps_err code
 * for a link that cannot go on (closed, protocol violation). */
static int dl_read(ps_ctx *ctx, dlink *d) {
  peer *l = d->l;
  while (d->pending > 0 || (d->listen && d->call->left > 0)) {
    size_t avail = l->dlen - l->doff;
    if (d->in_body) {
      if (avail) l->doff += dl_fill(d, l->dbuf + l->doff, avail);
      if (d->left == 0) {
        dl_frame_done(ctx, d);
        continue;
      }
      if (!d->discard && d->left >= DIRECT_READ_MIN) {
        /* Large remainder: straight into the destination. */
        struct iovec v[16];
        int nv = 0;
        uint64_t want = d->left;
        size_t off = d->dst_off;
        for (unsigned i = d->dst_i; i < d->ndst && nv < 16 && want; i++) {
          size_t n = d->dst[i].len - off;
          if (n > want) n = (size_t)want;
          v[nv].iov_base = d->dst[i].base + off;
          v[nv++].iov_len = n;
          want -= n;
          off = 0;
        }
        ssize_t got = readv(d->fd, v, nv);
        if (got <= 0) return dl_read_end(l, got);
        dl_advance(d, (size_t)got);
        d->moved += (uint64_t)got;
        continue;
      }
    } else if (avail >= PS_FRAME_HDR_SIZE) {
      int rc = ps__frame_decode(l->dbuf + l->doff, ctx->max_payload, &d->cur);
      if (rc) return rc;
      l->doff += PS_FRAME_HDR_SIZE;
      if ((rc = dl_begin(d))) return rc;
      continue;
    }
    /* Need more bytes in the buffer. */
    if (l->doff == l->dlen) l->doff = l->dlen = 0;
    if (l->dlen == DBUF_CAP) {
      memmove(l->dbuf, l->dbuf + l->doff, l->dlen - l->doff);
      l->dlen -= l->doff;
      l->doff = 0;
    }
    ssize_t got = recv(d->fd, l->dbuf + l->dlen, DBUF_CAP - l->dlen, MSG_DONTWAIT);
    if (got <= 0) return dl_read_end(l, got);
    l->dlen += (size_t)got;
    d->moved += (uint64_t)got;
  }
  return 0;
}

/* Write what the socket takes. 0, or a ps_err code. */
static int dl_write(dlink *d) {
  while (d->iov_at < d->niov) {
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = d->iov + d->iov_at;
    unsigned n = d->niov - d->iov_at;
    mh.msg_iovlen = n > 512 ? 512 : n;
    ssize_t put = sendmsg(d->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (put < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
      if (errno == EPIPE || errno == ECONNRESET)
        return ps__fail(PS_ERR_CLOSED, "server %u closed the connection (sending: %s)", d->l->id, strerror(errno));
      return ps__fail(PS_ERR_UNAVAILABLE, "sending to server %u: %s", d->l->id, strerror(errno));
    }
    size_t k = (size_t)put;
    d->moved += (uint64_t)put;
    while (k && d->iov_at < d->niov) {
      struct iovec *v = &d->iov[d->iov_at];
      if (k >= v->iov_len) {
        k -= v->iov_len;
        d->iov_at++;
      } else {
        v->iov_base = (char *)v->iov_base + k;
        v->iov_len -= k;
        k = 0;
      }
    }
    while (d->iov_at < d->niov && d->iov[d->iov_at].iov_len == 0) d->iov_at++;
  }
  return 0;
}

/* A replicated push may be answered by its chain's tail (PS_FLAG_TAIL) when this call
 * reads every other member's link: those it can claim are claimed as listening links
 * of the call (lend_mu held). Else the head answers it, on its own link. */
static int claim_listeners(ps_ctx *ctx, part *p, dlink *dl, unsigned *n, unsigned max) {
  int want = 0;
  int all = p->nchain > 1 && ps__frame_is_push_req(p->hdr.type);
  for (unsigned k = 0; all && k < p->nchain && k < PS_MAX_REPLICAS; k++) {
    uint32_t id = p->chain[k];
    unsigned j = 0;
    while (j < *n && dl[j].l->id != id) j++;
    if (j < *n) { /* claimed already (the head's, or another part's): it reads for the call */
      dl[j].listen = 1;
      continue;
    }
    peer *m = ps__link_find(ctx, id);
    if (!m || !m->alive || !m->conn) continue; /* no connection: no answer on it */
    if (*n == max || !link_claimable(m) || (!m->dbuf && !(m->dbuf = ps__malloc(DBUF_CAP)))) {
      if (!m->lent) m->lend_wanted = want = 1; /* for the next call */
      all = 0;
      break;
    }
    dl_init(&dl[*n], m);
    dl[(*n)++].listen = 1;
  }
  if (all)
    p->hdr.flags |= PS_FLAG_TAIL;
  else
    p->hdr.flags &= (uint8_t)~PS_FLAG_TAIL;
  return want;
}

/* Claim the lent links of every part of reqs[] for this thread. Returns the number of
 * links claimed into dl[] (parts grouped per link), or 0 when the call must go through
 * the loop (then links that could be lent are asked for). */
static unsigned direct_claim(ps_ctx *ctx, ps_req **reqs, unsigned nreqs, dlink *dl, unsigned max) {
  for (int attempt = 0;; attempt++) {
    unsigned n = 0;
    int ok = 1, ask = 0, want_listen = 0;
    if (__atomic_load_n(&ctx->outstanding, __ATOMIC_ACQUIRE) != 0) return 0;
    pthread_mutex_lock(&ctx->lend_mu);
    int fatal = 0;
    for (unsigned q = 0; q < nreqs && !fatal; q++) {
      for (unsigned i = 0; i < reqs[q]->nparts && !fatal; i++) {
        part *p = &reqs[q]->parts[i];
        unsigned j = 0;
        while (j < n && dl[j].l->id != p->target) j++;
        if (j == n) {
          peer *l = ps__link_find(ctx, p->target);
          if (!l || l->id == SCHED_LINK || !l->alive || n == max) {
            ok = 0;
            fatal = 1;
            break;
          }
          if (!link_claimable(l)) {
            /* Keep going: every link this call needs is asked for at once. */
            if (!l->lent && l->conn) l->lend_wanted = ask = 1;
            ok = 0;
            continue;
          }
          if (!l->dbuf && !(l->dbuf = ps__malloc(DBUF_CAP))) {
            ok = 0;
            fatal = 1;
            break;
          }
          dl_init(&dl[n++], l);
        }
        if (dl[j].nparts == DL_MAXPARTS) {
          ok = 0;
          fatal = 1;
          break;
        }
        dl[j].parts[dl[j].nparts++] = p;
        if (ok) want_listen |= claim_listeners(ctx, p, dl, &n, max);
      }
    }
    /* Re-check under the lock: a request posted meanwhile keeps its place in line. */
    if (ok && __atomic_load_n(&ctx->outstanding, __ATOMIC_ACQUIRE) != 0) ok = 0;
    if (ok)
      for (unsigned j = 0; j < n; j++) dl[j].l->busy = 1;
    pthread_mutex_unlock(&ctx->lend_mu);
    if (want_listen) ps__post_lend(ctx); /* listening links for the next call */
    if (ok) return n;
    if (!ask || fatal || attempt > 0) return 0;
    /* Connected links that are not lent yet: ask the loop and wait for its answer (one
     * loop wake-up). Going through the loop instead would take the links back at once. */
    ps__post_lend(ctx);
    struct timespec ts = ps__abs_after_ms(5);
    pthread_mutex_lock(&ctx->lend_mu);
    while (ctx->lend_posted)
      if (pthread_cond_timedwait(&ctx->lend_cv, &ctx->lend_mu, &ts) != 0) break;
    pthread_mutex_unlock(&ctx->lend_mu);
  }
}

/* Give claimed links back; one that failed mid-frame is broken (the loop closes it). */
static void direct_release(ps_ctx *ctx, dlink *dl, unsigned n) {
  int post = 0;
  pthread_mutex_lock(&ctx->lend_mu);
  for (unsigned j = 0; j < n; j++) {
    peer *l = dl[j].l;
    if (dl[j].released) continue;
    l->busy = 0;
    if (dl[j].failed) l->broken = 1;
    if (l->want_back || l->broken || !l->alive) post = 1;
  }
  pthread_mutex_unlock(&ctx->lend_mu);
  if (post) ps__mailbox_post(ctx->mail, ps__mail_reclaim, ctx);
}

/* How often a call with replicated parts looks for servers written off. */
#define DIRECT_ALIVE_MS 10

/* lend_mu held: the call gives link d back to the loop before it ends; its unanswered
 * parts are to be sent again through the loop, and the call uses it no more (broken: the
 * loop closes its stream). */
static void dl_give_back(dlink *d, dcall *call, int broken) {
  if (d->iov && !d->failed) {
    for (unsigned k = 0; k < d->nparts; k++)
      if (!d->parts[k]->reply_done) d->parts[k]->again = 1;
    call->left -= d->pending;
    d->pending = 0;
  }
  if (!d->failed) d->failed = PS_ERR_UNAVAILABLE;
  d->l->busy = 0;
  if (broken) d->l->broken = 1;
  d->released = 1;
}

/* Links of the call whose server left the job: their parts unanswered go to the loop
 * (sent again to the next member), the connection is not used again, and the link is
 * given back to the loop at once, answered or listening alike: its fail-over (the
 * pushes sent again, the REPLAYED list the new heads wait for) must not wait for this
 * call, which may itself wait for those heads. Returns 1 if any. */
static int direct_written_off(ps_ctx *ctx, dlink *dl, unsigned n, dcall *call) {
  int any = 0;
  pthread_mutex_lock(&ctx->lend_mu);
  for (unsigned j = 0; j < n; j++) {
    dlink *d = &dl[j];
    if (d->released || d->l->alive) continue;
    dl_give_back(d, call, 1);
    any = 1;
  }
  pthread_mutex_unlock(&ctx->lend_mu);
  if (any) ps__mailbox_post(ctx->mail, ps__mail_reclaim, ctx);
  return any;
}

/* After a server's death (ctx->yield_until_ms): links of the call the loop wants back
 * (the fail-over's frames wait for them: pushes sent again, the REPLAYED list) are
 * given back between frames, their unanswered parts to be sent again through the loop
 * (a pull again, a push once: the windows of shard/once.h). Only links that read
 * nothing for other links and carry no part another link may answer (a replicated
 * push's tail answer): their replies cannot come elsewhere. Without this, a pull held
 * by a new head's catch-up kept the links the catch-up's lists had to come by. Returns
 * 1 if any. */
static int direct_yield(ps_ctx *ctx, dlink *dl, unsigned n, dcall *call) {
  if (ps__now_ms() >= __atomic_load_n(&ctx->yield_until_ms, __ATOMIC_RELAXED)) return 0;
  int any = 0;
  pthread_mutex_lock(&ctx->lend_mu);
  for (unsigned j = 0; j < n; j++) {
    dlink *d = &dl[j];
    if (d->released || d->failed || !d->iov || d->listen || !d->l->want_back || d->iov_at < d->niov || d->in_body ||
        d->l->dlen != d->l->doff)
      continue;
    int tail_answered = 0;
    for (unsigned k = 0; k < d->nparts; k++)
      tail_answered |= !d->parts[k]->reply_done && d->parts[k]->nchain > 1 && ps__frame_is_push_req(d->parts[k]->hdr.type);
    if (tail_answered) continue;
    dl_give_back(d, call, 0); /* between frames: the stream is whole */
    any = 1;
  }
  pthread_mutex_unlock(&ctx->lend_mu);
  if (any) ps__mailbox_post(ctx->mail, ps__mail_reclaim, ctx);
  return any;
}

/* Run the parts of reqs[] (in order on each link) on claimed links dl[0..n) until
 * every reply arrived or the deadline passed. Part failures are recorded in their
 * requests. */
/* Polling: the caller keeps its CPU (no sleep in poll) while bytes keep moving, and
 * for up to spin_ns after the last progress, longer by ps__poll_extra_ns of the bytes
 * it sends (a server takes about that long to read them before it answers; 0.5 ms per
 * MiB): a loopback peer answers or drains within that, and a sleeping thread pays a
 * wake-up each time (tens of microseconds on an idle VM). spin = 0 (one CPU) always
 * sleeps. */
/* Kept whole: the caller-thread I/O loop (frame setup, write, read, deadline, poll)
 * is one hot path, kept in one piece; its parts are dl_write and dl_read. */
static void direct_io(ps_ctx *ctx, dlink *dl, unsigned n, uint64_t deadline_ms, int spin) {
  struct pollfd pf[64];
  uint64_t t0 = ps__now_ns(), moved = 0, sending = 0;
  unsigned pushes = 0;
  dcall call = {dl, n, 0};
  for (unsigned j = 0; j < n; j++) {
    dlink *d = &dl[j];
    unsigned niov = 0;
    d->call = &call;
    for (unsigned k = 0; k < d->nparts; k++) niov += 1 + d->parts[k]->nsend;
    d->iov = niov <= sizeof d->iov_small / sizeof d->iov_small[0] ? d->iov_small : ps__malloc(niov * sizeof *d->iov);
    if (!d->iov) {
      for (unsigned k = 0; k < d->nparts; k++) ps__req_set_error(d->parts[k]->req, PS_ERR_NOMEM, "out of memory");
      continue;
    }
    for (unsigned k = 0; k < d->nparts; k++) {
      part *p = d->parts[k];
      if (ps__frame_is_push_req(p->hdr.type) && !p->hdr.inc) { /* its identity, as on the loop (link.c) */
        p->hdr.inc = ctx->incarnation;
        p->hdr.seq = __atomic_add_fetch(&ctx->push_seq, 1, __ATOMIC_RELAXED);
        if (p->keep) ps__keep_sent(ctx, p); /* may make it name its copy: first */
      }
      uint64_t total = 0;
      for (unsigned b = 0; b < p->nsend; b++) total += p->send[b].len;
      p->hdr.sender = ctx->id;
      p->hdr.payload_len = total;
      if (ps__frame_is_push_req(p->hdr.type)) pushes++;
      p->attempts++;
      sending += total;
      p->sent = 1;
      ps__frame_encode(&p->hdr, d->hdrs[k]);
      d->iov[d->niov].iov_base = d->hdrs[k];
      d->iov[d->niov++].iov_len = PS_FRAME_HDR_SIZE;
      for (unsigned b = 0; b < p->nsend; b++) {
        d->iov[d->niov].iov_base = p->send[b].base;
        d->iov[d->niov++].iov_len = p->send[b].len;
      }
      /* Every data request is answered (pushes with an empty acknowledgement). */
      d->pending++;
      call.left++;
    }
  }
  uint64_t window = ctx->spin_ns + ps__poll_extra_ns(sending);
  /* Replicated parts: a server the membership wrote off (a zombie: its socket stays
   * open) is given up on at once, its parts sent to the next member through the loop. */
  int chained = 0;
  for (unsigned j = 0; j < n; j++)
    for (unsigned k = 0; k < dl[j].nparts; k++) chained |= dl[j].parts[k]->nchain > 1;
  uint64_t alive_check_ms = 0;
  /* A push unanswered retry_ms after every frame was written: the unanswered parts go
   * to the loop, which sends them again (ps__direct_run). */
  uint64_t attempt_end = UINT64_MAX;
  for (;;) {
    unsigned busy = 0, np = 0;
    for (unsigned j = 0; j < n; j++) {
      dlink *d = &dl[j];
      if (!d->iov || d->failed) continue;
      int rc = dl_write(d);
      if (!rc) rc = dl_read(ctx, d);
      if (rc) {
        d->failed = rc;
        char msg[320];
        snprintf(msg, sizeof msg, "%s", ps_errmsg()[0] ? ps_errmsg() : ps_strerror(rc));
        uint64_t now = ps__now_ms();
        for (unsigned k = 0; k < d->nparts; k++) {
          part *p = d->parts[k];
          if (p->reply_done) continue;
          if (ps__part_may_resend(ctx, p, now)) {
            p->again = 1; /* on a new connection, through the loop */
          } else {
            ps__req_set_error(p->req, PS_ERR_UNAVAILABLE, msg);
            p->reply_done = 1; /* no answer is awaited for it any more */
          }
        }
        /* Nor here for the others: the call does not wait for them on other links. */
        call.left -= d->pending;
        d->pending = 0;
        continue;
      }
      int reading = d->pending || (d->listen && call.left);
      if (d->iov_at < d->niov || reading) {
        busy++;
        if (np < 64) {
          pf[np].fd = d->fd;
          pf[np].events = (short)((d->iov_at < d->niov ? POLLOUT : 0) | (reading ? POLLIN : 0));
          pf[np].revents = 0;
          np++;
        }
      }
    }
    if (!busy) break;
    if (call.left == 0) { /* every answer is in (a later link of the round read the last) */
      int written = 1;
      for (unsigned j = 0; j < n; j++) written &= !dl[j].iov || dl[j].failed || dl[j].iov_at == dl[j].niov;
      if (written) break;
    }
    if (pushes && ctx->retry_ms && attempt_end == UINT64_MAX) {
      int written = 1;
      for (unsigned j = 0; j < n; j++) written &= !dl[j].iov || dl[j].failed || dl[j].iov_at == dl[j].niov;
      if (written) attempt_end = ps__now_ms() + ctx->retry_ms;
    }
    uint64_t total = 0;
    for (unsigned j = 0; j < n; j++) total += dl[j].moved;
    if (total != moved) {
      moved = total;
      t0 = ps__now_ns();
    }
    uint64_t now = ps__now_ms();
    if (chained && now >= alive_check_ms) {
      alive_check_ms = now + DIRECT_ALIVE_MS;
      if (direct_written_off(ctx, dl, n, &call) | direct_yield(ctx, dl, n, &call)) continue;
    }
    if (now >= attempt_end && now < deadline_ms) {
      /* Only when every part still unanswered may be sent again; else all wait here. */
      int all = 1;
      for (unsigned j = 0; j < n; j++)
        for (unsigned k = 0; k < dl[j].nparts && dl[j].iov && !dl[j].failed; k++)
          if (!dl[j].parts[k]->reply_done && !ps__part_may_resend(ctx, dl[j].parts[k], now)) all = 0;
      attempt_end = UINT64_MAX - 1; /* decided once */
      if (all) {
        for (unsigned j = 0; j < n; j++) {
          dlink *d = &dl[j];
          if (!d->iov || d->failed || !d->pending) continue;
          /* A reply half read leaves the stream unusable: the loop opens a new one. */
          if (d->in_body || d->l->dlen - d->l->doff >= PS_FRAME_HDR_SIZE) d->failed = PS_ERR_TIMEOUT;
          for (unsigned k = 0; k < d->nparts; k++)
            if (!d->parts[k]->reply_done) d->parts[k]->again = 1;
        }
        break;
      }
    }
    if (now >= deadline_ms) {
      for (unsigned j = 0; j < n; j++) {
        dlink *d = &dl[j];
        if (!d->iov || d->failed || !(d->iov_at < d->niov || d->pending)) continue;
        /* A frame half written or half read leaves the stream unusable; a reply that
         * simply has not come yet will be dropped when it does. */
        if (d->iov_at < d->niov || d->in_body || d->l->dlen - d->l->doff >= PS_FRAME_HDR_SIZE) d->failed = PS_ERR_TIMEOUT;
        char msg[96];
        snprintf(msg, sizeof msg, "no answer from node %u before the deadline", d->l->id);
        for (unsigned k = 0; k < d->nparts; k++)
          if (!d->parts[k]->reply_done) ps__req_set_error(d->parts[k]->req, PS_ERR_TIMEOUT, msg);
      }
      break;
    }
    if (spin && ps__now_ns() - t0 < window) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    uint64_t wait = (attempt_end < deadline_ms ? attempt_end : deadline_ms) - now;
    uint64_t cap = chained ? DIRECT_ALIVE_MS : 1000;
    poll(pf, np, wait > cap ? (int)cap : (int)wait);
  }
  for (unsigned j = 0; j < n; j++) {
    dlink *d = &dl[j];
    /* A listening link left in the middle of a frame (the call ended meanwhile): its
     * stream is unusable; the loop opens a new one. */
    if (d->listen && !d->failed && d->in_body) d->failed = PS_ERR_PROTO;
    if (d->iov != d->iov_small) free(d->iov);
    d->iov = NULL;
  }
}

#define PM_NOSPIN_BYTES (512u << 10)

/* Parts of r left unanswered to be sent again (p->again): make r a request of those
 * alone, as if just built, for the loop (answered parts count as finished). Returns
 * the number of such parts. */
static unsigned direct_again(ps_req *r) {
  unsigned left = 0;
  for (unsigned i = 0; i < r->nparts; i++)
    if (r->parts[i].again && !r->parts[i].reply_done) left++;
  if (!left) return 0;
  for (unsigned i = 0; i < r->nparts; i++) {
    part *p = &r->parts[i];
    if (p->again && !p->reply_done) {
      p->again = 0;
      p->sent = p->write_done = p->queued = 0;
      p->wpend = 0;
      p->lk = NULL;
      p->prev = p->next = NULL;
    } else {
      p->finished = 1;
    }
  }
  r->remaining = left;
  return left;
}

/* Run requests on lent links if they can be claimed. Returns 1 when done here (the
 * requests' statuses say how it went; a request left with done 0 has parts to be sent
 * again through the loop), 0 when they must go through the loop. */
int ps__direct_run(ps_ctx *ctx, ps_req **reqs, unsigned nreqs, uint64_t deadline_ms) {
  dlink dl[16];
  if (!ctx->direct || !ctx->thread_started) return 0;
  /* Replicated parts go to their chain's head, answered on its link or, a push, by the
   * chain's tail on the tail's (claim_listeners); a part to be sent again (its head
   * failed, or moved) goes through the loop, which re-routes it. A push to a replicated
   * sync table is kept (keep.c) when it is first sent, here as on the loop. */
  if (__atomic_load_n(&ctx->replicas, __ATOMIC_RELAXED) > 1) {
    pthread_mutex_lock(&ctx->lend_mu);
    int ok = 1;
    for (unsigned q = 0; q < nreqs && ok; q++)
      for (unsigned i = 0; i < reqs[q]->nparts && ok; i++) {
        part *p = &reqs[q]->parts[i];
        uint32_t head = p->nchain > 1 ? ps__part_head(ctx, p) : p->target;
        if (!head) ok = 0;
        else p->target = head;
      }
    pthread_mutex_unlock(&ctx->lend_mu);
    if (!ok) return 0;
  }
  unsigned n = direct_claim(ctx, reqs, nreqs, dl, 16);
  if (n == 0) return 0;
  __atomic_add_fetch(&ctx->direct_calls, 1, __ATOMIC_RELAXED);
  /* No polling while servers copy large peer-memory parts: no bytes move on the socket
   * meanwhile, the answer comes after the copy (about 100 us per MiB), and a polling
   * caller takes a CPU the servers need when workers and servers share the cores. */
  /* Nor while a chain forwards a large push: the head and the tail then work one after
   * the other on the cores the caller would poll on (pushes of 1 MiB over TCP with R = 2
   * ran 0.6x as fast polling). */
  /* Nor while a large pull of a replicated table waits: its answer waits until the
   * round is on every copy (the head forwards it, the tail applies it), and then comes
   * by peer memory (counted above) or streams in inline, which a polling caller reads a
   * few KiB at a time on a core the servers need (1 MiB sync rounds with R = 2 on one
   * host, answered inline: 0.85x the rounds polling). */
  uint64_t pm_bytes = 0;
  for (unsigned j = 0; j < n; j++)
    for (unsigned k = 0; k < dl[j].nparts; k++) {
      const part *p = dl[j].parts[k];
      pm_bytes += p->vx.bytes;
      if (p->nchain > 1 && ps__frame_is_push_req(p->hdr.type)) /* counted 4x: from 128 KiB */
        for (unsigned b = 0; b < p->nsend; b++) pm_bytes += 4 * (uint64_t)p->send[b].len;
      else if (p->nchain > 1) /* a pull: its answer, the same */
        pm_bytes += 4 * (uint64_t)p->recv_len;
    }
  direct_io(ctx, dl, n, deadline_ms, ctx->spin_ns > 0 && pm_bytes < PM_NOSPIN_BYTES);
  direct_release(ctx, dl, n);
  /* A peer-memory part left unanswered (a failed link) keeps the caller's buffers until
   * its deadline, as on the loop (ps__part_finish). Not one the loop sends again: the
   * call goes on there, and the loop holds it if it must when it finishes it. */
  for (int held = 1; held;) {
    held = 0;
    for (unsigned j = 0; j < n; j++)
      for (unsigned k = 0; k < dl[j].nparts && dl[j].failed != PS_ERR_CLOSED; k++)
        held |= !dl[j].parts[k]->again && ps__part_must_hold(dl[j].parts[k]);
    if (held) usleep(20000);
  }
  for (unsigned q = 0; q < nreqs; q++) {
    ps_req *r = reqs[q];
    if (r->status == 0 && direct_again(r)) continue; /* not done: the loop sends the rest again */
    if (r->status == 0) ps__req_rows_done(r);
    ps__req_observe(r);
    r->done = 1;
  }
  return 1;
}

/* A fire-and-forget frame to every server (CLOCK) written on lent links, when every
 * server's link is lent and idle. Returns 1 when sent here, 0 to go through the loop. */
int ps__direct_fire(ps_ctx *ctx, const ps__frame_hdr *h0) {
  dlink dl[16];
  unsigned n = 0;
  int ok = ctx->direct && ctx->thread_started;
  if (!ok || __atomic_load_n(&ctx->outstanding, __ATOMIC_ACQUIRE) != 0) return 0;
  pthread_mutex_lock(&ctx->lend_mu);
  for (peer *l = ctx->links; l && ok; l = l->next) {
    if (l->id == SCHED_LINK || !l->alive) continue;
    if (!link_claimable(l) || n == 16) {
      ok = 0;
      break;
    }
    dl_init(&dl[n++], l);
  }
  if (n == 0 || __atomic_load_n(&ctx->outstanding, __ATOMIC_ACQUIRE) != 0) ok = 0;
  if (ok)
    for (unsigned j = 0; j < n; j++) dl[j].l->busy = 1;
  pthread_mutex_unlock(&ctx->lend_mu);
  if (!ok) return 0;
  uint64_t deadline = ps__now_ms() + ctx->timeout_ms;
  for (unsigned j = 0; j < n; j++) {
    dlink *d = &dl[j];
    ps__frame_hdr h = *h0;
    struct iovec v;
    h.sender = ctx->id;
    h.payload_len = 0;
    ps__frame_encode(&h, d->hdrs[0]);
    v.iov_base = d->hdrs[0];
    v.iov_len = PS_FRAME_HDR_SIZE;
    d->iov = &v;
    d->niov = 1;
    while (!d->failed && d->iov_at < d->niov) {
      if ((d->failed = dl_write(d)) != 0) break;
      if (d->iov_at == d->niov) break;
      uint64_t now = ps__now_ms();
      if (now >= deadline) {
        d->failed = PS_ERR_TIMEOUT;
        break;
      }
      struct pollfd pf = {.fd = d->fd, .events = POLLOUT};
      poll(&pf, 1, (int)(deadline - now > 1000 ? 1000 : deadline - now));
    }
    if (d->failed) ps__log(PS_LOG_WARN, "clock to server %u not sent: %s", d->l->id, ps_strerror(d->failed));
    d->iov = NULL;
  }
  direct_release(ctx, dl, n);
  if (h0->type == PS_MSG_CLOCK) ps__clock_sent(ctx, h0->clock);
  __atomic_add_fetch(&ctx->direct_calls, 1, __ATOMIC_RELAXED);
  return 1;
}
