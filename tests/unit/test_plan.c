/*
 * test_plan.c - the cost model behind `pshard plan` (src/cli/plan_model.c) and its unit
 * parsers. The textbook cases are pinned exactly (to a relative 1e-12): 7e9 parameters
 * are 14 GB of fp16 weights and 112 GB of state at 16 B/param, 28 GB per server on 4
 * servers; 64 days on 1 worker are 4 days on 16; a 140 GB gradient takes 11.2 s on
 * 100 Gbit/s; 32 workers x 32 local batch is a global batch of 1,024 and a learning
 * rate of 0.4 from a 256 / 0.1 baseline. Sparse tables: the row map's bytes against a
 * real map, Zipf's distinct ids against a brute-force sum, and 10^9 rows of dim 64 with
 * Adagrad needing 9 servers of 64 GiB.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "common/common.h"
#include "cli/plan_model.h"
#include "store/store.h" /* the real row map, to hold the plan's figure to */

#define DAY 86400.0

#define near(got, want)                                                                     \
  do {                                                                                      \
    double g_ = (got), w_ = (want);                                                         \
    cr_assert(fabs(g_ - w_) <= 1e-12 * fabs(w_), "%s = %.17g, want %.17g", #got, g_, w_);   \
  } while (0)

static ps__plan_out run(const ps__plan_in *in) {
  ps__plan_out out;
  int rc = ps__plan_compute(in, &out);
  cr_assert_eq(rc, 0, "ps__plan_compute: %d %s", rc, ps_errmsg());
  return out;
}

/* ---------------------------------------------------------------- textbook cases */

Test(plan, seven_billion_params_mixed_adam_on_four_servers) {
  const ps__plan_recipe *r = ps__plan_recipe_find("mixed-adam");
  cr_assert_not_null(r);
  ps__plan_in in;
  ps__plan_in_init(&in);
  in.params = 7e9;
  in.state_bytes = r->state_bytes;
  in.weight_bytes = r->weight_bytes;
  in.grad_bytes = r->grad_bytes;
  in.servers = 4;
  ps__plan_out o = run(&in);
  near(o.weights_bytes, 14e9);
  near(o.state_bytes, 112e9);
  near(o.state_per_server, 28e9);
  cr_assert(isnan(o.servers_needed));
  in.server_mem = 80e9;
  o = run(&in);
  near(o.servers_needed, 2);
}

Test(plan, sixteen_bytes_per_param_and_fp16_weights) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  in.params = 7e9;
  in.state_bytes = 16;
  in.weight_bytes = ps__plan_precision_bytes("fp16");
  in.servers = 4;
  ps__plan_out o = run(&in);
  near(o.weights_bytes, 14e9);
  near(o.state_bytes, 112e9);
  near(o.state_per_server, 28e9);
}

Test(plan, sixty_four_days_on_one_worker_are_four_on_sixteen) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  double t;
  cr_assert_eq(ps__parse_duration("64d", &t), 0);
  in.job_time = t;
  in.workers = 16;
  ps__plan_out o = run(&in);
  near(o.job_compute, 4 * DAY);
  near(o.job_time_1, 64 * DAY);
  cr_assert(isnan(o.step_compute), "no steps given, so no per-step figure");
}

Test(plan, gradient_of_140_gb_over_100_gbit_takes_11_2_s) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  cr_assert_eq(ps__parse_rate("100Gbit/s", &in.link), 0);
  cr_assert_eq(ps__parse_bytes("140GB", &in.push_bytes), 0);
  ps__plan_out o = run(&in);
  near(o.push_bytes, 140e9);
  near(o.push_time, 11.2);

  /* The same payload from the model: 70e9 fp16 gradients. */
  ps__plan_in_init(&in);
  cr_assert_eq(ps__parse_rate("12.5GB/s", &in.link), 0);
  in.params = 70e9;
  in.grad_bytes = ps__plan_precision_bytes("fp16");
  o = run(&in);
  near(o.push_bytes, 140e9);
  near(o.push_time, 11.2);
}

Test(plan, linear_scaling_32_workers_of_32) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  in.workers = 32;
  in.batch = 32;
  in.ref_batch = 256;
  in.ref_lr = 0.1;
  ps__plan_out o = run(&in);
  near(o.global_batch, 1024);
  near(o.lr, 0.4);
  /* Scaled up 4x: Goyal et al. warm-up over 5 epochs; steps need the epoch size. */
  near(o.warmup_epochs, 5);
  cr_assert(isnan(o.warmup_steps));
  in.samples = 1281167; /* ImageNet-1k train */
  o = run(&in);
  near(o.steps_per_epoch, 1252); /* ceil(1281167 / 1024) */
  near(o.warmup_steps, ceil(5 * 1281167 / 1024.0));
}

/* ---------------------------------------------------------------- traffic and time */

Test(plan, traffic_is_two_k_g_spread_over_servers) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  in.params = 1e9;
  in.grad_bytes = 4;
  in.servers = 4;
  in.workers = 8;
  in.link = 12.5e9;
  ps__plan_out o = run(&in);
  near(o.push_bytes, 4e9);
  near(o.traffic_bytes, 2 * 8 * 4e9);
  near(o.traffic_per_server, 2 * 8 * 4e9 / 4);
  /* K > S: a server's link is the busiest one. */
  near(o.comm_time, 2 * 8 * 4e9 / 4 / 12.5e9);
  /* K <= S: each worker's own link is. */
  in.workers = 2;
  o = run(&in);
  near(o.comm_time, 2 * 4e9 / 12.5e9);
}

Test(plan, step_times_with_and_without_overlap) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  in.params = 1e9;
  in.grad_bytes = 2;
  in.servers = 2;
  in.workers = 4;
  in.link = 10e9;
  in.step_time = 8;
  in.steps = 1000;
  ps__plan_out o = run(&in);
  double comm = 2 * 2e9 * 4 / 2 / 10e9; /* 0.8 s */
  near(o.comm_time, comm);
  near(o.step_compute, 2);
  near(o.step_serial, 2 + comm);
  near(o.step_overlap, 2);
  near(o.job_time_1, 8000);
  near(o.job_compute, 2000);
  near(o.job_serial, 1000 * (2 + comm));
  near(o.job_overlap, 2000);
}

Test(plan, any_two_of_step_time_job_time_and_steps) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  in.job_time = 64 * DAY;
  in.steps = 64 * 24;
  ps__plan_out o = run(&in);
  near(o.step_time_1, 3600);
  ps__plan_in_init(&in);
  in.job_time = 10;
  in.step_time = 0.5;
  o = run(&in);
  near(o.steps, 20);
  in.steps = 20;
  cr_assert_eq(ps__plan_compute(&in, &o), PS_ERR_INVALID, "all three given");
}

/* Where the model says communication starts to dominate, it does: just above the
 * bound communication per step exceeds T/K, just below it does not. */
static void check_crossover(double servers) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  in.params = 1e9;
  in.grad_bytes = 4;
  in.link = 12.5e9;
  in.step_time = 20;
  in.servers = servers;
  ps__plan_out o = run(&in);
  double k = o.k_comm;
  cr_assert(k > 1, "bound %g", k);
  double G = 4e9, L = 12.5e9, T = 20;
  double ka = T * L / (2 * G); /* 31.25 */
  near(k, ka <= servers ? ka : sqrt(servers * ka));
  const double factors[] = {0.99, 1.01};
  for (size_t i = 0; i < 2; i++) {
    double f = factors[i], kk = k * f;
    double comm = 2 * fmax(G, kk * G / servers) / L;
    if (f < 1)
      cr_assert_lt(comm, T / kk, "S=%g K=%g below the bound", servers, kk);
    else
      cr_assert_gt(comm, T / kk, "S=%g K=%g above the bound", servers, kk);
  }
}

Test(plan, communication_dominates_beyond_the_bound) {
  check_crossover(64); /* bound 31.25 <= S: worker links limit */
  check_crossover(4);  /* bound sqrt(4 x 31.25) = 11.2 > S: server links limit */
}

Test(plan, unknown_inputs_give_nan) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  ps__plan_out o = run(&in);
  cr_assert(isnan(o.weights_bytes) && isnan(o.state_bytes) && isnan(o.push_bytes));
  cr_assert(isnan(o.push_time) && isnan(o.comm_time) && isnan(o.step_compute));
  cr_assert(isnan(o.job_compute) && isnan(o.k_comm) && isnan(o.global_batch));
  cr_assert(isnan(o.lr) && isnan(o.warmup_steps) && isnan(o.warmup_epochs));
  in.params = 1e6;
  in.state_bytes = 8;
  o = run(&in);
  near(o.state_bytes, 8e6);
  cr_assert(isnan(o.push_bytes), "no gradient precision given");
}

Test(plan, no_warmup_when_the_rate_is_not_scaled_up) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  in.workers = 4;
  in.batch = 64;
  in.ref_batch = 256;
  in.ref_lr = 0.1;
  ps__plan_out o = run(&in);
  near(o.lr, 0.1);
  cr_assert_eq(o.warmup_epochs, 0);
  cr_assert_eq(o.warmup_steps, 0);
  in.workers = 8;
  in.warmup_steps = 300;
  o = run(&in);
  near(o.warmup_steps, 300);
}

Test(plan, rejects_bad_inputs) {
  ps__plan_in in;
  ps__plan_out o;
  ps__plan_in_init(&in);
  in.servers = 0;
  cr_assert_eq(ps__plan_compute(&in, &o), PS_ERR_INVALID);
  ps__plan_in_init(&in);
  in.workers = 2.5;
  cr_assert_eq(ps__plan_compute(&in, &o), PS_ERR_INVALID);
  ps__plan_in_init(&in);
  in.params = -1;
  cr_assert_eq(ps__plan_compute(&in, &o), PS_ERR_INVALID);
  ps__plan_in_init(&in);
  in.link = INFINITY;
  cr_assert_eq(ps__plan_compute(&in, &o), PS_ERR_INVALID);
  ps__plan_in_init(&in);
  in.batch = NAN;
  cr_assert_eq(ps__plan_compute(&in, &o), PS_ERR_INVALID);
}

Test(plan, recipes_and_precisions) {
  const struct {
    const char *name;
    double state, weight, grad;
  } want[] = {{"fp32-sgd", 8, 4, 4},
              {"fp32-momentum", 12, 4, 4},
              {"fp32-adam", 16, 4, 4},
              {"mixed-adam", 16, 2, 2},
              {"fp16-weights", 2, 2, 2}};
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const ps__plan_recipe *r = ps__plan_recipe_find(want[i].name);
    cr_assert_not_null(r, "%s", want[i].name);
    cr_assert_eq(r->state_bytes, want[i].state, "%s", want[i].name);
    cr_assert_eq(r->weight_bytes, want[i].weight, "%s", want[i].name);
    cr_assert_eq(r->grad_bytes, want[i].grad, "%s", want[i].name);
    cr_assert_eq(r, ps__plan_recipe_at(i));
  }
  cr_assert_null(ps__plan_recipe_at(sizeof want / sizeof want[0]));
  cr_assert_null(ps__plan_recipe_find("adam"));
  cr_assert_null(ps__plan_recipe_find(NULL));
  cr_assert_eq(ps__plan_precision_bytes("fp32"), 4);
  cr_assert_eq(ps__plan_precision_bytes("bf16"), 2);
  cr_assert_eq(ps__plan_precision_bytes("int8"), 1);
  cr_assert_eq(ps__plan_precision_bytes("fp12"), 0);
}

/* ---------------------------------------------------------------- unit parsers */

static double bytes(const char *s) {
  double v = -1;
  cr_assert_eq(ps__parse_bytes(s, &v), 0, "ps__parse_bytes(\"%s\") failed", s);
  return v;
}

static double rate(const char *s) {
  double v = -1;
  cr_assert_eq(ps__parse_rate(s, &v), 0, "ps__parse_rate(\"%s\") failed", s);
  return v;
}

static double duration(const char *s) {
  double v = -1;
  cr_assert_eq(ps__parse_duration(s, &v), 0, "ps__parse_duration(\"%s\") failed", s);
  return v;
}

Test(plan_parse, bytes_decimal_and_binary) {
  near(bytes("14GB"), 14e9);
  near(bytes("14 GB"), 14e9);
  near(bytes("13GiB"), 13.0 * 1073741824.0);
  near(bytes("512MiB"), 512.0 * 1048576.0);
  near(bytes("1.5TB"), 1.5e12);
  near(bytes("4KiB"), 4096);
  near(bytes("4kB"), 4000);
  near(bytes("4KB"), 4000);
  near(bytes("100B"), 100);
  near(bytes("7e9"), 7e9);
  near(bytes("4096"), 4096);
  near(bytes("0"), 0);
  cr_assert(bytes("1GiB") > bytes("1GB"), "GiB and GB must differ");
}

Test(plan_parse, bytes_rejections) {
  const char *bad[] = {"",     "GB",   "14Gb",  "14Gbit", "14gb", "-1GB", "+1GB", "14GBs",
                       "14G",  "0x10", "inf",   "nan",    "1e999", "14  GB", " 14GB",
                       "14mB", "1..2GB", "14 ", NULL};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    double v = 123;
    cr_assert_neq(ps__parse_bytes(bad[i], &v), 0, "ps__parse_bytes(\"%s\") accepted: %g",
                  bad[i] ? bad[i] : "(null)", v);
    cr_assert_eq(v, 123, "output changed on failure");
  }
}

Test(plan_parse, rates_bits_and_bytes) {
  near(rate("100Gbit/s"), 12.5e9);
  near(rate("12.5GB/s"), 12.5e9);
  cr_assert_eq(rate("100Gbit/s"), rate("12.5GB/s"));
  near(rate("100Gb/s"), 12.5e9);
  near(rate("100Gbps"), 12.5e9);
  near(rate("100 Gbit/s"), 12.5e9);
  near(rate("10Gb/s"), 1.25e9);
  near(rate("25GBps"), 25e9);
  near(rate("1GiB/s"), 1073741824.0);
  near(rate("800Mbit/s"), 1e8);
  near(rate("8bit/s"), 1);
  near(rate("1B/s"), 1);
}

Test(plan_parse, rate_rejections) {
  const char *bad[] = {"", "100", "100G", "12.5GB", "100Gbit", "100gbit/s", "100Gbit/h",
                       "-1Gbit/s", "Gbit/s", "100GBit/s", NULL};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    double v = 123;
    cr_assert_neq(ps__parse_rate(bad[i], &v), 0, "ps__parse_rate(\"%s\") accepted: %g",
                  bad[i] ? bad[i] : "(null)", v);
    cr_assert_eq(v, 123);
  }
}

Test(plan_parse, durations) {
  near(duration("64d"), 64 * DAY);
  near(duration("3h"), 10800);
  near(duration("250ms"), 0.25);
  near(duration("1.5s"), 1.5);
  near(duration("2min"), 120);
  near(duration("2m"), 120);
  near(duration("10us"), 1e-5);
  near(duration("100ns"), 1e-7);
  near(duration("1w"), 7 * DAY);
}

Test(plan_parse, duration_rejections) {
  const char *bad[] = {"", "64", "d", "3x", "-1s", "1.5 s s", "1hr", "0x1s", NULL};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    double v = 123;
    cr_assert_neq(ps__parse_duration(bad[i], &v), 0, "ps__parse_duration(\"%s\") accepted: %g",
                  bad[i] ? bad[i] : "(null)", v);
    cr_assert_eq(v, 123);
  }
}

/* ---------------------------------------------------------------- sparse tables */

/* The plan's figure for a row map is the real map's: fill maps of a few shapes and
 * compare with ps__rowmap_bytes. What the plan leaves out is the last chunk's unused
 * rows (at most one chunk, <= 2 MiB) and a few hundred bytes of bookkeeping. */
Test(plan_sparse, rowmap_bytes_match_the_store) {
  const struct {
    size_t row_floats, rows;
  } cases[] = {{128, 200000}, {16, 300000}, {1, 300000}, {3, 1000}, {2, 3000000}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    ps__rowmap *m = ps__rowmap_new(cases[c].row_floats);
    cr_assert_not_null(m);
    for (size_t i = 0; i < cases[c].rows; i++) {
      int created;
      cr_assert_not_null(ps__rowmap_upsert(m, i * 0x9E3779B97F4A7C15ull, &created));
    }
    double real = (double)ps__rowmap_bytes(m), peak;
    double plan = ps__plan_rowmap_bytes((double)cases[c].rows, (double)cases[c].row_floats, &peak);
    double slack = (double)((size_t)2 << 20) + 4096;
    /* while rows still move to a grown index, the old one is there too: the peak */
    double want = ps__rowmap_moving(m) ? peak : plan;
    cr_assert(plan <= real && real - want <= slack,
              "%zu rows of %zu floats: plan %.0f B, the map holds %.0f B", cases[c].rows,
              cases[c].row_floats, plan, real);
    cr_assert(peak > plan);
    ps__rowmap_free(m);
  }
}

/* Zipf over a small domain summed by brute force, against the head-and-tail sum. */
Test(plan_sparse, zipf_distinct_against_brute_force) {
  const double rows = 200000, draws = 5000;
  const double exps[] = {0, 0.8, 1.0, 1.2};
  for (size_t e = 0; e < sizeof exps / sizeof exps[0]; e++) {
    double s = exps[e], h = 0, d = 0;
    for (double i = 1; i <= rows; i++) h += pow(i, -s);
    for (double i = 1; i <= rows; i++) d += 1 - pow(1 - pow(i, -s) / h, draws);
    double got = ps__plan_zipf_distinct(rows, s, draws);
    cr_assert(fabs(got - d) <= 1e-3 * d, "s = %g: %.3f distinct, brute force %.3f", s, got, d);
  }
  /* Uniform: N (1 - (1 - 1/N)^n). */
  double u = 1e9 * -expm1(1e6 * log1p(-1e-9));
  cr_assert(fabs(ps__plan_zipf_distinct(1e9, 0, 1e6) - u) <= 1e-3 * u);
}

/* 10^9 rows of dim 64 with Adagrad on servers of 64 GiB (68.7 GB): 520 B per row in
 * records (8 B key + 128 floats). On S = 8 servers 125,000,000 rows each need an index
 * of 2^28 entries of 4 B (2^27 hold only 117,440,512 at 7/8): 66.1 GB, 66.6 GB while the
 * old index of 2^27 entries is still there: 8 servers; on 7, 142,857,143 rows take
 * 75.4 GB. With R = 2, 2 x 10^9 rows: 16 servers (15 would hold 133,333,334 each). */
Test(plan_sparse, a_billion_rows_of_dim_64_with_adagrad) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  in.nsparse = 1;
  in.sparse[0] = (ps__plan_sparse){.rows = 1e9, .dim = 64, .nstate = 1, .touched = 20000};
  in.server_mem = 64.0 * (1u << 30);
  in.servers = 8;
  ps__plan_out o = run(&in);
  double n = 125000000, idx = 268435456.0 * 4;
  near(o.sparse[0].rows_per_server, n);
  near(o.sparse[0].bytes_per_server, n * 520 + idx);
  near(o.sparse[0].peak_per_server, n * 520 + idx * 1.5);
  near(o.servers_needed, 8);
  near(o.push_bytes, 20000 * (8 + 256));
  in.servers = 7;
  o = run(&in);
  cr_assert(142857143.0 * 520 + idx > in.server_mem); /* why 7 are not enough */
  near(o.servers_needed, 8);
  in.replicas = 2;
  in.servers = 16;
  o = run(&in);
  near(o.servers_needed, 16);
  near(o.sparse[0].rows_per_server, ceil(2e9 / 16));
}

/* R = 1 leaves the communication term as it was; R copies make a server's push
 * share R K G / S. */
Test(plan_sparse, replicas_in_the_comm_term) {
  ps__plan_in in;
  ps__plan_in_init(&in);
  in.push_bytes = 1e9;
  in.link = 1e9;
  in.servers = 4;
  in.workers = 8;
  in.step_time = 100;
  ps__plan_out o = run(&in);
  near(o.comm_time, 2 * 8 / 4.0);
  near(o.k_comm, sqrt(4 * 50.0));
  in.replicas = 2;
  o = run(&in);
  near(o.comm_time, (2 * 8 / 4.0) + 8 / 4.0);
  near(o.traffic_per_server, 3 * 8e9 / 4);
  /* K > S: T1 / K = (R + 1) K G / (S L) -> K = sqrt(S T1 L / ((R + 1) G)). */
  near(o.k_comm, sqrt(4 * 100 / 3.0));
  in.replicas = 5;
  cr_assert_neq(ps__plan_compute(&in, &o), 0);
}
