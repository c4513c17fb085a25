/*
 * xport.h - value transports: where a data request's values are, how a worker chooses
 * and describes them, and how a server reads or writes them.
 *
 *   transport  frame (hdr.xport)    the values are                    moved with
 *   inline     PS_XPORT_INLINE      in the frame, after the keys      memcpy from/to the body
 *   peer       PS_XPORT_PEER_MEM    in the sender's memory            process_vm_readv/writev (peermem.c)
 *   self       PS_XPORT_PEER_MEM    in this very process (a worker    memcpy
 *                                   colocated with its server)
 *   shared     PS_XPORT_PEER_MEM    in a ps_alloc buffer the sender   memcpy through this process's
 *                                   shares with the servers of its     mapping of it (shared.c)
 *                                   host
 *
 * The worker decides between the two frames (inline, peer memory) per dense part; the
 * server decides, from the frame and its connection, which of the last three serves a
 * peer-memory frame. A worker's blocking calls may also write frames on a lent socket
 * from the caller's thread (client); that changes which thread does the I/O, not where
 * the values are, and a lent socket carries inline or peer-memory frames alike.
 *
 * Who calls what, on the worker. ps__vx_link_peer runs on the I/O thread when a link's
 * connection comes up. ps__vx_choose and ps__vx_tail run on the caller's thread that
 * builds the request (ps__vx_choose asks its link_pid callback from there). ps__vx_reply
 * and ps__vx_written run where the reply is read: on the I/O thread, or on the caller's
 * thread for a blocking call on a lent link. ps__vx_lent and ps__vx_must_hold run
 * wherever the part is finished or given back: the I/O thread (completion, cancel, the
 * deadline sweep), the caller's thread after a call on lent links, or ps_ctx_close's
 * thread once the loop is gone. A ps__vx_part belongs to one thread at a time, as its
 * part does.
 *
 * Who calls what, on the server. ps__vx_open and ps__vx_close run on the server's loop
 * thread, within the callback that handles the frame: a shared transport's addresses
 * stay valid until control returns to the loop (ps__shm_sweep may unmap them then). The
 * ops may run on the loop thread or on its helper thread (ps__par): a copy split in two
 * parts at byte offsets touches disjoint bytes, and no op changes the ps__vx.
 */
#ifndef PS_XPORT_H
#define PS_XPORT_H

#include <stddef.h>
#include <stdint.h>

#include "net/net.h"
#include "proto/frame.h"

/* ---------------------------------------------------------------- the server's side */

typedef struct ps__vx ps__vx;

typedef struct ps__vx_ops {
  const char *name;
  /* Move bytes [off, off + len(loc)) of the values: into the local regions loc
   * (write = 0), or from them into the values (write = 1). 0, or PS_ERR_UNAVAILABLE
   * (not permitted here: the caller may answer inline instead), PS_ERR_IO (a bad
   * address), PS_ERR_TIMEOUT (the sender's deadline passed) or PS_ERR_SIZE, with a
   * message; after a failure part of the bytes may have moved. */
  int (*copy)(const ps__vx *x, int write, const uv_buf_t *loc, unsigned nloc, uint64_t off);
  /* y[0 .. n) += a * values[pos .. pos + n) (floats) straight from where the values
   * are, when they can be read in place: 0, or PS_ERR_UNAVAILABLE when they must be
   * copied first (peer), or an error as for copy. */
  int (*axpy)(const ps__vx *x, float *y, float a, uint64_t n, uint64_t pos);
  /* Are the values all there, readable (write = 0) or writable? 0, PS_ERR_IO (not),
   * PS_ERR_UNAVAILABLE (cannot tell) or PS_ERR_NOMEM. */
  int (*check)(const ps__vx *x, int write);
} ps__vx_ops;

struct ps__vx {
  const ps__vx_ops *ops;
  int pid;           /* peer: the sender's process (SO_PEERCRED) */
  uint64_t until;    /* the sender lets go of its buffers then (ps__now_ms), 0 = never */
  uint64_t hint;     /* the frame's shared-buffer hint (protocol.md 6.2a) */
  const uint8_t *d;  /* (u64 address, u64 length) pairs, little-endian: the sender's
                      * addresses (peer), or this process's (self, shared, inline) */
  size_t nd;
  uint64_t total;    /* bytes of values */
  uint8_t *xd;       /* owned: the pairs translated (shared), or the one pair (inline) */
};

extern const ps__vx_ops ps__vx_inline_ops, ps__vx_peer_ops, ps__vx_self_ops, ps__vx_shared_ops;

/* The values of an inline request: len bytes at vals. */
int ps__vx_inline(ps__vx *x, const void *vals, uint64_t len);
/* Parse and check a peer-memory tail (below) into x without choosing its transport
 * (x->ops stays NULL): for the checks of a request answered later. 0 or PS_ERR_PROTO. */
int ps__vx_parse(ps__vx *x, const uint8_t *tail, size_t tlen);
/* The values of a peer-memory request whose tail (what follows its keys: until, hint,
 * then the pairs) is tail[0 .. tlen), sent on connection c, on a server whose process
 * id is self_pid: the pairs are checked (PS_ERR_PROTO, with a message). The transport
 * is self for a peer in this process; shared when the hint names a buffer that can be
 * mapped for this access (the cache *shm is made on first use); else peer. */
int ps__vx_open(ps__vx *x, ps__shm_cache **shm, ps__conn *c, int self_pid, int write, const uint8_t *tail,
                size_t tlen);
void ps__vx_close(ps__vx *x);
/* The transport's name ("inline", "peer", "self", "shared"). */
static inline const char *ps__vx_name(const ps__vx *x) { return x->ops->name; }

/* ---------------------------------------------------------------- the worker's side */

/* Peer memory only for dense parts of at least this many value bytes: below it a
 * socket's two copies cost less than the system call's page pinning. */
#define PS_VX_PEER_MIN_BYTES ((uint64_t)64 << 10)
/* A peer-memory part names the caller's buffers, and the server copies from or into
 * them until the expiry its tail carries, PS_VX_SLACK_MS before the part's deadline;
 * peer memory is used only when the deadline is at least twice that far. */
#define PS_VX_SLACK_MS 2000u
/* A pull of a replicated table by peer memory expires this long after it is built, at
 * the latest: it may have to go to the next member of its chain, and goes only when
 * the member it went to first may no longer write into the caller's buffers (one
 * written off while it stood still may resume). A server that finds a pull expired
 * answers it inline. */
#define PS_VX_CHAIN_PULL_MS 1000u
/* A frame down a chain that names its values in the sender's memory (a sync round's
 * update, to a member on the same host) expires this long after it is sent; a member
 * that finds it expired answers PS_ERR_TIMEOUT and is sent the values. */
#define PS_FWD_PM_MS 1000u

/* How one dense part of a worker's request carries its values. */
typedef struct ps__vx_part {
  uint8_t xport;    /* PS_XPORT_INLINE or PS_XPORT_PEER_MEM: the frame's hdr.xport */
  int pid;          /* peer: the server's process, which copies from or into the buffers */
  uint64_t bytes;   /* peer: value bytes the regions hold */
  uint64_t until;   /* peer: the expiry in the tail (ps__now_ms) */
  uint64_t hint;    /* peer: the tail's shared-buffer hint, 0 = none (set by ps__vx_tail) */
  int answered;     /* peer: the server answered the part, or closed the connection
                     * (then it serves no frame of it any more): it is done with them */
} ps__vx_part;

/* May peer-memory frames go on connection c to a server that announced caps
 * (PS_CAP_*)? They need an AF_UNIX connection to a server that offers them, running
 * as this user or privileged (the kernel's ptrace rule for process_vm_readv). The
 * server's process id if so, else 0. */
int ps__vx_link_peer(const ps__conn *c, unsigned caps);
/* Choose how a dense part of `bytes` value bytes, due at deadline_ms, travels, into
 * *v (reset first): by peer memory when it is PS_VX_PEER_MIN_BYTES or more, its
 * deadline at least 2 * PS_VX_SLACK_MS after now_ms (ps__now_ms, read once per
 * request), and link_pid(arg), asked only then, gives the server's process (its
 * link's ps__vx_link_peer); else inline. Returns v->xport, for the frame's hdr.xport. */
uint8_t ps__vx_choose(ps__vx_part *v, uint64_t bytes, uint64_t deadline_ms, uint64_t now_ms,
                      int (*link_pid)(void *arg), void *arg);
/* What the frame of part v carries after its segment list, when the values are the
 * caller's regions r[0 .. n) in segment order. Inline: nothing (0; the regions go in
 * the frame's iov as they are). Peer memory: the tail of protocol.md 6.2a into the
 * 8-byte words tail[0 .. 2 + 2n): the expiry, the shared-buffer hint (ps__shm_hint:
 * the ps_alloc buffer that holds every region, also kept in v->hint), then one
 * (address, length) pair per region, all little-endian; returns its length in bytes,
 * 16 + 16 n. No allocation and no system call. */
size_t ps__vx_tail(ps__vx_part *v, uint64_t *tail, const uv_buf_t *r, size_t n);
/* Does the successful reply h to part v mean its values are already where the caller
 * wants them (a peer-memory pull's empty reply: the server wrote them)? */
int ps__vx_written(const ps__vx_part *v, const ps__frame_hdr *h);
/* What the successful reply h to a part v that expects `want` value bytes means: 0
 * with *written = 1 when the server wrote them already (ps__vx_written), 0 with
 * *written = 0 when the body holds them (read it into the destination), or
 * PS_ERR_SIZE, with a message, for a body of another length. A server may answer a
 * peer-memory pull inline (protocol.md 6.2a): either is accepted. */
int ps__vx_reply(const ps__vx_part *v, const ps__frame_hdr *h, uint64_t want, int *written);
/* Has part v, sent (sent != 0), lent the caller's buffers to the server? A peer-memory
 * part has: the server may copy from or into them at any time until it answers, so a
 * cancel cannot take them back. An inline part's buffers are the connection's only
 * until its write completes (ps__conn_send). */
int ps__vx_lent(const ps__vx_part *v, int sent);
/* Must the caller's buffers of part v, sent (sent != 0), stay lent now? Yes while the
 * server may still copy (ps__vx_lent): until it answered or closed the connection
 * (v->answered), deadline_ms passed (the tail's expiry and PS_VX_SLACK_MS after it),
 * or its process is gone (exited, or a zombie: it writes nowhere any more). */
int ps__vx_must_hold(const ps__vx_part *v, int sent, uint64_t deadline_ms);

#endif /* PS_XPORT_H */
