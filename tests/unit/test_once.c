/*
 * test_once.c - the windows of applied push sequences (shard/once.h): in order, out of
 * order, duplicates, incarnations, wrap-around and large gaps; the set of windows; the
 * encoding's round trip and its refusal of malformed bytes.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <string.h>

#include "common/common.h"
#include "shard/once.h"

TestSuite(once, .timeout = 30);

/* Check, then mark when new: what the engine does with each push. */
static int take(ps__once *w, uint64_t inc, uint32_t seq) {
  int v = ps__once_check(w, inc, seq);
  if (v == PS__ONCE_NEW) ps__once_mark(w, inc, seq);
  return v;
}

Test(once, in_order_then_duplicates) {
  ps__once w = {.worker = 3};
  for (uint32_t s = 1; s <= 100; s++) cr_assert(eq(int, take(&w, 7, s), PS__ONCE_NEW), "seq %u", s);
  cr_assert(eq(u32, w.high, 100));
  for (uint32_t s = 1; s <= 100; s++) cr_assert(eq(int, take(&w, 7, s), PS__ONCE_DUP), "seq %u", s);
  cr_assert(eq(int, take(&w, 7, 101), PS__ONCE_NEW));
}

Test(once, out_of_order) {
  ps__once w = {.worker = 1};
  const uint32_t order[] = {5, 2, 9, 1, 3, 8, 4, 7, 6};
  for (size_t i = 0; i < sizeof order / sizeof order[0]; i++)
    cr_assert(eq(int, take(&w, 1, order[i]), PS__ONCE_NEW), "seq %u", order[i]);
  cr_assert(eq(u32, w.high, 9));
  for (uint32_t s = 1; s <= 9; s++) cr_assert(eq(int, ps__once_check(&w, 1, s), PS__ONCE_DUP), "seq %u", s);
  cr_assert(eq(int, ps__once_check(&w, 1, 10), PS__ONCE_NEW));
  /* A hole below high stays new until it comes. */
  cr_assert(eq(int, take(&w, 1, 12), PS__ONCE_NEW));
  cr_assert(eq(int, ps__once_check(&w, 1, 11), PS__ONCE_NEW));
  cr_assert(eq(int, ps__once_check(&w, 1, 10), PS__ONCE_NEW));
  cr_assert(eq(int, take(&w, 1, 11), PS__ONCE_NEW));
  cr_assert(eq(int, ps__once_check(&w, 1, 11), PS__ONCE_DUP));
}

Test(once, incarnations) {
  ps__once w = {.worker = 1};
  for (uint32_t s = 1; s <= 10; s++) take(&w, 100, s);
  /* An older process of the same worker is refused, and changes nothing. */
  cr_assert(eq(int, ps__once_check(&w, 99, 11), PS__ONCE_STALE));
  cr_assert(eq(int, ps__once_check(&w, 99, 3), PS__ONCE_STALE));
  cr_assert(eq(u64, w.inc, 100));
  /* A newer one starts afresh: its sequence 1 is new, and the old one is stale now. */
  cr_assert(eq(int, take(&w, 200, 1), PS__ONCE_NEW));
  cr_assert(eq(u64, w.inc, 200));
  cr_assert(eq(u32, w.high, 1));
  cr_assert(eq(int, ps__once_check(&w, 200, 2), PS__ONCE_NEW));
  cr_assert(eq(int, ps__once_check(&w, 200, 1), PS__ONCE_DUP));
  cr_assert(eq(int, ps__once_check(&w, 100, 11), PS__ONCE_STALE));
}

Test(once, wraps_around) {
  ps__once w = {.worker = 1};
  uint32_t s = UINT32_MAX - 5;
  for (int i = 0; i < 12; i++, s++) cr_assert(eq(int, take(&w, 1, s), PS__ONCE_NEW), "seq %u", s);
  cr_assert(eq(u32, w.high, 5)); /* UINT32_MAX - 5 + 11 */
  for (uint32_t k = UINT32_MAX - 5; k != 6; k++) cr_assert(eq(int, ps__once_check(&w, 1, k), PS__ONCE_DUP), "seq %u", k);
  cr_assert(eq(int, ps__once_check(&w, 1, 6), PS__ONCE_NEW));
  cr_assert(eq(int, ps__once_check(&w, 1, UINT32_MAX - 6), PS__ONCE_NEW)); /* never applied, inside the window */
}

Test(once, gaps_and_the_edge_of_the_window) {
  ps__once w = {.worker = 1};
  take(&w, 1, 10);
  /* A gap inside the window keeps what is below. */
  cr_assert(eq(int, take(&w, 1, 10 + PS__ONCE_WINDOW - 1), PS__ONCE_NEW));
  cr_assert(eq(int, ps__once_check(&w, 1, 10), PS__ONCE_DUP));
  cr_assert(eq(int, ps__once_check(&w, 1, 11), PS__ONCE_NEW));
  /* One more and 10 falls out: too old to tell, refused rather than applied again. */
  cr_assert(eq(int, take(&w, 1, 10 + PS__ONCE_WINDOW), PS__ONCE_NEW));
  cr_assert(eq(int, ps__once_check(&w, 1, 10), PS__ONCE_TOO_OLD));
  cr_assert(eq(int, ps__once_check(&w, 1, 11), PS__ONCE_NEW));
  /* A gap wider than the window: nothing below is remembered, the ring holds no stale
   * bit (a sequence that maps to an old one's slot is new). */
  uint32_t far = 10 + 5 * PS__ONCE_WINDOW + 3;
  cr_assert(eq(int, take(&w, 1, far), PS__ONCE_NEW));
  for (uint32_t k = far - PS__ONCE_WINDOW + 1; k != far; k++)
    cr_assert(eq(int, ps__once_check(&w, 1, k), PS__ONCE_NEW), "seq %u", k);
  cr_assert(eq(int, ps__once_check(&w, 1, far - PS__ONCE_WINDOW), PS__ONCE_TOO_OLD));
  /* A sequence half the number space away counts as old. */
  cr_assert(eq(int, ps__once_check(&w, 1, far + 0x80000000u), PS__ONCE_TOO_OLD));
}

Test(once, set_find_and_get) {
  ps__once_set s = {0};
  cr_assert(ps__once_find(&s, 5, 0) == NULL);
  for (uint32_t id = 1; id <= 1000; id++) {
    ps__once *w = ps__once_get(&s, id, 0);
    cr_assert(w != NULL);
    ps__once_mark(w, id, id * 3);
  }
  cr_assert(eq(sz, s.n, 1000));
  for (uint32_t id = 1; id <= 1000; id++) {
    ps__once *w = ps__once_find(&s, id, 0);
    cr_assert(w != NULL && w->worker == id && w->high == id * 3, "worker %u", id);
    cr_assert(ps__once_get(&s, id, 0) == w);
  }
  cr_assert(ps__once_find(&s, 1001, 0) == NULL);
  ps__once_set_clear(&s);
  cr_assert(eq(sz, s.n, 0));
}

static int same(const ps__once *a, const ps__once *b) {
  if (a->worker != b->worker || a->any != b->any) return 0;
  if (!a->any) return 1;
  if (a->inc != b->inc || a->high != b->high) return 0;
  for (uint32_t i = 0; i < PS__ONCE_WINDOW; i++)
    if (ps__once_check(a, a->inc, a->high - i) != ps__once_check(b, b->inc, b->high - i)) return 0;
  return 1;
}

Test(once, encode_decode_round_trip) {
  ps__once_set s = {0};
  ps__once *a = ps__once_get(&s, 4, 0), *b = ps__once_get(&s, 9, 0), *c = ps__once_get(&s, 12, 0);
  (void)c; /* stays empty */
  /* across the wrap: UINT32_MAX - 100, ..., UINT32_MAX - 1, then 1, 4, ..., 298 */
  for (uint32_t k = UINT32_MAX - 100; k != 301; k += 3) ps__once_mark(a, 77, k);
  ps__once_mark(b, 1, 5);
  ps__once_mark(b, 1, 2);
  ps__wbuf wb;
  ps__wbuf_init(&wb);
  ps__once_set_encode(&s, &wb);
  cr_assert(wb.oom == 0);
  cr_assert(eq(sz, wb.len, 5 + 3 * (29 + PS__ONCE_WINDOW / 8)));
  ps__once_set t = {0};
  ps__once_mark(ps__once_get(&t, 50, 0), 1, 1); /* replaced by the decode */
  cr_assert(eq(int, ps__once_set_decode(&t, wb.data, wb.len), 0), "%s", ps_errmsg());
  cr_assert(eq(sz, t.n, 3));
  cr_assert(ps__once_find(&t, 50, 0) == NULL);
  for (uint32_t id = 4; id <= 12; id++) {
    ps__once *x = ps__once_find(&s, id, 0), *y = ps__once_find(&t, id, 0);
    cr_assert(eq(int, x == NULL, y == NULL), "worker %u", id);
    if (x) cr_assert(same(x, y) == 1, "worker %u", id);
  }
  /* The decoded window answers as the original did. */
  cr_assert(eq(int, ps__once_check(ps__once_find(&t, 4, 0), 77, 200), ps__once_check(a, 77, 200)));
  cr_assert(eq(int, ps__once_check(ps__once_find(&t, 9, 0), 1, 2), PS__ONCE_DUP));
  cr_assert(eq(int, ps__once_check(ps__once_find(&t, 9, 0), 1, 3), PS__ONCE_NEW));
  cr_assert(eq(int, ps__once_check(ps__once_find(&t, 12, 0), 5, 5), PS__ONCE_NEW));
  ps__wbuf_free(&wb);
  ps__once_set_clear(&s);
  ps__once_set_clear(&t);
}

/* Encode a set of one window for worker 2 (inc 5, sequences 1..3), to corrupt. */
static void one_window(ps__wbuf *wb) {
  ps__once_set s = {0};
  ps__once *w = ps__once_get(&s, 2, 0);
  for (uint32_t k = 1; k <= 3; k++) ps__once_mark(w, 5, k);
  ps__wbuf_init(wb);
  ps__once_set_encode(&s, wb);
  ps__once_set_clear(&s);
}

/* Offsets in one_window's bytes: format 0, count 1, worker 5, unit 9, any 17, inc 18,
 * high 26, nbits 30, bits 34. */
static void refused(const uint8_t *p, size_t len, const char *what) {
  ps__once_set t = {0};
  ps__once_mark(ps__once_get(&t, 8, 0), 1, 1);
  int rc = ps__once_set_decode(&t, p, len);
  cr_assert(eq(int, rc, PS_ERR_CORRUPT), "%s: rc %d", what, rc);
  cr_assert(ps_errmsg()[0] != '\0', "%s: no message", what);
  cr_assert(eq(sz, t.n, 1), "%s: the set changed", what); /* unchanged */
  cr_assert(ps__once_find(&t, 8, 0) != NULL);
  ps__once_set_clear(&t);
}

Test(once, malformed_bytes_are_refused) {
  ps__wbuf wb;
  one_window(&wb);
  size_t n = wb.len;
  uint8_t *b = malloc(n + 16);
  cr_assert(b != NULL);
  /* every truncation */
  for (size_t k = 0; k < n; k += (k < 40 ? 1 : 97)) refused(wb.data, k, "truncated");
  memcpy(b, wb.data, n);
  b[n] = 0;
  refused(b, n + 1, "trailing byte");
#define CORRUPT(stmt, what)      \
  do {                           \
    memcpy(b, wb.data, n);       \
    stmt;                        \
    refused(b, n, what);         \
  } while (0)
  CORRUPT(b[0] = 1, "unknown format");
  CORRUPT(ps__put_u32(b + 1, 2), "count above the windows");
  CORRUPT(ps__put_u32(b + 1, PS__ONCE_MAX_WORKERS + 1), "count above the limit");
  CORRUPT(ps__put_u32(b + 5, 0), "worker 0");
  CORRUPT(b[17] = 2, "bad flag");
  CORRUPT(ps__put_u32(b + 30, PS__ONCE_WINDOW / 2), "narrow window");
  CORRUPT(ps__put_u32(b + 30, PS__ONCE_WINDOW + 1), "width not whole words");
  CORRUPT(ps__put_u32(b + 30, PS__ONCE_MAX_BITS + 64), "width above the limit");
  CORRUPT(b[34] &= (uint8_t)~1u, "highest not marked");
  CORRUPT(b[17] = 0, "empty with a position");
  CORRUPT((b[17] = 0, memset(b + 18, 0, 12)), "empty with bits");
#undef CORRUPT
  /* The same window twice. */
  ps__wbuf two;
  ps__wbuf_init(&two);
  ps__wbuf_u8(&two, 2);
  ps__wbuf_u32(&two, 2);
  ps__wbuf_bytes(&two, wb.data + 5, n - 5);
  ps__wbuf_bytes(&two, wb.data + 5, n - 5);
  refused(two.data, two.len, "a worker twice");
  /* A wider window is taken, its first PS__ONCE_WINDOW bits kept. */
  ps__wbuf wide;
  ps__wbuf_init(&wide);
  ps__wbuf_bytes(&wide, wb.data, 30);
  ps__wbuf_u32(&wide, 2 * PS__ONCE_WINDOW);
  ps__wbuf_bytes(&wide, wb.data + 34, n - 34);
  uint8_t ones[PS__ONCE_WINDOW / 8];
  memset(ones, 0xff, sizeof ones);
  ps__wbuf_bytes(&wide, ones, sizeof ones);
  ps__once_set t = {0};
  cr_assert(eq(int, ps__once_set_decode(&t, wide.data, wide.len), 0), "%s", ps_errmsg());
  ps__once *w = ps__once_find(&t, 2, 0);
  cr_assert(w && w->high == 3 && w->inc == 5);
  cr_assert(eq(int, ps__once_check(w, 5, 2), PS__ONCE_DUP));
  cr_assert(eq(int, ps__once_check(w, 5, 4), PS__ONCE_NEW));
  ps__once_set_clear(&t);
  ps__wbuf_free(&wide);
  ps__wbuf_free(&two);
  ps__wbuf_free(&wb);
  free(b);
}

/* Windows of two servers merged: a sequence applied in either is applied; an older
 * incarnation's window gives way to a newer one. */
Test(once, set_merge) {
  ps__once_set a, b;
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  ps__once *wa = ps__once_get(&a, 5, 0), *wb = ps__once_get(&b, 5, 0), *wc = ps__once_get(&b, 9, 0), *wd = ps__once_get(&a, 11, 0);
  cr_assert(wa && wb && wc && wd);
  for (uint32_t s = 1; s <= 10; s += 2) take(wa, 100, s);
  for (uint32_t s = 2; s <= 20; s += 2) take(wb, 100, s);
  take(wc, 7, 3);
  take(wd, 50, 1);
  ps__once *we = ps__once_get(&b, 11, 0);
  cr_assert(we != NULL);
  take(we, 60, 4); /* a newer incarnation of worker 11 */
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__once_set_encode(&b, &w);
  cr_assert(eq(int, ps__once_set_merge(&a, w.data, w.len), 0), "%s", ps_errmsg());
  wa = ps__once_find(&a, 5, 0);
  for (uint32_t s = 1; s <= 20; s++)
    cr_expect(eq(int, ps__once_check(wa, 100, s), (s <= 10 || s % 2 == 0) ? PS__ONCE_DUP : PS__ONCE_NEW), "seq %u", s);
  cr_expect(eq(int, ps__once_check(ps__once_find(&a, 9, 0), 7, 3), PS__ONCE_DUP));
  cr_expect(eq(int, ps__once_check(ps__once_find(&a, 11, 0), 60, 4), PS__ONCE_DUP));
  cr_expect(eq(int, ps__once_check(ps__once_find(&a, 11, 0), 50, 1), PS__ONCE_STALE));
  cr_expect(eq(int, ps__once_set_merge(&a, w.data, w.len - 1), PS_ERR_CORRUPT));
  ps__wbuf_free(&w);
  ps__once_set_clear(&a);
  ps__once_set_clear(&b);
}

/* Windows encoded without some pushes (a cut whose rows do not hold them yet): those
 * read as new where the encoding is decoded, every other sequence as before; a
 * window's highest sequence left out moves the highest down, and a window left with
 * nothing is empty. The source's own windows are unchanged. */
Test(once, encode_except_leaves_pushes_out) {
  ps__once_set a, out;
  memset(&a, 0, sizeof a);
  memset(&out, 0, sizeof out);
  ps__once *w5 = ps__once_get(&a, 5, 0), *w9 = ps__once_get(&a, 9, 0), *w12 = ps__once_get(&a, 12, 0);
  cr_assert(w5 && w9 && w12);
  for (uint32_t s = 1; s <= 50; s++) take(w5, 100, s);
  take(w9, 7, 3);
  take(w12, 8, 40);
  take(w12, 8, 44);
  ps__push_id ex[] = {
      {.worker = 5, .seq = 50, .inc = 100}, /* the highest: moves down */
      {.worker = 5, .seq = 49, .inc = 100},
      {.worker = 5, .seq = 10, .inc = 100},
      {.worker = 5, .seq = 20, .inc = 99},  /* another incarnation: not this window's */
      {.worker = 9, .seq = 3, .inc = 7},    /* its only one: the window empties */
      {.worker = 12, .seq = 44, .inc = 8},
      {.worker = 77, .seq = 1, .inc = 1},   /* no window */
  };
  ps__wbuf w;
  ps__wbuf_init(&w);
  cr_assert(eq(int, ps__once_set_encode_except(&a, NULL, 0, ex, sizeof ex / sizeof *ex, &w), 0));
  cr_assert(eq(int, ps__once_set_decode(&out, w.data, w.len), 0), "%s", ps_errmsg());
  ps__once *o5 = ps__once_find(&out, 5, 0), *o9 = ps__once_find(&out, 9, 0), *o12 = ps__once_find(&out, 12, 0);
  cr_assert(o5 && o9 && o12);
  cr_expect(eq(u32, o5->high, 48));
  for (uint32_t s = 1; s <= 50; s++)
    cr_expect(eq(int, ps__once_check(o5, 100, s), (s == 10 || s >= 49) ? PS__ONCE_NEW : PS__ONCE_DUP), "seq %u", s);
  cr_expect(eq(int, o9->any, 0));
  cr_expect(eq(int, ps__once_check(o9, 7, 3), PS__ONCE_NEW));
  cr_expect(eq(u32, o12->high, 40));
  cr_expect(eq(int, ps__once_check(o12, 8, 40), PS__ONCE_DUP));
  cr_expect(eq(int, ps__once_check(o12, 8, 44), PS__ONCE_NEW));
  /* the source's windows are as they were */
  cr_expect(eq(int, ps__once_check(w5, 100, 50), PS__ONCE_DUP));
  cr_expect(eq(int, ps__once_check(w9, 7, 3), PS__ONCE_DUP));
  /* with nothing left out, the same bytes as the plain encoding */
  ps__wbuf plain, none;
  ps__wbuf_init(&plain);
  ps__wbuf_init(&none);
  ps__once_set_encode(&a, &plain);
  cr_assert(eq(int, ps__once_set_encode_except(&a, NULL, 0, NULL, 0, &none), 0));
  cr_expect(eq(sz, plain.len, none.len));
  cr_expect(memcmp(plain.data, none.data, plain.len) == 0);
  ps__wbuf_free(&plain);
  ps__wbuf_free(&none);
  ps__wbuf_free(&w);
  ps__once_set_clear(&a);
  ps__once_set_clear(&out);
}

/* Under replicas a window is per worker and per unit (the chain a push went down): a
 * sequence applied in one unit is new in another, and the encoding keeps each apart. */
Test(once, units_are_separate_windows) {
  ps__once_set s = {0}, t = {0};
  uint64_t ua = ps__once_unit(1, 3), ub = ps__once_unit(2, 3), uc = ps__once_unit(1, PS_FWD_DENSE_CHAIN | 3),
           ud = ps__once_unit(2, PS_FWD_DENSE_CHAIN | 3);
  /* a sparse route is the same chain in every table; a dense run is its table's own */
  cr_assert(eq(u64, ua, ub));
  cr_assert(ua != 0 && uc != 0 && uc != ud && ua != uc);
  ps__once *a = ps__once_get(&s, 7, ua), *c = ps__once_get(&s, 7, uc);
  cr_assert(a && c && a != c);
  take(a, 5, 10);
  take(c, 5, 11);
  cr_assert(eq(int, ps__once_check(a, 5, 11), PS__ONCE_NEW));
  cr_assert(eq(int, ps__once_check(c, 5, 10), PS__ONCE_NEW));
  cr_assert(ps__once_find(&s, 7, 0) == NULL);
  cr_assert(ps__once_find(&s, 7, ud) == NULL);
  ps__wbuf w;
  ps__wbuf_init(&w);
  ps__once_set_encode(&s, &w);
  cr_assert(eq(int, ps__once_set_decode(&t, w.data, w.len), 0), "%s", ps_errmsg());
  cr_assert(eq(int, ps__once_check(ps__once_find(&t, 7, ua), 5, 10), PS__ONCE_DUP));
  cr_assert(eq(int, ps__once_check(ps__once_find(&t, 7, ua), 5, 11), PS__ONCE_NEW));
  cr_assert(eq(int, ps__once_check(ps__once_find(&t, 7, uc), 5, 11), PS__ONCE_DUP));
  ps__wbuf_free(&w);
  ps__once_set_clear(&s);
  ps__once_set_clear(&t);
}

/* A copy of some chains takes the windows of those chains only: a server's windows of
 * its other chains say what it applied there, which the copy's rows do not hold. */
Test(once, encode_except_keeps_the_units_asked_for) {
  ps__once_set s = {0}, t = {0};
  uint64_t u1 = ps__once_unit(1, 0), u2 = ps__once_unit(1, 1), u3 = ps__once_unit(1, 2);
  take(ps__once_get(&s, 4, u1), 9, 1);
  take(ps__once_get(&s, 4, u2), 9, 2);
  take(ps__once_get(&s, 5, u2), 9, 3);
  take(ps__once_get(&s, 5, u3), 9, 4);
  take(ps__once_get(&s, 5, u3), 9, 5);
  uint64_t keep[] = {u3, u1};
  ps__push_id ex[] = {{.worker = 5, .seq = 5, .inc = 9, .unit = u3}, {.worker = 4, .seq = 1, .inc = 9, .unit = u2}};
  ps__wbuf w;
  ps__wbuf_init(&w);
  cr_assert(eq(int, ps__once_set_encode_except(&s, keep, 2, ex, 2, &w), 0));
  cr_assert(eq(int, ps__once_set_decode(&t, w.data, w.len), 0), "%s", ps_errmsg());
  cr_assert(eq(sz, t.n, 2));
  cr_assert(ps__once_find(&t, 4, u2) == NULL && ps__once_find(&t, 5, u2) == NULL, "a unit not asked for");
  cr_assert(eq(int, ps__once_check(ps__once_find(&t, 4, u1), 9, 1), PS__ONCE_DUP), "left out in another unit only");
  cr_assert(eq(int, ps__once_check(ps__once_find(&t, 5, u3), 9, 4), PS__ONCE_DUP));
  cr_assert(eq(int, ps__once_check(ps__once_find(&t, 5, u3), 9, 5), PS__ONCE_NEW), "left out");
  /* no unit at all: no window */
  ps__wbuf e;
  ps__wbuf_init(&e);
  cr_assert(eq(int, ps__once_set_encode_except(&s, keep, 0, NULL, 0, &e), 0));
  cr_assert(eq(int, ps__once_set_decode(&t, e.data, e.len), 0), "%s", ps_errmsg());
  cr_assert(eq(sz, t.n, 0));
  ps__wbuf_free(&e);
  ps__wbuf_free(&w);
  ps__once_set_clear(&s);
  ps__once_set_clear(&t);
}
