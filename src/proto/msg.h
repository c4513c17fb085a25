/*
 * msg.h - bodies of control frames (hello, membership, declare, create, metric).
 * Encoded with ps__wbuf and decoded with bounds-checked ps__rbuf; no I/O.
 */
#ifndef PS_MSG_H
#define PS_MSG_H

#include <stdint.h>

#include "proto/frame.h"

enum { PS_ROLE_SCHEDULER = 1, PS_ROLE_SERVER = 2, PS_ROLE_WORKER = 3 };

#define PS_HOST_MAX 64
#define PS_PATH_MAX 108
#define PS_NAME_MAX 128
#define PS_OPTS_MAX 1024
#define PS_MAX_MEMBERS 4096

typedef struct ps__member {
  uint32_t id;
  uint8_t role;
  uint8_t alive;
  uint32_t rank;
  uint16_t port;
  char host[PS_HOST_MAX];
  char unix_path[PS_PATH_MAX];
  char hostid[PS_HOST_MAX];
  uint8_t caps;           /* PS_CAP_* the node offers */
  uint32_t late;          /* a server that joined as a replacement: its admission number (1 for
                           * the job's first, increasing; 0: not one). ring.h: the head rule */
  uint8_t syncing;        /* a replacement still copying its rows: holds no copy yet */
} ps__member;

/* hello: who is registering and where it can be reached. */
typedef struct ps__hello {
  uint8_t role;
  uint16_t port;
  uint32_t pid;
  char host[PS_HOST_MAX];
  char unix_path[PS_PATH_MAX];
  char hostid[PS_HOST_MAX];
  uint8_t caps;
  uint8_t join;  /* a server that replaces a dead one (pshard server --join); absent on the wire: 0 */
  uint64_t token; /* random, one per node process: a registration sent again because its answer
                   * was lost (the connection broke, the scheduler restarted) names the node the
                   * scheduler registered; absent on the wire: 0 */
} ps__hello;

/* Capabilities a node announces in its hello (ps__member.caps). */
enum {
  PS_CAP_PEER_MEM = 1 /* a server serving peer-memory frames (net/peermem.c) */
};

typedef struct ps__membership {
  uint64_t epoch;
  uint32_t servers_expected, workers_expected;
  uint8_t started;
  uint8_t replicas;      /* R: copies of every key range (1..3); absent on the wire: 1 */
  uint32_t n;
  ps__member *m; /* n entries, owned (free with ps__membership_clear) */
} ps__membership;

typedef struct ps__declare {
  uint32_t id;   /* create: the table id; declare: 0 */
  uint8_t kind;
  uint64_t size;
  char name[PS_NAME_MAX];
  char options[PS_OPTS_MAX];
} ps__declare;

void ps__hello_encode(ps__wbuf *w, const ps__hello *h);
int ps__hello_decode(const void *p, size_t n, ps__hello *h);
void ps__membership_encode(ps__wbuf *w, const ps__membership *m);
/* Allocates m->m; returns 0 or PS_ERR_PROTO / PS_ERR_NOMEM. */
int ps__membership_decode(const void *p, size_t n, ps__membership *m);
void ps__membership_clear(ps__membership *m);
/* The head-rule state (common/ring.h, PS_CHAIN_*) of member x. */
uint8_t ps__member_chain_state(const ps__member *x);
void ps__declare_encode(ps__wbuf *w, const ps__declare *d);
int ps__declare_decode(const void *p, size_t n, ps__declare *d);

/* Checkpoints (docs/checkpoint.md). */
#define PS_CKPT_DIR_MAX 1024

/* CKPT (scheduler -> server): write checkpoint `id` into dir (the checkpoint's own
 * directory, DIR/ckpt-<id>), every sync table cut once `clock` rounds' worth of clocks
 * are applied (its version * every >= clock), the others at once. */
typedef struct ps__ckpt_req {
  uint64_t id;
  int64_t clock;
  uint32_t nservers;
  char dir[PS_CKPT_DIR_MAX];
  uint64_t base;   /* an increment on this complete checkpoint (same directory); 0: whole */
  uint32_t track;  /* 1: keep the set of rows changed from now on (increments follow) */
  uint32_t part;   /* this server's file among the checkpoint's nservers (its rank in them) */
} ps__ckpt_req;

/* CKPT reply (server -> scheduler): the data file it wrote. */
typedef struct ps__ckpt_done {
  uint32_t rank;
  char name[64];   /* in the checkpoint's directory */
  uint64_t bytes, checksum, rows;
  uint64_t base;   /* the file holds the rows changed since this checkpoint; 0: every row */
} ps__ckpt_done;

/* CHECKPOINT reply (scheduler -> requester): the complete checkpoint (in the header:
 * clock = its clock). */
typedef struct ps__ckpt_info {
  uint64_t id;
  char dir[PS_CKPT_DIR_MAX];
} ps__ckpt_info;

/* STALL body (server -> scheduler, no reply): u32 count, then per entry u32 worker,
 * u32 table, i64 round, u64 held_ms, u32 clocked, u32 zero. Each entry is a live worker
 * whose clock the server's sync round `round` of `table` has waited for, while another
 * worker had passed it, for held_ms; clocked: the worker has clocked before (a
 * straggler, not a node that never takes part). The scheduler removes a worker that
 * never clocked once held longer than its heartbeat timeout, and a straggler once held
 * longer than its stall timeout. */
#define PS_STALL_MAX 256
typedef struct ps__stall {
  uint32_t worker, table;
  int64_t round;
  uint64_t held_ms;
  uint32_t clocked;
} ps__stall;

void ps__stall_encode(ps__wbuf *w, const ps__stall *v, size_t n);
/* 0 with *n entries in out (room for PS_STALL_MAX), or PS_ERR_PROTO. */
int ps__stall_decode(const void *p, size_t len, ps__stall *out, size_t *n);

void ps__ckpt_req_encode(ps__wbuf *w, const ps__ckpt_req *q);
int ps__ckpt_req_decode(const void *p, size_t n, ps__ckpt_req *q);
void ps__ckpt_done_encode(ps__wbuf *w, const ps__ckpt_done *d);
int ps__ckpt_done_decode(const void *p, size_t n, ps__ckpt_done *d);
void ps__ckpt_info_encode(ps__wbuf *w, const ps__ckpt_info *i);
int ps__ckpt_info_decode(const void *p, size_t n, ps__ckpt_info *i);

#endif
