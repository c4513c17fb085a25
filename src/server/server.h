/*
 * server.h - the server role: holds shards of the tables and applies updates.
 *
 * Threads: one libuv loop owns all state (tables, rounds, connections); ps__server_run
 * runs it in the calling thread; ps__server_stop may be called from any thread.
 */
#ifndef PS_SERVER_H
#define PS_SERVER_H

#include <stdint.h>

typedef struct ps__server ps__server;

typedef struct ps__server_opts {
  const char *host;          /* address to bind and advertise (127.0.0.1) */
  int port;                  /* 0 = ephemeral */
  const char *sched_host;
  int sched_port;
  int use_unix;              /* also listen on an AF_UNIX socket for same-host peers */
  uint32_t heartbeat_ms;
  uint32_t vnodes;
  uint64_t max_payload;
  uint32_t connect_timeout_ms;
  uint32_t poll_us;          /* keep polling the sockets this long after a worker's frame
                              * instead of sleeping (0: always sleep; forced 0 on one CPU) */
  uint32_t rejoin_ms;        /* wait this long for a lost scheduler to come back (0: stop
                              * at once); the CLI's default is PS__REJOIN_MS */
  const char *restore_dir;   /* restore tables from the newest checkpoint there (or the
                              * checkpoint directory itself), NULL or "" for none */
  int stop_without_workers;  /* colocated in a worker: stop once the job has started and no
                              * worker is alive any more (each has left or died) */
  /* Limits (budget.c); 0 takes PSHARD_SERVER_MEMORY_MB, PSHARD_FRAME_BUDGET_MB and
   * PSHARD_FRAME_DEADLINE_MS from the environment, else the defaults there. */
  uint64_t memory_budget;    /* bytes of table rows (half the machine's memory) */
  uint64_t frame_budget;     /* bytes of partial frames in flight (a quarter of memory_budget,
                              * at least max_payload) */
  uint32_t frame_deadline_ms;/* a frame begun must arrive within this (60000) */
  /* Metrics over HTTP (GET /metrics, Prometheus text): http 1 serves them on
   * http_host:http_port (127.0.0.1; port 0 = ephemeral), 0 not. */
  int http;
  const char *http_host;
  int http_port;
  /* Counting on the request path (latency histograms, bytes by table): 1 on, -1 off,
   * 0 from PSHARD_METRICS (on, off; on when unset). Off, /metrics and STATS still
   * answer and those counters stay flat. */
  int metrics;
  int join;                  /* register as the replacement of a dead server of a running
                              * job (its id and rank), and copy its rows (server/repair.c) */
} ps__server_opts;

int ps__server_create(const ps__server_opts *o, ps__server **out);
/* Run until stopped or the scheduler is lost. Returns 0 after a stop, or an error. */
int ps__server_run(ps__server *s);
void ps__server_stop(ps__server *s);
void ps__server_destroy(ps__server *s);
int ps__server_port(const ps__server *s);
/* The port /metrics is served on, or -1 without HTTP. */
int ps__server_http_port(const ps__server *s);

#endif
