/*
 * client_int.h - the worker side's shared structures and the calls between its files.
 *
 * The worker side is cut by job, and each piece reports upward only through what it
 * was given:
 *   ctx.c      context and configuration: open, close, the I/O thread, the scheduler
 *              link (through the node agent), heartbeats and their statistics
 *   req.c      requests: parts, completion, wait, cancel, deadlines, blocking runs
 *   link.c     links to the servers and the scheduler: connect, send, receive, lend,
 *              membership applied to the links and the ring, fire-and-forget frames
 *   route.c    routing: keys and ranges to parts by the ring, de-duplicated pulls, the
 *              push and pull entry points; each dense part's value transport is chosen
 *              and described through net/xport.h, whose calls link.c, req.c and
 *              direct.c also use to read replies and to give the caller's buffers back
 *   direct.c   the caller-thread fast path: blocking calls on lent links
 *   control.c  control calls: declare, clock, checkpoint, barrier, metric, tasks,
 *              statistics
 * Embedded mode (scheduler and servers as threads of the worker's process) is composed
 * above the client, in src/embed/embed.c, through client.h: ps_ctx_close reaches it
 * only through the ps__ctx_embed hook it was given.
 *
 * Threads. The loop thread (io_main) owns the links and every part once posted;
 * callers' threads build requests, wait on them, and run the fast path on lent links.
 * ctx->mu guards membership, ring and tables; ctx->lend_mu the lending state and the
 * link list's structure; a request's mu its completion.
 */
#ifndef PS_CLIENT_INT_H
#define PS_CLIENT_INT_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <uv.h>

#include "agent/agent.h"
#include "client/client.h"
#include "common/common.h"
#include "common/config.h"
#include "common/hist.h"
#include "common/ring.h"
#include "net/net.h"
#include "net/xport.h"
#include "proto/msg.h"
#include "proto/spec.h"

#define SCHED_LINK 0u /* link id of the scheduler */

typedef struct peer peer;
typedef struct part part;
typedef struct ps__cx_table ps__cx_table; /* cx.c: a table's residuals and codec counters */
typedef struct kept kept; /* a copy of a push to a replicated sync table (keep.c) */
typedef struct kbuf kbuf; /* a shared buffer holding such a copy (keep.c) */

/* A table's traffic as this worker counts it (metrics=on): allocated when the table is
 * declared, freed with the context, so a request may keep a pointer to it. Relaxed
 * atomics: the caller's threads and the I/O thread add, anyone reads. */
typedef struct ps__tcount {
  uint64_t pushed_bytes;   /* payload of pushes (keys and values), as bytes_pushed */
  uint64_t pulled_bytes;   /* values of pull answers, as bytes_pulled */
  uint64_t sent;           /* request frames: one per server a push or pull went to */
  uint64_t received;       /* answers taken (successful replies) */
  char name[PS_NAME_MAX];
} ps__tcount;

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
  /* Re-sending (link.c): a push or pull whose connection failed is sent again when the
   * link is back, and a push whose reply did not come by attempt_ms again on the same
   * connection, both with the same req_id (and a push with the same seq), until the
   * deadline. */
  unsigned wpend;          /* writes of this part not completed (one per attempt) */
  unsigned attempts;       /* times sent */
  uint64_t attempt_ms;     /* a push: re-send if unanswered at this time (0: not armed) */
  int resend;              /* its connection failed: queue it again once wpend is 0 */
  int again;               /* direct.c: to be sent again through the loop */
  ps__vx_part vx;          /* how a dense part's values travel (net/xport.h); zero: inline */
  int held;                /* on ctx->held until its deadline (ps__part_finish) */
  int unanswered;          /* a push with keep, counted in ctx->keep_unanswered until it
                            * finishes (link.c: the CLOCKs behind it wait) */
  int status;
  /* Replication: the chain of the part's keys (head first); the part goes to its first
   * live member, and is sent again to the next one when that server dies or answers
   * that it is not the head (yet, or any more). nchain 0: not replicated. */
  uint32_t chain[PS_MAX_REPLICAS];
  unsigned nchain;
  uint64_t retry_at_ms;    /* on ctx->delayed: send again at this time */
  uint32_t keep;           /* a push or pull of a replicated sync table: its clocks per round (keep.c) */
  kbuf *kb;                /* the shared copy of its values it names instead of the caller's
                            * (keep.c): held until the request is destroyed */
  uint32_t reply_table;    /* hdr.table of the reply (declare returns the id) */
  int64_t reply_clock;     /* hdr.clock of the reply */
  char *stats_buf;         /* control reply body destination (STATS text, CHECKPOINT info),
                            * copied here cut to stats_cap - 1 bytes and NUL-terminated */
  size_t stats_cap;
  size_t stats_len;        /* the reply body's full length (more than stats_cap - 1: cut) */
  /* A pull of a table with a pull codec (cx.c): the reply is read into cx_recv and
   * decoded into the caller's regions cx_dst[cx_ndst] (cx_n values) when it is in. */
  uv_buf_t cx_recv;
  uv_buf_t *cx_dst;
  unsigned cx_ndst;
  uint32_t cx_codec;
  size_t cx_n;
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
  int submit_pending;  /* posted, ps__mail_submit not run yet: the request must stay (r->mu) */
  int kind;                /* 0 pull, 1 push, 2 control: for the wait-time counters */
  uint64_t t0_ns;          /* a pull or push: when it was started (its latency histogram) */
  int counted;             /* posted to the loop: counted in ctx->outstanding */
  int dropped;             /* a server dropped this push (counted once per request) */
  /* a de-duplicated pull (sparse_start): rows of the distinct keys, copied to out */
  void *dd_block, *dd_rows;
  size_t dd_block_len, dd_rows_len, dd_n;
  const uint32_t *dd_idx;
  float *dd_out;
  unsigned dd_width;
  /* encoded values (cx.c): a push's as sent, a pull's replies as received; malloc'd */
  void *cx_block;
  ps__cx_table *cx_table;  /* a pull's table, for its counters */
  ps__tcount *tc;          /* a pull's or push's table, when counting (NULL: not counted) */
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
  int lost;                /* a connection was lost: tell the server the clock again */
  int fail_over_due;       /* its server left while a caller used the link: fail over
                            * when it comes back (loop) */
  uint64_t left_epoch;     /* the epoch of the membership that said its server left */
  uint64_t reconnect_ms;   /* a failed connect: the next try (sweep), 0 = none due */
};

typedef struct table_info {
  int kind;
  uint64_t size;
  uint32_t width;
  uint64_t nrows;
  ps__update_mode update;
  ps__codec push_codec, pull_codec; /* spec push_codec=, pull_codec= */
  ps__cx_table *cx;        /* residuals and counters of a table with a codec (cx.c), else NULL */
  ps__tcount *tc;          /* the table's traffic (never NULL once declared) */
  int sync;                /* sync or sync:M */
  uint32_t every;          /* clocks per round */
} table_info;

struct ps_ctx {
  /* configuration */
  uint32_t timeout_ms, connect_timeout_ms, heartbeat_ms, vnodes, rejoin_ms;
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
  uv_timer_t sweep_timer;
  ps__agent agent;         /* the scheduler connection: registration, heartbeats, membership */
  int agent_inited;
  peer *links;             /* scheduler link first */
  peer *sched;
  part *held;              /* peer-memory parts held until their deadline (loop) */
  part *delayed;           /* replicated parts waiting to be sent again (loop; queued == 2) */
  uint32_t push_seq;       /* the last push sequence number given (atomic): one counter per
                            * worker, so a part sent again to another server keeps its identity */
  unsigned replicas;       /* R of the job (membership; atomic) */
  pthread_mutex_t keep_mu; /* the six below (keep.c) */
  kept *kept;              /* copies of pushes to replicated sync tables */
  size_t kept_bytes;
  int any_keep;            /* a push to a replicated sync table was kept */
  kbuf *kb_free;           /* shared buffers for such copies, free for reuse */
  size_t kb_nfree;
  int kb_closed;           /* ps__keep_free ran: a buffer let go is freed */
  uint64_t yield_until_ms; /* after a server's death, until then (atomic): a call on the
                            * caller's thread gives back a link the loop wants, so the
                            * fail-over's frames are not queued behind the call */

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
  int64_t clock;           /* starts at the HELLO reply's clock (a restored job's) */
  int64_t barrier_seq;
  uint64_t ckpt_every;     /* rank 0 asks for a checkpoint every this many clocks (0: off) */
  uint64_t ckpt_every_ms;  /* ... or at its first clock this long after the last one asked */
  uint64_t ckpt_last_ms;   /* when it last asked (or the context opened) */
  char mode[32];           /* job consistency mode, added to tables declared without one */
  /* counters (atomics): time blocked waiting, by kind; requests; bytes */
  uint64_t wait_ns[3];     /* 0 pull, 1 push, 2 other */
  uint64_t nreq[3];
  uint64_t dropped_pushes, fast_forwards;
  uint64_t bytes_pushed, bytes_pulled;
  ps__hist lat[2];         /* 0 pull, 1 push: from start to completion, as the caller sees it */
  uint64_t opened_ns;
  uint64_t spin_ns;        /* ps_req_wait polls this long before sleeping (0: never) */
  /* Caller-side I/O for blocking calls (lent links). */
  int direct;              /* enabled (PSHARD_DIRECT=0 turns it off) */
  int peer_mem;            /* large dense values by peer memory on same-host links */
  int dedup;               /* large sparse pulls ask for each distinct key once */
  int count;               /* metrics=on: the request path counts (latencies, requests,
                            * bytes); read without a lock, set once at open */
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
  uint64_t incarnation;    /* this process's pushes (shard/once.h): microseconds at open */
  uint32_t retry_ms;       /* a push's attempt timeout; 0: nothing is sent again */
  uint64_t resent;         /* parts sent again (atomic) */
  int64_t clock_sent;      /* the largest CLOCK handed to the links (atomic) */
  /* For CLOCK_GUARD_MS after a server's death, or after a push to a replicated sync
   * table was refused by a member of its chain, a CLOCK goes to the servers only once
   * every such push sent before it has its answer (loop): a push refused by a chain's
   * new head, not the head at its epoch yet, is sent again later, and its CLOCK must
   * not get there first. */
  uint64_t keep_unanswered; /* such pushes sent on the loop and not finished */
  uint64_t clock_guard_ms;  /* until then, CLOCKs wait for them */
  int64_t held_clock;       /* the largest CLOCK waiting for them (0: none) */

  /* what runs beside the worker in this process (embedded mode, a colocated server) */
  ps__ctx_embed emb;
  int emb_linger;          /* wait for it to stop by itself at close (a colocated server) */
};

static inline void part_list_remove(part **head, part *p) {
  if (p->prev)
    p->prev->next = p->next;
  else if (*head == p)
    *head = p->next;
  if (p->next) p->next->prev = p->prev;
  p->prev = p->next = NULL;
}

static inline void part_list_push(part **head, part *p) {
  p->prev = NULL;
  p->next = *head;
  if (*head) (*head)->prev = p;
  *head = p;
}

/* A peer-memory part (PS_XPORT_PEER_MEM) names the caller's buffers, and the server
 * copies from or into them until the expiry the frame carries, PS_VX_SLACK_MS before
 * the part's deadline. A part that ends without the server's answer (cancel, a failed
 * or closed connection, a closing context) therefore keeps the buffers, and its request
 * stays unfinished, until that deadline (ps__vx_must_hold): the caller must not reuse
 * them while a server may still write there. The loop's sweep finishes such held
 * parts. */
typedef struct fire {
  ps_ctx *ctx;
  uint32_t target; /* SCHED_LINK or 0xffffffff for every server */
  ps__frame_hdr h;
  size_t len;
  uint8_t body[];
} fire;

/* ---- req.c: requests (caller threads unless marked "loop") */
void ps__req_set_error(ps_req *r, int status, const char *msg);
/* Rows of a finished pull into the caller's order (scatter, de-duplicated copies). */
void ps__req_rows_done(ps_req *r);
/* Must a part keep the caller's buffers (a peer-memory server may still copy)? */
int ps__part_must_hold(const part *p);
/* Is p a replicated pull sent by peer memory (and not yet turned inline to be sent
 * again)? Its server may write into the caller's buffers until it answers, or until
 * the expiry the frame carries (link.c, ps__part_submit). */
int ps__part_pull_lent(const part *p);
/* Loop: a part is over (reply and write done, or failed); the last one completes. */
void ps__part_finish(part *p);
void ps__part_fail(part *p, int status, const char *msg);
/* Loop timer: fail parts past their deadline, release held peer-memory parts. */
void ps__sweep_tick(uv_timer_t *t);
/* Loop mail handlers: submit a posted request's parts; cancel a request. */
void ps__mail_submit(void *arg);
void ps__mail_cancel(void *arg);
ps_req *ps__req_new(ps_ctx *ctx, unsigned nparts, unsigned nbufs);
void ps__req_destroy(ps_req *r);
/* Scratch buffers from the context's pool shared by caller threads. */
void *ps__ubuf_get(ps_ctx *ctx, size_t n);
void ps__ubuf_put(ps_ctx *ctx, void *p, size_t n);
void ps__part_init(ps_ctx *ctx, ps_req *r, unsigned i, uint32_t target, uint8_t type, uint32_t table,
                   uint64_t deadline_ms);
/* Hand a request to the loop (counted in ctx->outstanding). 0 or PS_ERR_CLOSED. */
int ps__req_post(ps_ctx *ctx, ps_req *r);
/* Blocking runs: on lent links when possible, else through the loop; the requests are
 * freed. A blocking call's timeout is PS_ERR_TIMEOUT. */
int ps__req_run_n(ps_ctx *ctx, ps_req **reqs, unsigned nreqs, int timeout_ms);
int ps__req_run(ps_ctx *ctx, ps_req *r, int timeout_ms);
/* Wait for a posted request as a blocking call does: ps_req_wait, where a wait that
 * ends with the request still running (PS_ERR_PENDING) is the call's PS_ERR_TIMEOUT. */
int ps__req_wait_call(ps_req *r, int timeout_ms);
/* The absolute deadline (ps__now_ms) of a call with timeout_ms (< 0: the default). */
uint64_t ps__deadline_for(ps_ctx *ctx, int timeout_ms);

/* ---- link.c: links (loop unless marked) */
/* The link of node id, or NULL. Loop, or a caller holding lend_mu. */
peer *ps__link_find(ps_ctx *ctx, uint32_t id);
void ps__link_dequeue(peer *l, part *p);
void ps__link_fail_all(peer *l, int status, const char *why);
/* Loop: l's connection is gone (or is being closed): queue again the parts that may be
 * sent again (ps__part_may_resend), fail the others with status, and reconnect. */
void ps__link_lost(ps_ctx *ctx, peer *l, int status, const char *why);
/* May p be sent again after its connection failed or its attempt timed out? */
int ps__part_may_resend(const ps_ctx *ctx, const part *p, uint64_t now);
/* Loop: a replicated part answered MOVED or UNAVAILABLE, or whose server died: send it
 * again to its chain's head (at once, or after a short wait); a part of one copy
 * answered UNAVAILABLE: to its server again, after the wait (later). 1 if it will be,
 * 0 if not (the caller fails it). */
int ps__part_reroute(ps_ctx *ctx, part *p, int later);
/* The head of replicated part p's chain by the head rule (common/ring.h), 0: none live. */
uint32_t ps__part_head(ps_ctx *ctx, const part *p);
/* Loop timer: pushes whose attempt timed out sent again; links due to reconnect. */
void ps__link_sweep(ps_ctx *ctx, uint64_t now);
/* The scheduler link (loop thread): send the parts that waited for the agent's
 * connection, once the scheduler took this worker back; or fail them all. */
void ps__sched_flush(ps_ctx *ctx);
void ps__sched_fail(ps_ctx *ctx, int status, const char *why);
void ps__part_send(ps_ctx *ctx, peer *l, part *p);
void ps__part_submit(ps_ctx *ctx, part *p);
/* A lent link no caller is using (lend_mu held). */
int ps__link_idle_lent(const peer *l);
/* Loop: take l back if it is lent (what waited for it goes first). 1 when the loop may
 * send on l now; 0 when a caller is using it, or its connection had to be closed. */
int ps__link_take(ps_ctx *ctx, peer *l);
/* Any thread: ask the loop to lend idle links callers want. */
void ps__post_lend(ps_ctx *ctx);
/* Loop mail handler: take back lent links the loop wants, broken or dead ones. */
void ps__mail_reclaim(void *arg);
/* A CLOCK of clock c went to the servers (any thread). */
static inline void ps__clock_sent(ps_ctx *ctx, int64_t c) {
  int64_t cur = __atomic_load_n(&ctx->clock_sent, __ATOMIC_RELAXED);
  while (c > cur && !__atomic_compare_exchange_n(&ctx->clock_sent, &cur, c, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}
/* Loop mail handler: a fire-and-forget frame (struct fire, freed). */
void ps__mail_fire(void *arg);
/* Loop: push part p, counted in keep_unanswered, is answered or failed; the CLOCK held
 * behind the last of them goes out (from the mailbox: not inside the caller's walk of
 * a link's parts). */
void ps__clock_unhold(ps_ctx *ctx, part *p);
#define CLOCK_GUARD_MS 10000
/* Loop: send the held CLOCK if nothing holds it any more (the sweep's fallback). */
void ps__clock_release(ps_ctx *ctx);
/* A decoded membership: links of new servers, dead ones failed, the ring replaced. */
void ps__on_membership(ps_ctx *ctx, const ps__membership *m);
/* A successful reply to p (loop or lent link): what it tells the context. */
void ps__part_reply_ok(ps_ctx *ctx, part *p, const ps__frame_hdr *h);
/* The scheduler link's own traffic (replies to control requests), given to the node
 * agent as its on_header, on_frame and link callbacks (arg: the context). */
int ps__sched_on_header(void *arg, const ps__frame_hdr *h, ps__body *b);
void ps__sched_on_frame(void *arg, const ps__frame_hdr *h, ps__body *b);
void ps__sched_on_link(void *arg, ps__conn *c, int status);

/* ---- ctx.c */

/* The context failed (lost the scheduler, ...): later calls return err. Any thread. */
void ps__ctx_fail(ps_ctx *ctx, int err, const char *msg);
int ps__ctx_check(const ps_ctx *ctx);
/* PS_ERR_CLOSED or the context's failure, else 0. */
int ps__ctx_state_err(ps_ctx *ctx);

/* ---- direct.c: the caller-thread fast path */
/* Run requests on lent links if they can be claimed: 1 when done here (their statuses
 * say how), 0 when they must go through the loop. */
int ps__direct_run(ps_ctx *ctx, ps_req **reqs, unsigned nreqs, uint64_t deadline_ms);
/* A fire-and-forget frame to every server on lent links: 1 if sent, 0 to use the loop. */
int ps__direct_fire(ps_ctx *ctx, const ps__frame_hdr *h0);

/* ---- cx.c: value compression (callers' threads unless marked) */
/* The state of a table with a codec: residuals (push codec) and counters. NULL: NOMEM. */
ps__cx_table *ps__cx_table_new(const ps__table_spec *spec);
void ps__cx_table_free(ps__cx_table *t);
/* A counter by name: push_raw_bytes, push_wire_bytes, pull_raw_bytes, pull_wire_bytes
 * (value bytes as f32, and as encoded). 0, or -1 for another name. */
int ps__cx_stat(const ps__cx_table *t, const char *which, double *value);
/* Encode a built push request's parts with ti's push codec, with error feedback. 0, or
 * an error (NOMEM, TOO_LARGE) with the residuals as they were. */
int ps__cx_encode_push(ps_ctx *ctx, ps_req *r, const table_info *ti);
/* Make a built pull request's parts receive values encoded with ti's pull codec. */
int ps__cx_setup_pull(ps_req *r, const table_info *ti);
/* Loop or lent link: does a reply's codec match what part p expects? 0 or PS_ERR_PROTO. */
int ps__cx_reply_check(const part *p, const ps__frame_hdr *h);
/* A finished pull's encoded replies into the caller's buffers (a failure sets r's error). */
void ps__cx_pull_done(ps_req *r);

/* ---- control.c */
/* One request with a single control part to target carrying body (copied). */
ps_req *ps__ctrl_req(ps_ctx *ctx, uint32_t target, uint8_t type, const void *body, size_t len, uint64_t deadline);

/* ---- copies of pushes to replicated sync tables (keep.c); the failover on the loop */
/* A push part with keep is sent for the first time (its identity just given): keep a
 * copy of its frame, the values inline (from the caller's buffers for peer memory). */
void ps__keep_sent(ps_ctx *ctx, part *p);
/* A push part with keep answered (h): note who holds it (a copy made if none was), let
 * go of those now on every copy. */
void ps__keep_push(ps_ctx *ctx, part *p, const ps__frame_hdr *h);
/* A pull part with keep answered (h): let go of the copies of rounds before its clock. */
void ps__keep_pull(ps_ctx *ctx, part *p, const ps__frame_hdr *h);
/* Server `dead` left the job, as the membership of `epoch` says; moving: its parts being
 * sent to their chains' next members. */
void ps__keep_fail_over(ps_ctx *ctx, uint32_t dead, uint64_t epoch, part **moving, size_t nmoving);
void ps__keep_free(ps_ctx *ctx);
/* A part of a request being destroyed lets go of the shared copy it named (p->kb). */
void ps__keep_part_done(ps_ctx *ctx, part *p);
/* Send a control frame to every live server, after the parts queued on each link. */
void ps__fire_servers(ps_ctx *ctx, const ps__frame_hdr *h, const void *body, size_t len);
/* A request of nparts frames to ti's table starts (counting on): its traffic out. */
static inline void ps__tcount_start(ps_req *r, const table_info *ti, unsigned nparts, uint64_t pushed) {
  r->tc = ti->tc;
  if (!r->tc) return;
  __atomic_add_fetch(&r->tc->sent, nparts, __ATOMIC_RELAXED);
  if (pushed) __atomic_add_fetch(&r->tc->pushed_bytes, pushed, __ATOMIC_RELAXED);
}
/* A pull or push completed: its latency into the context's histogram (any thread). */
static inline void ps__req_observe(ps_req *r) {
  if (r->t0_ns && r->kind < 2 && r->status == 0 && !r->canceled)
    ps__hist_add(&r->ctx->lat[r->kind], ps__now_ns() - r->t0_ns);
}

/* ---- metrics.c: this worker's metrics as Prometheus text, sent to the scheduler
 * (PS_MSG_NODE_METRICS) about once a second and once more before leaving (loop). */
void ps__ctx_send_metrics(ps_ctx *ctx);

#endif
