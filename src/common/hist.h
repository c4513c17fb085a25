/*
 * hist.h - latency histograms: fixed log-spaced buckets, lock-free counters.
 *
 * Every histogram has the same buckets, four per decade from 10 us to 10 s (upper
 * bounds 10^(-5 + i/4) seconds, i = 0..24) and one for what is slower. Recording is
 * two relaxed atomic additions (the bucket and the sum), so any thread may record
 * into a histogram while another reads it: a reader sees each counter whole, though
 * the buckets and the sum of one read may be a few records apart. The buckets are
 * kept as counts per bucket; readers make them cumulative (proto/prom.c).
 */
#ifndef PS_HIST_H
#define PS_HIST_H

#include <stdint.h>

#define PS__HIST_BOUNDS 25                  /* finite upper bounds: 10 us .. 10 s */
#define PS__HIST_BUCKETS (PS__HIST_BOUNDS + 1) /* and the one above 10 s */

typedef struct ps__hist {
  uint64_t n[PS__HIST_BUCKETS]; /* records per bucket (not cumulative) */
  uint64_t sum_ns;              /* the recorded durations added up */
} ps__hist;

/* The upper bound of bucket i (< PS__HIST_BOUNDS), in nanoseconds and in seconds. */
extern const uint64_t ps__hist_bound_ns[PS__HIST_BOUNDS];
double ps__hist_bound_s(int i);
/* The bucket of a duration of ns nanoseconds: the first whose bound is >= ns. */
int ps__hist_bucket(uint64_t ns);

/* Record a duration. Any thread. */
static inline void ps__hist_add(ps__hist *h, uint64_t ns) {
  __atomic_fetch_add(&h->n[ps__hist_bucket(ns)], 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&h->sum_ns, ns, __ATOMIC_RELAXED);
}

/* A copy of h read counter by counter (relaxed loads). Any thread. */
void ps__hist_read(const ps__hist *h, ps__hist *out);

#endif
