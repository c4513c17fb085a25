/*
 * test_shard.c - the shard engine without sockets or threads: the consistency models,
 * rounds and their batch-weighted mean, aggregation, the learning-rate schedule, the
 * live set, and the pending apply of dense pushes, driven through shard.h alone.
 *
 * Every table here starts at zero (init=zero) with plain sgd unless a test says
 * otherwise, so after one step w = -lr * g and each expected value is written out.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "shard/shard.h"

/* ---------------------------------------------------------------- the fixture */

typedef struct hooks_log {
  int releases;
  uint32_t armed_ms; /* the last arm_flush: ms asked for, 0 after a cancel */
  int arms, cancels;
  int rounds_done;
} hooks_log;

static hooks_log L;
static ps__shard *SH;

static void *t_alloc(void *arg, size_t n) {
  (void)arg;
  return malloc(n ? n : 1);
}
static void t_release(void *arg, void *buf, size_t n) {
  (void)arg, (void)n;
  free(buf);
  L.releases++;
}
static void t_arm(void *arg, ps__table *t, uint32_t ms) {
  (void)arg, (void)t;
  L.armed_ms = ms;
  if (ms) L.arms++;
  else L.cancels++;
}
static void t_round_done(void *arg, ps__table *t, void *token) {
  (void)arg, (void)t, (void)token;
  L.rounds_done++;
}

/* The cut hook: a copy of the table as it is at the cut. */
static ps__snap_table CUT;
static int cuts;
static int64_t cut_version;
static void t_cut(void *arg, ps__table *t) {
  (void)arg;
  cuts++;
  cut_version = t->version;
  ps__shard_snap_release(t->sh, &CUT);
  cr_assert(eq(int, ps__shard_snap(t, &CUT, 0), 0));
}

/* Row i of a snapshot (read once), its first float. */
static float snap_first(ps__snap_table *s, uint64_t i) {
  float row[64];
  cr_assert(s->row_floats <= 64);
  cr_assert(eq(int, ps__snap_read(s, i, row), 0));
  return row[0];
}

static void setup(void) {
  memset(&L, 0, sizeof L);
  ps__shard_hooks h = {.alloc = t_alloc, .release = t_release, .arm_flush = t_arm, .round_done = t_round_done,
                       .cut = t_cut};
  cuts = 0;
  memset(&CUT, 0, sizeof CUT);
  SH = ps__shard_new(&h);
  cr_assert(SH != NULL);
}
static void teardown(void) {
  ps__shard_snap_release(SH, &CUT);
  ps__shard_free(SH);
}

TestSuite(shard, .init = setup, .fini = teardown, .timeout = 30);

static ps__table *create(uint32_t id, int kind, uint64_t size, const char *opts) {
  ps__declare d = {.id = id, .kind = (uint8_t)kind, .size = size};
  snprintf(d.name, sizeof d.name, "t%u", id);
  snprintf(d.options, sizeof d.options, "%s", opts);
  ps__verdict v;
  int st = ps__shard_create(SH, &d, &v);
  cr_assert(eq(int, st, PS__APPLIED), "create '%s': %s", opts, v.msg);
  return ps__shard_table(SH, id);
}

/* Workers 1..k are live, the job has started. */
static void start(uint32_t k) {
  for (uint32_t i = 1; i <= k; i++) ps__shard_member(SH, i, 1);
  ps__shard_set_started(SH, 1);
}

static void put_keys(uint8_t *b, const uint64_t *k, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    for (int j = 0; j < 8; j++) b[8 * i + j] = (uint8_t)(k[i] >> (8 * j));
}

/* A sparse push of one key with one float. */
static int push1(uint32_t table, uint32_t sender, int64_t clock, uint32_t batch, uint64_t key, float g, ps__verdict *v) {
  uint8_t kb[8];
  put_keys(kb, &key, 1);
  ps__push p = {.table = table, .sender = sender, .batch = batch, .clock = clock, .lr = -1.0f, .keys = kb,
                .nkeys = 1, .vals = &g, .nvals = 1};
  return ps__shard_push(SH, &p, NULL, v);
}

static void push1_ok(uint32_t table, uint32_t sender, int64_t clock, uint32_t batch, uint64_t key, float g) {
  ps__verdict v;
  int st = push1(table, sender, clock, batch, key, g, &v);
  cr_assert(eq(int, st, PS__APPLIED), "push of worker %u at clock %lld: status %d (%s)", sender, (long long)clock, st,
            st == PS__REJECTED ? v.msg : "");
}

static float row1(ps__table *t, uint64_t key) {
  uint8_t kb[8];
  float out = NAN;
  put_keys(kb, &key, 1);
  cr_assert(eq(int, ps__shard_read_rows(t, kb, 0, 1, &out), 0));
  return out;
}

#define SPARSE1 "init=zero lr=1"

/* ---------------------------------------------------------------- sync */

Test(shard, sync_round_closes_when_every_live_worker_clocked_and_only_then) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=sync");
  start(3);
  push1_ok(1, 1, 0, 10, 7, 1.0f);
  push1_ok(1, 2, 0, 30, 7, 3.0f);
  push1_ok(1, 3, 0, 60, 9, 2.0f); /* worker 3 touches another row */
  cr_assert(not(ps__shard_pull_ready(SH, t, 1)));
  ps__shard_clock(SH, 1, 1);
  ps__shard_clock(SH, 2, 1);
  cr_assert(eq(i64, t->version, 0), "the round closed before worker 3 clocked");
  cr_assert(eq(flt, row1(t, 7), 0.0f));
  cr_assert(not(ps__shard_pull_ready(SH, t, 1)));
  ps__shard_clock(SH, 3, 1);
  cr_assert(eq(i64, t->version, 1));
  cr_assert(ps__shard_pull_ready(SH, t, 1));
  cr_assert(eq(int, L.rounds_done, 1));
  /* batch-weighted mean over the whole round's batch (100): row 7 (10*1 + 30*3) / 100,
   * row 9 60*2 / 100 (workers that did not touch it count as zero) */
  cr_assert(ieee_ulp_eq(flt, row1(t, 7), -1.0f, 4), "row 7 = %g", row1(t, 7));
  cr_assert(ieee_ulp_eq(flt, row1(t, 9), -1.2f, 4), "row 9 = %g", row1(t, 9));
  cr_assert(eq(u64, t->applied, 1));
  cr_assert(eq(u64, t->pushes, 3));
  cr_assert(ieee_ulp_eq(dbl, t->last_batch, 100.0, 4));
}

Test(shard, sync_sum_mode_adds_the_gradients) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " update=sum");
  start(2);
  push1_ok(1, 1, 0, 5, 1, 1.5f);
  push1_ok(1, 2, 0, 7, 1, 2.5f);
  ps__shard_clock(SH, 1, 1);
  ps__shard_clock(SH, 2, 1);
  cr_assert(ieee_ulp_eq(flt, row1(t, 1), -4.0f, 4));
}

Test(shard, sync_rejects_pushes_outside_the_round_window) {
  create(1, PS_SPARSE, 1, SPARSE1);
  start(2);
  ps__verdict v;
  cr_assert(eq(int, push1(1, 1, 1, 1, 1, 1.0f, &v), PS__REJECTED), "a push from the future was taken");
  cr_assert(eq(int, v.err, PS_ERR_CLOCK));
  cr_assert(strstr(v.msg, "from the future") != NULL, "%s", v.msg);
  push1_ok(1, 1, 0, 1, 1, 1.0f);
  push1_ok(1, 2, 0, 1, 1, 1.0f);
  ps__shard_clock(SH, 1, 1);
  ps__shard_clock(SH, 2, 1);
  /* round 0 is applied: a push for clock 0 now is late, and plain sync rejects it */
  cr_assert(eq(int, push1(1, 1, 0, 1, 1, 1.0f, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_CLOCK));
  cr_assert(strstr(v.msg, "already applied round 0") != NULL, "%s", v.msg);
  cr_assert(eq(u64, SH->rejected_clock, 2));
  /* mean mode needs a batch */
  cr_assert(eq(int, push1(1, 1, 1, 0, 1, 1.0f, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_INVALID));
}

Test(shard, sync_every_n_applies_one_step_per_n_clocks) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " every=2");
  start(1);
  push1_ok(1, 1, 0, 4, 3, 1.0f);
  ps__shard_clock(SH, 1, 1);
  cr_assert(eq(i64, t->version, 0));
  push1_ok(1, 1, 1, 4, 3, 3.0f);
  ps__shard_clock(SH, 1, 2);
  cr_assert(eq(i64, t->version, 1));
  /* one step with 2x the mean over both clocks' pushes: (4*1 + 4*3) / 4 = 4 */
  cr_assert(ieee_ulp_eq(flt, row1(t, 3), -4.0f, 4), "%g", row1(t, 3));
  cr_assert(eq(u64, t->step, 1));
}

Test(shard, sync_m_drops_late_pushes_and_counts_them) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=sync:2");
  start(3);
  push1_ok(1, 1, 0, 1, 5, 2.0f);
  push1_ok(1, 2, 0, 1, 5, 4.0f);
  ps__shard_clock(SH, 1, 1);
  cr_assert(eq(i64, t->version, 0));
  ps__shard_clock(SH, 2, 1); /* the first M = 2 of 3 */
  cr_assert(eq(i64, t->version, 1));
  cr_assert(ieee_ulp_eq(flt, row1(t, 5), -3.0f, 4), "normalised by the accepted batches: %g", row1(t, 5));
  ps__verdict v;
  cr_assert(eq(int, push1(1, 3, 0, 1, 5, 100.0f, &v), PS__DROPPED));
  cr_assert(eq(u64, t->dropped, 1));
  cr_assert(ieee_ulp_eq(flt, row1(t, 5), -3.0f, 4), "a dropped push changed the row");
  /* the straggler's pull comes back at the table's clock, and it is moved up to it */
  cr_assert(eq(i64, ps__shard_pull_answered(SH, t, 3, 0), 1));
  cr_assert(eq(i64, ps__shard_worker(SH, 3)->clock, 1));
}

Test(shard, a_worker_leaving_mid_round_completes_the_round_with_the_others) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1);
  start(3);
  push1_ok(1, 1, 0, 10, 1, 1.0f);
  push1_ok(1, 2, 0, 10, 1, 3.0f);
  push1_ok(1, 3, 0, 20, 1, 6.0f); /* pushed, then died before its CLOCK */
  ps__shard_clock(SH, 1, 1);
  ps__shard_clock(SH, 2, 1);
  cr_assert(eq(i64, t->version, 0));
  ps__shard_member(SH, 3, 0);
  ps__shard_advance(SH);
  cr_assert(eq(i64, t->version, 1));
  /* what it pushed before dying stays in its round: (10 + 30 + 120) / 40 */
  cr_assert(ieee_ulp_eq(flt, row1(t, 1), -4.0f, 4), "%g", row1(t, 1));
  ps__verdict v;
  cr_assert(eq(int, push1(1, 3, 1, 1, 1, 1.0f, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_UNAVAILABLE));
  /* the next round needs only workers 1 and 2 */
  ps__shard_clock(SH, 1, 2);
  ps__shard_clock(SH, 2, 2);
  cr_assert(eq(i64, t->version, 2));
}

Test(shard, a_sender_the_membership_never_listed_holds_no_round) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1);
  start(1);
  push1_ok(1, 1, 0, 1, 1, 1.0f);
  push1_ok(1, 99, 0, 1, 1, 1.0f); /* a stray id: pending, never waited for */
  ps__shard_clock(SH, 1, 1);
  cr_assert(eq(i64, t->version, 1));
  cr_assert(ps__shard_worker(SH, 99)->pending);
}

/* Before this server hears of the job's start no round is applied: a sync pull past
 * the first round waits for its rounds (the workers may have started already), and is
 * answered once the start came and the clocks it needs are in. An async pull is
 * answered at once. */
Test(shard, a_sync_pull_before_the_job_starts_waits_for_its_rounds) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1);
  ps__table *a = create(2, PS_SPARSE, 1, SPARSE1 " mode=async");
  ps__shard_member(SH, 1, 1);
  cr_assert(ps__shard_pull_ready(SH, t, 0), "the first round needs nothing applied");
  cr_assert(not(ps__shard_pull_ready(SH, t, 2)));
  cr_assert(ps__shard_pull_ready(SH, a, 5));
  ps__shard_clock(SH, 1, 1);
  ps__shard_clock(SH, 1, 2);
  cr_assert(eq(i64, t->version, 0), "no round before the start");
  cr_assert(not(ps__shard_pull_ready(SH, t, 2)));
  ps__shard_set_started(SH, 1);
  cr_assert(eq(i64, t->version, 2));
  cr_assert(ps__shard_pull_ready(SH, t, 2));
  cr_assert(not(ps__shard_pull_ready(SH, t, 3)));
}

/* ---------------------------------------------------------------- ssp */

Test(shard, ssp_blocks_a_pull_beyond_the_bound_and_releases_it) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=ssp:2");
  start(2);
  for (int c = 1; c <= 4; c++) ps__shard_clock(SH, 1, c);
  cr_assert(ps__shard_pull_ready(SH, t, 2), "within the bound of the slowest (0)");
  cr_assert(not(ps__shard_pull_ready(SH, t, 3)), "clock 3 is more than 2 ahead of 0");
  cr_assert(not(ps__shard_pull_ready(SH, t, 4)));
  ps__shard_clock(SH, 2, 1);
  cr_assert(ps__shard_pull_ready(SH, t, 3));
  cr_assert(not(ps__shard_pull_ready(SH, t, 4)));
  ps__verdict v;
  cr_assert(eq(int, ps__shard_pull(SH, 1, 4, &v), PS__WAIT));
  ps__shard_member(SH, 2, 0); /* the slow worker leaves: only worker 1 counts */
  cr_assert(ps__shard_pull_ready(SH, t, 4));
  cr_assert(eq(int, ps__shard_pull(SH, 1, 4, &v), PS__APPLIED));
  cr_assert(eq(int, ps__shard_pull(SH, 9, 4, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_NO_TABLE));
  /* pushes apply on arrival and their staleness is recorded */
  push1_ok(1, 1, 4, 1, 1, 1.0f);
  push1_ok(1, 1, 2, 1, 1, 1.0f);
  cr_assert(ieee_ulp_eq(flt, row1(t, 1), -2.0f, 4));
  cr_assert(eq(u64, SH->push_stale[0], 1));
  cr_assert(eq(u64, SH->push_stale[2], 1));
  cr_assert(eq(i64, SH->push_stale_max, 2));
}

/* ---------------------------------------------------------------- async */

Test(shard, async_applies_each_push_at_once) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=async");
  start(2);
  push1_ok(1, 1, 0, 8, 1, 1.0f);
  cr_assert(ieee_ulp_eq(flt, row1(t, 1), -1.0f, 4));
  push1_ok(1, 2, 0, 8, 1, 0.5f);
  cr_assert(ieee_ulp_eq(flt, row1(t, 1), -1.5f, 4));
  cr_assert(eq(u64, t->applied, 2));
  cr_assert(ps__shard_pull_ready(SH, t, 1000));
  /* the global batch of a push on its own: its batch times the live workers */
  cr_assert(ieee_ulp_eq(dbl, t->last_batch, 16.0, 4));
}

Test(shard, async_aggregation_applies_the_batch_weighted_mean_after_n_pushes) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=async agg_n=3");
  start(3);
  push1_ok(1, 1, 0, 10, 1, 1.0f);
  push1_ok(1, 2, 0, 30, 1, 2.0f);
  cr_assert(eq(flt, row1(t, 1), 0.0f), "applied before N pushes");
  push1_ok(1, 3, 0, 60, 2, 5.0f);
  /* per row, the mean over the pushes that touched it: row 1 (10 + 60) / 40, row 2 5 */
  cr_assert(ieee_ulp_eq(flt, row1(t, 1), -1.75f, 4), "%g", row1(t, 1));
  cr_assert(ieee_ulp_eq(flt, row1(t, 2), -5.0f, 4), "%g", row1(t, 2));
  cr_assert(eq(u64, t->applied, 1));
  cr_assert(eq(u32, t->agg_count, 0));
}

Test(shard, async_aggregation_by_time_asks_the_owner_for_a_timer) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=async agg_ms=25");
  start(2);
  push1_ok(1, 1, 0, 1, 1, 2.0f);
  cr_assert(eq(u32, L.armed_ms, 25));
  push1_ok(1, 2, 0, 3, 1, 6.0f);
  cr_assert(eq(int, L.arms, 1), "armed again while armed");
  cr_assert(eq(flt, row1(t, 1), 0.0f));
  ps__shard_agg_flush(t); /* what the owner's timer does when it fires */
  cr_assert(ieee_ulp_eq(flt, row1(t, 1), -5.0f, 4), "(1*2 + 3*6) / 4: %g", row1(t, 1));
  cr_assert(eq(int, L.cancels, 1));
  push1_ok(1, 1, 0, 1, 1, 1.0f);
  cr_assert(eq(int, L.arms, 2), "a new buffer arms a new timer");
}

Test(shard, async_non_sgd_sums_repeated_keys_before_the_step) {
  ps__table *t = create(1, PS_SPARSE, 1, "init=zero lr=1 mode=async opt=adagrad eps=0");
  start(1);
  uint64_t keys[2] = {4, 4};
  uint8_t kb[16];
  float g[2] = {1.0f, 2.0f};
  put_keys(kb, keys, 2);
  ps__push p = {.table = 1, .sender = 1, .batch = 1, .clock = 0, .lr = -1.0f, .keys = kb, .nkeys = 2, .vals = g,
                .nvals = 2};
  ps__verdict v;
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__APPLIED));
  /* one adagrad step with g = 3: acc = 9, w = -3 / sqrt(9) = -1 */
  cr_assert(ieee_ulp_eq(flt, row1(t, 4), -1.0f, 4), "%g", row1(t, 4));
}

/* ---------------------------------------------------------------- the schedule */

Test(shard, the_learning_rate_schedule_follows_the_steps_and_a_push_rate_overrides_it) {
  ps__table *t = create(1, PS_SPARSE, 1, "init=zero lr=1 mode=async warmup=4 ref_batch=8");
  start(2);
  push1_ok(1, 1, 0, 4, 1, 1.0f); /* global batch 4 * 2 live workers = 8: no scaling */
  cr_assert(ieee_ulp_eq(flt, t->last_lr, 0.25f, 4), "warm-up step 1 of 4: %g", t->last_lr);
  push1_ok(1, 1, 0, 4, 1, 1.0f);
  cr_assert(ieee_ulp_eq(flt, t->last_lr, 0.5f, 4), "%g", t->last_lr);
  push1_ok(1, 1, 0, 8, 1, 1.0f); /* global batch 16: twice the rate */
  cr_assert(ieee_ulp_eq(flt, t->last_lr, 1.5f, 4), "%g", t->last_lr);
  push1_ok(1, 1, 0, 4, 1, 1.0f);
  push1_ok(1, 1, 0, 4, 1, 1.0f);
  cr_assert(ieee_ulp_eq(flt, t->last_lr, 1.0f, 4), "after warm-up: %g", t->last_lr);
  cr_assert(ieee_ulp_eq(flt, row1(t, 1), -(0.25f + 0.5f + 1.5f + 1.0f + 1.0f), 4), "%g", row1(t, 1));
  uint8_t kb[8];
  uint64_t key = 1;
  float g = 1.0f;
  put_keys(kb, &key, 1);
  ps__push p = {.table = 1, .sender = 1, .batch = 4, .clock = 0, .lr = 0.125f, .keys = kb, .nkeys = 1, .vals = &g,
                .nvals = 1};
  ps__verdict v;
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__APPLIED));
  cr_assert(eq(flt, t->last_lr, 0.125f));
}

Test(shard, a_sync_round_uses_the_schedule_at_its_step_with_its_global_batch) {
  ps__table *t = create(1, PS_SPARSE, 1, "init=zero lr=0.5 ref_batch=10 decay=step:1:0.5");
  start(2);
  for (int c = 0; c < 3; c++) {
    push1_ok(1, 1, c, 10, 1, 1.0f);
    push1_ok(1, 2, c, 10, 1, 1.0f);
    ps__shard_clock(SH, 1, c + 1);
    ps__shard_clock(SH, 2, c + 1);
  }
  /* global batch 20 = 2x ref: 1.0, then halved each step */
  cr_assert(ieee_ulp_eq(flt, t->last_lr, 0.25f, 4), "%g", t->last_lr);
  cr_assert(ieee_ulp_eq(flt, row1(t, 1), -1.75f, 4), "%g", row1(t, 1));
}

/* ---------------------------------------------------------------- dense */

static void put_seg(uint8_t *b, uint64_t off, uint64_t cnt) {
  uint64_t k[2] = {off, cnt};
  put_keys(b, k, 2);
}

Test(shard, a_dense_async_push_is_taken_and_applied_after_its_acknowledgement) {
  ps__table *t = create(1, PS_DENSE, 1000, "init=zero lr=1 mode=async slice=100");
  start(1);
  size_t len = 16 + 250 * 4;
  uint8_t *body = malloc(len);
  put_seg(body, 50, 250);
  float *g = (float *)(body + 16);
  for (int i = 0; i < 250; i++) g[i] = (float)i;
  ps__push p = {.table = 1, .sender = 1, .batch = 1, .clock = 0, .lr = -1.0f, .keys = body, .nkeys = 2, .vals = g,
                .nvals = 250};
  ps__owned own = {body, len};
  ps__verdict v;
  cr_assert(eq(int, ps__shard_push(SH, &p, &own, &v), PS__APPLIED));
  cr_assert(own.buf == NULL, "the body was not taken");
  cr_assert(v.later);
  cr_assert(t->pend.active);
  cr_assert(eq(u64, SH->npending, 1));
  ps__shard_pending_step(t, 60); /* part of it: into slice 0 and 1 */
  cr_assert(eq(u64, t->pend.done, 60));
  ps__shard_flush(t);
  cr_assert(not(t->pend.active));
  cr_assert(eq(int, L.releases, 1));
  cr_assert(eq(u64, SH->npending, 0));
  for (uint64_t e = 0; e < 1000; e++) {
    float *row = ps__rowmap_get(t->params, e / 100);
    float want = e >= 50 && e < 300 ? -(float)(e - 50) : 0.0f;
    float got = row ? row[e % 100] : 0.0f;
    cr_assert(eq(flt, got, want), "element %llu", (unsigned long long)e);
  }
}

Test(shard, a_dense_async_push_without_a_body_to_take_is_applied_at_once) {
  /* values the caller only lends (a member reading them in place in its predecessor's
   * shared buffer): applied before the push returns, nothing taken or released */
  ps__table *t = create(1, PS_DENSE, 1000, "init=zero lr=1 mode=async slice=100");
  start(1);
  uint8_t keys[16];
  put_seg(keys, 150, 200);
  float g[200];
  for (int i = 0; i < 200; i++) g[i] = (float)i;
  ps__push p = {.table = 1, .sender = 1, .batch = 1, .clock = 0, .lr = -1.0f, .keys = keys, .nkeys = 2, .vals = g,
                .nvals = 200};
  ps__owned own = {NULL, 0};
  ps__verdict v;
  cr_assert(eq(int, ps__shard_push(SH, &p, &own, &v), PS__APPLIED));
  cr_assert(not(v.later));
  cr_assert(not(t->pend.active));
  cr_assert(eq(u64, SH->npending, 0));
  cr_assert(eq(int, L.releases, 0));
  for (uint64_t e = 0; e < 1000; e++) {
    float *row = ps__rowmap_get(t->params, e / 100);
    float want = e >= 150 && e < 350 ? -(float)(e - 150) : 0.0f;
    float got = row ? row[e % 100] : 0.0f;
    cr_assert(eq(flt, got, want), "element %llu", (unsigned long long)e);
  }
}

Test(shard, a_dense_sync_round_averages_the_segments_of_each_worker) {
  ps__table *t = create(1, PS_DENSE, 10, "init=zero lr=1 slice=4");
  start(2);
  uint8_t seg[16];
  float a[10], b[6];
  for (int i = 0; i < 10; i++) a[i] = 1.0f;
  for (int i = 0; i < 6; i++) b[i] = 3.0f;
  put_seg(seg, 0, 10);
  ps__push p = {.table = 1, .sender = 1, .batch = 1, .clock = 0, .lr = -1.0f, .keys = seg, .nkeys = 2, .vals = a,
                .nvals = 10};
  ps__verdict v;
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__APPLIED));
  uint8_t seg2[16];
  put_seg(seg2, 4, 6);
  ps__push q = {.table = 1, .sender = 2, .batch = 1, .clock = 0, .lr = -1.0f, .keys = seg2, .nkeys = 2, .vals = b,
                .nvals = 6};
  cr_assert(eq(int, ps__shard_push(SH, &q, NULL, &v), PS__APPLIED));
  ps__shard_clock(SH, 1, 1);
  ps__shard_clock(SH, 2, 1);
  for (uint64_t e = 0; e < 10; e++) {
    float *row = ps__rowmap_get(t->params, e / 4);
    cr_assert(row != NULL);
    float want = e < 4 ? -0.5f : -2.0f; /* (1 + 0) / 2 and (1 + 3) / 2 */
    cr_assert(ieee_ulp_eq(flt, row[e % 4], want, 4), "element %llu: %g", (unsigned long long)e, row[e % 4]);
  }
}

/* ---------------------------------------------------------------- tables */

Test(shard, create_is_idempotent_and_refuses_a_conflicting_spec) {
  create(3, PS_SPARSE, 4, "lr=0.1");
  create(3, PS_SPARSE, 4, "lr=0.1");
  ps__declare d = {.id = 3, .kind = PS_SPARSE, .size = 4};
  snprintf(d.name, sizeof d.name, "t3");
  snprintf(d.options, sizeof d.options, "lr=0.2");
  ps__verdict v;
  cr_assert(eq(int, ps__shard_create(SH, &d, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_CONFLICT));
  snprintf(d.options, sizeof d.options, "opt=nonsense");
  d.id = 4;
  cr_assert(eq(int, ps__shard_create(SH, &d, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_CONFIG), "%s", v.msg);
  d.id = 0;
  cr_assert(eq(int, ps__shard_create(SH, &d, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_INVALID));
  ps__push p = {.table = 77, .sender = 1, .batch = 1};
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_NO_TABLE));
}

Test(shard, a_table_created_mid_job_starts_at_the_current_round) {
  start(2);
  for (int c = 1; c <= 3; c++) {
    ps__shard_clock(SH, 1, c);
    ps__shard_clock(SH, 2, c);
  }
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1);
  cr_assert(eq(i64, t->version, 3));
  push1_ok(1, 1, 3, 1, 1, 1.0f);
}

/* ---------------------------------------------------------------- checkpoints */

static void sync_round(int c, float g1, float g2) {
  push1_ok(1, 1, c, 1, 5, g1);
  push1_ok(1, 2, c, 1, 6, g2);
  ps__shard_clock(SH, 1, c + 1);
  ps__shard_clock(SH, 2, c + 1);
}

Test(shard, a_sync_table_is_cut_at_the_checkpoint_clock_before_the_next_round) {
  ps__table *t = create(1, PS_SPARSE, 1, "init=zero lr=1 opt=adam");
  start(2);
  sync_round(0, 1.0f, 2.0f);
  cr_assert(eq(int, ps__shard_cut_at(SH, t, 2), 0));
  cr_assert(eq(int, cuts, 0), "cut before the clock");
  /* worker 1's push for clock 2 arrives before round 1 closes: not in the cut */
  push1_ok(1, 1, 1, 1, 5, 3.0f);
  push1_ok(1, 2, 1, 1, 6, 3.0f);
  ps__shard_clock(SH, 1, 2);
  push1_ok(1, 1, 2, 1, 5, 100.0f);
  cr_assert(eq(int, cuts, 0));
  ps__shard_clock(SH, 2, 2); /* round 1 applied: version 2, the cut */
  cr_assert(eq(int, cuts, 1));
  cr_assert(eq(i64, cut_version, 2));
  cr_assert(eq(u64, CUT.n, 2));
  cr_assert(eq(u64, CUT.step, 2));
  cr_assert(eq(u32, CUT.row_floats, 3), "adam: parameter and two moments");
  float w5 = row1(t, 5);
  for (uint64_t i = 0; i < CUT.n; i++)
    if (ps__snap_key(&CUT, i) == 5) cr_assert(eq(flt, snap_first(&CUT, i), w5), "the cut holds round 1's result");
  push1_ok(1, 2, 2, 1, 5, 1.0f);
  ps__shard_clock(SH, 1, 3);
  ps__shard_clock(SH, 2, 3);
  cr_assert(eq(int, cuts, 1), "cut once");
  cr_assert(not(eq(flt, row1(t, 5), w5)), "round 2 applied after the cut");
  /* too late: the table is at clock 3 */
  cr_assert(eq(int, ps__shard_cut_at(SH, t, 2), PS_ERR_CLOCK));
  cr_assert(eq(int, ps__shard_cut_at(SH, t, 3), 0));
  cr_assert(eq(int, cuts, 2), "at the clock already: cut at once");
}

Test(shard, an_every_n_table_is_cut_at_its_next_round_boundary) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " every=2");
  start(1);
  cr_assert(eq(i64, ps__shard_cut_clock(t, 3), 4));
  cr_assert(eq(i64, ps__shard_cut_clock(t, 4), 4));
  cr_assert(eq(int, ps__shard_cut_at(SH, t, 3), 0));
  for (int c = 0; c < 4; c++) {
    push1_ok(1, 1, c, 1, 1, 1.0f);
    ps__shard_clock(SH, 1, c + 1);
    cr_assert(eq(int, cuts, c == 3), "clock %d", c + 1);
  }
  cr_assert(eq(i64, cut_version, 2));
}

Test(shard, an_async_table_is_cut_at_once_with_every_acknowledged_push) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=async agg_n=10");
  start(1);
  push1_ok(1, 1, 0, 1, 9, 2.0f);
  cr_assert(eq(flt, row1(t, 9), 0.0f), "buffered");
  cr_assert(eq(int, ps__shard_cut_at(SH, t, 123), 0));
  cr_assert(eq(int, cuts, 1));
  cr_assert(eq(u64, CUT.n, 1));
  cr_assert(eq(flt, snap_first(&CUT, 0), -2.0f), "the buffer was applied before the cut");
}

Test(shard, imported_rows_continue_as_the_saved_ones_would) {
  /* Two engines: one trains 3 rounds, is cut after 2; the other imports the cut and
   * trains the third round: both end bit-identical (parameters and adam moments). */
  ps__table *t = create(1, PS_SPARSE, 1, "init=normal:0.1 seed=3 lr=0.1 opt=adam");
  start(2);
  cr_assert(eq(int, ps__shard_cut_at(SH, t, 2), 0));
  sync_round(0, 1.0f, -2.0f);
  sync_round(1, 0.5f, 0.25f);
  cr_assert(eq(int, cuts, 1));
  sync_round(2, -1.5f, 4.0f);
  ps__snap_table saved = CUT;
  memset(&CUT, 0, sizeof CUT);
  ps__shard *a = SH;
  setup();
  ps__table *u = create(1, PS_SPARSE, 1, "init=normal:0.1 seed=3 lr=0.1 opt=adam");
  SH->base_clock = 2;
  start(2);
  for (uint64_t i = 0; i < saved.n; i++) { /* read after round 3 changed them: the saved values */
    float row[3];
    cr_assert(eq(int, ps__snap_read(&saved, i, row), 0));
    cr_assert(eq(int, ps__shard_import(u, ps__snap_key(&saved, i), row), 0));
  }
  u->step = saved.step;
  u->version = saved.version;
  cr_assert(eq(i64, ps__shard_worker(SH, 1)->clock, 2), "workers start at the restored clock");
  sync_round(2, -1.5f, 4.0f);
  for (uint64_t k = 5; k <= 6; k++) {
    float *x = ps__rowmap_get(t->params, k), *y = ps__rowmap_get(u->params, k);
    cr_assert(x && y);
    cr_assert(eq(int, memcmp(x, y, 3 * sizeof *x), 0), "row %llu differs", (unsigned long long)k);
  }
  cr_assert(eq(u64, t->step, u->step));
  ps__shard_snap_release(a, &saved);
  ps__shard_free(a);
}

Test(shard, a_sync_step_counts_rounds_not_the_rounds_this_shard_had_rows_in) {
  /* Adam's bias correction must not depend on which server holds a row: a round in
   * which this shard got no row still counts as a step of the table. */
  ps__table *t = create(1, PS_SPARSE, 1, "init=zero lr=0.1 opt=adam");
  start(1);
  push1_ok(1, 1, 0, 1, 5, 1.0f);
  ps__shard_clock(SH, 1, 1);
  ps__shard_clock(SH, 1, 2); /* round 1: no rows here */
  push1_ok(1, 1, 2, 1, 5, 1.0f);
  ps__shard_clock(SH, 1, 3);
  cr_assert(eq(u64, t->step, 3), "the third round is step 3 (got %llu)", (unsigned long long)t->step);
  cr_assert(eq(u64, t->applied, 2));
}

/* ---------------------------------------------------------------- cuts that copy nothing */

#define DIM4 4u

/* An async sgd push of one row of DIM4 floats, all g. */
static void push4(uint32_t table, uint64_t key, float g) {
  uint8_t kb[8];
  float v[DIM4] = {g, g, g, g};
  put_keys(kb, &key, 1);
  ps__push p = {.table = table, .sender = 1, .batch = 1, .clock = 0, .lr = -1.0f, .keys = kb, .nkeys = 1,
                .vals = v, .nvals = DIM4};
  ps__verdict vd;
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &vd), PS__APPLIED));
}

/* Row i of snapshot s equals expected (DIM4 floats), read once. */
static void snap_row_is(ps__snap_table *s, uint64_t i, const float *expected) {
  float got[DIM4];
  cr_assert(eq(int, ps__snap_read(s, i, got), 0));
  for (unsigned j = 0; j < DIM4; j++)
    cr_assert(eq(flt, got[j], expected[j]), "row %llu (key %llu): %g, not %g", (unsigned long long)i,
              (unsigned long long)ps__snap_key(s, i), got[j], expected[j]);
}

Test(shard, a_cut_reads_the_rows_as_they_were_while_they_change) {
  ps__table *t = create(1, PS_SPARSE, DIM4, "init=zero lr=1 mode=async");
  start(1);
  for (uint64_t k = 0; k < 100; k++) push4(1, k, (float)k);
  float was[100][DIM4];
  for (uint64_t i = 0; i < 100; i++) memcpy(was[i], ps__rowmap_row_at(t->params, i), sizeof was[i]);
  ps__snap_table s;
  cr_assert(eq(int, ps__shard_snap(t, &s, 0), 0));
  cr_assert(s.cut != NULL, "rows of 4 floats are read in place, not copied");
  cr_assert(eq(u64, s.n, 100));
  cr_assert(t->watch);
  for (uint64_t i = 0; i < 50; i++) snap_row_is(&s, i, was[i]); /* the writer reads half */
  for (uint64_t k = 0; k < 100; k++) push4(1, k, 1000.0f);      /* every row changes */
  for (uint64_t k = 100; k < 110; k++) push4(1, k, 1.0f);       /* and rows are created */
  for (uint64_t i = 50; i < 100; i++) snap_row_is(&s, i, was[i]); /* the saved values */
  float row[DIM4];
  cr_assert(eq(int, ps__snap_read(&s, 3, row), PS_ERR_INVALID), "a row is read once");
  cr_assert(eq(flt, ps__rowmap_get(t->params, 7)[0], was[7][0] - 1000.0f), "the table moved on");
  ps__shard_snap_release(SH, &s);
  cr_assert(t->cut == NULL);
  cr_assert(not(t->watch), "nothing watched once the cut is released");
  cr_assert(eq(int, ps__shard_snap(t, &s, 0), 0), "a second cut after the first");
  cr_assert(eq(u64, s.n, 110));
  ps__shard_snap_release(SH, &s);
}

Test(shard, a_second_cut_while_one_is_read_is_refused) {
  ps__table *t = create(1, PS_SPARSE, DIM4, "init=zero lr=1 mode=async");
  start(1);
  push4(1, 1, 1.0f);
  ps__snap_table a, b;
  cr_assert(eq(int, ps__shard_snap(t, &a, 0), 0));
  cr_assert(eq(int, ps__shard_snap(t, &b, 0), PS_ERR_UNAVAILABLE));
  ps__snap_table_free(&b);
  ps__shard_snap_release(SH, &a);
}

Test(shard, tracked_tables_know_the_rows_changed_since_their_last_cut) {
  ps__table *t = create(1, PS_SPARSE, DIM4, "init=zero lr=1 mode=async");
  start(1);
  for (uint64_t k = 0; k < 64; k++) push4(1, k, 1.0f);
  ps__snap_table s;
  cr_assert(eq(int, ps__shard_snap(t, &s, 1), 0));
  cr_assert(eq(ptr, s.dirty, NULL), "not tracked before the first cut: every row");
  for (uint64_t i = 0; i < s.n; i++) cr_assert(ps__snap_dirty(&s, i));
  ps__shard_snap_release(SH, &s);
  cr_assert(t->track && t->watch);
  push4(1, 3, 2.0f);
  push4(1, 40, 2.0f);
  push4(1, 3, 2.0f);
  uint8_t kb[8];
  float pulled[DIM4];
  uint64_t k200 = 200;
  put_keys(kb, &k200, 1);
  cr_assert(eq(int, ps__shard_read_rows(t, kb, 0, 1, pulled), 0)); /* a pull creates a row: new, so changed */
  cr_assert(eq(int, ps__shard_snap(t, &s, 1), 0));
  cr_assert(s.dirty != NULL);
  cr_assert(eq(u64, s.n, 65));
  for (uint64_t i = 0; i < s.n; i++) {
    uint64_t key = ps__snap_key(&s, i);
    cr_assert(eq(int, ps__snap_dirty(&s, i), key == 3 || key == 40 || key == 200), "key %llu",
              (unsigned long long)key);
  }
  ps__shard_snap_release(SH, &s);
  /* nothing changed since: an empty set; tracking off forgets it */
  cr_assert(eq(int, ps__shard_snap(t, &s, 0), 0));
  for (uint64_t i = 0; i < s.n; i++) cr_assert(not(ps__snap_dirty(&s, i)));
  ps__shard_snap_release(SH, &s);
  cr_assert(eq(int, t->track || t->watch, 0));
}

Test(shard, a_table_dropped_while_its_cut_is_read_leaves_its_rows_to_the_cut) {
  ps__table *t = create(1, PS_SPARSE, DIM4, "init=zero lr=1 mode=async");
  start(1);
  for (uint64_t k = 0; k < 300; k++) push4(1, k, (float)k);
  ps__snap_table s;
  cr_assert(eq(int, ps__shard_snap(t, &s, 1), 0));
  ps__shard_drop(SH, 1);
  cr_assert(eq(ptr, ps__shard_table(SH, 1), NULL));
  for (uint64_t i = 0; i < s.n; i++) {
    float want[DIM4];
    float v = -(float)ps__snap_key(&s, i);
    for (unsigned j = 0; j < DIM4; j++) want[j] = v;
    snap_row_is(&s, i, want);
  }
  ps__shard_snap_release(SH, &s); /* frees the map the table left */
}

/* The writer thread of the race below: reads every row of the snapshot once. */
typedef struct race_reader {
  ps__snap_table *s;
  float *out;
  int rc;
} race_reader;

static void *race_read(void *arg) {
  race_reader *r = arg;
  for (uint64_t i = r->s->n; i-- > 0 && !r->rc;) r->rc = ps__snap_read(r->s, i, r->out + i * DIM4);
  return NULL;
}

Test(shard, a_writer_thread_racing_the_loop_reads_every_row_as_it_was_at_the_cut) {
  enum { ROWS = 20000 };
  ps__table *t = create(1, PS_SPARSE, DIM4, "init=zero lr=1 mode=async");
  start(1);
  for (uint64_t k = 0; k < ROWS; k++) push4(1, k, (float)k);
  ps__snap_table s;
  cr_assert(eq(int, ps__shard_snap(t, &s, 1), 0));
  race_reader r = {.s = &s, .out = malloc(ROWS * DIM4 * sizeof(float))};
  cr_assert(r.out != NULL);
  pthread_t th;
  cr_assert(eq(int, pthread_create(&th, NULL, race_read, &r), 0));
  for (int pass = 0; pass < 3; pass++) /* the loop writes every row, from the other end */
    for (uint64_t k = 0; k < ROWS; k++) push4(1, k, 0.5f);
  pthread_join(th, NULL);
  cr_assert(eq(int, r.rc, 0));
  for (uint64_t i = 0; i < ROWS; i++) {
    float v = -(float)ps__snap_key(&s, i);
    for (unsigned j = 0; j < DIM4; j++)
      cr_assert(eq(flt, r.out[i * DIM4 + j], v), "row %llu: %g, not %g", (unsigned long long)i, r.out[i * DIM4 + j], v);
  }
  free(r.out);
  ps__shard_snap_release(SH, &s);
}

/* ---------------------------------------------------------------- pushes with an identity (once.h) */

/* push1 with an identity: the sender's incarnation and the push's sequence. */
static int push1_id(uint32_t table, uint32_t sender, int64_t clock, uint32_t batch, uint64_t key, float g,
                    uint64_t inc, uint32_t seq, ps__verdict *v) {
  uint8_t kb[8];
  put_keys(kb, &key, 1);
  ps__push p = {.table = table, .sender = sender, .batch = batch, .clock = clock, .lr = -1.0f, .keys = kb,
                .nkeys = 1, .vals = &g, .nvals = 1, .inc = inc, .seq = seq};
  return ps__shard_push(SH, &p, NULL, v);
}

Test(shard, a_duplicated_sync_push_counts_once_in_its_round) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=sync");
  start(2);
  ps__verdict v;
  cr_assert(eq(int, push1_id(1, 1, 0, 10, 7, 1.0f, 100, 1, &v), PS__APPLIED));
  cr_assert(eq(int, v.dup, 0));
  /* the same push again (a re-sent one, or a duplicated frame): applied, not counted */
  cr_assert(eq(int, push1_id(1, 1, 0, 10, 7, 1.0f, 100, 1, &v), PS__APPLIED));
  cr_assert(eq(int, v.dup, 1));
  cr_assert(eq(int, push1_id(1, 2, 0, 30, 7, 3.0f, 200, 1, &v), PS__APPLIED));
  cr_assert(eq(int, v.dup, 0));
  ps__round *r = &t->rounds[0];
  cr_assert(eq(i64, r->round, 0));
  cr_assert(eq(sz, r->npushers, 2));
  cr_assert(ieee_ulp_eq(dbl, r->batch_sum, 40.0, 4), "batch sum %g", r->batch_sum);
  cr_assert(eq(u64, t->pushes, 2));
  cr_assert(eq(u64, SH->once.dups, 1));
  ps__shard_clock(SH, 1, 1);
  ps__shard_clock(SH, 2, 1);
  cr_assert(eq(i64, t->version, 1));
  /* (10*1 + 30*3) / 40: the duplicate is neither in the sum nor in the batch */
  cr_assert(ieee_ulp_eq(flt, row1(t, 7), -2.5f, 4), "row 7 = %g", row1(t, 7));
  /* A copy arriving after its round was applied is still answered as applied (a plain
   * push for that clock would be rejected as late), and changes nothing. */
  cr_assert(eq(int, push1_id(1, 2, 0, 30, 7, 3.0f, 200, 1, &v), PS__APPLIED), "%s", v.msg);
  cr_assert(eq(int, v.dup, 1));
  cr_assert(eq(int, push1_id(1, 2, 0, 30, 7, 3.0f, 200, 2, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_CLOCK));
  cr_assert(ieee_ulp_eq(flt, row1(t, 7), -2.5f, 4));
}

Test(shard, a_duplicated_async_push_is_applied_once) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=async update=sum");
  start(1);
  ps__verdict v;
  for (uint32_t seq = 1; seq <= 3; seq++)
    for (int copy = 0; copy < 2; copy++) {
      cr_assert(eq(int, push1_id(1, 1, 0, 1, 4, 1.0f, 9, seq, &v), PS__APPLIED));
      cr_assert(eq(int, v.dup, copy));
    }
  /* out of order: 5 before 4, each once */
  cr_assert(eq(int, push1_id(1, 1, 0, 1, 4, 1.0f, 9, 5, &v), PS__APPLIED));
  cr_assert(eq(int, push1_id(1, 1, 0, 1, 4, 1.0f, 9, 4, &v), PS__APPLIED));
  cr_assert(eq(int, v.dup, 0));
  cr_assert(eq(int, push1_id(1, 1, 0, 1, 4, 1.0f, 9, 5, &v), PS__APPLIED));
  cr_assert(eq(int, v.dup, 1));
  cr_assert(eq(flt, row1(t, 4), -5.0f));
  cr_assert(eq(u64, t->pushes, 5));
  /* pushes without an identity are not tracked: each one is applied */
  push1_ok(1, 1, 0, 1, 4, 1.0f);
  push1_ok(1, 1, 0, 1, 4, 1.0f);
  cr_assert(eq(flt, row1(t, 4), -7.0f));
}

Test(shard, a_push_from_an_earlier_incarnation_is_refused) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=async update=sum");
  start(1);
  ps__verdict v;
  cr_assert(eq(int, push1_id(1, 1, 0, 1, 4, 1.0f, 50, 1, &v), PS__APPLIED));
  /* the worker restarted: its new process counts from 1 again, and is applied */
  cr_assert(eq(int, push1_id(1, 1, 0, 1, 4, 1.0f, 60, 1, &v), PS__APPLIED));
  cr_assert(eq(int, v.dup, 0));
  /* a late push of the old process changes nothing */
  cr_assert(eq(int, push1_id(1, 1, 0, 1, 4, 1.0f, 50, 2, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_CONFLICT));
  cr_assert(strstr(v.msg, "earlier process of worker 1") != NULL, "%s", v.msg);
  cr_assert(eq(flt, row1(t, 4), -2.0f));
  cr_assert(eq(u64, SH->once.stale, 1));
  /* one fallen out of the window cannot be told from a new one: refused too */
  cr_assert(eq(int, push1_id(1, 1, 0, 1, 4, 1.0f, 60, 2 + PS__ONCE_WINDOW, &v), PS__APPLIED));
  cr_assert(eq(int, push1_id(1, 1, 0, 1, 4, 1.0f, 60, 1, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_CONFLICT));
  cr_assert(strstr(v.msg, "may have been applied") != NULL, "%s", v.msg);
  cr_assert(eq(flt, row1(t, 4), -3.0f));
}

Test(shard, a_dropped_push_is_not_recorded_and_its_copy_is_dropped_again) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=sync:1");
  start(2);
  ps__verdict v;
  cr_assert(eq(int, push1_id(1, 1, 0, 1, 5, 2.0f, 1, 1, &v), PS__APPLIED));
  ps__shard_clock(SH, 1, 1); /* the first one of two closes the round */
  cr_assert(eq(i64, t->version, 1));
  cr_assert(eq(int, push1_id(1, 2, 0, 1, 5, 4.0f, 1, 1, &v), PS__DROPPED));
  cr_assert(eq(int, push1_id(1, 2, 0, 1, 5, 4.0f, 1, 1, &v), PS__DROPPED));
  cr_assert(eq(u64, t->dropped, 2));
  cr_assert(eq(flt, row1(t, 5), -2.0f));
}

Test(shard, a_cut_of_one_float_rows_kept_in_the_index_survives_the_index_growing) {
  ps__table *t = create(1, PS_SPARSE, 1, SPARSE1 " mode=async");
  start(1);
  for (uint64_t k = 0; k < 1000; k++) push1_ok(1, 1, 0, 1, k, (float)k);
  ps__snap_table s;
  cr_assert(eq(int, ps__shard_snap(t, &s, 0), 0));
  cr_assert(eq(u64, s.n, 1000));
  float row;
  for (uint64_t i = 0; i < 300; i++) { /* the writer reads some */
    cr_assert(eq(int, ps__snap_read(&s, i, &row), 0));
    cr_assert(eq(flt, row, -(float)ps__snap_key(&s, i)));
  }
  for (uint64_t k = 0; k < 500; k++) push1_ok(1, 1, 0, 1, k, 1000.0f); /* some change: saved first */
  for (uint64_t k = 1000; k < 50000; k++) push1_ok(1, 1, 0, 1, k, 1.0f); /* the index grows: rows move */
  for (uint64_t i = 300; i < s.n; i++) {
    cr_assert(eq(int, ps__snap_read(&s, i, &row), 0));
    cr_assert(eq(flt, row, -(float)ps__snap_key(&s, i)), "row %llu", (unsigned long long)i);
  }
  cr_assert(eq(flt, row1(t, 7), -1007.0f), "the table moved on");
  ps__shard_snap_release(SH, &s);
  for (uint64_t k = 50000; k < 120000; k++) push1_ok(1, 1, 0, 1, k, 1.0f); /* no hook left behind */
  cr_assert(eq(flt, row1(t, 100000), -1.0f));
}

/* ---------------------------------------------------------------- non-finite values */

/* The first float of the row of key in a table of dim <= 8. */
static float first_of(ps__table *t, uint64_t key) {
  uint8_t kb[8];
  float out[8] = {NAN};
  cr_assert(t->spec.width <= 8);
  put_keys(kb, &key, 1);
  cr_assert(eq(int, ps__shard_read_rows(t, kb, 0, 1, out), 0));
  return out[0];
}

/* Every parameter of a sparse table's rows 0..n-1 (dim 1), read without creating any. */
static int all_rows_finite(ps__table *t) {
  size_t n = ps__rowmap_count(t->params);
  for (size_t i = 0; i < n; i++) {
    const float *r = ps__rowmap_row_at(t->params, i);
    for (size_t k = 0; k < ps__spec_row_floats(&t->spec); k++)
      if (!isfinite(r[k])) return 0;
  }
  return 1;
}

Test(shard, the_finite_scan_finds_the_first_nan_or_infinity_anywhere) {
  enum { N = 10000 };
  float *v = malloc(N * sizeof *v);
  for (int i = 0; i < N; i++) v[i] = (float)i - 5000.0f;
  v[17] = 3.4e38f; /* the largest floats are finite */
  v[18] = -3.4e38f;
  cr_assert(eq(u64, ps__first_nonfinite(v, N), UINT64_MAX));
  cr_assert(eq(u64, ps__first_nonfinite(v, 0), UINT64_MAX));
  const float bad[] = {NAN, -NAN, INFINITY, -INFINITY};
  const size_t at[] = {0, 1, 2047, 2048, 2049, 5000, N - 1};
  for (size_t b = 0; b < 4; b++)
    for (size_t j = 0; j < sizeof at / sizeof at[0]; j++) {
      float was = v[at[j]];
      v[at[j]] = bad[b];
      cr_assert(eq(u64, ps__first_nonfinite(v, N), at[j]), "value %zu at %zu", b, at[j]);
      v[N - 1 - at[j] / 2] = NAN; /* a later one does not hide the first */
      cr_assert(eq(u64, ps__first_nonfinite(v, N), at[j] < N - 1 - at[j] / 2 ? at[j] : N - 1 - at[j] / 2));
      v[N - 1 - at[j] / 2] = (float)(N - 1 - at[j] / 2) - 5000.0f;
      v[at[j]] = was;
    }
  free(v);
}

Test(shard, a_sync_push_holding_nan_is_refused_whole_and_changes_nothing) {
  ps__table *t = create(1, PS_SPARSE, 2, "init=zero lr=1 mode=sync");
  start(2);
  uint64_t keys[3] = {5, 6, 7};
  uint8_t kb[24];
  put_keys(kb, keys, 3);
  float g[6] = {1, 1, 1, 1, NAN, 1};
  ps__push p = {.table = 1, .sender = 1, .batch = 1, .clock = 0, .lr = -1.0f, .keys = kb, .nkeys = 3, .vals = g,
                .nvals = 6};
  ps__verdict v;
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_INVALID));
  cr_assert(strstr(v.msg, "'t1'") != NULL && strstr(v.msg, "NaN at value 4 (key 7, element 0)") != NULL, "%s", v.msg);
  cr_assert(eq(u64, t->nonfinite, 1));
  cr_assert(eq(u64, SH->nonfinite_refused, 1));
  /* Nothing of it is in the round: the other worker's push alone makes it. */
  g[4] = 2.0f;
  p.sender = 2;
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__APPLIED), "%s", v.msg);
  ps__shard_clock(SH, 1, 1);
  ps__shard_clock(SH, 2, 1);
  cr_assert(eq(i64, t->version, 1));
  cr_assert(eq(flt, first_of(t, 6), -1.0f), "worker 2's push alone: %g", first_of(t, 6));
  cr_assert(all_rows_finite(t));
}

Test(shard, an_async_push_with_an_infinity_or_an_infinite_rate_is_refused) {
  ps__table *t = create(1, PS_SPARSE, 1, "init=zero lr=1 mode=async");
  start(1);
  ps__verdict v;
  cr_assert(eq(int, push1(1, 1, 0, 1, 3, -INFINITY, &v), PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_INVALID));
  cr_assert(strstr(v.msg, "an infinity at value 0 (key 3") != NULL, "%s", v.msg);
  uint8_t kb[8];
  uint64_t key = 3;
  put_keys(kb, &key, 1);
  float g = 1.0f;
  const float rates[] = {INFINITY, NAN};
  for (int i = 0; i < 2; i++) {
    ps__push p = {.table = 1, .sender = 1, .batch = 1, .clock = 0, .lr = rates[i], .keys = kb, .nkeys = 1, .vals = &g,
                  .nvals = 1};
    cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__REJECTED));
    cr_assert(strstr(v.msg, "learning rate") != NULL, "%s", v.msg);
  }
  cr_assert(eq(u64, SH->nonfinite_refused, 3));
  cr_assert(eq(u64, t->pushes, 0));
  cr_assert(eq(u64, t->step, 0), "no step was taken");
  push1_ok(1, 1, 0, 1, 3, 2.0f); /* a finite push goes through */
  cr_assert(eq(flt, row1(t, 3), -2.0f));
}

Test(shard, a_dense_push_with_nan_is_refused_before_it_is_taken) {
  ps__table *t = create(1, PS_DENSE, 1000, "init=zero lr=1 mode=async slice=100");
  start(1);
  size_t len = 32 + 300 * 4;
  uint8_t *body = malloc(len);
  put_seg(body, 50, 200);
  put_seg(body + 16, 600, 100);
  float *g = (float *)(body + 32);
  for (int i = 0; i < 300; i++) g[i] = 1.0f;
  g[250] = NAN; /* element 600 + 50 */
  ps__push p = {.table = 1, .sender = 1, .batch = 1, .clock = 0, .lr = -1.0f, .keys = body, .nkeys = 4, .vals = g,
                .nvals = 300};
  ps__owned own = {body, len};
  ps__verdict v;
  cr_assert(eq(int, ps__shard_push(SH, &p, &own, &v), PS__REJECTED));
  cr_assert(strstr(v.msg, "NaN at value 250 (element 650)") != NULL, "%s", v.msg);
  cr_assert(own.buf == body, "a refused body is not taken");
  cr_assert(not(t->pend.active));
  cr_assert(eq(u64, ps__rowmap_count(t->params), 0), "no slice was created");
  free(body);
}

Test(shard, nonfinite_skip_drops_the_push_and_counts_it) {
  ps__table *t = create(1, PS_SPARSE, 1, "init=zero lr=1 mode=async nonfinite=skip");
  start(1);
  ps__verdict v;
  cr_assert(eq(int, push1(1, 1, 0, 1, 3, NAN, &v), PS__DROPPED));
  cr_assert(eq(u64, SH->nonfinite_skipped, 1));
  cr_assert(eq(u64, SH->nonfinite_refused, 0));
  cr_assert(eq(u64, t->nonfinite, 1));
  cr_assert(eq(u64, ps__rowmap_count(t->params), 0));
  /* allow: the old behaviour, for who wants it */
  ps__table *u = create(2, PS_SPARSE, 1, "init=zero lr=1 mode=async nonfinite=allow");
  cr_assert(eq(int, push1(2, 1, 0, 1, 3, INFINITY, &v), PS__APPLIED));
  float r3 = row1(u, 3);
  cr_assert(isinf(r3) != 0, "%g", r3);
  cr_assert(eq(u64, u->nonfinite, 0));
}

Test(shard, table_options_refuse_values_that_are_not_finite) {
  const char *bad[] = {"lr=inf", "lr=nan", "init=const:nan", "init=const:inf", "init=uniform:inf", "init=normal:1e38",
                       "momentum=-inf", "decay=step:10:nan", "nonfinite=maybe"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ps__declare d = {.id = 1, .kind = PS_SPARSE, .size = 1};
    snprintf(d.name, sizeof d.name, "x");
    snprintf(d.options, sizeof d.options, "%s", bad[i]);
    ps__verdict v;
    cr_assert(eq(int, ps__shard_create(SH, &d, &v), PS__REJECTED), "%s accepted", bad[i]);
    cr_assert(eq(int, v.err, PS_ERR_CONFIG), "%s: %s", bad[i], v.msg);
  }
  /* The largest normal SD allowed gives finite rows. */
  ps__table *t = create(2, PS_SPARSE, 64, "init=normal:1e37 seed=9");
  for (uint64_t k = 0; k < 200; k++) cr_assert(ps__shard_row(t, k) != NULL);
  cr_assert(all_rows_finite(t));
}

/* The helper thread of a huge push (the server's hooks.par). */
static ps__par *HUGE_PAR;
static ps__par *t_par(void *arg, uint32_t nkeys) {
  (void)arg, (void)nkeys;
  return HUGE_PAR;
}

Test(shard, a_huge_push_on_two_threads_is_refused_for_one_nan_and_applied_when_finite) {
  ps__shard_free(SH);
  ps__shard_hooks h = {.alloc = t_alloc, .release = t_release, .arm_flush = t_arm, .par = t_par};
  SH = ps__shard_new(&h);
  HUGE_PAR = ps__par_new();
  cr_assert(HUGE_PAR != NULL);
  ps__table *t = create(1, PS_SPARSE, 1, "init=zero lr=1 mode=async");
  start(1);
  uint32_t n = PS__PAR_MIN_KEYS + 1000;
  uint8_t *kb = malloc(8 * (size_t)n);
  float *g = malloc(4 * (size_t)n);
  for (uint32_t i = 0; i < n; i++) {
    uint64_t k = (uint64_t)i * 7919u;
    put_keys(kb + 8 * (size_t)i, &k, 1);
    g[i] = 1.0f;
  }
  g[n - 3] = NAN;
  ps__push p = {.table = 1, .sender = 1, .batch = 1, .clock = 0, .lr = -1.0f, .keys = kb, .nkeys = n, .vals = g,
                .nvals = n};
  ps__verdict v;
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__REJECTED));
  cr_assert(strstr(v.msg, "NaN at value") != NULL, "%s", v.msg);
  cr_assert(eq(u64, ps__rowmap_count(t->params), 0), "nothing of the huge push was applied");
  g[n - 3] = 1.0f;
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__APPLIED), "%s", v.msg);
  cr_assert(eq(u64, ps__rowmap_count(t->params), n));
  cr_assert(eq(flt, row1(t, (uint64_t)(n - 3) * 7919u), -1.0f));
  cr_assert(all_rows_finite(t));
  free(kb);
  free(g);
  ps__par_free(HUGE_PAR);
  HUGE_PAR = NULL;
}

/* ---------------------------------------------------------------- the memory budget */

Test(shard, past_the_memory_budget_only_requests_for_new_rows_are_refused) {
  ps__table *t = create(1, PS_SPARSE, 4, "init=zero lr=1 mode=async");
  ps__table *d = create(2, PS_DENSE, 1000, "init=zero lr=1 mode=async slice=100");
  start(1);
  uint64_t k = 0;
  while (SH->mem_used < 256 * 1024) cr_assert(ps__shard_row(t, k++) != NULL);
  SH->mem_limit = SH->mem_used; /* reached */
  uint8_t kb[16];
  uint64_t two[2] = {3, k + 10};
  put_keys(kb, two, 2);
  ps__verdict v;
  cr_assert(eq(int, ps__shard_room(SH, t, kb, 1, &v), PS__APPLIED), "an existing row");
  cr_assert(eq(int, ps__shard_room(SH, t, kb, 2, &v), PS__REJECTED), "a new row");
  cr_assert(eq(int, v.err, PS_ERR_NOMEM));
  cr_assert(strstr(v.msg, "memory budget") != NULL, "%s", v.msg);
  float g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  ps__push p = {.table = 1, .sender = 1, .batch = 1, .clock = 0, .lr = -1.0f, .keys = kb, .nkeys = 2, .vals = g,
                .nvals = 8};
  size_t rows = ps__rowmap_count(t->params);
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__REJECTED));
  cr_assert(eq(u64, ps__rowmap_count(t->params), rows), "nothing was created");
  cr_assert(eq(flt, first_of(t, 3), 0.0f), "nothing was applied");
  p.nkeys = 1;
  p.nvals = 4;
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__APPLIED), "%s", v.msg);
  cr_assert(eq(flt, first_of(t, 3), -1.0f));
  /* A dense table: slices that exist are served, a new one is refused. */
  uint8_t seg[16];
  put_seg(seg, 150, 10);
  cr_assert(eq(int, ps__shard_room(SH, d, seg, 2, &v), PS__REJECTED));
  SH->mem_limit = 0;
  cr_assert(ps__shard_row(d, 1) != NULL);
  SH->mem_limit = SH->mem_used;
  cr_assert(eq(int, ps__shard_room(SH, d, seg, 2, &v), PS__APPLIED));
  cr_assert(eq(u64, SH->mem_refused, 3));
  /* Dropping a table gives its memory back. */
  uint64_t before = SH->mem_used;
  ps__shard_drop(SH, 1);
  cr_assert(lt(u64, SH->mem_used, before - 200 * 1024));
}

/* ---------------------------------------------------------------- replication after aggregation */

/* The agg_applied hook of a head: each applied buffer, as it would be forwarded. */
typedef struct agg_copy {
  uint8_t keys[8 * 16];
  float rows[16 * 8];
  uint32_t n;
  int per_row;
  float lr;
  double gb;
  uint64_t step;
} agg_copy;
static agg_copy AGG[64];
static int naggs;
static void t_agg_applied(void *arg, ps__table *t, const ps__rowmap *agg, int per_row, float lr, double gb,
                          uint64_t step) {
  (void)arg;
  cr_assert(lt(int, naggs, 64));
  agg_copy *a = &AGG[naggs++];
  size_t w = (size_t)t->spec.width + 1;
  a->n = (uint32_t)ps__rowmap_count(agg);
  cr_assert(le(u32, a->n, 16));
  cr_assert(le(sz, w * a->n, 16 * 8));
  for (uint32_t i = 0; i < a->n; i++) {
    put_keys(a->keys + 8 * i, (uint64_t[]){ps__rowmap_key_at(agg, i)}, 1);
    memcpy(a->rows + i * w, ps__rowmap_row_at(agg, i), 4 * w);
  }
  a->per_row = per_row, a->lr = lr, a->gb = gb, a->step = step;
}

/* The head is SH with the hook; the copy a second engine. In mean mode with a schedule
 * (warm-up), the rate, the global batch, the step and the per-row weights must all
 * travel for the copy to come out equal. */
static void copy_equals_head(const char *opts) {
  ps__shard_hooks h = {.alloc = t_alloc, .release = t_release, .agg_applied = t_agg_applied};
  ps__shard_snap_release(SH, &CUT);
  ps__shard_free(SH);
  SH = ps__shard_new(&h);
  ps__shard *copy = ps__shard_new(&(ps__shard_hooks){.alloc = t_alloc, .release = t_release});
  cr_assert(SH && copy);
  ps__table *t = create(1, PS_SPARSE, 3, opts);
  ps__declare d = {.id = 1, .kind = PS_SPARSE, .size = 3};
  snprintf(d.name, sizeof d.name, "t1");
  snprintf(d.options, sizeof d.options, "%s", opts);
  ps__verdict v;
  cr_assert(eq(int, ps__shard_create(copy, &d, &v), PS__APPLIED));
  ps__table *ct = ps__shard_table(copy, 1);
  start(3);
  naggs = 0;
  uint32_t seq = 0;
  for (int i = 0; i < 30; i++) {
    uint64_t keys[2] = {(uint64_t)(i % 5), (uint64_t)(7 + i % 3)};
    uint8_t kb[16];
    put_keys(kb, keys, 2);
    float g[6];
    for (int j = 0; j < 6; j++) g[j] = (float)((i * 7 + j * 3) % 11) / 7.0f - 0.6f;
    ps__push p = {.table = 1, .sender = 1 + (uint32_t)(i % 3), .batch = 4 + (uint32_t)(i % 5), .clock = 0,
                  .lr = -1.0f, .keys = kb, .nkeys = 2, .vals = g, .nvals = 6, .inc = 9, .seq = ++seq};
    cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__APPLIED), "%s", v.msg);
  }
  cr_assert(eq(int, naggs, 10), "one buffer per 3 pushes");
  for (int i = 0; i < naggs; i++) {
    /* every push identity of the buffer (3 per buffer, in order) */
    ps__push_id ids[3];
    for (int j = 0; j < 3; j++) ids[j] = (ps__push_id){.worker = 1 + (uint32_t)((3 * i + j) % 3), .seq = (uint32_t)(3 * i + j + 1), .inc = 9};
    cr_assert(eq(int,
                 ps__shard_agg_replica(copy, ct, AGG[i].keys, AGG[i].rows, AGG[i].n, AGG[i].per_row, AGG[i].lr,
                                       AGG[i].gb, AGG[i].step, ids, 3, &v),
                 PS__APPLIED), "%s", v.msg);
  }
  cr_assert(eq(u64, ct->step, t->step));
  cr_assert(eq(sz, ps__rowmap_count(ct->params), ps__rowmap_count(t->params)));
  size_t rf = ps__spec_row_floats(&t->spec);
  for (size_t i = 0; i < ps__rowmap_count(t->params); i++) {
    uint64_t key = ps__rowmap_key_at(t->params, i);
    float *a = ps__rowmap_get(t->params, key), *b = ps__rowmap_get(ct->params, key);
    cr_assert(b != NULL, "row %llu on the copy", (unsigned long long)key);
    cr_assert(eq(int, memcmp(a, b, 4 * rf), 0), "row %llu differs", (unsigned long long)key);
  }
  /* A push the buffers combined, sent again to the copy on its own, is a duplicate. */
  uint8_t kb[8];
  put_keys(kb, (uint64_t[]){0}, 1);
  float g[3] = {1, 1, 1};
  ps__push p = {.table = 1, .sender = 2, .batch = 1, .lr = -1.0f, .keys = kb, .nkeys = 1, .vals = g, .nvals = 3,
                .inc = 9, .seq = 5, .replica = 1};
  cr_assert(eq(int, ps__shard_push(copy, &p, NULL, &v), PS__APPLIED));
  cr_assert(v.dup, "answered from the window");
  float *row0 = ps__rowmap_get(ct->params, 0);
  cr_assert(eq(int, memcmp(row0, ps__rowmap_get(t->params, 0), 4 * rf), 0), "nothing applied");
  /* A buffer that comes again (its answer was lost) changes nothing: its pushes are all
   * in the windows. */
  uint64_t dups = copy->once.dups, step = ct->step;
  ps__push_id last[3];
  for (int j = 0; j < 3; j++) last[j] = (ps__push_id){.worker = 1 + (uint32_t)((27 + j) % 3), .seq = (uint32_t)(28 + j), .inc = 9};
  agg_copy *b = &AGG[naggs - 1];
  cr_assert(eq(int, ps__shard_agg_replica(copy, ct, b->keys, b->rows, b->n, b->per_row, b->lr, b->gb, b->step, last, 3, &v),
               PS__APPLIED), "%s", v.msg);
  cr_assert(v.dup, "a buffer applied before");
  cr_assert(eq(u64, copy->once.dups, dups + 3));
  cr_assert(eq(u64, ct->step, step), "no step taken");
  for (size_t i = 0; i < ps__rowmap_count(t->params); i++) {
    uint64_t key = ps__rowmap_key_at(t->params, i);
    cr_assert(eq(int, memcmp(ps__rowmap_get(t->params, key), ps__rowmap_get(ct->params, key), 4 * rf), 0),
              "row %llu changed", (unsigned long long)key);
  }
  /* One whose pushes came partly on their own first cannot take those out of its rows:
   * refused, to be sent again push by push; nothing changes, no window either. */
  ps__push_id mixed[2] = {{.worker = 1, .seq = 28, .inc = 9}, {.worker = 1, .seq = 31, .inc = 9}};
  cr_assert(eq(int, ps__shard_agg_replica(copy, ct, b->keys, b->rows, b->n, b->per_row, b->lr, b->gb, b->step, mixed, 2, &v),
               PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_UNAVAILABLE));
  cr_assert(eq(u64, ct->step, step), "no step taken");
  cr_assert(eq(int, ps__once_check(ps__once_find(&copy->once, 1, 0), 9, 31), PS__ONCE_NEW), "not recorded");
  /* A table without aggregation refuses a buffer. */
  cr_assert(eq(int, ps__shard_create(copy, &(ps__declare){.id = 2, .kind = PS_SPARSE, .size = 1, .name = "t2"}, &v),
               PS__APPLIED));
  cr_assert(eq(int, ps__shard_agg_replica(copy, ps__shard_table(copy, 2), AGG[0].keys, AGG[0].rows, 0, 0, 0.1f, 1.0,
                                          1, NULL, 0, &v),
               PS__REJECTED));
  cr_assert(eq(int, v.err, PS_ERR_INVALID));
  ps__shard_free(copy);
}

Test(shard, a_buffer_applied_on_a_copy_gives_the_same_rows_and_optimiser_state_bit_for_bit) {
  /* Adam divides its rows by their weights in place; sgd scales its rate instead. */
  copy_equals_head("opt=adam lr=0.1 warmup=5 init=uniform:0.5 seed=3 mode=async agg_n=3");
  copy_equals_head("opt=sgd lr=0.1 warmup=5 init=uniform:0.5 seed=3 mode=ssp:4 agg_n=3");
  copy_equals_head("opt=adagrad lr=0.1 update=sum init=uniform:0.5 seed=3 mode=async agg_n=3");
}

/* ---------------------------------------------------------------- large requests of new keys */

/* A push of many new keys into an empty table (sgd straight from the frame, adagrad
 * through the buffer) sizes the index for them at once: no rows left moving, every row
 * created once, initialised and stepped; a later push as large as the table is again a
 * batch of new rows created right, and a small one grows the index as usual. */
static void push_new(uint32_t table, uint64_t base, uint32_t n) {
  uint64_t *k = malloc(n * sizeof *k);
  uint8_t *kb = malloc(8 * (size_t)n);
  float *g = malloc(n * sizeof *g);
  cr_assert(k && kb && g);
  for (uint32_t i = 0; i < n; i++) {
    k[i] = (base + i) * 0x9E3779B97F4A7C15ull;
    g[i] = 1.0f + (float)((base + i) % 5);
  }
  put_keys(kb, k, n);
  ps__push p = {.table = table, .sender = 1, .batch = 1, .lr = -1.0f, .keys = kb, .nkeys = n, .vals = g, .nvals = n};
  ps__verdict v;
  cr_assert(eq(int, ps__shard_push(SH, &p, NULL, &v), PS__APPLIED));
  free(k);
  free(kb);
  free(g);
}

Test(shard, a_push_of_many_new_keys_sizes_the_index_once) {
  ps__table *s = create(1, PS_SPARSE, 1, SPARSE1 " mode=async");
  ps__table *a = create(2, PS_SPARSE, 1, "init=zero lr=1 mode=async opt=adagrad eps=0 acc0=0");
  start(1);
  push_new(1, 0, 40000); /* doubling alone would leave rows moving at 40000 */
  push_new(2, 0, 40000);
  for (int w = 0; w < 2; w++) {
    ps__table *t = w ? a : s;
    cr_assert(eq(sz, ps__rowmap_count(t->params), 40000));
    cr_assert(eq(sz, ps__rowmap_moving(t->params), 0), "sized once, nothing moving");
  }
  push_new(1, 40000, 50000); /* as large as the table: sized again */
  push_new(2, 40000, 50000);
  push_new(1, 90000, 1000); /* small: the usual growth */
  push_new(2, 90000, 1000);
  for (uint64_t i = 0; i < 91000; i += 7) {
    uint64_t key = i * 0x9E3779B97F4A7C15ull;
    float g = 1.0f + (float)(i % 5);
    cr_assert(ieee_ulp_eq(flt, row1(s, key), -g, 4), "sgd row %llu", (unsigned long long)i);
    cr_assert(ieee_ulp_eq(flt, row1(a, key), -1.0f, 4), "adagrad row %llu: %g", (unsigned long long)i, row1(a, key));
  }
  cr_assert(eq(sz, ps__rowmap_count(s->params), 91000));
  cr_assert(eq(sz, ps__rowmap_count(a->params), 91000));
  cr_assert(eq(u64, s->applied, 3));
}
