/*
 * xport.h - value transports: where a data request's values are, and how a server
 * reads or writes them.
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
 * A worker's blocking calls may also write frames on a lent socket from the caller's
 * thread (client); that changes which thread does the I/O, not where the values are,
 * and a lent socket carries inline or peer-memory frames alike.
 *
 * Who calls what. ps__vx_open and ps__vx_close run on the server's loop thread, within
 * the callback that handles the frame: a shared transport's addresses stay valid until
 * control returns to the loop (ps__shm_sweep may unmap them then). The ops may run on
 * the loop thread or on its helper thread (ps__par): a copy split in two parts at byte
 * offsets touches disjoint bytes, and no op changes the ps__vx.
 */
#ifndef PS_XPORT_H
#define PS_XPORT_H

#include <stddef.h>
#include <stdint.h>

#include "net/net.h"

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

#endif /* PS_XPORT_H */
