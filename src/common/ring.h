/*
 * ring.h - the consistent-hash ring that places keys on servers.
 *
 * Each server contributes `vnodes` points (xxh64 of (server id, replica index)); a key
 * belongs to the first point clockwise from the key's hash. Adding or removing a server
 * moves only the keys whose owner changes. The ring is a value type built from a list of
 * server ids and versioned by the membership epoch; it has no I/O and no threads. With
 * replicas R >= 2 (ps__ring_set_replicas) every key also has a chain of R servers.
 */
#ifndef PS_RING_H
#define PS_RING_H

#include <stddef.h>
#include <stdint.h>

typedef struct ps__ring ps__ring;

/* Build a ring over n servers (ids need not be contiguous; duplicates are an error).
 * Returns NULL on allocation failure or bad input (n == 0 or vnodes == 0). */
ps__ring *ps__ring_new(const uint32_t *server_ids, size_t n, unsigned vnodes, uint64_t epoch);
void ps__ring_free(ps__ring *r);
uint64_t ps__ring_epoch(const ps__ring *r);
size_t ps__ring_size(const ps__ring *r);        /* number of servers */
uint32_t ps__ring_server_at(const ps__ring *r, size_t i); /* i-th server id, sorted ascending */
/* Index (0..size-1, into the sorted server list) of the owner of (table, key). */
size_t ps__ring_owner_index(const ps__ring *r, uint32_t table, uint64_t key);
/* Owner's server id. */
uint32_t ps__ring_owner(const ps__ring *r, uint32_t table, uint64_t key);
/* The replica chain: up to nmax distinct servers starting with the owner, clockwise.
 * Returns how many were written to out (min(nmax, size)). */
size_t ps__ring_chain(const ps__ring *r, uint32_t table, uint64_t key, uint32_t *out, size_t nmax);
/* Dense tables: the table's slices are cut into S contiguous runs whose lengths differ by
 * at most one slice, and run j goes to order[j], the j-th distinct server met walking the
 * ring clockwise from the point of (table, 0). A dense table is then spread evenly (the
 * ring alone gives 16 slices over 4 servers as 5/2/1/8 for some ids) and each server's
 * share is one contiguous range; different tables start at different servers.
 * ps__ring_dense_order fills order[0 .. S) with server indices; returns S, or 0 on
 * allocation failure. */
size_t ps__ring_dense_order(const ps__ring *r, uint32_t table, uint32_t *order);
/* The run (index into order) of slice `slice` of a table of `nslices` slices over S
 * servers, and the first slice of run j (run j is [start(j), start(j + 1))). */
static inline size_t ps__dense_run(uint64_t slice, uint64_t nslices, size_t S) {
  return (size_t)(((unsigned __int128)slice * S) / nslices);
}
static inline uint64_t ps__dense_run_start(size_t j, uint64_t nslices, size_t S) {
  return (uint64_t)(((unsigned __int128)j * nslices + S - 1) / S);
}
/* Replication. ps__ring_set_replicas(r, R) (before the ring is shared; R is capped at
 * the number of servers) gives every point its chain: the point's server then the next
 * R-1 distinct servers clockwise, the ps__ring_chain of any key that lands on it. A
 * route is one distinct chain; the keys of one route travel together (one part of a
 * request per route: the head applies them and forwards them along the chain). With
 * R = 1 the routes are the servers: route i is server index i. 0 or PS_ERR_NOMEM. */
int ps__ring_set_replicas(ps__ring *r, unsigned replicas);
unsigned ps__ring_replicas(const ps__ring *r);
size_t ps__ring_nroutes(const ps__ring *r);
/* The route of (table, key), in 0 .. nroutes-1. */
size_t ps__ring_route_index(const ps__ring *r, uint32_t table, uint64_t key);
/* The server ids of route i, head first, into out[0 .. replicas); returns the count. */
size_t ps__ring_route(const ps__ring *r, size_t i, uint32_t *out);
/* A dense table's run j (ps__ring_dense_order's order[j]) and the next R-1 runs'
 * servers: the run's chain, as server ids into out; returns the count. */
size_t ps__ring_dense_chain(const ps__ring *r, const uint32_t *order, size_t j, uint32_t *out);
#define PS_MAX_REPLICAS 3

/* The head rule, the one place that says who heads a chain and in which order a push
 * goes down it. Each member of a chain (ring order) is in one of these states. A
 * replacement that joined a running job is "late", and carries its admission number
 * (late[i], 1 for the job's first replacement, increasing): it comes after every member
 * that was there before it. A syncing member (a replacement still copying its rows)
 * never heads and holds no copy yet: pushes reach it after every other live member.
 * So the order of a chain's members changes only when one of them dies: a replacement
 * that finishes its copy stays where it was while it copied, at the end, and never takes
 * a head away from a live member. */
enum {
  PS_CHAIN_DEAD = 0,    /* not a live member */
  PS_CHAIN_LIVE = 1,    /* live, holds its copy */
  PS_CHAIN_LATE = 2,    /* live, holds its copy, joined as a replacement */
  PS_CHAIN_SYNCING = 3  /* live, copying its rows from the chain's tail */
};
/* The live members of a chain of n in the order a push visits them, as indices into
 * st[0 .. n) (each a PS_CHAIN_* state) written to order: the LIVE members in chain
 * order, then the LATE ones by admission number late[i] (NULL: in chain order), then
 * the SYNCING ones. Returns how many; order[0] is the head unless it is SYNCING (no
 * member holds a copy: the chain has no head). */
size_t ps__chain_order(const uint8_t *st, const uint32_t *late, size_t n, uint8_t *order);
/* The head of a chain of n members in states st (an index), or -1 when it has none. */
int ps__chain_head(const uint8_t *st, const uint32_t *late, size_t n);

/* The hash of a key as used for placement (exposed for tests). */
uint64_t ps__ring_key_hash(uint32_t table, uint64_t key);

#endif
