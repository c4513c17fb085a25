/*
 * sched.h - the scheduler role: registration, membership epochs, heartbeats,
 * barriers, the table registry and metrics.
 *
 * Threads: the scheduler owns one libuv loop and all its state; ps__sched_run runs that
 * loop in the calling thread, ps__sched_stop may be called from any thread.
 */
#ifndef PS_SCHED_H
#define PS_SCHED_H

#include <stdint.h>

typedef struct ps__sched ps__sched;

typedef struct ps__sched_opts {
  const char *host;          /* bind address (127.0.0.1) */
  int port;                  /* 0 = ephemeral */
  uint32_t servers, workers; /* expected counts before the job starts */
  uint32_t heartbeat_ms;     /* check period */
  uint32_t heartbeat_timeout_ms;
  /* A worker that clocked before and holds a sync round back this long while another
   * worker waits is removed (0 = 60000; UINT32_MAX: never). One that never clocked is
   * removed after heartbeat_timeout_ms. */
  uint32_t stall_timeout_ms;
  uint64_t max_payload;
  const char *state_dir;     /* keep the scheduler's state there and take it back at a
                              * restart (src/sched/state.c); NULL or "": in memory only */
  int exit_when_done;        /* stop once every worker has left a started job */
  /* Checkpoints (docs/checkpoint.md). */
  const char *checkpoint_dir; /* where CHECKPOINT requests write DIR/ckpt-<id>; NULL: refused */
  unsigned checkpoint_keep;   /* complete checkpoints kept after each one (0 = 3) */
  uint32_t checkpoint_timeout_ms; /* a server answers a CKPT, or says it progressed, within this (0 = 120000) */
  unsigned checkpoint_full_every; /* a whole checkpoint every N, increments between (0, 1: all whole) */
  const char *restore_dir;    /* a checkpoint (or a directory of them, the newest is used)
                               * to resume: the table registry, the clock, the tasks */
  /* Replication: copies of every key range (1..3, 0 = 1; at most `servers`), told to
   * every node in MEMBERSHIP; vnodes: the ring's points per server (0 = 128), which the
   * scheduler needs to know which chains a server's removal would empty. */
  unsigned replicas;
  unsigned vnodes;
  /* The dashboard (/), its JSON (/api/snapshot, /api/history) and the job's metrics
   * (/metrics) over HTTP: http 1 serves them on http_host:http_port (127.0.0.1; port
   * 0 = ephemeral), 0 not. */
  int http;
  const char *http_host;
  int http_port;
} ps__sched_opts;

/* Bind and set up (replicas beyond PS_MAX_REPLICAS or the expected servers is
 * PS_ERR_CONFIG); with o->restore_dir, read the checkpoint first. The strings of o
 * are borrowed until ps__sched_destroy. 0, or an error with a message (a bad address,
 * an unreadable or bad checkpoint: the reader's PS_ERR_IO or PS_ERR_CORRUPT). */
int ps__sched_create(const ps__sched_opts *o, ps__sched **out);
int ps__sched_port(const ps__sched *s);
/* The port of the dashboard and /metrics, or -1 without HTTP. */
int ps__sched_http_port(const ps__sched *s);
/* Run until stopped. Returns 0, or 1 when it stopped on its own (exit_when_done)
 * after a worker failed. */
int ps__sched_run(ps__sched *s);
void ps__sched_stop(ps__sched *s);
void ps__sched_destroy(ps__sched *s);

#endif
