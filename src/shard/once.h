/*
 * once.h - exactly-once pushes: per worker, which push sequence numbers were applied.
 *
 * Every push a worker sends carries its identity: the worker's node id, the
 * incarnation of the worker process (chosen when it opened its context; a restarted
 * process has a larger one) and a sequence number counted per worker and per server.
 * The client re-sends a push whose answer it did not get (a broken connection, no
 * reply within an attempt timeout) with the same identity, so a server may see a push
 * twice, or pushes out of order across connections. A window (ps__once) remembers, for
 * one worker, its incarnation, the highest sequence applied and which of the
 * PS__ONCE_WINDOW sequences below it were applied; the shard engine answers a push it
 * has applied already as applied, without applying it again.
 *
 * Under replicas a window is per worker and per *unit*: the chain the push went down
 * (a sparse table's ring route, or a dense table's run; every part of a push is of one
 * chain), 0 without replicas. A server is a member of several chains, at a different
 * place in each, so what it applied of one chain says nothing about another: a
 * replacement that copies a chain's rows from that chain's tail takes only that chain's
 * windows with them, and a window never says a push is applied where its rows are not.
 *
 * The windows are engine state: they live in the engine (ps__shard.once), are changed
 * only on its thread, and have an encoding (ps__once_set_encode / _decode) so that a
 * checkpoint or a replica can carry them. No I/O, no threads.
 */
#ifndef PS_ONCE_H
#define PS_ONCE_H

#include <stddef.h>
#include <stdint.h>

#include "proto/frame.h"

/* Sequence numbers remembered below the highest applied: a worker may have this many
 * pushes to one server outstanding and still get each re-sent one answered right. */
#define PS__ONCE_WINDOW 4096u
#define PS__ONCE_MAX_BITS 65536u  /* the largest window an encoding may carry */
#define PS__ONCE_MAX_WORKERS (1u << 20) /* windows an encoding may carry, at most */
#define PS__ONCE_SPARSE (1ull << 63)     /* the units of sparse routes (ps__once_unit) */

typedef struct ps__once {
  uint32_t worker;  /* node id */
  uint64_t unit;    /* the chain its pushes went down (ps__once_unit), 0 without replicas */
  int any;          /* a push was recorded: inc and high are set */
  uint64_t inc;     /* the incarnation the window is for */
  uint32_t high;    /* highest sequence applied, in serial-number order (RFC 1982) */
  uint64_t bits[PS__ONCE_WINDOW / 64]; /* bit s % W: sequence s applied, s in (high - W, high] */
} ps__once;

/* What a push's identity is, against a window. */
enum {
  PS__ONCE_NEW = 0,     /* not applied yet: apply it, then ps__once_mark */
  PS__ONCE_DUP = 1,     /* applied already: answer it as applied, change nothing */
  PS__ONCE_STALE = 2,   /* from an incarnation older than the window's: refuse */
  PS__ONCE_TOO_OLD = 3  /* at or below high - W: cannot tell, refuse */
};

/* Classify push (inc, seq) against w (not changed). */
int ps__once_check(const ps__once *w, uint64_t inc, uint32_t seq);
/* Record push (inc, seq) as applied, after ps__once_check said PS__ONCE_NEW: a newer
 * incarnation starts the window afresh. */
void ps__once_mark(ps__once *w, uint64_t inc, uint32_t seq);

/* The unit of a push of table `table` down chain `chain` (a ring route, or
 * PS_FWD_DENSE_CHAIN | a dense run): a sparse route is the same chain in every table, a
 * dense run is the table's own. Never 0 (0 is the unit without replicas). */
static inline uint64_t ps__once_unit(uint32_t table, uint32_t chain) {
  return (chain & PS_FWD_DENSE_CHAIN) ? (uint64_t)table << 32 | chain : PS__ONCE_SPARSE | chain;
}
/* And back: the chain of a unit (0 for the unit without replicas). */
static inline uint32_t ps__once_unit_chain(uint64_t unit) { return (uint32_t)unit; }

/* A push's identity: its worker, sequence, the worker's incarnation and its unit (a
 * push combined into an aggregation buffer travels with the buffer as this). */
typedef struct ps__push_id {
  uint32_t worker, seq;
  uint64_t inc;
  uint64_t unit;
} ps__push_id;

/* The windows of an engine: (worker id, unit) -> window, open addressing. */
typedef struct ps__once_set {
  ps__once **slot;  /* cap entries (a power of two), NULL = empty */
  size_t cap, n;
  uint64_t dups, stale; /* pushes answered from a window, refused by one */
} ps__once_set;

/* The window of worker (a node id, not 0) in unit, or NULL. */
ps__once *ps__once_find(const ps__once_set *s, uint32_t worker, uint64_t unit);
/* The window of worker in unit, created empty when missing; NULL when out of memory. */
ps__once *ps__once_get(ps__once_set *s, uint32_t worker, uint64_t unit);
void ps__once_set_clear(ps__once_set *s);

/* One window as bytes: u32 worker, u64 unit, u8 any, u64 inc, u32 high, u32 nbits, then nbits/8
 * bytes in which bit i (byte i / 8, bit i % 8) says that sequence high - i was
 * applied. A window with any = 0 has inc = high = 0 and no bit set; one with any = 1
 * has bit 0 set (high itself). */
void ps__once_encode(const ps__once *w, ps__wbuf *out);
/* Read one window from in into *w. 0, or PS_ERR_CORRUPT (a message via ps__fail) for
 * bytes that break the rules above, or a window narrower than PS__ONCE_WINDOW (its
 * older sequences would look unapplied). A wider one keeps its first PS__ONCE_WINDOW
 * bits: older sequences are then refused as too old, never applied twice. */
int ps__once_decode(ps__rbuf *in, ps__once *w);

/* Every window of s: u8 format (2), u32 count, then count windows. */
void ps__once_set_encode(const ps__once_set *s, ps__wbuf *out);
/* The same, for the windows of the nunits units only (units NULL: every window), and as
 * if the n pushes ex had not been applied: their sequences unmarked, a window's highest
 * moved down to the highest still marked (a window left with none is empty). For a cut
 * of some chains' rows that do not hold those pushes yet (an aggregation buffer not
 * applied): whoever takes the cut must still apply them when they come. 0, or
 * PS_ERR_NOMEM (out holds nothing new then). */
int ps__once_set_encode_except(const ps__once_set *s, const uint64_t *units, size_t nunits, const ps__push_id *ex,
                               size_t n, ps__wbuf *out);
/* Replace the windows of s by those encoded in p[0, len): 0, or PS_ERR_CORRUPT (count
 * above PS__ONCE_MAX_WORKERS, a worker id 0, a (worker, unit) twice, trailing bytes, a
 * bad window) or PS_ERR_NOMEM, and s is unchanged. */
int ps__once_set_decode(ps__once_set *s, const void *p, size_t len);
/* Add the windows encoded in p[0, len) to those of s: a sequence applied in either is
 * applied in s (a newer incarnation replaces an older one's window). 0, or the
 * decoder's errors or PS_ERR_NOMEM (s may then hold part of them). */
int ps__once_set_merge(ps__once_set *s, const void *p, size_t len);

#endif
