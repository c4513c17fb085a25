/*
 * rowmap_int.h - the row map's layout (rowmap.c: index, growth, lookups and inserts;
 * rowmap_mem.c: its memory, huge-page mappings and arenas, its accounting and views).
 * See rowmap.c for the design.
 */
#ifndef PS_ROWMAP_INT_H
#define PS_ROWMAP_INT_H

#include <stdint.h>
#include <string.h>

#include "store/prefault.h"
#include "store/store.h"

#define NONE UINT32_MAX                /* row number reported for an absent key */
#define MAX_ROWS ((size_t)UINT32_MAX)  /* rows are numbered 0 .. MAX_ROWS - 1 */
#define CHUNK_TARGET ((size_t)2 << 20) /* bytes of a large chunk, at most */
#define MAX_CHUNK ((size_t)1 << 40)    /* refuse larger allocations outright */
#define MIN_INDEX 16                   /* entries of the first index */
#define ALIGN 64
#define HUGE_PAGE ((size_t)2 << 20)    /* THP size on x86-64 */
#define ARENA_BYTES ((size_t)64 << 20) /* address space reserved per arena */
#define ARENA_MIN_CHUNK ((size_t)256 << 10) /* chunks this large come from arenas */
#define KEY_BYTES 8u                   /* a record's key, before its row */
#define MIGRATE_EVERY 32               /* inserts between two steps of a move */
#define MIGRATE_STEP 64                /* rows moved to the new index per step */
#define PF_WAIT_MS 10                  /* a growth waits this long at most for a helper's step */

/* An index: cap 4-byte entries. */
typedef struct rowidx {
  uint32_t *e;
  size_t cap;
  size_t max_rows; /* rows it may hold: 7/8 of cap (and at most MAX_ROWS) */
  unsigned tb;     /* tag bits: the home flag and fb fraction bits */
  unsigned fb;     /* tb - 1 (0 if tb is 0) */
  uint32_t tmask;  /* (1 << tb) - 1 */
  size_t mapped;   /* bytes mapped by huge_alloc, 0 if calloc'd */
} rowidx;

typedef struct chunk {
  void *mem;  /* as allocated (NULL: carved from an arena) */
  char *rec;  /* ALIGN-aligned start of the records */
} chunk;

typedef struct arena {
  char *base;
  size_t len, used;
  size_t ready;     /* bytes from base on faulted in, or given to a helper to fault in */
  ps__prefault *pf; /* the helper faulting in the arena ahead of its chunks (NULL: none) */
} arena;

struct ps__rowmap {
  size_t row_floats;
  size_t row_bytes;
  size_t stride;      /* bytes of a record: KEY_BYTES + row_bytes */
  unsigned shift;     /* a large chunk holds 1 << shift records */
  size_t count;       /* rows in use */
  size_t row_cap;     /* rows the allocated chunks hold */
  chunk *chunks;
  size_t nchunks, chunks_cap;
  size_t chunk_bytes; /* sum of the chunks' allocation sizes */
  arena *arenas;      /* for large chunks; the last one is being filled */
  size_t narenas;
  rowidx cur;         /* the index new rows go into */
  rowidx old;         /* the index being replaced (cap 0: none) */
  size_t ostart;      /* an empty entry of the old index: its entries move from the next one on */
  size_t mig;         /* old entries looked at (moved if not empty), from ostart + 1 on */
  size_t safe;        /* the first mig entries up to an empty one: whole runs moved */
  size_t old_n, moved; /* rows the old index holds, rows of it moved */
  rowidx next;        /* the index to grow into, being faulted in (cap 0: none) */
  size_t touched;     /* bytes of next faulted in (without a helper) */
  ps__prefault *pf;   /* the helper faulting in next (NULL: none); next is its until pf_end */
  size_t own_faulted; /* bytes of next indexes this thread faulted in itself, ever */
};

/* Rows held by chunk c. */
static inline size_t chunk_rows(const ps__rowmap *m, size_t c) {
  if (c == 0) return 1;
  if (c <= m->shift) return (size_t)1 << (c - 1);
  return (size_t)1 << m->shift;
}

/* Chunk of row i and the row's offset in it. Chunk 0 holds row 0, chunk c in
 * 1..shift holds rows [2^(c-1), 2^c), later chunks 1 << shift rows each. */
static inline size_t locate_in(unsigned shift, size_t i, size_t *off) {
  size_t c;
  if (i >> shift) {
    *off = i & (((size_t)1 << shift) - 1);
    return shift + (i >> shift);
  }
  if (i == 0) {
    *off = 0;
    return 0;
  }
  c = (size_t)(64 - __builtin_clzll((unsigned long long)i));
  *off = i - ((size_t)1 << (c - 1));
  return c;
}

static inline char *rec_at(const ps__rowmap *m, size_t i) {
  size_t off, c = locate_in(m->shift, i, &off);
  return m->chunks[c].rec + off * m->stride;
}

static inline uint64_t rec_key(const char *rec) {
  uint64_t k;
  memcpy(&k, rec, sizeof k); /* 4-byte aligned when a row has an odd number of floats */
  return k;
}

static inline float *rec_row(char *rec) { return (float *)(void *)(rec + KEY_BYTES); }

/* ---------------------------------------------------------------- rowmap_mem.c */

/* n bytes (a multiple of HUGE_PAGE), 2 MiB-aligned, zeroed and advised for huge pages. */
void *ps__rm_huge_alloc(size_t n);
/* n rounded up to whole huge pages. */
size_t ps__rm_round_huge(size_t n);
/* n bytes (a multiple of ALIGN) from the map's arenas, or NULL. */
void *ps__rm_arena_take(ps__rowmap *m, size_t n);
/* Unmap arena a, or leave it to its helper if that is inside a step. */
void ps__rm_arena_free(arena *a);

/* ---------------------------------------------------------------- rowmap.c */

/* Bytes of the next index faulted in so far (counted in the map's bytes). */
size_t ps__rm_next_touched(const ps__rowmap *m);

#endif
