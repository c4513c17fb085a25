/*
 * shared.c - memory a worker shares with the servers of its host (ps_alloc).
 *
 * Peer memory (peermem.c) lets a server copy a push out of a worker's buffers, and a
 * pull into them, with process_vm_readv / process_vm_writev: one copy by the kernel,
 * which pins every 4 KiB page of the buffer for it. A buffer from ps_alloc is instead a
 * sealed memfd mapped shared. A peer-memory frame whose regions lie in one such buffer
 * names, in its tail's second word, 1 + the worker's file descriptor of it. The server
 * takes a duplicate of that descriptor (pidfd_getfd, which the kernel allows exactly
 * where it allows process_vm_readv), maps the file once, and from then on adds the
 * gradients straight from it and writes the pulled values straight into it: the
 * transfer becomes the server's own reads and writes, with no copy into a staging
 * buffer and no page pinning.
 *
 * The server trusts nothing in the frame but the hint. Each region is looked up in the
 * worker's own mappings (PROCMAP_QUERY, Linux 6.11): it must lie inside one shared
 * mapping of a file with the access the transfer needs; that file's device and inode
 * must be the descriptor's; the file must be plain shmem (not hugetlbfs) sealed
 * against shrinking (so that no access of the server can fault). The region's place in the file is the mapping's
 * offset, from the kernel. Anything else (no hint, an older kernel, another file, a
 * region across mappings) leaves the request to process_vm_readv / writev.
 *
 * A process shares at most PS_SHM_MAX buffers at once (each holds a descriptor: a
 * process's soft limit is often 1024); later ones are ordinary memory, which pushes and
 * pulls the usual way. Mappings are kept per connection, as many: dropped when it closes, when the worker no longer
 * maps the file where it was last seen (ps_free), or after a minute unused. The server
 * only touches them inside the loop callback that translated the regions, so dropping
 * one between callbacks is always safe.
 */

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "common/common.h"
#include "net/net.h"

#ifndef F_SEAL_SHRINK
#define F_ADD_SEALS 1033
#define F_GET_SEALS 1034
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#define MFD_ALLOW_SEALING 0x0002U
#endif
#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

/* ------------------------------------------------------------------ the worker's side */

typedef struct shm_buf {
  uintptr_t base;
  size_t len; /* mapped bytes (whole pages) */
  int fd;     /* the memfd, or -1: ordinary memory */
} shm_buf;

static pthread_mutex_t bufs_mu = PTHREAD_MUTEX_INITIALIZER;
static shm_buf *bufs; /* sorted by base */
static size_t nbufs, capbufs;
static size_t nshared; /* of them with a memfd (at most PS_SHM_MAX) */

static size_t page_round(size_t n) {
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  return n > SIZE_MAX - pg ? 0 : (n + pg - 1) / pg * pg;
}

/* A fork while another thread holds bufs_mu must not leave the child's copy locked. */
static void bufs_lock(void) { pthread_mutex_lock(&bufs_mu); }
static void bufs_unlock(void) { pthread_mutex_unlock(&bufs_mu); }
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void atfork_init(void) { pthread_atfork(bufs_lock, bufs_unlock, bufs_unlock); }

/* Take (1) or give back (-1) one of the PS_SHM_MAX shared buffers; 1 if taken. */
static int shared_slot(int delta) {
  pthread_mutex_lock(&bufs_mu);
  int ok = delta < 0 || nshared < PS_SHM_MAX;
  if (ok) nshared += (size_t)(ptrdiff_t)delta;
  pthread_mutex_unlock(&bufs_mu);
  return ok;
}

static int memfd_open(size_t len) {
  int fd = (int)syscall(SYS_memfd_create, "pshard-buffer", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  if (ftruncate(fd, (off_t)len) || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) {
    close(fd);
    return -1;
  }
  return fd;
}

void *ps_alloc(size_t bytes) {
  size_t len = page_round(bytes);
  if (!bytes || !len) {
    ps__fail(PS_ERR_INVALID, "ps_alloc of %zu bytes", bytes);
    return NULL;
  }
  pthread_once(&atfork_once, atfork_init);
  /* A slot is taken first, and given back if no memfd comes of it. */
  int fd = shared_slot(1) ? memfd_open(len) : -2;
  if (fd == -1) shared_slot(-1);
  if (fd < 0) fd = -1;
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, fd >= 0 ? MAP_SHARED : MAP_PRIVATE | MAP_ANONYMOUS, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    if (fd >= 0) {
      close(fd);
      shared_slot(-1);
    }
    ps__fail(PS_ERR_NOMEM, "ps_alloc of %zu bytes: %s", bytes, strerror(err));
    return NULL;
  }
  pthread_mutex_lock(&bufs_mu);
  if (nbufs == capbufs) {
    size_t cap = capbufs ? 2 * capbufs : 16;
    shm_buf *g = ps__realloc(bufs, cap * sizeof *g);
    if (!g) {
      if (fd >= 0) nshared--;
      pthread_mutex_unlock(&bufs_mu);
      munmap(p, len);
      if (fd >= 0) close(fd);
      ps__fail(PS_ERR_NOMEM, "out of memory");
      return NULL;
    }
    bufs = g, capbufs = cap;
  }
  size_t i = nbufs;
  while (i && bufs[i - 1].base > (uintptr_t)p) bufs[i] = bufs[i - 1], i--;
  bufs[i] = (shm_buf){(uintptr_t)p, len, fd};
  nbufs++;
  pthread_mutex_unlock(&bufs_mu);
  return p;
}

void ps_free(void *p) {
  if (!p) return;
  pthread_mutex_lock(&bufs_mu);
  size_t i = 0;
  while (i < nbufs && bufs[i].base != (uintptr_t)p) i++;
  if (i == nbufs) {
    pthread_mutex_unlock(&bufs_mu);
    ps__log(PS_LOG_ERROR, "ps_free of %p, which ps_alloc did not return: ignored", p);
    return;
  }
  shm_buf b = bufs[i];
  memmove(bufs + i, bufs + i + 1, (nbufs - i - 1) * sizeof *bufs);
  nbufs--;
  if (b.fd >= 0) nshared--;
  pthread_mutex_unlock(&bufs_mu);
  munmap((void *)b.base, b.len);
  if (b.fd >= 0) close(b.fd);
}

uint64_t ps__shm_hint(const uint64_t *pairs, size_t n) {
  if (!n) return 0;
  uint64_t hint = 0;
  pthread_mutex_lock(&bufs_mu);
  if (nbufs) {
    /* The last buffer starting at or before the first region. */
    uintptr_t a = (uintptr_t)pairs[0];
    size_t lo = 0, hi = nbufs;
    while (lo < hi) {
      size_t mid = (lo + hi) / 2;
      if (bufs[mid].base <= a) lo = mid + 1;
      else hi = mid;
    }
    if (lo) {
      const shm_buf *b = &bufs[lo - 1];
      int inside = b->fd >= 0;
      for (size_t i = 0; i < n && inside; i++)
        inside = pairs[2 * i] >= b->base && pairs[2 * i + 1] <= b->len && pairs[2 * i] - b->base <= b->len - pairs[2 * i + 1];
      if (inside) hint = (uint64_t)b->fd + 1;
    }
  }
  pthread_mutex_unlock(&bufs_mu);
  return hint;
}

/* ------------------------------------------------------------------ the server's side */

typedef struct shm_peer { /* a connection's process */
  const void *owner;
  int pid, maps_fd, pidfd;
} shm_peer;

typedef struct shm_map { /* a file of that process, mapped here */
  const void *owner;
  uint64_t dev, ino;
  char *base;
  size_t size;
  int writable;
  uint64_t seen_addr, seen_off; /* a region last used: its address there, its place here */
  uint64_t used_ms;
} shm_map;

struct ps__shm_cache {
  shm_peer *peers;
  size_t npeers, cappeers;
  shm_map *maps;
  size_t nmaps, capmaps;
  uint64_t translated, mapped; /* requests served from a mapping; files mapped */
};

#define SHM_IDLE_MS 60000

ps__shm_cache *ps__shm_cache_new(void) { return ps__calloc(1, sizeof(ps__shm_cache)); }

static void map_drop(ps__shm_cache *c, size_t i) {
  munmap(c->maps[i].base, c->maps[i].size);
  c->maps[i] = c->maps[--c->nmaps];
}

void ps__shm_forget(ps__shm_cache *c, const void *owner) {
  if (!c) return;
  for (size_t i = 0; i < c->nmaps;)
    if (c->maps[i].owner == owner) map_drop(c, i);
    else i++;
  for (size_t i = 0; i < c->npeers; i++)
    if (c->peers[i].owner == owner) {
      if (c->peers[i].maps_fd >= 0) close(c->peers[i].maps_fd);
      if (c->peers[i].pidfd >= 0) close(c->peers[i].pidfd);
      c->peers[i] = c->peers[--c->npeers];
      break;
    }
}

void ps__shm_cache_free(ps__shm_cache *c) {
  if (!c) return;
  while (c->npeers) ps__shm_forget(c, c->peers[0].owner);
  while (c->nmaps) map_drop(c, 0);
  free(c->peers);
  free(c->maps);
  free(c);
}

static shm_peer *peer_of(ps__shm_cache *c, const void *owner, int pid) {
  for (size_t i = 0; i < c->npeers; i++)
    if (c->peers[i].owner == owner) return c->peers[i].pid == pid ? &c->peers[i] : NULL;
  if (c->npeers == c->cappeers) {
    size_t cap = c->cappeers ? 2 * c->cappeers : 8;
    shm_peer *g = ps__realloc(c->peers, cap * sizeof *g);
    if (!g) return NULL;
    c->peers = g, c->cappeers = cap;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/maps", pid);
  int mfd = open(path, O_RDONLY | O_CLOEXEC);
  if (mfd < 0) return NULL;
  shm_peer *p = &c->peers[c->npeers++];
  *p = (shm_peer){owner, pid, mfd, -1};
  return p;
}

/* The mapping of process p holding address a, if shared and file-backed with the access
 * asked for. 0 or -1. */
static int query(const shm_peer *p, uint64_t a, int write, struct ps__procmap_query *q) {
  unsigned flags = PS_PMQ_READABLE | PS_PMQ_SHARED | PS_PMQ_FILE_BACKED | (write ? PS_PMQ_WRITABLE : 0);
  return ps__procmap_at(p->maps_fd, a, flags, q) ? -1 : 0;
}

static shm_map *map_file(ps__shm_cache *c, shm_peer *p, uint64_t hint, uint64_t dev, uint64_t ino) {
  if (p->pidfd < 0 && (p->pidfd = (int)syscall(SYS_pidfd_open, p->pid, 0)) < 0) return NULL;
  int fd = (int)syscall(SYS_pidfd_getfd, p->pidfd, (int)(hint - 1), 0);
  if (fd < 0) return NULL;
  struct stat st;
  struct statfs sf;
  shm_map *m = NULL;
  int seals = fcntl(fd, F_GET_SEALS), fl = fcntl(fd, F_GETFL);
  /* Plain shmem only (memfd_create without MFD_HUGETLB): a hugetlbfs file's page
   * faults can end in SIGBUS when its pool runs dry. */
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_ino == ino && (uint64_t)st.st_dev == dev &&
      fstatfs(fd, &sf) == 0 && sf.f_type == TMPFS_MAGIC && seals >= 0 && (seals & F_SEAL_SHRINK) && fl >= 0 &&
      st.st_size > 0) {
    int writable = (fl & O_ACCMODE) == O_RDWR;
    void *base = mmap(NULL, (size_t)st.st_size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
    if (base != MAP_FAILED) {
      size_t mine = 0, lru = SIZE_MAX;
      for (size_t i = 0; i < c->nmaps; i++)
        if (c->maps[i].owner == p->owner) {
          mine++;
          if (lru == SIZE_MAX || c->maps[i].used_ms < c->maps[lru].used_ms) lru = i;
        }
      if (mine >= PS_SHM_MAX) map_drop(c, lru);
      if (c->nmaps == c->capmaps) {
        size_t cap = c->capmaps ? 2 * c->capmaps : 8;
        shm_map *g = ps__realloc(c->maps, cap * sizeof *g);
        if (g) c->maps = g, c->capmaps = cap;
      }
      if (c->nmaps < c->capmaps) {
        m = &c->maps[c->nmaps++];
        *m = (shm_map){p->owner, dev, ino, base, (size_t)st.st_size, writable, 0, 0, 0};
        c->mapped++;
      } else {
        munmap(base, (size_t)st.st_size);
      }
    }
  }
  close(fd);
  return m;
}

int ps__shm_translate(ps__shm_cache *c, const void *owner, int pid, uint64_t hint, int write, const uint8_t *d,
                      size_t nd, uint8_t *out) {
  if (!c || !hint || hint > (uint64_t)INT32_MAX + 1 || !nd || pid <= 0) return 1;
  shm_peer *p = peer_of(c, owner, pid);
  if (!p) return 1;
  uint64_t now = ps__now_ms();
  shm_map *m = NULL;
  for (size_t i = 0; i < nd; i++) {
    uint64_t a = ps__get_u64(d + 16 * i), len = ps__get_u64(d + 16 * i + 8);
    struct ps__procmap_query q;
    if (query(p, a, write, &q) || len > q.vma_end - a) return 1; /* not one shared mapping */
    uint64_t dev = makedev(q.dev_major, q.dev_minor);
    /* The hint names one file: every region must be in it. (So only the first region can
     * map a file, and evicting another can never unmap an earlier region's address.) */
    if (m && (m->dev != dev || m->ino != q.inode)) return 1;
    if (!m) {
      for (size_t k = 0; k < c->nmaps && !m; k++)
        if (c->maps[k].owner == owner && c->maps[k].dev == dev && c->maps[k].ino == q.inode) m = &c->maps[k];
      if (!m && !(m = map_file(c, p, hint, dev, q.inode))) return 1;
    }
    uint64_t off = q.vma_offset + (a - q.vma_start);
    if ((write && !m->writable) || off > m->size || len > m->size - off) return 1;
    ps__put_u64(out + 16 * i, (uint64_t)(uintptr_t)(m->base + off));
    ps__put_u64(out + 16 * i + 8, len);
    m->seen_addr = a;
    m->seen_off = off;
    m->used_ms = now;
  }
  c->translated++;
  return 0;
}

void ps__shm_sweep(ps__shm_cache *c) {
  if (!c) return;
  uint64_t now = ps__now_ms();
  for (size_t i = 0; i < c->nmaps;) {
    shm_map *m = &c->maps[i];
    shm_peer *p = NULL;
    for (size_t k = 0; k < c->npeers && !p; k++)
      if (c->peers[k].owner == m->owner) p = &c->peers[k];
    struct ps__procmap_query q;
    /* Still mapped where it was last used, the same file, at the same place? */
    int kept = p && now - m->used_ms < SHM_IDLE_MS && query(p, m->seen_addr, 0, &q) == 0 &&
               makedev(q.dev_major, q.dev_minor) == m->dev && q.inode == m->ino &&
               q.vma_offset + (m->seen_addr - q.vma_start) == m->seen_off;
    if (kept) i++;
    else map_drop(c, i);
  }
}

void ps__shm_counts(const ps__shm_cache *c, uint64_t *translated, uint64_t *mapped, uint64_t *held) {
  *translated = c ? c->translated : 0;
  *mapped = c ? c->mapped : 0;
  *held = c ? c->nmaps : 0;
}
