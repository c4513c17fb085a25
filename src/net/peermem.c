/*
 * peermem.c - moving values straight between two processes of one host.
 *
 * A worker and a server on the same host talk over an AF_UNIX socket. For a large dense
 * push or pull the worker sends, instead of the values, the addresses of its own buffers
 * (a "peer-memory" frame, PS_XPORT_PEER_MEM); the server copies between those and its
 * own memory with process_vm_readv / process_vm_writev, one copy per byte instead of the
 * socket's two (into the kernel, out of it), and none of it on the worker's CPU.
 *
 * The server only ever addresses the process the kernel reports at the other end of the
 * socket (SO_PEERCRED, taken when the connection starts), so a frame can name addresses
 * only in its sender's own memory; a bad address fails the request (EFAULT) and changes
 * nothing. The kernel allows the access when the server could ptrace the worker: same
 * user (or a privileged server), the worker dumpable, and no Yama restriction; both
 * sides check what they can before using it (ps__pm_usable), and a server that cannot
 * write a pull's values into the worker sends them in the reply instead.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/common.h"
#include "net/net.h"
#include "proto/frame.h"

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

static int pm_state; /* 0 unknown, 1 usable, -1 not */

#define PM_CALL_MAX ((size_t)8 << 20) /* bytes per system call */

/* Peer-memory frames carry an expiry in CLOCK_MONOTONIC milliseconds, which both sides
 * read: a time namespace that shifts that clock would break the agreement. */
static int clock_unshifted(void) {
  FILE *f = fopen("/proc/self/timens_offsets", "r");
  if (!f) return 1; /* no time namespaces */
  char name[32];
  long long sec, nsec;
  int ok = 1;
  while (ok && fscanf(f, "%31s %lld %lld", name, &sec, &nsec) == 3)
    if (!strcmp(name, "monotonic") && (sec || nsec)) ok = 0;
  fclose(f);
  return ok;
}

static int yama_allows(void) {
  FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  if (!f) return 1; /* no Yama */
  int v = 1;
  if (fscanf(f, "%d", &v) != 1) v = 1;
  fclose(f);
  return v == 0;
}

int ps__pm_usable(void) {
  int st = __atomic_load_n(&pm_state, __ATOMIC_RELAXED);
  if (st) return st > 0;
  const char *env = getenv("PSHARD_PEER_MEM");
  int ok = !(env && !strcmp(env, "0"));
  /* The system calls exist and are allowed (a seccomp filter may refuse them), ... */
  if (ok) {
    char a[16] = "pshard-peermem", b[16] = {0};
    struct iovec l = {b, sizeof b}, r = {a, sizeof a};
    ok = process_vm_readv(getpid(), &l, 1, &r, 1, 0) == (ssize_t)sizeof a && !memcmp(a, b, sizeof a);
  }
  /* ... no Yama rule stands between two processes of one user, and this process may be
   * accessed at all (a non-dumpable one may not). */
  if (ok) ok = yama_allows() && prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 1 && clock_unshifted();
  __atomic_store_n(&pm_state, ok ? 1 : -1, __ATOMIC_RELAXED);
  return ok;
}

void ps__pm_reset(void) { __atomic_store_n(&pm_state, 0, __ATOMIC_RELAXED); }

int ps__pm_descs_check(const uint8_t *d, size_t nd, uint64_t *total) {
  uint64_t sum = 0;
  for (size_t i = 0; i < nd; i++) {
    uint64_t addr = ps__get_u64(d + 16 * i), len = ps__get_u64(d + 16 * i + 8);
    if (len == 0 || addr == 0 || len > (uint64_t)SSIZE_MAX || addr > UINT64_MAX - len || len > UINT64_MAX - sum)
      return ps__fail(PS_ERR_PROTO, "peer-memory region %zu (address %#llx, %llu bytes) is not valid", i,
                      (unsigned long long)addr, (unsigned long long)len);
    sum += len;
  }
  *total = sum;
  return 0;
}

/* process_vm_readv/writev within this process (a server colocated with its worker):
 * plain memcpy between the two region lists, which cover the same number of bytes. The
 * regions are our own client library's, naming the caller's live buffers. */
static ssize_t self_copy(int write, const struct iovec *lv, unsigned nl, const struct iovec *rv, unsigned nr) {
  size_t moved = 0, lo = 0, ro = 0;
  for (unsigned li = 0, ri = 0; li < nl && ri < nr;) {
    size_t n = lv[li].iov_len - lo < rv[ri].iov_len - ro ? lv[li].iov_len - lo : rv[ri].iov_len - ro;
    char *l = (char *)lv[li].iov_base + lo, *r = (char *)rv[ri].iov_base + ro;
    if (write) memcpy(r, l, n);
    else memcpy(l, r, n);
    moved += n, lo += n, ro += n;
    if (lo == lv[li].iov_len) li++, lo = 0;
    if (ro == rv[ri].iov_len) ri++, ro = 0;
  }
  return (ssize_t)moved;
}

/* Copy between the local regions loc and the peer's regions d[nd] taken from byte off
 * of their concatenation on, 64 regions a call on each side; a short transfer goes on
 * where it stopped. */
int ps__pm_copy(int pid, int write, const uv_buf_t *loc, unsigned nloc, const uint8_t *d, size_t nd, uint64_t off,
                uint64_t until_ms) {
  struct iovec lv[64], rv[64];
  unsigned li = 0;
  size_t lo = 0, ri = 0;
  uint64_t ro = off;
  while (ri < nd && ro >= ps__get_u64(d + 16 * ri + 8)) ro -= ps__get_u64(d + 16 * ri + 8), ri++;
  for (;;) {
    while (li < nloc && loc[li].len == lo) li++, lo = 0;
    if (li == nloc) return 0;
    if (ri == nd) return ps__fail(PS_ERR_SIZE, "peer-memory regions shorter than the values");
    /* The sender lets go of its buffers at its deadline: no copy starts after
     * until_ms, and none is longer than PM_CALL_MAX, so none ends much later. */
    if (until_ms && ps__now_ms() >= until_ms)
      return ps__fail(PS_ERR_TIMEOUT, "peer-memory request of process %d expired", pid);
    /* Up to 64 regions on each side, covering the same number of bytes. */
    unsigned nl = 0, nr = 0;
    size_t want = 0, have = 0;
    for (unsigned lj = li; lj < nloc && nl < 64 && want < PM_CALL_MAX; lj++) {
      size_t from = lj == li ? lo : 0;
      if (loc[lj].len == from) continue;
      lv[nl].iov_base = loc[lj].base + from;
      lv[nl].iov_len = loc[lj].len - from;
      if (lv[nl].iov_len > PM_CALL_MAX - want) lv[nl].iov_len = PM_CALL_MAX - want;
      want += lv[nl++].iov_len;
    }
    for (size_t rj = ri; rj < nd && nr < 64 && have < want; rj++) {
      uint64_t from = rj == ri ? ro : 0, addr = ps__get_u64(d + 16 * rj), len = ps__get_u64(d + 16 * rj + 8);
      rv[nr].iov_base = (void *)(uintptr_t)(addr + from);
      rv[nr].iov_len = (size_t)(len - from) < want - have ? (size_t)(len - from) : want - have;
      have += rv[nr++].iov_len;
    }
    size_t acc = 0; /* trim the local side to what the remote side covers */
    for (unsigned k = 0; k < nl; k++) {
      if (acc + lv[k].iov_len >= have) {
        lv[k].iov_len = have - acc;
        nl = k + 1;
        break;
      }
      acc += lv[k].iov_len;
    }
    ssize_t got = pid == PS_PM_SELF ? self_copy(write, lv, nl, rv, nr)
                  : write ? process_vm_writev(pid, lv, nl, rv, nr, 0) : process_vm_readv(pid, lv, nl, rv, nr, 0);
    if (got <= 0)
      return ps__fail(got < 0 && (errno == EPERM || errno == ENOSYS) ? PS_ERR_UNAVAILABLE : PS_ERR_IO,
                      "cannot %s the memory of process %d: %s", write ? "write" : "read", pid,
                      got < 0 ? strerror(errno) : "nothing moved");
    for (size_t n = (size_t)got; n && li < nloc;) {
      size_t step = loc[li].len - lo < n ? loc[li].len - lo : n;
      lo += step, n -= step;
      if (lo == loc[li].len) li++, lo = 0;
    }
    for (size_t n = (size_t)got; n && ri < nd;) {
      uint64_t len = ps__get_u64(d + 16 * ri + 8);
      size_t step = len - ro < n ? (size_t)(len - ro) : n;
      ro += step, n -= step;
      if (ro == len) ri++, ro = 0;
    }
  }
}

int ps__procmap_at(int maps_fd, uint64_t a, unsigned flags, struct ps__procmap_query *q) {
  memset(q, 0, sizeof *q);
  q->size = sizeof *q;
  q->query_flags = flags;
  q->query_addr = a;
  if (ioctl(maps_fd, PS_PROCMAP_QUERY, q)) return errno;
  return q->vma_start <= a && q->vma_end > a ? 0 : ENOENT; /* an answer about another mapping: none covers a */
}

/* Each region is followed from mapping to mapping, every one of them with the access
 * needed, until its end. */
int ps__pm_mapped_query(int pid, int write, const uint8_t *d, size_t nd) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/maps", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ps__fail(PS_ERR_UNAVAILABLE, "cannot read %s: %s", path, strerror(errno));
  int rc = 0;
  for (size_t i = 0; i < nd && !rc; i++) {
    uint64_t a = ps__get_u64(d + 16 * i), e = a + ps__get_u64(d + 16 * i + 8);
    while (a < e && !rc) {
      struct ps__procmap_query q;
      int err = ps__procmap_at(fd, a, write ? PS_PMQ_WRITABLE : PS_PMQ_READABLE, &q);
      if (!err) {
        a = q.vma_end;
        continue;
      }
      if (err == ENOTTY || err == EINVAL || err == EOPNOTSUPP) {
        rc = 1;
      } else if (err == ENOENT) {
        rc = ps__fail(PS_ERR_IO, "process %d has no %s mapping for [%#llx, %#llx)", pid, write ? "writable" : "readable",
                      (unsigned long long)ps__get_u64(d + 16 * i), (unsigned long long)e);
      } else {
        rc = ps__fail(PS_ERR_UNAVAILABLE, "cannot query %s: %s", path, strerror(err));
      }
    }
  }
  close(fd);
  return rc;
}

/* Is every region mapped in process pid with the access a transfer needs (read for a
 * push, write for a pull)? A streamed push checks this first, so that a bad address
 * fails before any value is applied (process_vm_readv itself would stop part way).
 * By PROCMAP_QUERY where the kernel has it, else from the text of /proc/pid/maps,
 * whose lines are sorted by address (a process's whole map as text: about 3% of the
 * samples of 1M-float sync rounds at K = 4). 0, PS_ERR_IO or PS_ERR_UNAVAILABLE. */
int ps__pm_mapped(int pid, int write, const uint8_t *d, size_t nd) {
  int rc = ps__pm_mapped_query(pid, write, d, nd);
  return rc == 1 ? ps__pm_mapped_text(pid, write, d, nd) : rc;
}

int ps__pm_mapped_text(int pid, int write, const uint8_t *d, size_t nd) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/maps", pid);
  FILE *f = fopen(path, "r");
  if (!f) return ps__fail(PS_ERR_UNAVAILABLE, "cannot read %s: %s", path, strerror(errno));
  /* The mappings, merged into runs of adjacent ones with the access needed. */
  size_t n = 0, cap = 64;
  uint64_t *run = ps__malloc(cap * 2 * sizeof *run);
  char line[512];
  int line_start = 1; /* a long line (a long path) is read in pieces: parse only its first */
  while (run && fgets(line, sizeof line, f)) {
    int first = line_start;
    line_start = strchr(line, '\n') != NULL;
    if (!first) continue;
    unsigned long long a, b;
    char perms[8];
    if (sscanf(line, "%llx-%llx %7s", &a, &b, perms) != 3) continue;
    if (perms[write ? 1 : 0] == '-') continue;
    if (n && run[2 * n - 1] == a) {
      run[2 * n - 1] = b;
      continue;
    }
    if (n == cap) {
      uint64_t *g = ps__realloc(run, cap * 4 * sizeof *run);
      if (!g) {
        free(run);
        run = NULL;
        break;
      }
      run = g, cap *= 2;
    }
    run[2 * n] = a, run[2 * n + 1] = b, n++;
  }
  fclose(f);
  if (!run) return ps__fail(PS_ERR_NOMEM, "out of memory");
  int rc = 0;
  for (size_t i = 0; i < nd && !rc; i++) {
    uint64_t a = ps__get_u64(d + 16 * i), e = a + ps__get_u64(d + 16 * i + 8);
    size_t j = 0;
    while (j < n && run[2 * j + 1] <= a) j++;
    if (j == n || run[2 * j] > a || run[2 * j + 1] < e)
      rc = ps__fail(PS_ERR_IO, "process %d has no %s mapping for [%#llx, %#llx)", pid, write ? "writable" : "readable",
                    (unsigned long long)a, (unsigned long long)e);
  }
  free(run);
  return rc;
}
