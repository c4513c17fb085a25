/*
 * repl_sync_int.h - what repl_sync.c (sync rounds forwarded down the chains) and
 * repl_catchup.c (a failover's catch-up) share: the state per replicated sync table,
 * a catch-up's, and the forwarding of a round.
 */
#ifndef PS_REPL_SYNC_INT_H
#define PS_REPL_SYNC_INT_H

#include "server/server_int.h"

/* A round being rebuilt after a failover. */
typedef struct cu_round {
  ps__rowmap *acc;
  double batch_sum;
  float lr;
  int has_lr;
} cu_round;

typedef struct cu_push {
  uint32_t worker, seq;
  uint64_t inc;
} cu_push;

typedef struct cu_seen {
  uint32_t worker;
  int64_t clock;
} cu_seen;

typedef struct cu_marker {
  uint32_t dead, worker;
} cu_marker;

#define CU_MAX_DEAD 8

typedef struct srv_catchup {
  uint32_t dead[CU_MAX_DEAD]; /* the servers whose chains this one took over */
  size_t ndead;               /* more than one: another died while it ran */
  int64_t V;            /* the table's version when it began: rounds [from, V) are rebuilt */
  int64_t from;
  uint8_t *taken;       /* per chain index: taken over */
  cu_round *rounds;     /* V - from of them */
  cu_marker *markers;   /* (dead server, worker) whose REPLAYED came */
  size_t nmarkers;
  cu_push *expect, *arrived;
  size_t nexpect, narrived;
  cu_seen *seen;        /* (worker, clock) pairs counted in a round's batch */
  size_t nseen;
  uint64_t deadline_ms;
} srv_catchup;

struct srv_sync {
  srv_sync *next;
  uint32_t table;
  int64_t *ver;          /* per chain index: rounds of the chain held here as a member */
  size_t nver;
  srv_fwd_group **rounds; /* rounds forwarded and not answered, oldest first */
  size_t nrounds, cap;
  srv_catchup *cu;       /* a failover's catch-up, or NULL */
  uint8_t *member;       /* per chain index, before a membership: 1 a member after the head */
  uint32_t *old_head;
};

#define CATCHUP_MIN_MS 5000

typedef struct round_rows {
  const ps__rowmap *m;  /* the head's round, or */
  const uint8_t *keys;  /* a frame's keys and rows */
  const float *rows;
  size_t n, w;
} round_rows;

typedef struct round_args {
  int64_t round;
  float lr;
  double denom, batch;
} round_args;

/* repl_sync.c */
/* The state of replicated sync table `table`, or NULL. */
srv_sync *ps__rs_find(ps__server *s, uint32_t table);
/* The table's `durable` from the rounds not answered yet (pulls waiting on it answered). */
void ps__rs_durable_update(ps__server *s, srv_sync *y);
/* A new group for round `round`'s forwards, listed in y, or NULL. */
srv_fwd_group *ps__rs_round_group(ps__server *s, srv_sync *y, int64_t round);
/* Send round ra's rows (a) of chains cks on to the live member after this server in
 * each, in group g. 0 or an error. */
int ps__rs_round_send(ps__server *s, ps__table *t, const round_rows *a, const uint32_t *cks, size_t ncks,
                      const round_args *ra, srv_fwd_group *g);

/* repl_catchup.c */
void ps__rs_catchup_free(srv_catchup *cu);
/* The REPLAYED lists kept for an epoch not reached, let go. */
void ps__rs_early_free(ps__server *s);

#endif
