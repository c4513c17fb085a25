/*
 * ring.h - the consistent-hash ring that places keys on servers.
 *
 * Each server contributes `vnodes` points (xxh64 of (server id, replica index)); a key
 * belongs to the first point clockwise from the key's hash. Adding or removing a server
 * moves only the keys whose owner changes. The ring is a value type built from a list of
 * server ids and versioned by the membership epoch; it has no I/O and no threads.
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
/* The hash of a key as used for placement (exposed for tests). */
uint64_t ps__ring_key_hash(uint32_t table, uint64_t key);

#endif
