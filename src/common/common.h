/*
 * common.h - shared internals: error messages, logging, time, assertions.
 * No I/O beyond the log hook; usable from every layer.
 */
#ifndef PS_COMMON_H
#define PS_COMMON_H

#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "pshard.h"

#define PS_INTERNAL __attribute__((visibility("hidden")))

/* Always-on assertion for internal invariants (never for outside input). */
#define PS_ASSERT(cond)                                                        \
  do {                                                                         \
    if (!(cond)) ps__panic(__FILE__, __LINE__, #cond);                         \
  } while (0)
_Noreturn void ps__panic(const char *file, int line, const char *what);

/* Record a detailed message for the calling thread's last error and return err. */
int ps__fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Clear the thread's last message. */
void ps__clear_err(void);

/* Logging through the hook set with ps_set_log (or stderr for daemons). */
/* Would a message of this level go anywhere (a log function is set and takes it)? */
int ps__log_enabled(int level);
void ps__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Daemons (pshard server/scheduler) log to stderr at this level. */
void ps__log_to_stderr(int max_level, const char *prefix);
/* Block SIGPIPE in the calling thread, which runs a pshard event loop. A write to a
 * connection the peer closed then fails with EPIPE (handled as a closed connection)
 * instead of killing the process: libuv writes without MSG_NOSIGNAL, and in embedded
 * mode or in a worker the process is the user's, so we cannot ignore the signal
 * process-wide. A SIGPIPE left pending on such a thread is never delivered. */
void ps__block_sigpipe(void);

/* Monotonic time. */
uint64_t ps__now_ns(void);
static inline uint64_t ps__now_ms(void) { return ps__now_ns() / 1000000u; }
/* The CLOCK_REALTIME instant ms milliseconds from now (pthread_cond_timedwait,
 * pthread_timedjoin_np). */
static inline struct timespec ps__abs_after_ms(uint64_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t ns = (uint64_t)ts.tv_nsec + (ms % 1000) * 1000000ull;
  ts.tv_sec += (time_t)(ms / 1000 + ns / 1000000000ull);
  ts.tv_nsec = (long)(ns % 1000000000ull);
  return ts;
}
/* How much longer than its base window a poller keeps polling after handing a loopback
 * peer `bytes` (or taking them from it): the peer needs about that long to take them in
 * (2 GB/s) before it answers or sends its next request, and a sleeping poller on an
 * idle virtual CPU pays a hypervisor wake-up when it does. At most 1 ms. */
static inline uint64_t ps__poll_extra_ns(uint64_t bytes) { return bytes / 2 < 1000000u ? bytes / 2 : 1000000u; }

/* Parsing helpers: 0 on success. */
int ps__parse_u64(const char *s, uint64_t *out);
int ps__parse_i64(const char *s, int64_t *out);
int ps__parse_float(const char *s, float *out);
/* "host:port" -> host (copied into host, hostlen) and port. */
int ps__parse_hostport(const char *s, char *host, size_t hostlen, int *port);

/* xxh64 of a byte string (used for ring placement and name hashing). */
uint64_t ps__hash64(const void *p, size_t n, uint64_t seed);
/* A 64-bit mixer (splitmix64 finaliser). */
static inline uint64_t ps__mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Allocation that reports failure (callers turn NULL into PS_ERR_NOMEM). */
void *ps__malloc(size_t n);
void *ps__calloc(size_t n, size_t m);
void *ps__realloc(void *p, size_t n);
char *ps__strdup(const char *s);
/* This host's identity for same-host transport selection. */
void ps__hostid(char *out, size_t n);

#endif
