/*
 * ring.c - the consistent-hash ring that places keys on servers (see ring.h).
 *
 * A ring over n servers is a sorted array of n * vnodes points. Point (s, v), for the
 * server with id s and replica index v, sits at xxh64 of the 8 bytes (s, v) in
 * little-endian order; a key (table, k) sits at xxh64 of the 12 bytes (table, k), also
 * little-endian, so placement is the same on every host. The owner of a key is the
 * first point at or after the key's hash, wrapping past the top of the hash space to
 * the first point. Points depend only on their server, so adding or removing a server
 * only inserts or deletes that server's points: keys move to or from it and nowhere
 * else. Equal point hashes (never seen in practice) are ordered by server id, so the
 * order does not depend on the order of the id list either.
 *
 * A ring is immutable after ps__ring_new: lookups may run from any number of threads.
 */
#include "common/ring.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/common.h"

/* Seeds keep the point and key hash families apart; they are part of the placement
 * and must never change (a change moves every key). */
#define RING_POINT_SEED 0x70736872696e6770ull /* "pshringp" */
#define RING_KEY_SEED 0x70736872696e676bull   /* "pshringk" */

typedef struct ring_point {
  uint64_t hash;
  uint32_t server; /* index into ids */
} ring_point;

struct ps__ring {
  uint64_t epoch;
  size_t nservers;
  uint32_t *ids; /* sorted ascending */
  size_t npoints;
  ring_point *points; /* sorted by (hash, server id) */
  /* Bucketed search: lut[b] is the first point whose hash has top bits >= b (lut_bits
   * of them), lut[1 << lut_bits] = npoints. A lookup searches only its bucket's points,
   * usually none or one, instead of log2(npoints) unpredictable branches over all of
   * them: routing and ownership checks run once per key of every request. */
  uint32_t *lut;
  unsigned lut_bits;
  /* Replication (ps__ring_set_replicas): replicas >= 2 gives each point a route, one of
   * nroutes distinct chains of server indices (routes[i * replicas ...]). */
  unsigned replicas;
  size_t nroutes;
  uint32_t *route_of; /* per point */
  uint32_t *routes;
};

static void put_le32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static void put_le64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t point_hash(uint32_t server_id, uint32_t vnode) {
  unsigned char buf[8];
  put_le32(buf, server_id);
  put_le32(buf + 4, vnode);
  return XXH64(buf, sizeof buf, RING_POINT_SEED);
}

uint64_t ps__ring_key_hash(uint32_t table, uint64_t key) {
  unsigned char buf[12];
  put_le32(buf, table);
  put_le64(buf + 4, key);
  return XXH64(buf, sizeof buf, RING_KEY_SEED);
}

static int cmp_u32(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return (x > y) - (x < y);
}

/* Server indices follow the sorted ids, so comparing indices compares ids. */
static int cmp_point(const void *a, const void *b) {
  const ring_point *x = a, *y = b;
  if (x->hash != y->hash) return (x->hash > y->hash) - (x->hash < y->hash);
  return (x->server > y->server) - (x->server < y->server);
}

ps__ring *ps__ring_new(const uint32_t *server_ids, size_t n, unsigned vnodes, uint64_t epoch) {
  if (!server_ids || n == 0 || vnodes == 0) {
    ps__fail(PS_ERR_INVALID, "ring needs at least one server and one virtual node");
    return NULL;
  }
  if (n > UINT32_MAX || n > SIZE_MAX / sizeof(ring_point) / vnodes) {
    ps__fail(PS_ERR_INVALID, "ring too large: %zu servers x %u virtual nodes", n, vnodes);
    return NULL;
  }
  ps__ring *r = ps__calloc(1, sizeof *r);
  if (!r) goto nomem;
  r->epoch = epoch;
  r->nservers = n;
  r->replicas = 1;
  r->ids = ps__malloc(n * sizeof *r->ids);
  if (!r->ids) goto nomem;
  memcpy(r->ids, server_ids, n * sizeof *r->ids);
  qsort(r->ids, n, sizeof *r->ids, cmp_u32);
  for (size_t i = 1; i < n; i++) {
    if (r->ids[i] == r->ids[i - 1]) {
      ps__fail(PS_ERR_INVALID, "ring: server id %u appears twice", r->ids[i]);
      ps__ring_free(r);
      return NULL;
    }
  }
  r->npoints = n * vnodes;
  r->points = ps__malloc(r->npoints * sizeof *r->points);
  if (!r->points) goto nomem;
  for (size_t i = 0; i < n; i++) {
    for (unsigned v = 0; v < vnodes; v++) {
      ring_point *p = &r->points[i * vnodes + v];
      p->hash = point_hash(r->ids[i], v);
      p->server = (uint32_t)i;
    }
  }
  qsort(r->points, r->npoints, sizeof *r->points, cmp_point);
  r->lut_bits = 8;
  while (r->lut_bits < 16 && ((size_t)1 << r->lut_bits) < 4 * r->npoints) r->lut_bits++;
  r->lut = ps__malloc((((size_t)1 << r->lut_bits) + 1) * sizeof *r->lut);
  if (!r->lut) goto nomem;
  for (size_t b = 0, i = 0; b <= ((size_t)1 << r->lut_bits); b++) {
    while (i < r->npoints && b < ((size_t)1 << r->lut_bits) && (r->points[i].hash >> (64 - r->lut_bits)) < b) i++;
    r->lut[b] = (uint32_t)(b == ((size_t)1 << r->lut_bits) ? r->npoints : i);
  }
  return r;

nomem:
  ps__ring_free(r);
  ps__fail(PS_ERR_NOMEM, "ring: out of memory for %zu servers x %u virtual nodes", n, vnodes);
  return NULL;
}

void ps__ring_free(ps__ring *r) {
  if (!r) return;
  free(r->ids);
  free(r->points);
  free(r->lut);
  free(r->route_of);
  free(r->routes);
  free(r);
}

uint64_t ps__ring_epoch(const ps__ring *r) { return r->epoch; }

size_t ps__ring_size(const ps__ring *r) { return r->nservers; }

uint32_t ps__ring_server_at(const ps__ring *r, size_t i) {
  PS_ASSERT(i < r->nservers);
  return r->ids[i];
}

/* Position of the first point whose hash is >= h, wrapping to 0 past the last one. */
static size_t first_point_at_or_after(const ps__ring *r, uint64_t h) {
  size_t b = (size_t)(h >> (64 - r->lut_bits));
  size_t lo = r->lut[b], hi = r->lut[b + 1];
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (r->points[mid].hash < h)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo == r->npoints ? 0 : lo;
}

size_t ps__ring_owner_index(const ps__ring *r, uint32_t table, uint64_t key) {
  return r->points[first_point_at_or_after(r, ps__ring_key_hash(table, key))].server;
}

uint32_t ps__ring_owner(const ps__ring *r, uint32_t table, uint64_t key) {
  return r->ids[ps__ring_owner_index(r, table, key)];
}

/* Distinct server indices in the order their points follow h clockwise, up to want of
 * them, into idx. Duplicates are found with the bitmap seen over all servers, or, with
 * seen NULL, by a linear search of idx (cheaper for short chains). One lap visits every
 * server, so this terminates. */
static size_t walk_distinct(const ps__ring *r, uint64_t h, uint32_t *idx, size_t want, uint64_t *seen) {
  size_t pos = first_point_at_or_after(r, h), got = 0;
  for (size_t step = 0; step < r->npoints && got < want; step++) {
    uint32_t i = r->points[pos].server;
    int dup;
    if (seen) {
      dup = (int)(seen[i / 64] >> (i % 64) & 1);
      seen[i / 64] |= 1ull << (i % 64);
    } else {
      size_t j = 0;
      while (j < got && idx[j] != i) j++;
      dup = j < got;
    }
    if (!dup) idx[got++] = i;
    if (++pos == r->npoints) pos = 0;
  }
  PS_ASSERT(got == want);
  return got;
}

size_t ps__ring_chain(const ps__ring *r, uint32_t table, uint64_t key, uint32_t *out, size_t nmax) {
  size_t want = nmax < r->nservers ? nmax : r->nservers;
  if (want == 0) return 0;
  /* Chains are short (the replication factor): no bitmap over all servers. */
  walk_distinct(r, ps__ring_key_hash(table, key), out, want, NULL);
  for (size_t j = 0; j < want; j++) out[j] = r->ids[out[j]];
  return want;
}

size_t ps__ring_dense_order(const ps__ring *r, uint32_t table, uint32_t *order) {
  size_t S = r->nservers;
  uint64_t one = 0, *seen = S <= 64 ? &one : ps__calloc((S + 63) / 64, 8);
  if (!seen) return 0;
  walk_distinct(r, ps__ring_key_hash(table, 0), order, S, seen);
  if (seen != &one) free(seen);
  return S;
}

/* The distinct servers clockwise from point pos, want of them (server indices). */
static void walk_from(const ps__ring *r, size_t pos, uint32_t *idx, size_t want) {
  size_t got = 0;
  for (size_t step = 0; step < r->npoints && got < want; step++) {
    uint32_t i = r->points[pos].server;
    size_t j = 0;
    while (j < got && idx[j] != i) j++;
    if (j == got) idx[got++] = i;
    if (++pos == r->npoints) pos = 0;
  }
  PS_ASSERT(got == want);
}

int ps__ring_set_replicas(ps__ring *r, unsigned replicas) {
  if (replicas > r->nservers) replicas = (unsigned)r->nservers;
  if (replicas > PS_MAX_REPLICAS) replicas = PS_MAX_REPLICAS;
  free(r->route_of);
  free(r->routes);
  r->route_of = r->routes = NULL;
  r->nroutes = 0;
  r->replicas = 1;
  if (replicas <= 1) return 0;
  /* Distinct chains by an open-addressing table over their packed indices. */
  size_t cap = 16;
  while (cap < 2 * r->npoints) cap *= 2;
  uint64_t *slot_key = ps__calloc(cap, sizeof *slot_key);
  uint32_t *slot_val = ps__malloc(cap * sizeof *slot_val);
  r->route_of = ps__malloc(r->npoints * sizeof *r->route_of);
  r->routes = ps__malloc(r->npoints * replicas * sizeof *r->routes);
  if (!slot_key || !slot_val || !r->route_of || !r->routes) {
    free(slot_key);
    free(slot_val);
    free(r->route_of);
    free(r->routes);
    r->route_of = r->routes = NULL;
    return ps__fail(PS_ERR_NOMEM, "ring: out of memory for replica chains");
  }
  for (size_t p = 0; p < r->npoints; p++) {
    uint32_t c[PS_MAX_REPLICAS];
    walk_from(r, p, c, replicas);
    uint64_t key = 1; /* never 0: 0 marks an empty slot */
    for (unsigned k = 0; k < replicas; k++) key = key << 21 | c[k];
    size_t h = (size_t)(key * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
    while (slot_key[h] && slot_key[h] != key) h = (h + 1) & (cap - 1);
    if (!slot_key[h]) {
      slot_key[h] = key;
      slot_val[h] = (uint32_t)r->nroutes;
      memcpy(r->routes + r->nroutes * replicas, c, replicas * sizeof *c);
      r->nroutes++;
    }
    r->route_of[p] = slot_val[h];
  }
  free(slot_key);
  free(slot_val);
  r->replicas = replicas;
  return 0;
}

unsigned ps__ring_replicas(const ps__ring *r) { return r->replicas; }

size_t ps__ring_nroutes(const ps__ring *r) { return r->replicas > 1 ? r->nroutes : r->nservers; }

size_t ps__ring_route_index(const ps__ring *r, uint32_t table, uint64_t key) {
  size_t p = first_point_at_or_after(r, ps__ring_key_hash(table, key));
  return r->replicas > 1 ? r->route_of[p] : r->points[p].server;
}

size_t ps__ring_route(const ps__ring *r, size_t i, uint32_t *out) {
  if (r->replicas <= 1) {
    out[0] = r->ids[i];
    return 1;
  }
  for (unsigned k = 0; k < r->replicas; k++) out[k] = r->ids[r->routes[i * r->replicas + k]];
  return r->replicas;
}

size_t ps__ring_dense_chain(const ps__ring *r, const uint32_t *order, size_t j, uint32_t *out) {
  for (unsigned k = 0; k < r->replicas; k++) out[k] = r->ids[order[(j + k) % r->nservers]];
  return r->replicas;
}

/* ------------------------------------------------------------------ the head rule */

/* A copy holder's place in the order: LIVE members first (key 0), then LATE ones by
 * admission number; ties (late NULL) in chain order. */
static uint64_t chain_key(const uint8_t *st, const uint32_t *late, size_t i) {
  uint64_t gen = st[i] == PS_CHAIN_LIVE ? 0 : late && late[i] ? late[i] : 1;
  return gen << 32 | i;
}

size_t ps__chain_order(const uint8_t *st, const uint32_t *late, size_t n, uint8_t *order) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (st[i] != PS_CHAIN_LIVE && st[i] != PS_CHAIN_LATE) continue;
    size_t j = k++; /* insertion by key: n is at most a few */
    while (j > 0 && chain_key(st, late, order[j - 1]) > chain_key(st, late, i)) {
      order[j] = order[j - 1];
      j--;
    }
    order[j] = (uint8_t)i;
  }
  for (size_t i = 0; i < n; i++)
    if (st[i] == PS_CHAIN_SYNCING) order[k++] = (uint8_t)i;
  return k;
}

int ps__chain_head(const uint8_t *st, const uint32_t *late, size_t n) {
  int head = -1;
  for (size_t i = 0; i < n; i++)
    if ((st[i] == PS_CHAIN_LIVE || st[i] == PS_CHAIN_LATE) &&
        (head < 0 || chain_key(st, late, i) < chain_key(st, late, (size_t)head)))
      head = (int)i;
  return head;
}
