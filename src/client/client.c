/*
 * client.c - the worker side: ps_ctx, tables, push/pull, clock, barrier, metrics.
 *
 * Threads. A context owns one I/O thread running a libuv loop; every connection (to
 * the scheduler and to each server) lives there. API calls run on the caller's thread:
 * they route keys with the ring, build a request (ps_req) of one part per server, and
 * post it to the loop through the mailbox. The loop sends each part, matches replies
 * by request id, reads pull replies straight into their destination (the caller's
 * array when the keys need no reordering), and completes the request under its mutex.
 * Every part carries a deadline swept by a loop timer, so every request ends.
 *
 * Ownership. A part's payload regions are borrowed from the caller (or owned by the
 * request when keys had to be partitioned). A request that must stop early (timeout of
 * a blocking call, ps_req_free of a running one) is canceled on the loop: a reply
 * being read into it is switched to discard, and a part whose frame is still being
 * written finishes only when that write completes (a write that never completes is
 * cut by the deadline sweep, which closes the connection). The request is complete,
 * and the caller's memory free again, only once every part has finished.
 */
#include <errno.h>
#include <signal.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "common/config.h"
#include "common/ring.h"
#include "net/net.h"
#include "proto/msg.h"
#include "sched/sched.h"
#include "server/server.h"
#include "proto/spec.h"

#define SCHED_LINK 0u /* link id of the scheduler */

typedef struct peer peer;
typedef struct part part;

struct part {
  ps_req *req;
  uint32_t target;         /* server id, or SCHED_LINK */
  ps__frame_hdr hdr;
  uv_buf_t *send;          /* payload regions (borrowed) */
  unsigned nsend;
  uv_buf_t *recv;          /* reply destinations; NULL = control reply */
  unsigned nrecv;
  size_t recv_len;
  uint64_t deadline_ms;
  int queued, sent, write_done, reply_done, finished;
  int pm_answered;         /* a peer-memory part's reply arrived: the server is done */
  int pm_pid;              /* a peer-memory part's server process */
  uint64_t pm_bytes;       /* a peer-memory part's value bytes (the server copies them) */
  int held;                /* on ctx->held until its deadline (part_finish) */
  int status;
  uint32_t reply_table;    /* hdr.table of the reply (declare returns the id) */
  int64_t reply_clock;     /* hdr.clock of the reply */
  char *stats_buf;         /* STATS reply text destination (control body copied here) */
  size_t stats_cap;
  peer *lk;
  part *prev, *next;       /* in the link's in-flight or queue list */
};

struct ps_req {
  ps_ctx *ctx;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  int canceled;
  int status;
  char msg[256];
  unsigned nparts, remaining;
  part *parts;
  uv_buf_t *bufs;          /* storage for all parts' send/recv regions */
  /* owned buffers */
  void *own_keys, *own_recv, *own_segs; /* own_recv points into scratch */
  void *scratch;           /* pooled block holding routed keys, values, reply slots */
  size_t scratch_len;
  uint32_t *pos;           /* sparse pull scatter: caller index of each routed key */
  float *out;              /* caller destination for a scattered pull */
  unsigned width;
  size_t nkeys;
  int cancel_acked;
  int kind;                /* 0 pull, 1 push, 2 control: for the wait-time counters */
  int counted;             /* posted to the loop: counted in ctx->outstanding */
  int dropped;             /* a server dropped this push (counted once per request) */
  /* a de-duplicated pull (sparse_start): rows of the distinct keys, copied to out */
  void *dd_block, *dd_rows;
  size_t dd_block_len, dd_rows_len, dd_n;
  const uint32_t *dd_idx;
  float *dd_out;
  unsigned dd_width;
};

struct peer {
  uint32_t id;             /* server id or SCHED_LINK */
  ps__member m;
  int alive;
  ps__conn *conn;
  int connecting;
  part *inflight;          /* sent, awaiting reply or write completion */
  part *queue_head, *queue_tail; /* waiting for the connection */
  part *reading;           /* part whose reply body is being read */
  peer *next;
  /* Lending to callers (caller-side I/O, see "lent links"); under ctx->lend_mu. */
  int lent;                /* the loop stopped reading; callers may use fd */
  int busy;                /* a caller is doing I/O on fd */
  int want_back;           /* the loop needs the link when that caller is done */
  int lend_wanted;         /* a caller would use the link: lend it when idle */
  int broken;              /* a caller's I/O failed mid-frame: close, do not resume */
  int fd;
  int pm;                  /* peer-memory frames may go to this server: its pid (atomic), or 0 */
  uint8_t *dbuf;           /* borrowers' read buffer; bytes [doff, dlen) not parsed yet */
  size_t doff, dlen;
};

typedef struct table_info {
  int kind;
  uint64_t size;
  uint32_t width;
  uint64_t nrows;
  ps__update_mode update;
} table_info;

struct ps_ctx {
  /* configuration */
  uint32_t timeout_ms, connect_timeout_ms, heartbeat_ms, vnodes;
  uint64_t max_payload;
  int use_unix;
  char sched_host[PS_CFG_HOST_MAX];
  int sched_port;
  char hostid[PS_HOST_MAX];

  /* the loop */
  uv_loop_t loop;
  pthread_t thread;
  int thread_started;
  ps__mailbox *mail;
  ps__pool *pool;
  uv_timer_t hb_timer, sweep_timer, retry_timer;
  uint64_t connect_deadline_ms;
  int connect_refused;     /* the scheduler refused a connection (retrying) */
  peer *links;             /* scheduler link first */
  peer *sched;
  part *held;              /* peer-memory parts held until their deadline (loop) */

  /* shared state under mu */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int registered, started, failed, closing;
  int fail_err;
  char fail_msg[256];
  uint32_t id;
  int rank, nworkers, nservers;
  uint64_t epoch;
  ps__ring *ring;          /* current ring; replaced rings are retired, freed at close */
  ps__ring **retired;
  size_t nretired;
  table_info *tables;
  size_t ntables;
  int64_t clock;
  int64_t barrier_seq;
  char mode[32];           /* job consistency mode, added to tables declared without one */
  /* counters (atomics): time blocked waiting, by kind; requests; bytes */
  uint64_t wait_ns[3];     /* 0 pull, 1 push, 2 other */
  uint64_t nreq[3];
  uint64_t dropped_pushes, fast_forwards;
  uint64_t bytes_pushed, bytes_pulled;
  uint64_t opened_ns;
  uint64_t spin_ns;        /* ps_req_wait polls this long before sleeping (0: never) */
  /* Caller-side I/O for blocking calls (lent links). */
  int direct;              /* enabled (PSHARD_DIRECT=0 turns it off) */
  int peer_mem;            /* large dense values by peer memory on same-host links */
  int dedup;               /* large sparse pulls ask for each distinct key once */
  pthread_mutex_t lend_mu; /* links' lending state; the link list's structure */
  pthread_cond_t lend_cv;  /* a mail_lend ran */
  int lend_posted;         /* a mail_lend is queued */
  uint64_t outstanding;    /* requests and fire-and-forget frames not finished by the loop */
  uint64_t direct_calls;   /* blocking calls and clocks done on lent links */
  uint64_t pm_parts;       /* dense parts sent as peer-memory frames */
  uint64_t shared_parts;   /* of those, parts naming a ps_alloc buffer (the server may map it) */
  /* Buffers for partitioned requests, reused across calls (callers' threads). */
  pthread_mutex_t upool_mu;
  ps__pool *upool;
  uint32_t clock_batch;    /* largest batch pushed in the current clock */
  uint64_t examples;       /* sum over finished clocks of clock_batch */
  unsigned hb_count;
  uint64_t next_req_id;

  /* embedded mode */
  ps__sched *emb_sched;
  pthread_t emb_sched_thread;
  ps__server **emb_servers;
  pthread_t *emb_server_threads;
  unsigned n_emb;
  int colocated;    /* emb_servers are the job's servers, colocated here (no emb_sched) */
};

/* The CLOCK_REALTIME instant ms milliseconds from now, for pthread_cond_timedwait. */
static struct timespec abs_after_ms(uint64_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t ns = (uint64_t)ts.tv_nsec + (ms % 1000) * 1000000ull;
  ts.tv_sec += (time_t)(ms / 1000 + ns / 1000000000ull);
  ts.tv_nsec = (long)(ns % 1000000000ull);
  return ts;
}

/* ================================================================== loop side */

static void part_finish(part *p);

static void list_remove(part **head, part *p) {
  if (p->prev)
    p->prev->next = p->next;
  else if (*head == p)
    *head = p->next;
  if (p->next) p->next->prev = p->prev;
  p->prev = p->next = NULL;
}

static void list_push(part **head, part *p) {
  p->prev = NULL;
  p->next = *head;
  if (*head) (*head)->prev = p;
  *head = p;
}

static peer *find_link(ps_ctx *ctx, uint32_t id) {
  for (peer *l = ctx->links; l; l = l->next)
    if (l->id == id) return l;
  return NULL;
}

static void req_set_error(ps_req *r, int status, const char *msg) {
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
static void req_rows_done(ps_req *r) {
  if (r->pos) req_scatter(r);
  if (r->dd_rows) {
    size_t w = r->dd_width;
    const float *rows = r->dd_rows;
    for (size_t j = 0; j < r->dd_n; j++) memcpy(r->dd_out + j * w, rows + (size_t)r->dd_idx[j] * w, w * 4);
  }
}

static void req_destroy(ps_req *r);

static void req_complete(ps_req *r) {
  if (r->counted) __atomic_sub_fetch(&r->ctx->outstanding, 1, __ATOMIC_RELEASE);
  if (r->canceled == 2) { /* detached (hello, queued fire-and-forget): nobody waits */
    req_destroy(r);
    return;
  }
  if (r->status == 0 && !r->canceled) req_rows_done(r);
  pthread_mutex_lock(&r->mu);
  __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE); /* read unlocked by ps_req_wait's poll */
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

/* A peer-memory part (PS_CODEC_PEER_MEM) names the caller's buffers, and the server
 * copies from or into them until the expiry the frame carries, PM_SLACK_MS before the
 * part's deadline. A part that ends without the server's answer (cancel, a failed or
 * closed connection, a closing context) therefore keeps the buffers, and its request
 * stays unfinished, until that deadline: the caller must not reuse them while a
 * server may still write there. The loop's sweep finishes such held parts. */
#define PM_SLACK_MS 2000u

/* Is process pid gone (exited, or a zombie not reaped yet)? */
static int process_gone(int pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return kill(pid, 0) != 0 && errno == ESRCH;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *e = strrchr(buf, ')'); /* "pid (comm) S ...": comm may hold anything */
  return e && (e[2] == 'Z' || e[2] == 'X');
}

static int pm_must_hold(const part *p) {
  if (p->hdr.codec != PS_CODEC_PEER_MEM || !p->sent || p->pm_answered || ps__now_ms() >= p->deadline_ms) return 0;
  /* A server process that is gone (killed, crashed) writes nowhere any more. */
  return !process_gone(p->pm_pid);
}

/* A part is finished when its reply arrived (or it failed) and its write completed. */
static void part_finish(part *p) {
  if (p->finished) return;
  if (!p->held && pm_must_hold(p)) {
    if (p->lk) {
      list_remove(&p->lk->inflight, p);
      p->lk = NULL;
    }
    p->held = 1;
    list_push(&p->req->ctx->held, p);
    return;
  }
  if (p->held) {
    p->held = 0;
    list_remove(&p->req->ctx->held, p);
  }
  p->finished = 1;
  /* A part that expects no reply (a queued fire-and-forget frame) finishes on its write
   * completion while still on the link's in-flight list; a detached request is freed
   * right below, so it must leave the list first. */
  if (p->lk) {
    list_remove(&p->lk->inflight, p);
    p->lk = NULL;
  }
  ps_req *r = p->req;
  if (--r->remaining == 0) req_complete(r);
}

static void part_fail(part *p, int status, const char *msg) {
  if (p->finished) return;
  req_set_error(p->req, status, msg);
  p->reply_done = 1;
  /* A write still in flight holds the part (its callback argument) and the caller's
   * buffers: the part finishes in on_write_done, which every path that fails such a
   * part brings about soon by closing the connection (ECANCELED). Finishing it here
   * would let ps_req_free() free the request under the pending callback. */
  if (!p->sent) p->write_done = 1;
  if (p->write_done) part_finish(p);
}

/* Take a part off its link's queue of parts waiting for the connection. */
static void queue_remove(peer *l, part *p) {
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

static void link_fail_all(peer *l, int status, const char *why) {
  while (l->queue_head) {
    part *p = l->queue_head;
    queue_remove(l, p);
    part_fail(p, status, why);
  }
  while (l->inflight) {
    part *p = l->inflight;
    list_remove(&l->inflight, p);
    p->lk = NULL;
    part_fail(p, status, why);
  }
  l->reading = NULL;
}

static void on_write_done(void *arg, int status) {
  part *p = arg;
  p->write_done = 1;
  if (status != 0 && !p->finished) {
    char msg[128];
    snprintf(msg, sizeof msg, "sending to node %u failed: %s", p->target, ps_strerror(status));
    if (p->lk) list_remove(&p->lk->inflight, p);
    p->lk = NULL;
    part_fail(p, (status == PS_ERR_CANCELED || status == PS_ERR_CLOSED) ? PS_ERR_UNAVAILABLE : status, msg);
    return;
  }
  if (p->reply_done) part_finish(p);
}

static void part_send(ps_ctx *ctx, peer *l, part *p) {
  (void)ctx;
  p->hdr.sender = ctx->id;
  p->lk = l;
  list_push(&l->inflight, p);
  p->sent = 1;
  if (ps__conn_send(l->conn, &p->hdr, p->send, p->nsend, on_write_done, p) != 0) {
    list_remove(&l->inflight, p);
    p->lk = NULL;
    p->write_done = 1; /* nothing in flight: the callback will not run */
    part_fail(p, PS_ERR_UNAVAILABLE, ps_errmsg());
  }
}

static void link_connect(ps_ctx *ctx, peer *l);

/* ---- lent links
 *
 * A blocking data call whose servers' links are idle does its own socket I/O on the
 * caller's thread (direct_run, below): one write and one wake-up when the reply
 * arrives, like a raw round trip, instead of crossing to the I/O thread and back.
 * The loop lends a link at an idle point (nothing in flight, queued, half read or
 * unsent) and stops reading it. Callers use lent links only while no request of the
 * context is running on the loop (ctx->outstanding == 0), so frames go out in the
 * order of the calls that made them. When the loop must send on a lent link it takes
 * it back: at once if no caller is using it, else when that caller is done
 * (want_back, then mail_reclaim). A caller whose I/O failed mid-frame marks the link
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
  }
}

static void part_send(ps_ctx *ctx, peer *l, part *p);

/* Send what waited for a link: on a new connection or on a link given back. */
static void link_flush(ps_ctx *ctx, peer *l) {
  if (!l->queue_head) return;
  if (!l->conn) {
    if (!l->connecting) link_connect(ctx, l);
    return;
  }
  while (l->queue_head) {
    part *p = l->queue_head;
    queue_remove(l, p);
    part_send(ctx, l, p);
  }
}

/* Loop: l, no longer lent, is the loop's again: resume it and send what waited for it
 * (or fail that if its server left). */
static void link_returned(ps_ctx *ctx, peer *l) {
  link_resume(l);
  if (l->alive)
    link_flush(ctx, l);
  else
    link_fail_all(l, PS_ERR_UNAVAILABLE, "server left the job");
}

/* A lent link no caller is using can go back to the loop. lend_mu held. */
static int link_idle_lent(const peer *l) { return l->lent && !l->busy; }

/* Loop: take l back if it is lent; what waited for it goes first. Returns 1 when the
 * loop may send on l now; 0 when a caller is using it (it comes back through
 * mail_reclaim) or its connection had to be closed. */
static int link_take(ps_ctx *ctx, peer *l) {
  int resume = 0, ok = 1;
  pthread_mutex_lock(&ctx->lend_mu);
  if (link_idle_lent(l)) {
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

static void mail_reclaim(void *arg) {
  ps_ctx *ctx = arg;
  for (peer *l = ctx->links; l; l = l->next) {
    int resume = 0;
    pthread_mutex_lock(&ctx->lend_mu);
    if (link_idle_lent(l) && (l->want_back || l->broken || !l->alive)) {
      l->lent = 0;
      l->want_back = 0;
      resume = 1;
    }
    pthread_mutex_unlock(&ctx->lend_mu);
    if (resume) link_returned(ctx, l);
  }
}

static void part_submit(ps_ctx *ctx, part *p) {
  peer *l = find_link(ctx, p->target);
  if (!l || !l->alive) {
    char msg[160];
    snprintf(msg, sizeof msg, "server %u, which holds these keys, has left the job; without replicas its shard is lost",
             p->target);
    part_fail(p, PS_ERR_UNAVAILABLE, msg);
    return;
  }
  if (l->conn && link_take(ctx, l)) {
    part_send(ctx, l, p);
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
  peer *l = find_link(ctx, ca->id);
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
    link_fail_all(l, PS_ERR_UNAVAILABLE, msg);
    return;
  }
  if (!l->alive || ctx->closing) {
    ps__conn_close(c, 0);
    link_fail_all(l, PS_ERR_UNAVAILABLE, "server left the job");
    return;
  }
  c->udata = l;
  l->conn = c;
  /* Peer memory needs a same-host AF_UNIX link to a server that offers it, running as
   * this user or privileged (the kernel's ptrace rule for process_vm_readv). */
  int pm = ctx->peer_mem && c->is_unix && c->peer_pid && (l->m.caps & PS_CAP_PEER_MEM) &&
           (c->peer_uid == (unsigned)geteuid() || c->peer_uid == 0);
  __atomic_store_n(&l->pm, pm ? c->peer_pid : 0, __ATOMIC_RELAXED);
  link_flush(ctx, l);
}

static void link_connect(ps_ctx *ctx, peer *l) {
  conn_arg *ca = ps__malloc(sizeof *ca);
  int rc;
  if (!ca) {
    link_fail_all(l, PS_ERR_NOMEM, "out of memory");
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
    link_fail_all(l, rc, ps_errmsg());
  }
}

static part *inflight_find(peer *l, uint64_t req_id) {
  for (part *p = l->inflight; p; p = p->next)
    if (p->hdr.req_id == req_id) return p;
  return NULL;
}

static void ctx_fail(ps_ctx *ctx, int err, const char *msg) {
  pthread_mutex_lock(&ctx->mu);
  if (!ctx->failed) {
    ctx->failed = 1;
    ctx->fail_err = err;
    snprintf(ctx->fail_msg, sizeof ctx->fail_msg, "%s", msg);
  }
  pthread_cond_broadcast(&ctx->cv);
  pthread_mutex_unlock(&ctx->mu);
}

static void on_membership(ps_ctx *ctx, const ps__body *b) {
  ps__membership m;
  if (ps__membership_decode(b->buf, b->len, &m)) {
    ps__log(PS_LOG_ERROR, "bad membership frame: %s", ps_errmsg());
    return;
  }
  uint32_t *ids = ps__calloc(m.n ? m.n : 1, sizeof *ids);
  size_t nsrv = 0, nalive = 0;
  int nwork = 0;
  if (!ids) {
    ps__membership_clear(&m);
    return;
  }
  for (uint32_t i = 0; i < m.n; i++) {
    ps__member *x = &m.m[i];
    if (x->role == PS_ROLE_WORKER && x->alive) nwork++;
    if (x->role != PS_ROLE_SERVER) continue;
    peer *l = find_link(ctx, x->id);
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
      l->alive = 1;
    } else if (l->alive) {
      pthread_mutex_lock(&ctx->lend_mu);
      l->alive = 0; /* a caller using the link finishes first; mail_reclaim closes it */
      int in_use = l->lent && l->busy;
      if (link_idle_lent(l)) l->lent = 0;
      pthread_mutex_unlock(&ctx->lend_mu);
      if (in_use) continue;
      char msg[96];
      snprintf(msg, sizeof msg, "server %u left the job", x->id);
      link_fail_all(l, PS_ERR_UNAVAILABLE, msg);
      if (l->conn) {
        l->conn->udata = NULL;
        ps__conn_close(l->conn, 0);
        l->conn = NULL;
      }
    }
  }
  ps__ring *ring = nsrv ? ps__ring_new(ids, nsrv, ctx->vnodes, m.epoch) : NULL;
  free(ids);
  pthread_mutex_lock(&ctx->mu);
  if (m.epoch >= ctx->epoch) {
    ctx->epoch = m.epoch;
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
  ps__membership_clear(&m);
}

/* A peer-memory pull's reply: the values are already in the caller's buffers. */
static int pm_reply(const part *p, const ps__frame_hdr *h) {
  return h->codec == PS_CODEC_PEER_MEM && p->hdr.codec == PS_CODEC_PEER_MEM && h->payload_len == 0;
}

static int link_on_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  peer *l = c->udata;
  if (!l) {
    b->discard = 1;
    return 0;
  }
  if (h->type == PS_MSG_MEMBERSHIP && l->id == SCHED_LINK) return 0;
  if (h->type == PS_MSG_ERROR) return 0;
  if (!(h->type & PS_FRAME_REPLY)) return ps__fail(PS_ERR_PROTO, "unexpected %s request", ps__frame_type_name(h->type));
  part *p = inflight_find(l, h->req_id);
  if (!p || p->reply_done) {
    b->discard = 1; /* a reply to a canceled or timed-out request */
    return 0;
  }
  if (h->status == 0 && p->recv && !pm_reply(p, h)) {
    if (h->payload_len != p->recv_len) {
      char msg[160];
      snprintf(msg, sizeof msg, "reply of %llu bytes where %zu were expected", (unsigned long long)h->payload_len,
               p->recv_len);
      p->pm_answered = 1;
      list_remove(&l->inflight, p);
      p->lk = NULL;
      part_fail(p, PS_ERR_SIZE, msg);
      b->discard = 1;
      return 0;
    }
    b->iov = p->recv;
    b->niov = p->nrecv;
    l->reading = p;
  }
  b->udata = p;
  return 0;
}

/* A successful reply to p (loop or lent link): what it tells the context. */
static void part_reply_ok(ps_ctx *ctx, part *p, const ps__frame_hdr *h) {
  p->reply_table = h->table;
  p->reply_clock = h->clock;
  uint8_t t = h->type & (uint8_t)~PS_FRAME_REPLY;
  if (t == PS_MSG_PULL || t == PS_MSG_PULL_DENSE) {
    /* A worker behind the table's applied rounds (sync:M straggler, late joiner)
     * resumes at the round the servers are at. */
    int64_t cur = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED);
    while (h->clock > cur && !__atomic_compare_exchange_n(&ctx->clock, &cur, h->clock, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    if (h->clock > cur) __atomic_add_fetch(&ctx->fast_forwards, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&ctx->bytes_pulled, pm_reply(p, h) ? p->recv_len : h->payload_len, __ATOMIC_RELAXED);
  } else if (t == PS_MSG_PUSH || t == PS_MSG_PUSH_DENSE) {
    /* One push goes to every server as one part each: count the push, not its parts. */
    if ((h->flags & PS_FLAG_DROPPED) && !__atomic_exchange_n(&p->req->dropped, 1, __ATOMIC_RELAXED))
      __atomic_add_fetch(&ctx->dropped_pushes, 1, __ATOMIC_RELAXED);
  }
}

/* Ask the loop to lend idle links that callers want (from any thread). */
static void post_lend(ps_ctx *ctx) {
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

static void link_on_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  peer *l = c->udata;
  ps_ctx *ctx = c->loop->data;
  if (!l) return;
  if (h->type == PS_MSG_MEMBERSHIP) {
    on_membership(ctx, b);
    return;
  }
  if (h->type == PS_MSG_ERROR) {
    ps__log(PS_LOG_ERROR, "node %u: %.*s", l->id, (int)b->len, b->buf ? (const char *)b->buf : "");
    return;
  }
  part *p = b->udata;
  l->reading = NULL;
  if (!p) return;
  p->pm_answered = 1;
  list_remove(&l->inflight, p);
  p->lk = NULL;
  if (h->status) {
    char msg[300];
    snprintf(msg, sizeof msg, "%.*s", (int)(b->len < 256 ? b->len : 256), b->buf ? (const char *)b->buf : "");
    part_fail(p, h->status, msg[0] ? msg : ps_strerror(h->status));
    return;
  }
  part_reply_ok(ctx, p, h);
  if (l->lend_wanted && !l->inflight && !l->queue_head) post_lend(ctx);
  if (h->type == (PS_MSG_HELLO | PS_FRAME_REPLY)) {
    pthread_mutex_lock(&ctx->mu);
    ctx->id = h->table;
    ctx->rank = (int)h->batch;
    ctx->registered = 1;
    pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
  }
  if (p->stats_buf) {
    size_t n = b->len < p->stats_cap - 1 ? b->len : p->stats_cap - 1;
    if (n) memcpy(p->stats_buf, b->buf, n);
    p->stats_buf[n] = '\0';
  }
  p->reply_done = 1;
  if (p->write_done) part_finish(p);
}

static void link_on_close(ps__conn *c, int status) {
  peer *l = c->udata;
  ps_ctx *ctx = c->loop->data;
  if (!l) return;
  /* The server closed the connection (or died): it no longer serves any frame of it,
   * so its peer-memory parts need not be held (part_finish). */
  if (status == PS_ERR_CLOSED)
    for (part *p = l->inflight; p; p = p->next) p->pm_answered = 1;
  l->conn = NULL;
  __atomic_store_n(&l->pm, 0, __ATOMIC_RELAXED);
  char msg[160];
  snprintf(msg, sizeof msg, "connection to %s %u closed: %s", l->id == SCHED_LINK ? "scheduler" : "server", l->id,
           ps_strerror(status));
  link_fail_all(l, status ? PS_ERR_UNAVAILABLE : PS_ERR_CANCELED, msg);
  if (l->id == SCHED_LINK && !ctx->closing) ctx_fail(ctx, PS_ERR_UNAVAILABLE, "lost the scheduler");
}

/* The counters every worker reports to the scheduler (names "ps.<stat>"), read by
 * `pshard plan --measured` and the progress line. */
static const char *const reported_stats[] = {"uptime_s", "compute_s", "pull_wait_s", "push_wait_s", "other_wait_s",
                                             "clock", "examples", "bytes_pushed", "bytes_pulled", "pulls", "pushes"};

static void report_stats(ps_ctx *ctx) {
  if (!ctx->sched->conn || !ctx->registered) return;
  for (size_t i = 0; i < sizeof reported_stats / sizeof reported_stats[0]; i++) {
    double v;
    char name[64];
    ps__wbuf w;
    if (ps_ctx_stat(ctx, reported_stats[i], &v)) continue;
    snprintf(name, sizeof name, "ps.%s", reported_stats[i]);
    ps__wbuf_init(&w);
    ps__wbuf_str(&w, name);
    ps__wbuf_f64(&w, v);
    ps__frame_hdr h = {.type = PS_MSG_METRIC, .sender = ctx->id, .clock = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED)};
    if (!w.oom) ps__conn_send_ctrl(ctx->sched->conn, &h, w.data, w.len);
    ps__wbuf_free(&w);
  }
}

static void hb_tick(uv_timer_t *t) {
  ps_ctx *ctx = t->data;
  if (!ctx->sched->conn) return;
  ps__frame_hdr h = {.type = PS_MSG_HEARTBEAT, .sender = ctx->id};
  ps__conn_send_ctrl(ctx->sched->conn, &h, NULL, 0);
  if (++ctx->hb_count * ctx->heartbeat_ms >= 1000) {
    ctx->hb_count = 0;
    report_stats(ctx);
  }
}

/* Fail parts whose deadline passed. A part whose payload is still being written
 * forces its connection closed (its buffers must be released). */
static void sweep_tick(uv_timer_t *t) {
  ps_ctx *ctx = t->data;
  uint64_t now = ps__now_ms();
  for (part *p = ctx->held; p;) { /* peer-memory parts whose buffers the server may no longer touch */
    part *next = p->next;
    if (!pm_must_hold(p)) part_finish(p);
    p = next;
  }
  for (peer *l = ctx->links; l; l = l->next) {
    int close_conn = 0;
    for (part *p = l->queue_head; p;) {
      part *next = p->next;
      if (now >= p->deadline_ms) {
        queue_remove(l, p);
        part_fail(p, PS_ERR_TIMEOUT, "deadline exceeded waiting for a connection");
      }
      p = next;
    }
    for (part *p = l->inflight; p;) {
      part *next = p->next;
      if (now >= p->deadline_ms) {
        if (!p->write_done || l->reading == p) close_conn = 1;
        list_remove(&l->inflight, p);
        p->lk = NULL;
        char msg[96];
        snprintf(msg, sizeof msg, "no answer from node %u before the deadline", l->id);
        part_fail(p, PS_ERR_TIMEOUT, msg);
      }
      p = next;
    }
    if (close_conn && l->conn) {
      l->conn->udata = NULL;
      ps__conn_close(l->conn, PS_ERR_TIMEOUT);
      l->conn = NULL;
      l->reading = NULL;
      link_fail_all(l, PS_ERR_UNAVAILABLE, "connection reset after a deadline");
    }
  }
}

/* ---- mail handlers (run on the loop) */

static void mail_submit(void *arg) {
  ps_req *r = arg;
  ps_ctx *ctx = r->ctx;
  if (r->nparts == 0) {
    req_complete(r);
    return;
  }
  for (unsigned i = 0; i < r->nparts; i++) part_submit(ctx, &r->parts[i]);
}

static void mail_cancel(void *arg) {
  ps_req *r = arg;
  for (unsigned i = 0; i < r->nparts; i++) {
    part *p = &r->parts[i];
    if (p->finished) continue;
    peer *l = p->lk;
    if (p->queued) {
      l = find_link(r->ctx, p->target);
      if (l) {
        queue_remove(l, p);
      } else {
        p->prev = p->next = NULL;
        p->queued = 0;
      }
    } else if (l && p->hdr.codec == PS_CODEC_PEER_MEM && p->sent) {
      /* The server may be copying from or into the caller's buffers: the part stays in
       * flight until its answer (or its deadline), which finishes it as canceled. */
      req_set_error(r, PS_ERR_CANCELED, "canceled");
      continue;
    } else if (l) {
      if (l->reading == p && l->conn) {
        l->conn->body.discard = 1;
        l->conn->body.udata = NULL;
        l->reading = NULL;
      }
      /* A frame still being written stays on the in-flight list until its write ends
       * (on_write_done finishes it; part_fail waits for that), so the deadline sweep
       * can still cut a write that never ends; a reply to it is discarded. Closing the
       * connection instead would fail every other request on it. */
      if (p->write_done) {
        list_remove(&l->inflight, p);
        p->lk = NULL;
      }
    }
    part_fail(p, PS_ERR_CANCELED, "canceled");
  }
  pthread_mutex_lock(&r->mu);
  r->cancel_acked = 1;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

typedef struct fire {
  ps_ctx *ctx;
  uint32_t target; /* SCHED_LINK or 0xffffffff for every server */
  ps__frame_hdr h;
  size_t len;
  uint8_t body[];
} fire;

/* Fire-and-forget frames (clock, metric). Ordered after earlier parts on each link:
 * a link still connecting gets the frame queued as a part of a detached request. */
static void mail_fire(void *arg) {
  fire *f = arg;
  ps_ctx *ctx = f->ctx;
  for (peer *l = ctx->links; l; l = l->next) {
    if (f->target == SCHED_LINK ? l->id != SCHED_LINK : (l->id == SCHED_LINK || !l->alive)) continue;
    ps__frame_hdr h = f->h;
    h.sender = ctx->id;
    if (l->conn && link_take(ctx, l) && !l->queue_head) {
      ps__conn_send_ctrl(l->conn, &h, f->body, f->len);
    } else if (l->alive) {
      /* Not connected yet: queue a one-part request that frees itself. */
      ps_req *r = ps__calloc(1, sizeof *r);
      if (!r) continue;
      r->ctx = ctx;
      r->nparts = r->remaining = 1;
      r->parts = ps__calloc(1, sizeof *r->parts);
      r->bufs = ps__calloc(1, sizeof *r->bufs);
      r->own_keys = f->len ? ps__malloc(f->len) : NULL;
      if (!r->parts || !r->bufs || (f->len && !r->own_keys)) {
        free(r->parts); free(r->bufs); free(r->own_keys); free(r);
        continue;
      }
      pthread_mutex_init(&r->mu, NULL);
      pthread_cond_init(&r->cv, NULL);
      r->canceled = 2; /* detached: freed by the loop when done */
      if (f->len) memcpy(r->own_keys, f->body, f->len);
      r->bufs[0] = uv_buf_init(r->own_keys, (unsigned)f->len);
      part *p = &r->parts[0];
      p->req = r;
      p->target = l->id;
      p->hdr = h;
      p->send = r->bufs;
      p->nsend = f->len ? 1 : 0;
      p->deadline_ms = ps__now_ms() + ctx->timeout_ms;
      p->reply_done = 1; /* no reply expected */
      part_submit(ctx, p);
    }
  }
  __atomic_sub_fetch(&ctx->outstanding, 1, __ATOMIC_RELEASE);
  free(f);
}

static void *io_main(void *arg) {
  ps_ctx *ctx = arg;
  ps__block_sigpipe();
  uv_run(&ctx->loop, UV_RUN_DEFAULT);
  return NULL;
}

static void walk_close(uv_handle_t *h, void *arg) {
  (void)arg;
  if (uv_is_closing(h)) return;
  if (h->type == UV_TCP || h->type == UV_NAMED_PIPE) {
    ps__conn *c = h->data;
    if (c) {
      ps__conn_close(c, 0);
      return;
    }
  }
  if (h->type == UV_ASYNC) return;
  uv_close(h, NULL);
}

static void mail_shutdown(void *arg) {
  ps_ctx *ctx = arg;
  ctx->closing = 1;
  for (peer *l = ctx->links; l; l = l->next) {
    link_fail_all(l, PS_ERR_CLOSED, "context closed");
    if (l->conn) {
      if (l->id == SCHED_LINK) {
        report_stats(ctx); /* final counters before leaving */
        ps__frame_hdr h = {.type = PS_MSG_LEAVE, .sender = ctx->id};
        ps__conn_send_ctrl(l->conn, &h, NULL, 0);
        ps__conn_close_after_flush(l->conn, 0);
      } else {
        ps__conn_close(l->conn, 0);
      }
    }
  }
  uv_walk(&ctx->loop, walk_close, NULL);
  ps__mailbox_close(ctx->mail);
}

/* ================================================================== caller side */

static int ctx_check(const ps_ctx *ctx) {
  if (!ctx) return ps__fail(PS_ERR_INVALID, "NULL context");
  return 0;
}

static int ctx_state_err(ps_ctx *ctx) {
  int rc = 0;
  pthread_mutex_lock(&ctx->mu);
  if (ctx->closing) rc = ps__fail(PS_ERR_CLOSED, "context is closed");
  else if (ctx->failed) rc = ps__fail(ctx->fail_err, "%s", ctx->fail_msg);
  pthread_mutex_unlock(&ctx->mu);
  return rc;
}

static ps_req *req_new(ps_ctx *ctx, unsigned nparts, unsigned nbufs) {
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
static void *ubuf_get(ps_ctx *ctx, size_t n) {
  pthread_mutex_lock(&ctx->upool_mu);
  void *p = ps__pool_get(ctx->upool, n);
  pthread_mutex_unlock(&ctx->upool_mu);
  return p;
}

static void ubuf_put(ps_ctx *ctx, void *p, size_t n) {
  if (!p) return;
  pthread_mutex_lock(&ctx->upool_mu);
  ps__pool_put(ctx->upool, p, n);
  pthread_mutex_unlock(&ctx->upool_mu);
}

static void req_destroy(ps_req *r) {
  if (r->scratch) ubuf_put(r->ctx, r->scratch, r->scratch_len);
  ubuf_put(r->ctx, r->dd_rows, r->dd_rows_len);
  ubuf_put(r->ctx, r->dd_block, r->dd_block_len);
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
  free(r->parts);
  free(r->bufs);
  free(r->own_keys);
  free(r->own_segs);
  free(r);
}

static void part_init(ps_ctx *ctx, ps_req *r, unsigned i, uint32_t target, uint8_t type, uint32_t table,
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

static int req_post(ps_ctx *ctx, ps_req *r) {
  r->counted = 1;
  __atomic_add_fetch(&ctx->outstanding, 1, __ATOMIC_ACQ_REL);
  int rc = ps__mailbox_post(ctx->mail, mail_submit, r);
  if (rc) {
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
  struct timespec ts = abs_after_ms(tmo);
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
      return ps__fail(PS_ERR_TIMEOUT, "request still running after %llu ms", (unsigned long long)tmo);
    }
  }
  __atomic_add_fetch(&r->ctx->wait_ns[r->kind], ps__now_ns() - t0, __ATOMIC_RELAXED);
  int st = r->status;
  if (st) ps__fail(st, "%s", r->msg);
  pthread_mutex_unlock(&r->mu);
  return st;
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
  if (ps__mailbox_post(r->ctx->mail, mail_cancel, r) != 0) return; /* loop gone: nothing runs */
  /* Wait for mail_cancel itself, not for completion: it keeps reading the request
   * after its last part finished (and it may run after a normal completion). */
  pthread_mutex_lock(&r->mu);
  while (!r->cancel_acked) pthread_cond_wait(&r->cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
}

void ps_req_free(ps_req *r) {
  if (!r) return;
  req_cancel_sync(r);
  /* After a cancel the loop may still be finishing parts; wait for done. */
  pthread_mutex_lock(&r->mu);
  while (!r->done) pthread_cond_wait(&r->cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
  req_destroy(r);
}


/* ---- caller-side I/O on lent links (see "lent links" above) */

#define DBUF_CAP (64u * 1024u)      /* a borrower's read buffer */
#define DIRECT_READ_MIN (16u * 1024u) /* body bytes read straight into the destination */
#define DL_MAXPARTS 2               /* parts of one call on one link (push + pull) */

typedef struct dlink {
  peer *l;
  int fd;
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
  const uv_buf_t *dst;
  unsigned ndst, dst_i;
  size_t dst_off;
  uint64_t left;
  uv_buf_t errbuf;
  char errtxt[512];
  int failed;                   /* a mid-frame failure: the link is broken */
  uint64_t moved;               /* bytes written and read so far (progress) */
} dlink;

/* May a caller claim lent link l now? lend_mu held. */
static int link_claimable(const peer *l) { return link_idle_lent(l) && !l->want_back && !l->broken; }

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
  d->pending--;
  p->reply_done = 1;
  p->pm_answered = 1;
  if (d->cur.status) {
    size_t n = d->cur.payload_len < sizeof d->errtxt - 1 ? (size_t)d->cur.payload_len : sizeof d->errtxt - 1;
    d->errtxt[n] = '\0';
    req_set_error(p->req, d->cur.status, n ? d->errtxt : ps_strerror(d->cur.status));
    return;
  }
  if (p->status == 0) part_reply_ok(ctx, p, &d->cur);
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
  for (unsigned i = 0; i < d->nparts; i++)
    if (d->parts[i]->hdr.req_id == h->req_id && !d->parts[i]->reply_done) p = d->parts[i];
  if (!p) return 0; /* a reply to an earlier call that timed out: dropped */
  d->cur_p = p;
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
  if (p->recv && !pm_reply(p, h)) {
    if (h->payload_len != p->recv_len) {
      char msg[160];
      snprintf(msg, sizeof msg, "reply of %llu bytes where %zu were expected", (unsigned long long)h->payload_len, p->recv_len);
      req_set_error(p->req, PS_ERR_SIZE, msg);
      p->status = PS_ERR_SIZE;
      return 0;
    }
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
  while (d->pending > 0) {
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
        return ps__fail(PS_ERR_CLOSED, "sending to server %u: %s", d->l->id, strerror(errno));
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

/* Claim the lent links of every part of reqs[] for this thread. Returns the number of
 * links claimed into dl[] (parts grouped per link), or 0 when the call must go through
 * the loop (then links that could be lent are asked for). */
static unsigned direct_claim(ps_ctx *ctx, ps_req **reqs, unsigned nreqs, dlink *dl, unsigned max) {
  for (int attempt = 0;; attempt++) {
    unsigned n = 0;
    int ok = 1, ask = 0;
    if (__atomic_load_n(&ctx->outstanding, __ATOMIC_ACQUIRE) != 0) return 0;
    pthread_mutex_lock(&ctx->lend_mu);
    int fatal = 0;
    for (unsigned q = 0; q < nreqs && !fatal; q++) {
      for (unsigned i = 0; i < reqs[q]->nparts && !fatal; i++) {
        part *p = &reqs[q]->parts[i];
        unsigned j = 0;
        while (j < n && dl[j].l->id != p->target) j++;
        if (j == n) {
          peer *l = find_link(ctx, p->target);
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
      }
    }
    /* Re-check under the lock: a request posted meanwhile keeps its place in line. */
    if (ok && __atomic_load_n(&ctx->outstanding, __ATOMIC_ACQUIRE) != 0) ok = 0;
    if (ok)
      for (unsigned j = 0; j < n; j++) dl[j].l->busy = 1;
    pthread_mutex_unlock(&ctx->lend_mu);
    if (ok) return n;
    if (!ask || fatal || attempt > 0) return 0;
    /* Connected links that are not lent yet: ask the loop and wait for its answer (one
     * loop wake-up). Going through the loop instead would take the links back at once. */
    post_lend(ctx);
    struct timespec ts = abs_after_ms(5);
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
    l->busy = 0;
    if (dl[j].failed) l->broken = 1;
    if (l->want_back || l->broken || !l->alive) post = 1;
  }
  pthread_mutex_unlock(&ctx->lend_mu);
  if (post) ps__mailbox_post(ctx->mail, mail_reclaim, ctx);
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
static void direct_io(ps_ctx *ctx, dlink *dl, unsigned n, uint64_t deadline_ms, int spin) {
  struct pollfd pf[64];
  uint64_t t0 = ps__now_ns(), moved = 0, sending = 0;
  for (unsigned j = 0; j < n; j++) {
    dlink *d = &dl[j];
    unsigned niov = 0;
    for (unsigned k = 0; k < d->nparts; k++) niov += 1 + d->parts[k]->nsend;
    d->iov = niov <= sizeof d->iov_small / sizeof d->iov_small[0] ? d->iov_small : ps__malloc(niov * sizeof *d->iov);
    if (!d->iov) {
      for (unsigned k = 0; k < d->nparts; k++) req_set_error(d->parts[k]->req, PS_ERR_NOMEM, "out of memory");
      continue;
    }
    for (unsigned k = 0; k < d->nparts; k++) {
      part *p = d->parts[k];
      uint64_t total = 0;
      for (unsigned b = 0; b < p->nsend; b++) total += p->send[b].len;
      p->hdr.sender = ctx->id;
      p->hdr.payload_len = total;
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
    }
  }
  uint64_t window = ctx->spin_ns + ps__poll_extra_ns(sending);
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
        for (unsigned k = 0; k < d->nparts; k++)
          if (!d->parts[k]->reply_done) req_set_error(d->parts[k]->req, PS_ERR_UNAVAILABLE, msg);
        continue;
      }
      if (d->iov_at < d->niov || d->pending) {
        busy++;
        if (np < 64) {
          pf[np].fd = d->fd;
          pf[np].events = (short)((d->iov_at < d->niov ? POLLOUT : 0) | (d->pending ? POLLIN : 0));
          pf[np].revents = 0;
          np++;
        }
      }
    }
    if (!busy) break;
    uint64_t total = 0;
    for (unsigned j = 0; j < n; j++) total += dl[j].moved;
    if (total != moved) {
      moved = total;
      t0 = ps__now_ns();
    }
    uint64_t now = ps__now_ms();
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
          if (!d->parts[k]->reply_done) req_set_error(d->parts[k]->req, PS_ERR_TIMEOUT, msg);
      }
      break;
    }
    if (spin && ps__now_ns() - t0 < window) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    uint64_t wait = deadline_ms - now;
    poll(pf, np, wait > 1000 ? 1000 : (int)wait);
  }
  for (unsigned j = 0; j < n; j++) {
    dlink *d = &dl[j];
    if (d->iov != d->iov_small) free(d->iov);
    d->iov = NULL;
  }
}

#define PM_NOSPIN_BYTES (512u << 10)

/* Run requests on lent links if they can be claimed. Returns 1 when done here (the
 * requests' statuses say how it went), 0 when they must go through the loop. */
static int direct_run(ps_ctx *ctx, ps_req **reqs, unsigned nreqs, uint64_t deadline_ms) {
  dlink dl[16];
  if (!ctx->direct || !ctx->thread_started) return 0;
  unsigned n = direct_claim(ctx, reqs, nreqs, dl, 16);
  if (n == 0) return 0;
  __atomic_add_fetch(&ctx->direct_calls, 1, __ATOMIC_RELAXED);
  /* No polling while servers copy large peer-memory parts: no bytes move on the socket
   * meanwhile, the answer comes after the copy (about 100 us per MiB), and a polling
   * caller takes a CPU the servers need when workers and servers share the cores. */
  uint64_t pm_bytes = 0;
  for (unsigned j = 0; j < n; j++)
    for (unsigned k = 0; k < dl[j].nparts; k++) pm_bytes += dl[j].parts[k]->pm_bytes;
  direct_io(ctx, dl, n, deadline_ms, ctx->spin_ns > 0 && pm_bytes < PM_NOSPIN_BYTES);
  direct_release(ctx, dl, n);
  /* A peer-memory part left unanswered (a failed link) keeps the caller's buffers until
   * its deadline, as on the loop (part_finish). */
  for (int held = 1; held;) {
    held = 0;
    for (unsigned j = 0; j < n; j++)
      for (unsigned k = 0; k < dl[j].nparts && dl[j].failed != PS_ERR_CLOSED; k++) held |= pm_must_hold(dl[j].parts[k]);
    if (held) usleep(20000);
  }
  for (unsigned q = 0; q < nreqs; q++) {
    ps_req *r = reqs[q];
    if (r->status == 0) req_rows_done(r);
    r->done = 1;
  }
  return 1;
}

/* A fire-and-forget frame to every server (CLOCK) written on lent links, when every
 * server's link is lent and idle. Returns 1 when sent here, 0 to go through the loop. */
static int direct_fire(ps_ctx *ctx, const ps__frame_hdr *h0) {
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
  __atomic_add_fetch(&ctx->direct_calls, 1, __ATOMIC_RELAXED);
  return 1;
}

/* Blocking calls: on lent links when possible, else through the loop. reqs[] are
 * sent in order (a push then a pull of ps_push_pull). On timeout a request running on
 * the loop is canceled. */
static int req_run_n(ps_ctx *ctx, ps_req **reqs, unsigned nreqs, int timeout_ms) {
  uint64_t tmo = timeout_ms < 0 ? ctx->timeout_ms : (uint64_t)timeout_ms;
  uint64_t t0 = ps__now_ns();
  int rc = 0;
  char msg[256] = "";
  if (direct_run(ctx, reqs, nreqs, ps__now_ms() + tmo)) {
    uint64_t dt = ps__now_ns() - t0;
    for (unsigned q = 0; q < nreqs; q++) {
      __atomic_add_fetch(&ctx->wait_ns[reqs[q]->kind], dt / nreqs, __ATOMIC_RELAXED);
      if (reqs[q]->status && !rc) {
        rc = reqs[q]->status;
        snprintf(msg, sizeof msg, "%s", reqs[q]->msg);
      }
      req_destroy(reqs[q]);
    }
    if (rc) ps__fail(rc, "%s", msg);
    return rc;
  }
  unsigned posted = 0;
  for (; posted < nreqs; posted++)
    if ((rc = req_post(ctx, reqs[posted]))) break;
  for (unsigned q = posted; q < nreqs; q++) req_destroy(reqs[q]);
  for (unsigned q = 0; q < posted; q++) {
    uint64_t spent = (ps__now_ns() - t0) / 1000000u;
    int left = spent >= tmo ? 0 : (int)(tmo - spent);
    int st = rc ? rc : ps_req_wait(reqs[q], left);
    if (st && !rc) {
      rc = st;
      snprintf(msg, sizeof msg, "%s", ps_errmsg());
    }
    ps_req_free(reqs[q]);
  }
  if (rc) ps__fail(rc, "%s", msg[0] ? msg : ps_strerror(rc));
  return rc;
}

/* Run a request to completion within timeout_ms; cancel it on timeout. */
static int req_run(ps_ctx *ctx, ps_req *r, int timeout_ms) {
  if (r->kind != 2) return req_run_n(ctx, &r, 1, timeout_ms);
  int rc = req_post(ctx, r);
  if (rc) {
    req_destroy(r);
    return rc;
  }
  rc = ps_req_wait(r, timeout_ms);
  char msg[256];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  ps_req_free(r);
  if (rc) ps__fail(rc, "%s", msg);
  return rc;
}

/* Called before the context is checked: a NULL ctx must reach ctx_check (INVALID). */
static uint64_t deadline_for(ps_ctx *ctx, int timeout_ms) {
  uint64_t t = timeout_ms >= 0 ? (uint64_t)timeout_ms : ctx ? ctx->timeout_ms : 0;
  return ps__now_ms() + t + 50;
}

/* Snapshot of routing state for one request. */
static int route_state(ps_ctx *ctx, uint32_t table, table_info *ti, ps__ring **ring) {
  int rc = ctx_state_err(ctx);
  if (rc) return rc;
  pthread_mutex_lock(&ctx->mu);
  if (table == 0 || table >= ctx->ntables || ctx->tables[table].kind == 0) {
    pthread_mutex_unlock(&ctx->mu);
    return ps__fail(PS_ERR_NO_TABLE, "unknown table %u (declare it with ps_table_declare)", table);
  }
  *ti = ctx->tables[table];
  *ring = ctx->ring;
  pthread_mutex_unlock(&ctx->mu);
  if (!*ring) return ps__fail(PS_ERR_UNAVAILABLE, "no servers in the job");
  return 0;
}

/* Remember the batch behind this clock's pushes (the examples counter). */
static void note_batch(ps_ctx *ctx, uint32_t batch) {
  uint32_t cur = __atomic_load_n(&ctx->clock_batch, __ATOMIC_RELAXED);
  while (batch > cur &&
         !__atomic_compare_exchange_n(&ctx->clock_batch, &cur, batch, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}

/* ---- sparse */

static int sparse_start_keys(ps_ctx *ctx, int is_push, uint32_t table, const uint64_t *keys, size_t nkeys,
                             const float *grads, float *out, uint32_t batch, float lr, uint64_t deadline,
                             ps_req **out_req) {
  table_info ti = {0};
  ps__ring *ring = NULL;
  int rc = ctx_check(ctx);
  if (rc || (rc = route_state(ctx, table, &ti, &ring))) return rc;
  if (ti.kind != PS_SPARSE) return ps__fail(PS_ERR_INVALID, "table %u is dense: use ps_%s_range", table, is_push ? "push" : "pull");
  if (nkeys && !keys) return ps__fail(PS_ERR_INVALID, "keys is NULL");
  if (nkeys && is_push && !grads) return ps__fail(PS_ERR_INVALID, "grads is NULL");
  if (nkeys && !is_push && !out) return ps__fail(PS_ERR_INVALID, "out is NULL");
  if (nkeys > UINT32_MAX) return ps__fail(PS_ERR_TOO_LARGE, "%zu keys in one call (at most %u)", nkeys, UINT32_MAX);
  if (is_push && ti.update == PS__UPDATE_MEAN && batch == 0 && nkeys)
    return ps__fail(PS_ERR_INVALID, "push with batch size 0 to a mean-mode table");
  size_t S = ps__ring_size(ring);
  size_t w = ti.width;
  uint64_t bytes = (uint64_t)nkeys * (8 + 4 * w);
  if (bytes > ctx->max_payload) return ps__fail(PS_ERR_TOO_LARGE, "request of %llu bytes exceeds max_frame_mb", (unsigned long long)bytes);
  int64_t clock = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED);

  /* Route: owner index per key. */
  uint32_t *owner = NULL;
  size_t *count = ps__calloc(S, sizeof *count);
  if (!count) return ps__fail(PS_ERR_NOMEM, "out of memory");
  size_t single = SIZE_MAX; /* the one server holding every key, if so */
  if (S == 1) {
    count[0] = nkeys;
    single = 0;
  } else if (nkeys) {
    owner = ubuf_get(ctx, nkeys * sizeof *owner);
    if (!owner) {
      free(count);
      return ps__fail(PS_ERR_NOMEM, "out of memory");
    }
    for (size_t i = 0; i < nkeys; i++) {
      owner[i] = (uint32_t)ps__ring_owner_index(ring, table, keys[i]);
      count[owner[i]]++;
    }
    for (size_t s = 0; s < S; s++)
      if (count[s] == nkeys) single = s;
  }
  /* Pushes go to every server (empty where no keys): each server must count this
   * worker's batch in the round's denominator. Pulls go only where keys are. */
  unsigned nparts = 0;
  for (size_t s = 0; s < S; s++) nparts += (is_push || count[s]) ? 1 : 0;
  ps_req *r = req_new(ctx, nparts, 2 * nparts);
  if (!r) {
    ubuf_put(ctx, owner, nkeys * sizeof *owner);
    free(count);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  r->kind = is_push ? 1 : 0;
  __atomic_add_fetch(&ctx->nreq[r->kind], 1, __ATOMIC_RELAXED);
  if (is_push) {
    __atomic_add_fetch(&ctx->bytes_pushed, bytes, __ATOMIC_RELAXED);
    note_batch(ctx, batch);
  }
  const uint64_t *pkeys = keys;
  const float *pvals = grads;
  float *precv = out;
  if (single == SIZE_MAX && nkeys) {
    /* Partition keys (and values or reply slots) by server, contiguous per server. */
    size_t *start = ps__calloc(S, sizeof *start);
    size_t len = nkeys * 8 + nkeys * w * 4 + (is_push ? 0 : nkeys * sizeof(uint32_t));
    uint8_t *block = ubuf_get(ctx, len);
    if (!start || !block) {
      free(start);
      ubuf_put(ctx, block, len);
      ubuf_put(ctx, owner, nkeys * sizeof *owner);
      free(count);
      req_destroy(r);
      return ps__fail(PS_ERR_NOMEM, "out of memory");
    }
    r->scratch = block;
    r->scratch_len = len;
    uint64_t *k2 = (uint64_t *)block;
    float *v2 = is_push ? (float *)(block + nkeys * 8) : NULL;
    float *rv = !is_push ? (float *)(block + nkeys * 8) : NULL;
    uint32_t *pos = !is_push ? (uint32_t *)(block + nkeys * 8 + nkeys * w * 4) : NULL;
    for (size_t s = 1; s < S; s++) start[s] = start[s - 1] + count[s - 1];
    for (size_t i = 0; i < nkeys; i++) {
      size_t j = start[owner[i]]++;
      k2[j] = keys[i];
      if (is_push)
        memcpy(v2 + j * w, grads + i * w, w * 4);
      else
        pos[j] = (uint32_t)i;
    }
    free(start);
    r->own_recv = rv;
    r->pos = pos;
    r->out = out;
    r->width = (unsigned)w;
    r->nkeys = nkeys;
    pkeys = k2;
    pvals = v2;
    precv = rv;
  }
  size_t base = 0;
  unsigned pi = 0;
  for (size_t s = 0; s < S; s++) {
    size_t n = (single == SIZE_MAX) ? count[s] : (s == single ? nkeys : 0);
    if (!is_push && n == 0) continue;
    part_init(ctx, r, pi, ps__ring_server_at(ring, s), is_push ? PS_MSG_PUSH : PS_MSG_PULL, table, deadline);
    part *p = &r->parts[pi];
    p->hdr.nkeys = (uint32_t)n;
    p->hdr.clock = clock;
    p->send = &r->bufs[2 * pi];
    p->nsend = 0;
    if (n) {
      p->send[p->nsend].base = (char *)(pkeys + base);
      p->send[p->nsend++].len = n * 8;
      if (is_push) {
        p->send[p->nsend].base = (char *)(pvals + base * w);
        p->send[p->nsend++].len = n * w * 4;
      }
    }
    if (is_push) {
      p->hdr.batch = batch;
      p->hdr.lr = lr < 0 ? PS_LR_SCHEDULE : lr;
    } else {
      p->recv = &r->bufs[2 * pi + 1];
      p->recv->base = (char *)(precv + base * w);
      p->recv->len = n * w * 4;
      p->nrecv = 1;
      p->recv_len = n * w * 4;
    }
    base += n;
    pi++;
  }
  if (owner) ubuf_put(ctx, owner, nkeys * sizeof *owner);
  free(count);
  *out_req = r;
  return 0;
}

/* A pull of at least DEDUP_MIN_KEYS keys with rows of at least DEDUP_MIN_ROW_BYTES asks
 * for each distinct key once when at most DEDUP_MAX_SHARE of its keys are distinct, and
 * copies the rows to the repeats when the reply is in (req_rows_done): heavy-tailed
 * batches repeat their hot keys (a 100k-key Zipf(1.1) batch of bench_sparse holds 29k
 * distinct keys), and every repeat would cost a lookup on the server and a row on the
 * wire. The answer is the same. `dedup=0` (PSHARD_DEDUP=0) turns it off. */
#define DEDUP_MIN_KEYS 1024u
#define DEDUP_MIN_ROW_BYTES 32u
#define DEDUP_MAX_SHARE 0.8

/* Distinct keys of keys[n] in first-seen order into a pooled block: ukeys[nu], then
 * idx[n] (the distinct index of each key). 1 if worth it (set *blockp, *block_len, *nu),
 * 0 if not (or out of memory: the plain path then runs). */
static int dedup_keys(ps_ctx *ctx, const uint64_t *keys, size_t n, void **blockp, size_t *block_len, size_t *nu_out) {
  size_t cap = 1024;
  while (cap < 2 * n) cap *= 2;
  size_t len = n * 8 + n * 4 + cap * 4;
  uint8_t *block = ubuf_get(ctx, len);
  if (!block) return 0;
  uint64_t *ukeys = (uint64_t *)block;
  uint32_t *idx = (uint32_t *)(block + n * 8), *slot = idx + n; /* slot: distinct index + 1, 0 = empty */
  memset(slot, 0, cap * 4);
  size_t mask = cap - 1, nu = 0, limit = (size_t)(DEDUP_MAX_SHARE * (double)n);
  for (size_t j = 0; j < n; j++) {
    uint64_t k = keys[j];
    size_t h = (size_t)ps__mix64(k) & mask;
    for (;; h = (h + 1) & mask) {
      uint32_t u = slot[h];
      if (!u) {
        slot[h] = (uint32_t)++nu;
        ukeys[nu - 1] = k;
        idx[j] = (uint32_t)(nu - 1);
        break;
      }
      if (ukeys[u - 1] == k) {
        idx[j] = u - 1;
        break;
      }
    }
    if (nu > limit) { /* mostly distinct: not worth a second copy of the rows */
      ubuf_put(ctx, block, len);
      return 0;
    }
  }
  *blockp = block;
  *block_len = len;
  *nu_out = nu;
  return 1;
}

static int sparse_start(ps_ctx *ctx, int is_push, uint32_t table, const uint64_t *keys, size_t nkeys,
                        const float *grads, float *out, uint32_t batch, float lr, uint64_t deadline, ps_req **out_req) {
  unsigned w = 0;
  if (ctx && !is_push && ctx->dedup && nkeys >= DEDUP_MIN_KEYS && nkeys <= UINT32_MAX && keys && out) {
    pthread_mutex_lock(&ctx->mu);
    if (table < ctx->ntables && ctx->tables[table].kind == PS_SPARSE) w = ctx->tables[table].width;
    pthread_mutex_unlock(&ctx->mu);
  }
  void *block;
  size_t block_len, nu;
  if (w * 4u < DEDUP_MIN_ROW_BYTES || !dedup_keys(ctx, keys, nkeys, &block, &block_len, &nu))
    return sparse_start_keys(ctx, is_push, table, keys, nkeys, grads, out, batch, lr, deadline, out_req);
  size_t rows_len = nu * w * 4;
  float *rows = ubuf_get(ctx, rows_len);
  int rc = rows ? sparse_start_keys(ctx, 0, table, (const uint64_t *)block, nu, NULL, rows, 0, 0, deadline, out_req)
                : ps__fail(PS_ERR_NOMEM, "out of memory");
  if (rc) {
    ubuf_put(ctx, rows, rows_len);
    ubuf_put(ctx, block, block_len);
    return rc;
  }
  ps_req *r = *out_req;
  r->dd_block = block;
  r->dd_block_len = block_len;
  r->dd_rows = rows;
  r->dd_rows_len = rows_len;
  r->dd_idx = (const uint32_t *)((uint8_t *)block + nkeys * 8);
  r->dd_n = nkeys;
  r->dd_out = out;
  r->dd_width = w;
  return 0;
}

/* ---- dense */

/* Dense parts of at least this many bytes go by peer memory where they can: below it a
 * socket's two copies cost less than the system call's page pinning. */
#define PM_MIN_BYTES ((size_t)64 << 10)

/* The pid of target's server process if peer-memory frames may go to it, else 0. */
static int link_takes_pm(ps_ctx *ctx, uint32_t target) {
  if (!ctx->peer_mem) return 0;
  pthread_mutex_lock(&ctx->lend_mu);
  peer *l = find_link(ctx, target);
  int pm = l ? __atomic_load_n(&l->pm, __ATOMIC_RELAXED) : 0;
  pthread_mutex_unlock(&ctx->lend_mu);
  return pm;
}

static int dense_start(ps_ctx *ctx, int is_push, uint32_t table, uint64_t offset, uint64_t cnt, const float *grads,
                       float *out, uint32_t batch, float lr, uint64_t deadline, ps_req **out_req) {
  table_info ti = {0};
  ps__ring *ring = NULL;
  int rc = ctx_check(ctx);
  if (rc || (rc = route_state(ctx, table, &ti, &ring))) return rc;
  if (ti.kind != PS_DENSE) return ps__fail(PS_ERR_INVALID, "table %u is sparse: use ps_%s", table, is_push ? "push" : "pull");
  if (cnt == 0 || offset >= ti.size || cnt > ti.size - offset)
    return ps__fail(PS_ERR_RANGE, "range [%llu, %llu) outside a table of %llu floats", (unsigned long long)offset,
                    (unsigned long long)(offset + cnt), (unsigned long long)ti.size);
  if (is_push ? !grads : !out) return ps__fail(PS_ERR_INVALID, "%s is NULL", is_push ? "grads" : "out");
  if (is_push && ti.update == PS__UPDATE_MEAN && batch == 0)
    return ps__fail(PS_ERR_INVALID, "push with batch size 0 to a mean-mode table");
  if (cnt * 4 > ctx->max_payload) return ps__fail(PS_ERR_TOO_LARGE, "range of %llu floats exceeds max_frame_mb", (unsigned long long)cnt);
  size_t S = ps__ring_size(ring);
  uint64_t w = ti.width;
  uint64_t first = offset / w, last = (offset + cnt - 1) / w;
  /* Segments: runs of consecutive slices with the same owner. */
  size_t maxseg = (size_t)(last - first + 1);
  uint64_t *segs = ps__malloc(maxseg * 2 * 8);
  uint32_t *segown = ps__malloc(maxseg * sizeof *segown);
  size_t *nseg_of = ps__calloc(S, sizeof *nseg_of);
  uint32_t *order = ps__malloc(S * sizeof *order);
  if (!segs || !segown || !nseg_of || !order || !ps__ring_dense_order(ring, table, order)) {
    free(segs); free(segown); free(nseg_of); free(order);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  size_t nseg = 0;
  uint64_t nsl = (ti.size + w - 1) / w;
  for (uint64_t sl = first; sl <= last; sl++) {
    uint32_t o = order[ps__dense_run(sl, nsl, S)];
    uint64_t a = sl == first ? offset : sl * w;
    uint64_t b = sl == last ? offset + cnt : (sl + 1) * w;
    if (nseg && segown[nseg - 1] == o && segs[2 * (nseg - 1)] + segs[2 * (nseg - 1) + 1] == a) {
      segs[2 * (nseg - 1) + 1] += b - a;
    } else {
      segs[2 * nseg] = a;
      segs[2 * nseg + 1] = b - a;
      segown[nseg] = o;
      nseg_of[o]++;
      nseg++;
    }
  }
  free(order);
  unsigned nparts = 0;
  for (size_t s = 0; s < S; s++) nparts += (is_push || nseg_of[s]) ? 1 : 0;
  /* Per part: 1 buffer for its segment list, 1 for its peer-memory descriptors, plus
   * one region per segment. segbuf: the segment lists, then the descriptors (one
   * (address, length) pair per segment). */
  ps_req *r = req_new(ctx, nparts, 2 * nparts + (unsigned)nseg);
  uint64_t *segbuf = ps__malloc(((nseg ? nseg : 1) * 4 + 2 * (size_t)nparts) * 8);
  if (!r || !segbuf) {
    free(segs); free(segown); free(nseg_of); free(segbuf);
    if (r) req_destroy(r);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  r->own_segs = segbuf;
  r->kind = is_push ? 1 : 0;
  __atomic_add_fetch(&ctx->nreq[r->kind], 1, __ATOMIC_RELAXED);
  if (is_push) {
    __atomic_add_fetch(&ctx->bytes_pushed, cnt * 4 + nseg * 16, __ATOMIC_RELAXED);
    note_batch(ctx, batch);
  }
  int64_t clock = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED);
  unsigned pi = 0, bi = 0;
  size_t sb = 0;
  uint64_t *descs = segbuf + 2 * nseg; /* per part: expiry, reserved, then its pairs */
  /* The server may touch the caller's buffers until PM_SLACK_MS before the deadline;
   * the caller gets them back at the deadline at the latest (part_finish). */
  int pm_time = deadline >= ps__now_ms() + 2 * PM_SLACK_MS;
  for (size_t s = 0; s < S; s++) {
    if (!is_push && !nseg_of[s]) continue;
    uint32_t target = ps__ring_server_at(ring, s);
    part_init(ctx, r, pi, target, is_push ? PS_MSG_PUSH_DENSE : PS_MSG_PULL_DENSE, table, deadline);
    part *p = &r->parts[pi];
    p->hdr.clock = clock;
    p->hdr.nkeys = (uint32_t)(2 * nseg_of[s]);
    /* regs: segment list, descriptors, then the values' regions. */
    uv_buf_t *regs = &r->bufs[bi];
    unsigned nreg = 2;
    size_t sb0 = sb;
    regs[0] = uv_buf_init((char *)(segbuf + 2 * sb), (unsigned)(nseg_of[s] * 16));
    uint64_t *tail = descs + 2 * (sb + pi);
    regs[1] = uv_buf_init((char *)tail, (unsigned)(16 + nseg_of[s] * 16));
    tail[0] = deadline - PM_SLACK_MS;
    tail[1] = 0;
    size_t bytes = 0;
    for (size_t k = 0; k < nseg; k++) {
      if (segown[k] != s) continue;
      segbuf[2 * sb] = segs[2 * k];
      segbuf[2 * sb + 1] = segs[2 * k + 1];
      uint64_t rel = segs[2 * k] - offset;
      uv_buf_t rb;
      rb.base = is_push ? (char *)(grads + rel) : (char *)(out + rel);
      rb.len = segs[2 * k + 1] * 4;
      tail[2 + 2 * (sb - sb0)] = (uint64_t)(uintptr_t)rb.base;
      tail[3 + 2 * (sb - sb0)] = rb.len;
      sb++;
      bytes += rb.len;
      regs[nreg++] = rb;
    }
    bi += nreg;
    /* A large part to a server on this host goes by peer memory: the frame names the
     * caller's buffers, the server copies from or into them (net/peermem.c). */
    int pm = pm_time && bytes >= PM_MIN_BYTES ? link_takes_pm(ctx, target) : 0;
    if (pm) {
      p->pm_pid = pm;
      p->pm_bytes = bytes;
      __atomic_add_fetch(&ctx->pm_parts, 1, __ATOMIC_RELAXED);
      p->hdr.codec = PS_CODEC_PEER_MEM;
      /* Regions in one ps_alloc buffer: the server may map it instead (net/shared.c). */
      tail[1] = ps__shm_hint(tail + 2, nseg_of[s]);
      if (tail[1]) __atomic_add_fetch(&ctx->shared_parts, 1, __ATOMIC_RELAXED);
      for (size_t k = 0; k < 2 + 2 * nseg_of[s]; k++) ps__put_u64((uint8_t *)&tail[k], tail[k]); /* little-endian */
    }
    if (is_push) {
      p->send = regs;
      p->nsend = nseg_of[s] ? (pm ? 2 : nreg) : 0;
      if (!pm && nseg_of[s]) { /* the segment list, then the values: drop the descriptors */
        regs[1] = regs[0];
        p->send = regs + 1;
        p->nsend = nreg - 1;
      }
      p->hdr.batch = batch;
      p->hdr.lr = lr < 0 ? PS_LR_SCHEDULE : lr;
    } else {
      p->send = regs;
      p->nsend = pm ? 2 : 1;
      p->recv = regs + 2; /* also where inline values of a peer-memory pull go */
      p->nrecv = nreg - 2;
      p->recv_len = bytes;
    }
    pi++;
  }
  free(segs);
  free(segown);
  free(nseg_of);
  *out_req = r;
  return 0;
}

#define CTX_DEADLINE(ctx) deadline_for(ctx, -1)

int ps_pull_start(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys, float *out, ps_req **req) {
  if (!req) return ps__fail(PS_ERR_INVALID, "req is NULL");
  int rc = sparse_start(ctx, 0, table, keys, nkeys, NULL, out, 0, 0, CTX_DEADLINE(ctx), req);
  if (!rc && (rc = req_post(ctx, *req))) req_destroy(*req);
  return rc;
}

int ps_push_start(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys, const float *grads, uint32_t batch,
                  float lr, ps_req **req) {
  if (!req) return ps__fail(PS_ERR_INVALID, "req is NULL");
  int rc = sparse_start(ctx, 1, table, keys, nkeys, grads, NULL, batch, lr, CTX_DEADLINE(ctx), req);
  if (!rc && (rc = req_post(ctx, *req))) req_destroy(*req);
  return rc;
}

int ps_pull_range_start(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count, float *out, ps_req **req) {
  if (!req) return ps__fail(PS_ERR_INVALID, "req is NULL");
  int rc = dense_start(ctx, 0, table, offset, count, NULL, out, 0, 0, CTX_DEADLINE(ctx), req);
  if (!rc && (rc = req_post(ctx, *req))) req_destroy(*req);
  return rc;
}

int ps_push_range_start(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count, const float *grads,
                        uint32_t batch, float lr, ps_req **req) {
  if (!req) return ps__fail(PS_ERR_INVALID, "req is NULL");
  int rc = dense_start(ctx, 1, table, offset, count, grads, NULL, batch, lr, CTX_DEADLINE(ctx), req);
  if (!rc && (rc = req_post(ctx, *req))) req_destroy(*req);
  return rc;
}

int ps_pull(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys, float *out, int timeout_ms) {
  ps_req *r;
  int rc = sparse_start(ctx, 0, table, keys, nkeys, NULL, out, 0, 0, deadline_for(ctx, timeout_ms), &r);
  return rc ? rc : req_run(ctx, r, timeout_ms);
}

int ps_push(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys, const float *grads, uint32_t batch,
            float lr, int timeout_ms) {
  ps_req *r;
  int rc = sparse_start(ctx, 1, table, keys, nkeys, grads, NULL, batch, lr, deadline_for(ctx, timeout_ms), &r);
  return rc ? rc : req_run(ctx, r, timeout_ms);
}

int ps_pull_range(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count, float *out, int timeout_ms) {
  ps_req *r;
  int rc = dense_start(ctx, 0, table, offset, count, NULL, out, 0, 0, deadline_for(ctx, timeout_ms), &r);
  return rc ? rc : req_run(ctx, r, timeout_ms);
}

int ps_push_range(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count, const float *grads, uint32_t batch,
                  float lr, int timeout_ms) {
  ps_req *r;
  int rc = dense_start(ctx, 1, table, offset, count, grads, NULL, batch, lr, deadline_for(ctx, timeout_ms), &r);
  return rc ? rc : req_run(ctx, r, timeout_ms);
}

int ps_push_pull(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys, const float *grads, uint32_t batch,
                 float lr, float *out, int timeout_ms) {
  ps_req *r[2];
  uint64_t dl = deadline_for(ctx, timeout_ms);
  int rc = sparse_start(ctx, 1, table, keys, nkeys, grads, NULL, batch, lr, dl, &r[0]);
  if (rc) return rc;
  if ((rc = sparse_start(ctx, 0, table, keys, nkeys, NULL, out, 0, 0, dl, &r[1]))) {
    req_destroy(r[0]);
    return rc;
  }
  return req_run_n(ctx, r, 2, timeout_ms);
}

int ps_push_pull_range(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count, const float *grads,
                       uint32_t batch, float lr, float *out, int timeout_ms) {
  ps_req *r[2];
  uint64_t dl = deadline_for(ctx, timeout_ms);
  int rc = dense_start(ctx, 1, table, offset, count, grads, NULL, batch, lr, dl, &r[0]);
  if (rc) return rc;
  if ((rc = dense_start(ctx, 0, table, offset, count, NULL, out, 0, 0, dl, &r[1]))) {
    req_destroy(r[0]);
    return rc;
  }
  return req_run_n(ctx, r, 2, timeout_ms);
}

/* ---- control requests */

/* One request with a single control part to `target` carrying body (copied). */
static ps_req *ctrl_req(ps_ctx *ctx, uint32_t target, uint8_t type, const void *body, size_t len, uint64_t deadline) {
  ps_req *r = req_new(ctx, 1, 1);
  if (!r) return NULL;
  if (len) {
    r->own_keys = ps__malloc(len);
    if (!r->own_keys) {
      req_destroy(r);
      return NULL;
    }
    memcpy(r->own_keys, body, len);
  }
  part_init(ctx, r, 0, target, type, 0, deadline);
  r->kind = 2;
  r->bufs[0] = uv_buf_init(r->own_keys, (unsigned)len);
  r->parts[0].send = r->bufs;
  r->parts[0].nsend = len ? 1 : 0;
  return r;
}

int ps_table_declare(ps_ctx *ctx, const char *name, ps_table_kind kind, uint64_t size, const char *options,
                     uint32_t *id_out) {
  ps__declare d;
  ps__table_spec spec;
  char err[256];
  ps__wbuf w;
  int rc = ctx_check(ctx);
  if (rc || (rc = ctx_state_err(ctx))) return rc;
  if (!name || !*name || strlen(name) >= PS_NAME_MAX) return ps__fail(PS_ERR_INVALID, "table name must be 1..%d bytes", PS_NAME_MAX - 1);
  if (options && strlen(options) >= PS_OPTS_MAX) return ps__fail(PS_ERR_CONFIG, "table options longer than %d bytes", PS_OPTS_MAX - 1);
  /* A table without its own mode= gets the job's (config key `mode`). */
  char opts[PS_OPTS_MAX];
  const char *o = options ? options : "";
  int has_mode = !strncmp(o, "mode=", 5) || strstr(o, " mode=") || strstr(o, "\tmode=");
  if (!has_mode && ctx->mode[0]) {
    if ((size_t)snprintf(opts, sizeof opts, "%s%smode=%s", o, *o ? " " : "", ctx->mode) >= sizeof opts)
      return ps__fail(PS_ERR_CONFIG, "table options too long");
  } else {
    snprintf(opts, sizeof opts, "%s", o);
  }
  rc = ps__table_spec_parse(&spec, name, (int)kind, size, opts, err, sizeof err);
  if (rc) return ps__fail(rc, "table '%s': %s", name, err);
  memset(&d, 0, sizeof d);
  d.kind = (uint8_t)kind;
  d.size = size;
  snprintf(d.name, sizeof d.name, "%s", name);
  snprintf(d.options, sizeof d.options, "%s", opts);
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &d);
  if (w.oom) return ps__fail(PS_ERR_NOMEM, "out of memory");
  ps_req *r = ctrl_req(ctx, SCHED_LINK, PS_MSG_DECLARE, w.data, w.len, deadline_for(ctx, -1));
  ps__wbuf_free(&w);
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  rc = req_post(ctx, r);
  if (rc) {
    req_destroy(r);
    return rc;
  }
  rc = ps_req_wait(r, -1);
  uint32_t id = r->parts[0].reply_table;
  char msg[256];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  ps_req_free(r);
  if (rc) return ps__fail(rc, "%s", msg);
  if (id == 0 || id >= 65536) return ps__fail(PS_ERR_PROTO, "scheduler returned a bad table id %u", id);

  /* Create it on every server (idempotent). */
  d.id = id;
  ps__wbuf_init(&w);
  ps__declare_encode(&w, &d);
  pthread_mutex_lock(&ctx->mu);
  ps__ring *ring = ctx->ring;
  pthread_mutex_unlock(&ctx->mu);
  size_t S = ring ? ps__ring_size(ring) : 0;
  r = req_new(ctx, (unsigned)S, 1);
  if (w.oom || !r || !(r->own_keys = ps__malloc(w.len))) {
    ps__wbuf_free(&w);
    if (r) req_destroy(r);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  memcpy(r->own_keys, w.data, w.len);
  r->bufs[0] = uv_buf_init(r->own_keys, (unsigned)w.len);
  ps__wbuf_free(&w);
  for (size_t s = 0; s < S; s++) {
    part_init(ctx, r, (unsigned)s, ps__ring_server_at(ring, s), PS_MSG_CREATE, id, deadline_for(ctx, -1));
    r->parts[s].send = r->bufs;
    r->parts[s].nsend = 1;
  }
  rc = req_run(ctx, r, -1);
  if (rc) return rc;
  pthread_mutex_lock(&ctx->mu);
  if (id >= ctx->ntables) {
    table_info *nt = ps__realloc(ctx->tables, (id + 1u) * sizeof *nt);
    if (!nt) {
      pthread_mutex_unlock(&ctx->mu);
      return ps__fail(PS_ERR_NOMEM, "out of memory");
    }
    memset(nt + ctx->ntables, 0, (id + 1u - ctx->ntables) * sizeof *nt);
    ctx->tables = nt;
    ctx->ntables = id + 1u;
  }
  ctx->tables[id].kind = (int)kind;
  ctx->tables[id].size = size;
  ctx->tables[id].width = spec.width;
  ctx->tables[id].nrows = spec.nrows;
  ctx->tables[id].update = spec.update;
  pthread_mutex_unlock(&ctx->mu);
  if (id_out) *id_out = id;
  return 0;
}

static int post_fire(ps_ctx *ctx, uint32_t target, const ps__frame_hdr *h, const void *body, size_t len) {
  fire *f = ps__malloc(sizeof *f + len);
  if (!f) return ps__fail(PS_ERR_NOMEM, "out of memory");
  f->ctx = ctx;
  f->target = target;
  f->h = *h;
  f->len = len;
  if (len) memcpy(f->body, body, len);
  __atomic_add_fetch(&ctx->outstanding, 1, __ATOMIC_ACQ_REL);
  if (ps__mailbox_post(ctx->mail, mail_fire, f)) {
    __atomic_sub_fetch(&ctx->outstanding, 1, __ATOMIC_RELEASE);
    free(f);
    return ps__fail(PS_ERR_CLOSED, "context is closed");
  }
  return 0;
}

int ps_clock(ps_ctx *ctx) {
  int rc = ctx_check(ctx);
  if (rc || (rc = ctx_state_err(ctx))) return rc;
  int64_t c = __atomic_add_fetch(&ctx->clock, 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&ctx->examples, __atomic_exchange_n(&ctx->clock_batch, 0, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
  ps__frame_hdr h = {.type = PS_MSG_CLOCK, .clock = c};
  if (direct_fire(ctx, &h)) return 0;
  return post_fire(ctx, 0xffffffffu, &h, NULL, 0);
}

int ps_barrier(ps_ctx *ctx, int timeout_ms) {
  int rc = ctx_check(ctx);
  if (rc || (rc = ctx_state_err(ctx))) return rc;
  ps_req *r = ctrl_req(ctx, SCHED_LINK, PS_MSG_BARRIER, NULL, 0, deadline_for(ctx, timeout_ms));
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  /* The sequence advances only when a barrier is passed: a call after a failed one
   * (timeout) enters the same barrier again. The scheduler may have completed it in
   * the meantime; it then answers at once. */
  int64_t seq = __atomic_load_n(&ctx->barrier_seq, __ATOMIC_RELAXED) + 1;
  r->parts[0].hdr.clock = seq;
  rc = req_run(ctx, r, timeout_ms);
  if (rc == 0) __atomic_store_n(&ctx->barrier_seq, seq, __ATOMIC_RELAXED);
  return rc;
}

int ps_metric(ps_ctx *ctx, const char *name, double value) {
  int rc = ctx_check(ctx);
  if (rc || (rc = ctx_state_err(ctx))) return rc;
  if (!name || !*name || strlen(name) >= 64) return ps__fail(PS_ERR_INVALID, "metric name must be 1..63 bytes");
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__wbuf_str(&w, name);
  ps__wbuf_f64(&w, value);
  ps__frame_hdr h = {.type = PS_MSG_METRIC, .clock = __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED)};
  rc = w.oom ? ps__fail(PS_ERR_NOMEM, "out of memory") : post_fire(ctx, SCHED_LINK, &h, w.data, w.len);
  ps__wbuf_free(&w);
  return rc;
}

/* ---- context lifecycle */

int ps_ctx_rank(const ps_ctx *ctx) { return ctx ? ctx->rank : -1; }
int ps_ctx_num_workers(const ps_ctx *ctx) { return ctx ? __atomic_load_n(&ctx->nworkers, __ATOMIC_RELAXED) : 0; }
int ps_ctx_num_servers(const ps_ctx *ctx) { return ctx ? __atomic_load_n(&ctx->nservers, __ATOMIC_RELAXED) : 0; }
int64_t ps_ctx_clock(const ps_ctx *ctx) { return ctx ? __atomic_load_n(&ctx->clock, __ATOMIC_RELAXED) : 0; }
uint64_t ps_ctx_epoch(const ps_ctx *ctx) { return ctx ? __atomic_load_n(&ctx->epoch, __ATOMIC_RELAXED) : 0; }

static void *emb_sched_main(void *arg) {
  ps__sched_run(arg);
  return NULL;
}

static void *emb_server_main(void *arg) {
  ps__server_run(arg);
  return NULL;
}

static void stop_embedded(ps_ctx *ctx) {
  for (unsigned i = 0; i < ctx->n_emb; i++) {
    if (!ctx->emb_servers[i]) continue;
    ps__server_stop(ctx->emb_servers[i]);
    pthread_join(ctx->emb_server_threads[i], NULL);
    ps__server_destroy(ctx->emb_servers[i]);
  }
  free(ctx->emb_servers);
  free(ctx->emb_server_threads);
  ctx->emb_servers = NULL;
  ctx->n_emb = 0;
  if (ctx->emb_sched) {
    ps__sched_stop(ctx->emb_sched);
    pthread_join(ctx->emb_sched_thread, NULL);
    ps__sched_destroy(ctx->emb_sched);
    ctx->emb_sched = NULL;
  }
}

/* Start n server threads registering with the scheduler at ctx->sched_host:sched_port:
 * an embedded scheduler's, or the job's (colocated servers, which bind `host` and stop
 * once no worker is alive in the job). */
static int start_servers(ps_ctx *ctx, const char *host, unsigned n, int colocated) {
  ctx->emb_servers = ps__calloc(n, sizeof *ctx->emb_servers);
  ctx->emb_server_threads = ps__calloc(n, sizeof *ctx->emb_server_threads);
  if (!ctx->emb_servers || !ctx->emb_server_threads) return ps__fail(PS_ERR_NOMEM, "out of memory");
  for (unsigned i = 0; i < n; i++) {
    ps__server_opts o = {.host = host, .sched_host = ctx->sched_host, .sched_port = ctx->sched_port,
                         .use_unix = ctx->use_unix, .heartbeat_ms = ctx->heartbeat_ms, .vnodes = ctx->vnodes,
                         .max_payload = ctx->max_payload, .connect_timeout_ms = ctx->connect_timeout_ms,
                         .stop_without_workers = colocated};
    int rc = ps__server_create(&o, &ctx->emb_servers[i]);
    if (rc) return rc;
    ctx->n_emb = i + 1;
    if (pthread_create(&ctx->emb_server_threads[i], NULL, emb_server_main, ctx->emb_servers[i])) {
      ps__server_destroy(ctx->emb_servers[i]);
      ctx->emb_servers[i] = NULL;
      return ps__fail(PS_ERR_NOMEM, "cannot start %s server thread", colocated ? "a colocated" : "an embedded");
    }
  }
  return 0;
}

static int start_embedded(ps_ctx *ctx, const ps_config *cfg, unsigned nservers, uint32_t nworkers) {
  ps__sched_opts so = {.host = "127.0.0.1", .port = 0, .servers = nservers, .workers = nworkers,
                       .heartbeat_ms = ctx->heartbeat_ms,
                       .heartbeat_timeout_ms = (uint32_t)ps__config_uint(cfg, "heartbeat_timeout_ms", 3000),
                       .max_payload = ctx->max_payload};
  int rc = ps__sched_create(&so, &ctx->emb_sched);
  if (rc) return rc;
  if (pthread_create(&ctx->emb_sched_thread, NULL, emb_sched_main, ctx->emb_sched)) {
    ps__sched_destroy(ctx->emb_sched);
    ctx->emb_sched = NULL;
    return ps__fail(PS_ERR_NOMEM, "cannot start the embedded scheduler thread");
  }
  snprintf(ctx->sched_host, sizeof ctx->sched_host, "127.0.0.1");
  ctx->sched_port = ps__sched_port(ctx->emb_sched);
  return start_servers(ctx, "127.0.0.1", nservers, 0);
}

static void mail_connect(void *arg);

static void retry_tick(uv_timer_t *t) { mail_connect(t->data); }

static void on_sched_connected(void *arg, ps__conn *c, int status) {
  ps_ctx *ctx = arg;
  /* The scheduler may not listen yet (launchers start every rank at once): retry until
   * the connect deadline; ps_ctx_open gives up then. */
  if ((status == PS_ERR_UNAVAILABLE || !c) && !ctx->closing && ps__now_ms() < ctx->connect_deadline_ms) {
    __atomic_store_n(&ctx->connect_refused, 1, __ATOMIC_RELAXED);
    uv_timer_start(&ctx->retry_timer, retry_tick, 200, 0);
    return;
  }
  if (status || !c) {
    char msg[200];
    snprintf(msg, sizeof msg, "cannot reach the scheduler at %s:%d: %s", ctx->sched_host, ctx->sched_port,
             ps_strerror(status));
    ctx_fail(ctx, PS_ERR_UNAVAILABLE, msg);
    return;
  }
  c->udata = ctx->sched;
  ctx->sched->conn = c;
  ps__hello hello;
  ps__wbuf w;
  memset(&hello, 0, sizeof hello);
  hello.role = PS_ROLE_WORKER;
  hello.pid = (uint32_t)getpid();
  snprintf(hello.hostid, sizeof hello.hostid, "%s", ctx->hostid);
  ps__wbuf_init(&w);
  ps__hello_encode(&w, &hello);
  /* The HELLO is a part of a detached request so its reply is matched like any other. */
  ps_req *r = ctrl_req(ctx, SCHED_LINK, PS_MSG_HELLO, w.data, w.len, ps__now_ms() + ctx->connect_timeout_ms);
  ps__wbuf_free(&w);
  if (!r) {
    ctx_fail(ctx, PS_ERR_NOMEM, "out of memory");
    return;
  }
  r->canceled = 2;
  part_send(ctx, ctx->sched, &r->parts[0]);
  uv_timer_start(&ctx->hb_timer, hb_tick, ctx->heartbeat_ms, ctx->heartbeat_ms);
}

static void mail_connect(void *arg) {
  ps_ctx *ctx = arg;
  int rc = ps__connect_tcp(&ctx->loop, ctx->sched_host, ctx->sched_port, &link_ops, NULL, ctx->pool, 1u << 24,
                           on_sched_connected, ctx);
  if (rc) ctx_fail(ctx, rc, ps_errmsg());
}

int ps_ctx_open(const ps_config *cfg, ps_ctx **out) {
  int rc;
  if (!out) return ps__fail(PS_ERR_INVALID, "out is NULL");
  *out = NULL;
  ps_config *empty = NULL;
  if (!cfg) {
    if ((rc = ps_config_new(&empty))) return rc;
    cfg = empty;
  }
  const char *role = ps__config_str(cfg, "role", "worker");
  if (strcmp(role, "worker")) {
    ps_config_free(empty);
    return ps__fail(PS_ERR_ROLE, "ps_ctx_open opens a worker; role is '%s' (start servers with `pshard server`)", role);
  }
  ps_ctx *ctx = ps__calloc(1, sizeof *ctx);
  if (!ctx) {
    ps_config_free(empty);
    return ps__fail(PS_ERR_NOMEM, "out of memory");
  }
  pthread_mutex_init(&ctx->mu, NULL);
  pthread_cond_init(&ctx->cv, NULL);
  ctx->timeout_ms = (uint32_t)ps__config_uint(cfg, "timeout_ms", 30000);
  ctx->connect_timeout_ms = (uint32_t)ps__config_uint(cfg, "connect_timeout_ms", 60000);
  ctx->heartbeat_ms = (uint32_t)ps__config_uint(cfg, "heartbeat_ms", 200);
  ctx->vnodes = (uint32_t)ps__config_uint(cfg, "vnodes", 128);
  ctx->max_payload = ps__config_uint(cfg, "max_frame_mb", 2048) << 20;
  ctx->use_unix = strcmp(ps__config_str(cfg, "transport", "auto"), "tcp") != 0;
  snprintf(ctx->mode, sizeof ctx->mode, "%s", ps__config_str(cfg, "mode", ""));
  ctx->opened_ns = ps__now_ns();
  ctx->spin_ns = sysconf(_SC_NPROCESSORS_ONLN) > 1 ? 50000 : 0;
  ctx->direct = (int)ps__config_uint(cfg, "direct", 1);
  ctx->dedup = (int)ps__config_uint(cfg, "dedup", 1);
  ctx->peer_mem = ps__config_uint(cfg, "peer_mem", 1) && ps__pm_usable();
  pthread_mutex_init(&ctx->lend_mu, NULL);
  pthread_cond_init(&ctx->lend_cv, NULL);
  pthread_mutex_init(&ctx->upool_mu, NULL);
  ctx->upool = ps__pool_new(512u << 20);
  if (!ctx->heartbeat_ms) ctx->heartbeat_ms = 200;
  if (!ctx->vnodes) ctx->vnodes = 128;
  ps__hostid(ctx->hostid, sizeof ctx->hostid);
  unsigned emb = (unsigned)ps__config_uint(cfg, "embedded", 0);
  uv_loop_init(&ctx->loop);
  ctx->loop.data = ctx;
  ctx->pool = ps__pool_new(256u << 20);
  ctx->mail = ps__mailbox_new(&ctx->loop);
  ctx->sched = ps__calloc(1, sizeof *ctx->sched);
  if (!ctx->pool || !ctx->mail || !ctx->sched) {
    rc = ps__fail(PS_ERR_NOMEM, "out of memory");
    goto fail;
  }
  ctx->sched->id = SCHED_LINK;
  ctx->sched->alive = 1;
  ctx->links = ctx->sched;
  uv_timer_init(&ctx->loop, &ctx->hb_timer);
  ctx->hb_timer.data = ctx;
  uv_timer_init(&ctx->loop, &ctx->sweep_timer);
  ctx->sweep_timer.data = ctx;
  uv_timer_init(&ctx->loop, &ctx->retry_timer);
  ctx->retry_timer.data = ctx;
  ctx->connect_deadline_ms = ps__now_ms() + ctx->connect_timeout_ms;
  uv_timer_start(&ctx->sweep_timer, sweep_tick, 50, 50);
  if (emb && ps__config_uint(cfg, "colocate", 0)) {
    rc = ps__fail(PS_ERR_CONFIG, "'embedded' and 'colocate' exclude each other: an embedded job has its own servers");
    goto fail;
  }
  if (emb) {
    rc = start_embedded(ctx, cfg, emb, (uint32_t)ps__config_uint(cfg, "workers", 1));
    if (rc) goto fail;
  } else {
    const char *addr = ps_config_get(cfg, "scheduler");
    if (!addr) {
      rc = ps__fail(PS_ERR_CONFIG, "no scheduler address: set 'scheduler' (PSHARD_SCHEDULER) or 'embedded'");
      goto fail;
    }
    if (ps__parse_hostport(addr, ctx->sched_host, sizeof ctx->sched_host, &ctx->sched_port)) {
      rc = ps__fail(PS_ERR_CONFIG, "bad scheduler address '%s'", addr);
      goto fail;
    }
    /* A colocated server: one more server of the job, in this process (design.md §10). */
    if (ps__config_uint(cfg, "colocate", 0)) {
      ctx->colocated = 1;
      if ((rc = start_servers(ctx, ps__config_str(cfg, "host", "127.0.0.1"), 1, 1))) goto fail;
    }
  }
  ps__mailbox_post(ctx->mail, mail_connect, ctx);
  if (pthread_create(&ctx->thread, NULL, io_main, ctx)) {
    rc = ps__fail(PS_ERR_NOMEM, "cannot start the I/O thread");
    goto fail;
  }
  ctx->thread_started = 1;

  /* Wait for registration and the job start. */
  uint64_t deadline = ps__now_ms() + ctx->connect_timeout_ms;
  pthread_mutex_lock(&ctx->mu);
  while (!ctx->failed && !(ctx->registered && ctx->started && ctx->ring)) {
    uint64_t now = ps__now_ms();
    if (now >= deadline) break;
    struct timespec ts = abs_after_ms(deadline - now < 100 ? deadline - now : 100);
    pthread_cond_timedwait(&ctx->cv, &ctx->mu, &ts);
  }
  if (ctx->failed) {
    rc = ps__fail(ctx->fail_err, "%s", ctx->fail_msg);
  } else if (!ctx->registered && __atomic_load_n(&ctx->connect_refused, __ATOMIC_RELAXED)) {
    rc = ps__fail(PS_ERR_UNAVAILABLE, "cannot reach the scheduler at %s:%d: connection refused (retried for %u ms)",
                  ctx->sched_host, ctx->sched_port, ctx->connect_timeout_ms);
  } else if (!(ctx->registered && ctx->started && ctx->ring)) {
    rc = ps__fail(PS_ERR_TIMEOUT, "the job did not start within %u ms (%s)", ctx->connect_timeout_ms,
                  ctx->registered ? "waiting for the other servers and workers" : "no answer from the scheduler");
  }
  pthread_mutex_unlock(&ctx->mu);
  if (rc) goto fail;
  ps_config_free(empty);
  *out = ctx;
  return 0;
fail: {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  ctx->colocated = 0; /* the job did not start with us: stop our server at once */
  ps_ctx_close(ctx);
  ps_config_free(empty);
  return ps__fail(rc, "%s", msg);
}
}

int ps_ctx_open_env(ps_ctx **out) {
  ps_config *cfg;
  int rc = ps_config_new(&cfg);
  if (rc) return rc;
  rc = ps_config_from_env(cfg);
  if (!rc) rc = ps_ctx_open(cfg, out);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  ps_config_free(cfg);
  if (rc) ps__fail(rc, "%s", msg);
  return rc;
}

void ps_ctx_close(ps_ctx *ctx) {
  if (!ctx) return;
  if (ctx->thread_started) {
    if (ps__mailbox_post(ctx->mail, mail_shutdown, ctx) == 0) pthread_join(ctx->thread, NULL);
  } else if (ctx->mail) {
    ctx->closing = 1;
    ps__mailbox_close(ctx->mail);
    uv_walk(&ctx->loop, walk_close, NULL);
    uv_run(&ctx->loop, UV_RUN_DEFAULT);
  } else {
    uv_walk(&ctx->loop, walk_close, NULL);
    uv_run(&ctx->loop, UV_RUN_DEFAULT);
  }
  /* The loop is gone: release held peer-memory parts at their deadlines. */
  for (int held = 1; held;) {
    held = 0;
    for (part *p = ctx->held; p; p = p->next) held |= pm_must_hold(p);
    if (held) usleep(20000);
  }
  while (ctx->held) part_finish(ctx->held);
  uv_loop_close(&ctx->loop);
  /* A colocated server serves the other workers until none is left in the job (it stops
   * by itself then), bounded by the request timeout. */
  if (ctx->colocated) {
    struct timespec ts = abs_after_ms(ctx->timeout_ms);
    for (unsigned i = 0; i < ctx->n_emb; i++) {
      if (!ctx->emb_servers[i] || pthread_timedjoin_np(ctx->emb_server_threads[i], NULL, &ts)) continue;
      ps__server_destroy(ctx->emb_servers[i]);
      ctx->emb_servers[i] = NULL;
    }
  }
  stop_embedded(ctx);
  while (ctx->links) {
    peer *l = ctx->links;
    ctx->links = l->next;
    free(l->dbuf);
    free(l);
  }
  for (size_t i = 0; i < ctx->nretired; i++) ps__ring_free(ctx->retired[i]);
  free(ctx->retired);
  ps__ring_free(ctx->ring);
  ps__pool_free(ctx->pool);
  ps__pool_free(ctx->upool);
  pthread_mutex_destroy(&ctx->upool_mu);
  pthread_mutex_destroy(&ctx->lend_mu);
  pthread_cond_destroy(&ctx->lend_cv);
  free(ctx->tables);
  pthread_mutex_destroy(&ctx->mu);
  pthread_cond_destroy(&ctx->cv);
  free(ctx);
}

/* ---- data-partition tasks */

int ps_tasks_init(ps_ctx *ctx, uint32_t partitions, uint32_t epochs) {
  int rc = ctx_check(ctx);
  if (rc || (rc = ctx_state_err(ctx))) return rc;
  if (partitions == 0 || epochs == 0) return ps__fail(PS_ERR_INVALID, "tasks need at least one partition and one epoch");
  ps_req *r = ctrl_req(ctx, SCHED_LINK, PS_MSG_TASK_INIT, NULL, 0, deadline_for(ctx, -1));
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  r->parts[0].hdr.table = partitions;
  r->parts[0].hdr.batch = epochs;
  return req_run(ctx, r, -1);
}

int ps_task_next(ps_ctx *ctx, ps_task *task, int timeout_ms) {
  int rc = ctx_check(ctx);
  if (rc || (rc = ctx_state_err(ctx))) return rc;
  if (!task) return ps__fail(PS_ERR_INVALID, "task is NULL");
  uint64_t tmo = timeout_ms < 0 ? ctx->timeout_ms : (uint64_t)timeout_ms;
  if (tmo > UINT32_MAX) tmo = UINT32_MAX;
  /* The scheduler answers TIMEOUT itself after tmo; our deadline comes later. */
  ps_req *r = ctrl_req(ctx, SCHED_LINK, PS_MSG_TASK_NEXT, NULL, 0, ps__now_ms() + tmo + 2000);
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  r->parts[0].hdr.batch = (uint32_t)tmo;
  rc = req_post(ctx, r);
  if (rc) {
    req_destroy(r);
    return rc;
  }
  rc = ps_req_wait(r, (int)(tmo + 2000 > INT32_MAX ? INT32_MAX : tmo + 2000));
  char msg[256];
  snprintf(msg, sizeof msg, "%s", ps_errmsg());
  if (rc == 0) {
    task->partition = r->parts[0].reply_table;
    task->epoch = (uint32_t)r->parts[0].reply_clock;
  }
  ps_req_free(r);
  if (rc) return ps__fail(rc, "%s", rc == PS_ERR_DONE ? "every epoch is finished" : msg);
  return 0;
}

int ps_task_done(ps_ctx *ctx, const ps_task *task) {
  int rc = ctx_check(ctx);
  if (rc || (rc = ctx_state_err(ctx))) return rc;
  if (!task) return ps__fail(PS_ERR_INVALID, "task is NULL");
  ps_req *r = ctrl_req(ctx, SCHED_LINK, PS_MSG_TASK_DONE, NULL, 0, deadline_for(ctx, -1));
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  r->parts[0].hdr.table = task->partition;
  r->parts[0].hdr.clock = task->epoch;
  return req_run(ctx, r, -1);
}

/* ---- statistics */

int ps_ctx_stat(const ps_ctx *ctx, const char *name, double *value) {
  if (!ctx || !name || !value) return ps__fail(PS_ERR_INVALID, "NULL argument");
  ps_ctx *c = (ps_ctx *)ctx;
  double up = (double)(ps__now_ns() - c->opened_ns) * 1e-9;
  double wp = (double)__atomic_load_n(&c->wait_ns[0], __ATOMIC_RELAXED) * 1e-9;
  double ws = (double)__atomic_load_n(&c->wait_ns[1], __ATOMIC_RELAXED) * 1e-9;
  double wo = (double)__atomic_load_n(&c->wait_ns[2], __ATOMIC_RELAXED) * 1e-9;
  if (!strcmp(name, "uptime_s")) *value = up;
  else if (!strcmp(name, "pull_wait_s")) *value = wp;
  else if (!strcmp(name, "push_wait_s")) *value = ws;
  else if (!strcmp(name, "other_wait_s")) *value = wo;
  else if (!strcmp(name, "compute_s")) *value = up - wp - ws - wo;
  else if (!strcmp(name, "pulls")) *value = (double)__atomic_load_n(&c->nreq[0], __ATOMIC_RELAXED);
  else if (!strcmp(name, "pushes")) *value = (double)__atomic_load_n(&c->nreq[1], __ATOMIC_RELAXED);
  else if (!strcmp(name, "bytes_pushed")) *value = (double)__atomic_load_n(&c->bytes_pushed, __ATOMIC_RELAXED);
  else if (!strcmp(name, "bytes_pulled")) *value = (double)__atomic_load_n(&c->bytes_pulled, __ATOMIC_RELAXED);
  else if (!strcmp(name, "dropped_pushes")) *value = (double)__atomic_load_n(&c->dropped_pushes, __ATOMIC_RELAXED);
  else if (!strcmp(name, "fast_forwards")) *value = (double)__atomic_load_n(&c->fast_forwards, __ATOMIC_RELAXED);
  else if (!strcmp(name, "clock")) *value = (double)__atomic_load_n(&c->clock, __ATOMIC_RELAXED);
  else if (!strcmp(name, "examples")) *value = (double)__atomic_load_n(&c->examples, __ATOMIC_RELAXED);
  else if (!strcmp(name, "direct_calls")) *value = (double)__atomic_load_n(&c->direct_calls, __ATOMIC_RELAXED);
  else if (!strcmp(name, "peer_mem_parts")) *value = (double)__atomic_load_n(&c->pm_parts, __ATOMIC_RELAXED);
  else if (!strcmp(name, "shared_parts")) *value = (double)__atomic_load_n(&c->shared_parts, __ATOMIC_RELAXED);
  else return ps__fail(PS_ERR_INVALID, "unknown statistic '%s'", name);
  return 0;
}

int ps_server_stats(ps_ctx *ctx, int server, char *buf, size_t cap, int timeout_ms) {
  int rc = ctx_check(ctx);
  if (rc || (rc = ctx_state_err(ctx))) return rc;
  if (!buf || cap == 0) return ps__fail(PS_ERR_INVALID, "no buffer");
  pthread_mutex_lock(&ctx->mu);
  ps__ring *ring = ctx->ring;
  pthread_mutex_unlock(&ctx->mu);
  if (!ring || server < 0 || (size_t)server >= ps__ring_size(ring))
    return ps__fail(PS_ERR_RANGE, "no server %d (the job has %zu)", server, ring ? ps__ring_size(ring) : (size_t)0);
  ps_req *r = ctrl_req(ctx, ps__ring_server_at(ring, (size_t)server), PS_MSG_STATS, NULL, 0, deadline_for(ctx, timeout_ms));
  if (!r) return ps__fail(PS_ERR_NOMEM, "out of memory");
  /* The text reply lands in a buffer of the caller's size (one byte kept for the NUL). */
  r->parts[0].stats_buf = buf;
  r->parts[0].stats_cap = cap;
  return req_run(ctx, r, timeout_ms);
}

