/*
 * store.h - parameter storage: row maps, initialisers and optimisers.
 *
 * No I/O: everything here is called from one server event-loop thread and is testable
 * on its own. The only threads of the store are a row map's helpers, which fault in the
 * next index of a large map and its record arena ahead of use (store/prefault.c); the
 * map starts and ends them, and they touch nothing but those pages.
 *
 * A server keeps every table as a row map. A sparse table's rows are its embedding
 * rows; a dense table of n floats is cut into slices of `slice` elements and each
 * slice is one row (key = slice index, the last slice may be shorter but is stored at
 * full width). A row is `row_floats` contiguous floats: the parameters (width floats)
 * followed by the optimiser state, one block of `width` floats per state variable.
 * Rows live in large chunks that never move, so a row pointer stays valid until the
 * map is cleared or freed, and memory per row is the payload, its key and the index.
 */
#ifndef PS_STORE_H
#define PS_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "proto/spec.h" /* the table spec every function here is driven by */

/* ---------------------------------------------------------------- initialiser */

/* Fill the parameters of a new row deterministically from (seed, name_hash, row key,
 * element index), so that any server creates the same row. Fills `len` floats of w,
 * and sets the optimiser state (state floats after the width block) to its start
 * value (adagrad: acc0; others 0). `row` points to ps__spec_row_floats floats. */
void ps__row_init(const ps__table_spec *spec, uint64_t key, float *row);

/* ---------------------------------------------------------------- optimisers */

/* Apply one optimiser step to n parameters w with gradient g (already combined: the
 * batch-weighted mean or the sum). state points to nstate blocks of `stride` floats
 * (block k at state + k*stride); for a row, stride = width. `step` is the 1-based
 * number of this update of the table (adam bias correction). lr is the rate to use. */
void ps__optim_apply(const ps__optim *o, float lr, uint64_t step, float *restrict w,
                     float *restrict state, size_t stride, const float *restrict g,
                     size_t n);

/* ---------------------------------------------------------------- vector helpers */

/* y[i] += a * x[i] for i < n; written to vectorise. */
void ps__axpy(float *restrict y, float a, const float *restrict x, size_t n);
/* y[i] += x[i]. */
void ps__vadd(float *restrict y, const float *restrict x, size_t n);
/* y[i] *= a. */
void ps__vscale(float *y, float a, size_t n);
/* y = a * x (a plain copy for a = 1). */
void ps__vset(float *restrict y, float a, const float *restrict x, size_t n);

/* ---------------------------------------------------------------- row map */

typedef struct ps__rowmap ps__rowmap;

/* A map from uint64 key (every value is a valid key, 0 and UINT64_MAX included) to a
 * row of row_floats floats. Rows are numbered 0..count-1 in insertion order and never
 * move: a row pointer and a row number stay valid until the map is cleared or freed.
 * Memory per row: the row, its 8-byte key and 4 / load bytes of index (load between
 * 7/16 and 7/8; rowmap.c). The index doubles when full, without a pause: rows move to
 * the bigger index a few per insert (ps__rowmap_moving). Not thread-safe,
 * except that lookups (get, find_many, index, prefetch) write nothing and may run on
 * several threads at once when no thread changes the map. Returns NULL on allocation
 * failure or a row too large. */
ps__rowmap *ps__rowmap_new(size_t row_floats);
void ps__rowmap_free(ps__rowmap *m);
/* The row for key, or NULL if absent. */
float *ps__rowmap_get(const ps__rowmap *m, uint64_t key);
/* Rows of keys[0 .. n) into rows[] (NULL where a key is absent), each key hashed once:
 * a software pipeline prefetches the index entries of the key 16 ahead and the record
 * (key and row) of the key 8 ahead, so a batch of cold keys keeps many misses in
 * flight. keys64 is an array of host-order keys; keys_le the wire's little-endian bytes
 * (8 per key). */
void ps__rowmap_find_many(const ps__rowmap *m, const uint64_t *keys64, size_t n, float **rows);
void ps__rowmap_find_many_le(const ps__rowmap *m, const uint8_t *keys_le, size_t n, float **rows);
/* Hints for callers walking many keys of a large map, where cache misses rather than
 * work dominate: prefetch the index entries of key; or find key's entry (prefetched a
 * few keys earlier) and prefetch its row. Neither changes the map. */
void ps__rowmap_prefetch(const ps__rowmap *m, uint64_t key);
void ps__rowmap_prefetch_row(const ps__rowmap *m, uint64_t key);
/* The row for key, created if absent (*created set to 1 then, row zero-filled).
 * NULL only on allocation failure (the map is unchanged then). */
float *ps__rowmap_upsert(ps__rowmap *m, uint64_t key, int *created);
/* Like ps__rowmap_upsert, but a created row's floats are undefined: the caller writes
 * every one of them (saves a pass over rows filled at once, e.g. accumulators). */
float *ps__rowmap_upsert_uninit(ps__rowmap *m, uint64_t key, int *created);
/* The rows of keys[0 .. n) (keys64, or when it is NULL the wire's little-endian keys_le),
 * each created if absent, into rows[]; with the row numbers into idx[] and 1 where this
 * call created the row, else 0, into created[] (either may be NULL). A key repeated in
 * the batch is created once, at its first place. Created rows are zero-filled if zero,
 * else undefined (the caller writes them). The find_many pipeline, inserting at its last
 * stage, where the key's index entries are in cache: on a big map a batch of new keys
 * costs about what a batch of present ones does. Returns n, or the number of keys done
 * (their rows set) when memory ran out at the next one (the map holds the rows made). */
size_t ps__rowmap_upsert_many(ps__rowmap *m, const uint64_t *keys64, const uint8_t *keys_le, size_t n, float **rows,
                              uint32_t *idx, uint8_t *created, int zero);
/* Number of rows. Rows are numbered 0..count-1 in insertion order. */
size_t ps__rowmap_count(const ps__rowmap *m);
/* Key and row of the i-th inserted row (i < count). */
uint64_t ps__rowmap_key_at(const ps__rowmap *m, size_t i);
float *ps__rowmap_row_at(const ps__rowmap *m, size_t i);
/* Remove every row but keep the memory for reuse (used for per-round accumulators);
 * an index being replaced is dropped. */
void ps__rowmap_clear(ps__rowmap *m);
/* Bytes held: record chunks + index (both indexes while rows move) + bookkeeping. */
size_t ps__rowmap_bytes(const ps__rowmap *m);
/* ps__rowmap_bytes, apart: rows, payload = rows x row_floats x 4, keys = rows x 8,
 * index (both while rows move), spare (chunk room not yet holding rows, bookkeeping);
 * payload + keys + index + spare = total = ps__rowmap_bytes. */
typedef struct ps__rowmap_use {
  size_t rows, payload, keys, index, spare, total;
} ps__rowmap_use;
void ps__rowmap_usage(const ps__rowmap *m, ps__rowmap_use *u);
/* An index for at least `rows` rows now, so that the map does not grow its index before
 * it holds that many (the rows there are moved at once: a pause). 0, or -1 out of memory
 * or rows > 2^32 - 1 (the map is unchanged then). */
int ps__rowmap_reserve(ps__rowmap *m, size_t rows);
/* The next index, made ready before the current one is full (over its last 1/8 for
 * an index of 2 MiB or more, on a helper thread; rowmap.c): its bytes (0: none now),
 * the bytes faulted in so far, whether a helper thread is faulting it in, and the
 * bytes of next indexes the map's own thread faulted in itself over the map's life
 * (the part a helper did not reach in time, or all of it when no helper could start). */
typedef struct ps__rowmap_next {
  size_t bytes, faulted, own;
  int helper;
} ps__rowmap_next;
void ps__rowmap_next_state(const ps__rowmap *m, ps__rowmap_next *s);
/* Rows still to move from the index being replaced to the new one (0: none). */
size_t ps__rowmap_moving(const ps__rowmap *m);
/* If at most `budget` rows are still moving, move them all now (the old index is freed)
 * and return how many; else change nothing and return 0. While rows move, a key whose
 * entry has not moved is looked up in both indexes, so a request of many keys finishes
 * the move first when it costs no more than the request's own lookups. */
size_t ps__rowmap_settle(ps__rowmap *m, size_t budget);
/* The same, with each row's number (its place in insertion order; UINT32_MAX where a key
 * is absent) into idx[]: keys64 or, when it is NULL, keys_le. */
void ps__rowmap_find_many_at(const ps__rowmap *m, const uint64_t *keys64, const uint8_t *keys_le, size_t n,
                             float **rows, uint32_t *idx);
/* ps__rowmap_upsert, with the row's number into *idx. */
float *ps__rowmap_upsert_at(ps__rowmap *m, uint64_t key, int *created, uint32_t *idx);
/* The row number of key (its place in insertion order), or SIZE_MAX if absent. */
size_t ps__rowmap_index(const ps__rowmap *m, uint64_t key);

/* The rows [0, n) of a map as they are placed now, readable from another thread while
 * the map's owner goes on inserting (chunks never move, a row's key never changes, and
 * the index is not read): a copy of the chunk pointers, nothing else. Valid until the
 * map is cleared or freed. The rows' contents are the owner's: a reader that races
 * with writes needs its own protocol (shard/snap.c). */
typedef struct ps__rowmap_view {
  size_t n, row_floats;
  size_t stride;  /* bytes per record (key, then row) */
  unsigned shift;
  size_t nchunks;
  char **recs;    /* per chunk: its first record */
} ps__rowmap_view;
/* 0 or PS_ERR_NOMEM. */
int ps__rowmap_view_take(const ps__rowmap *m, ps__rowmap_view *v);
void ps__rowmap_view_free(ps__rowmap_view *v);
float *ps__rowmap_view_row(const ps__rowmap_view *v, size_t i);
uint64_t ps__rowmap_view_key(const ps__rowmap_view *v, size_t i);

#endif /* PS_STORE_H */
