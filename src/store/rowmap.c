/*
 * rowmap.c - a map from uint64 keys to fixed-size float rows.
 *
 * Rows are numbered in insertion order and stored in chunks that never move, so a row
 * pointer stays valid until the map is cleared or freed. Each chunk holds its rows
 * (64-byte aligned, so a 16-float row is one cache line) followed by the keys of those
 * rows, which gives key_at() without a second lookup structure. Large chunks hold
 * 1 << shift rows, with shift chosen so a chunk is 1-2 MiB; the first 1 << shift rows
 * go into chunks of 1, 1, 2, 4, ... rows so that a small map (a dense table of a few
 * slices, a round's accumulator) does not reserve megabytes.
 *
 * The index is open addressing with linear probing over two parallel arrays: the key
 * and the row number, where row number UINT32_MAX marks an empty slot (so every
 * uint64 is a valid key). Capacity is a power of two and the index is rebuilt at
 * twice the size when the load would exceed 3/4. Memory per row is the payload, the
 * 8-byte key beside it, and 12 bytes per index slot (16-32 bytes per row).
 */
#include "store/store.h"

#include <string.h>

#include "common/common.h"

#define EMPTY UINT32_MAX               /* row number of an empty index slot */
#define MAX_ROWS ((size_t)UINT32_MAX)  /* rows are numbered 0 .. MAX_ROWS - 1 */
#define CHUNK_TARGET ((size_t)2 << 20) /* bytes of a large chunk, at most */
#define MAX_CHUNK ((size_t)1 << 40)    /* refuse larger allocations outright */
#define MIN_INDEX 16
#define ALIGN 64

typedef struct chunk {
  void *mem;      /* as allocated */
  float *rows;    /* ALIGN-aligned start of the rows */
  uint64_t *keys; /* the rows' keys, after the rows */
} chunk;

struct ps__rowmap {
  size_t row_floats;
  size_t row_bytes;
  unsigned shift;     /* a large chunk holds 1 << shift rows */
  size_t count;       /* rows in use */
  size_t row_cap;     /* rows the allocated chunks hold */
  chunk *chunks;
  size_t nchunks, chunks_cap;
  size_t chunk_bytes; /* sum of the chunks' allocation sizes */
  uint64_t *ikeys;    /* index: key per slot */
  uint32_t *irows;    /* index: row number per slot, EMPTY if free */
  size_t icap;        /* slots, a power of two, or 0 before the first insert */
};

/* Rows held by chunk c. */
static size_t chunk_rows(const ps__rowmap *m, size_t c) {
  if (c == 0) return 1;
  if (c <= m->shift) return (size_t)1 << (c - 1);
  return (size_t)1 << m->shift;
}

/* Chunk of row i and the row's offset in it. Chunk 0 holds row 0, chunk c in
 * 1..shift holds rows [2^(c-1), 2^c), later chunks 1 << shift rows each. */
static size_t locate(const ps__rowmap *m, size_t i, size_t *off) {
  size_t c;
  if (i >> m->shift) {
    *off = i & (((size_t)1 << m->shift) - 1);
    return m->shift + (i >> m->shift);
  }
  if (i == 0) {
    *off = 0;
    return 0;
  }
  c = (size_t)(64 - __builtin_clzll((unsigned long long)i));
  *off = i - ((size_t)1 << (c - 1));
  return c;
}

static float *row_ptr(const ps__rowmap *m, size_t i) {
  size_t off, c = locate(m, i, &off);
  return m->chunks[c].rows + off * m->row_floats;
}

static size_t slot_of(uint64_t key, size_t mask) { return (size_t)ps__mix64(key) & mask; }

ps__rowmap *ps__rowmap_new(size_t row_floats) {
  ps__rowmap *m;
  size_t per_row;
  if (row_floats > MAX_CHUNK / sizeof(float)) return NULL;
  m = ps__calloc(1, sizeof *m);
  if (!m) return NULL;
  m->row_floats = row_floats;
  m->row_bytes = row_floats * sizeof(float);
  per_row = m->row_bytes + sizeof(uint64_t);
  while (m->shift < 30 && ((size_t)2 << m->shift) * per_row <= CHUNK_TARGET) m->shift++;
  return m;
}

void ps__rowmap_free(ps__rowmap *m) {
  if (!m) return;
  for (size_t c = 0; c < m->nchunks; c++) free(m->chunks[c].mem);
  free(m->chunks);
  free(m->ikeys);
  free(m->irows);
  free(m);
}

float *ps__rowmap_get(const ps__rowmap *m, uint64_t key) {
  size_t mask, s;
  if (m->count == 0) return NULL;
  mask = m->icap - 1;
  for (s = slot_of(key, mask);; s = (s + 1) & mask) {
    uint32_t r = m->irows[s];
    if (r == EMPTY) return NULL;
    if (m->ikeys[s] == key) return row_ptr(m, r);
  }
}

/* Allocate the next chunk. 0 or -1 (nothing changed). */
static int add_chunk(ps__rowmap *m) {
  size_t c = m->nchunks, n = chunk_rows(m, c);
  size_t rows_bytes, bytes;
  void *mem;
  uintptr_t at;

  if (m->row_bytes > MAX_CHUNK / n) return -1;
  rows_bytes = (n * m->row_bytes + 7) & ~(size_t)7;
  if (rows_bytes > MAX_CHUNK - n * sizeof(uint64_t)) return -1;
  bytes = rows_bytes + n * sizeof(uint64_t) + ALIGN - 1;
  if (m->nchunks == m->chunks_cap) {
    size_t cap = m->chunks_cap ? 2 * m->chunks_cap : 32;
    chunk *cs = ps__realloc(m->chunks, cap * sizeof *cs);
    if (!cs) return -1;
    m->chunks = cs;
    m->chunks_cap = cap;
  }
  mem = ps__malloc(bytes);
  if (!mem) return -1;
  at = ((uintptr_t)mem + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1);
  m->chunks[c].mem = mem;
  m->chunks[c].rows = (float *)at;
  m->chunks[c].keys = (uint64_t *)(at + rows_bytes);
  m->nchunks++;
  m->row_cap += n;
  m->chunk_bytes += bytes;
  return 0;
}

/* Rebuild the index with ncap slots. 0 or -1 (nothing changed). */
static int rehash(ps__rowmap *m, size_t ncap) {
  uint64_t *keys;
  uint32_t *rows;
  size_t mask = ncap - 1;

  if (ncap > SIZE_MAX / sizeof(uint64_t)) return -1;
  keys = ps__malloc(ncap * sizeof *keys);
  rows = ps__malloc(ncap * sizeof *rows);
  if (!keys || !rows) {
    free(keys);
    free(rows);
    return -1;
  }
  memset(rows, 0xff, ncap * sizeof *rows);
  for (size_t s = 0; s < m->icap; s++) {
    uint32_t r = m->irows[s];
    size_t t;
    if (r == EMPTY) continue;
    for (t = slot_of(m->ikeys[s], mask); rows[t] != EMPTY; t = (t + 1) & mask) {
    }
    keys[t] = m->ikeys[s];
    rows[t] = r;
  }
  free(m->ikeys);
  free(m->irows);
  m->ikeys = keys;
  m->irows = rows;
  m->icap = ncap;
  return 0;
}

float *ps__rowmap_upsert(ps__rowmap *m, uint64_t key, int *created) {
  size_t mask, s = 0, off, c;
  float *row;

  if (created) *created = 0;
  if (m->icap) {
    mask = m->icap - 1;
    for (s = slot_of(key, mask);; s = (s + 1) & mask) {
      uint32_t r = m->irows[s];
      if (r == EMPTY) break;
      if (m->ikeys[s] == key) return row_ptr(m, r);
    }
  }
  /* A new row: make room first, so that a failure leaves the map as it was. */
  if (m->count >= MAX_ROWS) return NULL;
  if (m->count == m->row_cap && add_chunk(m)) return NULL;
  if ((m->count + 1) * 4 > m->icap * 3) {
    if (rehash(m, m->icap ? 2 * m->icap : MIN_INDEX)) return NULL;
    mask = m->icap - 1;
    for (s = slot_of(key, mask); m->irows[s] != EMPTY; s = (s + 1) & mask) {
    }
  }
  m->ikeys[s] = key;
  m->irows[s] = (uint32_t)m->count;
  c = locate(m, m->count, &off);
  m->chunks[c].keys[off] = key;
  row = m->chunks[c].rows + off * m->row_floats;
  memset(row, 0, m->row_bytes);
  m->count++;
  if (created) *created = 1;
  return row;
}

size_t ps__rowmap_count(const ps__rowmap *m) { return m->count; }

uint64_t ps__rowmap_key_at(const ps__rowmap *m, size_t i) {
  size_t off, c;
  PS_ASSERT(i < m->count);
  c = locate(m, i, &off);
  return m->chunks[c].keys[off];
}

float *ps__rowmap_row_at(const ps__rowmap *m, size_t i) {
  PS_ASSERT(i < m->count);
  return row_ptr(m, i);
}

void ps__rowmap_clear(ps__rowmap *m) {
  if (m->icap) memset(m->irows, 0xff, m->icap * sizeof *m->irows);
  m->count = 0;
}

size_t ps__rowmap_bytes(const ps__rowmap *m) {
  return sizeof *m + m->chunks_cap * sizeof(chunk) + m->chunk_bytes +
         m->icap * (sizeof *m->ikeys + sizeof *m->irows);
}
