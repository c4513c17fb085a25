/*
 * test_rowmap.c - the row store's growth (store/rowmap.c): every key found and every row
 * unchanged at each step of the index's growth and while rows move to a bigger index,
 * views taken during a move, a randomised run against a reference map, and the memory
 * accounting. (test_store.c has the basic map tests.)
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <stdlib.h>
#include <string.h>

#include "store/store.h"

/* Distinct keys with 0 and UINT64_MAX among the first ones. */
static uint64_t key_of(size_t i) {
  if (i == 0) return 0;
  if (i == 1) return UINT64_MAX;
  if (i == 2) return 1;
  if (i == 3) return UINT64_MAX - 1;
  return (uint64_t)i * 0x9E3779B97F4A7C15ull; /* odd multiplier: a bijection */
}

/* Row i's contents: its number and key in every float. */
static void fill_row(float *r, size_t rf, size_t i) {
  for (size_t j = 0; j < rf; j++) r[j] = (float)(i % 1000003) + (float)j * 0.5f;
}

static int row_ok(const float *r, size_t rf, size_t i) {
  for (size_t j = 0; j < rf; j++)
    if (r[j] != (float)(i % 1000003) + (float)j * 0.5f) return 0;
  return 1;
}

/* Every row [0, n) of m: found by key (get, index, find_many), in place (row_at), with
 * its key and contents. */
static void check_all(const ps__rowmap *m, size_t rf, size_t n, const char *when) {
  enum { B = 100 };
  uint64_t keys[B];
  float *rows[B];
  uint32_t idx[B];
  cr_assert(eq(sz, ps__rowmap_count(m), n), "%s", when);
  for (size_t i = 0; i < n; i++) {
    float *r = ps__rowmap_get(m, key_of(i));
    if (!r || r != ps__rowmap_row_at(m, i) || ps__rowmap_index(m, key_of(i)) != i ||
        ps__rowmap_key_at(m, i) != key_of(i) || !row_ok(r, rf, i))
      cr_fatal("%s: row %zu of %zu", when, i, n);
  }
  for (size_t b = 0; b < n; b += B) {
    size_t k = n - b < B ? n - b : B;
    for (size_t j = 0; j < k; j++) keys[j] = key_of(b + j);
    ps__rowmap_find_many_at(m, keys, NULL, k, rows, idx);
    for (size_t j = 0; j < k; j++)
      if (idx[j] != b + j || rows[j] != ps__rowmap_row_at(m, b + j)) cr_fatal("%s: find_many row %zu", when, b + j);
  }
  for (size_t i = n; i < n + 50; i++)
    if (ps__rowmap_get(m, key_of(i)) || ps__rowmap_index(m, key_of(i)) != SIZE_MAX)
      cr_fatal("%s: absent key %zu found", when, i);
}

/* Each growth of the index (when rows start moving) and its end (none left to move):
 * every row found and unchanged, for a few row widths. Small maps: after every insert. */
static void growth_steps(size_t rf, size_t n) {
  ps__rowmap *m = ps__rowmap_new(rf);
  cr_assert(not(zero(ptr, m)));
  size_t moving = 0, growths = 0;
  for (size_t i = 0; i < n; i++) {
    int created = 0;
    uint32_t at = 7;
    float *r = ps__rowmap_upsert_at(m, key_of(i), &created, &at);
    if (!r || !created || at != i) cr_fatal("insert %zu", i);
    for (size_t j = 0; j < rf; j++)
      if (r[j] != 0.0f) cr_fatal("row %zu not zeroed", i);
    fill_row(r, rf, i);
    size_t now = ps__rowmap_moving(m);
    if (i < 2000) check_all(m, rf, i + 1, "small map");
    else if ((now && !moving) || (!now && moving)) check_all(m, rf, i + 1, now ? "a move starts" : "a move ends");
    if (now && !moving) growths++;
    moving = now;
  }
  cr_assert(gt(sz, growths, 10), "the index grew %zu times", growths);
  check_all(m, rf, n, "the end");
  ps__rowmap_free(m);
}

Test(rowmap_growth, every_step_one_float) { growth_steps(1, 300000); }
Test(rowmap_growth, every_step_odd_width) { growth_steps(3, 200000); }
Test(rowmap_growth, every_step_wide) { growth_steps(48, 60000); }

/* An index whose capacity is no power of two (sized by a reserve) doubles: the entries at their home
 * move without their records (new home and tag from the old ones), the others by their
 * keys, and every row is found at each step of the move, by a batch upsert as well. */
Test(rowmap_growth, move_from_any_capacity) {
  const size_t rf = 2;
  ps__rowmap *m = ps__rowmap_new(rf);
  cr_assert(eq(int, ps__rowmap_reserve(m, 70001), 0));
  size_t n = 0, steps = 0;
  while (n < 70001 || ps__rowmap_moving(m) || steps == 0) {
    fill_row(ps__rowmap_upsert(m, key_of(n), NULL), rf, n);
    n++;
    if (ps__rowmap_moving(m) && n % 4099 == 0) {
      check_all(m, rf, n, "during the move");
      steps++;
    }
  }
  cr_assert(gt(sz, steps, 3), "%zu checks during the move", steps);
  check_all(m, rf, n, "the move ended");
  enum { B = 64 };
  uint64_t keys[B];
  float *rows[B];
  uint32_t idx[B];
  uint8_t made[B];
  for (size_t b = 0; b + B <= n; b += 997) {
    for (size_t j = 0; j < B; j++) keys[j] = key_of(b + j);
    cr_assert(eq(sz, ps__rowmap_upsert_many(m, keys, NULL, B, rows, idx, made, 1), B));
    for (size_t j = 0; j < B; j++)
      if (made[j] || idx[j] != b + j) cr_fatal("upsert_many of row %zu after the move", b + j);
  }
  ps__rowmap_free(m);
}

/* A view taken while rows move to a new index reads every row of the cut, during the
 * move and after it, while the owner inserts; lookups meanwhile answer from both
 * indexes. */
Test(rowmap_growth, views_and_lookups_during_a_move) {
  const size_t rf = 2;
  ps__rowmap *m = ps__rowmap_new(rf);
  size_t n = 0;
  while (n < 100000 || !ps__rowmap_moving(m)) { /* until a move has just started */
    fill_row(ps__rowmap_upsert(m, key_of(n), NULL), rf, n);
    n++;
  }
  size_t left = ps__rowmap_moving(m);
  cr_assert(gt(sz, left, 1000), "a move of %zu rows", left);
  ps__rowmap_view v;
  cr_assert(eq(int, ps__rowmap_view_take(m, &v), 0));
  cr_assert(eq(sz, v.n, n));
  size_t cut = n;
  check_all(m, rf, n, "a move just started");
  while (ps__rowmap_moving(m)) {
    fill_row(ps__rowmap_upsert(m, key_of(n), NULL), rf, n);
    n++;
    if (n % 997 == 0) {
      for (size_t i = 0; i < cut; i += 13)
        if (ps__rowmap_view_key(&v, i) != key_of(i) || !row_ok(ps__rowmap_view_row(&v, i), rf, i) ||
            ps__rowmap_view_row(&v, i) != ps__rowmap_get(m, key_of(i)))
          cr_fatal("view row %zu during the move", i);
      cr_assert(lt(sz, ps__rowmap_moving(m), left), "the move goes on");
    }
  }
  check_all(m, rf, n, "the move ended");
  for (size_t i = 0; i < cut; i++)
    if (ps__rowmap_view_key(&v, i) != key_of(i) || !row_ok(ps__rowmap_view_row(&v, i), rf, i))
      cr_fatal("view row %zu after the move", i);
  ps__rowmap_view_free(&v);
  ps__rowmap_free(m);
}

/* A clear while rows move drops the old index; the map is then as good as new. */
Test(rowmap_growth, clear_during_a_move) {
  ps__rowmap *m = ps__rowmap_new(1);
  size_t n = 0;
  while (n < 50000 || !ps__rowmap_moving(m)) *ps__rowmap_upsert(m, key_of(n++), NULL) = 1.0f;
  size_t bytes = ps__rowmap_bytes(m);
  ps__rowmap_clear(m);
  cr_assert(eq(sz, ps__rowmap_moving(m), 0));
  cr_assert(lt(sz, ps__rowmap_bytes(m), bytes), "the old index was freed");
  for (size_t i = 0; i < n; i += 101) cr_assert(zero(ptr, ps__rowmap_get(m, key_of(i))));
  for (size_t i = 0; i < 3 * n; i++) fill_row(ps__rowmap_upsert(m, key_of(i), NULL), 1, i);
  check_all(m, 1, 3 * n, "refilled after a clear");
  ps__rowmap_free(m);
}

/* A reserved index does not grow before it holds that many rows. */
Test(rowmap_growth, reserve) {
  ps__rowmap *m = ps__rowmap_new(1);
  for (size_t i = 0; i < 1000; i++) fill_row(ps__rowmap_upsert(m, key_of(i), NULL), 1, i);
  cr_assert(eq(int, ps__rowmap_reserve(m, 200000), 0));
  cr_assert(eq(sz, ps__rowmap_moving(m), 0));
  check_all(m, 1, 1000, "reserved");
  ps__rowmap_use u0, u1;
  ps__rowmap_usage(m, &u0);
  /* (the last 1/64 of the rows an index holds start faulting in the next one) */
  for (size_t i = 1000; i < 195000; i++) {
    fill_row(ps__rowmap_upsert(m, key_of(i), NULL), 1, i);
    if (ps__rowmap_moving(m)) cr_fatal("grew at row %zu", i);
  }
  ps__rowmap_usage(m, &u1);
  cr_assert(eq(sz, u1.index, u0.index), "the index stayed as reserved");
  check_all(m, 1, 195000, "filled as reserved");
  for (size_t i = 195000; i < 200000; i++) {
    fill_row(ps__rowmap_upsert(m, key_of(i), NULL), 1, i);
    if (ps__rowmap_moving(m)) cr_fatal("grew at row %zu", i);
  }
  check_all(m, 1, 200000, "filled to the reserve");
  cr_assert(eq(int, ps__rowmap_reserve(m, 100), 0)); /* smaller: nothing to do */
  cr_assert(eq(int, ps__rowmap_reserve(m, (size_t)UINT32_MAX + 1), -1));
  ps__rowmap_free(m);
}

/* Memory apart: the parts sum to the total, payload and keys exact, and at a million
 * rows the index costs 4 / load bytes per row with load in [7/16, 7/8], plus the old
 * index (half the size) while rows move. */
Test(rowmap_growth, usage_adds_up) {
  ps__rowmap *m = ps__rowmap_new(2);
  ps__rowmap_use u;
  ps__rowmap_usage(m, &u);
  cr_assert(eq(sz, u.rows + u.payload + u.keys + u.index, 0));
  cr_assert(eq(sz, u.total, ps__rowmap_bytes(m)));
  for (size_t i = 0; i < 1000000; i++) ps__rowmap_upsert(m, key_of(i), NULL);
  ps__rowmap_usage(m, &u);
  cr_assert(eq(sz, u.rows, 1000000));
  cr_assert(eq(sz, u.payload, 8000000));
  cr_assert(eq(sz, u.keys, 8000000));
  cr_assert(eq(sz, u.payload + u.keys + u.index + u.spare, u.total));
  cr_assert(eq(sz, u.total, ps__rowmap_bytes(m)));
  double per = (double)u.index / 1e6, lo = 4.0 * 8 / 7, hi = 4.0 * 16 / 7 + (ps__rowmap_moving(m) ? 4.0 * 8 / 7 : 0.0);
  cr_assert(ge(dbl, per, lo - 0.01), "index %.2f B/row", per);
  cr_assert(le(dbl, per, hi + 0.01), "index %.2f B/row", per);
  cr_assert(lt(sz, u.spare, (size_t)4 << 20), "spare %zu", u.spare);
  ps__rowmap_free(m);
}

/* ---------------------------------------------------------------- randomised */

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static uint64_t rnd(void) { /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}

/* Keys of the run: a universe of U keys, 0, UINT64_MAX and near neighbours included,
 * the others spread and some close together (keys differing in low bits only). */
enum { U = 1 << 19 };
static uint64_t ukey(size_t u) {
  if (u < 4) return key_of(u);
  if (u < 1000) return (uint64_t)u; /* small consecutive keys */
  return ((uint64_t)u * 0xD6E8FEB86659FD93ull) ^ 0x5555555555555555ull;
}

/* 3M operations (insert, update, batch upsert, get, index, find_many, row_at, rare clears) on a map
 * and on a reference (the row number of each universe key), compared after each. */
Test(rowmap_growth, random_against_reference, .timeout = 60) {
  const size_t rf = 2;
  ps__rowmap *m = ps__rowmap_new(rf);
  int64_t *ref = malloc(U * sizeof *ref);  /* universe key -> row, or -1 */
  uint32_t *who = malloc(U * sizeof *who); /* row -> universe key */
  cr_assert(ref && who);
  for (size_t u = 0; u < U; u++) ref[u] = -1;
  size_t n = 0, clears = 0;
  uint64_t keys[64];
  float *rows[64];
  uint32_t idx[64];
  for (size_t op = 0; op < 3000000; op++) {
    uint64_t x = rnd();
    size_t u = (size_t)(x >> 40) % U;
    unsigned what = (unsigned)(x & 1023);
    if (what < 1) { /* a clear, a few times in the run */
      if ((x >> 20 & 511) == 0) {
        ps__rowmap_clear(m);
        for (size_t i = 0; i < n; i++) ref[who[i]] = -1;
        n = 0;
        clears++;
      }
    } else if (what < 600) { /* upsert: insert or update */
      int created = -1;
      uint32_t at;
      float *r = ps__rowmap_upsert_at(m, ukey(u), &created, &at);
      cr_assert(not(zero(ptr, r)));
      if (ref[u] < 0) {
        if (!created || at != n) cr_fatal("op %zu: insert of %zu as row %u, expected new row %zu", op, u, at, n);
        ref[u] = (int64_t)n;
        who[n++] = (uint32_t)u;
      } else if (created || at != (uint32_t)ref[u]) {
        cr_fatal("op %zu: update of %zu gave row %u, expected %lld", op, u, at, (long long)ref[u]);
      }
      r[0] = (float)u;
      r[1] += 1.0f;
    } else if (what < 900) { /* single lookups */
      float *r = ps__rowmap_get(m, ukey(u));
      size_t i = ps__rowmap_index(m, ukey(u));
      if (ref[u] < 0) {
        if (r || i != SIZE_MAX) cr_fatal("op %zu: absent %zu found", op, u);
      } else if (!r || i != (size_t)ref[u] || r != ps__rowmap_row_at(m, i) || r[0] != (float)u) {
        cr_fatal("op %zu: %zu not found as row %lld", op, u, (long long)ref[u]);
      }
    } else if (what < 960) { /* a batch upsert: inserts and updates, repeats within it */
      size_t k = 1 + (size_t)(x >> 10) % 64;
      size_t us[64];
      uint8_t made[64];
      for (size_t j = 0; j < k; j++) {
        us[j] = j && (rnd() & 7) == 0 ? us[j - 1] : (size_t)(rnd() >> 40) % U;
        keys[j] = ukey(us[j]);
      }
      cr_assert(eq(sz, ps__rowmap_upsert_many(m, keys, NULL, k, rows, idx, made, 1), k));
      for (size_t j = 0; j < k; j++) {
        if (ref[us[j]] < 0) {
          if (!made[j] || idx[j] != n || rows[j][0] != 0.0f || rows[j][1] != 0.0f)
            cr_fatal("op %zu: batch insert of %zu as row %u, expected new zeroed row %zu", op, us[j], idx[j], n);
          ref[us[j]] = (int64_t)n;
          who[n++] = (uint32_t)us[j];
        } else if (made[j] || idx[j] != (uint32_t)ref[us[j]]) {
          cr_fatal("op %zu: batch update of %zu gave row %u, expected %lld", op, us[j], idx[j], (long long)ref[us[j]]);
        }
        if (rows[j] != ps__rowmap_row_at(m, idx[j])) cr_fatal("op %zu: batch row of %zu", op, us[j]);
        rows[j][0] = (float)us[j];
        rows[j][1] += 1.0f;
      }
    } else { /* a batch */
      size_t k = 1 + (size_t)(x >> 10) % 64;
      size_t us[64];
      for (size_t j = 0; j < k; j++) {
        us[j] = (size_t)(rnd() >> 40) % U;
        keys[j] = ukey(us[j]);
      }
      ps__rowmap_find_many_at(m, keys, NULL, k, rows, idx);
      for (size_t j = 0; j < k; j++) {
        int64_t want = ref[us[j]];
        if (want < 0 ? (rows[j] || idx[j] != UINT32_MAX)
                     : (idx[j] != (uint32_t)want || rows[j] != ps__rowmap_row_at(m, idx[j]) ||
                        rows[j][0] != (float)us[j]))
          cr_fatal("op %zu: find_many key %zu", op, us[j]);
      }
    }
  }
  /* The end: every row in order, every universe key answered right. */
  cr_assert(eq(sz, ps__rowmap_count(m), n));
  for (size_t i = 0; i < n; i++)
    if (ps__rowmap_key_at(m, i) != ukey(who[i])) cr_fatal("key_at %zu", i);
  for (size_t u = 0; u < U; u++) {
    size_t i = ps__rowmap_index(m, ukey(u));
    if (ref[u] < 0 ? i != SIZE_MAX : i != (size_t)ref[u]) cr_fatal("final lookup of %zu", u);
  }
  cr_log_info("rowmap: random run: %zu rows at the end, %zu clears", n, clears);
  cr_assert(gt(sz, n, 100000), "the map grew large (%zu rows)", n);
  free(ref);
  free(who);
  ps__rowmap_free(m);
}

/* ---------------------------------------------------------------- batch upsert */

/* ps__rowmap_upsert_many against ps__rowmap_upsert_at key by key, on two maps fed the
 * same batches (host-order and wire-order keys in turn) of random keys with every
 * uint64 edge among them and repeats within a batch, through several growths of the
 * index: the same row numbers, the same created flags, the same keys in the same order. */
static void batch_matches_scalar(size_t rf, int zero) {
  ps__rowmap *a = ps__rowmap_new(rf), *b = ps__rowmap_new(rf);
  cr_assert(a && b);
  enum { MAXB = 5000 };
  static uint64_t keys[MAXB];
  static uint8_t le[8 * MAXB], made[MAXB];
  static float *rows[MAXB];
  static uint32_t idx[MAXB];
  const uint64_t edge[] = {0, UINT64_MAX, 1, UINT64_MAX - 1, (uint64_t)1 << 63, ((uint64_t)1 << 32) - 1,
                           (uint64_t)1 << 32};
  size_t total = 0;
  rng_state = 0x9E3779B97F4A7C15ull + rf;
  for (int round = 0; round < 120; round++) {
    size_t k = 1 + (size_t)(rnd() >> 20) % MAXB;
    for (size_t j = 0; j < k; j++) {
      uint64_t x = rnd();
      if ((x & 63) == 0) keys[j] = edge[(x >> 8) % (sizeof edge / sizeof edge[0])];
      else if ((x & 7) == 1 && j) keys[j] = keys[(x >> 16) % j]; /* a repeat */
      else if ((x & 7) == 2 && total) keys[j] = ps__rowmap_key_at(a, (size_t)(x >> 16) % ps__rowmap_count(a));
      else keys[j] = (x >> 44) * 0xD6E8FEB86659FD93ull; /* a universe of 2^20 keys: many repeats over rounds */
      for (int q = 0; q < 8; q++) le[8 * j + q] = (uint8_t)(keys[j] >> (8 * q));
    }
    size_t got = round % 2 ? ps__rowmap_upsert_many(b, NULL, le, k, rows, idx, made, zero)
                           : ps__rowmap_upsert_many(b, keys, NULL, k, rows, idx, made, zero);
    cr_assert(eq(sz, got, k));
    for (size_t j = 0; j < k; j++) {
      int created = -1;
      uint32_t at;
      float *r = ps__rowmap_upsert_at(a, keys[j], &created, &at);
      cr_assert(not(zero(ptr, r)));
      if (at != idx[j] || created != made[j] || rows[j] != ps__rowmap_row_at(b, idx[j]))
        cr_fatal("round %d key %zu (%llu): batch row %u created %u, scalar row %u created %d", round, j,
                 (unsigned long long)keys[j], idx[j], made[j], at, created);
      if (made[j]) {
        if (zero)
          for (size_t q = 0; q < rf; q++)
            if (rows[j][q] != 0.0f) cr_fatal("round %d key %zu: created row not zero-filled", round, j);
        for (size_t q = 0; q < rf; q++) rows[j][q] = (float)(keys[j] >> 40) + (float)q; /* the caller writes it */
      }
    }
    total += k;
  }
  cr_assert(eq(sz, ps__rowmap_count(a), ps__rowmap_count(b)));
  for (size_t i = 0; i < ps__rowmap_count(a); i++) {
    uint64_t k = ps__rowmap_key_at(a, i);
    float *r = ps__rowmap_get(b, k);
    if (ps__rowmap_key_at(b, i) != k || r != ps__rowmap_row_at(b, i) || r[0] != (float)(k >> 40))
      cr_fatal("row %zu differs", i);
  }
  for (size_t e = 0; e < sizeof edge / sizeof edge[0]; e++)
    cr_assert(eq(int, ps__rowmap_get(a, edge[e]) != NULL, ps__rowmap_get(b, edge[e]) != NULL));
  cr_log_info("rowmap: batch upsert: %zu keys, %zu rows", total, ps__rowmap_count(b));
  cr_assert(gt(sz, ps__rowmap_count(b), 100000), "the map grew through several index sizes");
  ps__rowmap_free(a);
  ps__rowmap_free(b);
}

Test(rowmap_batch, upsert_many_matches_scalar_one_float, .timeout = 60) { batch_matches_scalar(1, 1); }
Test(rowmap_batch, upsert_many_matches_scalar_wide_uninit, .timeout = 60) { batch_matches_scalar(9, 0); }

/* An empty map and an empty batch; a batch of one key repeated. */
Test(rowmap_batch, upsert_many_edges) {
  ps__rowmap *m = ps__rowmap_new(2);
  float *rows[40];
  uint32_t idx[40];
  uint8_t made[40];
  uint64_t keys[40];
  cr_assert(eq(sz, ps__rowmap_upsert_many(m, keys, NULL, 0, rows, idx, made, 1), 0));
  cr_assert(eq(sz, ps__rowmap_count(m), 0));
  for (int i = 0; i < 40; i++) keys[i] = UINT64_MAX;
  cr_assert(eq(sz, ps__rowmap_upsert_many(m, keys, NULL, 40, rows, NULL, made, 1), 40));
  cr_assert(eq(sz, ps__rowmap_count(m), 1));
  cr_assert(eq(u8, made[0], 1));
  for (int i = 1; i < 40; i++) {
    cr_assert(eq(u8, made[i], 0));
    cr_assert(eq(ptr, rows[i], rows[0]));
  }
  keys[0] = 0;
  cr_assert(eq(sz, ps__rowmap_upsert_many(m, keys, NULL, 2, rows, idx, NULL, 1), 2));
  cr_assert(eq(u32, idx[0], 1));
  cr_assert(eq(u32, idx[1], 0));
  cr_assert(eq(ptr, ps__rowmap_get(m, 0), rows[0]));
  ps__rowmap_free(m);
}

/* A new key repeated d keys later in one batch, for every distance d around the
 * pipeline's stages (1 to 40), on a map growing meanwhile: created once, at its first
 * place, and both places get its row. */
Test(rowmap_batch, upsert_many_repeats_at_every_distance) {
  enum { B = 512 };
  ps__rowmap *m = ps__rowmap_new(1);
  uint64_t keys[B];
  float *rows[B];
  uint32_t idx[B];
  uint8_t made[B];
  uint64_t next = 1;
  for (size_t round = 0; round < 400; round++) {
    size_t d = 1 + round % 40, before = ps__rowmap_count(m);
    for (size_t j = 0; j < B; j++) keys[j] = (j >= d && (j / d) % 2 == 1) ? keys[j - d] : (next++) * 0x9E3779B97F4A7C15ull;
    cr_assert(eq(sz, ps__rowmap_upsert_many(m, keys, NULL, B, rows, idx, made, 1), B));
    size_t fresh = 0;
    for (size_t j = 0; j < B; j++) {
      int repeat = j >= d && (j / d) % 2 == 1;
      if (made[j] != !repeat) cr_fatal("distance %zu: key %zu created %u", d, j, made[j]);
      if (repeat && (rows[j] != rows[j - d] || idx[j] != idx[j - d])) cr_fatal("distance %zu: key %zu", d, j);
      if (rows[j] != ps__rowmap_get(m, keys[j])) cr_fatal("distance %zu: key %zu not found", d, j);
      fresh += !repeat;
    }
    cr_assert(eq(sz, ps__rowmap_count(m), before + fresh));
  }
  cr_assert(gt(sz, ps__rowmap_count(m), 100000), "the map grew through several index sizes");
  ps__rowmap_free(m);
}

/* ps__rowmap_settle: while rows move, a budget below the rows left changes nothing; one
 * at least as large moves them all (the old index freed), every row still found. */
Test(rowmap_growth, settle_finishes_a_move_within_its_budget) {
  ps__rowmap *m = ps__rowmap_new(2);
  size_t n = 0;
  while (ps__rowmap_moving(m) < 5000) {
    float *r = ps__rowmap_upsert(m, key_of(n), NULL);
    cr_assert(not(zero(ptr, r)));
    fill_row(r, 2, n++);
  }
  size_t left = ps__rowmap_moving(m), before = ps__rowmap_bytes(m);
  cr_assert(eq(sz, ps__rowmap_settle(m, left - 1), 0));
  cr_assert(eq(sz, ps__rowmap_moving(m), left));
  cr_assert(eq(sz, ps__rowmap_settle(m, left), left));
  cr_assert(eq(sz, ps__rowmap_moving(m), 0));
  cr_assert(lt(sz, ps__rowmap_bytes(m), before), "the old index is freed");
  check_all(m, 2, n, "after settle");
  cr_assert(eq(sz, ps__rowmap_settle(m, SIZE_MAX), 0), "nothing moving: nothing to do");
  ps__rowmap_free(m);
}
