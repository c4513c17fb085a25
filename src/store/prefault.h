/*
 * prefault.h - fault in a fresh mapping on a helper thread (store-internal; used by
 * rowmap.c for the next row index).
 *
 * A job covers a range of `bytes` bytes in one mapping. The range is cut in 2 MiB steps; the helper thread and the owner's thread both take steps from one
 * atomic counter, so each step is faulted in exactly once, by whichever thread claimed
 * it, and neither waits for the other. A step is faulted in with MADV_POPULATE_WRITE
 * where the kernel has it (the pages' contents are not written), else by writing one
 * byte per 4 KiB page.
 *
 * Threads: the job's owner (one thread: the row map's) calls every function here; the
 * helper only faults in steps and says when it has finished. The owner uses the memory
 * only after ps__prefault_stop returned 0: the helper takes no step after that, and
 * writes no byte of the mapping after that. ps__prefault_stop waits for nothing but a
 * step that writes the mapping, and not longer than it is told: when the helper is
 * still inside such a step then, the mapping passes to the helper, which unmaps it
 * when the step ends.
 */
#ifndef PS_STORE_PREFAULT_H
#define PS_STORE_PREFAULT_H

#include <stddef.h>

typedef struct ps__prefault ps__prefault;

/* Fault in the pages of [p, p + n) (n a multiple of 4096; p page-aligned) on the calling
 * thread. */
void ps__pages_populate(void *p, size_t n);

/* A helper thread that faults in [p, p + bytes) (p 2 MiB-aligned), part of the
 * mapping [map, map + map_len) (as made by mmap), started now. NULL when no job could
 * be made (out of memory, or no thread): the caller then faults the range in itself. */
ps__prefault *ps__prefault_start(void *p, size_t bytes, void *map, size_t map_len);

/* Whether the helper's steps write no byte (the kernel has MADV_POPULATE_WRITE): then
 * the owner may write to the range while the helper faults it in. */
int ps__prefault_writes_nothing(void);

/* On the owner's thread: claim and fault in steps until the first `due` bytes of the
 * mapping are claimed (by either thread). Returns the bytes this call faulted in. */
size_t ps__prefault_claim(ps__prefault *pf, size_t due);

/* Bytes claimed by either thread so far (at most the mapping's size): faulted in, or
 * being faulted in now. */
size_t ps__prefault_claimed(const ps__prefault *pf);

/* Bytes whose steps are done (faulted in). */
size_t ps__prefault_faulted(const ps__prefault *pf);

/* Whether the helper has ended (every step claimed and done, or it was stopped). */
int ps__prefault_finished(const ps__prefault *pf);

/* End the job; the helper takes no further step. keep: the owner is about to use the
 * range, else it is about to unmap the mapping. Never waits longer than wait_ms (0: not at
 * all), and only when keep is set and the helper is inside a step that writes the
 * mapping (no MADV_POPULATE_WRITE). 0: the mapping is the owner's (the steps before
 * *claimed are faulted in, the one the helper may still be in with
 * MADV_POPULATE_WRITE, which changes no byte and leaves the mapping in place, excepted).
 * -1: the helper is inside a step and the whole mapping is the helper's now, which
 * unmaps it when the step ends. Either way the job is the helper's or freed: the owner forgets
 * it (the last of the two frees it). */
int ps__prefault_stop(ps__prefault *pf, int keep, unsigned wait_ms, size_t *claimed);

/* Helper threads running now, in this process (jobs not yet ended; tests). */
unsigned ps__prefault_running(void);

/* Tests: when set, the helper of a job of `bytes` bytes calls the hook before it claims
 * each step (where 0) and inside each step before faulting it in (where 1); the hook
 * may sleep, to model a starved thread or a slow kernel. With ps__prefault_test_write
 * set, steps are faulted in by writing, as without MADV_POPULATE_WRITE. Set both
 * before jobs start. */
extern void (*ps__prefault_test_hook)(size_t bytes, int where);
extern int ps__prefault_test_write;

#endif /* PS_STORE_PREFAULT_H */
