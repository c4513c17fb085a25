/*
 * hist.c - the buckets of the latency histograms (hist.h).
 */
#include "common/hist.h"

/* 10^(-5 + i/4) s, rounded to the nanosecond. */
const uint64_t ps__hist_bound_ns[PS__HIST_BOUNDS] = {
    10000ull,      17783ull,      31623ull,      56234ull,      100000ull,     177828ull,    316228ull,
    562341ull,     1000000ull,    1778279ull,    3162278ull,    5623413ull,    10000000ull,  17782794ull,
    31622777ull,   56234133ull,   100000000ull,  177827941ull,  316227766ull,  562341325ull, 1000000000ull,
    1778279410ull, 3162277660ull, 5623413252ull, 10000000000ull};

double ps__hist_bound_s(int i) { return (double)ps__hist_bound_ns[i] * 1e-9; }

int ps__hist_bucket(uint64_t ns) {
  int lo = 0, hi = PS__HIST_BOUNDS; /* the answer is in [lo, hi] */
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (ps__hist_bound_ns[mid] >= ns)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

void ps__hist_read(const ps__hist *h, ps__hist *out) {
  for (int i = 0; i < PS__HIST_BUCKETS; i++) out->n[i] = __atomic_load_n(&h->n[i], __ATOMIC_RELAXED);
  out->sum_ns = __atomic_load_n(&h->sum_ns, __ATOMIC_RELAXED);
}
