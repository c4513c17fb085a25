/*
 * par.h - fork-join on two threads: the caller and one persistent helper thread.
 *
 * For a loop thread that meets a request too large to serve at memory latency on one
 * core (a pull or push of millions of keys): it splits the work in two parts, runs
 * part 0 itself and part 1 on the helper, and blocks until both are done. Nothing else
 * runs on the helper. The parts must not write the same memory; whatever the parts
 * read or write is handed over with the job and back with its completion (a mutex and
 * condition variable), so no other synchronisation is needed. One caller at a time.
 */
#ifndef PS_PAR_H
#define PS_PAR_H

typedef struct ps__par ps__par;
typedef void (*ps__par_fn)(void *arg, unsigned part);

/* Start the helper thread. NULL if it cannot be started (callers then stay serial). */
ps__par *ps__par_new(void);
/* Run fn(arg, 0) on the calling thread and fn(arg, 1) on the helper; return when both
 * have returned. */
void ps__par_run(ps__par *p, ps__par_fn fn, void *arg);
/* Stop and join the helper, free p. NULL is a no-op. */
void ps__par_free(ps__par *p);

#endif /* PS_PAR_H */
