/*
 * server_int.h - what the files of the server role share.
 *
 * The server is a libuv loop in front of a shard engine (shard/shard.h): server.c owns
 * the loop, the listeners, the scheduler link and the dispatch table; push.c, pull.c,
 * peer.c (the large-request path: values in the worker's memory) and stats.c each
 * serve one family of requests: decode, validate against the ring, call the engine,
 * reply. Everything here runs on the loop thread.
 */
#ifndef PS_SERVER_INT_H
#define PS_SERVER_INT_H

#include <stdint.h>

#include "agent/agent.h"
#include "common/hist.h"
#include "common/par.h"
#include "common/ring.h"
#include "net/http.h"
#include "net/net.h"
#include "net/xport.h"
#include "server/server.h"
#include "shard/shard.h"

typedef struct srv_ckpt srv_ckpt;       /* a checkpoint being written (ckpt.c) */
typedef struct srv_restore srv_restore; /* the checkpoint restored from (ckpt.c) */
typedef struct srv_fwd srv_fwd;         /* a push forwarded down its chain (repl.c) */
typedef struct srv_peer srv_peer;       /* another server, as a forward's destination (repl.c) */
typedef struct srv_held srv_held;       /* a forward's body another server may still read (fwd_body.c) */
typedef struct srv_fwd_group srv_fwd_group; /* an aggregation buffer's forwards (repl_agg.c) */
typedef struct srv_aggw srv_aggw;       /* a push combined into a buffer, awaiting its answer (repl_agg.c) */
typedef struct srv_sync srv_sync;       /* a sync table's replication state (repl_sync.c) */
typedef struct srv_early srv_early;     /* a REPLAYED list that came before its membership (repl_sync.c) */
typedef struct srv_repair srv_repair;   /* copies of rows to or from a replacement (repair.c) */

/* A worker (or forwarding server) connection, for the metrics by peer (stats.c): its
 * conn's udata. node is the sender of its first frame (0 until then). */
typedef struct srv_metlink {
  struct srv_metlink *next, *prev;
  ps__conn *conn;
  uint32_t node;
  uint64_t mem_in, mem_out; /* values moved by peer or shared memory, not on the socket */
} srv_metlink;

/* Bytes and frames of the connections already closed, by peer node. */
typedef struct srv_io {
  uint32_t node;
  uint64_t bytes_in, bytes_out, frames_in, frames_out;
} srv_io;

/* A pull waiting for its table to reach its clock, holding its request body. */
typedef struct pending_pull {
  struct pending_pull *next;
  ps__conn *conn;
  ps__frame_hdr h;
  void *buf;   /* request body (keys), pooled */
  size_t len;
  int fused_err;       /* a peer-memory write of a round's fused apply failed (peer.c) */
  ps__vx fused;        /* where a fused round writes its values (open while it runs) */
  char fused_msg[200];
} pending_pull;

/* A table's aggregation timer (the engine's arm_flush hook). */
typedef struct table_timer {
  uv_timer_t tm;
  ps__table *t;
} table_timer;

struct ps__server {
  ps__server_opts o;
  ps__shard *sh;     /* tables, clocks, rounds */
  uint64_t frames;   /* worker frames handled (the poll window of ps__server_run) */
  uint64_t poll_extra_ns; /* the last frame's bytes in and out, as poll time (ps__poll_extra_ns) */
  uv_loop_t loop;
  ps__pool *pool;
  float *pm_chunk;   /* PM_CHUNK floats: a streamed peer-memory push's staging (cache-sized) */
  ps__shm_cache *shm; /* workers' ps_alloc buffers mapped here (net/shared.c), or NULL */
  ps__mailbox *mail;
  ps__listener tcp, unix_l;
  ps__frame_budget fb; /* partial frames of the workers' connections (budget.c) */
  ps__agent agent;   /* the scheduler link */
  int agent_inited;
  uint64_t ring_gen; /* from 1, incremented whenever ring or id is replaced (a table's dense
                      * ownership cache, mine_gen 0, is then never current before use) */
  int pid;           /* getpid(): a peer with this pid is a colocated worker */
  uint32_t id, rank;
  uint64_t epoch;
  int stopping;
  int result;
  ps__ring *ring;
  pending_pull *pulls;
  char unix_path[PS_PATH_MAX];
  uv_idle_t apply_idle; /* runs while tables have a pending apply */
  uint64_t pm_pushes, pm_pulls, fused_pulls; /* peer-memory requests served; pulls written by a fused round */
  uint64_t kept_in_place; /* sync pushes added to their round from the worker's kept copy (peer.c) */
  uint8_t *pm_body;       /* the peer-memory push being served: its body, when that is a shared
                           * buffer in the shape of its forward (peer.c, repl.c) */
  uint64_t pm_fwd_out, pm_fwd_in, pm_fwd_inline; /* such forwards sent; read here; sent again with values */
  srv_ckpt *ckpt;        /* the checkpoint being cut or written, or NULL */
  uint64_t ckpt_last;    /* the last checkpoint written with tracking on: the tables'
                          * changed sets start at its cut (0: none) */
  srv_restore *restore;  /* the checkpoint this server restores tables from, or NULL */
  ps__par *par;   /* helper thread for huge requests, started on the first one */
  int par_failed; /* it could not be started: stay serial */
  /* replication (repl.c) */
  unsigned replicas;     /* R of the job (membership): 1 = none */
  srv_peer **peers;      /* the other servers */
  size_t npeers;
  srv_fwd *fwds;         /* forwards awaiting their answer */
  srv_held *pm_held;     /* bodies of forwards a server may still read (fwd_body.c) */
  struct {               /* bodies of such forwards from ps_alloc, kept for reuse (fwd_body.c) */
    void *p;
    size_t cap;
    int refs;            /* its holders: a forward, a push body the engine applies */
    uint64_t used_ms;    /* given back then (uv_now): let go of after a minute unused */
  } shbufs[8];
  size_t nshbufs;        /* of those, how many it may have (PSHARD_FORWARD_BUFFERS) */
  uint64_t fwd_seq;      /* req_id of the last forward */
  uint64_t forwards, forwards_refused; /* sent; received at another epoch and refused */
  uint64_t forward_bytes; /* bodies of the frames sent down the chains */
  uint64_t last_tick_ms; /* the last heartbeat tick (uv_now) */
  uint32_t next_hop;     /* set by the ring checks of the request being served (R >= 2) */
  uint64_t push_unit;    /* and its chain as an exactly-once unit (shard/once.h; 0: R = 1) */
  const ps__fwd *fwd_up; /* the prefix of the forward being served, or NULL */
  srv_aggw *aggw;        /* pushes in aggregation buffers, answered once a buffer reached every copy */
  srv_fwd_group *groups; /* aggregation buffers being forwarded */
  srv_sync *syncs;       /* sync tables under R >= 2: versions per chain, rounds in flight, catch-ups */
  srv_early *early;      /* REPLAYED lists of an epoch this server has not reached, newest first */
  size_t nearly, early_bytes;
  uint64_t catchups;     /* failovers of sync tables caught up */
  uint64_t held_ahead;   /* pushes sent again for a round a chain taken over held ahead of its table */
  uint64_t round_gaps;   /* round frames refused: an earlier round of their chain had not come (repl_sync.c) */
  unsigned sync_refusals_logged; /* ps__srv_sync_refused's lines so far (at most 20) */
  uint64_t tail_answers; /* workers' pushes this server answered as their chain's tail */
  srv_aggw *agg_cur;     /* the push being served, for the buffer it may fill ... */
  int agg_taken;         /* ... which was applied and forwarded with it */
  uint8_t self_state;    /* PS_CHAIN_* of this server in the membership (0 before one) */
  uint32_t self_late;    /* its admission number as a replacement (0: not one) */
  srv_repair *repair;    /* copies of rows to or from a replacement (repair.c), or NULL */
  int replaying;         /* forwards held while syncing are being applied (repair.c) */
  int fenced;            /* stood still: serves no data request for now */
  uint64_t fenced_at;
  /* metrics (stats.c): counted on the loop, rendered on the loop once a second,
   * served by the HTTP thread from what was rendered last */
  ps__hist lat_push, lat_pull;   /* time a push (or forward), a pull spent in its handler */
  uint64_t *table_in;            /* payload bytes received by table id (PS__MAX_TABLES) */
  uint64_t *table_out;           /* bytes of pull answers queued, by table id */
  srv_metlink *links;               /* live connections of workers and servers */
  srv_io *io_closed;             /* what closed connections carried, by node */
  size_t nio_closed;
  ps__http *http;                /* /metrics, or NULL */
  uv_timer_t metrics_timer;
  int metrics_on;
  int count;                     /* counting on the request path (o.metrics) */
  char http_addr[80];            /* HOST:PORT of /metrics, "" without */
};

/* ---- limits (budget.c) */
/* Fill the limits of s->o left 0 from the environment or their defaults: 0, or
 * PS_ERR_CONFIG for a bad environment value. */
int ps__srv_limits(ps__server *s);
/* May new table t (dense) be held here within the memory budget? 0, or PS_ERR_NOMEM
 * with the message in msg. */
int ps__srv_create_fits(ps__server *s, ps__table *t, char *msg, size_t len);

/* ---- replies (server.c) */
void ps__srv_reply_ok(ps__conn *c, const ps__frame_hdr *req, uint8_t flags);
void ps__srv_reply_err(ps__conn *c, const ps__frame_hdr *req, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Send a reply whose payload is a pooled buffer (released when written). */
void ps__srv_reply_pooled(ps__server *s, ps__conn *c, ps__frame_hdr *h, void *buf, size_t len);
/* Answer a request with an engine verdict that is not APPLIED (a drop is acknowledged). */
void ps__srv_reply_verdict(ps__conn *c, const ps__frame_hdr *h, const ps__verdict *v);
/* The helper thread for a request of nkeys keys, or NULL to serve it serially. */
ps__par *ps__srv_par(ps__server *s, uint32_t nkeys);
/* Start the idle handler if the engine holds a pending apply. */
void ps__srv_pending_check(ps__server *s);

/* ---- validation against the ring (push.c) */
/* The request's table, of the given kind; NULL when answered with an error. */
ps__table *ps__srv_table_of(ps__server *s, ps__conn *c, const ps__frame_hdr *h, int kind);
/* The dense slices [*lo, *hi) of t this server owns (ring.h: one contiguous run per
 * server), cached per ring. 0, or -1 when out of memory. */
int ps__srv_dense_mine(ps__server *s, ps__table *t, uint64_t *lo, uint64_t *hi);
/* Check a dense segment list: in range, owned. Returns total elements or -1 (answered). */
int64_t ps__srv_check_segments(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const uint8_t *keys);
/* Check that every sparse key is owned here: 0, or -1 (answered with MOVED). Under
 * R >= 2, its chain's member to forward to goes to s->next_hop. */
int ps__srv_check_keys(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const uint8_t *keys);
/* The checks of a push's keys or segments against its values; 0 or -1 (answered). */
int ps__srv_push_shape(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const ps__push *p, int dense);
/* A push frame as the engine's request. */
ps__push ps__srv_push_of(const ps__frame_hdr *h, const void *body, uint64_t nvals);
void ps__srv_on_push(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b, int dense);
/* Serve a push whose values are in memory (a frame's body, or fetched from the
 * worker): validate, hand to the engine, reply. body may be taken by the engine. */
void ps__srv_push(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const ps__push *p, ps__owned *body, int dense);

/* ---- pulls (pull.c) */
void ps__srv_on_pull(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b, int dense);
void ps__srv_answer_pull(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const void *body, size_t blen);
/* The reply header of a pull answered now (its clock: the values' clock). */
ps__frame_hdr ps__srv_pull_reply_hdr(ps__server *s, ps__table *t, const ps__frame_hdr *h);
void ps__srv_answer_ready_pulls(ps__server *s);
void ps__srv_drop_pulls_of(ps__server *s, ps__conn *c);
void ps__srv_free_pulls(ps__server *s);

/* ---- the large-request path: values in the worker's memory (peer.c) */
void ps__srv_on_push_peer(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b);
/* The values of a peer-memory frame received on c, an AF_UNIX connection (the sender's
 * memory: a worker's, or the server before this one in a chain): body[0 .. pre) is
 * what precedes its tail (until, hint, regions), copied as is; the values are read
 * after it into a pooled body (*out, *olen). With in_place, values in one region of a
 * shared buffer the sender named (its hint) are not copied: *in_place is where this
 * server maps them (valid until the loop callback returns), *in_len their bytes, and
 * *out NULL. 0, or PS_ERR_UNAVAILABLE (cannot be read from here), PS_ERR_TIMEOUT (the
 * sender's expiry passed), PS_ERR_PROTO, PS_ERR_SIZE or PS_ERR_NOMEM, with a message. */
int ps__srv_peer_values(ps__server *s, ps__conn *c, uint32_t table, const void *body, size_t blen, size_t pre,
                        const void **in_place, uint64_t *in_len, void **out, size_t *olen);
/* The values of a frame down a chain that names them in its sender's memory (c), after
 * body[0 .. pre): where they are (*at, valid until the loop callback returns: a shared
 * buffer of the sender mapped here, not while a replacement copies its rows here, since
 * it may hold the frame), or else read into a new inline body that replaces b's. h's
 * xport and payload_len follow. 0, or -1 (answered; the sender sends the values). */
int ps__srv_fwd_values(ps__server *s, ps__conn *c, ps__frame_hdr *h, ps__body *b, size_t pre, const void **at);
/* Answer a dense pull by writing into the worker's memory: 1 if done (or answered with
 * an error), 0 if the values must go in the reply instead. */
int ps__srv_write_rows_to_peer(ps__conn *c, const ps__frame_hdr *h, const uint8_t *keys, size_t blen,
                               const uv_buf_t *v, unsigned n, ps__frame_hdr *r);
/* Check a peer-memory pull's regions against its n values: 0, or -1 (answered). */
int ps__srv_check_peer_pull(ps__conn *c, const ps__frame_hdr *h, const ps__body *b, int64_t n);
/* The engine's round hooks: a sync round of a dense table applied slice by slice into
 * the peer-memory pulls waiting for it. */
int ps__srv_round_apply(void *arg, ps__table *t, ps__round *r, void **token);
void ps__srv_round_done(void *arg, ps__table *t, void *token);

/* ---- checkpoints (ckpt.c) */
void ps__srv_on_ckpt(ps__server *s, const ps__frame_hdr *h, const ps__body *b);
void ps__srv_cut(void *arg, ps__table *t);        /* the engine's cut hook */
void ps__srv_ckpt_written(void *arg);              /* mail from the writer thread */
/* Each heartbeat: tell the scheduler a checkpoint being written gets on. */
void ps__srv_ckpt_tick(ps__server *s);
void ps__srv_ckpt_stop(ps__server *s);
/* Read the restore directory's manifest (at create): 0, or an error with a message. */
int ps__srv_restore_open(ps__server *s, const char *dir);
/* Load table t's rows this server owns from the checkpoint being restored, if any:
 * 0, or an error with a message (the table is then unusable: answer its CREATE so). */
int ps__srv_restore_table(ps__server *s, ps__table *t);
void ps__srv_restore_free(ps__server *s);

/* ---- replication (repl.c) */
/* Is server id alive in the latest membership (this server is)? */
int ps__srv_server_alive(ps__server *s, uint32_t id);
/* Server id's PS_CHAIN_* state in the latest membership (common/ring.h, the head rule). */
uint8_t ps__srv_chain_state(ps__server *s, uint32_t id);
/* The same, and in *late its admission number as a replacement (0: not one), which
 * orders the late members of a chain (the head rule): one lookup for both. */
uint8_t ps__srv_chain_member(ps__server *s, uint32_t id, uint32_t *late);
/* Under R >= 2: are a request's keys (sparse) or segments (dense) of one chain, headed
 * here (a worker's request) or with this server after its head (a forward)? 0 with the
 * member to forward to in *next (0: none), or -1 (answered with MOVED). */
int ps__srv_route_keys(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const uint8_t *keys,
                       uint32_t *next);
int ps__srv_route_segments(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const uint8_t *keys,
                           uint32_t *next);
/* Forward push p, applied here with rate lr and step (0: none), to server `to`; the
 * answer goes to request uh on up. 0 or PS_ERR_NOMEM (nothing sent). */
int ps__srv_forward(ps__server *s, ps__conn *up, const ps__frame_hdr *uh, const ps__push *p, uint32_t to, float lr,
                    uint64_t step);
void ps__srv_on_forward(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b, int dense);
/* The tail of a chain, serving forward h of worker's push (s->fwd_up): answer the
 * worker's request on its own connection here. 1 when sent (the answer up the chain
 * then says so: PS_FLAG_TAIL), 0 when this server has no connection of that worker. */
int ps__srv_tail_answer(ps__server *s, const ps__frame_hdr *h, uint32_t worker);
/* The checks every frame coming down a chain passes: its prefix (into *fw) names this
 * server's epoch, and its sender is another live server. 0, or -1 (answered MOVED). */
int ps__srv_forward_admit(ps__server *s, ps__conn *c, const ps__frame_hdr *h, const ps__body *b, ps__fwd *fw);
/* A FORWARD_AGG or FORWARD_ROUND arriving: held (a replacement copying its rows),
 * admitted (ps__srv_forward_admit), and its table. The table, or NULL (held or answered). */
ps__table *ps__srv_forward_table(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b, ps__fwd *fw);
/* Send a frame of len body bytes (pooled, taken) to server `to` down a chain; its
 * answer goes to group g. Header fields sender, req_id and payload_len are set here.
 * pm_off, when not 0, is where the frame's values start in buf: to a server of this
 * host they are named, not sent (PS_XPORT_PEER_MEM: buf[0 .. pm_off), then a tail
 * naming buf[pm_off .. len) that expires PS_FWD_PM_MS after the send), and buf is
 * kept until that server answered or can no longer read it. 0 or PS_ERR_NOMEM (buf
 * given back, nothing sent). */
int ps__srv_forward_frame(ps__server *s, uint32_t to, const ps__frame_hdr *hdr, void *buf, size_t len,
                          size_t pm_off, srv_fwd_group *g);
/* A body of len bytes for ps__srv_forward_frame: shared (its values named to a member
 * on this host), from a few buffers of ps_alloc kept for reuse, so that the member reads
 * them in place (a mapping of the file, xport.h's shared transport) rather than with
 * process_vm_readv; else, or when none is free, from the pool. NULL: out of memory.
 * Given back by ps__srv_fwd_buf_put (ps__srv_forward_frame does it itself). */
void *ps__srv_fwd_buf(ps__server *s, size_t len, int shared);
/* One of those shared buffers only, or NULL (none free, too large, out of memory). */
void *ps__srv_fwd_buf_shared(ps__server *s, size_t len);
/* One more holder of buf, when it is a shared buffer (1); else nothing (0). Each holder
 * gives it back with ps__srv_fwd_buf_put (or _hold). */
int ps__srv_fwd_buf_ref(ps__server *s, const void *buf);
/* Give back a body of ps__srv_fwd_buf (its last holder), or any pooled buffer. */
void ps__srv_fwd_buf_put(ps__server *s, void *buf, size_t len);
/* A small frame came down a chain (values inline, under PS_POLL_CHAIN_MAX_BYTES), or
 * its answer back up: the loop polls PS_POLL_CHAIN_US more than poll_us before it
 * sleeps (server.c, ps__server_run). */
#define PS_POLL_CHAIN_US 150u
#define PS_POLL_CHAIN_MAX_BYTES ((uint64_t)16 << 10)
static inline void ps__srv_poll_chain(ps__server *s) {
  s->frames++;
  if (s->poll_extra_ns < PS_POLL_CHAIN_US * 1000u) s->poll_extra_ns = PS_POLL_CHAIN_US * 1000u;
}
/* How many shared buffers this server may have: PSHARD_FORWARD_BUFFERS (0 to 8; 8). */
void ps__srv_fwd_buf_init(ps__server *s);
/* The shared buffers allocated, and of those the ones held now (STATS). */
void ps__srv_fwd_buf_counts(const ps__server *s, size_t *allocated, size_t *busy);
/* Give back such a body once ps__now_ms() reaches until (a server may read it till then). */
void ps__srv_fwd_buf_hold(ps__server *s, void *buf, size_t len, uint64_t until);
/* Give back the held bodies whose time came, and let go of shared ones a minute unused
 * (all: every one; the server stops). Each tick (ps__srv_repl_tick). */
void ps__srv_fwd_body_sweep(ps__server *s, int all);
/* A chain's first live member, whether this server is in it, and the live member after
 * this server (0: none). */
void ps__srv_chain_places(ps__server *s, const uint32_t *c, size_t n, uint32_t *head, int *has_self, uint32_t *next);

/* The chains of a table's rows, under the server's ring (repl.c). A chain is named by
 * its ring route (sparse), or PS_FWD_DENSE_CHAIN | its run (dense). */
typedef struct ps__srv_chains {
  ps__server *s;
  ps__table *t;
  size_t S, nroutes;
  uint64_t nsl;
  uint32_t *order; /* dense: the table's run order */
} ps__srv_chains;
int ps__srv_chains_init(ps__srv_chains *x, ps__server *s, ps__table *t); /* 0 or PS_ERR_NOMEM */
void ps__srv_chains_free(ps__srv_chains *x);
/* The chain of a row (a sparse key, or a dense slice). */
uint32_t ps__srv_row_chain(const ps__srv_chains *x, uint64_t key);
/* A chain's servers into ch (n; 0 for a name that is no chain). */
size_t ps__srv_chain_servers(const ps__srv_chains *x, uint32_t ck, uint32_t *ch);
/* This server's place in chain ck: 1 its head, 2 after it, 0 not in it; *next the live
 * member after this server (0: none). */
int ps__srv_chain_place(const ps__srv_chains *x, uint32_t ck, uint32_t *next);
/* The table's chains: 0 .. n-1 as names, and back. */
static inline size_t ps__srv_nchains(const ps__srv_chains *x) { return x->order ? x->S : x->nroutes; }
static inline uint32_t ps__srv_chain_name(const ps__srv_chains *x, size_t i) {
  return x->order ? PS_FWD_DENSE_CHAIN | (uint32_t)i : (uint32_t)i;
}
static inline size_t ps__srv_chain_index(const ps__srv_chains *x, uint32_t ck) {
  return x->order ? (ck & ~PS_FWD_DENSE_CHAIN) : ck;
}
/* The chain of a push (nkeys > 0): its first key's, or its first segment's slice's. */
static inline uint32_t ps__srv_push_chain(const ps__srv_chains *x, const ps__push *p) {
  uint64_t first = ps__get_u64(p->keys);
  return ps__srv_row_chain(x, x->order ? first / x->t->spec.width : first);
}

/* Frames sent down the chains together (repl_agg.c): answered as one, to the workers'
 * pushes they carry (waiters), to the frame they came in (up), or to done. */
struct srv_fwd_group {
  srv_fwd_group *next; /* in s->groups */
  unsigned out;        /* frames not answered yet */
  int building;        /* frames still being made */
  int status;          /* the first error answered */
  char msg[240];
  srv_aggw *waiters;   /* at the head: the pushes the buffer combined */
  ps__conn *up;        /* at a member: where the frame it got came from (NULL: closed) */
  ps__frame_hdr up_hdr;
  /* a sync round's frames (repl_sync.c): done is called when the group finishes, and
   * redirect when one of its frames could not be delivered to `to` (status): 1 with
   * *to set to send the frame (re-stamped) there instead, 0 to answer it with status */
  void (*done)(ps__server *s, srv_fwd_group *g);
  int (*redirect)(ps__server *s, srv_fwd_group *g, const uint8_t *buf, size_t len, int status, uint32_t *to);
  void *arg;
  int64_t round;
};
srv_fwd_group *ps__srv_group_new(ps__server *s); /* building set: clear it, then ps__srv_group_maybe_done */
/* Finish g once no frame of it is being made or awaited; 1 when g was freed. */
int ps__srv_group_maybe_done(ps__server *s, srv_fwd_group *g);

/* ---- replication of aggregation buffers (repl_agg.c) */
/* The engine's agg_applied hook: forward the buffer down the chains of its rows. */
void ps__srv_agg_applied(void *arg, ps__table *t, const ps__rowmap *agg, int per_row, float lr, double gb,
                         uint64_t step);
/* Around the engine's push of p to table t (which aggregates) at the head of its chain
 * under R >= 2: before, note the push (it may fill the buffer, which then carries it);
 * after, with the engine's verdict, keep it to answer once the buffer it went into was
 * applied and reached every live copy. ps__srv_agg_after returns 1 when the push is
 * handled so (answered, or to be answered), 0 when the caller answers it (refused) or
 * forwards it on its own (a copy of a push applied earlier). */
void ps__srv_agg_before(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const ps__push *p);
int ps__srv_agg_after(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const ps__verdict *v);
void ps__srv_on_forward_agg(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b);
/* A forward of group g was answered (status 0: applied by every copy after this one). */
void ps__srv_fwd_group_answer(ps__server *s, srv_fwd_group *g, int status, const char *msg);
void ps__srv_agg_conn_closed(ps__server *s, ps__conn *c);
/* The identities of the pushes in aggregation buffers not applied yet (their windows
 * mark them, their rows do not hold them yet), into *ids (malloc'ed, NULL when none):
 * their count, or (size_t)-1 when out of memory. */
size_t ps__srv_agg_pending(ps__server *s, ps__push_id **ids);

/* ---- replication of sync rounds (repl_sync.c) */
/* A sync table created under R >= 2: its copies' versions start at its version. */
void ps__srv_sync_table(ps__server *s, ps__table *t);
/* The engine's round_applied hook: forward the round down the chains of its rows. */
void ps__srv_round_applied(void *arg, ps__table *t, ps__rowmap *acc, int64_t round, float lr, double denom,
                           double batch);
void ps__srv_on_forward_round(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b);
void ps__srv_on_replayed(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b);
/* The clock before which every round of sync table t is on every copy (push answers
 * carry it). */
int64_t ps__srv_sync_durable_clock(ps__server *s, ps__table *t);
/* A push (validated) to a sync table while a failover's catch-up runs: 1 when served
 * here (answered), 0 when the engine takes it as usual (then ps__srv_sync_pushed). */
int ps__srv_sync_push(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__table *t, const ps__push *p);
/* A push to a replicated sync table refused for its clock (the engine's verdict v): logged
 * with the chain's state here (at most 20 times per server), since a worker that sent
 * it expected the round to take it; at debug level only when its round is on every copy
 * (a copy a worker kept of a push to a seldom pushed table, sent again at a failover). */
void ps__srv_sync_refused(ps__server *s, ps__table *t, const ps__push *p, const ps__verdict *v);
void ps__srv_sync_pushed(ps__server *s, ps__table *t);
/* Around a membership: which chains this server followed, and which it now heads. */
void ps__srv_sync_before(ps__server *s);
void ps__srv_sync_after(ps__server *s);
void ps__srv_sync_tick(ps__server *s);
/* The server's epoch moved on: the REPLAYED lists that waited for it are taken in. */
void ps__srv_sync_epoch(ps__server *s);
void ps__srv_sync_free(ps__server *s);
/* The rounds of chain ck of sync table t held here (in its rows): the table's version
 * where this server heads the chain, else the rounds forwarded to it (repair.c's cut). */
int64_t ps__srv_sync_chain_rounds(ps__server *s, ps__table *t, uint32_t ck);
/* Sync tables whose failover catch-up is running here. */
size_t ps__srv_sync_catchups_running(ps__server *s);
/* A replacement's copy of chain ck came from a cut that held `rounds` rounds. */
void ps__srv_sync_set_chain_rounds(ps__server *s, ps__table *t, uint32_t ck, int64_t rounds);
void ps__srv_agg_free(ps__server *s);
/* Does this server hold back data requests (it stood still and may have been replaced)? */
int ps__srv_fenced(ps__server *s);
void ps__srv_repl_tick(ps__server *s);
/* Replication lag: forwards sent down the chains and not answered yet, their bytes, and
 * how long the oldest of them has waited (ms; 0 when none). */
void ps__srv_repl_lag(ps__server *s, uint64_t *n, uint64_t *bytes, uint64_t *oldest_ms);
int ps__srv_repl_membership(ps__server *s, const ps__membership *m);
void ps__srv_repl_conn_closed(ps__server *s, ps__conn *c);
void ps__srv_repl_free(ps__server *s);

/* Which rows of the chains are whose, as the ring and the live servers were when it was
 * made (on the loop): rows of the chains headed by this server (member 0: what a
 * checkpoint writes; after a failover, the dead server's ranges are headed by their next
 * live member), or of every chain this server is in (member 1: what a restore loads).
 * Read-only once made, so the checkpoint writer thread may use it. ring NULL: every row
 * (R = 1, or a server alone). */
typedef struct ps__srv_rows {
  ps__ring *ring;      /* a copy of the server's ring, or NULL */
  uint32_t self;
  int member;
  uint32_t *live;      /* the live servers */
  uint8_t *state;      /* and their PS_CHAIN_* states */
  uint32_t *late;      /* and admission numbers (the head rule) */
  size_t nlive;
  uint8_t *route_ok;   /* per sparse route: this server's rows */
  size_t nroutes;
} ps__srv_rows;
/* 0, or PS_ERR_NOMEM with a message (r is then empty). */
int ps__srv_rows_init(ps__server *s, ps__srv_rows *r, int member);
void ps__srv_rows_free(ps__srv_rows *r);
/* Is a chain of n servers this server's (head, or member)? */
int ps__srv_rows_chain(const ps__srv_rows *r, const uint32_t *ch, size_t n);
/* A dense table's runs (ps__ring_dense_order) that are this server's: runs[j], j < S.
 * 0 or PS_ERR_NOMEM. */
int ps__srv_rows_dense(const ps__srv_rows *r, uint32_t table, uint8_t *runs);
/* Is sparse row (table, key) this server's? */
static inline int ps__srv_rows_key(const ps__srv_rows *r, uint32_t table, uint64_t key) {
  return !r->ring || r->route_ok[ps__ring_route_index(r->ring, table, key)];
}

/* ---- repair: a replacement's copies (repair.c) */
/* After a membership (ring and peers set): start copies to new syncing replacements,
 * drop those to replacements gone or done; as a syncing replacement, learn its sources
 * or stop when one died before its copy was in. */
void ps__srv_repair_membership(ps__server *s, const ps__membership *m);
void ps__srv_repair_tick(ps__server *s);
/* Is this server a replacement copying its rows (forwards may be held, not applied)? */
int ps__srv_repair_syncing(const ps__server *s);
/* Apply every aggregation buffer before a new membership m changes a server's place in
 * the chains (repl_agg.c). */
void ps__srv_agg_before_membership(ps__server *s, const ps__membership *m);
/* An error answer to c: counted and logged when c is the sink of held forwards being
 * applied (repair.c), which were answered as applied when they came. */
void ps__srv_repair_refused(ps__server *s, ps__conn *c, int err, const char *msg);
/* A forward to a syncing replacement from a source whose copy is not in: held (and
 * answered), 1; else 0 (served as usual). b->buf may be taken. */
int ps__srv_repair_hold(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b);
/* Must nothing be forwarded to `to` from here yet (its copy could not start)? */
int ps__srv_repair_blocked(ps__server *s, uint32_t to);
void ps__srv_on_sync_rows(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b);
void ps__srv_on_sync_done(ps__server *s, ps__conn *c, const ps__frame_hdr *h, ps__body *b);
/* STATS lines of the repair (newline-terminated) into line. */
void ps__srv_repair_stats(ps__server *s, char *line, size_t cap);
void ps__srv_repair_free(ps__server *s);
/* The id of peer i < s->npeers (repl.c). */
uint32_t ps__srv_peer_id(ps__server *s, size_t i);
/* Stop the server with an error status (server.c). */
void ps__srv_fail(ps__server *s, int status);

/* ---- statistics (stats.c) */
void ps__srv_on_stats(ps__server *s, ps__conn *c, const ps__frame_hdr *h);
/* The metrics: start the HTTP server (o.http) and the once-a-second render; 0, or an
 * error with a message (the HTTP address cannot be bound). */
int ps__srv_metrics_start(ps__server *s);
/* Render now: serve the text and send it to the scheduler (also the last one, at stop). */
void ps__srv_metrics_tick(ps__server *s);
/* A frame handled: count its time (data requests) and its table's bytes (ns is 0 when
 * counting is off: nothing is counted). */
static inline void ps__srv_metrics_frame(ps__server *s, ps__conn *c, const ps__frame_hdr *h, uint64_t ns) {
  srv_metlink *l = c->udata;
  if (l && !l->node) l->node = h->sender;
  if (!s->count) return;
  uint8_t t = h->type;
  if (t == PS_MSG_PUSH || t == PS_MSG_PUSH_DENSE || t == PS_MSG_FORWARD || t == PS_MSG_FORWARD_DENSE)
    ps__hist_add(&s->lat_push, ns);
  else if (t == PS_MSG_PULL || t == PS_MSG_PULL_DENSE)
    ps__hist_add(&s->lat_pull, ns);
  else
    return;
  if (s->table_in && h->table < PS__MAX_TABLES) s->table_in[h->table] += h->payload_len;
}
/* A peer-memory request on c moved `bytes` of values of table `table` without the
 * socket: read from the worker (out 0) or written into it (out 1). Counted with the
 * socket's bytes by peer, and by table when counting is on. */
static inline void ps__srv_metrics_mem(ps__server *s, ps__conn *c, uint32_t table, int out, uint64_t bytes) {
  srv_metlink *l = c->udata;
  if (l) *(out ? &l->mem_out : &l->mem_in) += bytes;
  uint64_t *by_table = out ? s->table_out : s->table_in;
  if (s->count && by_table && table < PS__MAX_TABLES) by_table[table] += bytes;
}
void ps__srv_metrics_accept(ps__server *s, ps__conn *c);
void ps__srv_metrics_close(ps__server *s, ps__conn *c);
void ps__srv_metrics_free(ps__server *s);

#endif /* PS_SERVER_INT_H */
