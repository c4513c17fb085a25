/*
 * pm_test.h - helpers shared by the unit tests of peer memory (test_peermem.c) and of
 * shared buffers (test_shared.c): call checks, byte patterns, lists of (address,
 * length) descriptors, and bounded waits for a forked child.
 */
#ifndef PS_PM_TEST_H
#define PS_PM_TEST_H

#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proto/frame.h"
#include "pshard.h"

#define OK(call)                                                                                    \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, 0), "%s -> %s: %s", #call, ps_err_name(rc_), ps_errmsg());               \
  } while (0)

/* A call that must fail with `err`. */
#define FAILS(err, call)                                                                            \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, err), "%s -> %s (%s), expected %s", #call, ps_err_name(rc_),               \
              rc_ ? ps_errmsg() : "", ps_err_name(err));                                            \
  } while (0)

static inline uint8_t pat(unsigned seed, size_t i) { return (uint8_t)((i + seed * 977u) * 2654435761u >> 13); }

static inline size_t page_size(void) { return (size_t)sysconf(_SC_PAGESIZE); }

/* A list of descriptors: little-endian (u64 address, u64 length) pairs. */
typedef struct descs {
  uint8_t *d;
  size_t n, cap;
} descs;

static inline void descs_add(descs *s, uint64_t addr, uint64_t len) {
  if (s->n == s->cap) {
    s->cap = s->cap ? 2 * s->cap : 16;
    s->d = realloc(s->d, s->cap * 16);
    cr_assert(s->d != NULL);
  }
  ps__put_u64(s->d + 16 * s->n, addr);
  ps__put_u64(s->d + 16 * s->n + 8, len);
  s->n++;
}

static inline void descs_free(descs *s) {
  free(s->d);
  memset(s, 0, sizeof *s);
}

static inline int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait at most ms for pid to exit; 1 and its status if it did. */
static inline int reap(pid_t pid, int ms, int *status) {
  int64_t end = now_ms() + ms;
  for (;;) {
    int st = 0;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) {
      if (status) *status = st;
      return 1;
    }
    if (r < 0 && errno != EINTR) return 0;
    if (now_ms() >= end) return 0;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}

#endif
