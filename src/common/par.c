/*
 * par.c - fork-join on two threads (see par.h). The helper sleeps on a condition
 * variable between jobs; a job is (fn, arg) plus a sequence number, its completion a
 * second sequence number.
 */
#include "common/par.h"

#include <pthread.h>
#include <signal.h>

#include "common/common.h"

struct ps__par {
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  ps__par_fn fn;
  void *arg;
  unsigned long posted, done; /* jobs posted to the helper, jobs it finished */
  int stop;
};

static void *helper_main(void *arg) {
  ps__par *p = arg;
  unsigned long seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->stop && p->posted == seen) pthread_cond_wait(&p->cv, &p->mu);
    if (p->stop) break;
    seen = p->posted;
    ps__par_fn fn = p->fn;
    void *a = p->arg;
    pthread_mutex_unlock(&p->mu);
    fn(a, 1);
    pthread_mutex_lock(&p->mu);
    p->done = seen;
    pthread_cond_broadcast(&p->cv);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

ps__par *ps__par_new(void) {
  ps__par *p = ps__calloc(1, sizeof *p);
  if (!p) return NULL;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  /* The helper inherits the caller's signal mask; block everything so that signals
   * aimed at the process (and SIGPIPE) go to the threads that expect them. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int rc = pthread_create(&p->th, NULL, helper_main, p);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
    return NULL;
  }
  return p;
}

void ps__par_run(ps__par *p, ps__par_fn fn, void *arg) {
  pthread_mutex_lock(&p->mu);
  p->fn = fn;
  p->arg = arg;
  unsigned long job = ++p->posted;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  fn(arg, 0);
  pthread_mutex_lock(&p->mu);
  while (p->done != job) pthread_cond_wait(&p->cv, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

void ps__par_free(ps__par *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  pthread_join(p->th, NULL);
  pthread_cond_destroy(&p->cv);
  pthread_mutex_destroy(&p->mu);
  free(p);
}
