/*
 * net.h - framed connections on a libuv event loop, and the payload buffer pool.
 *
 * Threads: a connection, its listener and its pool belong to one loop and are used
 * only from that loop's thread. Other threads reach a loop through ps__mailbox (a
 * mutex-protected queue and one uv_async wake-up).
 *
 * Transports: TCP between hosts and AF_UNIX stream sockets on one host share this code
 * path (both are uv_stream_t). Reading: a connection parses the 64-byte header from a
 * staging buffer, then asks its owner where the body goes (ps__conn_ops.on_header):
 * into caller-supplied regions (a pull reply lands straight in the user's array) or a
 * pooled buffer. Large bodies are read by the kernel directly into the destination;
 * small ones are copied out of the staging buffer. Writing uses scatter/gather: the
 * header and any number of borrowed payload regions go out in one uv_write.
 */
#ifndef PS_NET_H
#define PS_NET_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "proto/frame.h"

/* ---------------------------------------------------------------- buffer pool */

/* A per-loop cache of payload buffers in power-of-two size classes (4 KiB .. 1 TiB),
 * so repeated large messages reuse warm pages instead of fresh ones. */
typedef struct ps__pool ps__pool;
ps__pool *ps__pool_new(size_t max_cached_bytes);
void ps__pool_free(ps__pool *p);
/* A buffer of at least n bytes, or NULL. */
void *ps__pool_get(ps__pool *p, size_t n);
/* Return a buffer obtained with ps__pool_get(p, n) (same n). NULL is a no-op. */
void ps__pool_put(ps__pool *p, void *buf, size_t n);
/* A cached buffer of at least n bytes (memory the pool holds already), or NULL: none
 * is cached, nothing is allocated. Returned with ps__pool_put(p, buf, n). */
void *ps__pool_cached(ps__pool *p, size_t n);
/* Grow buf, from ps__pool_get(p, n), to hold m > n bytes with its first n kept: the
 * same buffer when its size class holds m already, else a larger one (realloc: large
 * buffers are remapped, not copied). Returned with ps__pool_put(p, new, m). NULL when
 * out of memory; buf is then still valid. */
void *ps__pool_grow(ps__pool *p, void *buf, size_t n, size_t m);

/* ---------------------------------------------------------------- frame budget */

typedef struct ps__conn ps__conn;

/* Limits on frames being read, shared by the connections of one loop that are given
 * it (a server's workers): the bytes held by the bodies of partial frames across them
 * (a frame whose body would pass it is refused, and its connection closed, with
 * PS_ERR_NOMEM), and how long a frame begun may take to arrive (its connection is then
 * closed, with a log line). A connection's body buffer grows as its bytes arrive, so a
 * header's announced length reserves nothing by itself. Loop thread only. */
typedef struct ps__frame_budget {
  uint64_t limit;        /* bytes (0: no limit) */
  uint64_t used;         /* held by partial frames now */
  uint32_t deadline_ms;  /* 0: no deadline */
  uv_timer_t timer;
  int timer_init;
  ps__conn *partial;     /* connections in a frame (deadline_ms set), a list */
  uint64_t refused;      /* frames refused over the limit */
  uint64_t expired;      /* connections closed past the deadline */
  uint64_t peak;         /* the most used at once */
} ps__frame_budget;

/* Start a budget on loop (its timer is closed with ps__frame_budget_close, or by a
 * loop close that closes every handle). */
void ps__frame_budget_init(ps__frame_budget *b, uv_loop_t *loop, uint64_t limit, uint32_t deadline_ms);
void ps__frame_budget_close(ps__frame_budget *b);

/* ---------------------------------------------------------------- connections */

#define PS_BODY_MAX_IOV 8

/* Where a frame body goes, decided by on_header. */
typedef struct ps__body {
  /* Destinations chosen by the owner: regions filled in order; their lengths must add up
   * to the payload length. Left empty, the connection reads into a pooled buffer. */
  uv_buf_t *iov;
  unsigned niov;
  uv_buf_t iov_small[PS_BODY_MAX_IOV]; /* storage the owner may point iov at */
  int discard;  /* set by on_header: read and drop the body */
  void *buf;    /* pooled body (when iov is empty); on_frame may take it (set NULL) */
  size_t len;   /* its length (the payload length) */
  void *udata;  /* passed from on_header to on_frame */
} ps__body;

typedef struct ps__conn_ops {
  /* A valid header arrived. Return 0 to accept (optionally setting body->iov/discard),
   * or a ps_err code to answer with an error frame and close the connection. */
  int (*on_header)(ps__conn *c, const ps__frame_hdr *h, ps__body *body);
  /* The whole frame arrived. body->buf (if any) is returned to the pool afterwards
   * unless on_frame set it to NULL (then it owns it, size body->len). */
  void (*on_frame)(ps__conn *c, const ps__frame_hdr *h, ps__body *body);
  /* The connection is closed and about to be freed; status is 0 for a local close or
   * a ps_err code. Called once. Do not touch c after it returns. */
  void (*on_close)(ps__conn *c, int status);
} ps__conn_ops;

/* Completion of a send: status 0 or a ps_err code. */
typedef void (*ps__send_cb)(void *arg, int status);

struct ps__conn {
  uv_loop_t *loop;
  union {
    uv_stream_t stream;
    uv_tcp_t tcp;
    uv_pipe_t pipe;
    uv_handle_t handle;
  } h;
  const ps__conn_ops *ops;
  void *udata;       /* owner's pointer */
  ps__pool *pool;
  uint64_t max_payload;
  int closing;
  int close_status;
  int is_unix;
  int peer_pid;          /* AF_UNIX: the peer process (SO_PEERCRED), else 0 */
  unsigned peer_uid;
  /* read state */
  uint8_t *stage;
  size_t stage_cap, rpos, wpos;
  int in_body;
  int direct;            /* last alloc_cb handed out a body region */
  ps__frame_hdr cur;
  ps__body body;
  unsigned cur_iov;
  size_t cur_off;        /* offset within iov[cur_iov] */
  uint64_t body_left;
  uint8_t *discard_buf;
  /* a pooled body grows as its bytes arrive: body_cap bytes held now (the size given to
   * ps__pool_get or ps__pool_grow), growing while that is less than the payload */
  size_t body_cap;
  int growing;
  int body_err;          /* the body could not grow: the frame is refused */
  ps__frame_budget *budget; /* NULL: no limits */
  uint64_t held;         /* bytes counted in budget->used */
  ps__conn *pnext, *pprev; /* budget->partial */
  int plinked;
  uint64_t since_ms;     /* the frame being read began (uv_now) */
  /* accounting */
  uint64_t bytes_in, bytes_out, frames_in, frames_out;
  size_t write_queue_bytes;  /* includes frames held back by fault injection */
  char peer[128];
  struct ps__fault_q *fq;    /* fault injection state (conn_fault.c): NULL until a fault fires here */
  /* authentication (auth.c) */
  struct ps__auth_conn *hs;  /* the handshake under way, else NULL */
  int authed;                /* the handshake succeeded: auth_role and auth_node name the peer */
  int auth_inbound;          /* accepted and authenticated: every frame's sender is checked */
  uint8_t auth_role;
  uint32_t auth_node;
};

/* Wrap an accepted or connected stream. The conn starts reading at once. */
int ps__conn_start(ps__conn *c);
/* Allocate a conn for a stream to be initialised by the caller (tcp or pipe). */
ps__conn *ps__conn_alloc(uv_loop_t *loop, const ps__conn_ops *ops, void *udata, ps__pool *pool,
                         uint64_t max_payload);
/* Free a conn whose stream was never initialised (its handle not opened). */
void ps__conn_free_unopened(ps__conn *c);
/* Connections allocated and not yet freed in this process (STATS `connections`). */
size_t ps__conn_live(void);
/* Send a frame: header h (payload_len is set from bufs) and borrowed payload regions
 * (valid until cb). cb may be NULL. Returns 0, or an error (cb is then not called). */
int ps__conn_send(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs,
                  ps__send_cb cb, void *arg);
/* Send a frame whose payload regions are borrowed only for the duration of the call:
 * what the socket accepts at once is written straight from them (no copy), the rest is
 * copied into a pooled buffer and written later. So the frame carries the regions as
 * they are now, whatever happens to them after the call. Returns 0, or an error (then
 * the frame was not sent; if part of it was, the connection is closed). */
int ps__conn_send_now(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs);
/* Like ps__conn_send_now, for a payload that becomes final from the front while it is
 * sent: only its first `ready` bytes may be read yet. Whenever the socket takes no more
 * of what is final, produce(arg) is called to make more of it final and returns the new
 * count, which must grow, up to the payload length. So the owner's work (finishing the
 * values) runs while the peer drains the socket. On return the whole payload is final
 * unless an error is returned. */
typedef size_t (*ps__produce_fn)(void *arg);
int ps__conn_send_produced(ps__conn *c, ps__frame_hdr *h, const uv_buf_t *bufs, unsigned nbufs, size_t ready,
                           ps__produce_fn produce, void *arg);
/* Send a control frame whose body is copied. */
int ps__conn_send_ctrl(ps__conn *c, ps__frame_hdr *h, const void *body, size_t len);
/* Answer request h with an error frame carrying msg. */
int ps__conn_send_error(ps__conn *c, const ps__frame_hdr *req, int status, const char *msg);
/* Close (idempotent). on_close runs later on the loop with status. */
void ps__conn_close(ps__conn *c, int status);
/* Close after the writes queued so far are flushed. */
void ps__conn_close_after_flush(ps__conn *c, int status);

/* Lending a connection's socket to another thread (the client's caller-side I/O for
 * blocking calls). ps__conn_pause stops reading and returns the socket descriptor, but
 * only at an idle point: no frame half read, nothing staged, nothing unsent (else -1).
 * While paused the loop must neither send on c nor expect reads; the borrower does
 * whole-frame I/O on the descriptor. ps__conn_resume gives it back: n bytes the
 * borrower read past its last frame (at most the staging capacity) are parsed first,
 * then reading restarts. */
int ps__conn_pause(ps__conn *c);
int ps__conn_resume(ps__conn *c, const void *pre, size_t n);

/* ---------------------------------------------------------------- listening and connecting */

typedef void (*ps__accept_cb)(void *arg, ps__conn *c);

typedef struct ps__listener {
  uv_loop_t *loop;
  union {
    uv_tcp_t tcp;
    uv_pipe_t pipe;
    uv_handle_t handle;
    uv_stream_t stream;
  } h;
  int is_unix;
  const ps__conn_ops *ops;
  ps__accept_cb on_accept;
  void *arg;
  ps__pool *pool;
  uint64_t max_payload;
  ps__frame_budget *budget; /* given to accepted connections (NULL: none); set after listening */
  int port;            /* bound TCP port */
  char path[108];      /* bound unix path */
} ps__listener;

/* Listen on host:port (port 0 = ephemeral; the bound port is in l->port). */
int ps__listen_tcp(ps__listener *l, uv_loop_t *loop, const char *host, int port,
                   const ps__conn_ops *ops, ps__accept_cb cb, void *arg, ps__pool *pool,
                   uint64_t max_payload);
/* Listen on a unix socket path (unlinked first and on close). */
int ps__listen_unix(ps__listener *l, uv_loop_t *loop, const char *path, const ps__conn_ops *ops,
                    ps__accept_cb cb, void *arg, ps__pool *pool, uint64_t max_payload);
void ps__listener_close(ps__listener *l);

/* Connect; on completion cb(arg, conn or NULL, status). The conn reads once connected. */
typedef void (*ps__connect_cb)(void *arg, ps__conn *c, int status);
int ps__connect_tcp(uv_loop_t *loop, const char *host, int port, const ps__conn_ops *ops,
                    void *udata, ps__pool *pool, uint64_t max_payload, ps__connect_cb cb, void *arg);
int ps__connect_unix(uv_loop_t *loop, const char *path, const ps__conn_ops *ops, void *udata,
                     ps__pool *pool, uint64_t max_payload, ps__connect_cb cb, void *arg);

/* ---------------------------------------------------------------- mailbox */

/* Run functions on a loop's thread, posted from any thread. */
typedef struct ps__mailbox ps__mailbox;
typedef void (*ps__mail_fn)(void *arg);
ps__mailbox *ps__mailbox_new(uv_loop_t *loop);
/* Queue fn(arg) to run on the loop; returns 0 or PS_ERR_NOMEM / PS_ERR_CLOSED. */
int ps__mailbox_post(ps__mailbox *m, ps__mail_fn fn, void *arg);
/* Close from the loop thread; queued mail is run first. */
void ps__mailbox_close(ps__mailbox *m);

/* Translate a libuv error into a ps_err code. */
int ps__uv_err(int uverr);

/* ------------------------------------------------------------------ peer memory (peermem.c) */

/* May this process use peer-memory transfers with another process of its user (the
 * system calls work here, no Yama restriction, dumpable)? PSHARD_PEER_MEM=0 says no.
 * Checked once; ps__pm_reset forgets the answer (tests). */
int ps__pm_usable(void);
void ps__pm_reset(void);
/* Validate nd descriptors (u64 address, u64 length, little-endian) and sum their
 * lengths. 0 or PS_ERR_PROTO. */
int ps__pm_descs_check(const uint8_t *d, size_t nd, uint64_t *total);
/* Copy between process pid's regions d[nd], from byte off of their concatenation on,
 * and the local regions loc: the peer's into loc (write = 0), or loc into the peer's
 * (write = 1), as many bytes as loc holds, in system calls of at most 8 MiB, none
 * started at or after until_ms (ps__now_ms; 0 = no limit). 0, PS_ERR_UNAVAILABLE (not
 * permitted here), PS_ERR_IO (a bad address), PS_ERR_TIMEOUT (expired) or PS_ERR_SIZE,
 * with a message; after a failure part of the bytes may have moved.
 * pid PS_PM_SELF: the regions are this process's own, named by our own client library
 * (a server colocated with its worker): plain memcpy, no system call and no check of the
 * addresses (a bad one is the caller's own bad pointer). */
#define PS_PM_SELF (-1)
int ps__pm_copy(int pid, int write, const uv_buf_t *loc, unsigned nloc, const uint8_t *d, size_t nd, uint64_t off,
                uint64_t until_ms);
/* Are the regions d[nd] all mapped in process pid, readable (write = 0) or writable?
 * 0, PS_ERR_IO (not), PS_ERR_UNAVAILABLE (cannot tell) or PS_ERR_NOMEM. */
int ps__pm_mapped(int pid, int write, const uint8_t *d, size_t nd);
/* Its two ways, for tests: by PROCMAP_QUERY (Linux 6.11; returns 1 where the kernel
 * does not have it), and from the text of /proc/pid/maps. */
int ps__pm_mapped_query(int pid, int write, const uint8_t *d, size_t nd);
int ps__pm_mapped_text(int pid, int write, const uint8_t *d, size_t nd);

/* PROCMAP_QUERY (Linux 6.11): one mapping of a process by address, asked with an ioctl
 * on its /proc/pid/maps instead of reading the whole text. Declared here: Debian 12's
 * kernel headers predate it (linux/fs.h, struct procmap_query, a stable interface).
 * Used by peermem.c and shared.c. */
struct ps__procmap_query {
  uint64_t size, query_flags, query_addr, vma_start, vma_end, vma_flags, vma_page_size, vma_offset, inode;
  uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
  uint64_t vma_name_addr, build_id_addr;
};
#define PS_PROCMAP_QUERY _IOWR('f', 17, struct ps__procmap_query)
#define PS_PMQ_READABLE 0x01u
#define PS_PMQ_WRITABLE 0x02u
#define PS_PMQ_SHARED 0x08u
#define PS_PMQ_FILE_BACKED 0x20u
/* The mapping of the process whose /proc/pid/maps is open as maps_fd that covers
 * address a with every property in flags (PS_PMQ_*), into *q: 0, else an errno
 * (ENOENT: none; ENOTTY, EINVAL, EOPNOTSUPP: a kernel without PROCMAP_QUERY). */
int ps__procmap_at(int maps_fd, uint64_t a, unsigned flags, struct ps__procmap_query *q);

/* ------------------------------------------------------------------ shared buffers (shared.c) */

/* At most this many ps_alloc buffers of a process are shared at once (each holds a file
 * descriptor; later ones are ordinary memory until one is freed), and a server keeps at
 * most this many files mapped per connection (the least recently used goes). */
#define PS_SHM_MAX 256
/* Worker side: 1 + the file descriptor of the ps_alloc buffer that holds every region of
 * pairs[n] (native address, length), or 0 (the tail's hint, protocol.md 6.2a). */
uint64_t ps__shm_hint(const uint64_t *pairs, size_t n);
/* Server side: the shared files of its workers, mapped here, per connection (owner). */
typedef struct ps__shm_cache ps__shm_cache;
ps__shm_cache *ps__shm_cache_new(void);
void ps__shm_cache_free(ps__shm_cache *c);
/* The regions d[nd] (little-endian pairs) of process pid, with the frame's hint, as
 * this process's own addresses in out[nd] (same form), from a mapping of the worker's
 * sealed file: 0. 1 when they cannot be (then out is undefined and the request goes by
 * process_vm_readv / writev). The addresses are valid until control returns to the
 * loop: ps__shm_sweep and ps__shm_forget may unmap them. */
int ps__shm_translate(ps__shm_cache *c, const void *owner, int pid, uint64_t hint, int write, const uint8_t *d,
                      size_t nd, uint8_t *out);
/* Unmap what the workers no longer map where they last used it, or left unused for a
 * minute; ps__shm_forget: everything of one connection (closed). */
void ps__shm_sweep(ps__shm_cache *c);
void ps__shm_forget(ps__shm_cache *c, const void *owner);
void ps__shm_counts(const ps__shm_cache *c, uint64_t *translated, uint64_t *mapped, uint64_t *held);

#endif
