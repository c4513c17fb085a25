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
 * The index is open addressing with linear probing over packed 12-byte slots holding
 * the key and the row number side by side, so that a lookup in a large map costs one
 * cache miss, not two; row number UINT32_MAX marks an empty slot (so every uint64 is a
 * valid key). Capacity is a power of two and the index is rebuilt at twice the size
 * when the load would exceed 3/4. Memory per row is the payload, the 8-byte key beside
 * it, and 12 bytes per index slot (16-32 bytes per row). Callers walking many keys
 * hide the misses with ps__rowmap_prefetch / ps__rowmap_prefetch_row a few keys ahead.
 *
 * In a map made with ps__rowmap_new_in_index, one-float rows (a sparse sgd table of
 * dim 1) live in the index itself, in 16-byte slots (key, row number, value): a lookup then
 * costs one cache miss, not two. Such a row moves when the index is rebuilt, so its
 * pointer is valid only until the next insert; each chunk keeps the slot of each of its
 * rows, for row_at(). Memory per row: the 8-byte key, the 4-byte slot number and 16
 * bytes per index slot (33-55 bytes per row, against 28-44 with the row in a chunk).
 *
 * Huge pages. A large index and the large chunks live in 2 MiB-aligned mappings
 * advised for transparent huge pages (THP is "madvise" on Debian): with 4 KiB pages a
 * random lookup in a table of millions of rows misses the TLB as well as the cache
 * (measured on this VM: 46 ns per random access into 192 MiB with 4 KiB pages, 15 ns
 * with 2 MiB pages). Large chunks are carved from 64 MiB arenas in order, so the only
 * waste is the untouched tail of the last arena, which costs address space, not memory.
 */
#include "store/store.h"

#include <string.h>
#include <sys/mman.h>

#include "common/common.h"

#define EMPTY UINT32_MAX               /* row number of an empty index slot */
#define MAX_ROWS ((size_t)UINT32_MAX)  /* rows are numbered 0 .. MAX_ROWS - 1 */
#define CHUNK_TARGET ((size_t)2 << 20) /* bytes of a large chunk, at most */
#define MAX_CHUNK ((size_t)1 << 40)    /* refuse larger allocations outright */
#define MIN_INDEX 16
#define ALIGN 64
#define HUGE_PAGE ((size_t)2 << 20)    /* THP size on x86-64 */
#define ARENA_BYTES ((size_t)64 << 20) /* address space reserved per arena */
#define ARENA_MIN_CHUNK ((size_t)256 << 10) /* chunks this large come from arenas */

/* An index slot: the key (8 bytes), the row number (4 bytes, EMPTY if free), packed so
 * that both come in one cache line (SLOT 12 bytes); in a map of one-float rows, also the
 * row itself (SLOT1, 16 bytes, so a slot never straddles two lines). */
#define SLOT 12u
#define SLOT1 16u

typedef struct chunk {
  void *mem;       /* as allocated */
  float *rows;     /* ALIGN-aligned start of the rows (NULL: rows in the index) */
  uint64_t *keys;  /* the rows' keys, after the rows */
  uint32_t *slots; /* rows in the index: each row's slot, after the keys */
} chunk;

typedef struct arena {
  char *base;
  size_t len, used;
} arena;

struct ps__rowmap {
  size_t row_floats;
  size_t row_bytes;
  int in_index;       /* one-float rows, kept in the index slots */
  size_t slot_bytes;  /* SLOT, or SLOT1 when in_index */
  unsigned shift;     /* a large chunk holds 1 << shift rows */
  size_t count;       /* rows in use */
  size_t row_cap;     /* rows the allocated chunks hold */
  chunk *chunks;
  size_t nchunks, chunks_cap;
  size_t chunk_bytes; /* sum of the chunks' allocation sizes */
  unsigned char *idx; /* index slots, slot_bytes each */
  size_t idx_mapped;  /* bytes mapped for idx by huge_alloc, 0 if malloc'd */
  arena *arenas;      /* for large chunks; the last one is being filled */
  size_t narenas;
  size_t icap;        /* slots, a power of two, or 0 before the first insert */
  void (*before_rehash)(void *arg); /* told before rows in the index move */
  void *before_rehash_arg;
};

/* Rows held by chunk c. */
static size_t chunk_rows(const ps__rowmap *m, size_t c) {
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

static size_t locate(const ps__rowmap *m, size_t i, size_t *off) { return locate_in(m->shift, i, off); }

static inline unsigned char *slot_at(const ps__rowmap *m, size_t s) { return m->idx + s * m->slot_bytes; }
static inline uint64_t slot_key(const unsigned char *p) {
  uint64_t k;
  memcpy(&k, p, sizeof k);
  return k;
}
static inline uint32_t slot_row(const unsigned char *p) {
  uint32_t r;
  memcpy(&r, p + 8, sizeof r);
  return r;
}
static inline void slot_set(unsigned char *p, uint64_t key, uint32_t row) {
  memcpy(p, &key, sizeof key);
  memcpy(p + 8, &row, sizeof row);
}
/* The row kept in slot p of a map of one-float rows. */
static inline float *slot_val(unsigned char *p) { return (float *)(void *)(p + 12); }

static float *row_ptr(const ps__rowmap *m, size_t i) {
  size_t off, c = locate(m, i, &off);
  if (m->in_index) return slot_val(m->idx + (size_t)m->chunks[c].slots[off] * SLOT1);
  return m->chunks[c].rows + off * m->row_floats;
}

/* n bytes (a multiple of HUGE_PAGE), 2 MiB-aligned and advised for huge pages. */
static void *huge_alloc(size_t n) {
  size_t len = n + HUGE_PAGE;
  char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  uintptr_t a = ((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
  if (a > (uintptr_t)p) munmap(p, a - (uintptr_t)p);
  size_t tail = (size_t)((uintptr_t)p + len - (a + n));
  if (tail) munmap((char *)(a + n), tail);
#ifdef MADV_HUGEPAGE
  madvise((void *)a, n, MADV_HUGEPAGE);
#endif
  return (void *)a;
}

static size_t round_huge(size_t n) { return (n + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1); }

/* n bytes (a multiple of ALIGN) from the map's arenas, or NULL. */
static void *arena_take(ps__rowmap *m, size_t n) {
  arena *a = m->narenas ? &m->arenas[m->narenas - 1] : NULL;
  if (!a || a->len - a->used < n) {
    size_t len = n > ARENA_BYTES ? round_huge(n) : ARENA_BYTES;
    arena *as = ps__realloc(m->arenas, (m->narenas + 1) * sizeof *as);
    if (!as) return NULL;
    m->arenas = as;
    char *base = huge_alloc(len);
    if (!base) return NULL;
    a = &m->arenas[m->narenas++];
    a->base = base;
    a->len = len;
    a->used = 0;
  }
  void *p = a->base + a->used;
  a->used += n;
  return p;
}

static size_t slot_of(uint64_t key, size_t mask) { return (size_t)ps__mix64(key) & mask; }

static ps__rowmap *rowmap_new(size_t row_floats, int in_index) {
  ps__rowmap *m;
  size_t per_row;
  if (row_floats > MAX_CHUNK / sizeof(float)) return NULL;
  m = ps__calloc(1, sizeof *m);
  if (!m) return NULL;
  m->row_floats = row_floats;
  m->row_bytes = row_floats * sizeof(float);
  m->in_index = in_index && row_floats == 1;
  m->slot_bytes = m->in_index ? SLOT1 : SLOT;
  per_row = m->in_index ? sizeof(uint64_t) + sizeof(uint32_t) : m->row_bytes + sizeof(uint64_t);
  while (m->shift < 30 && ((size_t)2 << m->shift) * per_row <= CHUNK_TARGET) m->shift++;
  return m;
}

ps__rowmap *ps__rowmap_new(size_t row_floats) { return rowmap_new(row_floats, 0); }

ps__rowmap *ps__rowmap_new_in_index(size_t row_floats) { return rowmap_new(row_floats, 1); }

void ps__rowmap_free(ps__rowmap *m) {
  if (!m) return;
  for (size_t c = 0; c < m->nchunks; c++) free(m->chunks[c].mem);
  for (size_t a = 0; a < m->narenas; a++) munmap(m->arenas[a].base, m->arenas[a].len);
  free(m->arenas);
  free(m->chunks);
  if (m->idx_mapped)
    munmap(m->idx, m->idx_mapped);
  else
    free(m->idx);
  free(m);
}

float *ps__rowmap_get(const ps__rowmap *m, uint64_t key) {
  size_t mask, s;
  if (m->count == 0) return NULL;
  mask = m->icap - 1;
  for (s = slot_of(key, mask);; s = (s + 1) & mask) {
    unsigned char *p = slot_at(m, s);
    uint32_t r = slot_row(p);
    if (r == EMPTY) return NULL;
    if (slot_key(p) == key) return m->in_index ? slot_val(p) : row_ptr(m, r);
  }
}

#define FM_SLOT_AHEAD 16 /* keys between hashing (slot prefetch) and emitting */
#define FM_ROW_AHEAD 8   /* keys between probing (row prefetch) and emitting */
#define FM_RING 32       /* > FM_SLOT_AHEAD, a power of two */

/* A little-endian key: one (unaligned) load, swapped on a big-endian host. */
static inline uint64_t key_le(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

static inline void prefetch_row_lines(const ps__rowmap *m, const char *r) {
  size_t n = m->row_bytes < 1024 ? m->row_bytes : 1024;
  for (size_t off = 0; off < n; off += 64) __builtin_prefetch(r + off);
}

/* For rows in the index: the probe finds the row, so two stages, the probe
 * SLOT_AHEAD keys after the prefetch. */
static inline void find_many_in_index(const ps__rowmap *m, const uint64_t *k64, const uint8_t *kle, size_t n,
                                      float **rows, uint32_t *idx) {
  size_t sring[FM_RING];
  const size_t mask = m->icap - 1;
  for (size_t t = 0; t < n + FM_SLOT_AHEAD; t++) {
    if (t < n) {
      size_t s = slot_of(k64 ? k64[t] : key_le(kle + 8 * t), mask);
      sring[t & (FM_RING - 1)] = s;
      __builtin_prefetch(m->idx + s * SLOT1);
    }
    if (t >= FM_SLOT_AHEAD) {
      size_t b = t - FM_SLOT_AHEAD;
      uint64_t key = k64 ? k64[b] : key_le(kle + 8 * b);
      float *r = NULL;
      uint32_t x = EMPTY;
      for (size_t s = sring[b & (FM_RING - 1)];; s = (s + 1) & mask) {
        unsigned char *p = m->idx + s * SLOT1;
        if (slot_row(p) == EMPTY) break;
        if (slot_key(p) == key) {
          r = slot_val(p);
          x = slot_row(p);
          break;
        }
      }
      rows[b] = r;
      if (idx) idx[b] = x;
    }
  }
}

/* Stage 1 at key t, stage 2 (probe) at t - (SLOT_AHEAD - ROW_AHEAD), emit at
 * t - SLOT_AHEAD; slot and row numbers wait in small rings between stages. */
static inline void find_many(const ps__rowmap *m, const uint64_t *k64, const uint8_t *kle, size_t n, float **rows,
                             uint32_t *idx) {
  size_t sring[FM_RING];
  uint32_t rring[FM_RING];
  if (m->count == 0) {
    for (size_t i = 0; i < n; i++) rows[i] = NULL;
    for (size_t i = 0; idx && i < n; i++) idx[i] = EMPTY;
    return;
  }
  if (m->in_index) {
    find_many_in_index(m, k64, kle, n, rows, idx);
    return;
  }
  const size_t mask = m->icap - 1;
  for (size_t t = 0; t < n + FM_SLOT_AHEAD; t++) {
    if (t < n) {
      uint64_t key = k64 ? k64[t] : key_le(kle + 8 * t);
      size_t s = slot_of(key, mask);
      sring[t & (FM_RING - 1)] = s;
      __builtin_prefetch(m->idx + s * SLOT);
    }
    size_t b = t - (FM_SLOT_AHEAD - FM_ROW_AHEAD);
    if (t >= FM_SLOT_AHEAD - FM_ROW_AHEAD && b < n) {
      uint64_t key = k64 ? k64[b] : key_le(kle + 8 * b);
      uint32_t r = EMPTY;
      for (size_t s = sring[b & (FM_RING - 1)];; s = (s + 1) & mask) {
        const unsigned char *p = m->idx + s * SLOT;
        uint32_t x = slot_row(p);
        if (x == EMPTY) break;
        if (slot_key(p) == key) {
          r = x;
          break;
        }
      }
      rring[b & (FM_RING - 1)] = r;
      if (r != EMPTY) prefetch_row_lines(m, (const char *)row_ptr(m, r));
    }
    if (t >= FM_SLOT_AHEAD) {
      size_t c = t - FM_SLOT_AHEAD;
      uint32_t r = rring[c & (FM_RING - 1)];
      rows[c] = r == EMPTY ? NULL : row_ptr(m, r);
      if (idx) idx[c] = r;
    }
  }
}

void ps__rowmap_find_many(const ps__rowmap *m, const uint64_t *keys64, size_t n, float **rows) {
  find_many(m, keys64, NULL, n, rows, NULL);
}

void ps__rowmap_find_many_le(const ps__rowmap *m, const uint8_t *keys_le, size_t n, float **rows) {
  find_many(m, NULL, keys_le, n, rows, NULL);
}

void ps__rowmap_find_many_at(const ps__rowmap *m, const uint64_t *keys64, const uint8_t *keys_le, size_t n,
                             float **rows, uint32_t *idx) {
  if (keys64) find_many(m, keys64, NULL, n, rows, idx);
  else find_many(m, NULL, keys_le, n, rows, idx);
}

void ps__rowmap_prefetch(const ps__rowmap *m, uint64_t key) {
  if (m->icap) __builtin_prefetch(slot_at(m, slot_of(key, m->icap - 1)));
}

void ps__rowmap_prefetch_row(const ps__rowmap *m, uint64_t key) {
  const char *r = (const char *)ps__rowmap_get(m, key);
  if (r) {
    /* A wide row is copied or updated whole: ask for all of its lines (up to 1 KiB), not
     * just the first two the hardware's streamer would wait for. */
    prefetch_row_lines(m, r);
  }
}

/* Allocate the next chunk. 0 or -1 (nothing changed). */
static int add_chunk(ps__rowmap *m) {
  size_t c = m->nchunks, n = chunk_rows(m, c);
  size_t rows_bytes, bytes;
  void *mem;
  uintptr_t at;

  if (m->row_bytes > MAX_CHUNK / n) return -1;
  rows_bytes = m->in_index ? 0 : (n * m->row_bytes + 7) & ~(size_t)7;
  if (rows_bytes > MAX_CHUNK - n * sizeof(uint64_t)) return -1;
  bytes = rows_bytes + n * sizeof(uint64_t) + (m->in_index ? n * sizeof(uint32_t) : 0) + ALIGN - 1;
  if (m->nchunks == m->chunks_cap) {
    size_t cap = m->chunks_cap ? 2 * m->chunks_cap : 32;
    chunk *cs = ps__realloc(m->chunks, cap * sizeof *cs);
    if (!cs) return -1;
    m->chunks = cs;
    m->chunks_cap = cap;
  }
  if (bytes >= ARENA_MIN_CHUNK) {
    bytes = (bytes - (ALIGN - 1) + ALIGN - 1) & ~(size_t)(ALIGN - 1); /* arenas are aligned */
    mem = arena_take(m, bytes);
    if (!mem) return -1;
    at = (uintptr_t)mem;
    mem = NULL; /* freed with its arena */
  } else {
    mem = ps__malloc(bytes);
    if (!mem) return -1;
    at = ((uintptr_t)mem + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1);
  }
  m->chunks[c].mem = mem;
  m->chunks[c].rows = m->in_index ? NULL : (float *)at;
  m->chunks[c].keys = (uint64_t *)(at + rows_bytes);
  m->chunks[c].slots = m->in_index ? (uint32_t *)(m->chunks[c].keys + n) : NULL;
  m->nchunks++;
  m->row_cap += n;
  m->chunk_bytes += bytes;
  return 0;
}

/* Rebuild the index with ncap slots. 0 or -1 (nothing changed). */
static int rehash(ps__rowmap *m, size_t ncap) {
  unsigned char *idx;
  size_t mask = ncap - 1, sb = m->slot_bytes;

  if (ncap > SIZE_MAX / sb) return -1;
  if (m->in_index && m->before_rehash) m->before_rehash(m->before_rehash_arg);
  size_t bytes = ncap * sb, mapped = 0;
  if (bytes >= HUGE_PAGE) {
    mapped = round_huge(bytes);
    idx = huge_alloc(mapped);
  } else {
    idx = ps__malloc(bytes);
  }
  if (!idx) return -1;
  for (size_t t = 0; t < ncap; t++) slot_set(idx + t * sb, 0, EMPTY);
  for (size_t s = 0; s < m->icap; s++) {
    const unsigned char *p = slot_at(m, s);
    uint32_t r = slot_row(p);
    size_t t;
    if (r == EMPTY) continue;
    for (t = slot_of(slot_key(p), mask); slot_row(idx + t * sb) != EMPTY; t = (t + 1) & mask) {
    }
    memcpy(idx + t * sb, p, sb); /* key, row number and, in the index, the row */
    if (m->in_index) {
      size_t off, c = locate(m, r, &off);
      m->chunks[c].slots[off] = (uint32_t)t;
    }
  }
  if (m->idx_mapped)
    munmap(m->idx, m->idx_mapped);
  else
    free(m->idx);
  m->idx = idx;
  m->idx_mapped = mapped;
  m->icap = ncap;
  return 0;
}

static float *upsert(ps__rowmap *m, uint64_t key, int *created, int zero, uint32_t *idx) {
  size_t mask, s = 0, off, c;
  float *row;

  if (created) *created = 0;
  if (m->icap) {
    mask = m->icap - 1;
    for (s = slot_of(key, mask);; s = (s + 1) & mask) {
      unsigned char *p = slot_at(m, s);
      uint32_t r = slot_row(p);
      if (r == EMPTY) break;
      if (slot_key(p) == key) {
        if (idx) *idx = r;
        return m->in_index ? slot_val(p) : row_ptr(m, r);
      }
    }
  }
  /* A new row: make room first, so that a failure leaves the map as it was. */
  if (m->count >= MAX_ROWS) return NULL;
  if (m->count == m->row_cap && add_chunk(m)) return NULL;
  if ((m->count + 1) * 4 > m->icap * 3) {
    if (rehash(m, m->icap ? 2 * m->icap : MIN_INDEX)) return NULL;
    mask = m->icap - 1;
    for (s = slot_of(key, mask); slot_row(slot_at(m, s)) != EMPTY; s = (s + 1) & mask) {
    }
  }
  slot_set(slot_at(m, s), key, (uint32_t)m->count);
  c = locate(m, m->count, &off);
  m->chunks[c].keys[off] = key;
  if (m->in_index) {
    m->chunks[c].slots[off] = (uint32_t)s;
    row = slot_val(slot_at(m, s));
  } else {
    row = m->chunks[c].rows + off * m->row_floats;
  }
  if (zero) memset(row, 0, m->row_bytes);
  if (idx) *idx = (uint32_t)m->count;
  m->count++;
  if (created) *created = 1;
  return row;
}

float *ps__rowmap_upsert(ps__rowmap *m, uint64_t key, int *created) { return upsert(m, key, created, 1, NULL); }

float *ps__rowmap_upsert_at(ps__rowmap *m, uint64_t key, int *created, uint32_t *idx) {
  return upsert(m, key, created, 1, idx);
}

float *ps__rowmap_upsert_uninit(ps__rowmap *m, uint64_t key, int *created) { return upsert(m, key, created, 0, NULL); }

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

/* A map whose index is much larger than its rows (an accumulator that once held a huge
 * round, then small ones) is cleared slot by slot: each row's slot is found first (all
 * lookups before any slot is emptied, since a probe stops at an empty slot), then
 * emptied, instead of a pass over the whole index on every clear. */
static int clear_rows(ps__rowmap *m) {
  size_t n = m->count, mask = m->icap - 1;
  size_t *at = ps__malloc(n * sizeof *at);
  if (!at) return -1;
  for (size_t i = 0; i < n; i++) {
    size_t s = slot_of(ps__rowmap_key_at(m, i), mask);
    while (slot_row(slot_at(m, s)) != (uint32_t)i) s = (s + 1) & mask;
    at[i] = s;
  }
  for (size_t i = 0; i < n; i++) slot_set(slot_at(m, at[i]), 0, EMPTY);
  free(at);
  return 0;
}

void ps__rowmap_clear(ps__rowmap *m) {
  if (m->count && (m->count * 16 >= m->icap || clear_rows(m)))
    for (size_t s = 0; s < m->icap; s++) slot_set(slot_at(m, s), 0, EMPTY);
  m->count = 0;
}

size_t ps__rowmap_bytes(const ps__rowmap *m) {
  return sizeof *m + m->chunks_cap * sizeof(chunk) + m->chunk_bytes +
         m->icap * m->slot_bytes;
}

size_t ps__rowmap_index(const ps__rowmap *m, uint64_t key) {
  if (m->count == 0) return SIZE_MAX;
  size_t mask = m->icap - 1;
  for (size_t s = slot_of(key, mask);; s = (s + 1) & mask) {
    const unsigned char *p = slot_at(m, s);
    uint32_t r = slot_row(p);
    if (r == EMPTY) return SIZE_MAX;
    if (slot_key(p) == key) return r;
  }
}

/* ---------------------------------------------------------------- views */

void ps__rowmap_before_rehash(ps__rowmap *m, void (*fn)(void *arg), void *arg) {
  m->before_rehash = fn;
  m->before_rehash_arg = arg;
}

int ps__rowmap_view_take(const ps__rowmap *m, ps__rowmap_view *v) {
  memset(v, 0, sizeof *v);
  size_t off, nc = m->count ? locate(m, m->count - 1, &off) + 1 : 0;
  v->idx = m->in_index ? m->idx : NULL;
  v->n = m->count;
  v->row_floats = m->row_floats;
  v->shift = m->shift;
  v->nchunks = nc;
  v->rows = ps__malloc((nc ? nc : 1) * sizeof *v->rows);
  v->keys = ps__malloc((nc ? nc : 1) * sizeof *v->keys);
  if (!v->rows || !v->keys) {
    ps__rowmap_view_free(v);
    return PS_ERR_NOMEM;
  }
  for (size_t c = 0; c < nc; c++) {
    /* rows in the index: the chunk's slot numbers stand in for its rows */
    v->rows[c] = m->in_index ? (float *)(void *)m->chunks[c].slots : m->chunks[c].rows;
    v->keys[c] = m->chunks[c].keys;
  }
  return 0;
}

void ps__rowmap_view_free(ps__rowmap_view *v) {
  free(v->rows);
  free(v->keys);
  memset(v, 0, sizeof *v);
}

float *ps__rowmap_view_row(const ps__rowmap_view *v, size_t i) {
  size_t off, c = locate_in(v->shift, i, &off);
  if (v->idx) return slot_val(v->idx + (size_t)((const uint32_t *)(const void *)v->rows[c])[off] * SLOT1);
  return v->rows[c] + off * v->row_floats;
}

uint64_t ps__rowmap_view_key(const ps__rowmap_view *v, size_t i) {
  size_t off, c = locate_in(v->shift, i, &off);
  return v->keys[c][off];
}
