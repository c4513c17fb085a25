/*
 * rowmap.c - a map from uint64 keys to fixed-size float rows.
 *
 * Records. Rows are numbered 0, 1, 2, ... in insertion order and stored as records
 * (the 8-byte key, then the row's floats) in chunks that never move, so a row pointer
 * and a row number stay valid until the map is cleared or freed, and the key is stored
 * once, beside its row. Large chunks hold 1 << shift records, with shift chosen so a
 * chunk is 1-2 MiB; the first 1 << shift rows go into chunks of 1, 1, 2, 4, ... records
 * so that a small map (a dense table of a few slices, a round's accumulator) does not
 * reserve megabytes.
 *
 * Index. Open addressing with linear probing over 4-byte entries: 0 is a free entry,
 * anything else is (row number + 1) << tag_bits | tag, where tag_bits = 32 - the bits
 * of the largest row number the index can hold (5 bits for 10^8 rows, more in smaller
 * maps). The tag's low bit says the entry is at its home; the bits above it are the top
 * bits of the hash's fraction below the home (the low 64 bits of hash * capacity). A
 * probe compares tags, the home flag included (an entry at the key's home must have it,
 * one further on must not: about as selective as tag_bits bits of the hash), and lets a
 * move to an index twice as large place an entry at its home without its key (below).
 * Only a matching tag costs the access to the record, whose key decides; so a hit
 * costs the entry's cache line and the record's (the record is the row itself: the
 * access brings the row), and a miss costs the entries' line or two, a wrong tag match
 * (about 1 in 2^tag_bits entries scanned) a record more. A position is the hash times the
 * capacity, shifted (multiply-shift range reduction: any capacity works, as
 * ps__rowmap_reserve asks for, and positions keep the order of the hashes); the load is
 * at most 7/8 and the index doubles when it is reached, so its load stays between 7/16
 * and 7/8. Memory per row: row_floats * 4 + 8 + 4 / load, e.g. 16.6-21.1 bytes for
 * one-float rows (and the old index, half the size, while rows move to a new one).
 *
 * Growth without a pause (as Redis's dict does it, for open addressing): the new index
 * replaces the old one at once, new rows go into it, and every MIGRATE_EVERY inserts
 * MIGRATE_STEP rows of the old index move to it, in order of position. An entry at its
 * home (about 56% of them at load 7/8) needs no record: its home in an index twice as
 * large is twice the old one plus the fraction's top bit, and the fraction's next bits
 * are its new tag. Any other entry's key is read from its record (a batch of records
 * prefetched together), which is the move's cost: a random access. Positions keep the hash
 * order, so the writes into the new index go in order too. The old index does not
 * change meanwhile: a key whose home lies in a stretch of it that has moved whole (up to
 * an empty entry) is looked up in the new index only, any other in the old one and then
 * the new one. The move ends halfway to the next growth; a clear drops the old index.
 * A fresh index is zero pages from mmap, and the first inserts into it land all over
 * it: to keep them from faulting it in whole at once, the next index is faulted in
 * before the growth. One in huge pages is allocated at 15/16 of the rows and faulted in
 * by a helper thread (prefault.c), which stops taking steps before the index is used
 * (at the growth at the latest); over the last 1/64 of the rows the map's own thread
 * faults in whatever the helper has not reached, at the pace that finishes at the
 * growth (prepare()).
 * Lookups never write, so two threads may look keys up at once (shard/apply.c's huge
 * requests). Callers walking many keys hide the misses with ps__rowmap_find_many, or
 * with ps__rowmap_prefetch / ps__rowmap_prefetch_row a few keys ahead.
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
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "common/common.h"
#include "store/prefault.h"

#include "store/rowmap_int.h"

/* ---------------------------------------------------------------- the index */

static inline size_t ix_home(const rowidx *x, uint64_t h) {
  return (size_t)(((unsigned __int128)h * x->cap) >> 64);
}

static inline size_t ix_next(const rowidx *x, size_t s) { return s + 1 == x->cap ? 0 : s + 1; }

static inline uint32_t ix_row(const rowidx *x, uint32_t e) { return (e >> x->tb) - 1; }

/* The tag of hash h at its home, or 1 less (the home flag clear) anywhere else: the
 * fraction's top fb bits above the home flag. */
static inline uint32_t ix_tag_lo(const rowidx *x, uint64_t lo) {
  return x->tb ? (x->fb ? (uint32_t)(lo >> (64 - x->fb)) << 1 : 0) | 1 : 0;
}

/* Home and home tag of hash h in one multiply. */
static inline size_t ix_home_tag(const rowidx *x, uint64_t h, uint32_t *tag) {
  unsigned __int128 p = (unsigned __int128)h * x->cap;
  *tag = ix_tag_lo(x, (uint64_t)p);
  return (size_t)(p >> 64);
}

/* An empty index of cap entries into *x; 0 or -1. */
static int ix_make(rowidx *x, size_t cap) {
  size_t bytes = cap * sizeof(uint32_t), mapped = 0;
  uint32_t *e;
  if (cap > SIZE_MAX / sizeof(uint32_t) / 8) return -1;
  if (bytes >= HUGE_PAGE) {
    mapped = ps__rm_round_huge(bytes);
    e = ps__rm_huge_alloc(mapped);
  } else {
    e = ps__calloc(cap, sizeof *e);
  }
  if (!e) return -1;
  x->e = e;
  x->cap = cap;
  x->mapped = mapped;
  x->max_rows = cap / 8 * 7 + cap % 8 * 7 / 8;
  if (x->max_rows > MAX_ROWS) x->max_rows = MAX_ROWS;
  unsigned rb = (unsigned)(64 - __builtin_clzll((unsigned long long)x->max_rows)); /* holds row + 1 */
  x->tb = rb >= 32 ? 0 : 32 - rb;
  x->tmask = x->tb ? ((uint32_t)1 << x->tb) - 1 : 0;
  x->fb = x->tb ? x->tb - 1 : 0;
  return 0;
}

static void ix_free(rowidx *x) {
  if (x->mapped) munmap(x->e, x->mapped);
  else free(x->e);
  memset(x, 0, sizeof *x);
}

/* Row r, whose home in x is s0 and home tag tag, into x (its key is not there yet):
 * away from home the home flag is cleared. */
static inline void ix_put_at(rowidx *x, size_t s0, uint32_t tag, uint32_t r) {
  size_t s = s0;
  while (x->e[s]) s = ix_next(x, s);
  x->e[s] = ((r + 1) << x->tb) | (s == s0 ? tag : tag & ~(uint32_t)1);
}

/* Row r of hash h into x (its key is not there yet). */
static inline void ix_put(rowidx *x, uint64_t h, uint32_t r) {
  uint32_t tag;
  size_t s = ix_home_tag(x, h, &tag);
  ix_put_at(x, s, tag, r);
}

/* The row of key (hash h) in x, or NONE; its record into *rec when found. */
static inline uint32_t ix_find(const ps__rowmap *m, const rowidx *x, uint64_t key, uint64_t h, char **rec) {
  uint32_t tag;
  size_t s0 = ix_home_tag(x, h, &tag);
  for (size_t s = s0;; s = ix_next(x, s)) {
    uint32_t e = x->e[s];
    if (!e) return NONE;
    if ((e & x->tmask) == (s == s0 ? tag : tag & ~(uint32_t)1)) {
      uint32_t r = ix_row(x, e);
      char *p = rec_at(m, r);
      if (rec_key(p) == key) {
        *rec = p;
        return r;
      }
    }
  }
}

/* The first row of x whose tag matches h, or NONE: the candidate a pipeline prefetches
 * (its key is checked when the record is in cache). */
static inline uint32_t cand_at(const rowidx *x, size_t s, uint32_t tag);
static inline uint32_t ix_candidate(const rowidx *x, uint64_t h) {
  uint32_t tag;
  size_t s = ix_home_tag(x, h, &tag);
  return cand_at(x, s, tag);
}

/* Whether the old index's entry for hash h, if there is one, has surely moved to the
 * current index. The old index moves in order of position, from just after the empty
 * entry ostart round to it; a key's entry is in the run of entries (up to an empty one)
 * that holds its home, after the home, so once a run has moved whole (it lies before
 * m->safe), so have the entries of every key whose home is in it. The old index never
 * changes while rows move, so an entry that has moved is still found there too. */
static inline int old_moved(const ps__rowmap *m, uint64_t h) {
  size_t ho = ix_home(&m->old, h), q = ho > m->ostart ? ho - m->ostart - 1 : ho + m->old.cap - m->ostart - 1;
  return q < m->safe;
}

/* While rows move, a key whose old entry has not moved is looked up in the old index
 * (where the rows from before the growth are) and then in the current one (rows since);
 * any other key only in the current one. */
static inline uint32_t find_h(const ps__rowmap *m, uint64_t key, uint64_t h, char **rec) {
  if (m->count == 0) return NONE;
  if (m->old.cap && !old_moved(m, h)) {
    __builtin_prefetch(&m->cur.e[ix_home(&m->cur, h)]); /* both misses at once */
    uint32_t r = ix_find(m, &m->old, key, h, rec);
    if (r != NONE) return r;
  }
  return ix_find(m, &m->cur, key, h, rec);
}

/* Rows [0, count) into the current index, which holds none of them. */
static void put_all(ps__rowmap *m) {
  enum { BATCH = 32 };
  uint64_t hs[BATCH];
  for (size_t i = 0; i < m->count; i += BATCH) {
    size_t n = m->count - i < BATCH ? m->count - i : BATCH;
    for (size_t j = 0; j < n; j++) {
      hs[j] = ps__mix64(rec_key(rec_at(m, i + j)));
      __builtin_prefetch(&m->cur.e[ix_home(&m->cur, hs[j])], 1);
    }
    for (size_t j = 0; j < n; j++) ix_put(&m->cur, hs[j], (uint32_t)(i + j));
  }
}

/* Move k rows (or all that are left) of the old index into the current one; the old
 * index is freed once all have moved. The
 * old entries are read in order and the records of a batch of them prefetched (their
 * keys give the hashes); since a position is the hash scaled to the capacity, the
 * entries written to the current index go in order too, from line to line. */
static void migrate(ps__rowmap *m, size_t k) {
  enum { BATCH = 32 };
  uint32_t rows[BATCH];
  uint64_t hs[BATCH];
  const rowidx *o = &m->old;
  rowidx *x = &m->cur;
  /* An entry at its home (flag set) moves without its record when the new index is
   * twice the old one and its tag has a fraction bit for each: the new home is twice
   * the old one plus the fraction's top bit, and the bits after it are the new tag's. */
  int quick = x->cap == 2 * o->cap && o->fb >= x->fb + 1;
  unsigned drop = quick ? o->fb - 1 - x->fb : 0;
  uint32_t fmask = ((uint32_t)1 << x->fb) - 1;
  size_t moved = 0;
  while (moved < k && m->mig < o->cap) {
    size_t n = 0;
    while (n < BATCH && moved + n < k && m->mig < o->cap) {
      size_t p = m->ostart + 1 + m->mig;
      if (p >= o->cap) p -= o->cap;
      uint32_t e = o->e[p];
      m->mig++;
      if (e) {
        uint32_t r = ix_row(o, e);
        if (quick && (e & 1)) {
          uint32_t f = (e & o->tmask) >> 1;
          uint32_t tag = x->tb ? (((f >> drop) & fmask) << 1) | 1 : 0;
          ix_put_at(x, 2 * p + (f >> (o->fb - 1)), tag, r);
          moved++;
          continue;
        }
        rows[n] = r;
        __builtin_prefetch(rec_at(m, rows[n]));
        n++;
      } else {
        m->safe = m->mig; /* a run has moved whole */
      }
    }
    for (size_t j = 0; j < n; j++) hs[j] = ps__mix64(rec_key(rec_at(m, rows[j])));
    for (size_t j = 0; j < n; j++) ix_put(x, hs[j], rows[j]);
    moved += n;
  }
  m->moved += moved;
  /* The records the next step will read (MIGRATE_STEP rows lie in about 80 entries at
   * load 7/8 or less): asked for now, they arrive while the inserts before it run. */
  for (size_t i = 0, p = m->ostart + 1 + m->mig; i < MIGRATE_STEP * 5 / 4 && m->mig + i < o->cap; i++, p++) {
    uint32_t e = o->e[p >= o->cap ? p - o->cap : p];
    if (e && !(quick && (e & 1))) __builtin_prefetch(rec_at(m, ix_row(o, e)));
  }
  if (m->mig == o->cap) {
    ix_free(&m->old);
    m->mig = m->moved = m->old_n = m->ostart = m->safe = 0;
  }
}

static size_t next_cap(const ps__rowmap *m) { return m->cur.cap ? 2 * m->cur.cap : MIN_INDEX; }

/* Bytes of the next index faulted in (or being faulted in) so far. */
size_t ps__rm_next_touched(const ps__rowmap *m) {
  if (!m->next.cap) return 0;
  size_t bytes = m->next.cap * sizeof(uint32_t), t = m->pf ? ps__prefault_claimed(m->pf) : m->touched;
  return t < bytes ? t : bytes;
}

/* End the helper faulting in the next index. keep: the index is about to be used
 * (waiting up to wait_ms, only for a step that writes it), else about to be freed. 0:
 * the next index is this thread's (m->touched: the bytes faulted in); -1: it went to
 * the helper, which unmaps it when its step ends, and there is no next index now. */
static int pf_end(ps__rowmap *m, int keep, unsigned wait_ms) {
  size_t claimed = 0;
  ps__prefault *pf = m->pf;
  m->pf = NULL;
  if (ps__prefault_stop(pf, keep, wait_ms, &claimed) == 0) {
    m->touched = claimed;
    return 0;
  }
  memset(&m->next, 0, sizeof m->next);
  m->touched = 0;
  return -1;
}

/* Ready the next index before the current one is full, so that the first inserts into
 * it, which land all over it, do not fault in (zero) the whole index at once: at 10^7
 * rows that was a pause of 50-200 ms.
 *
 * A next index in huge pages (2 MiB or more) is allocated when the map holds 15/16 of
 * the rows the current index takes (PF_SHARE), and a helper thread faults it in
 * (prefault.c): a huge page's fault with memory compaction costs the serving thread
 * milliseconds. At 5 M new rows a second the last 1/16 of 58.7 M rows (a 512 MiB next
 * index) takes 0.7 s, the helper's time for 256 faults; an earlier start holds the next
 * index (twice the current one) longer: from 7/8 on, a table of 10^8 rows of dim 1
 * took 30 B per row in bench_memory instead of 22 to 23, for growth latencies that were
 * no better (bench_growth: push p99 2.0x fixed against 1.7-1.8x from 15/16). Over the last 1/64 of the
 * rows (PREP_SHARE) this thread keeps pace itself, a 2 MiB step at a time, for the part
 * the helper has not reached (a starved helper, a slow kernel), so the index is faulted
 * in whole at the growth, as it is when there is no helper (none could be started, or a
 * smaller index, allocated and zeroed by calloc over the last 1/64). */
#define PREP_SHARE 64
#define PF_SHARE 16
#define PF_STEP HUGE_PAGE
static void prepare(ps__rowmap *m) {
  size_t max = m->cur.max_rows;
  if (m->old.cap || m->count >= max || max < 4096) return;
  if (!m->next.cap) {
    size_t cap = next_cap(m);
    if (m->count < max - max / (cap * sizeof(uint32_t) >= HUGE_PAGE ? PF_SHARE : PREP_SHARE)) return;
    if (ix_make(&m->next, cap)) return; /* out of memory: grow() tries again */
    m->touched = m->next.mapped ? 0 : cap * sizeof(uint32_t); /* calloc'd: zeroed */
    if (m->next.mapped) /* NULL: this thread does it */
      m->pf = ps__prefault_start(m->next.e, m->next.mapped, m->next.e, m->next.mapped);
  }
  if (m->pf && ps__prefault_finished(m->pf)) pf_end(m, 1, 0); /* all faulted in: join it */
  size_t share = max / PREP_SHARE, left = max - m->count;
  if (left > share) return;
  size_t bytes = m->next.cap * sizeof(uint32_t);
  size_t due = bytes - (size_t)((unsigned __int128)bytes * left / share);
  if (m->pf) {
    m->own_faulted += ps__prefault_claim(m->pf, due);
  } else if (m->touched < due) {
    due = (due + PF_STEP - 1) / PF_STEP * PF_STEP;
    if (due > bytes) due = bytes;
    ps__pages_populate((char *)m->next.e + m->touched, due - m->touched);
    m->own_faulted += due - m->touched;
    m->touched = due;
  }
}

/* Room in the index for one more row: a bigger index when the current one is full,
 * the old one finished first if it has not been (only when the map is cleared and
 * refilled faster than it moves). 0 or -1 (nothing changed). */
static int grow(ps__rowmap *m) {
  rowidx nx;
  if (m->count < m->cur.max_rows) return 0;
  if (m->old.cap) migrate(m, SIZE_MAX);
  if (m->pf) pf_end(m, 1, PF_WAIT_MS); /* normally done long ago */
  if (m->next.cap) {
    nx = m->next;
    memset(&m->next, 0, sizeof m->next);
    m->touched = 0;
  } else if (ix_make(&nx, next_cap(m))) {
    return -1;
  }
  if (m->count == 0) { /* nothing to move */
    if (m->cur.cap) ix_free(&m->cur);
    m->cur = nx;
    return 0;
  }
  m->old = m->cur;
  m->cur = nx;
  m->ostart = 0;
  while (m->old.e[m->ostart]) m->ostart++; /* there is one: the load is at most 7/8 */
  m->mig = m->moved = m->safe = 0;
  m->old_n = m->count;
  return 0;
}

int ps__rowmap_reserve(ps__rowmap *m, size_t rows) {
  rowidx nx;
  if (rows > MAX_ROWS) return -1;
  if (rows <= m->cur.max_rows) return 0;
  size_t cap = rows / 7 * 8 + (rows % 7 * 8 + 6) / 7; /* ceil(rows * 8 / 7) */
  if (cap < MIN_INDEX) cap = MIN_INDEX;
  if (ix_make(&nx, cap)) return -1;
  if (m->old.cap) ix_free(&m->old);
  if (m->pf) pf_end(m, 0, 0);
  if (m->next.cap) ix_free(&m->next);
  m->touched = 0;
  if (m->cur.cap) ix_free(&m->cur);
  m->cur = nx;
  m->mig = m->moved = m->old_n = m->ostart = m->safe = 0;
  put_all(m); /* every row, at once: the caller asked for the pause */
  return 0;
}

/* ---------------------------------------------------------------- map */

ps__rowmap *ps__rowmap_new(size_t row_floats) {
  ps__rowmap *m;
  if (row_floats > MAX_CHUNK / sizeof(float)) return NULL;
  m = ps__calloc(1, sizeof *m);
  if (!m) return NULL;
  m->row_floats = row_floats;
  m->row_bytes = row_floats * sizeof(float);
  m->stride = KEY_BYTES + m->row_bytes;
  while (m->shift < 30 && ((size_t)2 << m->shift) * m->stride <= CHUNK_TARGET) m->shift++;
  return m;
}

void ps__rowmap_free(ps__rowmap *m) {
  if (!m) return;
  for (size_t c = 0; c < m->nchunks; c++) free(m->chunks[c].mem);
  for (size_t a = 0; a < m->narenas; a++) ps__rm_arena_free(&m->arenas[a]);
  free(m->arenas);
  free(m->chunks);
  if (m->cur.cap) ix_free(&m->cur);
  if (m->old.cap) ix_free(&m->old);
  if (m->pf) pf_end(m, 0, 0); /* never waits: a helper inside a step unmaps the index */
  if (m->next.cap) ix_free(&m->next);
  free(m);
}

float *ps__rowmap_get(const ps__rowmap *m, uint64_t key) {
  char *rec;
  uint32_t r = find_h(m, key, ps__mix64(key), &rec);
  return r == NONE ? NULL : rec_row(rec);
}

size_t ps__rowmap_index(const ps__rowmap *m, uint64_t key) {
  char *rec;
  uint32_t r = find_h(m, key, ps__mix64(key), &rec);
  return r == NONE ? SIZE_MAX : r;
}

/* ps__rowmap_upsert_many's pipeline (find_many's is below). */
#define FM_SLOT_AHEAD 16 /* keys between hashing (entry prefetch) and emitting */
#define FM_ROW_AHEAD 8   /* keys between probing (record prefetch) and emitting */
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

/* A record's lines (its key and up to 1 KiB of the row): a wide row is copied or updated
 * whole, so all of its lines are asked for, not just the first two the hardware's
 * streamer would wait for. */
static inline void prefetch_rec(const ps__rowmap *m, const char *r) {
  size_t n = m->stride < 1024 ? m->stride : 1024;
  for (size_t off = 0; off < n; off += 64) __builtin_prefetch(r + off);
  __builtin_prefetch(r + n - 1);
}

/* The row of the first entry of x from position s on whose tag is tag, or NONE if an
 * empty entry comes first. The first FM_WIN entries are compared at once where SSE2 is
 * available (no branch per entry: the probe's length is data, and a mispredicted exit
 * cost more than the compares); a longer probe, or one that would run past the end of
 * the index, goes on one entry at a time. */
#define FM_WIN 8
static inline uint32_t cand_at(const rowidx *x, size_t s, uint32_t tag) {
  uint32_t away = tag & ~(uint32_t)1; /* the tag past the home */
#ifdef __SSE2__
  if (s + FM_WIN <= x->cap) {
    __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(x->e + s));
    __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(x->e + s + 4));
    __m128i zero = _mm_setzero_si128(), mk = _mm_set1_epi32((int)x->tmask), tg = _mm_set1_epi32((int)away);
    __m128i tg0 = _mm_set_epi32((int)away, (int)away, (int)away, (int)tag);
    unsigned z = (unsigned)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(a, zero))) |
                 (unsigned)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(b, zero))) << 4;
    unsigned t = (unsigned)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(a, mk), tg0))) |
                 (unsigned)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(b, mk), tg))) << 4;
    t &= ~z;
    if (t | z) {
      unsigned p = (unsigned)__builtin_ctz(t | z);
      return (t >> p) & 1 ? ix_row(x, x->e[s + p]) : NONE;
    }
    s += FM_WIN - 1; /* the loop below starts at the entry after */
    s = ix_next(x, s);
    tag = away;
  }
#endif
  for (;; s = ix_next(x, s), tag = away) {
    uint32_t e = x->e[s];
    if (!e) return NONE;
    if ((e & x->tmask) == tag) return ix_row(x, e);
  }
}

/* Three stages, each a tight loop over a batch of FM_B keys: stage 1 hashes the newest
 * batch and prefetches its entries (the home's line, and the next one when cand_at's
 * window reaches it); stage 2 takes the batch before, finds each key's candidate (the
 * first entry with its tag) and prefetches its record; stage 3 takes the batch before
 * that, where the record's key decides (a wrong candidate, rare, is resolved by a plain
 * lookup). A key's misses thus have 1-2 batches of other keys' work to arrive in.
 * Hashes, candidates and records wait in small rings between stages. */
#define FM_B 16
#define FM_R (4 * FM_B) /* ring slots: > 3 batches, a power of two */
static inline void find_many(const ps__rowmap *m, const uint64_t *k64, const uint8_t *kle, size_t n, float **rows,
                             uint32_t *idx) {
  uint64_t hring[FM_R];
  char *cring[FM_R];
  uint32_t rring[FM_R];
  if (m->count == 0) {
    for (size_t i = 0; i < n; i++) rows[i] = NULL;
    for (size_t i = 0; idx && i < n; i++) idx[i] = NONE;
    return;
  }
  const rowidx *cx = &m->cur, *ox = m->old.cap ? &m->old : NULL;
  for (size_t base = 0; base < n + 2 * FM_B; base += FM_B) {
    for (size_t t = base, e = base + FM_B < n ? base + FM_B : n; t < e; t++) {
      uint64_t h = ps__mix64(k64 ? k64[t] : key_le(kle + 8 * t));
      hring[t & (FM_R - 1)] = h;
      size_t s = ix_home(cx, h);
      __builtin_prefetch(&cx->e[s]);
      __builtin_prefetch(&cx->e[s + FM_WIN - 1 < cx->cap ? s + FM_WIN - 1 : s]); /* cand_at reads it too */
      if (ox && !old_moved(m, h)) __builtin_prefetch(&ox->e[ix_home(ox, h)]);
    }
    if (base >= FM_B) {
      for (size_t b = base - FM_B, e = base < n ? base : n; b < e; b++) {
        uint64_t h = hring[b & (FM_R - 1)];
        uint32_t r = ox && !old_moved(m, h) ? ix_candidate(ox, h) : NONE;
        if (r == NONE) r = ix_candidate(cx, h);
        char *rec = r != NONE ? rec_at(m, r) : NULL;
        rring[b & (FM_R - 1)] = r;
        cring[b & (FM_R - 1)] = rec;
        if (rec) prefetch_rec(m, rec);
      }
    }
    if (base >= 2 * FM_B) {
      for (size_t c = base - 2 * FM_B, e = base - FM_B < n ? base - FM_B : n; c < e; c++) {
        char *rec = cring[c & (FM_R - 1)];
        uint32_t r = rring[c & (FM_R - 1)];
        float *row = NULL;
        if (rec) {
          uint64_t key = k64 ? k64[c] : key_le(kle + 8 * c);
          if (rec_key(rec) != key) { /* a wrong tag match: look it up in full */
            r = find_h(m, key, hring[c & (FM_R - 1)], &rec);
            if (r == NONE) rec = NULL;
          }
          if (rec) row = rec_row(rec);
        }
        rows[c] = row;
        if (idx) idx[c] = r;
      }
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
  if (!m->cur.cap) return;
  uint64_t h = ps__mix64(key);
  __builtin_prefetch(&m->cur.e[ix_home(&m->cur, h)]);
  if (m->old.cap && !old_moved(m, h)) __builtin_prefetch(&m->old.e[ix_home(&m->old, h)]);
}

void ps__rowmap_prefetch_row(const ps__rowmap *m, uint64_t key) {
  if (m->count == 0) return;
  uint64_t h = ps__mix64(key);
  uint32_t r = m->old.cap && !old_moved(m, h) ? ix_candidate(&m->old, h) : NONE;
  if (r == NONE) r = ix_candidate(&m->cur, h);
  if (r != NONE) prefetch_rec(m, rec_at(m, r));
}

/* Allocate the next chunk. 0 or -1 (nothing changed). */
static int add_chunk(ps__rowmap *m) {
  size_t c = m->nchunks, n = chunk_rows(m, c);
  size_t bytes;
  void *mem;
  uintptr_t at;

  if (m->stride > MAX_CHUNK / n) return -1;
  bytes = n * m->stride;
  if (m->nchunks == m->chunks_cap) {
    size_t cap = m->chunks_cap ? 2 * m->chunks_cap : 32;
    chunk *cs = ps__realloc(m->chunks, cap * sizeof *cs);
    if (!cs) return -1;
    m->chunks = cs;
    m->chunks_cap = cap;
  }
  if (bytes >= ARENA_MIN_CHUNK) {
    bytes = (bytes + ALIGN - 1) & ~(size_t)(ALIGN - 1); /* arenas stay aligned */
    mem = ps__rm_arena_take(m, bytes);
    if (!mem) return -1;
    at = (uintptr_t)mem;
    mem = NULL; /* freed with its arena */
  } else {
    bytes += ALIGN - 1;
    mem = ps__malloc(bytes);
    if (!mem) return -1;
    at = ((uintptr_t)mem + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1);
  }
  m->chunks[c].mem = mem;
  m->chunks[c].rec = (char *)at;
  m->nchunks++;
  m->row_cap += n;
  m->chunk_bytes += bytes;
  return 0;
}

/* The record of a new row for key (hash h, known absent), its number into *r: room is
 * made first, so that a failure (NULL) leaves the map as it was. */
static char *insert_new(ps__rowmap *m, uint64_t key, uint64_t h, int zero, uint32_t *r) {
  if (m->count >= MAX_ROWS) return NULL;
  if (m->count == m->row_cap && add_chunk(m)) return NULL;
  if (grow(m)) return NULL;
  *r = (uint32_t)m->count;
  char *rec = rec_at(m, *r);
  memcpy(rec, &key, sizeof key);
  ix_put(&m->cur, h, *r);
  m->count++;
  if (m->old.cap) {
    if (m->count % MIGRATE_EVERY == 0) migrate(m, MIGRATE_STEP);
  } else {
    prepare(m);
  }
  if (zero) memset(rec_row(rec), 0, m->row_bytes);
  return rec;
}

static float *upsert(ps__rowmap *m, uint64_t key, int *created, int zero, uint32_t *idx) {
  uint64_t h = ps__mix64(key);
  char *rec;
  uint32_t r = find_h(m, key, h, &rec);

  if (created) *created = 0;
  if (r == NONE) {
    rec = insert_new(m, key, h, zero, &r);
    if (!rec) return NULL;
    if (created) *created = 1;
  }
  if (idx) *idx = r;
  return rec_row(rec);
}

/* The pipeline of find_many, inserting the keys it does not find at the emit stage,
 * where their index entries are in cache (prefetched for writing). An insert may grow
 * the index or move rows between the stages: a candidate found before is still a row
 * number (rows never move) and its record's key decides. A key that had no candidate
 * at stage 2 was absent then, and growths and moves only move entries: it is inserted
 * without a second lookup, unless one of the FM_GAP keys emitted since stage 2 was the
 * same key (repeated in the batch: then it is looked up in full, and found). */
#define FM_GAP (FM_SLOT_AHEAD - FM_ROW_AHEAD)
size_t ps__rowmap_upsert_many(ps__rowmap *m, const uint64_t *k64, const uint8_t *kle, size_t n, float **rows,
                              uint32_t *idx, uint8_t *created, int zero) {
  uint64_t hring[FM_RING];
  uint32_t rring[FM_RING];
  for (size_t t = 0; t < n + FM_SLOT_AHEAD; t++) {
    if (t < n) {
      uint64_t h = ps__mix64(k64 ? k64[t] : key_le(kle + 8 * t));
      hring[t & (FM_RING - 1)] = h;
      if (m->cur.cap) {
        size_t s = ix_home(&m->cur, h);
        __builtin_prefetch(&m->cur.e[s], 1);
        __builtin_prefetch(&m->cur.e[s + 16 < m->cur.cap ? s + 16 : s], 1); /* a miss's probe runs on at high load */
      }
      if (m->old.cap && !old_moved(m, h)) __builtin_prefetch(&m->old.e[ix_home(&m->old, h)]);
    }
    size_t b = t - (FM_SLOT_AHEAD - FM_ROW_AHEAD);
    if (t >= FM_SLOT_AHEAD - FM_ROW_AHEAD && b < n) {
      uint64_t h = hring[b & (FM_RING - 1)];
      uint32_t r = NONE;
      if (m->count) {
        if (m->old.cap && !old_moved(m, h)) r = ix_candidate(&m->old, h);
        if (r == NONE) r = ix_candidate(&m->cur, h);
      }
      rring[b & (FM_RING - 1)] = r;
      if (r != NONE) prefetch_rec(m, rec_at(m, r));
    }
    if (t >= FM_SLOT_AHEAD) {
      size_t c = t - FM_SLOT_AHEAD;
      uint64_t key = k64 ? k64[c] : key_le(kle + 8 * c), h = hring[c & (FM_RING - 1)];
      uint32_t r = rring[c & (FM_RING - 1)];
      char *rec = NULL;
      uint8_t made = 0;
      int again = 0; /* look the key up in full */
      if (r != NONE) {
        rec = rec_at(m, r);
        again = rec_key(rec) != key;
        if (again) rec = NULL;
      } else { /* absent at stage 2 stays absent unless a key emitted since was this one */
        for (size_t j = c > FM_GAP ? c - FM_GAP : 0; j < c && !again; j++)
          again = (k64 ? k64[j] : key_le(kle + 8 * j)) == key;
      }
      if (again) r = find_h(m, key, h, &rec);
      if (!rec) {
        rec = insert_new(m, key, h, zero, &r);
        if (!rec) return c;
        made = 1;
      }
      rows[c] = rec_row(rec);
      if (idx) idx[c] = r;
      if (created) created[c] = made;
    }
  }
  return n;
}

float *ps__rowmap_upsert(ps__rowmap *m, uint64_t key, int *created) { return upsert(m, key, created, 1, NULL); }

float *ps__rowmap_upsert_at(ps__rowmap *m, uint64_t key, int *created, uint32_t *idx) {
  return upsert(m, key, created, 1, idx);
}

float *ps__rowmap_upsert_uninit(ps__rowmap *m, uint64_t key, int *created) { return upsert(m, key, created, 0, NULL); }

size_t ps__rowmap_count(const ps__rowmap *m) { return m->count; }

uint64_t ps__rowmap_key_at(const ps__rowmap *m, size_t i) {
  PS_ASSERT(i < m->count);
  return rec_key(rec_at(m, i));
}

float *ps__rowmap_row_at(const ps__rowmap *m, size_t i) {
  PS_ASSERT(i < m->count);
  return rec_row(rec_at(m, i));
}

size_t ps__rowmap_moving(const ps__rowmap *m) { return m->old.cap ? m->old_n - m->moved : 0; }

size_t ps__rowmap_settle(ps__rowmap *m, size_t budget) {
  size_t left = ps__rowmap_moving(m);
  if (!left || left > budget) return 0;
  migrate(m, SIZE_MAX);
  return left;
}

/* A map whose index is much larger than its rows (an accumulator that once held a huge
 * round, then small ones) is cleared entry by entry: each row's entry is found first
 * (all lookups before any entry is emptied, since a probe stops at an empty entry),
 * then emptied, instead of a pass over the whole index on every clear. Called with no
 * old index. */
static int clear_rows(ps__rowmap *m) {
  size_t n = m->count;
  rowidx *x = &m->cur;
  size_t *at = ps__malloc(n * sizeof *at);
  if (!at) return -1;
  for (size_t i = 0; i < n; i++) {
    uint64_t h = ps__mix64(rec_key(rec_at(m, i)));
    size_t s = ix_home(x, h);
    while (!x->e[s] || ix_row(x, x->e[s]) != (uint32_t)i) s = ix_next(x, s);
    at[i] = s;
  }
  for (size_t i = 0; i < n; i++) x->e[at[i]] = 0;
  free(at);
  return 0;
}

void ps__rowmap_clear(ps__rowmap *m) {
  if (m->old.cap) { /* rows being moved: the old index goes, the new one is wiped whole */
    ix_free(&m->old);
    m->mig = m->moved = m->old_n = m->ostart = m->safe = 0;
    memset(m->cur.e, 0, m->cur.cap * sizeof *m->cur.e);
  } else if (m->count && (m->count * 16 >= m->cur.cap || clear_rows(m))) {
    memset(m->cur.e, 0, m->cur.cap * sizeof *m->cur.e);
  }
  m->count = 0;
}
