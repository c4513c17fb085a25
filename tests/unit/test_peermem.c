/*
 * test_peermem.c - peer-memory transfers (src/net/peermem.c): descriptor validation,
 * copies between local regions and a process's regions, and the mapping check.
 *
 * Most copies address this test's own process (getpid()): the "remote" regions are
 * slices of one arena, placed at odd offsets with sentinel gaps between them and in
 * reverse order, so that a copy that strays or reorders shows up. Every copy is compared,
 * arena against arena, with a reference done by plain memcpy, which also checks that
 * nothing outside the regions changed. The cross-process tests fork a child that holds
 * a buffer allocated before the fork (so at the same address) and waits on a pipe; the
 * child also exits on its own when the pipe closes, when its parent dies, or after an
 * alarm, and every wait for it is bounded.
 *
 * Every test has the same timeout: Criterion 2.4.1's runner, running tests in parallel,
 * leaks a 48-byte timeout entry (LeakSanitizer fails the run) when a test with a shorter
 * timeout starts while one with a longer timeout still runs.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/utsname.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "common/common.h"
#include "net/net.h"
#include "proto/frame.h"
#include "pshard.h"
#include "pm_test.h"

/* ---------------------------------------------------------------- regions in an arena */

#define GAP 7          /* sentinel bytes around every region */
#define SENTINEL 0xa5

typedef struct layout {
  uint8_t *arena;
  size_t size;    /* of the arena */
  size_t n;       /* regions */
  size_t *at;     /* region k starts at arena + at[k] */
  size_t *len;
  size_t total;   /* sum of len */
} layout;

/* n regions whose sizes cycle through cyc[], cut so that they sum to `target` exactly
 * (the last one shortened; SIZE_MAX for no cut). Placed at odd offsets with sentinel
 * gaps, region 0 last in memory when `reverse`; their bytes hold pat(seed, position in
 * the concatenation). */
static void layout_make(layout *l, const size_t *cyc, size_t ncyc, size_t n, size_t target, int reverse,
                        unsigned seed) {
  memset(l, 0, sizeof *l);
  l->at = calloc(n ? n : 1, sizeof *l->at);
  l->len = calloc(n ? n : 1, sizeof *l->len);
  cr_assert(l->at && l->len);
  for (size_t k = 0; k < n && l->total < target; k++) {
    size_t len = cyc[k % ncyc];
    if (len > target - l->total) len = target - l->total;
    l->len[k] = len;
    l->total += len;
    l->n = k + 1;
  }
  cr_assert(target == SIZE_MAX || l->total == target, "cannot make %zu bytes of %zu regions", target, n);
  l->size = 1 + l->total + (l->n + 1) * GAP;
  l->arena = malloc(l->size);
  cr_assert(l->arena != NULL);
  memset(l->arena, SENTINEL, l->size);
  size_t p = 1 + GAP;
  for (size_t i = 0; i < l->n; i++) {
    size_t k = reverse ? l->n - 1 - i : i;
    l->at[k] = p;
    p += l->len[k] + GAP;
  }
  size_t pos = 0;
  for (size_t k = 0; k < l->n; k++)
    for (size_t b = 0; b < l->len[k]; b++) l->arena[l->at[k] + b] = pat(seed, pos++);
}

static void layout_free(layout *l) {
  free(l->arena);
  free(l->at);
  free(l->len);
  memset(l, 0, sizeof *l);
}

static uv_buf_t *layout_bufs(const layout *l) {
  uv_buf_t *v = calloc(l->n ? l->n : 1, sizeof *v);
  cr_assert(v != NULL);
  for (size_t k = 0; k < l->n; k++) {
    v[k].base = (char *)l->arena + l->at[k];
    v[k].len = l->len[k];
  }
  return v;
}

static void layout_descs(const layout *l, descs *s) {
  for (size_t k = 0; k < l->n; k++) descs_add(s, (uint64_t)(uintptr_t)(l->arena + l->at[k]), l->len[k]);
}

static size_t count_nonempty(const layout *l) {
  size_t c = 0;
  for (size_t k = 0; k < l->n; k++) c += l->len[k] != 0;
  return c;
}

/* The reference: the same transfer, by memcpy, one piece at a time, between copies of
 * the two arenas (with the same offsets). Returns the bytes moved. */
static size_t ref_copy(int write, const layout *loc, uint8_t *lref, const layout *rem, uint8_t *rref, uint64_t off) {
  size_t li = 0, lo = 0, ri = 0, moved = 0;
  uint64_t ro = off;
  while (ri < rem->n && ro >= rem->len[ri]) ro -= rem->len[ri++];
  for (;;) {
    while (li < loc->n && lo == loc->len[li]) li++, lo = 0;
    if (li == loc->n || ri == rem->n) return moved;
    size_t step = loc->len[li] - lo;
    if (step > rem->len[ri] - ro) step = (size_t)(rem->len[ri] - ro);
    uint8_t *lp = lref + loc->at[li] + lo, *rp = rref + rem->at[ri] + ro;
    if (write)
      memcpy(rp, lp, step);
    else
      memcpy(lp, rp, step);
    moved += step, lo += step, ro += step;
    if (ro == rem->len[ri]) ri++, ro = 0;
  }
}

static void expect_same(const uint8_t *got, const uint8_t *want, size_t n, const layout *l, const char *what) {
  if (!memcmp(got, want, n)) return;
  size_t i = 0;
  while (got[i] == want[i]) i++;
  size_t k = 0;
  while (k < l->n && !(i >= l->at[k] && i < l->at[k] + l->len[k])) k++;
  if (k < l->n)
    cr_fatal("%s: byte %zu of region %zu (of %zu, %zu bytes) is %#x, expected %#x", what, i - l->at[k], k, l->n,
                   l->len[k], got[i], want[i]);
  cr_fatal("%s: arena byte %zu outside every region changed to %#x (was %#x)", what, i, got[i], want[i]);
}

static uint64_t copy_until_ms; /* the deadline check_copy passes (0 = none) */
static int copy_self;           /* check_copy passes PS_PM_SELF instead of getpid() */

/* Copy between local regions of sizes lcyc (cut to `ltotal` bytes, at most nl regions)
 * and remote regions of sizes rcyc (nr regions) of this process, from byte off of the
 * remote concatenation, and compare both arenas with the memcpy reference. */
static void check_copy(int write, const size_t *lcyc, size_t nlcyc, size_t nl, size_t ltotal, const size_t *rcyc,
                       size_t nrcyc, size_t nr, uint64_t off) {
  layout loc, rem;
  layout_make(&rem, rcyc, nrcyc, nr, SIZE_MAX, 1, 1);
  cr_assert(le(u64, off, rem.total), "off %llu beyond the %zu remote bytes", (unsigned long long)off, rem.total);
  if (ltotal == SIZE_MAX) ltotal = rem.total - (size_t)off;
  layout_make(&loc, lcyc, nlcyc, nl, ltotal, 0, 2);
  uint8_t *lref = malloc(loc.size), *rref = malloc(rem.size);
  cr_assert(lref && rref);
  memcpy(lref, loc.arena, loc.size);
  memcpy(rref, rem.arena, rem.size);
  size_t moved = ref_copy(write, &loc, lref, &rem, rref, off);
  cr_assert(eq(sz, moved, loc.total), "test setup: the remote side must cover the local one");

  uv_buf_t *v = layout_bufs(&loc);
  descs d = {0};
  layout_descs(&rem, &d);
  OK(ps__pm_copy(copy_self ? PS_PM_SELF : (int)getpid(), write, v, (unsigned)loc.n, d.d, d.n, off, copy_until_ms));
  expect_same(loc.arena, lref, loc.size, &loc, write ? "local side after a write" : "local side after a read");
  expect_same(rem.arena, rref, rem.size, &rem, write ? "remote side after a write" : "remote side after a read");

  free(v);
  descs_free(&d);
  free(lref);
  free(rref);
  layout_free(&loc);
  layout_free(&rem);
}

/* Misaligned sizes, some large; the local list has empty regions too. */
static const size_t RCYC[] = {1, 3, 4095, 70000, 4096, 2, 65537, 5, 4097, 11};
static const size_t LCYC[] = {3, 0, 4095, 1, 70000, 0, 0, 7, 65535, 4097, 2, 0, 13};
#define NRCYC (sizeof RCYC / sizeof RCYC[0])
#define NLCYC (sizeof LCYC / sizeof LCYC[0])

/* ---------------------------------------------------------------- ps__pm_descs_check */

Test(pm_descs, sums_valid_lists, .timeout = 120) {
  descs d = {0};
  uint64_t total = 12345;
  OK(ps__pm_descs_check(NULL, 0, &total));
  cr_assert(eq(u64, total, 0));
  descs_add(&d, 0x1000, 1);
  descs_add(&d, 0x7fff00000003, 4095);
  descs_add(&d, 0x10, 70000);
  descs_add(&d, UINT64_MAX - 5, 5); /* ends exactly at the top */
  OK(ps__pm_descs_check(d.d, d.n, &total));
  cr_assert(eq(u64, total, 1 + 4095 + 70000 + 5));
  /* two of the largest regions allowed still sum without overflow */
  descs_free(&d);
  descs_add(&d, 1, (uint64_t)SSIZE_MAX);
  descs_add(&d, 1, (uint64_t)SSIZE_MAX);
  OK(ps__pm_descs_check(d.d, d.n, &total));
  cr_assert(eq(u64, total, 2 * (uint64_t)SSIZE_MAX));
  descs_free(&d);
}

/* Regions 0 and 1 valid, region 2 bad as given: PS_ERR_PROTO, a message naming region
 * 2, and *total untouched. */
static void check_bad_third(uint64_t addr, uint64_t len, uint64_t len01) {
  descs d = {0};
  descs_add(&d, 0x1000, len01);
  descs_add(&d, 0x2000, len01);
  descs_add(&d, addr, len);
  uint64_t total = 777;
  FAILS(PS_ERR_PROTO, ps__pm_descs_check(d.d, d.n, &total));
  cr_assert(eq(u64, total, 777));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "region 2"), NULL)), "message: %s", ps_errmsg());
  descs_free(&d);
}

Test(pm_descs, rejects_bad_regions, .timeout = 120) {
  check_bad_third(0x3000, 0, 8);                              /* zero length */
  check_bad_third(0, 64, 8);                                  /* null address */
  check_bad_third(UINT64_MAX - 10, 100, 8);                   /* address + length overflows */
  check_bad_third(UINT64_MAX, 1, 8);                          /* the same, by one */
  check_bad_third(0x3000, (uint64_t)SSIZE_MAX + 1, 8);        /* longer than a copy can be */
  check_bad_third(1, (uint64_t)SSIZE_MAX, (uint64_t)SSIZE_MAX); /* total overflows */
}

Test(pm_descs, message_names_the_region, .timeout = 120) {
  descs d = {0};
  descs_add(&d, 0xabc000, 0);
  uint64_t total;
  FAILS(PS_ERR_PROTO, ps__pm_descs_check(d.d, d.n, &total));
  const char *m = ps_errmsg();
  cr_assert(not(eq(ptr, strstr(m, "region 0"), NULL)), "message: %s", m);
  cr_assert(not(eq(ptr, strstr(m, "0xabc000"), NULL)), "message: %s", m);
  descs_free(&d);
}

/* ---------------------------------------------------------------- ps__pm_copy in this process */

Test(pm_copy, read_many_regions, .timeout = 120) {
  layout probe;
  layout_make(&probe, LCYC, NLCYC, 100000, 1929011, 0, 0);
  cr_assert(gt(sz, count_nonempty(&probe), 64)); /* more than one batch on the local side */
  layout_free(&probe);
  check_copy(0, LCYC, NLCYC, 100000, SIZE_MAX, RCYC, NRCYC, 130, 0);
}

Test(pm_copy, write_many_regions, .timeout = 120) { check_copy(1, LCYC, NLCYC, 100000, SIZE_MAX, RCYC, NRCYC, 130, 0); }

/* Many tiny regions on both sides: each batch of 64 covers only a few bytes. */
Test(pm_copy, tiny_regions, .timeout = 120) {
  static const size_t l[] = {1, 0, 2, 1, 0, 0, 3};
  static const size_t r[] = {3, 1, 1, 2};
  for (int w = 0; w < 2; w++) check_copy(w, l, 7, 100000, SIZE_MAX, r, 4, 1000, 0);
  /* one large local region against many small remote ones, and the reverse */
  static const size_t big[] = {1u << 20};
  static const size_t small[] = {4095, 1, 3};
  for (int w = 0; w < 2; w++) {
    check_copy(w, big, 1, 1, 1u << 20, small, 3, 768, 700); /* 768 regions hold 1049344 bytes */
    check_copy(w, small, 3, 100000, SIZE_MAX, big, 1, 1, 0);
  }
}

/* Local regions that are all empty copy nothing, whatever the remote side. */
Test(pm_copy, empty_local_side, .timeout = 120) {
  layout rem;
  layout_make(&rem, RCYC, NRCYC, 20, SIZE_MAX, 1, 1);
  uint8_t *before = malloc(rem.size);
  cr_assert(before != NULL);
  memcpy(before, rem.arena, rem.size);
  descs d = {0};
  layout_descs(&rem, &d);
  char dummy = 'x';
  uv_buf_t e[100];
  for (int k = 0; k < 100; k++) e[k] = uv_buf_init(&dummy, 0);
  const uint64_t offs[] = {0, 1, 4, rem.total - 1, rem.total, rem.total + 100};
  for (int w = 0; w < 2; w++)
    for (size_t i = 0; i < sizeof offs / sizeof offs[0]; i++) {
      OK(ps__pm_copy((int)getpid(), w, e, 100, d.d, d.n, offs[i], 0));
      OK(ps__pm_copy((int)getpid(), w, e, 0, d.d, d.n, offs[i], 0));
      OK(ps__pm_copy((int)getpid(), w, e, 100, NULL, 0, offs[i], 0)); /* no remote regions at all */
    }
  cr_assert(eq(int, memcmp(before, rem.arena, rem.size), 0));
  cr_assert(eq(chr, dummy, 'x'));
  free(before);
  descs_free(&d);
  layout_free(&rem);
}

/* Runs of more than a batch of empty local regions, before, between and after data. */
Test(pm_copy, runs_of_empty_local_regions, .timeout = 120) {
  size_t cyc[400];
  for (size_t k = 0; k < 400; k++) cyc[k] = k < 150 || (k >= 160 && k < 300) ? 0 : 1 + k % 5 * 1000;
  for (int w = 0; w < 2; w++) {
    check_copy(w, cyc, 400, 400, SIZE_MAX, RCYC, NRCYC, 3, 2);   /* ends inside the 2nd non-empty run */
    check_copy(w, cyc, 400, 100000, SIZE_MAX, RCYC, NRCYC, 100, 0);
  }
}

/* off: inside a region, exactly at each boundary, past many regions (more than a batch),
 * in the last region, and at the very end with nothing to copy. */
Test(pm_copy, from_an_offset, .timeout = 120) {
  size_t sum70 = 0;
  for (size_t k = 0; k < 70; k++) sum70 += RCYC[k % NRCYC];
  size_t total = 0;
  for (size_t k = 0; k < 130; k++) total += RCYC[k % NRCYC];
  const uint64_t offs[] = {1, 2, 4, 5, 4099, 4099 + 1, 4099 + 35000, 4099 + 70000, 4099 + 70000 + 4096 - 1,
                           sum70, sum70 - 1, sum70 + 1, sum70 + 17, total - 11, total - 1, total};
  for (size_t i = 0; i < sizeof offs / sizeof offs[0]; i++)
    for (int w = 0; w < 2; w++) {
      check_copy(w, LCYC, NLCYC, 100000, SIZE_MAX, RCYC, NRCYC, 130, offs[i]); /* to the end */
      size_t rest = total - (size_t)offs[i];
      check_copy(w, LCYC, NLCYC, 100000, rest > 200000 ? 200000 : rest / 2, RCYC, NRCYC, 130, offs[i]);
    }
}

/* Regions larger than one system call moves (8 MiB), on either side or both. */
Test(pm_copy, regions_larger_than_one_call, .timeout = 120) {
  static const size_t l[] = {(20u << 20) + 3, 5, (9u << 20) - 1};
  static const size_t r[] = {(7u << 20) + 1, 3, (12u << 20) + 5, 1};
  static const size_t one[] = {(30u << 20) + 11};
  for (int w = 0; w < 2; w++) {
    check_copy(w, l, 3, 3, SIZE_MAX, r, 4, 6, 0);
    check_copy(w, l, 3, 3, SIZE_MAX, r, 4, 6, (7u << 20) - 5);
    check_copy(w, one, 1, 1, one[0], r, 4, 8, 2);              /* remote longer */
    check_copy(w, l, 3, 3, l[0] + l[1] + l[2], one, 1, 1, 4);
    check_copy(w, RCYC, NRCYC, 100000, SIZE_MAX, one, 1, 1, 0); /* many small local regions */
  }
}

/* PS_PM_SELF (a colocated worker's regions, copied with memcpy) moves exactly what the
 * system call moves, for the layouts above: many regions, tiny ones, offsets, regions
 * larger than one call; and it keeps the deadline. */
Test(pm_copy, self_copies_like_the_system_call, .timeout = 120) {
  copy_self = 1;
  static const size_t l[] = {1, 0, 2, 1, 0, 0, 3};
  static const size_t r[] = {3, 1, 1, 2};
  static const size_t big[] = {(9u << 20) + 3, 5};
  for (int w = 0; w < 2; w++) {
    check_copy(w, LCYC, NLCYC, 100000, SIZE_MAX, RCYC, NRCYC, 130, 0);
    check_copy(w, LCYC, NLCYC, 100000, 200000, RCYC, NRCYC, 130, 4099 + 35000);
    check_copy(w, l, 7, 100000, SIZE_MAX, r, 4, 1000, 0);
    check_copy(w, big, 2, 2, SIZE_MAX, RCYC, NRCYC, 400, 1);
    check_copy(w, RCYC, NRCYC, 100000, SIZE_MAX, big, 2, 2, 0);
  }
  layout loc, rem;
  layout_make(&rem, RCYC, NRCYC, 10, SIZE_MAX, 1, 1);
  layout_make(&loc, LCYC, NLCYC, 100, rem.total, 0, 2);
  uint8_t *before = malloc(loc.size);
  cr_assert(before != NULL);
  memcpy(before, loc.arena, loc.size);
  uv_buf_t *v = layout_bufs(&loc);
  descs d = {0};
  layout_descs(&rem, &d);
  FAILS(PS_ERR_TIMEOUT, ps__pm_copy(PS_PM_SELF, 0, v, (unsigned)loc.n, d.d, d.n, 0, 1));
  cr_assert(eq(int, memcmp(before, loc.arena, loc.size), 0), "an expired copy moved bytes");
  free(v);
  free(before);
  descs_free(&d);
  layout_free(&loc);
  layout_free(&rem);
  copy_self = 0;
}

/* A deadline still ahead changes nothing; one passed fails before anything moves. */
Test(pm_copy, deadline, .timeout = 120) {
  copy_until_ms = ps__now_ms() + 3600 * 1000;
  for (int w = 0; w < 2; w++) check_copy(w, LCYC, NLCYC, 100000, SIZE_MAX, RCYC, NRCYC, 130, 17);
  copy_until_ms = 0;

  layout loc, rem;
  layout_make(&rem, RCYC, NRCYC, 130, SIZE_MAX, 1, 1);
  layout_make(&loc, LCYC, NLCYC, 100000, rem.total, 0, 2);
  uint8_t *lref = malloc(loc.size), *rref = malloc(rem.size);
  cr_assert(lref && rref);
  memcpy(lref, loc.arena, loc.size);
  memcpy(rref, rem.arena, rem.size);
  uv_buf_t *v = layout_bufs(&loc);
  descs d = {0};
  layout_descs(&rem, &d);
  const uint64_t past[] = {1, ps__now_ms()};
  for (int w = 0; w < 2; w++)
    for (int k = 0; k < 2; k++) {
      FAILS(PS_ERR_TIMEOUT, ps__pm_copy((int)getpid(), w, v, (unsigned)loc.n, d.d, d.n, 0, past[k]));
      cr_assert(not(eq(ptr, strstr(ps_errmsg(), "expired"), NULL)), "message: %s", ps_errmsg());
    }
  expect_same(loc.arena, lref, loc.size, &loc, "local side after an expired copy");
  expect_same(rem.arena, rref, rem.size, &rem, "remote side after an expired copy");
  /* nothing to copy is not an error, deadline or not */
  char c = 0;
  uv_buf_t e = uv_buf_init(&c, 0);
  OK(ps__pm_copy((int)getpid(), 0, &e, 1, d.d, d.n, 0, 1));
  free(v);
  descs_free(&d);
  free(lref);
  free(rref);
  layout_free(&loc);
  layout_free(&rem);
}

/* The remote side may be longer than the local one: as many bytes as the local regions
 * hold are copied and (for a write) nothing after them changes. */
Test(pm_copy, remote_longer_is_fine, .timeout = 120) {
  for (int w = 0; w < 2; w++) {
    check_copy(w, LCYC, NLCYC, 100000, 1, RCYC, NRCYC, 130, 0);
    check_copy(w, LCYC, NLCYC, 100000, 100000, RCYC, NRCYC, 130, 0);
    check_copy(w, LCYC, NLCYC, 100000, 1000000, RCYC, NRCYC, 130, 3);
  }
}

/* The remote side shorter than the local one (from off): PS_ERR_SIZE. */
Test(pm_copy, remote_shorter_fails, .timeout = 120) {
  layout loc, rem;
  layout_make(&rem, RCYC, NRCYC, 130, SIZE_MAX, 1, 1);
  descs d = {0};
  layout_descs(&rem, &d);
  const uint64_t offs[] = {0, 1, 4, rem.total - 1, rem.total, rem.total + 1, UINT64_MAX};
  for (size_t i = 0; i < sizeof offs / sizeof offs[0]; i++) {
    size_t avail = offs[i] >= rem.total ? 0 : rem.total - (size_t)offs[i];
    layout_make(&loc, LCYC, NLCYC, 100000, avail + 1, 0, 2);
    uv_buf_t *v = layout_bufs(&loc);
    for (int w = 0; w < 2; w++) {
      FAILS(PS_ERR_SIZE, ps__pm_copy((int)getpid(), w, v, (unsigned)loc.n, d.d, d.n, offs[i], 0));
      cr_assert(gt(sz, strlen(ps_errmsg()), 0));
    }
    free(v);
    layout_free(&loc);
  }
  /* no remote regions at all */
  char one = 0;
  uv_buf_t b = uv_buf_init(&one, 1);
  FAILS(PS_ERR_SIZE, ps__pm_copy((int)getpid(), 0, &b, 1, NULL, 0, 0, 0));
  FAILS(PS_ERR_SIZE, ps__pm_copy((int)getpid(), 1, &b, 1, NULL, 0, 0, 0));
  descs_free(&d);
  layout_free(&rem);
}

/* ---------------------------------------------------------------- bad addresses */


static uint8_t *map_pages(size_t n, int prot) {
  void *p = mmap(NULL, n * page_size(), prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  cr_assert(not(eq(ptr, p, MAP_FAILED)), "mmap: %s", strerror(errno));
  return p;
}

static void expect_io_message(int write, int pid) {
  char want[96];
  snprintf(want, sizeof want, "cannot %s the memory of process %d", write ? "write" : "read", pid);
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), want), NULL)), "message: %s", ps_errmsg());
}

Test(pm_copy, unmapped_address_fails, .timeout = 120) {
  size_t pg = page_size();
  uint8_t *p = map_pages(3, PROT_READ | PROT_WRITE);
  memset(p, 1, 3 * pg);
  cr_assert(eq(int, munmap(p + pg, pg), 0));
  uint8_t buf[300];
  uv_buf_t v[2] = {uv_buf_init((char *)buf, 100), uv_buf_init((char *)buf + 100, 200)};
  int pid = (int)getpid();

  /* wholly inside the hole */
  descs d = {0};
  descs_add(&d, (uint64_t)(uintptr_t)(p + pg + 5), 300);
  for (int w = 0; w < 2; w++) {
    FAILS(PS_ERR_IO, ps__pm_copy(pid, w, v, 2, d.d, d.n, 0, 0));
    expect_io_message(w, pid);
  }
  descs_free(&d);

  /* valid regions first, then one that starts valid and runs into the hole: the
   * function fails (part may have moved) */
  descs_add(&d, (uint64_t)(uintptr_t)(p + 10), 50);
  descs_add(&d, (uint64_t)(uintptr_t)(p + pg - 100), 250);
  for (int w = 0; w < 2; w++) {
    FAILS(PS_ERR_IO, ps__pm_copy(pid, w, v, 2, d.d, d.n, 0, 0));
    expect_io_message(w, pid);
  }
  /* the same list from an offset past the good region */
  for (int w = 0; w < 2; w++) FAILS(PS_ERR_IO, ps__pm_copy(pid, w, v, 1, d.d, d.n, 60, 0));
  /* but stopping before the hole is fine */
  uv_buf_t fit = uv_buf_init((char *)buf, 150);
  OK(ps__pm_copy(pid, 0, &fit, 1, d.d, d.n, 0, 0));
  cr_assert(eq(u8, buf[149], 1));
  OK(ps__pm_copy(pid, 1, &fit, 1, d.d, d.n, 0, 0));
  descs_free(&d);

  /* the bad region comes after more than a batch of good ones */
  layout rem;
  layout_make(&rem, RCYC, NRCYC, 130, SIZE_MAX, 1, 1);
  layout_descs(&rem, &d);
  descs_add(&d, (uint64_t)(uintptr_t)(p + 2 * pg), 20); /* the third page is fine... */
  descs_add(&d, (uint64_t)(uintptr_t)(p + pg), 20);     /* ...the second is not */
  uint8_t *big = malloc(rem.total + 40);
  cr_assert(big != NULL);
  uv_buf_t bv = uv_buf_init((char *)big, (unsigned)(rem.total + 40));
  for (int w = 0; w < 2; w++) {
    FAILS(PS_ERR_IO, ps__pm_copy(pid, w, &bv, 1, d.d, d.n, 0, 0));
    expect_io_message(w, pid);
  }
  free(big);
  layout_free(&rem);
  descs_free(&d);
  munmap(p, pg);
  munmap(p + 2 * pg, pg);
}

/* A read-only page can be read from but not written to. */
Test(pm_copy, read_only_page, .timeout = 120) {
  size_t pg = page_size();
  uint8_t *p = map_pages(1, PROT_READ | PROT_WRITE);
  memset(p, 0x3c, pg);
  cr_assert(eq(int, mprotect(p, pg, PROT_READ), 0));
  uint8_t buf[64];
  memset(buf, 0, sizeof buf);
  uv_buf_t v = uv_buf_init((char *)buf, sizeof buf);
  descs d = {0};
  descs_add(&d, (uint64_t)(uintptr_t)(p + 100), 64);
  OK(ps__pm_copy((int)getpid(), 0, &v, 1, d.d, d.n, 0, 0));
  cr_assert(eq(u8, buf[0], 0x3c));
  cr_assert(eq(u8, buf[63], 0x3c));
  FAILS(PS_ERR_IO, ps__pm_copy((int)getpid(), 1, &v, 1, d.d, d.n, 0, 0));
  expect_io_message(1, (int)getpid());
  cr_assert(eq(u8, p[100], 0x3c));
  descs_free(&d);
  munmap(p, pg);
}

/* ---------------------------------------------------------------- ps__pm_mapped */

/* Each case runs the way ps__pm_mapped picks on this kernel (PROCMAP_QUERY from Linux
 * 6.11) and again from the text of /proc/pid/maps, the way of older kernels. */
typedef int (*mapped_fn)(int pid, int write, const uint8_t *d, size_t nd);

static int mapped1(mapped_fn mapped, int pid, int write, const void *addr, uint64_t len) {
  descs d = {0};
  descs_add(&d, (uint64_t)(uintptr_t)addr, len);
  int rc = mapped(pid, write, d.d, d.n);
  descs_free(&d);
  return rc;
}

static void heap_stack_and_mmap_regions(mapped_fn mapped) {
  int pid = (int)getpid();
  uint8_t stack[1000];
  memset(stack, 0, sizeof stack);
  uint8_t *small = malloc(100), *large = malloc(8u << 20);
  cr_assert(small && large);
  uint8_t *m = map_pages(4, PROT_READ | PROT_WRITE);
  for (int w = 0; w < 2; w++) {
    OK(mapped1(mapped, pid, w, stack, sizeof stack));
    OK(mapped1(mapped, pid, w, small, 100));
    OK(mapped1(mapped, pid, w, large, 8u << 20));
    OK(mapped1(mapped, pid, w, m, 4 * page_size()));
    OK(mapped1(mapped, pid, w, m + 1, 4 * page_size() - 1));
    descs d = {0};
    descs_add(&d, (uint64_t)(uintptr_t)large + 5, 1);
    descs_add(&d, (uint64_t)(uintptr_t)stack, sizeof stack);
    descs_add(&d, (uint64_t)(uintptr_t)m + 3, 3);
    descs_add(&d, (uint64_t)(uintptr_t)small, 100);
    OK(mapped(pid, w, d.d, d.n));
    descs_free(&d);
  }
  OK(mapped(pid, 0, NULL, 0));
  free(small);
  free(large);
  munmap(m, 4 * page_size());
}

static void hole_in_the_middle(mapped_fn mapped) {
  int pid = (int)getpid();
  size_t pg = page_size();
  uint8_t *p = map_pages(3, PROT_READ | PROT_WRITE);
  OK(mapped1(mapped, pid, 0, p, 3 * pg));
  cr_assert(eq(int, munmap(p + pg, pg), 0));
  for (int w = 0; w < 2; w++) {
    FAILS(PS_ERR_IO, mapped1(mapped, pid, w, p, 3 * pg));
    char want[64];
    snprintf(want, sizeof want, "[%#llx, %#llx)", (unsigned long long)(uintptr_t)p,
             (unsigned long long)(uintptr_t)(p + 3 * pg));
    cr_assert(not(eq(ptr, strstr(ps_errmsg(), want), NULL)), "message: %s (wanted %s)", ps_errmsg(), want);
    FAILS(PS_ERR_IO, mapped1(mapped, pid, w, p + pg - 1, 2));   /* one byte into the hole */
    FAILS(PS_ERR_IO, mapped1(mapped, pid, w, p + pg + 10, 1));  /* inside it */
    FAILS(PS_ERR_IO, mapped1(mapped, pid, w, p + 2 * pg - 1, 2)); /* from its last byte */
    OK(mapped1(mapped, pid, w, p, pg));                          /* the pages either side are fine */
    OK(mapped1(mapped, pid, w, p + 2 * pg, pg));
    /* a good list with one bad region, last */
    descs d = {0};
    descs_add(&d, (uint64_t)(uintptr_t)p, pg);
    descs_add(&d, (uint64_t)(uintptr_t)(p + 2 * pg), pg);
    OK(mapped(pid, w, d.d, d.n));
    descs_add(&d, (uint64_t)(uintptr_t)(p + 10), 2 * pg);
    FAILS(PS_ERR_IO, mapped(pid, w, d.d, d.n));
    descs_free(&d);
  }
  munmap(p, pg);
  munmap(p + 2 * pg, pg);
}

static void read_only_mapping(mapped_fn mapped) {
  int pid = (int)getpid();
  size_t pg = page_size();
  uint8_t *p = map_pages(2, PROT_READ);
  OK(mapped1(mapped, pid, 0, p, 2 * pg));
  FAILS(PS_ERR_IO, mapped1(mapped, pid, 1, p, 2 * pg));
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "writable"), NULL)), "message: %s", ps_errmsg());
  FAILS(PS_ERR_IO, mapped1(mapped, pid, 1, p + 7, 1));
  munmap(p, 2 * pg);

  /* rw, r, rw pages in one mapping: readable throughout (adjacent mappings join), but
   * only the outer pages are writable */
  p = map_pages(3, PROT_READ | PROT_WRITE);
  cr_assert(eq(int, mprotect(p + pg, pg, PROT_READ), 0));
  OK(mapped1(mapped, pid, 0, p, 3 * pg));
  FAILS(PS_ERR_IO, mapped1(mapped, pid, 1, p, 3 * pg));
  FAILS(PS_ERR_IO, mapped1(mapped, pid, 1, p + pg - 1, 2));
  OK(mapped1(mapped, pid, 1, p, pg));
  OK(mapped1(mapped, pid, 1, p + 2 * pg, pg));
  /* no access at all */
  cr_assert(eq(int, mprotect(p + pg, pg, PROT_NONE), 0));
  FAILS(PS_ERR_IO, mapped1(mapped, pid, 0, p, 3 * pg));
  FAILS(PS_ERR_IO, mapped1(mapped, pid, 0, p + pg, 1));
  munmap(p, 3 * pg);
}

Test(pm_mapped, heap_stack_and_mmap_regions, .timeout = 120) { heap_stack_and_mmap_regions(ps__pm_mapped); }
Test(pm_mapped_text, heap_stack_and_mmap_regions, .timeout = 120) { heap_stack_and_mmap_regions(ps__pm_mapped_text); }

Test(pm_mapped, hole_in_the_middle, .timeout = 120) { hole_in_the_middle(ps__pm_mapped); }
Test(pm_mapped_text, hole_in_the_middle, .timeout = 120) { hole_in_the_middle(ps__pm_mapped_text); }

Test(pm_mapped, read_only_mapping, .timeout = 120) { read_only_mapping(ps__pm_mapped); }
Test(pm_mapped_text, read_only_mapping, .timeout = 120) { read_only_mapping(ps__pm_mapped_text); }

/* From Linux 6.11 on the check must not fall back to reading the text: PROCMAP_QUERY
 * answers, for a good region and for a bad one. */
Test(pm_mapped_query, answers_from_linux_6_11, .timeout = 120) {
  struct utsname u;
  unsigned major = 0, minor = 0;
  cr_assert(eq(int, uname(&u), 0));
  if (sscanf(u.release, "%u.%u", &major, &minor) != 2 || major < 6 || (major == 6 && minor < 11))
    cr_skip_test("kernel %s has no PROCMAP_QUERY", u.release);
  int pid = (int)getpid();
  size_t pg = page_size();
  uint8_t *p = map_pages(3, PROT_READ | PROT_WRITE);
  cr_assert(eq(int, mprotect(p + pg, pg, PROT_READ), 0));
  OK(mapped1(ps__pm_mapped_query, pid, 0, p, 3 * pg));
  OK(mapped1(ps__pm_mapped_query, pid, 1, p + 2 * pg, pg));
  FAILS(PS_ERR_IO, mapped1(ps__pm_mapped_query, pid, 1, p, 3 * pg));
  munmap(p, 3 * pg);
  FAILS(PS_ERR_IO, mapped1(ps__pm_mapped_query, pid, 0, p, 1));
}

/* ---------------------------------------------------------------- ps__pm_usable */

Test(pm_usable, works_here_and_can_be_turned_off, .timeout = 120) {
  const char *orig = getenv("PSHARD_PEER_MEM");
  char *saved = orig ? strdup(orig) : NULL;
  unsetenv("PSHARD_PEER_MEM");
  ps__pm_reset();
  cr_assert(eq(int, ps__pm_usable(), 1));
  cr_assert(eq(int, ps__pm_usable(), 1));
  cr_assert(eq(int, setenv("PSHARD_PEER_MEM", "0", 1), 0));
  cr_assert(eq(int, ps__pm_usable(), 1), "the answer is kept until ps__pm_reset");
  ps__pm_reset();
  cr_assert(eq(int, ps__pm_usable(), 0));
  unsetenv("PSHARD_PEER_MEM");
  cr_assert(eq(int, ps__pm_usable(), 0), "the answer is kept until ps__pm_reset");
  ps__pm_reset();
  cr_assert(eq(int, ps__pm_usable(), 1));
  cr_assert(eq(int, setenv("PSHARD_PEER_MEM", "1", 1), 0));
  ps__pm_reset();
  cr_assert(eq(int, ps__pm_usable(), 1));
  if (saved)
    setenv("PSHARD_PEER_MEM", saved, 1);
  else
    unsetenv("PSHARD_PEER_MEM");
  free(saved);
  ps__pm_reset();
}

/* ---------------------------------------------------------------- another process */

#define KID_SEED 7
#define PARENT_SEED 3
#define WRITE_SEED 9

static struct {
  pid_t pid;
  int go;    /* parent's write end: 'v' = verify and exit; EOF = exit */
  int ready; /* parent's read end: one byte once the child is set up */
} kid = {0, -1, -1};



static void kid_stop(void) {
  if (kid.go >= 0) close(kid.go); /* the child exits on EOF */
  if (kid.ready >= 0) close(kid.ready);
  if (kid.pid > 0) {
    kill(kid.pid, SIGKILL);
    reap(kid.pid, 10000, NULL);
  }
  kid.pid = 0, kid.go = kid.ready = -1;
}

/* The child: fill buf with its own pattern (and unmap the middle page of hole, which
 * stays mapped in the parent), say so, then wait for 'v' to check that buf holds its
 * pattern with [woff, woff + wlen) replaced by the parent's write. */
static void kid_main(uint8_t *buf, size_t n, uint8_t *hole, size_t woff, size_t wlen, int go, int ready) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  alarm(60);
  for (size_t i = 0; i < n; i++) buf[i] = pat(KID_SEED, i);
  if (munmap(hole + page_size(), page_size()) != 0) _exit(3);
  char c = 'r';
  if (write(ready, &c, 1) != 1) _exit(4);
  if (read(go, &c, 1) != 1 || c != 'v') _exit(2);
  for (size_t i = 0; i < n; i++) {
    uint8_t want = i >= woff && i - woff < wlen ? pat(WRITE_SEED, i - woff) : pat(KID_SEED, i);
    if (buf[i] != want) _exit(1);
  }
  _exit(0);
}

static void kid_start(uint8_t *buf, size_t n, uint8_t *hole, size_t woff, size_t wlen) {
  int go[2], ready[2];
  cr_assert(eq(int, pipe(go), 0));
  cr_assert(eq(int, pipe(ready), 0));
  fflush(NULL);
  pid_t pid = fork();
  cr_assert(ge(int, pid, 0), "fork: %s", strerror(errno));
  if (pid == 0) {
    close(go[1]);
    close(ready[0]);
    kid_main(buf, n, hole, woff, wlen, go[0], ready[1]);
  }
  close(go[0]);
  close(ready[1]);
  kid.pid = pid, kid.go = go[1], kid.ready = ready[0];
  struct pollfd pf = {.fd = kid.ready, .events = POLLIN};
  int rc;
  do rc = poll(&pf, 1, 20000);
  while (rc < 0 && errno == EINTR);
  cr_assert(eq(int, rc, 1), "the child did not start");
  char c = 0;
  cr_assert(eq(int, (int)read(kid.ready, &c, 1), 1), "the child exited early");
  cr_assert(eq(chr, c, 'r'));
}

Test(pm_child, read_and_write_another_process, .timeout = 120, .fini = kid_stop) {
  const size_t n = 400000, woff = 4095 + 1 + 13, wlen = 250000;
  size_t pg = page_size();
  uint8_t *buf = malloc(n);
  uint8_t *hole = map_pages(3, PROT_READ | PROT_WRITE);
  cr_assert(buf != NULL);
  for (size_t i = 0; i < n; i++) buf[i] = pat(PARENT_SEED, i);
  kid_start(buf, n, hole, woff, wlen);
  int pid = (int)kid.pid;

  /* The child's buffer, cut into remote regions of misaligned sizes, out of order. */
  static const size_t rc[] = {4095, 1, 13, 70000, 3, 65537, 4097, 2};
  descs d = {0};
  size_t cut[64], ncut = 0, pos = 0;
  while (pos < n) {
    size_t len = rc[ncut % 8] < n - pos ? rc[ncut % 8] : n - pos;
    cut[ncut++] = pos;
    pos += len;
  }
  cut[ncut] = n;
  /* descriptors in the order of the buffer: the concatenation is the buffer */
  for (size_t k = 0; k < ncut; k++) descs_add(&d, (uint64_t)(uintptr_t)(buf + cut[k]), cut[k + 1] - cut[k]);
  OK(ps__pm_mapped(pid, 0, d.d, d.n));
  OK(ps__pm_mapped(pid, 1, d.d, d.n));

  /* read it all into many local regions */
  layout loc;
  layout_make(&loc, LCYC, NLCYC, 100000, n, 0, 2);
  uv_buf_t *v = layout_bufs(&loc);
  OK(ps__pm_copy(pid, 0, v, (unsigned)loc.n, d.d, d.n, 0, 0));
  size_t i = 0;
  for (size_t k = 0; k < loc.n; k++)
    for (size_t b = 0; b < loc.len[k]; b++, i++)
      cr_assert(eq(u8, loc.arena[loc.at[k] + b], pat(KID_SEED, i)), "byte %zu read from the child", i);
  for (i = 0; i < n; i++) cr_assert(eq(u8, buf[i], pat(PARENT_SEED, i)), "the parent's own buffer changed at %zu", i);
  free(v);
  layout_free(&loc);

  /* write wlen bytes from woff on (across region boundaries) */
  layout_make(&loc, LCYC, NLCYC, 100000, wlen, 0, WRITE_SEED);
  v = layout_bufs(&loc);
  OK(ps__pm_copy(pid, 1, v, (unsigned)loc.n, d.d, d.n, woff, 0));
  free(v);
  layout_free(&loc);
  for (i = 0; i < n; i++) cr_assert(eq(u8, buf[i], pat(PARENT_SEED, i)), "the parent's own buffer changed at %zu", i);

  /* read back from an offset inside a region, through one local region */
  uint8_t *back = malloc(n - 5);
  cr_assert(back != NULL);
  uv_buf_t bb = uv_buf_init((char *)back, (unsigned)(n - 5));
  OK(ps__pm_copy(pid, 0, &bb, 1, d.d, d.n, 5, 0));
  for (i = 5; i < n; i++) {
    uint8_t want = i >= woff && i - woff < wlen ? pat(WRITE_SEED, i - woff) : pat(KID_SEED, i);
    cr_assert(eq(u8, back[i - 5], want), "byte %zu of the child's buffer after the write", i);
  }
  free(back);

  /* the middle page of `hole` is gone in the child only (both ways of checking) */
  mapped_fn ways[2] = {ps__pm_mapped, ps__pm_mapped_text};
  for (int k = 0; k < 2; k++) {
    OK(mapped1(ways[k], (int)getpid(), 0, hole, 3 * pg));
    FAILS(PS_ERR_IO, mapped1(ways[k], pid, 0, hole, 3 * pg));
    FAILS(PS_ERR_IO, mapped1(ways[k], pid, 1, hole + pg, 1));
    OK(mapped1(ways[k], pid, 1, hole, pg));
  }
  descs h = {0};
  descs_add(&h, (uint64_t)(uintptr_t)(hole + pg - 8), 16);
  uint8_t x[16];
  uv_buf_t xv = uv_buf_init((char *)x, sizeof x);
  FAILS(PS_ERR_IO, ps__pm_copy(pid, 0, &xv, 1, h.d, h.n, 0, 0));
  expect_io_message(0, pid);
  FAILS(PS_ERR_IO, ps__pm_copy(pid, 1, &xv, 1, h.d, h.n, 8, 0)); /* wholly in the hole */
  expect_io_message(1, pid);
  descs_free(&h);

  /* the child checks its buffer itself and exits */
  char c = 'v';
  cr_assert(eq(int, (int)write(kid.go, &c, 1), 1));
  int st = 0, reaped = reap(kid.pid, 20000, &st), exited = WIFEXITED(st);
  cr_assert(reaped, "the child did not exit");
  kid.pid = 0;
  cr_assert(exited, "the child died (status %#x)", st);
  cr_assert(eq(int, WEXITSTATUS(st), 0), "the child saw a different buffer (1) or failed (>1)");

  /* a process that is gone */
  FAILS(PS_ERR_UNAVAILABLE, ps__pm_mapped(pid, 0, d.d, d.n));
  uint8_t y[8];
  uv_buf_t yv = uv_buf_init((char *)y, sizeof y);
  cr_assert(not(eq(int, ps__pm_copy(pid, 0, &yv, 1, d.d, d.n, 0, 0), 0)));

  descs_free(&d);
  free(buf);
  munmap(hole, 3 * pg);
}
