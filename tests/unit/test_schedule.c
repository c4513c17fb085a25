/*
 * test_schedule.c - the servers' learning-rate schedule (ps__lr_at): linear scaling
 * with the global batch, warm-up, step and cosine decay, and their option parsing.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "pshard.h"
#include "store/store.h"

static ps__table_spec spec_of(const char *opts) {
  ps__table_spec s;
  char err[256];
  int rc = ps__table_spec_parse(&s, "t", PS_DENSE, 10, opts, err, sizeof err);
  cr_assert_eq(rc, 0, "parse '%s': %s", opts, err);
  return s;
}

#define NEAR(a, b) cr_assert(fabs((double)(a) - (double)(b)) < 1e-6 * fmax(1.0, fabs((double)(b))), "%.9g != %.9g", (double)(a), (double)(b))

Test(schedule, constant_rate_without_options) {
  ps__table_spec s = spec_of("lr=0.05");
  NEAR(ps__lr_at(&s, 1, 32), 0.05);
  NEAR(ps__lr_at(&s, 1000, 4096), 0.05);
}

Test(schedule, linear_scaling_textbook_case) {
  /* 32 workers x 32 local batch = 1024; 0.1 at a reference batch of 256 -> 0.4 */
  ps__table_spec s = spec_of("lr=0.1 ref_batch=256");
  NEAR(ps__lr_at(&s, 1, 32 * 32), 0.4);
  /* a worker leaves: 31 x 32 = 992 -> 0.3875 */
  NEAR(ps__lr_at(&s, 2, 31 * 32), 0.3875);
}

Test(schedule, warmup_then_constant) {
  ps__table_spec s = spec_of("lr=0.4 warmup=4");
  NEAR(ps__lr_at(&s, 1, 1), 0.1);
  NEAR(ps__lr_at(&s, 2, 1), 0.2);
  NEAR(ps__lr_at(&s, 4, 1), 0.4);
  NEAR(ps__lr_at(&s, 5, 1), 0.4);
  NEAR(ps__lr_at(&s, 500, 1), 0.4);
}

Test(schedule, step_decay_after_warmup) {
  ps__table_spec s = spec_of("lr=1 warmup=2 decay=step:3:0.5");
  NEAR(ps__lr_at(&s, 1, 1), 0.5);
  NEAR(ps__lr_at(&s, 2, 1), 1.0);
  NEAR(ps__lr_at(&s, 3, 1), 1.0);  /* first step after warm-up */
  NEAR(ps__lr_at(&s, 5, 1), 1.0);
  NEAR(ps__lr_at(&s, 6, 1), 0.5);  /* 4th step after warm-up */
  NEAR(ps__lr_at(&s, 9, 1), 0.25);
}

Test(schedule, cosine_decay) {
  ps__table_spec s = spec_of("lr=2 decay=cos:100:0.1");
  NEAR(ps__lr_at(&s, 1, 1), 2.0);
  NEAR(ps__lr_at(&s, 51, 1), 2.0 * (0.1 + 0.9 * 0.5));  /* half way: (1 + cos(pi/2)) / 2 = 0.5 */
  NEAR(ps__lr_at(&s, 101, 1), 0.2);                    /* the end: MIN x peak */
  NEAR(ps__lr_at(&s, 5000, 1), 0.2);                   /* and stays there */
}

Test(schedule, scaling_warmup_and_decay_compose) {
  ps__table_spec s = spec_of("lr=0.1 ref_batch=256 warmup=10 decay=cos:90");
  NEAR(ps__lr_at(&s, 5, 1024), 0.2);       /* half of the warm-up of 0.4 */
  NEAR(ps__lr_at(&s, 11, 1024), 0.4);      /* peak */
  NEAR(ps__lr_at(&s, 101, 1024), 0.0);     /* cosine to zero */
}

Test(schedule, bad_options_are_refused) {
  static const char *bad[] = {"decay=linear", "decay=step:0:0.5", "decay=step:3:1.5", "decay=step:3",
                              "decay=cos:0", "decay=cos:10:2", "warmup=-1", "ref_batch=x", "decay=cos:10:0.1x"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ps__table_spec s;
    char err[256];
    int rc = ps__table_spec_parse(&s, "t", PS_DENSE, 10, bad[i], err, sizeof err);
    cr_assert_eq(rc, PS_ERR_CONFIG, "'%s' accepted", bad[i]);
    cr_assert(err[0], "no message for '%s'", bad[i]);
  }
}
