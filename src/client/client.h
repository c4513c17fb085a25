/*
 * client.h - what the layers above the worker side use: a context opened in two steps,
 * the settings every in-process node shares, and the hook for what runs beside.
 *
 * ps_ctx_open (src/embed/embed.c) composes a worker with the scheduler and server
 * threads of embedded mode, or with a colocated server: it creates the context
 * (ps__ctx_new), starts those threads, gives the context the hook that stops them
 * (ps__ctx_set_embed), then starts it against the scheduler's address (ps__ctx_start).
 * The worker side never includes the server or scheduler headers.
 * Threads: all of these run on the thread that opens the context.
 */
#ifndef PS_CLIENT_H
#define PS_CLIENT_H

#include <stdint.h>

#include "pshard.h"

/* The settings of a configuration that the worker and the threads beside it share,
 * defaults applied. */
typedef struct ps__worker_opts {
  uint32_t timeout_ms, connect_timeout_ms, heartbeat_ms, vnodes;
  uint32_t rejoin_ms; /* how long a lost scheduler is waited for (agent/agent.h) */
  uint64_t max_payload;
  int use_unix;
  int count; /* metrics=on: count on the request path (a colocated server follows it) */
} ps__worker_opts;
void ps__worker_opts_read(const ps_config *cfg, ps__worker_opts *o);

/* What runs beside the worker in its process. ps_ctx_close calls stop(arg, linger_ms)
 * once the worker has left the job and its loop is gone: wait up to linger_ms for the
 * threads to stop by themselves (a colocated server serves the other workers until
 * none is left), then stop the rest. linger_ms is 0 when the open failed. */
typedef struct ps__ctx_embed {
  void (*stop)(void *arg, uint32_t linger_ms);
  void *arg;
  int http_port;           /* a colocated server's /metrics port, -1 for none */
} ps__ctx_embed;

/* A worker context from cfg (not NULL), not yet connected. PS_ERR_ROLE for a role
 * other than worker, PS_ERR_NOMEM. */
int ps__ctx_new(const ps_config *cfg, ps_ctx **out);
/* What to stop at close (copied); before ps__ctx_start. */
void ps__ctx_set_embed(ps_ctx *ctx, const ps__ctx_embed *emb);
/* Register with the scheduler at sched_host:sched_port and wait for the job to start
 * (connect_timeout_ms). linger: ask the hook to linger at close. On failure the context
 * is closed (the hook stopping at once) and the error returned, as ps_ctx_open's. */
int ps__ctx_start(ps_ctx *ctx, const char *sched_host, int sched_port, int linger);
/* Close a context that was not started, keeping the failure's message: returns rc. */
int ps__ctx_abort(ps_ctx *ctx, int rc);

#endif
