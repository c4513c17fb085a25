/*
 * test_prefault.c - the next row index faulted in on a helper thread (store/prefault.c,
 * prepare() in store/rowmap.c): the helper readies the index before the growth and the
 * map's thread takes no fault of it; a starved helper, a slow step that writes the
 * index or one that only populates it, a map freed or re-reserved while the helper
 * runs, and no helper at all (its job cannot be allocated): every row is found and
 * unchanged after each, and every helper ends and frees its job.
 *
 * The maps reserve an index for 10^6 rows first (ps__rowmap_reserve), so that the next
 * index (9.1 MB, five 2 MiB steps) is made at 875,000 rows, without the growths before.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "common/fault.h"
#include "store/prefault.h"
#include "store/store.h"

#define STEP ((size_t)2 << 20)
#define RESERVED 1000000u
#define START (RESERVED - RESERVED / 16) /* where the next index is made */
#define NEXT_BYTES ((size_t)2285716 * 4) /* 2 x ceil(10^6 x 8 / 7) entries of 4 bytes */
#define NEXT_MAPPED ((size_t)5 * STEP)

static uint64_t key_of(size_t i) { return (uint64_t)i * 0x9E3779B97F4A7C15ull + (i & 1); }

static float val_of(size_t i) { return (float)(i % 1000003) + 0.25f; }

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Rows [from, to) in, one float each. */
static void insert_rows(ps__rowmap *m, size_t from, size_t to) {
  for (size_t i = from; i < to; i++) {
    float *r = ps__rowmap_upsert(m, key_of(i), NULL);
    if (!r) cr_fatal("insert %zu failed", i);
    r[0] = val_of(i);
  }
}

/* Rows from *n on until the index grows (rows start moving). */
static void insert_to_growth(ps__rowmap *m, size_t *n) {
  while (!ps__rowmap_moving(m)) {
    if (*n > RESERVED) cr_fatal("no growth by row %zu", *n);
    insert_rows(m, *n, *n + 1);
    (*n)++;
  }
}

/* Every row [0, n) found with its value, by get and by find_many, and a few absent. */
static void check_rows(const ps__rowmap *m, size_t n, const char *when) {
  enum { B = 256 };
  uint64_t keys[B];
  float *rows[B];
  cr_assert(eq(sz, ps__rowmap_count(m), n), "%s", when);
  for (size_t b = 0; b < n; b += B) {
    size_t k = n - b < B ? n - b : B;
    for (size_t j = 0; j < k; j++) keys[j] = key_of(b + j);
    ps__rowmap_find_many(m, keys, k, rows);
    for (size_t j = 0; j < k; j++)
      if (!rows[j] || rows[j][0] != val_of(b + j) || rows[j] != ps__rowmap_get(m, key_of(b + j)))
        cr_fatal("%s: row %zu of %zu", when, b + j, n);
  }
  for (size_t i = n; i < n + 100; i++)
    if (ps__rowmap_get(m, key_of(i))) cr_fatal("%s: absent row %zu found", when, i);
}

/* A map with an index for RESERVED rows, filled to START - 1: the next insert makes the
 * next index. */
static ps__rowmap *map_before_start(void) {
  ps__rowmap *m = ps__rowmap_new(1);
  cr_assert(not(zero(ptr, m)));
  cr_assert(eq(int, ps__rowmap_reserve(m, RESERVED), 0));
  insert_rows(m, 0, START - 1);
  ps__rowmap_next s;
  ps__rowmap_next_state(m, &s);
  cr_assert(eq(sz, s.bytes, 0), "no next index before 15/16 of the rows");
  return m;
}

/* Up to `secs` for the helpers of this process to end; whether they did. */
static int helpers_end(double secs) {
  double dl = now_s() + secs;
  while (ps__prefault_running() && now_s() < dl) usleep(1000);
  return ps__prefault_running() == 0;
}

/* A hook that holds the next index's helper (a job of NEXT_MAPPED bytes; the helpers
 * faulting in record arenas ahead pass) at one place (where, from its `after`-th call
 * there on) until the gate opens, 30 s at most (a test never hangs). */
static int gate_where = -1, gate_after, gate_open, gate_calls[2], gate_held;
static size_t gate_bytes = NEXT_MAPPED;
static void gate_hook(size_t bytes, int where) {
  if (bytes != gate_bytes) return;
  int call = __atomic_fetch_add(&gate_calls[where], 1, __ATOMIC_SEQ_CST);
  if (where != gate_where || call < gate_after) return;
  __atomic_store_n(&gate_held, 1, __ATOMIC_SEQ_CST);
  double dl = now_s() + 30;
  while (!__atomic_load_n(&gate_open, __ATOMIC_SEQ_CST) && now_s() < dl) usleep(500);
  __atomic_store_n(&gate_held, 0, __ATOMIC_SEQ_CST);
}

static int gate_holds(void) { return __atomic_load_n(&gate_held, __ATOMIC_SEQ_CST); }

static void gate_set(int where, int after) {
  gate_where = where;
  gate_after = after;
  ps__prefault_test_hook = gate_hook;
}

/* Up to 20 s for the helper to reach the gate (its calls there number gate_after + 1). */
static void gate_reached(void) {
  double dl = now_s() + 20;
  while (__atomic_load_n(&gate_calls[gate_where], __ATOMIC_SEQ_CST) <= gate_after && now_s() < dl) usleep(500);
  cr_assert(gt(int, __atomic_load_n(&gate_calls[gate_where], __ATOMIC_SEQ_CST), gate_after), "the helper reached the gate");
}

static void gate_release(void) { __atomic_store_n(&gate_open, 1, __ATOMIC_SEQ_CST); }

static void disarm(void) { ps__fault_disarm(); }

/* The helper faults in the next index while rows go in; the map's thread faults in none
 * of it, the growth uses it, and the helper has been joined. */
Test(prefault, the_helper_readies_the_next_index, .timeout = 60) {
  ps__rowmap *m = map_before_start();
  size_t n = START - 1;
  ps__rowmap_next s;
  insert_rows(m, n, n + 1);
  n++;
  ps__rowmap_next_state(m, &s);
  cr_assert(eq(sz, s.bytes, NEXT_BYTES));
  cr_assert(s.helper || s.faulted == s.bytes, "a helper faults it in (or has already)");
  double dl = now_s() + 20;
  do {
    usleep(1000);
    ps__rowmap_next_state(m, &s);
  } while (s.faulted < s.bytes && now_s() < dl);
  cr_assert(eq(sz, s.faulted, s.bytes), "the helper faulted the next index in");
  ps__rowmap_use u;
  ps__rowmap_usage(m, &u);
  cr_assert(ge(sz, u.index, NEXT_BYTES + NEXT_BYTES / 2), "the next index is counted");
  dl = now_s() + 20; /* the helper ends just after its last step; an insert then joins it */
  do {
    insert_rows(m, n, n + 1);
    n++;
    ps__rowmap_next_state(m, &s);
    if (s.helper) usleep(100);
  } while (s.helper && now_s() < dl && n < RESERVED - RESERVED / 64);
  cr_assert(eq(int, s.helper, 0), "the finished helper is joined at an insert");
  insert_to_growth(m, &n);
  ps__rowmap_next_state(m, &s);
  cr_assert(eq(sz, s.own, 0), "the map's thread faulted nothing in itself");
  cr_assert(eq(sz, s.bytes, 0), "the next index is in use");
  check_rows(m, n, "growth into the helper's index");
  insert_rows(m, n, n + 520000); /* the move ends (halfway to the next growth) */
  n += 520000;
  cr_assert(eq(sz, ps__rowmap_moving(m), 0));
  check_rows(m, n, "after the move");
  ps__rowmap_free(m);
}

/* A helper that stops after two steps (a starved thread): over the last 1/64 of the
 * rows the map's thread faults in the other three itself, and the growth does not wait
 * for the helper, which ends (and frees its job) when it runs again. */
Test(prefault, a_starved_helper_is_overtaken, .timeout = 60) {
  gate_set(0, 2);
  ps__rowmap *m = map_before_start();
  size_t n = START - 1;
  ps__rowmap_next s;
  insert_rows(m, n, n + 1);
  n++;
  gate_reached();
  ps__rowmap_next_state(m, &s);
  cr_assert(eq(int, s.helper, 1));
  cr_assert(eq(sz, s.faulted, 2 * STEP));
  insert_to_growth(m, &n);
  ps__rowmap_next_state(m, &s);
  cr_assert(eq(sz, s.own, NEXT_MAPPED - 2 * STEP), "the map's thread faulted in the rest");
  cr_assert(eq(int, s.helper, 0));
  check_rows(m, n, "growth past a starved helper");
  cr_assert(gate_holds(), "the helper still waits at the gate");
  gate_release();
  cr_assert(helpers_end(20), "the helper ended");
  insert_rows(m, n, n + 1000);
  n += 1000;
  check_rows(m, n, "after the helper ended");
  ps__rowmap_free(m);
}

/* A helper stuck inside a step that writes the index (no MADV_POPULATE_WRITE): the
 * growth waits 10 ms at most, then leaves that index to the helper (which unmaps it
 * when its step ends) and grows into a fresh one. */
Test(prefault, a_slow_writing_step_gives_the_index_up, .timeout = 60) {
  ps__prefault_test_write = 1;
  gate_set(1, 0);
  ps__rowmap *m = map_before_start();
  size_t n = START - 1;
  insert_rows(m, n, n + 1);
  n++;
  gate_reached();
  insert_to_growth(m, &n);
  ps__rowmap_next s;
  ps__rowmap_next_state(m, &s);
  cr_assert(eq(sz, s.own, NEXT_MAPPED - STEP), "the map's thread faulted in the other steps");
  cr_assert(eq(int, s.helper, 0));
  cr_assert(gate_holds(), "the helper is still in its step");
  check_rows(m, n, "growth into a fresh index");
  gate_release();
  cr_assert(helpers_end(20), "the helper ended");
  insert_rows(m, n, n + 300000);
  n += 300000;
  check_rows(m, n, "after the move");
  ps__rowmap_free(m);
}

/* A helper inside a step that only populates the index (MADV_POPULATE_WRITE, where the
 * kernel has it): the growth uses the index at once, and the step that ends after rows
 * went into it changes none of them. */
Test(prefault, a_populating_step_may_end_after_the_growth, .timeout = 60) {
  gate_set(1, 1);
  ps__rowmap *m = map_before_start();
  size_t n = START - 1;
  insert_rows(m, n, n + 1);
  n++;
  gate_reached();
  insert_to_growth(m, &n);
  insert_rows(m, n, n + 20000); /* rows all over the new index, the held step's pages too */
  n += 20000;
  check_rows(m, n, "before the step ends");
  gate_release();
  cr_assert(helpers_end(20), "the helper ended");
  check_rows(m, n, "after the step ended");
  insert_rows(m, n, n + 300000);
  n += 300000;
  check_rows(m, n, "after the move");
  ps__rowmap_free(m);
}

/* A map freed while its helper is between steps, or inside one: the free does not wait,
 * and the helper ends later and frees what is left to it (ASan sees any use after the
 * free or a leak). */
static void free_while_running(int where) {
  gate_set(where, 1);
  ps__rowmap *m = map_before_start();
  insert_rows(m, START - 1, START);
  gate_reached();
  double t0 = now_s();
  ps__rowmap_free(m);
  double took = now_s() - t0;
  cr_assert(gate_holds(), "the helper is still held");
  cr_assert(lt(dbl, took, 5.0), "the free did not wait for the helper (%.3f s)", took);
  gate_release();
  cr_assert(helpers_end(20), "the helper ended");
}

Test(prefault, free_while_the_helper_is_between_steps, .timeout = 60) { free_while_running(0); }
Test(prefault, free_while_the_helper_is_inside_a_step, .timeout = 60) { free_while_running(1); }
Test(prefault, free_while_a_writing_step_runs, .timeout = 60) {
  ps__prefault_test_write = 1;
  free_while_running(1);
}

/* A reserve while the helper runs drops the next index: the helper ends, the rows are
 * all in the reserved index, and a later next index gets a helper of its own. */
Test(prefault, reserve_while_the_helper_runs, .timeout = 60) {
  gate_set(0, 1);
  ps__rowmap *m = map_before_start();
  size_t n = START;
  insert_rows(m, START - 1, START);
  gate_reached();
  cr_assert(eq(int, ps__rowmap_reserve(m, 2 * RESERVED), 0));
  ps__rowmap_next s;
  ps__rowmap_next_state(m, &s);
  cr_assert(eq(sz, s.bytes, 0), "the next index was dropped");
  check_rows(m, n, "reserved while the helper ran");
  gate_release();
  cr_assert(helpers_end(20), "the helper ended");
  ps__rowmap_free(m);
}

/* No memory for the helper's job: the map's thread faults the next index in itself over
 * the last 1/64 of the rows, and the growth uses it. */
Test(prefault, no_memory_for_a_helper, .timeout = 60, .fini = disarm) {
  ps__rowmap *m = map_before_start();
  size_t n = START - 1;
  cr_assert(eq(int, ps__fault_arm("alloc:n=1+"), 0));
  insert_rows(m, n, n + 1); /* (no chunk is allocated at this row) */
  n++;
  ps__fault_disarm();
  ps__rowmap_next s;
  ps__rowmap_next_state(m, &s);
  cr_assert(eq(sz, s.bytes, NEXT_BYTES), "the next index is made");
  cr_assert(eq(int, s.helper, 0), "without a helper");
  insert_rows(m, n, RESERVED - RESERVED / 64);
  n = RESERVED - RESERVED / 64;
  ps__rowmap_next_state(m, &s);
  cr_assert(eq(sz, s.faulted, 0), "nothing faulted in before the last 1/64");
  insert_to_growth(m, &n);
  ps__rowmap_next_state(m, &s);
  cr_assert(eq(sz, s.own, NEXT_BYTES), "the map's thread faulted it all in");
  check_rows(m, n, "growth without a helper");
  ps__rowmap_free(m);
}

/* Records: a helper faults in the 8 MiB of the record arena after the chunks in use
 * (where the kernel has MADV_POPULATE_WRITE), so pages no row has reached yet are
 * resident. Rows go in a chunk (2^17 rows) at a time, the helpers left to end between
 * chunks. */
Test(prefault, record_arenas_are_faulted_in_ahead, .timeout = 60) {
  if (!ps__prefault_writes_nothing()) cr_skip_test("no MADV_POPULATE_WRITE");
  ps__rowmap *m = ps__rowmap_new(1);
  size_t n = 0;
  for (int c = 0; c < 6; c++) {
    insert_rows(m, n, n + (1u << 17));
    n += 1u << 17;
    cr_assert(helpers_end(20), "the helpers ended");
  }
  check_rows(m, n, "rows in arenas faulted in ahead");
  uintptr_t last = (uintptr_t)ps__rowmap_row_at(m, n - 1), huge = (uintptr_t)2 << 20;
  uintptr_t ahead = (last + huge - 1) / huge * huge + huge; /* within 4 MiB after the last row */
  unsigned char vec[8];
  cr_assert(eq(int, mincore((void *)ahead, 8 * 4096, vec), 0));
  for (int i = 0; i < 8; i++) cr_assert(eq(int, vec[i] & 1, 1), "page %d ahead of the rows is resident", i);
  ps__rowmap_free(m);
}

/* A map freed while an arena's helper is inside a step: the helper unmaps the arena
 * when its step ends. */
Test(prefault, free_while_an_arena_helper_is_inside_a_step, .timeout = 60) {
  if (!ps__prefault_writes_nothing()) cr_skip_test("no MADV_POPULATE_WRITE");
  gate_bytes = (size_t)8 << 20;
  gate_set(1, 0);
  ps__rowmap *m = ps__rowmap_new(1);
  insert_rows(m, 0, 1u << 17); /* the first large chunks, from an arena */
  gate_reached();
  ps__rowmap_free(m);
  cr_assert(gate_holds(), "the helper is still held");
  gate_release();
  cr_assert(helpers_end(20), "the helper ended");
}
