/*
 * sched_int.h - the scheduler's state, shared by sched.c (registration, membership,
 * barriers, tables, tasks) and ckpt.c (checkpoints and restore). Not for other layers.
 *
 * Threads: everything here belongs to the scheduler's loop thread.
 */
#ifndef PS_SCHED_INT_H
#define PS_SCHED_INT_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "net/http.h"
#include "net/net.h"
#include "proto/msg.h"
#include "proto/spec.h"
#include "sched/sched.h"

typedef struct ps__sched_node {
  ps__member m;
  ps__conn *conn;
  uint64_t token;       /* its registration's token (ps__hello): a HELLO sent again names it */
  uint64_t last_seen_ms;
  uint64_t dead_ms;     /* when it was removed (a replacement takes the oldest dead server) */
  int last_copy_warned; /* silent, kept: it holds the last live copy of some keys */
  int64_t barrier_seq;  /* barrier this worker waits in, -1 none */
  int64_t barrier_done; /* last barrier this worker passed (0 none) */
  uint64_t barrier_req;
  uint32_t nmetrics;    /* metric names this node reported (at most PS__METRICS_PER_NODE) */
  int metrics_warned;   /* a name past the cap was logged */
  int left;             /* it left the job (LEAVE) rather than died */
  /* its latest metrics (PS_MSG_NODE_METRICS, metrics.c) and their history */
  char *prom;
  size_t prom_len;
  uint64_t prom_ms;     /* when they came */
  struct ps__node_hist *hist;
} ps__sched_node;

/* Bounded metric work: names kept per node and in all, and metric lines in a STATS
 * reply (the rest are counted on a metrics_omitted line). */
#define PS__METRICS_PER_NODE 256
#define PS__METRICS_MAX 8192
#define PS__STATS_METRICS 1024

typedef struct ps__sched_table {
  ps__declare d;
  ps__table_spec spec;
} ps__sched_table;

typedef struct ps__sched_metric {
  uint32_t node;
  char name[64];
  double value;
  int64_t clock;
  uint64_t count;
} ps__sched_metric;

/* Data-partition tasks (DESIGN 6). */
enum { PS__TASK_PENDING = 0, PS__TASK_ASSIGNED = 1, PS__TASK_DONE = 2 };

typedef struct ps__task_waiter {
  struct ps__task_waiter *next;
  ps__conn *conn;
  uint32_t node;
  uint64_t req_id;
  uint64_t deadline_ms;
  int status;    /* served: 0 (part) or PS_ERR_DONE */
  uint32_t part;
} ps__task_waiter;

typedef struct ps__sched_tasks {
  int init;
  uint32_t parts, epochs, epoch;
  uint8_t *state; /* PS__TASK_* per partition */
  uint32_t *owner;
  uint32_t ndone;
  uint64_t handed, completed, requeued;
  ps__task_waiter *waiters;
} ps__sched_tasks;

/* The task state a restore read from a manifest, applied at the first TASK_INIT with
 * the same counts. */
typedef struct ps__sched_task_restore {
  int have;
  uint32_t parts, epochs, epoch;
  uint8_t *done; /* parts bytes, 1 = done in `epoch` */
} ps__sched_task_restore;

/* One server's part in the checkpoint being taken. */
typedef struct ps__ckpt_part {
  uint32_t node;     /* its node id */
  uint32_t rank;
  uint64_t req_id;   /* of the CKPT request it was sent */
  int answered;
  uint64_t word_ms;  /* when it last answered or said it progressed (its deadline runs from there) */
  int64_t probe_clock;
  ps__ckpt_done done;
} ps__ckpt_part;

/* The checkpoint being taken (at most one at a time). */
enum { PS__CKPT_IDLE = 0, PS__CKPT_PROBING = 1, PS__CKPT_CUTTING = 2 };

typedef struct ps__sched_ckpt {
  char root[PS_CKPT_DIR_MAX]; /* the checkpoint directory, absolute ("" = none) */
  int phase;              /* PS__CKPT_* */
  char into[PS_CKPT_DIR_MAX]; /* where this one goes: root, or the directory its request named */
  uint8_t *state;         /* its STATE block, encoded when the cut is sent */
  size_t state_len;
  uint64_t id;
  int64_t clock;          /* the cut clock (-1 while probing for one) */
  char dir[PS_CKPT_DIR_MAX]; /* DIR/ckpt-<id> */
  ps__conn *requester;    /* NULL once it went away */
  uint64_t requester_req; /* 0 = fire-and-forget */
  ps__ckpt_part *parts;
  uint32_t nparts, nanswered;
  uint64_t started_ms;
  uint64_t next_req;      /* req_id of the next CKPT sent to a server */
  uv_timer_t deadline;
  uint64_t taken, failed; /* counters for STATS */
  /* increments (checkpoint_full_every > 1) */
  uint64_t base;          /* the one being taken is an increment on this one; 0: whole */
  uint64_t last_id;       /* the last complete checkpoint this scheduler took (0: none) */
  uint32_t since_full;    /* increments taken since the last whole one */
} ps__sched_ckpt;

struct ps__sched {
  ps__sched_tasks tk;
  ps__sched_opts o;
  uv_loop_t loop;
  ps__listener listener;
  ps__mailbox *mail;
  uv_timer_t hb_timer;
  uint64_t hb_last_ms; /* when the previous liveness check ran (or the timer started) */
  ps__pool *pool;
  ps__sched_node *nodes;
  size_t nnodes, cap;
  uint32_t next_id;
  uint32_t nserver_ranks, nworker_ranks;
  uint64_t epoch;
  int started;
  ps__sched_table *tables;
  size_t ntables;
  ps__sched_metric *metrics;
  size_t nmetrics, mcap;
  uint64_t metrics_refused; /* reports of a new name past a cap */
  int stopping;
  int finished;     /* every worker left (exit_when_done): stopping soon */
  int worker_failed;/* a worker died rather than leaving */
  int result;
  uv_timer_t finish_timer;
  int64_t start_clock; /* the restored checkpoint's clock (0 without a restore) */
  ps__sched_task_restore tk_restore;
  ps__sched_ckpt ck;
  /* metrics and the dashboard (metrics.c) */
  ps__http *http;
  uv_timer_t metrics_timer;
  uint64_t created_ms;
  uint64_t *hist_ms;      /* the history's sample times (a ring of PS__HIST_SAMPLES) */
  size_t hist_head, hist_n;
  uint64_t node_metrics, node_metrics_refused; /* NODE_METRICS frames taken, refused */
  int history_published;  /* /api/history was rendered once */
};

/* ------------------------------------------------------------ metrics.c */

#define PS__HIST_SAMPLES 300        /* the dashboard's history: 5 minutes at one a second */
#define PS__NODE_METRICS_MAX (1u << 20) /* a node's metrics text, at most */

/* Start the HTTP server (o.http) and the once-a-second sampling. 0 or an error. */
int ps__sched_metrics_start(ps__sched *s);
/* A NODE_METRICS frame from node n: keep its text (a malformed one is refused). */
void ps__sched_metrics_frame(ps__sched *s, ps__sched_node *n, const ps__body *b);
void ps__sched_metrics_free(ps__sched *s);
/* Is t (len bytes) a well-formed exposition of ps_ families, each a HELP line, its TYPE
 * line (counter, gauge or histogram) and its samples, none of them the scheduler's own
 * nor labelled node? 0, or -1 with the reason in *why. */
int ps__sched_metrics_check(const char *t, size_t len, const char **why);

/* ------------------------------------------------------------ sched.c for ckpt.c */

size_t ps__sched_count_alive(ps__sched *s, uint8_t role);
int ps__sched_server_alive(const ps__sched *s, uint32_t id);
/* Replicated (R >= 2), and every key range still has a live copy (servers may have died):
 * a checkpoint is then complete without the dead servers. */
int ps__sched_every_range_live(ps__sched *s);

/* ------------------------------------------------------------ state.c */

/* Rewrite the state file after a change (logged, not fatal, when it cannot be). */
void ps__sched_state_save(ps__sched *s);
/* At create: load the state file if there is one. 0, or an error with a message. */
int ps__sched_state_load(ps__sched *s);

/* ------------------------------------------------------------ ckpt.c */

#define PS__CKPT_DEADLINE_MS 120000u /* the default of checkpoint_timeout_ms */
#define PS__CKPT_PROBE_MARGIN 2      /* clocks added to the probed clock */

/* Set up the checkpoint state (timer) at create; with o.restore_dir, read the
 * checkpoint there into the registry, start_clock and tk_restore. 0, or the reader's
 * error (its message kept). */
int ps__sched_ckpt_init(ps__sched *s);
/* Free what ps__sched_ckpt_init and a restore allocated (the timer is closed by the
 * loop walk). */
void ps__sched_ckpt_free(ps__sched *s);
/* A CHECKPOINT request from c (a registered node or not); b its body: empty for the
 * job's checkpoint directory, or `str dir` naming another one. */
void ps__sched_ckpt_request(ps__sched *s, ps__conn *c, const ps__frame_hdr *h, const ps__body *b);
/* A CKPT reply (or error frame) from server n. */
void ps__sched_ckpt_reply(ps__sched *s, ps__sched_node *n, const ps__frame_hdr *h, const ps__body *b);
/* Server n died (why says how): fails the checkpoint in progress if n takes part. */
void ps__sched_ckpt_node_dead(ps__sched *s, ps__sched_node *n, const char *why);
/* Connection c is closing: forget it as a requester. */
void ps__sched_ckpt_conn_closed(ps__sched *s, ps__conn *c);
/* A first TASK_INIT allocated the tasks: apply the restored state if the counts match. */
void ps__sched_ckpt_tasks_restore(ps__sched *s);
/* The next free checkpoint id of dir: 1 + the largest <id> of a ckpt-<id> entry (1 for
 * none or a missing dir). PS_ERR_IO when dir cannot be read. */
int ps__sched_ckpt_next_id(const char *dir, uint64_t *id);
/* The STATE block: the clock and the task state. Encoding (little-endian):
 *   u32 magic "PSST" | u32 version (1) | i64 clock | u8 tasks (0 none, 1 declared)
 *   [tasks: u32 parts | u32 epochs | u32 epoch | ceil(parts / 8) bytes, bit p of byte
 *    p / 8 (lsb first) set when partition p is done in `epoch`]
 * A partition handed out but not done counts as not done: it is handed out again. */
void ps__sched_state_encode(ps__wbuf *w, int64_t clock, const ps__sched_tasks *t);
/* Decode into *clock and *r (r->done allocated, parts bytes of 0/1). 0, or
 * PS_ERR_IO with a message for a malformed block. */
int ps__sched_state_decode(const void *p, size_t n, int64_t *clock, ps__sched_task_restore *r);

/* ---- tasks (tasks.c) */
void ps__sched_on_task_init(ps__sched *s, ps__conn *c, const ps__frame_hdr *h);
void ps__sched_on_task_next(ps__sched *s, ps__sched_node *n, ps__conn *c, const ps__frame_hdr *h);
void ps__sched_on_task_done(ps__sched *s, ps__sched_node *n, ps__conn *c, const ps__frame_hdr *h);
/* Forget the waiters of connection c (NULL: none), or answer and forget the expired. */
void ps__sched_task_drop_waiters(ps__sched *s, ps__conn *c, int expired_only);
/* A dead worker's unfinished partitions go back to the queue. */
void ps__sched_task_requeue(ps__sched *s, uint32_t node_id);

#endif
