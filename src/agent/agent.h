/*
 * agent.h - the node agent: a node's link to the scheduler, a piece a loop owner embeds.
 *
 * Every node (server or worker) registers with the scheduler the same way: connect,
 * retrying while the scheduler does not listen yet (launchers start every rank at
 * once) until the connect deadline; send HELLO; heartbeat every heartbeat_ms; take the
 * MEMBERSHIP frames the scheduler broadcasts; leave with LEAVE. The agent does that
 * once for all of them. Its owner embeds a ps__agent in its own state, runs it on its
 * own loop, and learns what happens only through the callbacks it gave (a lower piece
 * never calls into its owner otherwise). Frames on the scheduler connection that the
 * agent does not handle itself (replies to the owner's own control requests, such as a
 * worker's DECLARE or BARRIER) go to the owner's on_header and on_frame.
 *
 * The deadline covers registration, not only the connection: a node not registered
 * connect_timeout_ms after ps__agent_start is lost (PS_ERR_UNAVAILABLE if the scheduler
 * never accepted a connection, else PS_ERR_TIMEOUT).
 *
 * Threads: every function runs on the owner's loop thread, except ps__agent_refused,
 * which any thread may call. Callbacks run on the loop thread.
 */
#ifndef PS_AGENT_H
#define PS_AGENT_H

#include <stdint.h>
#include <uv.h>

#include "net/net.h"
#include "proto/msg.h"

/* How long nodes wait for a lost scheduler to come back, unless told otherwise
 * (configuration key rejoin_ms, `pshard server --rejoin-ms`). */
#define PS__REJOIN_MS 10000u

typedef struct ps__agent_cbs {
  void *arg; /* passed to every callback */
  /* The scheduler accepted the HELLO: this node's id and rank. The reply's clock (where
   * a restored job resumes) is in ps__agent.start_clock by then. */
  void (*registered)(void *arg, uint32_t id, uint32_t rank);
  /* A MEMBERSHIP frame, decoded (borrowed for the call). A frame that does not decode
   * is logged and dropped. */
  void (*membership)(void *arg, const ps__membership *m);
  /* Optional: the scheduler said the job is finished (membership with started == 2),
   * called right after membership(). */
  void (*finished)(void *arg);
  /* The agent is done for: the scheduler could not be reached or registered with by
   * the deadline (status PS_ERR_UNAVAILABLE or PS_ERR_TIMEOUT), refused the
   * registration (its status), or closed the connection (PS_ERR_UNAVAILABLE). msg says
   * which. Called at most once, never after ps__agent_stop. */
  void (*lost)(void *arg, int status, const char *msg);
  /* Optional: the scheduler went away after registration and the agent waits for it
   * (rejoin_ms): msg says why. registered() is called again, with the same id and
   * rank, when it takes this node back. */
  void (*detached)(void *arg, const char *msg);
  /* Optional: every heartbeat period once connected, after the heartbeat went out
   * (a worker reports its counters, a server sweeps its shared buffers). */
  void (*tick)(void *arg);
  /* Optional: the scheduler connection is up (c, on which the owner may send its own
   * frames until the next call) or gone (c NULL, status as ps__conn_ops.on_close). */
  void (*link)(void *arg, ps__conn *c, int status);
  /* Optional: frames the agent does not handle, as ps__conn_ops. Without on_header such
   * a frame is a protocol error (the connection is closed: lost). */
  int (*on_header)(void *arg, const ps__frame_hdr *h, ps__body *b);
  void (*on_frame)(void *arg, const ps__frame_hdr *h, ps__body *b);
} ps__agent_cbs;

typedef struct ps__agent_opts {
  const char *sched_host;      /* copied */
  int sched_port;
  ps__hello hello;             /* what the node announces: role, pid, hostid, and for a
                                * server its host, TCP port, unix path and caps; its
                                * token, when 0, is drawn at random by ps__agent_init */
  uint32_t heartbeat_ms;       /* 0: 200 */
  uint32_t connect_timeout_ms; /* deadline to register; 0: 60000 */
  uint32_t retry_ms;           /* between refused connection attempts; 0: 200 */
  ps__pool *pool;              /* the owner's loop pool, for frame bodies */
  uint64_t max_payload;        /* largest frame accepted from the scheduler; 0: 16 MiB */
  uint32_t rejoin_ms;          /* after registering: a lost scheduler is waited for this
                                * long (reconnecting every retry_ms, then a HELLO naming
                                * this node's id) before lost(); 0: lost() at once */
} ps__agent_opts;

typedef struct ps__agent {
  uv_loop_t *loop;
  ps__agent_opts o;
  ps__agent_cbs cb;
  char sched_host[PS_HOST_MAX];
  ps__conn *conn;              /* the scheduler connection, or NULL */
  uv_timer_t hb_timer, retry_timer, deadline_timer;
  uint64_t deadline_ms;
  uint32_t id, rank;
  int64_t start_clock;         /* the HELLO reply's clock: 0, or a restored job's clock */
  int registered, stopped, lost, connected_once;
  int rejoining;               /* registered once, the scheduler gone: reconnecting */
  uint32_t rejoins;            /* times the scheduler came back */
  int refused;                 /* the last connection attempt was refused (atomic) */
  uint64_t refused_since_ms;   /* the first refusal of this run of them (0: none) */
  int said_waiting;            /* the "still waiting" line was written */
} ps__agent;

/* Set a up on loop (timers; no I/O yet). 0, or PS_ERR_INVALID for a missing callback
 * (registered, membership and lost are required) or a bad scheduler address. */
int ps__agent_init(ps__agent *a, uv_loop_t *loop, const ps__agent_opts *o, const ps__agent_cbs *cb);
/* Start connecting; the deadline runs from now. 0, or an error (nothing started). */
int ps__agent_start(ps__agent *a);
/* Stop: with leave and a connection, send LEAVE and close once it is flushed; else
 * close. Timers are closed (with the loop's other handles). No callback runs after
 * this, except link(NULL) when the connection closes. Idempotent. The owner frees a
 * only after its loop has run to the end (uv_run returned). */
void ps__agent_stop(ps__agent *a, int leave);
/* The node id the scheduler gave (0 before registration). */
uint32_t ps__agent_id(const ps__agent *a);
/* The clock the job starts at, from the HELLO reply (0 before registration, or when the
 * job is not restored from a checkpoint). */
int64_t ps__agent_start_clock(const ps__agent *a);
/* Was the last connection attempt refused (the scheduler not listening)? Any thread. */
int ps__agent_refused(const ps__agent *a);

/* Close every handle of loop but its async wake-ups (a mailbox closes its own):
 * connections through ps__conn_close, the rest with uv_close. For shutdown; close
 * listeners first (ps__listener_close), whose handles are not connections. */
void ps__loop_close_all(uv_loop_t *loop);

#endif
