/*
 * auth.h - the job secret on connections: this process's key and policy, the
 * handshake run on every connection before its owner sees it, and the check that a
 * frame's sender is the peer the handshake authenticated.
 *
 * The key. A process belongs to one job: its secret and job id are process-wide, set
 * before the first listen or connect, from (first that applies) ps__auth_set_secret*,
 * else PSHARD_SECRET_FILE (a file holding the secret; the `secret_file` configuration
 * key), else PSHARD_SECRET (the secret itself); the job id from ps__auth_set_job, else
 * PSHARD_JOB_ID, else "default". Without a secret connections are not authenticated:
 * listening is then allowed on loopback only (a warning is logged once), or anywhere
 * after ps__auth_set_insecure(1) / PSHARD_INSECURE=1.
 *
 * The handshake (proto/auth.h) runs inside net/: an accepted connection reaches the
 * listener's accept callback, and an outgoing one its connect callback, only once both
 * sides proved they hold the secret. Until then the connection accepts frames of at
 * most PS_AUTH_MAX_BODY bytes, must finish within the deadline (PSHARD_AUTH_TIMEOUT_MS,
 * 10000 ms), and at most PSHARD_AUTH_PENDING_MAX (64) accepted connections of the
 * process may be unauthenticated at once (more are closed at accept). Any failure gets
 * one refusal, an ERROR frame with PS_ERR_AUTH "authentication failed", and the close;
 * the reason is logged locally only. A connect that fails its handshake completes with
 * PS_ERR_AUTH.
 *
 * Identity. Each loop's connections present who owns the loop (ps__auth_self_set: the
 * node agent registers its role and node id, the scheduler its role). On an accepted,
 * authenticated connection every frame's sender must be the authenticated node:
 * a sender of 0 is read as that node, another is refused (PS_ERR_AUTH, then the
 * close). A node's id is given at registration; the scheduler binds a connection to
 * the id it just gave (ps__conn_auth_bind).
 *
 * Threads: the key and policy are set before loops run (a mutex guards the setting);
 * everything else runs on the connection's loop thread.
 */
#ifndef PS_NET_AUTH_H
#define PS_NET_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "net/net.h"
#include "proto/auth.h"

/* Load the key from the environment once (no-op after a setter): 0, or PS_ERR_CONFIG
 * with a message (a bad PSHARD_SECRET_FILE, a short secret, both variables set). Called
 * by every listen and connect. */
int ps__auth_arm_env(void);
/* Use the secret in file path (trailing newlines dropped; PS_AUTH_SECRET_MIN to
 * PS_AUTH_SECRET_MAX bytes): 0 or PS_ERR_CONFIG. A file readable by other users is
 * used with a warning. */
int ps__auth_set_secret_file(const char *path);
/* Use these n bytes as the secret: 0 or PS_ERR_CONFIG. */
int ps__auth_set_secret(const void *secret, size_t n);
/* The job id the handshake is bound to (at most PS_AUTH_JOB_MAX printable bytes): 0
 * or PS_ERR_CONFIG. */
int ps__auth_set_job(const char *job);
void ps__auth_set_insecure(int on);
/* Tests: forget the key and policy; the environment is read again at the next arm. */
void ps__auth_reset(void);
/* Is a secret set (after ps__auth_arm_env)? */
int ps__auth_enabled(void);
/* May this process listen on host (a numeric address)? 0, or PS_ERR_CONFIG: a
 * non-loopback address without a secret and without insecure. */
int ps__auth_check_bind(const char *host);

/* Connections of loop present role and node from now on (the agent sets them when it
 * starts and again when it registers). Until set, and after clear (when the loop is
 * torn down), a loop presents a tool with node 0. */
void ps__auth_self_set(uv_loop_t *loop, uint8_t role, uint32_t node);
void ps__auth_self_clear(uv_loop_t *loop);

/* The connection's authenticated peer is now node (the scheduler, at registration). */
void ps__conn_auth_bind(ps__conn *c, uint32_t node);

/* ---------------------------------------------------------------- hooks of listen.c and conn.c */

/* An accepted, started connection: hand it to cb now (no secret), or once it is
 * authenticated. */
void ps__auth_accept(ps__conn *c, ps__accept_cb cb, void *arg);
/* A connected, started connection: cb(arg, c, 0) now (no secret) or once it is
 * authenticated; else cb(arg, NULL, err): PS_ERR_AUTH when either side refused,
 * PS_ERR_UNAVAILABLE when the peer closed it during the handshake, PS_ERR_CLOSED when
 * it was closed here (a loop's teardown). */
void ps__auth_connected(ps__conn *c, ps__connect_cb cb, void *arg);
/* ps__conn_reject during the handshake (an oversized or malformed frame): the
 * uniform refusal. */
void ps__auth_refuse(ps__conn *c, const char *why);
/* ps__conn_close during the handshake: stop its deadline. */
void ps__auth_stop(ps__conn *c);
/* Refuse the frame being read (c->cur) for its sender; then the close. */
void ps__auth_refuse_sender(ps__conn *c);

/* The sender check of an accepted, authenticated connection (c->auth_inbound), on each
 * header: 0 to go on (a sender of 0 becomes the authenticated node), 1 when the frame
 * was refused and the connection closes. */
static inline int ps__auth_sender(ps__conn *c, ps__frame_hdr *h) {
  if (h->sender == c->auth_node) return 0;
  if (h->sender == 0) {
    h->sender = c->auth_node;
    return 0;
  }
  ps__auth_refuse_sender(c);
  return 1;
}

#endif
