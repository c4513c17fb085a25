/*
 * oneshot.h - one request, one reply, blocking: for tools that ask a running node one
 * question (the `pshard` command fetching the scheduler's counters) without setting up
 * a client context.
 *
 * The exchange runs on a private libuv loop in the calling thread, over the same
 * framed connection code (net/conn.c) as every other peer, so frames are encoded,
 * bounded and checked the same way. Nothing is shared between calls; any thread may
 * call it, several at once.
 */
#ifndef PS_ONESHOT_H
#define PS_ONESHOT_H

#include <stddef.h>
#include <stdint.h>

#include "proto/frame.h"

/* Connect to addr ("HOST:PORT", HOST an IPv4 or IPv6 address or a host name) over TCP, send the
 * request req (type, req_id and the other header fields as given; payload_len is set
 * from len; a req_id of 0 becomes 1) with body[0 .. len), and wait for the frame that
 * answers it: type req->type | PS_FRAME_REPLY with the same req_id. Frames that answer
 * something else are read and dropped. Blocks for at most timeout_ms (> 0) in all,
 * connecting included. A reply body longer than max_reply bytes is refused unread.
 *
 * On success returns 0 and sets *reply to the reply's header and *out to its body: a
 * malloc'd buffer of *out_len bytes plus a terminating NUL (so a text reply is a C
 * string), NULL when the body is empty; the caller frees it. reply may be NULL.
 * On failure *out is NULL, *out_len 0, and the return value, with a message for
 * ps_errmsg() that names addr, is one of:
 *   PS_ERR_INVALID      a NULL argument or timeout_ms == 0
 *   PS_ERR_CONFIG       addr is not HOST:PORT with a numeric host and a port in 1..65535
 *   PS_ERR_UNAVAILABLE  the connection was refused or the host is unreachable
 *   PS_ERR_TIMEOUT      no reply within timeout_ms
 *   PS_ERR_TOO_LARGE    the reply's body exceeds max_reply bytes
 *   PS_ERR_CLOSED       the peer closed the connection without replying
 *   PS_ERR_PROTO        the peer sent a malformed frame
 *   PS_ERR_NOMEM, PS_ERR_IO
 *   or the status of an error frame the peer answered with (its text in the message).
 * SIGPIPE from a peer that hangs up is suppressed and does not reach the caller. */
int ps__oneshot(const char *addr, const ps__frame_hdr *req, const void *body, size_t len,
                uint64_t timeout_ms, uint64_t max_reply, ps__frame_hdr *reply, void **out,
                size_t *out_len);

#endif /* PS_ONESHOT_H */
