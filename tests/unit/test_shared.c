/*
 * test_shared.c - buffers a worker shares with the servers of its host (src/net/shared.c):
 * ps_alloc / ps_free, the worker's hint (ps__shm_hint), and the server's cache of its
 * workers' files (ps__shm_translate, ps__shm_sweep, ps__shm_forget, ps__shm_cache_free).
 *
 * The server's side needs another process. Each such test forks a child (the "worker")
 * that allocates its buffers after the fork (so they are its own, not inherited), fills
 * them with a pattern, sends the parent (the "server") their addresses and descriptors
 * over one pipe and then serves commands from another: check or fill a range of its
 * buffer, free it, allocate a new one. The child exits on its own when the command pipe
 * closes, when its parent dies, or after an alarm, and every wait for it is bounded.
 *
 * ps__shm_translate looks the regions up with PROCMAP_QUERY, which Linux has from 6.11 on;
 * on an older kernel every translation falls back (returns 1). The tests that expect a
 * translation check that fallback there, and then skip the rest.
 *
 * Every test has the same timeout: Criterion 2.4.1's runner, running tests in parallel,
 * leaks a 48-byte timeout entry (LeakSanitizer fails the run) when a test with a shorter
 * timeout starts while one with a longer timeout still runs.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/common.h"
#include "net/net.h"
#include "proto/frame.h"
#include "pshard.h"
#include "pm_test.h"

static size_t page_round(size_t n) { return (n + page_size() - 1) / page_size() * page_size(); }

/* ---------------------------------------------------------------- this process */

/* Open file descriptors of this process. */
static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  cr_assert(d != NULL, "opendir: %s", strerror(errno));
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

/* Mappings of this process whose line in /proc/self/maps contains `needle`. */
static int count_maps(const char *needle) {
  FILE *f = fopen("/proc/self/maps", "r");
  cr_assert(f != NULL, "fopen: %s", strerror(errno));
  char *line = NULL;
  size_t cap = 0;
  int n = 0;
  while (getline(&line, &cap, f) > 0) n += strstr(line, needle) != NULL;
  free(line);
  fclose(f);
  return n;
}

#define SHM_NAME "/memfd:pshard-buffer"
#define KID_FILE "/memfd:pshard-test " /* the child's own files (the space: not -huge) */

/* What fd names in /proc/self/fd. */
static void fd_target(int fd, char *out, size_t n) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t k = readlink(path, out, n - 1);
  cr_assert(gt(sz, (size_t)(k < 0 ? 0 : k), 0), "readlink %s: %s", path, strerror(errno));
  out[k] = '\0';
}

static uint64_t hint1(const void *p, uint64_t len) {
  uint64_t pair[2] = {(uint64_t)(uintptr_t)p, len};
  return ps__shm_hint(pair, 1);
}

static uint64_t hint2(const void *p, uint64_t len, const void *q, uint64_t qlen) {
  uint64_t pairs[4] = {(uint64_t)(uintptr_t)p, len, (uint64_t)(uintptr_t)q, qlen};
  return ps__shm_hint(pairs, 2);
}

/* ---------------------------------------------------------------- ps_alloc / ps_free */

Test(shm_alloc, aligned_zeroed_writable, .timeout = 120) {
  static const size_t sizes[] = {1, 4096, 4097, 3u << 20};
  enum { N = sizeof sizes / sizeof sizes[0] };
  uint8_t *p[N];
  for (size_t k = 0; k < N; k++) {
    p[k] = ps_alloc(sizes[k]);
    cr_assert(not(eq(ptr, p[k], NULL)), "ps_alloc(%zu): %s", sizes[k], ps_errmsg());
    cr_assert(eq(u64, (uint64_t)(uintptr_t)p[k] % page_size(), 0), "ps_alloc(%zu) = %p", sizes[k], (void *)p[k]);
    for (size_t i = 0; i < sizes[k]; i++) cr_assert(eq(u8, p[k][i], 0), "ps_alloc(%zu): byte %zu", sizes[k], i);
    for (size_t i = 0; i < sizes[k]; i++) p[k][i] = pat((unsigned)k, i);
  }
  /* all four at once, each still holding its own bytes: none overlaps another */
  for (size_t k = 0; k < N; k++)
    for (size_t i = 0; i < sizes[k]; i++) cr_assert(eq(u8, p[k][i], pat((unsigned)k, i)), "buffer %zu, byte %zu", k, i);
  for (size_t k = 0; k < N; k++) ps_free(p[k]);
  /* and again after they are freed: zeroed, not the old bytes */
  uint8_t *q = ps_alloc(3u << 20);
  cr_assert(not(eq(ptr, q, NULL)), "%s", ps_errmsg());
  for (size_t i = 0; i < (3u << 20); i++) cr_assert(eq(u8, q[i], 0), "byte %zu", i);
  ps_free(q);
}

Test(shm_alloc, bad_sizes_fail_with_a_message, .timeout = 120) {
  int fds = count_fds();
  ps__clear_err();
  cr_assert(eq(ptr, ps_alloc(0), NULL));
  cr_assert(gt(sz, strlen(ps_errmsg()), 0), "no message for ps_alloc(0)");
  cr_assert(not(eq(ptr, strstr(ps_errmsg(), "ps_alloc"), NULL)), "message: %s", ps_errmsg());
  /* sizes that cannot be rounded to a page, or mapped */
  const size_t huge[] = {SIZE_MAX, SIZE_MAX - page_size() + 2, (size_t)1 << 60};
  for (size_t k = 0; k < sizeof huge / sizeof huge[0]; k++) {
    ps__clear_err();
    cr_assert(eq(ptr, ps_alloc(huge[k]), NULL), "ps_alloc(%zu)", huge[k]);
    cr_assert(gt(sz, strlen(ps_errmsg()), 0), "no message for ps_alloc(%zu)", huge[k]);
  }
  cr_assert(eq(int, count_fds(), fds), "a failed ps_alloc left a descriptor open");
}

static char logged[1024];
static int nlogged;

static void keep_log(int level, const char *msg, void *arg) {
  (void)arg;
  if (level != PS_LOG_ERROR) return;
  snprintf(logged, sizeof logged, "%s", msg);
  nlogged++;
}

Test(shm_alloc, free_takes_only_its_own_pointers, .timeout = 120) {
  ps_set_log(keep_log, NULL, PS_LOG_DEBUG);
  ps_free(NULL);
  cr_assert(eq(int, nlogged, 0), "ps_free(NULL) logged: %s", logged);

  /* a pointer from malloc: ignored (and said so), the memory stays usable */
  uint8_t *m = malloc(10000);
  cr_assert(m != NULL);
  for (size_t i = 0; i < 10000; i++) m[i] = pat(1, i);
  ps_free(m);
  cr_assert(eq(int, nlogged, 1));
  cr_assert(not(eq(ptr, strstr(logged, "ps_free"), NULL)), "logged: %s", logged);
  for (size_t i = 0; i < 10000; i++) cr_assert(eq(u8, m[i], pat(1, i)), "byte %zu", i);
  memset(m, 0x5a, 10000);
  cr_assert(eq(u8, m[9999], 0x5a));
  free(m);

  /* a pointer inside a ps_alloc buffer, not its start: ignored, the buffer still whole */
  size_t pg = page_size();
  uint8_t *p = ps_alloc(3 * pg);
  cr_assert(not(eq(ptr, p, NULL)), "%s", ps_errmsg());
  for (size_t i = 0; i < 3 * pg; i++) p[i] = pat(2, i);
  uint64_t h = hint1(p, 3 * pg);
  cr_assert(not(eq(u64, h, 0)));
  ps_free(p + pg);
  ps_free(p + 1);
  cr_assert(eq(int, nlogged, 3));
  for (size_t i = 0; i < 3 * pg; i++) cr_assert(eq(u8, p[i], pat(2, i)), "byte %zu", i);
  cr_assert(eq(u64, hint1(p, 3 * pg), h), "the buffer is still known");

  /* freed: gone from the hints; a second ps_free of it is ignored too */
  ps_free(p);
  cr_assert(eq(int, nlogged, 3));
  cr_assert(eq(u64, hint1(p, 1), 0));
  ps_free(p);
  cr_assert(eq(int, nlogged, 4));
  ps_set_log(NULL, NULL, 0);
}

Test(shm_alloc, no_descriptor_leak, .timeout = 120) {
  int fds = count_fds();
  size_t pg = page_size();
  /* one descriptor per live buffer, none after ps_free */
  uint8_t *p[10];
  for (size_t k = 0; k < 10; k++) {
    p[k] = ps_alloc(1 + k * pg);
    cr_assert(not(eq(ptr, p[k], NULL)), "%s", ps_errmsg());
  }
  cr_assert(eq(int, count_fds(), fds + 10));
  for (size_t k = 0; k < 10; k++) ps_free(p[k]);
  cr_assert(eq(int, count_fds(), fds));
  int maps = count_maps(SHM_NAME);
  for (size_t k = 0; k < 200; k++) {
    uint8_t *q = ps_alloc(1 + (k * 7919) % (300 * 1024));
    cr_assert(not(eq(ptr, q, NULL)), "cycle %zu: %s", k, ps_errmsg());
    q[0] = (uint8_t)k;
    ps_free(q);
  }
  /* freed in another order than allocated */
  for (size_t k = 0; k < 10; k++) {
    p[k] = ps_alloc(pg + k);
    cr_assert(not(eq(ptr, p[k], NULL)), "%s", ps_errmsg());
  }
  for (size_t k = 0; k < 10; k++) ps_free(p[(k * 3) % 10]);
  cr_assert(eq(int, count_fds(), fds), "descriptors leaked over the alloc/free cycles");
  cr_assert(eq(int, count_maps(SHM_NAME), maps), "mappings left over the alloc/free cycles");
}

/* ---------------------------------------------------------------- ps__shm_hint */

/* The descriptor a hint names: open, close-on-exec, a sealed memfd of ps_alloc. */
static void expect_buffer_fd(uint64_t h) {
  cr_assert(gt(u64, h, 0));
  cr_assert(le(u64, h, (uint64_t)INT32_MAX + 1));
  int fd = (int)(h - 1);
  int fl = fcntl(fd, F_GETFD);
  cr_assert(ge(int, fl, 0), "hint %llu: fd %d is not open", (unsigned long long)h, fd);
  cr_assert(fl & FD_CLOEXEC, "fd %d is not close-on-exec", fd);
  char name[256];
  fd_target(fd, name, sizeof name);
  cr_assert(eq(int, strncmp(name, SHM_NAME, strlen(SHM_NAME)), 0), "fd %d is %s", fd, name);
  int seals = fcntl(fd, F_GET_SEALS);
  cr_assert(ge(int, seals, 0), "F_GET_SEALS: %s", strerror(errno));
  cr_assert(eq(int, seals & (F_SEAL_SHRINK | F_SEAL_GROW), F_SEAL_SHRINK | F_SEAL_GROW), "seals %#x", seals);
}

/* At most PS_SHM_MAX buffers are shared at once (each holds a descriptor); later ones
 * are ordinary memory (no hint) that works the same, until a shared one is freed. */
Test(shm_alloc, shares_at_most_a_cap_of_buffers_at_once, .timeout = 120) {
  size_t pg = page_size();
  int fds = count_fds();
  enum { N = PS_SHM_MAX + 3 };
  static uint8_t *p[N];
  for (unsigned k = 0; k < N; k++) {
    p[k] = ps_alloc(pg);
    cr_assert(not(eq(ptr, p[k], NULL)), "buffer %u: %s", k, ps_errmsg());
    cr_assert(eq(u64, (uint64_t)(uintptr_t)p[k] % pg, 0));
    cr_assert(eq(u8, p[k][0] | p[k][pg - 1], 0), "buffer %u is not zeroed", k);
    p[k][0] = p[k][pg - 1] = (uint8_t)(k + 1);
    if (k < PS_SHM_MAX) cr_assert(not(eq(u64, hint1(p[k], pg), 0)), "buffer %u is not shared", k);
    else cr_assert(eq(u64, hint1(p[k], pg), 0), "buffer %u is shared beyond the cap", k);
  }
  cr_assert(eq(int, count_fds(), fds + PS_SHM_MAX));
  for (unsigned k = 0; k < N; k++) cr_assert(eq(u8, p[k][0], (uint8_t)(k + 1)), "buffer %u", k);
  /* an ordinary one freed: still no room; a shared one freed: the next is shared */
  ps_free(p[N - 1]);
  p[N - 1] = ps_alloc(pg);
  cr_assert(not(eq(ptr, p[N - 1], NULL)));
  cr_assert(eq(u64, hint1(p[N - 1], pg), 0));
  ps_free(p[0]);
  p[0] = ps_alloc(pg);
  cr_assert(not(eq(ptr, p[0], NULL)));
  cr_assert(not(eq(u64, hint1(p[0], pg), 0)), "a freed slot was not taken again");
  cr_assert(eq(int, count_fds(), fds + PS_SHM_MAX));
  for (unsigned k = 0; k < N; k++) ps_free(p[k]);
  cr_assert(eq(int, count_fds(), fds));
}

/* Forks while another thread allocates and frees: every child can still allocate (the
 * allocator's lock is never copied held into a child). Each child is waited for at
 * most 5 s; one that hangs fails the test and is killed. */
static volatile int churn_stop;

static void *churn(void *arg) {
  (void)arg;
  while (!churn_stop) ps_free(ps_alloc(4096));
  return NULL;
}

Test(shm_alloc, fork_while_another_thread_allocates, .timeout = 120) {
  pthread_t t;
  cr_assert(eq(int, pthread_create(&t, NULL, churn, NULL), 0));
  int bad = 0;
  for (int i = 0; i < 400 && !bad; i++) {
    pid_t pid = fork();
    cr_assert(ge(int, pid, 0));
    if (pid == 0) {
      alarm(10);
      void *p = ps_alloc(8192);
      _exit(p && hint1(p, 8192) ? 0 : 3);
    }
    int st = 0;
    if (!reap(pid, 5000, &st)) {
      kill(pid, SIGKILL);
      reap(pid, 5000, NULL);
      bad = 1;
    } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      bad = 2;
    }
  }
  churn_stop = 1;
  pthread_join(t, NULL);
  cr_assert(eq(int, bad, 0), "a child %s", bad == 1 ? "hung in ps_alloc" : "failed");
}

Test(shm_hint, regions_inside_one_buffer, .timeout = 120) {
  size_t pg = page_size(), n = 3 * pg + 5, len = page_round(n);
  uint8_t *p = ps_alloc(n);
  cr_assert(not(eq(ptr, p, NULL)), "%s", ps_errmsg());
  uint64_t h = hint1(p, 1);
  expect_buffer_fd(h);
  cr_assert(eq(u64, hint1(p, n), h));
  cr_assert(eq(u64, hint1(p, len), h), "the whole mapping");
  cr_assert(eq(u64, hint1(p + len - 1, 1), h), "its last byte");
  cr_assert(eq(u64, hint1(p + pg - 3, 7), h), "across a page boundary");
  /* several regions, out of order, one repeated */
  uint64_t pairs[] = {(uint64_t)(uintptr_t)(p + 2 * pg + 1), 100, (uint64_t)(uintptr_t)p, 10,
                      (uint64_t)(uintptr_t)(p + 7), pg,      (uint64_t)(uintptr_t)(p + len - 9), 9,
                      (uint64_t)(uintptr_t)p, 10};
  cr_assert(eq(u64, ps__shm_hint(pairs, 5), h));

  /* another buffer has its own descriptor */
  uint8_t *q = ps_alloc(pg);
  cr_assert(not(eq(ptr, q, NULL)), "%s", ps_errmsg());
  uint64_t hq = hint1(q, pg);
  expect_buffer_fd(hq);
  cr_assert(not(eq(u64, hq, h)));
  cr_assert(eq(u64, hint1(p, n), h), "the first buffer's hint after another was added");
  ps_free(q);
  cr_assert(eq(u64, hint1(p, n), h), "the first buffer's hint after the other was freed");
  ps_free(p);
}

Test(shm_hint, regions_not_in_one_buffer, .timeout = 120) {
  size_t pg = page_size();
  uint8_t *m = malloc(5000);
  cr_assert(m != NULL);
  uint64_t none[2] = {(uint64_t)(uintptr_t)m, 100};
  cr_assert(eq(u64, ps__shm_hint(none, 1), 0), "no ps_alloc buffer at all yet");
  cr_assert(eq(u64, ps__shm_hint(none, 0), 0));
  cr_assert(eq(u64, ps__shm_hint(NULL, 0), 0));

  size_t n = 2 * pg + 100, len = page_round(n);
  uint8_t *p = ps_alloc(n), *q = ps_alloc(pg);
  cr_assert(p && q, "%s", ps_errmsg());
  uint64_t h = hint1(p, n), hq = hint1(q, pg);
  cr_assert(h && hq);
  cr_assert(eq(u64, ps__shm_hint(none, 1), 0), "malloc'd memory");
  cr_assert(eq(u64, hint1(p + len - 10, 11), 0), "runs one byte past the end");
  cr_assert(eq(u64, hint1(p + len - 10, 10), h), "ends at the end");
  cr_assert(eq(u64, hint1(p + len, 1), q == p + len ? hq : 0), "starts at the end");
  cr_assert(eq(u64, hint1(p + 10, UINT64_MAX), 0), "longer than anything");
  cr_assert(eq(u64, hint1(p + 10, UINT64_MAX - (uint64_t)(uintptr_t)p), 0));
  cr_assert(eq(u64, hint1(p - 1, 2), 0), "starts before");
  cr_assert(eq(u64, hint2(p, 10, m, 10), 0), "one region in the buffer, one in malloc'd memory");
  cr_assert(eq(u64, hint2(m, 10, p, 10), 0), "the same, the other way round");
  cr_assert(eq(u64, hint2(p, 10, q, 10), 0), "regions in two buffers");
  cr_assert(eq(u64, hint2(q, 10, p, 10), 0));
  /* one region from inside the lower buffer to inside the higher */
  uint8_t *lo = p < q ? p : q, *hi = p < q ? q : p;
  size_t lolen = lo == p ? len : pg;
  cr_assert(eq(u64, hint1(lo + lolen - 10, (uint64_t)(hi - lo) - lolen + 20), 0), "across two buffers");
  cr_assert(eq(u64, hint1(lo + 5, (uint64_t)(hi - lo) + 5), 0));

  /* freed: no longer a buffer, the other one still is */
  ps_free(p);
  cr_assert(eq(u64, hint1(p, 1), 0));
  cr_assert(eq(u64, hint1(p + len - 10, 10), 0));
  cr_assert(eq(u64, hint1(q, pg), hq));
  ps_free(q);
  cr_assert(eq(u64, hint1(q, 1), 0));
  free(m);
}

/* ---------------------------------------------------------------- the worker (a child) */

#define KID_SEED 7
#define WRITE_SEED 9
#define KID_FILL_SEED 11
#define S_SEED 13
#define RO_SEED 17
#define KID_A ((1u << 20) + 4097) /* bytes asked of ps_alloc for buffer A */
#define KID_B (2 * 4096 + 1)
#define KID_HEAP 65536

/* What the child has, as it tells the parent. Addresses and descriptors are the child's. */
typedef struct kid_info {
  uint64_t pid;
  uint64_t a, a_map, a_hint;          /* ps_alloc(KID_A): filled with pat(KID_SEED, i); mapped bytes */
  uint64_t b, b_hint;                 /* ps_alloc(KID_B), zero */
  uint64_t heap;                      /* malloc(KID_HEAP), filled */
  uint64_t unsealed, unsealed_fd;     /* memfd (sealing allowed, no seal), 4 pages, MAP_SHARED */
  uint64_t nosealing, nosealing_fd;   /* memfd without MFD_ALLOW_SEALING, 4 pages, MAP_SHARED */
  uint64_t priv, priv_fd;             /* sealed memfd, 4 pages, MAP_PRIVATE */
  uint64_t ro, ro_fd;                 /* sealed memfd, 4 pages, MAP_SHARED PROT_READ: pat(RO_SEED, i) */
  uint64_t whole, part, s_fd;         /* sealed memfd, 4 pages of pat(S_SEED, i): whole, and pages 1-2 */
  uint64_t over, over_fd;             /* sealed memfd of 1 page, mapped over 2 pages */
  uint64_t huge, huge_fd;             /* sealed hugetlb memfd of 2 MiB, MAP_SHARED | MAP_NORESERVE,
                                       * never touched; 0 where memfd_create cannot make one */
} kid_info;

/* A command: 'c' check that A[off + j] == pat(seed, base + j) for j < len; 'w' fill that
 * range so; 'f' ps_free(A); 'n' ps_alloc a new A (zeroed); 'g' ps_free(B);
 * 'k' ps_alloc one more buffer of one page, filled with pat(seed, i). EOF: exit. */
typedef struct kid_cmd {
  uint64_t op, off, len, seed, base;
} kid_cmd;

typedef struct kid_ans {
  uint64_t ok, addr, hint; /* ok: 1 (done, the range checked out) or 0 */
} kid_ans;

static struct {
  pid_t pid;
  int cmd; /* parent's write end */
  int ans; /* parent's read end */
} kid = {0, -1, -1};


static int write_full(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n) {
    ssize_t k = write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k, n -= (size_t)k;
  }
  return 0;
}

/* Read n bytes, waiting at most ms in all (ms < 0: no limit). */
static int read_full(int fd, void *buf, size_t n, int ms) {
  char *p = buf;
  int64_t end = now_ms() + ms;
  while (n) {
    if (ms >= 0) {
      int64_t left = end - now_ms();
      struct pollfd pf = {.fd = fd, .events = POLLIN};
      int rc = left > 0 ? poll(&pf, 1, (int)left) : 0;
      if (rc < 0 && errno == EINTR) continue;
      if (rc <= 0) return -1;
    }
    ssize_t k = read(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k, n -= (size_t)k;
  }
  return 0;
}


static void kid_stop(void) {
  if (kid.cmd >= 0) close(kid.cmd); /* the child exits on EOF */
  if (kid.ans >= 0) close(kid.ans);
  if (kid.pid > 0) {
    if (!reap(kid.pid, 5000, NULL)) {
      kill(kid.pid, SIGKILL);
      reap(kid.pid, 10000, NULL);
    }
  }
  kid.pid = 0, kid.cmd = kid.ans = -1;
}

/* In the child: a memfd of size bytes holding pat(seed, i), with these seals. */
static int kid_memfd(size_t size, unsigned flags, int seals, unsigned seed) {
  int fd = memfd_create("pshard-test", MFD_CLOEXEC | flags);
  if (fd < 0 || ftruncate(fd, (off_t)size)) _exit(10);
  uint8_t chunk[4096];
  for (size_t at = 0; at < size; at += sizeof chunk) {
    size_t k = size - at < sizeof chunk ? size - at : sizeof chunk;
    for (size_t i = 0; i < k; i++) chunk[i] = pat(seed, at + i);
    if (pwrite(fd, chunk, k, (off_t)at) != (ssize_t)k) _exit(11);
  }
  if (seals && fcntl(fd, F_ADD_SEALS, seals)) _exit(12);
  return fd;
}

static uint64_t kid_map(size_t len, int prot, int flags, int fd, size_t off) {
  void *p = mmap(NULL, len, prot, flags, fd, (off_t)off);
  if (p == MAP_FAILED) _exit(13);
  return (uint64_t)(uintptr_t)p;
}

static uint8_t *kid_alloc_a(kid_info *in) {
  uint8_t *a = ps_alloc(KID_A);
  if (!a) _exit(14);
  in->a = (uint64_t)(uintptr_t)a;
  in->a_map = page_round(KID_A);
  in->a_hint = hint1(a, KID_A);
  if (!in->a_hint) _exit(15);
  return a;
}

static _Noreturn void kid_main(pid_t parent, int cmd, int ans) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(20);
  alarm(60);
  size_t pg = page_size();
  kid_info in;
  memset(&in, 0, sizeof in);
  in.pid = (uint64_t)getpid();
  uint8_t *a = kid_alloc_a(&in);
  for (size_t i = 0; i < KID_A; i++) a[i] = pat(KID_SEED, i);
  uint8_t *b = ps_alloc(KID_B);
  if (!b) _exit(16);
  in.b = (uint64_t)(uintptr_t)b;
  in.b_hint = hint1(b, KID_B);
  uint8_t *heap = malloc(KID_HEAP);
  if (!heap) _exit(17);
  for (size_t i = 0; i < KID_HEAP; i++) heap[i] = pat(KID_SEED, i);
  in.heap = (uint64_t)(uintptr_t)heap;
  const int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
  int fd = kid_memfd(4 * pg, MFD_ALLOW_SEALING, 0, KID_SEED);
  in.unsealed_fd = (uint64_t)fd, in.unsealed = kid_map(4 * pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  fd = kid_memfd(4 * pg, 0, 0, KID_SEED);
  in.nosealing_fd = (uint64_t)fd, in.nosealing = kid_map(4 * pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  fd = kid_memfd(4 * pg, MFD_ALLOW_SEALING, seals, KID_SEED);
  in.priv_fd = (uint64_t)fd, in.priv = kid_map(4 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  fd = kid_memfd(4 * pg, MFD_ALLOW_SEALING, seals, RO_SEED);
  in.ro_fd = (uint64_t)fd, in.ro = kid_map(4 * pg, PROT_READ, MAP_SHARED, fd, 0);
  fd = kid_memfd(4 * pg, MFD_ALLOW_SEALING, seals, S_SEED);
  in.s_fd = (uint64_t)fd, in.whole = kid_map(4 * pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  in.part = kid_map(2 * pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, pg);
  fd = kid_memfd(pg, MFD_ALLOW_SEALING, seals, S_SEED);
  in.over_fd = (uint64_t)fd, in.over = kid_map(2 * pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  /* A hugetlb file: its page faults can end in SIGBUS when the pool is dry (this
   * machine has no huge pages), so a server must not map it. */
  fd = memfd_create("pshard-test-huge", MFD_CLOEXEC | MFD_HUGETLB | MFD_ALLOW_SEALING);
  if (fd >= 0 && ftruncate(fd, 2 << 20) == 0 && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0) {
    void *h = mmap(NULL, 2 << 20, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (h != MAP_FAILED) in.huge_fd = (uint64_t)fd, in.huge = (uint64_t)(uintptr_t)h;
  }
  if (write_full(ans, &in, sizeof in)) _exit(21);

  for (;;) {
    kid_cmd c;
    if (read_full(cmd, &c, sizeof c, -1)) _exit(0);
    kid_ans r = {1, 0, 0};
    switch (c.op) {
    case 'c':
      if (!a || c.off > KID_A || c.len > KID_A - c.off) r.ok = 0;
      for (size_t j = 0; r.ok && j < c.len; j++) r.ok = a[c.off + j] == pat((unsigned)c.seed, c.base + j);
      break;
    case 'w':
      if (!a || c.off > KID_A || c.len > KID_A - c.off) r.ok = 0;
      for (size_t j = 0; r.ok && j < c.len; j++) a[c.off + j] = pat((unsigned)c.seed, c.base + j);
      break;
    case 'f':
      ps_free(a);
      a = NULL;
      break;
    case 'n':
      a = kid_alloc_a(&in);
      r.addr = in.a, r.hint = in.a_hint;
      break;
    case 'g':
      ps_free(b);
      break;
    case 'k': { /* a sealed memfd of its own: ps_alloc shares at most PS_SHM_MAX */
      int fd = kid_memfd(pg, MFD_ALLOW_SEALING, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, (unsigned)c.seed);
      r.addr = kid_map(pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), r.hint = (uint64_t)fd + 1;
      break;
    }
    default:
      _exit(22);
    }
    if (write_full(ans, &r, sizeof r)) _exit(23);
  }
}

static void kid_start(kid_info *in) {
  int cmd[2], ans[2];
  cr_assert(eq(int, pipe(cmd), 0));
  cr_assert(eq(int, pipe(ans), 0));
  signal(SIGPIPE, SIG_IGN); /* a child gone shows as a failed write, not a dead test */
  pid_t parent = getpid();
  fflush(NULL);
  pid_t pid = fork();
  cr_assert(ge(int, pid, 0), "fork: %s", strerror(errno));
  if (pid == 0) {
    close(cmd[1]);
    close(ans[0]);
    kid_main(parent, cmd[0], ans[1]);
  }
  close(cmd[0]);
  close(ans[1]);
  kid.pid = pid, kid.cmd = cmd[1], kid.ans = ans[0];
  cr_assert(eq(int, read_full(kid.ans, in, sizeof *in, 20000), 0), "the child did not start");
  cr_assert(eq(u64, in->pid, (uint64_t)pid));
}

static kid_ans kid_do(int op, uint64_t off, uint64_t len, unsigned seed, uint64_t base) {
  kid_cmd c = {(uint64_t)op, off, len, seed, base};
  kid_ans r;
  cr_assert(eq(int, write_full(kid.cmd, &c, sizeof c), 0), "the child is gone");
  cr_assert(eq(int, read_full(kid.ans, &r, sizeof r, 20000), 0), "the child did not answer '%c'", op);
  return r;
}

/* The child's A holds pat(seed, base + j) at off + j, for j < len. */
static int kid_has(uint64_t off, uint64_t len, unsigned seed, uint64_t base) {
  return (int)kid_do('c', off, len, seed, base).ok;
}

/* ---------------------------------------------------------------- the server's side */

/* Has this kernel PROCMAP_QUERY (Linux 6.11)? */
static int have_query(void) {
  struct utsname u;
  unsigned major = 0, minor = 0;
  cr_assert(eq(int, uname(&u), 0));
  return sscanf(u.release, "%u.%u", &major, &minor) == 2 && (major > 6 || (major == 6 && minor >= 11));
}

static void expect_counts(const ps__shm_cache *c, uint64_t translated, uint64_t mapped, uint64_t held) {
  uint64_t t = 99, m = 99, h = 99;
  ps__shm_counts(c, &t, &m, &h);
  cr_assert(eq(u64, t, translated), "translated %llu, expected %llu", (unsigned long long)t,
            (unsigned long long)translated);
  cr_assert(eq(u64, m, mapped), "mapped %llu, expected %llu", (unsigned long long)m, (unsigned long long)mapped);
  cr_assert(eq(u64, h, held), "held %llu, expected %llu", (unsigned long long)h, (unsigned long long)held);
}

/* Translate the regions d; on 0, ptrs[k] is region k here (lengths checked). */
static int tr(ps__shm_cache *c, const void *owner, int pid, uint64_t hint, int write, const descs *d, uint8_t **ptrs) {
  uint8_t *out = malloc(16 * (d->n ? d->n : 1));
  cr_assert(out != NULL);
  memset(out, 0, 16 * (d->n ? d->n : 1));
  int rc = ps__shm_translate(c, owner, pid, hint, write, d->d, d->n, out);
  if (rc == 0)
    for (size_t k = 0; k < d->n; k++) {
      cr_assert(eq(u64, ps__get_u64(out + 16 * k + 8), ps__get_u64(d->d + 16 * k + 8)), "length of region %zu", k);
      if (ptrs) ptrs[k] = (uint8_t *)(uintptr_t)ps__get_u64(out + 16 * k);
    }
  free(out);
  return rc;
}

/* One region: its address here, or NULL when it is not translated. */
static uint8_t *tr1(ps__shm_cache *c, const void *owner, int pid, uint64_t hint, int write, uint64_t addr,
                    uint64_t len) {
  descs d = {0};
  descs_add(&d, addr, len);
  uint8_t *p = NULL;
  int rc = tr(c, owner, pid, hint, write, &d, &p);
  descs_free(&d);
  cr_assert(rc == 0 || rc == 1, "ps__shm_translate returned %d", rc);
  return rc ? NULL : p;
}

/* Before Linux 6.11 nothing is translated: check that this is so, and skip the rest. */
static void need_query(const kid_info *in) {
  if (have_query()) return;
  ps__shm_cache *c = ps__shm_cache_new();
  cr_assert(c != NULL);
  int owner = 0;
  for (int w = 0; w < 2; w++) cr_assert(eq(ptr, tr1(c, &owner, (int)in->pid, in->a_hint, w, in->a, 100), NULL));
  expect_counts(c, 0, 0, 0);
  ps__shm_cache_free(c);
  struct utsname u;
  uname(&u);
  cr_skip_test("kernel %s has no PROCMAP_QUERY: the fallback checked, nothing more to test", u.release);
}

/* The usual start of a test: the child, a kernel that can translate, an empty cache. */
static ps__shm_cache *kid_cache(kid_info *in) {
  kid_start(in);
  need_query(in);
  ps__shm_cache *c = ps__shm_cache_new();
  cr_assert(c != NULL);
  return c;
}

/* The child's A cut into regions of misaligned sizes covering [from, from + n), listed
 * in reverse order; at[k] is region k's offset in A. */
static size_t cut(descs *d, size_t *at, size_t max, uint64_t a, size_t from, size_t n) {
  static const size_t sz[] = {4095, 1, 13, 70000, 3, 65537, 4097, 2};
  size_t off[64], len[64], k = 0;
  for (size_t pos = from; pos < from + n; k++) {
    cr_assert(lt(sz, k, (size_t)64));
    off[k] = pos;
    len[k] = sz[k % 8] < from + n - pos ? sz[k % 8] : from + n - pos;
    pos += len[k];
  }
  cr_assert(le(sz, k, max));
  for (size_t i = 0; i < k; i++) {
    at[i] = off[k - 1 - i];
    descs_add(d, a + at[i], len[k - 1 - i]);
  }
  return k;
}

Test(shm_translate, reads_the_workers_buffer, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  ps__shm_cache *c = kid_cache(&in);
  int pid = (int)in.pid, owner = 0;
  expect_counts(c, 0, 0, 0);

  descs d = {0};
  size_t at[64];
  size_t n = cut(&d, at, 64, in.a, 0, KID_A);
  uint8_t *p[64];
  OK(tr(c, &owner, pid, in.a_hint, 0, &d, p));
  expect_counts(c, 1, 1, 1);
  /* every region is in the one mapping of the file, at its place in the buffer */
  uint8_t *base = p[0] - at[0];
  for (size_t k = 0; k < n; k++) {
    cr_assert(eq(ptr, p[k], base + at[k]), "region %zu", k);
    uint64_t len = ps__get_u64(d.d + 16 * k + 8);
    for (size_t j = 0; j < len; j++)
      cr_assert(eq(u8, p[k][j], pat(KID_SEED, at[k] + j)), "byte %zu of region %zu (buffer byte %zu)", j, k, at[k] + j);
  }
  cr_assert(eq(int, count_maps(SHM_NAME), 1), "the server maps the worker's file");
  descs_free(&d);

  /* again, other regions: served from the same mapping */
  uint8_t *q = tr1(c, &owner, pid, in.a_hint, 0, in.a + 12345, 1000);
  cr_assert(eq(ptr, q, base + 12345));
  expect_counts(c, 2, 1, 1);
  cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, 0, in.a, in.a_map), base), "the whole mapping");
  cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, 0, in.a + in.a_map - 10, 10), base + in.a_map - 10));
  expect_counts(c, 4, 1, 1);
  for (size_t j = KID_A; j < in.a_map; j++) cr_assert(eq(u8, base[j], 0), "byte %zu past the asked size", j);

  /* what the worker writes afterwards shows through the same pointers: shared, not a copy */
  cr_assert(kid_do('w', 12345 + 17, 500, KID_FILL_SEED, 0).ok);
  for (size_t j = 0; j < 1000; j++) {
    uint8_t want = j >= 17 && j < 517 ? pat(KID_FILL_SEED, j - 17) : pat(KID_SEED, 12345 + j);
    cr_assert(eq(u8, q[j], want), "byte %zu after the worker's write", j);
  }
  /* reading changed nothing in the worker */
  cr_assert(kid_has(0, 12345 + 17, KID_SEED, 0));
  cr_assert(kid_has(12345 + 17 + 500, KID_A - (12345 + 17 + 500), KID_SEED, 12345 + 17 + 500));
  ps__shm_cache_free(c);
  cr_assert(eq(int, count_maps(SHM_NAME), 0), "the cache unmapped the file");
}

Test(shm_translate, writes_into_the_workers_buffer, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  ps__shm_cache *c = kid_cache(&in);
  int pid = (int)in.pid, owner = 0;
  const size_t woff = 4096 + 13, wlen = 300001;
  descs d = {0};
  size_t at[64];
  size_t n = cut(&d, at, 64, in.a, woff, wlen);
  uint8_t *p[64];
  OK(tr(c, &owner, pid, in.a_hint, 1, &d, p));
  expect_counts(c, 1, 1, 1);
  cr_assert(kid_has(0, KID_A, KID_SEED, 0), "translating a write changed the buffer");
  for (size_t k = 0; k < n; k++) {
    uint64_t len = ps__get_u64(d.d + 16 * k + 8);
    for (size_t j = 0; j < len; j++) p[k][j] = pat(WRITE_SEED, at[k] - woff + j);
  }
  /* the worker sees the bytes written, and nothing else changed */
  cr_assert(kid_has(woff, wlen, WRITE_SEED, 0), "the worker does not see the write");
  cr_assert(kid_has(0, woff, KID_SEED, 0), "bytes before the write changed");
  cr_assert(kid_has(woff + wlen, KID_A - woff - wlen, KID_SEED, woff + wlen), "bytes after the write changed");
  /* a read of the same regions: the same addresses, no new mapping */
  uint8_t *r[64];
  OK(tr(c, &owner, pid, in.a_hint, 0, &d, r));
  for (size_t k = 0; k < n; k++) cr_assert(eq(ptr, r[k], p[k]), "region %zu", k);
  expect_counts(c, 2, 1, 1);
  descs_free(&d);
  ps__shm_cache_free(c);
}

/* A file mapped at an offset, a mapping longer than its file, a read-only mapping. */
Test(shm_translate, where_the_worker_maps_its_files, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  kid_start(&in);
  need_query(&in);
  int pid = (int)in.pid, owner = 0;
  size_t pg = page_size();
  ps__shm_cache *c = ps__shm_cache_new();
  cr_assert(c != NULL);

  /* pages 1-2 of the file, mapped at `part`: their place is the file's, not the mapping's */
  uint64_t sh = in.s_fd + 1;
  uint8_t *part = tr1(c, &owner, pid, sh, 0, in.part + 10, 2 * pg - 10);
  cr_assert(not(eq(ptr, part, NULL)));
  for (size_t j = 0; j < 2 * pg - 10; j++) cr_assert(eq(u8, part[j], pat(S_SEED, pg + 10 + j)), "byte %zu", j);
  expect_counts(c, 1, 1, 1);
  uint8_t *whole = tr1(c, &owner, pid, sh, 1, in.whole, 4 * pg);
  cr_assert(not(eq(ptr, whole, NULL)));
  cr_assert(eq(ptr, part, whole + pg + 10), "the two mappings of one file are one mapping here");
  expect_counts(c, 2, 1, 1);
  cr_assert(eq(ptr, tr1(c, &owner, pid, sh, 0, in.part + 2 * pg - 1, 2), NULL), "runs past the end of `part`");

  /* a file of one page mapped over two: the page past the file is refused */
  uint64_t oh = in.over_fd + 1;
  cr_assert(not(eq(ptr, tr1(c, &owner, pid, oh, 0, in.over + 10, pg - 10), NULL)));
  expect_counts(c, 3, 2, 2);
  for (int w = 0; w < 2; w++) {
    cr_assert(eq(ptr, tr1(c, &owner, pid, oh, w, in.over + pg, 1), NULL), "past the file");
    cr_assert(eq(ptr, tr1(c, &owner, pid, oh, w, in.over + pg - 5, 10), NULL), "into the page past the file");
  }
  expect_counts(c, 3, 2, 2);

  /* mapped read-only by the worker: read, never written */
  uint64_t rh = in.ro_fd + 1;
  cr_assert(eq(ptr, tr1(c, &owner, pid, rh, 1, in.ro, 100), NULL));
  expect_counts(c, 3, 2, 2);
  uint8_t *ro = tr1(c, &owner, pid, rh, 0, in.ro + 1, 4 * pg - 1);
  cr_assert(not(eq(ptr, ro, NULL)));
  for (size_t j = 0; j < 4 * pg - 1; j++) cr_assert(eq(u8, ro[j], pat(RO_SEED, 1 + j)), "byte %zu", j);
  expect_counts(c, 4, 3, 3);
  cr_assert(eq(ptr, tr1(c, &owner, pid, rh, 1, in.ro, 100), NULL), "a write, once the file is mapped");
  expect_counts(c, 4, 3, 3);
  ps__shm_cache_free(c);
}

/* Every case returns 1 and maps nothing; then the good request works on the same cache. */
Test(shm_translate, refuses_what_it_cannot_map, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  kid_start(&in);
  int pid = (int)in.pid, owner = 0;
  size_t pg = page_size();
  ps__shm_cache *c = ps__shm_cache_new();
  cr_assert(c != NULL);
  int fds = count_fds();
  for (int w = 0; w < 2; w++) {
    const uint64_t bad_hints[] = {0,                           /* none */
                                  1,                           /* its stdin */
                                  in.b_hint,                   /* its other buffer */
                                  in.s_fd + 1,                 /* a sealed file it maps elsewhere */
                                  901,                         /* not open */
                                  (uint64_t)INT32_MAX + 1,     /* the largest descriptor */
                                  (uint64_t)INT32_MAX + 2,     /* larger */
                                  UINT64_MAX};
    for (size_t k = 0; k < sizeof bad_hints / sizeof bad_hints[0]; k++)
      cr_assert(eq(ptr, tr1(c, &owner, pid, bad_hints[k], w, in.a, 100), NULL), "hint %llu, write %d",
                (unsigned long long)bad_hints[k], w);
    /* the right hint, regions that are not all in its file */
    cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, w, in.a + in.a_map - 10, 11), NULL), "past the end");
    cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, w, in.a + in.a_map, 1), NULL), "just after the end");
    cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, w, in.a - 1, 2), NULL), "just before the start");
    cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, w, in.a + 10, UINT64_MAX), NULL), "longer than anything");
    cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, w, in.heap, 100), NULL), "malloc'd memory");
    cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, w, 0, 1), NULL), "address 0");
    descs d = {0};
    descs_add(&d, in.heap, 100);
    descs_add(&d, in.a, 100);
    cr_assert(eq(int, tr(c, &owner, pid, in.a_hint, w, &d, NULL), 1), "malloc'd memory, then the buffer");
    descs_free(&d);
    /* files it maps shared but has not sealed, or has sealed but maps privately */
    cr_assert(eq(ptr, tr1(c, &owner, pid, in.unsealed_fd + 1, w, in.unsealed, 100), NULL), "not sealed");
    cr_assert(eq(ptr, tr1(c, &owner, pid, in.nosealing_fd + 1, w, in.nosealing, 100), NULL), "cannot be sealed");
    cr_assert(eq(ptr, tr1(c, &owner, pid, in.priv_fd + 1, w, in.priv, 100), NULL), "mapped privately");
    cr_assert(eq(ptr, tr1(c, &owner, pid, in.priv_fd + 1, w, in.priv + pg, pg), NULL), "mapped privately");
    if (in.huge) cr_assert(eq(ptr, tr1(c, &owner, pid, in.huge_fd + 1, w, in.huge, 100), NULL), "hugetlb");
    /* no process, no regions, no cache */
    cr_assert(eq(ptr, tr1(c, &owner, 0, in.a_hint, w, in.a, 100), NULL), "pid 0");
    cr_assert(eq(ptr, tr1(c, &owner, -1, in.a_hint, w, in.a, 100), NULL), "pid -1");
    cr_assert(eq(ptr, tr1(c, &owner, INT32_MIN, in.a_hint, w, in.a, 100), NULL), "pid INT32_MIN");
    descs none = {0};
    cr_assert(eq(int, tr(c, &owner, pid, in.a_hint, w, &none, NULL), 1), "no regions");
    cr_assert(eq(ptr, tr1(NULL, &owner, pid, in.a_hint, w, in.a, 100), NULL), "no cache");
    expect_counts(c, 0, 0, 0);
  }
  cr_assert(eq(int, count_maps(SHM_NAME), 0), "a refused request left a mapping");
  cr_assert(kid_has(0, KID_A, KID_SEED, 0), "a refused request changed the buffer");
  /* Only the descriptors of the worker's maps file and of its pidfd may stay open. */
  cr_assert(le(int, count_fds(), fds + 2), "%d descriptors left open", count_fds() - fds);

  /* The same cache, the right hint: translated (from Linux 6.11 on). */
  uint8_t *p = tr1(c, &owner, pid, in.a_hint, 1, in.a + 5, 100);
  if (!have_query()) {
    cr_assert(eq(ptr, p, NULL));
    expect_counts(c, 0, 0, 0);
  } else {
    cr_assert(not(eq(ptr, p, NULL)));
    cr_assert(eq(u8, p[0], pat(KID_SEED, 5)));
    expect_counts(c, 1, 1, 1);
    /* the owner belongs to this process: the same owner with another pid is refused */
    cr_assert(eq(ptr, tr1(c, &owner, (int)getpid(), in.a_hint, 0, in.a + 5, 100), NULL), "another pid");
    expect_counts(c, 1, 1, 1);
  }
  ps__shm_cache_free(c);
}

/* ---------------------------------------------------------------- sweep, forget, free */

Test(shm_sweep, keeps_what_the_worker_still_maps, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  ps__shm_cache *c = kid_cache(&in);
  int pid = (int)in.pid, owner = 0;
  uint8_t *p = tr1(c, &owner, pid, in.a_hint, 0, in.a + 100, 5000);
  cr_assert(not(eq(ptr, p, NULL)));
  expect_counts(c, 1, 1, 1);
  for (int k = 0; k < 3; k++) {
    ps__shm_sweep(c);
    expect_counts(c, 1, 1, 1);
  }
  cr_assert(eq(int, count_maps(SHM_NAME), 1));
  for (size_t j = 0; j < 5000; j++) cr_assert(eq(u8, p[j], pat(KID_SEED, 100 + j)), "byte %zu after the sweeps", j);
  cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, 0, in.a + 100, 5000), p), "mapped again");
  expect_counts(c, 2, 1, 1);
  ps__shm_cache_free(c);
}

Test(shm_sweep, drops_what_the_worker_freed, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  ps__shm_cache *c = kid_cache(&in);
  int pid = (int)in.pid, owner = 0;
  cr_assert(not(eq(ptr, tr1(c, &owner, pid, in.a_hint, 0, in.a, 100), NULL)));
  cr_assert(not(eq(ptr, tr1(c, &owner, pid, in.b_hint, 1, in.b, KID_B), NULL)));
  expect_counts(c, 2, 2, 2);
  ps__shm_sweep(c);
  expect_counts(c, 2, 2, 2);

  /* the worker frees A: the sweep drops its mapping, and only it */
  cr_assert(kid_do('f', 0, 0, 0, 0).ok);
  ps__shm_sweep(c);
  expect_counts(c, 2, 2, 1);
  cr_assert(eq(int, count_maps(SHM_NAME), 1));
  cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, 0, in.a, 100), NULL), "A is gone");
  expect_counts(c, 2, 2, 1);

  /* a new buffer (maybe at A's address): mapped anew, zeroed, not A's bytes */
  kid_ans r = kid_do('n', 0, 0, 0, 0);
  cr_assert(r.ok && r.addr && r.hint);
  uint8_t *p = tr1(c, &owner, pid, r.hint, 0, r.addr, KID_A);
  cr_assert(not(eq(ptr, p, NULL)));
  expect_counts(c, 3, 3, 2);
  for (size_t j = 0; j < KID_A; j++) cr_assert(eq(u8, p[j], 0), "byte %zu of the new buffer", j);

  /* freed and allocated again before a sweep: the new file is mapped, the old one swept */
  cr_assert(kid_do('f', 0, 0, 0, 0).ok);
  kid_ans r2 = kid_do('n', 0, 0, 0, 0);
  cr_assert(r2.ok && r2.addr && r2.hint);
  cr_assert(kid_do('w', 0, 64, KID_FILL_SEED, 0).ok);
  p = tr1(c, &owner, pid, r2.hint, 0, r2.addr, 64);
  cr_assert(not(eq(ptr, p, NULL)));
  for (size_t j = 0; j < 64; j++) cr_assert(eq(u8, p[j], pat(KID_FILL_SEED, j)), "byte %zu of the newest buffer", j);
  expect_counts(c, 4, 4, 3);
  ps__shm_sweep(c);
  expect_counts(c, 4, 4, 2);
  cr_assert(eq(int, count_maps(SHM_NAME), 2));
  for (size_t j = 0; j < 64; j++) cr_assert(eq(u8, p[j], pat(KID_FILL_SEED, j)), "byte %zu after the sweep", j);

  /* the worker frees B: swept too */
  cr_assert(kid_do('g', 0, 0, 0, 0).ok);
  ps__shm_sweep(c);
  expect_counts(c, 4, 4, 1);
  ps__shm_cache_free(c);
  cr_assert(eq(int, count_maps(SHM_NAME), 0));
}

/* A worker that has exited: everything of it is swept. */
Test(shm_sweep, drops_an_exited_worker, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  ps__shm_cache *c = kid_cache(&in);
  int pid = (int)in.pid, owner = 0;
  cr_assert(not(eq(ptr, tr1(c, &owner, pid, in.a_hint, 0, in.a, 100), NULL)));
  expect_counts(c, 1, 1, 1);
  close(kid.cmd);
  kid.cmd = -1;
  int st = 0;
  cr_assert(reap(kid.pid, 20000, &st), "the child did not exit");
  kid.pid = 0;
  int clean = WIFEXITED(st) && WEXITSTATUS(st) == 0;
  cr_assert(clean, "the child failed (status %#x)", st);
  ps__shm_sweep(c);
  expect_counts(c, 1, 1, 0);
  cr_assert(eq(int, count_maps(SHM_NAME), 0));
  cr_assert(eq(ptr, tr1(c, &owner, pid, in.a_hint, 0, in.a, 100), NULL), "a process that is gone");
  ps__shm_cache_free(c);
}

Test(shm_forget, drops_one_owner_only, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  kid_start(&in);
  need_query(&in);
  int pid = (int)in.pid, o1 = 1, o2 = 2, o3 = 3;
  int fds = count_fds();
  ps__shm_cache *c = ps__shm_cache_new();
  cr_assert(c != NULL);
  uint8_t *p1 = tr1(c, &o1, pid, in.a_hint, 0, in.a, 1000);
  uint8_t *p2 = tr1(c, &o2, pid, in.a_hint, 0, in.a, 1000);
  cr_assert(p1 && p2);
  cr_assert(not(eq(ptr, p1, p2)), "each connection maps the file itself");
  cr_assert(not(eq(ptr, tr1(c, &o2, pid, in.b_hint, 0, in.b, 10), NULL)));
  expect_counts(c, 3, 3, 3);
  cr_assert(eq(int, count_maps(SHM_NAME), 3));

  ps__shm_forget(c, &o3); /* owns nothing */
  expect_counts(c, 3, 3, 3);
  ps__shm_forget(c, &o1);
  expect_counts(c, 3, 3, 2);
  cr_assert(eq(int, count_maps(SHM_NAME), 2));
  for (size_t j = 0; j < 1000; j++) cr_assert(eq(u8, p2[j], pat(KID_SEED, j)), "o2's byte %zu after forgetting o1", j);
  cr_assert(eq(ptr, tr1(c, &o2, pid, in.a_hint, 0, in.a, 1000), p2), "o2's mapping is kept");
  expect_counts(c, 4, 3, 2);
  /* o1 again: mapped anew */
  cr_assert(not(eq(ptr, tr1(c, &o1, pid, in.a_hint, 0, in.a, 1000), NULL)));
  expect_counts(c, 5, 4, 3);

  ps__shm_forget(c, &o2);
  expect_counts(c, 5, 4, 1);
  ps__shm_forget(c, &o2);
  expect_counts(c, 5, 4, 1);
  ps__shm_forget(c, &o1);
  expect_counts(c, 5, 4, 0);
  cr_assert(eq(int, count_maps(SHM_NAME), 0));
  cr_assert(eq(int, count_fds(), fds), "forgetting left descriptors open");
  ps__shm_cache_free(c);
}

Test(shm_forget, cache_free_with_mappings, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  kid_start(&in);
  need_query(&in);
  int pid = (int)in.pid, o1 = 1, o2 = 2;
  int fds = count_fds();
  ps__shm_cache *c = ps__shm_cache_new();
  cr_assert(c != NULL);
  cr_assert(not(eq(ptr, tr1(c, &o1, pid, in.a_hint, 1, in.a, 1000), NULL)));
  cr_assert(not(eq(ptr, tr1(c, &o1, pid, in.b_hint, 1, in.b, 1000), NULL)));
  cr_assert(not(eq(ptr, tr1(c, &o2, pid, in.a_hint, 0, in.a, 1000), NULL)));
  cr_assert(not(eq(ptr, tr1(c, &o2, pid, in.s_fd + 1, 0, in.part, 1000), NULL)));
  expect_counts(c, 4, 4, 4);
  cr_assert(eq(int, count_maps(SHM_NAME), 3));
  cr_assert(gt(int, count_fds(), fds));
  ps__shm_cache_free(c); /* LeakSanitizer checks the rest */
  cr_assert(eq(int, count_maps(SHM_NAME), 0), "mappings left after ps__shm_cache_free");
  cr_assert(eq(int, count_maps("/memfd:pshard-test"), 0), "mappings left after ps__shm_cache_free");
  cr_assert(eq(int, count_fds(), fds), "descriptors left after ps__shm_cache_free");
}

Test(shm_forget, null_cache_is_safe, .timeout = 120) {
  int owner = 0;
  ps__shm_forget(NULL, &owner);
  ps__shm_sweep(NULL);
  expect_counts(NULL, 0, 0, 0);
  ps__shm_cache_free(NULL);
  uint8_t d[16], out[16];
  ps__put_u64(d, 0x10000);
  ps__put_u64(d + 8, 16);
  cr_assert(eq(int, ps__shm_translate(NULL, &owner, (int)getpid(), 1, 0, d, 1, out), 1));
  /* an empty cache: the same */
  ps__shm_cache *c = ps__shm_cache_new();
  cr_assert(c != NULL);
  expect_counts(c, 0, 0, 0);
  ps__shm_sweep(c);
  ps__shm_forget(c, &owner);
  expect_counts(c, 0, 0, 0);
  ps__shm_cache_free(c);
}

/* ---------------------------------------------------------------- many files */

#define MANY (PS_SHM_MAX + 6)
#define MANY_SEED 200

/* A connection keeps at most PS_SHM_MAX files mapped: the least recently used goes.
 * Another connection's mappings do not count against it. */
Test(shm_translate, at_most_a_cap_of_files_per_connection, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  kid_start(&in);
  need_query(&in);
  int pid = (int)in.pid, o1 = 1, o2 = 2;
  size_t pg = page_size();
  ps__shm_cache *c = ps__shm_cache_new();
  cr_assert(c != NULL);
  cr_assert(not(eq(ptr, tr1(c, &o2, pid, in.a_hint, 0, in.a, 100), NULL)));
  expect_counts(c, 1, 1, 1);
  for (unsigned k = 0; k < MANY; k++) {
    kid_ans r = kid_do('k', 0, 0, MANY_SEED + k, 0);
    cr_assert(r.ok && r.addr && r.hint);
    uint8_t *p = tr1(c, &o1, pid, r.hint, 0, r.addr, pg);
    cr_assert(not(eq(ptr, p, NULL)), "buffer %u", k);
    for (size_t j = 0; j < pg; j++) cr_assert(eq(u8, p[j], pat(MANY_SEED + k, j)), "byte %zu of buffer %u", j, k);
    expect_counts(c, 2 + k, 2 + k, 1 + (k + 1 < PS_SHM_MAX ? k + 1 : PS_SHM_MAX));
  }
  cr_assert(eq(int, count_maps(SHM_NAME), 1), "ps_alloc's buffer");
  cr_assert(eq(int, count_maps(KID_FILE), PS_SHM_MAX), "the child's own files");
  /* o2's mapping survived: the same address, no new mapping */
  cr_assert(not(eq(ptr, tr1(c, &o2, pid, in.a_hint, 0, in.a, 100), NULL)));
  expect_counts(c, 2 + MANY, 1 + MANY, PS_SHM_MAX + 1);
  ps__shm_forget(c, &o1);
  expect_counts(c, 2 + MANY, 1 + MANY, 1);
  ps__shm_cache_free(c);
  cr_assert(eq(int, count_maps(SHM_NAME), 0));
  cr_assert(eq(int, count_maps(KID_FILE), 0));
}

/* One request whose regions lie in the PS_SHM_MAX files a connection already has mapped
 * and then in one more (the hint's). The hint names one file, so such a request is refused
 * (1) before anything is mapped or evicted: were the 65th mapped, evicting the least
 * recently used file could unmap the address already given out for region 0. A
 * worker's own ps__shm_hint never names such a request; the server must not trust the
 * frame. Also refused: two regions in two files both already mapped. */
Test(shm_translate, a_request_across_files_is_refused, .timeout = 120, .fini = kid_stop) {
  kid_info in;
  kid_start(&in);
  need_query(&in);
  int pid = (int)in.pid, owner = 0;
  size_t pg = page_size();
  ps__shm_cache *c = ps__shm_cache_new();
  cr_assert(c != NULL);
  uint64_t addr[PS_SHM_MAX + 1], hint[PS_SHM_MAX + 1];
  for (unsigned k = 0; k <= PS_SHM_MAX; k++) {
    kid_ans r = kid_do('k', 0, 0, MANY_SEED + k, 0);
    cr_assert(r.ok && r.addr && r.hint);
    addr[k] = r.addr, hint[k] = r.hint;
    if (k < PS_SHM_MAX) cr_assert(not(eq(ptr, tr1(c, &owner, pid, hint[k], 0, addr[k], pg), NULL)), "buffer %u", k);
  }
  expect_counts(c, PS_SHM_MAX, PS_SHM_MAX, PS_SHM_MAX);
  descs d = {0};
  for (unsigned k = 0; k <= PS_SHM_MAX; k++) descs_add(&d, addr[k] + 8, 64);
  uint8_t *p[PS_SHM_MAX + 1];
  cr_assert(eq(int, tr(c, &owner, pid, hint[PS_SHM_MAX], 0, &d, p), 1));
  expect_counts(c, PS_SHM_MAX, PS_SHM_MAX, PS_SHM_MAX); /* nothing mapped, nothing evicted */
  descs_free(&d);
  descs two = {0};
  descs_add(&two, addr[0] + 8, 64);
  descs_add(&two, addr[1] + 8, 64);
  cr_assert(eq(int, tr(c, &owner, pid, hint[0], 0, &two, p), 1));
  cr_assert(eq(int, tr(c, &owner, pid, hint[1], 0, &two, p), 1));
  expect_counts(c, PS_SHM_MAX, PS_SHM_MAX, PS_SHM_MAX);
  descs_free(&two);
  ps__shm_cache_free(c);
}
