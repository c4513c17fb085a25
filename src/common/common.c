/*
 * common.c - error messages, logging, time, parsing and allocation helpers.
 */
#include "common/common.h"
#include "common/fault.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

static const char *const err_msgs[] = {
#define X(name, code, msg) [code] = msg,
    PS_ERRNO_MAP(X)
#undef X
};
static const char *const err_names[] = {
#define X(name, code, msg) [code] = "PS_" #name,
    PS_ERRNO_MAP(X)
#undef X
};

const char *ps_strerror(int err) {
  if (err < 0 || err >= PS_ERR__COUNT) return "unknown error";
  return err_msgs[err];
}

const char *ps_err_name(int err) {
  if (err < 0 || err >= PS_ERR__COUNT) return "PS_ERR_UNKNOWN";
  return err_names[err];
}

static _Thread_local char last_msg[512];

const char *ps_errmsg(void) { return last_msg; }

void ps__clear_err(void) { last_msg[0] = '\0'; }

int ps__fail(int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_msg, sizeof last_msg, fmt, ap);
  va_end(ap);
  return err;
}

void ps__block_sigpipe(void) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &set, NULL);
}

_Noreturn void ps__panic(const char *file, int line, const char *what) {
  fprintf(stderr, "pshard: internal error at %s:%d: assertion failed: %s\n", file, line, what);
  abort();
}

/* Logging: a process-wide hook. Reads are racy by design only at configuration time. */
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static ps_log_fn log_fn;
static void *log_arg;
static int log_level = -1;
static char log_prefix[64];

void ps_set_log(ps_log_fn fn, void *arg, int max_level) {
  pthread_mutex_lock(&log_mu);
  log_fn = fn;
  log_arg = arg;
  log_level = fn ? max_level : -1;
  pthread_mutex_unlock(&log_mu);
}

static void stderr_log(int level, const char *msg, void *arg) {
  static const char *const names[] = {"error", "warn", "info", "debug"};
  (void)arg;
  fprintf(stderr, "%s%s: %s\n", log_prefix, names[level < 0 ? 0 : level > 3 ? 3 : level], msg);
}

void ps__log_to_stderr(int max_level, const char *prefix) {
  pthread_mutex_lock(&log_mu);
  snprintf(log_prefix, sizeof log_prefix, "%s", prefix ? prefix : "");
  pthread_mutex_unlock(&log_mu);
  ps_set_log(stderr_log, NULL, max_level);
}

int ps__log_enabled(int level) {
  pthread_mutex_lock(&log_mu);
  int on = log_fn && level <= log_level;
  pthread_mutex_unlock(&log_mu);
  return on;
}

void ps__log(int level, const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  pthread_mutex_lock(&log_mu);
  ps_log_fn fn = log_fn;
  void *arg = log_arg;
  int max = log_level;
  pthread_mutex_unlock(&log_mu);
  if (!fn || level > max) return;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fn(level, buf, arg);
}

uint64_t ps__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int ps__parse_u64(const char *s, uint64_t *out) {
  char *end;
  /* strtoull would also take leading blanks and a sign ("-1" wraps around). */
  if (!s || *s < '0' || *s > '9') return -1;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end) return -1;
  *out = v;
  return 0;
}

int ps__parse_i64(const char *s, int64_t *out) {
  char *end;
  if (!s || !*s) return -1;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || *end) return -1;
  *out = v;
  return 0;
}

int ps__parse_float(const char *s, float *out) {
  char *end;
  if (!s || !*s) return -1;
  errno = 0;
  float v = strtof(s, &end);
  if (errno || *end || !isfinite(v)) return -1;
  *out = v;
  return 0;
}

int ps__parse_hostport(const char *s, char *host, size_t hostlen, int *port) {
  const char *colon = s ? strrchr(s, ':') : NULL;
  uint64_t p;
  if (!colon || colon == s || (size_t)(colon - s) >= hostlen) return -1;
  if (ps__parse_u64(colon + 1, &p) || p > 65535) return -1;
  memcpy(host, s, (size_t)(colon - s));
  host[colon - s] = '\0';
  *port = (int)p;
  return 0;
}

uint64_t ps__hash64(const void *p, size_t n, uint64_t seed) { return XXH64(p, n, seed); }

/* Each wrapper may be made to fail by an armed alloc fault rule (fault.h); when none
 * is armed that costs one test of a global flag. */
void *ps__malloc(size_t n) { return ps__fault_on() && ps__fault_alloc() ? NULL : malloc(n ? n : 1); }
void *ps__calloc(size_t n, size_t m) { return ps__fault_on() && ps__fault_alloc() ? NULL : calloc(n ? n : 1, m ? m : 1); }
void *ps__realloc(void *p, size_t n) { return ps__fault_on() && ps__fault_alloc() ? NULL : realloc(p, n ? n : 1); }
char *ps__strdup(const char *s) { return !s || (ps__fault_on() && ps__fault_alloc()) ? NULL : strdup(s); }

/* An identifier of this host (boot id, else host name): peers with the same one may use
 * AF_UNIX sockets. */
void ps__hostid(char *out, size_t n) {
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  out[0] = '\0';
  if (f) {
    if (fgets(out, (int)n, f)) out[strcspn(out, "\n")] = '\0';
    fclose(f);
  }
  if (!out[0] && gethostname(out, n) != 0) snprintf(out, n, "unknown");
}
