/*
 * test_par.c - the two-thread fork-join helper (common/par.h).
 */
#include <criterion/criterion.h>
#include <pthread.h>

#include "common/par.h"

typedef struct job {
  pthread_t self[2];
  int runs[2];
} job;

static void record(void *arg, unsigned part) {
  job *j = arg;
  cr_assert_lt(part, 2u);
  j->self[part] = pthread_self();
  j->runs[part]++;
}

Test(par, runs_both_parts_and_returns_after_both) {
  ps__par *p = ps__par_new();
  cr_assert_not_null(p);
  job j = {0};
  for (int i = 0; i < 1000; i++) ps__par_run(p, record, &j);
  /* Every run's part 1 finished before ps__par_run returned: no run is lost. */
  cr_assert_eq(j.runs[0], 1000);
  cr_assert_eq(j.runs[1], 1000);
  cr_assert(pthread_equal(j.self[0], pthread_self()), "part 0 runs on the caller");
  cr_assert(!pthread_equal(j.self[1], pthread_self()), "part 1 runs on the helper");
  ps__par_free(p);
}

Test(par, free_null_and_unused) {
  ps__par_free(NULL);
  ps__par_free(ps__par_new());
}
