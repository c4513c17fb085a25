/*
 * rowmap_mem.c - the row map's memory: 2 MiB-aligned mappings for large indexes and
 * arenas of large chunks (with a helper faulting in the arena ahead of its records),
 * what the map takes (ps__rowmap_usage, ps__rowmap_bytes), and views of its rows for a
 * checkpoint's writer. The layout is in rowmap_int.h, the design in rowmap.c.
 */
#include <string.h>
#include <sys/mman.h>

#include "common/common.h"
#include "store/rowmap_int.h"

/* ---------------------------------------------------------------- memory */

void *ps__rm_huge_alloc(size_t n) {
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

size_t ps__rm_round_huge(size_t n) { return (n + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1); }

/* Keep the AHEAD bytes of arena a after its chunks faulted in by a helper, so that the
 * map's thread, writing new records, does not take their huge pages' faults (the
 * kernel zeroing 2 MiB, at times compacting memory first). Only where the helper's
 * faults write no byte (MADV_POPULATE_WRITE): records are written meanwhile, and
 * perhaps into the page the helper is in. A window is given once the last one is done
 * and less than half of one is left ahead; the chunks catching up with a window that is
 * still being faulted in just take their faults (the kernel serialises them). */
#define AHEAD ((size_t)8 << 20)
static void arena_ahead(arena *a) {
  size_t claimed;
  if (a->pf) {
    if (!ps__prefault_finished(a->pf)) return;
    ps__prefault_stop(a->pf, 1, 0, &claimed); /* ended: 0 */
    a->pf = NULL;
  }
  if (a->ready >= a->len || a->ready >= a->used + AHEAD / 2 || !ps__prefault_writes_nothing()) return;
  size_t from = a->ready > a->used ? a->ready : ps__rm_round_huge(a->used), to = from + AHEAD < a->len ? from + AHEAD : a->len;
  if (from >= to) return;
  a->pf = ps__prefault_start(a->base + from, to - from, a->base, a->len);
  a->ready = to; /* failed: the map's thread takes these faults, as before */
}

void ps__rm_arena_free(arena *a) {
  size_t claimed;
  if (a->pf && ps__prefault_stop(a->pf, 0, 0, &claimed) < 0) return;
  munmap(a->base, a->len);
}

void *ps__rm_arena_take(ps__rowmap *m, size_t n) {
  arena *a = m->narenas ? &m->arenas[m->narenas - 1] : NULL;
  if (!a || a->len - a->used < n) {
    size_t len = n > ARENA_BYTES ? ps__rm_round_huge(n) : ARENA_BYTES;
    arena *as = ps__realloc(m->arenas, (m->narenas + 1) * sizeof *as);
    if (!as) return NULL;
    m->arenas = as;
    char *base = ps__rm_huge_alloc(len);
    if (!base) return NULL;
    if (m->narenas && m->arenas[m->narenas - 1].pf) { /* the full arena's helper: done, or nearly */
      size_t claimed;
      ps__prefault_stop(m->arenas[m->narenas - 1].pf, 1, 0, &claimed);
      m->arenas[m->narenas - 1].pf = NULL;
    }
    a = &m->arenas[m->narenas++];
    a->base = base;
    a->len = len;
    a->used = 0;
    a->ready = 0;
    a->pf = NULL;
  }
  void *p = a->base + a->used;
  a->used += n;
  arena_ahead(a);
  return p;
}

/* ---------------------------------------------------------------- accounting */

void ps__rowmap_usage(const ps__rowmap *m, ps__rowmap_use *u) {
  u->rows = m->count;
  u->payload = m->count * m->row_bytes;
  u->keys = m->count * KEY_BYTES;
  u->index = (m->cur.cap + m->old.cap) * sizeof(uint32_t) + ps__rm_next_touched(m);
  u->total = ps__rowmap_bytes(m);
  u->spare = u->total - u->payload - u->keys - u->index;
}

size_t ps__rowmap_bytes(const ps__rowmap *m) {
  return sizeof *m + m->chunks_cap * sizeof(chunk) + m->chunk_bytes + (m->cur.cap + m->old.cap) * sizeof(uint32_t) +
         ps__rm_next_touched(m);
}

void ps__rowmap_next_state(const ps__rowmap *m, ps__rowmap_next *s) {
  s->bytes = m->next.cap * sizeof(uint32_t);
  s->faulted = m->pf ? ps__prefault_faulted(m->pf) : ps__rm_next_touched(m);
  if (s->faulted > s->bytes) s->faulted = s->bytes;
  s->own = m->own_faulted;
  s->helper = m->pf != NULL;
}

/* ---------------------------------------------------------------- views */

int ps__rowmap_view_take(const ps__rowmap *m, ps__rowmap_view *v) {
  memset(v, 0, sizeof *v);
  size_t off, nc = m->count ? locate_in(m->shift, m->count - 1, &off) + 1 : 0;
  v->n = m->count;
  v->row_floats = m->row_floats;
  v->stride = m->stride;
  v->shift = m->shift;
  v->nchunks = nc;
  v->recs = ps__malloc((nc ? nc : 1) * sizeof *v->recs);
  if (!v->recs) {
    ps__rowmap_view_free(v);
    return PS_ERR_NOMEM;
  }
  for (size_t c = 0; c < nc; c++) v->recs[c] = m->chunks[c].rec;
  return 0;
}

void ps__rowmap_view_free(ps__rowmap_view *v) {
  free(v->recs);
  memset(v, 0, sizeof *v);
}

float *ps__rowmap_view_row(const ps__rowmap_view *v, size_t i) {
  size_t off, c = locate_in(v->shift, i, &off);
  return rec_row(v->recs[c] + off * v->stride);
}

uint64_t ps__rowmap_view_key(const ps__rowmap_view *v, size_t i) {
  size_t off, c = locate_in(v->shift, i, &off);
  return rec_key(v->recs[c] + off * v->stride);
}
