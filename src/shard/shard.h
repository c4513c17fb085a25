/*
 * shard.h - the shard engine: a server's tables, clocks, rounds and consistency models,
 * with no sockets and no threads of its own.
 *
 * The engine takes decoded requests (ps__push, a pull's table and clock) and returns
 * verdicts: applied, dropped, rejected with an error and a message, or wait. It never
 * sees a connection; what it needs from its owner (release a push body it took, arm an
 * aggregation timer, a helper thread for huge requests, a sync round applied into
 * waiting pulls) it asks through the hooks given to ps__shard_new. One thread, the
 * owner's (the server's loop), calls everything here; a huge request may run part of
 * its work on the owner's helper thread, handed over and back by ps__par_run.
 *
 * Every change to a parameter or to its optimiser state goes through ps__shard_write
 * (below), and every row is created by ps__shard_row. Those two are where replication
 * forwards, checkpoints snapshot and migration exports and imports.
 *
 * The consistency models are an ops table (ps__mode_ops), one file per family:
 * sync.c (sync and sync:M), ssp.c (bounded staleness) and async.c (eventual, with
 * server-side aggregation). apply.c holds the update paths they share.
 */
#ifndef PS_SHARD_H
#define PS_SHARD_H

#include <stddef.h>
#include <stdint.h>

#include "common/config.h"
#include "common/par.h"
#include "proto/msg.h"
#include "shard/once.h"
#include "store/store.h"

#define PS__ROUND_WINDOW 8    /* rounds a sync push may run ahead of the applied version */
#define PS__MAX_TABLES 65536
#define PS__MAX_DELAY 10000   /* a push more clocks behind the fastest worker is rejected */
#define PS__STALE_BUCKETS 64  /* staleness histogram: 0..62, and >= 63 */
#define PS__PAR_MIN_KEYS (256u * 1024u) /* sparse requests this large use the helper thread */
#define PS__APPLY_STEP (64u * 1024u)    /* floats per idle step of a pending apply (256 KiB) */
#define PS__PRODUCE_STEP (256u * 1024u) /* floats per step while a reply waits on it (1 MiB) */

typedef struct ps__shard ps__shard;
typedef struct ps__table ps__table;
typedef struct ps__cut ps__cut;

/* A decoded push. keys are wire bytes: sparse row ids (8 bytes each, little-endian), or
 * for a dense table (offset, count) pairs of elements. */
typedef struct ps__push {
  uint32_t table, sender, batch;
  int64_t clock;
  float lr;             /* < 0: the table's schedule */
  const uint8_t *keys;
  uint32_t nkeys;
  const float *vals;    /* nvals floats: nkeys * dim (sparse) or the segments' total (dense) */
  uint64_t nvals;
  uint64_t inc;         /* identity (once.h): the sender's incarnation, 0 = none (not tracked) */
  uint32_t seq;         /* and the push's sequence number */
  uint64_t unit;        /* and the chain it went down (ps__once_unit), 0 without replicas */
  /* A push forwarded by the previous server of its chain (replication): that server
   * admitted it, so the clocks and the live set are not checked again; it is applied
   * with the head's rate (lr) and, when step is not 0, the head's step number, so that
   * the optimiser state stays the same on every copy. */
  int replica;
  uint64_t step;
} ps__push;

/* A pooled buffer the engine may take from its caller (a push body applied after the
 * push was acknowledged); buf is set NULL when taken, and the engine gives it back
 * through the release hook. With none (NULL, or buf NULL), a dense push is applied
 * before ps__shard_push returns. */
typedef struct ps__owned {
  void *buf;
  size_t len;
} ps__owned;

enum { PS__APPLIED = 0, PS__DROPPED = 1, PS__REJECTED = 2, PS__WAIT = 3 };

/* The engine's answer to a request: status (above); err and msg when rejected. */
typedef struct ps__verdict {
  int status;
  int later;    /* APPLIED, and the owner calls ps__shard_pending_first after its reply */
  int dup;      /* APPLIED before (once.h): answered as applied, nothing changed */
  int err;
  char msg[256];
} ps__verdict;

typedef struct ps__pusher {
  uint32_t worker;
  int64_t clock;
} ps__pusher;

/* One sync round's accumulated pushes: key -> batch-weighted sum of gradients. */
typedef struct ps__round {
  int64_t round;        /* which round this slot holds, -1 none */
  ps__rowmap *acc;      /* key -> accumulated gradient (width floats) */
  double batch_sum;
  float lr;
  int has_lr;
  ps__pusher *pushers;  /* (worker, clock) pairs that pushed this (table, round) */
  size_t npushers, cap;
} ps__round;

/* A dense push that was acknowledged and is being applied a piece at a time: its values,
 * in the order of its segment list, are applied up to `done`. */
typedef struct ps__pending_apply {
  int active;
  void *buf;            /* the push body (taken), owned */
  size_t len;
  const uint8_t *keys;  /* in buf */
  uint32_t nkeys;
  const float *vals;    /* in buf */
  uint64_t total, done; /* floats */
  uint32_t seg;         /* cursor: segment (pair index) and floats into it */
  uint64_t seg_off;
  float lr;
  uint64_t step;
} ps__pending_apply;

struct ps__table {
  ps__shard *sh;
  uint32_t id;
  ps__table_spec spec;
  ps__declare decl;
  ps__rowmap *params;
  uint64_t step;        /* updates applied (adam bias correction) */
  /* sync and sync:M */
  int64_t version;      /* rounds applied; round r covers clocks [r*every, (r+1)*every) */
  ps__round rounds[PS__ROUND_WINDOW];
  uint64_t blocked_ms;  /* when a live worker's clock first passed round `version` while the round
                         * still waited for others (ps__now_ms); 0: no worker waits */
  /* async and ssp: buffered pushes (server-side aggregation) */
  ps__rowmap *agg;      /* key -> sum of weighted gradients (width floats) + weight sum (1 float) */
  ps__rowmap *agg_rep;  /* a buffer forwarded by the chain's head, while it is applied here */
  ps__rowmap *round_rep; /* a sync round forwarded by the chain's head, while it is applied here */
  /* sync under replication (the owner's): rounds before `durable` are on every copy (a
   * pull waits for them too; INT64_MAX: no limit), and while `hold` is set no round is
   * applied and no pull answered (a failover's catch-up) */
  int64_t durable;
  int hold;
  uint32_t agg_count;
  double agg_batch;     /* sum of the buffered pushes' batches */
  float agg_lr;
  int agg_has_lr;
  int agg_armed;        /* the owner was asked for a flush after agg_ms */
  ps__pending_apply pend;
  /* counters */
  uint64_t pushes, pulls, dropped, rejected, applied;
  /* value bytes of a table with a codec (server/push.c, pull.c): as f32 and as encoded */
  uint64_t codec_push_raw, codec_push_wire, codec_pull_raw, codec_pull_wire;
  uint64_t nonfinite;   /* pushes refused or dropped for a NaN or an infinity */
  size_t params_bytes;  /* ps__rowmap_bytes(params) as counted in the engine's mem_used */
  float last_lr;        /* learning rate of the last update */
  double last_batch;    /* global batch of the last update */
  int64_t cut_at;       /* sync: cut (hooks.cut) once version * every >= cut_at; -1 none */
  /* checkpoints (snap.c): a cut being read by the owner's writer thread, and the rows
   * changed since the last cut (a bit per row number) when they are tracked */
  ps__cut *cut;
  uint64_t *dirty;
  size_t dirty_words;
  int track;
  int watch;            /* cut || track: ps__shard_write tells ps__shard_watch first */
  int dirty_inline;     /* track, no cut, one writer thread: ps__shard_write sets the bit */
  /* owner's cache: the dense slices [mine_lo, mine_hi) owned under ring generation mine_gen */
  uint64_t mine_gen, mine_lo, mine_hi;
  void *owner;          /* the owner's per-table state (an aggregation timer) */
};

typedef struct ps__worker {
  uint32_t id;
  int alive;    /* in the live set: rounds wait for its clock */
  int pending;  /* seen in a frame, not (yet) in the membership: never waited for */
  int64_t clock;
  uint64_t clocked_ms; /* when its clock last advanced, or it joined the live set (ps__now_ms) */
  int clocked;         /* its clock advanced here at least once (a straggler, if late; not a phantom) */
} ps__worker;

/* What the engine asks of its owner. Every hook is called on the owner's thread, from
 * within an engine call. */
typedef struct ps__shard_hooks {
  void *arg;
  /* Scratch buffers of a huge request, and bodies taken from a ps__owned: get n bytes
   * (NULL when out of memory) and give them back with the same n (required; the
   * server's are its buffer pool, whose pages stay warm between requests). */
  void *(*alloc)(void *arg, size_t n);
  void (*release)(void *arg, void *buf, size_t len);
  /* Call ps__shard_agg_flush(t) once, ms milliseconds from now; ms == 0 cancels. NULL:
   * aggregation by time is flushed only by count and by the owner. */
  void (*arm_flush)(void *arg, ps__table *t, uint32_t ms);
  /* The helper thread for a huge request of nkeys keys, or NULL to serve it serially. */
  ps__par *(*par)(void *arg, uint32_t nkeys);
  /* Sync round r of t is complete: apply it into waiting pulls (through
   * ps__shard_round_begin and ps__shard_apply_row) and return 1, or return 0 and the
   * engine applies it. *token is handed to round_done after the version moved on. */
  int (*round_apply)(void *arg, ps__table *t, ps__round *r, void **token);
  void (*round_done)(void *arg, ps__table *t, void *token);
  /* A sync table reached the clock of the cut asked for with ps__shard_cut_at: take its
   * snapshot now (ps__shard_snap), before the next round changes it. */
  void (*cut)(void *arg, ps__table *t);
  /* An aggregation buffer of t was applied (replication forwards it down the chains):
   * its rows (width + 1 floats: the weighted sums, then the weight sum), per_row (each
   * row is divided by its weight sum), and the rate, global batch and step it was
   * applied with. Called before the buffer is cleared. */
  void (*agg_applied)(void *arg, ps__table *t, const ps__rowmap *agg, int per_row, float lr, double gb,
                      uint64_t step);
  /* Sync round `round` of t was applied (replication forwards it down the chains): acc
   * its rows as applied (NULL: this server had none), which a copy applies with
   * ps__shard_apply_round_at and the same lr, denom and batch. Called for every round
   * the version passes, with or without rows, before the accumulator is cleared. */
  void (*round_applied)(void *arg, ps__table *t, ps__rowmap *acc, int64_t round, float lr, double denom,
                        double batch);
} ps__shard_hooks;

/* The consistency model of a table (one per ps__mode_kind). */
typedef struct ps__mode_ops {
  const char *name;
  /* Admit a push by its clock (the worker is known): APPLIED to go on, DROPPED (counted,
   * acknowledged, not applied) or REJECTED. */
  int (*admit)(ps__shard *sh, ps__table *t, ps__worker *w, const ps__push *p, int64_t fastest, ps__verdict *v);
  /* Apply or buffer an admitted push. */
  int (*push)(ps__shard *sh, ps__table *t, const ps__push *p, ps__owned *body, ps__verdict *v);
  /* May a pull at clock c be answered now? */
  int (*pull_ready)(ps__shard *sh, ps__table *t, int64_t c);
  /* Clocks or the live set changed: apply what is complete. */
  void (*advance)(ps__shard *sh, ps__table *t);
} ps__mode_ops;

extern const ps__mode_ops ps__mode_sync, ps__mode_ssp, ps__mode_async;

struct ps__shard {
  ps__shard_hooks hooks;
  int started;          /* the job has started (membership); before, pulls are answered at once */
  int64_t base_clock;   /* a restored job's clock: workers start there */
  ps__worker *workers;
  size_t nworkers, wcap;
  ps__table **tables;   /* indexed by table id */
  size_t ntables;
  size_t npending;      /* tables with a pending apply */
  uint64_t rejected_clock;
  uint64_t nonfinite_refused, nonfinite_skipped; /* pushes holding NaN or Inf (nonfinite=) */
  /* The memory budget of the tables' rows (parameters and optimiser state): once
   * mem_used reaches mem_limit (0: none), a request that would create a row is
   * refused (PS_ERR_NOMEM); rows that exist are served as before. */
  uint64_t mem_limit, mem_used, mem_refused;
  /* staleness of applied pushes (max worker clock - push clock) and of answered pulls
   * (pull clock - slowest live worker's clock), async and ssp tables */
  uint64_t push_stale[PS__STALE_BUCKETS], pull_stale[PS__STALE_BUCKETS];
  int64_t push_stale_max, pull_stale_max;
  ps__once_set once;    /* per worker: the pushes applied (once.h) */
  uint64_t replay_step; /* while a forwarded push is applied: the head's step (0: none) */
};

/* ---------------------------------------------------------------- engine and tables */

ps__shard *ps__shard_new(const ps__shard_hooks *hooks);
void ps__shard_free(ps__shard *sh);
const ps__mode_ops *ps__shard_mode(const ps__table *t);
int ps__table_is_sync(const ps__table *t);
/* The table's mode as STATS names it: "sync", "sync:M", "ssp" or "async". */
const char *ps__table_mode_name(const ps__table *t);
static inline ps__table *ps__shard_table(const ps__shard *sh, uint32_t id) {
  return id < sh->ntables ? sh->tables[id] : NULL;
}
/* Create table d (its options parsed), or check that an existing one is the same.
 * PS__APPLIED, or PS__REJECTED (INVALID, CONFIG, CONFLICT, NOMEM) with a message. */
int ps__shard_create(ps__shard *sh, const ps__declare *d, ps__verdict *v);
/* Forget table id and everything in it (a table whose restore failed). */
void ps__shard_drop(ps__shard *sh, uint32_t id);

/* Does a request that may create the rows of keys (wire bytes: sparse row ids, or a
 * dense table's (offset, count) pairs) fit the memory budget? Under the budget, or when
 * every row exists already: PS__APPLIED. Else PS__REJECTED (PS_ERR_NOMEM naming the
 * budget and the first new row), counted in mem_refused. */
int ps__shard_room(ps__shard *sh, ps__table *t, const uint8_t *keys, uint32_t nkeys, ps__verdict *v);

/* ---------------------------------------------------------------- clocks and workers */

ps__worker *ps__shard_worker(ps__shard *sh, uint32_t id);
/* Clocks of the live workers: slowest, fastest and count. */
size_t ps__shard_live_clocks(const ps__shard *sh, int64_t *minc, int64_t *maxc);
/* The scheduler's membership lists worker id as alive or not (a worker only seen in
 * frames so far becomes live). */
void ps__shard_member(ps__shard *sh, uint32_t id, int alive);
/* The membership's job state (0 waiting, 1 running, 2 finished); then apply what is complete. */
void ps__shard_set_started(ps__shard *sh, int started);
/* A CLOCK from worker id: it finished clock-1. Applies every round that completes. */
void ps__shard_clock(ps__shard *sh, uint32_t id, int64_t clock);
/* Apply every sync round that is complete. */
void ps__shard_advance(ps__shard *sh);
/* The live workers that hold a sync round back: for each table whose next round waits
 * while some worker has passed it, the workers it waits for, with how long the round
 * has waited for them (since the later of their last clock and the first arrival), if
 * at least min_ms. One entry per worker (its longest wait), at most cap; the count. */
size_t ps__sync_laggards(ps__shard *sh, uint64_t now_ms, uint64_t min_ms, ps__stall *out, size_t cap);

/* ---------------------------------------------------------------- requests */

/* The position of the first NaN or infinity among v[0..n), or UINT64_MAX: a
 * vectorised scan, the check every push's values pass under nonfinite=refuse|skip. */
uint64_t ps__first_nonfinite(const float *v, uint64_t n);
/* Admit and apply (or buffer, or drop) a validated push: p's table exists with the
 * right kind, and its keys are owned and match its values. A push that would create a
 * row past the memory budget is refused (ps__shard_room). A push holding a value that
 * is not finite, or a rate (lr >= 0 or NaN) that is not, changes nothing: it is
 * refused (PS_ERR_INVALID naming the table and the first bad value) or, under
 * nonfinite=skip, dropped (PS__DROPPED). The engine may take body (a dense push applied
 * after it is acknowledged). Returns v->status. */
int ps__shard_push(ps__shard *sh, const ps__push *p, ps__owned *body, ps__verdict *v);
/* Admit a sync push and return its round's accumulator, for an owner that fills it
 * itself (a push read from the worker's memory as it goes) and then counts it in
 * t->pushes and calls ps__shard_push_done; NULL with v set when it is dropped,
 * rejected or a duplicate (v->dup, status APPLIED: answer it as applied). */
ps__rowmap *ps__shard_push_acc(ps__shard *sh, const ps__push *p, ps__verdict *v);
/* The push of a ps__shard_push_acc is in its round: record its identity (once.h). */
void ps__shard_push_done(ps__shard *sh, const ps__push *p);
/* A validated pull of table `table` at clock c: PS__APPLIED (answer it now), PS__WAIT
 * (it waits for a round, or for the slowest worker; ask again after a clock or
 * membership change), or PS__REJECTED (NO_TABLE). */
int ps__shard_pull(ps__shard *sh, uint32_t table, int64_t c, ps__verdict *v);
/* The same question for a known table: may a pull at clock c be answered now? */
int ps__shard_pull_ready(ps__shard *sh, ps__table *t, int64_t c);
/* A pull of worker `sender` at clock c is answered now: record its staleness, and
 * return the clock of the values (a sync table's applied rounds), moving a worker that
 * fell behind a sync:M job up to it. */
int64_t ps__shard_pull_answered(ps__shard *sh, ps__table *t, uint32_t sender, int64_t c);
/* Copy the rows of keys [lo, hi) (wire bytes) into out, creating missing ones; 1 if a
 * row could not be created (written as zeros), else 0. */
int ps__shard_read_rows(ps__table *t, const uint8_t *keys, uint32_t lo, uint32_t hi, float *out);
/* The same for a whole huge request on the owner's helper thread; 0 or PS_ERR_NOMEM. */
int ps__shard_read_huge(ps__table *t, ps__par *par, const uint8_t *keys, uint32_t nkeys, float *out);
/* Apply the buffered async/ssp pushes of t now. */
void ps__shard_agg_flush(ps__table *t);

/* ---------------------------------------------------------------- pending applies */

/* The first step of a pending apply that a push started (verdict.later), called
 * once the push is acknowledged: a small push is applied whole, a large one in part. */
void ps__shard_pending_first(ps__table *t);
/* Apply up to `budget` more floats of t's pending push (all: UINT64_MAX). */
void ps__shard_pending_step(ps__table *t, uint64_t budget);
/* Finish t's pending apply, if any. Everything that reads or updates t's parameters
 * calls this first, except a pull of exactly the pending ranges (ps__shard_pending_step
 * then runs while its reply is sent). */
static inline void ps__shard_flush(ps__table *t) {
  if (t->pend.active) ps__shard_pending_step(t, UINT64_MAX);
}
/* A step of every pending apply (the owner calls it when idle). */
void ps__shard_pending_idle(ps__shard *sh, uint64_t budget);

/* ---------------------------------------------------------------- checkpoints (snap.c) */

/* One table as it was at its cut, and the state a restore needs. Its n rows (key,
 * parameters and optimiser state), numbered in the order of the table's row map, are
 * read with ps__snap_key and ps__snap_read, from any one thread, through the cut: the
 * live rows, each saved first by the owner if it is written before the reader has read
 * it (and, in a map of one-float rows kept in its index, every unread row saved before
 * the index grows and moves them). dirty: the rows changed since the cut before (a bit
 * per row number; rows created since are set), or NULL when they were not tracked. */
typedef struct ps__snap_table {
  ps__declare decl;
  uint32_t width, row_floats;
  uint64_t step;
  int64_t version;
  uint64_t n;
  ps__cut *cut;
  uint64_t *dirty;
} ps__snap_table;

/* The first clock at or after `clock` at which table t can be cut: a sync table's next
 * round boundary (a multiple of every). */
int64_t ps__shard_cut_clock(const ps__table *t, int64_t clock);
/* The clock a sync table's applied rounds reach (version * every); 0 for other modes.
 * A cut at a clock whose boundary is below it is too late. */
int64_t ps__shard_table_clock(const ps__table *t);
/* Is a cut of t at clock too late already (a sync table past its boundary)? */
int ps__shard_cut_too_late(const ps__table *t, int64_t clock);
/* Ask for the cut of table t at clock (sync tables: once version * every reaches its
 * boundary; hooks.cut is called then, or at once when it is there already). Others are
 * cut at once. 0, or PS_ERR_CLOCK when a sync table is past it already. */
int ps__shard_cut_at(ps__shard *sh, ps__table *t, int64_t clock);
/* Cut table t as it is now into *out (finishing a pending apply and flushing an
 * aggregation buffer first, so every acknowledged push is in): O(chunks), not a copy of
 * the rows. The dirty rows since the cut
 * before go with it; from now on the table tracks its changed rows when track is set
 * (and forgets them when not). One cut of a table at a time. 0 or PS_ERR_NOMEM. */
int ps__shard_snap(ps__table *t, ps__snap_table *out, int track);
/* The same cut for a copy to another server (a replacement's rows): the rows changed
 * since the last checkpoint and their tracking are left as they are, and an aggregation
 * buffer is left unapplied (when applied it is forwarded to the copy). */
int ps__shard_snap_keep(ps__table *t, ps__snap_table *out);
/* Key and row (row_floats floats into dst) of row i < s->n as they were at the cut,
 * each row read once. 0, or PS_ERR_NOMEM when the owner could not save a row before
 * writing it (the snapshot is lost then). Any thread (one at a time). */
uint64_t ps__snap_key(const ps__snap_table *s, uint64_t i);
int ps__snap_read(ps__snap_table *s, uint64_t i, float *dst);
/* A hint: row i is read soon. */
void ps__snap_prefetch(const ps__snap_table *s, uint64_t i);
/* Is row i in the snapshot's dirty set (every row when it has none)? */
static inline int ps__snap_dirty(const ps__snap_table *s, uint64_t i) {
  return !s->dirty || (s->dirty[i >> 6] >> (i & 63) & 1);
}
/* On the owner's thread, once the reader is done: the table (if it still exists)
 * forgets the cut, and the snapshot's memory is freed. */
void ps__shard_snap_release(ps__shard *sh, ps__snap_table *s);
/* Frees what a snapshot holds, on any thread, once no table refers to its cut (after
 * ps__shard_snap_release, or for a snapshot whose table was freed). */
void ps__snap_table_free(ps__snap_table *s);
/* Called by ps__shard_write before row `key` changes, when t->watch is set: marks it
 * dirty and, under a cut, saves its old value first if the reader has not read it. */
void ps__shard_watch(ps__table *t, uint64_t key, uint32_t idx);
/* Row `key` was just created (tracked as changed); a table being freed under a cut
 * leaves its map to the cut. */
void ps__shard_created(ps__table *t, uint64_t key);
void ps__shard_cut_orphan(ps__table *t);

/* ---------------------------------------------------------------- the mutation point */

/* The parameter row for key, created from the initialiser on first touch; NULL when out
 * of memory. Rows never move (store.h). */
float *ps__shard_row(ps__table *t, uint64_t key);
/* The same, with the row's number (its place in the row map) into *idx. */
float *ps__shard_row_at(ps__table *t, uint64_t key, uint32_t *idx);
/* ps__shard_row_at for n <= PS__ROWS_BATCH keys at once (keys64, or when it is NULL the
 * wire's keys_le), through the row map's batch upsert: rows[] and, if idx is not NULL,
 * the row numbers. Returns n, or the number of keys done when memory ran out (logged by
 * the caller). */
#define PS__ROWS_BATCH 512u
/* A request is about to look up n keys of t, any of which may be new: when n is at
 * least the rows t holds, its index is sized now for all of them (ps__rowmap_reserve).
 * Moving the rows held then costs no more than the request's own work, and the request
 * does not grow the index step by step, moving its own new rows again at each step
 * (a first huge push or pull into an empty table). The index is at most n entries too
 * large if the keys were not new. Failure to reserve changes nothing (the index grows
 * as usual). */
void ps__shard_expect(ps__table *t, size_t n);
size_t ps__shard_rows_at(ps__table *t, const uint64_t *keys64, const uint8_t *keys_le, size_t n, float **rows,
                         uint32_t *idx);
/* Rows were added to t->params: count their memory in the engine's mem_used. */
void ps__shard_grown(ps__table *t);
#define PS__ROW_ANY UINT32_MAX /* a row number not known: ps__shard_watch looks it up */

/* A whole row (parameters and optimiser state, row_floats floats) set from a
 * checkpoint or another server: the one way a row changes other than by an optimiser
 * step. 0 or PS_ERR_NOMEM. */
int ps__shard_import(ps__table *t, uint64_t key, const float *row);

/* The one place where parameters and optimiser state change by a step: one optimiser step with
 * rate lr and step number `step` on parameters [within, within + n) of row `row`
 * (the row of `key`, number idx in the row map, or PS__ROW_ANY), gradient g (combined
 * already: the mean or the sum). Called on the owner's thread, or on its helper thread
 * for the rows of a huge push that the helper owns (each row then has one writer). The
 * row number spares a watched table (a cut being read, changed rows tracked) a second
 * lookup of the key; callers that have it cheaply pass it when t->watch is set. */
static inline void ps__shard_write(ps__table *t, uint64_t key, uint32_t idx, float *row, uint32_t within,
                                   const float *g, size_t n, float lr, uint64_t step) {
  if (__builtin_expect(t->watch, 0)) {
    if (idx != PS__ROW_ANY && t->dirty_inline) t->dirty[idx >> 6] |= (uint64_t)1 << (idx & 63);
    else ps__shard_watch(t, key, idx);
  }
  unsigned width = t->spec.width;
  if (t->spec.opt.kind == PS__OPT_SGD && n <= 8) {
    /* sgd on a short run (sparse rows of small dim): the step inlined, no call. */
    float *w = row + within;
    for (size_t k = 0; k < n; k++) w[k] -= lr * g[k];
    return;
  }
  ps__optim_apply(&t->spec.opt, lr, step, row + within, row + width + within, width, g, n);
}

/* ---------------------------------------------------------------- rounds (for the owner's round_apply) */

/* Start applying round r of t as one optimiser step: its rate, step number and the
 * denominator of its rows (finishes a pending apply first). 0 when the round is empty. */
int ps__shard_round_begin(ps__table *t, ps__round *r, float *lr, uint64_t *step, double *denom);
/* One row of a round or buffer: gradient sum g (scaled in place), denominator d.
 * 0 or PS_ERR_NOMEM (logged). */
int ps__shard_apply_row(ps__table *t, uint64_t key, float *g, double d, float lr, uint64_t step);

/* ---------------------------------------------------------------- shared by the mode files */

void ps__shard_stale(uint64_t *hist, int64_t *max, int64_t v);
int ps__shard_reject(ps__shard *sh, ps__table *t, ps__verdict *v, int err, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Apply a whole accumulator as one step; per_row_denom: each row's last float is its
 * denominator. Rows other than sgd's are divided in place (sgd scales its rate instead),
 * so afterwards the accumulator holds what was applied: see ps__shard_acc_divided. */
void ps__shard_apply_acc(ps__table *t, ps__rowmap *acc, double denom, int per_row_denom, float lr, double global_batch);
/* After ps__shard_apply_acc with per-row denominators, are t's accumulator rows already
 * divided by them (applying them again takes denominator 1)? */
static inline int ps__shard_acc_divided(const ps__table *t) { return t->spec.opt.kind != PS__OPT_SGD; }
/* Accumulate p's gradients, weighted, into acc (count_weight: rows carry their weight sum). */
int ps__shard_accumulate(ps__table *t, ps__rowmap *acc, const ps__push *p, float weight, int count_weight);
/* async.c's admission and push path, shared with ssp.c. */
int ps__async_admit(ps__shard *sh, ps__table *t, ps__worker *w, const ps__push *p, int64_t fastest, ps__verdict *v);
int ps__async_push(ps__shard *sh, ps__table *t, const ps__push *p, ps__owned *body, ps__verdict *v);
/* A sync push's round accumulator, with its pusher and rate recorded (sync.c). */
ps__rowmap *ps__sync_round_acc(ps__shard *sh, ps__table *t, const ps__push *p, ps__verdict *v);
/* Apply an aggregation buffer as its chain's head applied it (replication): n rows of
 * width + 1 floats under keys (little-endian u64: row ids, or slices of a dense table),
 * with the head's rate, global batch and step, as ps__shard_agg_flush did there; then
 * record the pushes it combined (ids) in their windows, so a copy of one of them sent
 * here later is answered as applied. PS__APPLIED, or REJECTED (out of memory, or t is a
 * table without aggregation). */
int ps__shard_agg_replica(ps__shard *sh, ps__table *t, const uint8_t *keys, const float *rows, uint32_t n,
                          int per_row, float lr, double gb, uint64_t step, const ps__push_id *ids, uint32_t nids,
                          ps__verdict *v);
/* Apply acc as sync round `round` of t (its step, round + 1; lr < 0: the schedule's at
 * that step for batch): the same call on every copy of the rows gives the same result. */
void ps__shard_apply_round_at(ps__table *t, ps__rowmap *acc, int64_t round, float lr, double denom, double batch);
/* Apply n rows of width floats under keys (little-endian u64, each once: the head's
 * accumulator's) as sync round `round`, as its chain's head applied them
 * (ps__shard_apply_round_at). Read only; straight from them when no gradient is to be
 * scaled (denom 1, or sgd). PS__APPLIED or REJECTED. */
int ps__shard_round_replica(ps__shard *sh, ps__table *t, const uint8_t *keys, const float *rows, uint32_t n,
                            int64_t round, float lr, double denom, double batch, ps__verdict *v);
/* The identity check of push p alone (shard/once.h): PS__APPLIED (new: after applying it
 * elsewhere, record it with ps__shard_push_done), APPLIED with v->dup, or REJECTED. */
int ps__shard_push_identity(ps__shard *sh, ps__table *t, const ps__push *p, ps__verdict *v);
/* Does t buffer pushes (async or ssp with agg_n > 1 or agg_ms)? */
static inline int ps__table_aggregates(const ps__table *t) {
  return !(t->spec.mode == PS__MODE_SYNC || t->spec.mode == PS__MODE_SYNC_M) &&
         !(t->spec.agg_n == 1 || (t->spec.agg_n == 0 && t->spec.agg_ms == 0));
}
/* Apply a push on its own, at once (async and ssp without aggregation). */
int ps__shard_apply_direct(ps__shard *sh, ps__table *t, const ps__push *p, ps__owned *body, ps__verdict *v);
/* The global batch of a push applied on its own: its batch times the live workers. */
double ps__shard_direct_batch(const ps__shard *sh, uint32_t batch);

/* The dense segment list (offset, count pairs) as runs inside slices: fn(arg, slice,
 * first element within it, count, position of the run in the values). Stops at, and
 * returns, fn's first non-zero. */
typedef int (*ps__slice_fn)(void *arg, uint64_t slice, uint64_t within, uint64_t n, uint64_t pos);
int ps__walk_slices(const uint8_t *keys, uint32_t nkeys, unsigned width, ps__slice_fn fn, void *arg);

#endif /* PS_SHARD_H */
