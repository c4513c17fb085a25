/*
 * prefault.c - fault in a fresh mapping on a helper thread (see prefault.h).
 *
 * Why: the row map's next index is hundreds of MiB at 10^8 rows, in 2 MiB huge pages.
 * A huge page's first fault zeroes 2 MiB and may compact memory first (THP defrag
 * "madvise"): 0.3-8 ms each on a VM. Taken on the serving thread, those faults are
 * the tail of a growing table's push latency; taken here, they cost that thread
 * nothing but the start and the join of this thread.
 *
 * One job, one thread, started with the job and ended by ps__prefault_stop: the
 * helper checks `stop` under the job's mutex before it claims a step, and marks the
 * step it is in, so that the owner knows, without waiting, whether the helper may still
 * touch the mapping. Steps are claimed from an atomic counter; `ended` is also read
 * atomically, so that the owner can poll it without the lock. The job is freed by the
 * owner after a join when the helper has ended, else by the helper as it ends.
 */
#include "store/prefault.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#include "common/common.h"

#define STEP ((size_t)2 << 20) /* one huge page */
#define PAGE 4096u

struct ps__prefault {
  char *p;
  size_t bytes;
  void *map;      /* the mapping the range lies in (unmapped by the helper when it is its) */
  size_t map_len;
  size_t claim;   /* atomic: next byte offset to claim (may pass bytes) */
  size_t faulted; /* atomic: bytes of steps done */
  int writes;     /* steps write the mapping (no MADV_POPULATE_WRITE) */
  int stop;       /* under mu: take no further step */
  int in_step;    /* under mu: the helper is faulting in a step it claimed */
  int ended;      /* under mu (and atomic, for polling): the helper has left its loop */
  int gone;       /* under mu: the owner forgot the job; the helper frees it */
  int unmap;      /* under mu: the mapping is the helper's to unmap */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t th;
};

void (*ps__prefault_test_hook)(size_t bytes, int where);
int ps__prefault_test_write;

static unsigned running; /* atomic: helpers not yet ended */
static int populate = -1; /* atomic: whether the kernel has MADV_POPULATE_WRITE (-1: not asked yet) */

/* Whether pages can be faulted in without writing them: the advice is known (a kernel
 * of 5.14 or later), asked once with an empty range. */
static int can_populate(void) {
  int v = __atomic_load_n(&populate, __ATOMIC_RELAXED);
  if (v < 0) {
#ifdef MADV_POPULATE_WRITE
    v = madvise(NULL, 0, MADV_POPULATE_WRITE) == 0;
#else
    v = 0;
#endif
    __atomic_store_n(&populate, v, __ATOMIC_RELAXED);
  }
  return v;
}

static void fault_range(void *p, size_t n, int writes) {
#ifdef MADV_POPULATE_WRITE
  if (!writes) {
    madvise(p, n, MADV_POPULATE_WRITE); /* failed (out of memory): they fault in when used */
    return;
  }
#endif
  volatile unsigned char *q = p;
  for (size_t b = 0; b < n; b += PAGE) q[b] = 0; /* fresh memory: already zero */
}

void ps__pages_populate(void *p, size_t n) { fault_range(p, n, !can_populate()); }

static void job_free(ps__prefault *pf) {
  pthread_cond_destroy(&pf->cv);
  pthread_mutex_destroy(&pf->mu);
  free(pf);
}

static void *helper_main(void *arg) {
  ps__prefault *pf = arg;
  pthread_setname_np(pthread_self(), "pshard-prefault");
  pthread_mutex_lock(&pf->mu);
  for (;;) {
    if (pf->stop) break;
    if (ps__prefault_test_hook) {
      pthread_mutex_unlock(&pf->mu);
      ps__prefault_test_hook(pf->bytes, 0);
      pthread_mutex_lock(&pf->mu);
      if (pf->stop) break;
    }
    size_t off = __atomic_fetch_add(&pf->claim, STEP, __ATOMIC_RELAXED);
    if (off >= pf->bytes) break;
    size_t n = pf->bytes - off < STEP ? pf->bytes - off : STEP;
    pf->in_step = 1;
    pthread_mutex_unlock(&pf->mu);
    if (ps__prefault_test_hook) ps__prefault_test_hook(pf->bytes, 1);
    fault_range(pf->p + off, n, pf->writes);
    __atomic_fetch_add(&pf->faulted, n, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pf->mu);
    pf->in_step = 0;
    pthread_cond_broadcast(&pf->cv);
  }
  __atomic_store_n(&pf->ended, 1, __ATOMIC_RELEASE);
  int gone = pf->gone, unmap = pf->unmap;
  pthread_mutex_unlock(&pf->mu);
  if (unmap) munmap(pf->map, pf->map_len);
  if (gone) job_free(pf); /* else the owner joins this thread, then frees it */
  __atomic_fetch_sub(&running, 1, __ATOMIC_RELEASE);
  return NULL;
}

int ps__prefault_writes_nothing(void) { return !ps__prefault_test_write && can_populate(); }

ps__prefault *ps__prefault_start(void *p, size_t bytes, void *map, size_t map_len) {
  ps__prefault *pf = ps__calloc(1, sizeof *pf);
  pthread_condattr_t ca;
  if (!pf) return NULL;
  pf->p = p;
  pf->bytes = bytes;
  pf->map = map;
  pf->map_len = map_len;
  pf->writes = !ps__prefault_writes_nothing();
  pthread_mutex_init(&pf->mu, NULL);
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&pf->cv, &ca);
  pthread_condattr_destroy(&ca);
  /* The helper inherits the caller's signal mask: block everything, so that signals
   * aimed at the process go to the threads that expect them. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  __atomic_fetch_add(&running, 1, __ATOMIC_RELAXED);
  int rc = pthread_create(&pf->th, NULL, helper_main, pf);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    __atomic_fetch_sub(&running, 1, __ATOMIC_RELAXED);
    job_free(pf);
    return NULL;
  }
  return pf;
}

size_t ps__prefault_claim(ps__prefault *pf, size_t due) {
  size_t own = 0;
  if (due > pf->bytes) due = pf->bytes;
  while (__atomic_load_n(&pf->claim, __ATOMIC_RELAXED) < due) {
    size_t off = __atomic_fetch_add(&pf->claim, STEP, __ATOMIC_RELAXED);
    if (off >= pf->bytes) break;
    size_t n = pf->bytes - off < STEP ? pf->bytes - off : STEP;
    fault_range(pf->p + off, n, pf->writes);
    __atomic_fetch_add(&pf->faulted, n, __ATOMIC_RELAXED);
    own += n;
  }
  return own;
}

size_t ps__prefault_claimed(const ps__prefault *pf) {
  size_t c = __atomic_load_n(&pf->claim, __ATOMIC_RELAXED);
  return c < pf->bytes ? c : pf->bytes;
}

size_t ps__prefault_faulted(const ps__prefault *pf) { return __atomic_load_n(&pf->faulted, __ATOMIC_RELAXED); }

int ps__prefault_finished(const ps__prefault *pf) { return __atomic_load_n(&pf->ended, __ATOMIC_ACQUIRE); }

int ps__prefault_stop(ps__prefault *pf, int keep, unsigned wait_ms, size_t *claimed) {
  int rc = 0;
  pthread_mutex_lock(&pf->mu);
  pf->stop = 1;
  if (pf->in_step && keep && pf->writes && wait_ms) {
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += wait_ms / 1000;
    dl.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
      dl.tv_sec++;
      dl.tv_nsec -= 1000000000L;
    }
    while (pf->in_step)
      if (pthread_cond_timedwait(&pf->cv, &pf->mu, &dl) == ETIMEDOUT) break;
  }
  if (pf->in_step && (pf->writes || !keep)) { /* the mapping goes with the helper */
    pf->unmap = 1;
    rc = -1;
  }
  *claimed = ps__prefault_claimed(pf);
  if (pf->ended) {
    pthread_mutex_unlock(&pf->mu);
    pthread_join(pf->th, NULL);
    job_free(pf);
  } else { /* it is between steps or in its last one: it frees the job when it ends */
    pthread_t th = pf->th;
    pf->gone = 1;
    pthread_mutex_unlock(&pf->mu);
    pthread_detach(th);
  }
  return rc;
}

unsigned ps__prefault_running(void) { return __atomic_load_n(&running, __ATOMIC_ACQUIRE); }
