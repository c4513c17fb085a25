/*
 * pshard.h - the public C API of pshard, a parameter server for distributed training.
 *
 * This header is the whole API: what it does not declare is internal. A worker program
 * opens a context (ps_ctx), declares tables, then loops: pull parameters, compute
 * gradients, push them, advance its clock. Servers and the scheduler are started by
 * the `pshard` command, or run as threads inside the worker in embedded mode.
 *
 * Conventions
 *  - Every function that can fail returns an int: 0 (PS_OK) on success, a positive
 *    ps_err code otherwise. ps_strerror() and ps_err_name() describe a code;
 *    ps_errmsg() gives the detailed message of the last failure in the calling thread.
 *  - Handles are opaque. close/free functions accept NULL.
 *  - Buffers passed to a blocking call are borrowed for the duration of the call.
 *    Buffers passed to a *_start call must stay valid (and, for pulls, untouched)
 *    until ps_req_wait() returned something other than PS_ERR_PENDING, or until
 *    ps_req_free() returned.
 *  - Errors: each declaration lists the codes it returns. Every call that talks to
 *    the job may also return the context's own failure (PS_ERR_UNAVAILABLE after the
 *    scheduler was lost) and PS_ERR_CLOSED once ps_ctx_close has begun; a NULL
 *    handle is PS_ERR_INVALID.
 *  - Thread safety: a ps_ctx may be used from several threads at once; a ps_req must
 *    be waited on and freed by one thread at a time. ps_config is not thread-safe.
 *  - Timeouts are in milliseconds; a negative timeout means the context's default
 *    request deadline (config key `timeout_ms`). Nothing waits forever.
 */
#ifndef PSHARD_H
#define PSHARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this header; ps_version() gives the library's ("0.7.0"). */
#define PS_VERSION_MAJOR 0
#define PS_VERSION_MINOR 7
#define PS_VERSION_PATCH 0

#if defined(__GNUC__)
#define PS_API __attribute__((visibility("default")))
#else
#define PS_API
#endif

/* The error table. The same codes travel in error frames on the wire. */
#define PS_ERRNO_MAP(X)                                                        \
  X(OK, 0, "success")                                                          \
  X(ERR_INVALID, 1, "invalid argument")                                        \
  X(ERR_NOMEM, 2, "out of memory")                                             \
  X(ERR_TIMEOUT, 3, "deadline exceeded")                                       \
  X(ERR_CLOSED, 4, "closed")                                                   \
  X(ERR_IO, 5, "i/o error")                                                    \
  X(ERR_PROTO, 6, "malformed frame")                                           \
  X(ERR_TOO_LARGE, 7, "message too large")                                     \
  X(ERR_NO_TABLE, 8, "unknown table")                                          \
  X(ERR_SIZE, 9, "wrong length")                                               \
  X(ERR_DIM, 10, "wrong dimension")                                            \
  X(ERR_CONFLICT, 11, "table declared with different options")                 \
  X(ERR_MOVED, 12, "key not owned by this server")                             \
  X(ERR_CLOCK, 13, "clock out of range")                                       \
  X(ERR_CONFIG, 14, "bad configuration")                                       \
  X(ERR_UNAVAILABLE, 15, "peer unavailable")                                   \
  X(ERR_CANCELED, 16, "canceled")                                              \
  X(ERR_ROLE, 17, "not allowed in this role")                                  \
  X(ERR_RANGE, 18, "out of range")                                             \
  X(ERR_INTERNAL, 19, "internal error")                                        \
  X(ERR_DONE, 20, "no more tasks")                                             \
  X(ERR_PENDING, 21, "request still running")                                  \
  X(ERR_CORRUPT, 22, "corrupt data")                                          \
  X(ERR_AUTH, 23, "authentication failed")

typedef enum ps_err {
#define PS__ERR_ENUM(name, code, msg) PS_##name = code,
  PS_ERRNO_MAP(PS__ERR_ENUM)
#undef PS__ERR_ENUM
  PS_ERR__COUNT
} ps_err;

/* The library's version, "MAJOR.MINOR.PATCH" (as PS_VERSION_*). Never NULL, static. */
PS_API const char *ps_version(void);

/* Human-readable description of an error code ("unknown table"). Never NULL. */
PS_API const char *ps_strerror(int err);
/* Symbolic name of an error code ("PS_ERR_NO_TABLE"). Never NULL. */
PS_API const char *ps_err_name(int err);
/* Detailed message of the last failure in this thread ("" if none). Valid until the
 * next pshard call in this thread. */
PS_API const char *ps_errmsg(void);

/* ---------------------------------------------------------------- configuration */

typedef struct ps_config ps_config;

/* A configuration holds string options. Keys (environment variable in brackets):
 *   role               worker | server | scheduler            [PSHARD_ROLE]
 *   scheduler          host:port of the scheduler             [PSHARD_SCHEDULER]
 *   servers            expected number of servers S           [PSHARD_SERVERS]
 *   workers            expected number of workers K           [PSHARD_WORKERS]
 *   embedded           run a scheduler and this many servers as threads in the
 *                      calling process (0 = off)              [PSHARD_EMBEDDED]
 *   colocate           1: also run one of the job's servers as a thread in this
 *                      process, registered with `scheduler`; ps_ctx_close then waits
 *                      (at most timeout_ms) until no worker is left in the job
 *                                                             [PSHARD_COLOCATE]
 *   mode               consistency model of tables declared without their own
 *                      mode= option: sync (BSP), sync:M (a round needs the first M
 *                      workers; later pushes are dropped and counted), ssp:S (bounded
 *                      staleness S), async                    [PSHARD_MODE]
 *   timeout_ms         default request deadline (30000)       [PSHARD_TIMEOUT_MS]
 *   retry_ms           a push not answered this long after it was written is sent
 *                      again (the wait doubles per attempt, up to 8x), and pushes and
 *                      pulls whose connection failed are sent again on a new one, all
 *                      within their deadline; a server applies a push once however
 *                      often it arrives. 0: never sent again (1000) [PSHARD_RETRY_MS]
 *   connect_timeout_ms deadline to join the job (60000)       [PSHARD_CONNECT_TIMEOUT_MS]
 *   heartbeat_ms       heartbeat period (200)                 [PSHARD_HEARTBEAT_MS]
 *   heartbeat_timeout_ms  a node silent this long is dead (3000)
 *                                                             [PSHARD_HEARTBEAT_TIMEOUT_MS]
 *   rejoin_ms          a worker whose scheduler went away keeps its servers and waits
 *                      this long for a restarted scheduler to take it back (10000;
 *                      0: fail at once); meanwhile pushes and pulls go on, and calls
 *                      that need the scheduler (declare, barrier, tasks, checkpoint)
 *                      may fail
 *                                                             [PSHARD_REJOIN_MS]
 *   transport          auto | tcp (auto uses AF_UNIX sockets on the same host)
 *                                                             [PSHARD_TRANSPORT]
 *   host               address to bind and advertise (127.0.0.1) [PSHARD_HOST]
 *   vnodes             virtual nodes per server on the ring (128) [PSHARD_VNODES]
 *   max_frame_mb       largest accepted frame payload (2048)  [PSHARD_MAX_FRAME_MB]
 *   direct             1: blocking calls do their socket I/O on the calling thread
 *                      when the servers' connections are idle; 0: always through the
 *                      context's I/O thread (1)                [PSHARD_DIRECT]
 *   peer_mem           1: large dense values to and from a server on this host are
 *                      copied by the server straight from or into the caller's
 *                      buffers where the system allows it; 0: always on the socket (1)
 *                                                             [PSHARD_PEER_MEM]
 *   dedup              1: a large sparse pull asks for each distinct key once (1)
 *                                                             [PSHARD_DEDUP]
 *   http_port          a colocated server's /metrics port: 0 = ephemeral (0), off =
 *                      none (docs/operations.md, 9a)           [PSHARD_HTTP_PORT]
 *   http_host          the address it binds (127.0.0.1)       [PSHARD_HTTP_HOST]
 *   metrics            on | off: off stops the counting on the request path (the
 *                      latency histograms, request and byte counters of the context
 *                      and of a colocated or embedded server); the stats and
 *                      /metrics still answer, those counters stay flat. Servers read
 *                      PSHARD_METRICS (on)                     [PSHARD_METRICS]
 *   port               the port `pshard scheduler` binds; a worker does not use it,
 *                      but validates it (an integer in [0, 65535]) [PSHARD_PORT]
 *   fault              fault injection rules, off when unset: drop, delay or
 *                      duplicate the n-th frame of a type, fail the n-th allocation,
 *                      e.g. "drop:type=push:n=3:node=server.0;alloc:n=500"
 *                      (docs/operations.md, section "Fault injection") [PSHARD_FAULT]
 *   checkpoint_every   N > 0: the worker of rank 0 asks the scheduler for a checkpoint
 *                      (as ps_checkpoint, without waiting for it) each time its clock
 *                      reaches a multiple of N; or a duration ("500ms", "30s", "10m",
 *                      "2h"): at its first clock that long after it last asked;
 *                      0 = off (0)                            [PSHARD_CHECKPOINT_EVERY]
 *   checkpoint_dir     `pshard scheduler`: the directory checkpoints are written to
 *                      (none: the job takes no checkpoints)   [PSHARD_CHECKPOINT_DIR]
 *   checkpoint_keep    `pshard scheduler`: complete checkpoints kept, older ones are
 *                      removed (3; and the ones a kept increment builds on)
 *                                                             [PSHARD_CHECKPOINT_KEEP]
 *   checkpoint_full_every  `pshard scheduler`: N > 1: one checkpoint in N holds every
 *                      row, the others only the rows changed since the checkpoint
 *                      before (increments; a restore reads the chain) (1: every
 *                      checkpoint whole)                      [PSHARD_CHECKPOINT_FULL_EVERY]
 *   replicas           `pshard scheduler` (and an embedded job's scheduler): copies
 *                      of every key range, 1 to 3 and at most the number of servers
 *                      (1); the servers and workers learn it from the scheduler
 *                      (docs/design.md, section 8c)           [PSHARD_REPLICAS]
 *   restore            `pshard scheduler` and `pshard server`: start the job from the
 *                      newest complete checkpoint under this directory (or from the
 *                      checkpoint directory itself); the workers' clocks start at its
 *                      clock (ps_ctx_clock)                    [PSHARD_RESTORE]
 * Of these a worker does not read `servers` (the scheduler tells it the servers),
 * `checkpoint_dir`, `checkpoint_keep`, `checkpoint_full_every`, `replicas` or `restore`
 * (they are the daemons'; `replicas` also sets an embedded job's);
 * `workers` is read in embedded mode (the embedded scheduler expects that many).
 */
/* A new, empty configuration in *out (free it with ps_config_free).
 * Errors: PS_ERR_INVALID (out is NULL), PS_ERR_NOMEM. */
PS_API int ps_config_new(ps_config **out);
PS_API void ps_config_free(ps_config *cfg);
/* Set one option. The configuration is unchanged after an error. The strings are
 * copied. Errors: PS_ERR_INVALID (a NULL argument), PS_ERR_CONFIG (an unknown key or
 * an invalid value; the message says which), PS_ERR_NOMEM. */
PS_API int ps_config_set(ps_config *cfg, const char *key, const char *value);
/* Read every PSHARD_* variable that names a known key. Unknown PSHARD_* variables are
 * ignored. Errors: PS_ERR_INVALID (cfg is NULL), PS_ERR_CONFIG (an invalid value; the
 * message names the variable), PS_ERR_NOMEM. */
PS_API int ps_config_from_env(ps_config *cfg);
/* The current value of a key, or NULL if unset. Borrowed from cfg. */
PS_API const char *ps_config_get(const ps_config *cfg, const char *key);

/* ---------------------------------------------------------------- context */

typedef struct ps_ctx ps_ctx;

/* Open a worker context: connect to the scheduler (or start an embedded one), register,
 * and wait until the job's expected servers and workers have joined (deadline
 * connect_timeout_ms). cfg is borrowed for the call (NULL: all defaults). On success
 * *out owns the context; close it with ps_ctx_close. On failure *out is NULL.
 * Errors: PS_ERR_INVALID (out is NULL), PS_ERR_ROLE (role is not worker),
 * PS_ERR_CONFIG (no scheduler address, a bad one, or embedded with colocate),
 * PS_ERR_UNAVAILABLE (the scheduler could not be reached, or closed the connection),
 * PS_ERR_TIMEOUT (no answer to the registration, or the job did not start by
 * connect_timeout_ms), PS_ERR_IO (a socket error), PS_ERR_NOMEM, or the code with
 * which the scheduler refused the registration. */
PS_API int ps_ctx_open(const ps_config *cfg, ps_ctx **out);
/* Same, from a configuration built from the environment alone. Errors: as
 * ps_ctx_open, and as ps_config_from_env. */
PS_API int ps_ctx_open_env(ps_ctx **out);
/* Leave the job cleanly, cancel outstanding requests, stop embedded threads, free. */
PS_API void ps_ctx_close(ps_ctx *ctx);

/* This worker's rank in [0, K) (-1 for NULL) and the job's current worker and server
 * counts (0 for NULL). */
PS_API int ps_ctx_rank(const ps_ctx *ctx);
PS_API int ps_ctx_num_workers(const ps_ctx *ctx);
PS_API int ps_ctx_num_servers(const ps_ctx *ctx);
/* The worker's clock: the number of completed iterations (ps_clock calls). */
PS_API int64_t ps_ctx_clock(const ps_ctx *ctx);
/* Membership epoch as last heard from the scheduler. */
PS_API uint64_t ps_ctx_epoch(const ps_ctx *ctx);

/* ---------------------------------------------------------------- tables */

typedef enum ps_table_kind { PS_DENSE = 1, PS_SPARSE = 2 } ps_table_kind;

/* Declare a table, or attach to one already declared by another worker.
 *   kind  PS_DENSE: a vector of `size` floats; PS_SPARSE: rows of `size` floats (dim)
 *         keyed by any uint64 row id, created on first touch.
 *   options  space-separated key=value pairs, NULL or "" for defaults:
 *     opt=sgd|momentum|adagrad|adam|ftrl   (sgd)
 *     lr=0.01 momentum=0.9 beta1=0.9 beta2=0.999 eps=1e-8 acc0=0 (adagrad start)
 *     l1=0 l2=0 beta=1 (ftrl)
 *     update=mean|sum      combine pushes as the batch-weighted mean (default) or sum
 *     init=zero | const:V | uniform:A (in [-A,A]) | normal:SD    (zero)
 *     seed=N               initialiser seed (0)
 *     slice=N              dense: elements per slice, the unit of placement (65536)
 *     mode=sync|sync:M|ssp:S|async   consistency model (default: the job's `mode`)
 *     every=N              sync modes: apply a round every N clocks (layer-wise
 *                          frequencies: a table synchronised less often) (1)
 *     agg_n=N agg_ms=T     async/ssp: buffer pushes and apply, per row, their
 *                          batch-weighted mean after N pushes or T ms (off)
 *     nonfinite=refuse|skip|allow   a push holding a NaN or an infinity (or with a
 *                          header rate lr that is not finite): refused whole with
 *                          PS_ERR_INVALID naming the first bad index, dropped whole
 *                          (answered as dropped), or applied unchecked (refuse)
 *     push_codec=none|fp16|bf16|int8|topk:F   how workers encode pushes on the wire;
 *                          topk:F sends the F (F >= 1) or F x n (F < 1) largest values of
 *                          each server's part. What a lossy codec leaves out is kept by
 *                          the worker and added to its next push of the same rows
 *                          (error feedback; memory: one f32 per value pushed). (none)
 *     pull_codec=none|fp16|bf16|int8   how servers encode pull replies (none)
 *   The learning-rate schedule applied by the servers (a push's own lr overrides it):
 *     ref_batch=B          linear scaling: lr * B_global / B, where B_global is the
 *                          examples behind the update (sync: the round's batches, so it
 *                          changes when workers join or leave; async: the buffered
 *                          pushes' mean batch times the live workers) (off)
 *     warmup=N             linear warm-up: step t <= N uses t/N of the rate (off)
 *     decay=const | step:S:G | cos:T[:MIN]   after warm-up: constant; times G every S
 *                          steps; or cosine from the peak to MIN x peak over T steps
 * *id_out receives the table id used by push and pull (id_out may be NULL).
 * Errors: PS_ERR_INVALID (NULL ctx, a name of 0 or more than 127 bytes, a bad kind or
 * size), PS_ERR_CONFIG (bad options, the message says which), PS_ERR_CONFLICT (the
 * same name declared before with other options), PS_ERR_TIMEOUT (no answer within
 * timeout_ms), PS_ERR_UNAVAILABLE (the scheduler or a server is gone), PS_ERR_PROTO
 * (a bad answer), PS_ERR_NOMEM, PS_ERR_CLOSED. */
PS_API int ps_table_declare(ps_ctx *ctx, const char *name, ps_table_kind kind,
                            uint64_t size, const char *options, uint32_t *id_out);

/* ---------------------------------------------------------------- push and pull */

/* A learning rate of PS_LR_SCHEDULE (any negative value) means "the table's own". */
#define PS_LR_SCHEDULE (-1.0f)

/* Errors of every push and pull below: PS_ERR_INVALID (NULL ctx, keys, grads or out
 * where needed; a sparse call on a dense table or the reverse; batch 0 in a push to an
 * update=mean table), PS_ERR_NO_TABLE (not declared in this context), PS_ERR_RANGE (a
 * dense range outside the table, or empty), PS_ERR_TOO_LARGE (more than max_frame_mb,
 * or more than 2^32-1 keys), PS_ERR_TIMEOUT (not answered within timeout_ms),
 * PS_ERR_UNAVAILABLE (a server holding the keys left the job or cannot be reached),
 * PS_ERR_SIZE (an answer of the wrong length), PS_ERR_NOMEM, PS_ERR_CLOSED, or an error
 * a server answered with (PS_ERR_NO_TABLE, PS_ERR_MOVED, PS_ERR_CLOCK, PS_ERR_DIM,
 * PS_ERR_NOMEM, ...). After an error a push may have been applied on some servers. */

/* Pull sparse rows: out receives nkeys*dim floats, row i for keys[i] (repeats allowed).
 * In sync mode the answer reflects every round before this worker's clock. */
PS_API int ps_pull(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys,
                   float *out, int timeout_ms);
/* Push sparse gradients: grads holds nkeys*dim floats, the worker's mean gradient over
 * its local batch of `batch` examples. Repeated keys in one push are combined: their
 * gradients are summed. lr overrides the table's learning rate unless negative. */
PS_API int ps_push(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys,
                   const float *grads, uint32_t batch, float lr, int timeout_ms);
/* Dense variants over the element range [offset, offset+count). */
PS_API int ps_pull_range(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count,
                         float *out, int timeout_ms);
PS_API int ps_push_range(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count,
                         const float *grads, uint32_t batch, float lr, int timeout_ms);

/* Push then pull the same keys (or range) in one round trip: the two requests go out
 * back to back on each server's connection, and the call returns when both are
 * answered. The result is what ps_push followed by ps_pull would give: in async mode
 * the pulled rows include this push; in sync modes the pull answers at the current
 * clock (call ps_clock between a push and a pull to read the round it closes). grads
 * and out may be the same array. */
PS_API int ps_push_pull(ps_ctx *ctx, uint32_t table, const uint64_t *keys, size_t nkeys,
                        const float *grads, uint32_t batch, float lr, float *out, int timeout_ms);
PS_API int ps_push_pull_range(ps_ctx *ctx, uint32_t table, uint64_t offset, uint64_t count,
                              const float *grads, uint32_t batch, float lr, float *out,
                              int timeout_ms);

/* Memory for the values of dense pushes and pulls, which a server on the same host can
 * read and write in place: dense calls on it move less data between the processes.
 * ps_alloc gives the caller `bytes` of zeroed, page-aligned memory, owned by the
 * caller until ps_free; use it like any memory (pushes and pulls from it give the same
 * results as from other memory). Beyond 256 buffers alive at once it gives ordinary
 * memory, which works the same way. The memory stays usable in children forked after
 * the call. Returns NULL (with ps_errmsg) when out of memory or bytes is 0.
 * ps_free takes only a pointer from ps_alloc (or NULL). Thread-safe; no context
 * needed. */
PS_API void *ps_alloc(size_t bytes);
PS_API void ps_free(void *p);

typedef struct ps_req ps_req;

/* Non-blocking variants: *req receives a handle, owned by the caller until
 * ps_req_free; see the buffer rules above. Errors: those of the blocking calls found
 * before anything is sent (PS_ERR_INVALID also for a NULL req, PS_ERR_NO_TABLE,
 * PS_ERR_RANGE, PS_ERR_TOO_LARGE, PS_ERR_NOMEM, PS_ERR_CLOSED); the others come from
 * ps_req_wait. A request's deadline is the context's timeout_ms. */
PS_API int ps_pull_start(ps_ctx *ctx, uint32_t table, const uint64_t *keys,
                         size_t nkeys, float *out, ps_req **req);
PS_API int ps_push_start(ps_ctx *ctx, uint32_t table, const uint64_t *keys,
                         size_t nkeys, const float *grads, uint32_t batch, float lr,
                         ps_req **req);
PS_API int ps_pull_range_start(ps_ctx *ctx, uint32_t table, uint64_t offset,
                               uint64_t count, float *out, ps_req **req);
PS_API int ps_push_range_start(ps_ctx *ctx, uint32_t table, uint64_t offset,
                               uint64_t count, const float *grads, uint32_t batch,
                               float lr, ps_req **req);
/* Wait for a request. Returns its result once it has finished: 0, or its error (as
 * the blocking call's; PS_ERR_TIMEOUT when it failed at its own deadline).
 * PS_ERR_PENDING when it is still running after this wait's timeout_ms (0 polls): the
 * request then stays valid and may be waited again. PS_ERR_INVALID for NULL. */
PS_API int ps_req_wait(ps_req *req, int timeout_ms);
/* 1 once the request has finished (ps_req_wait then returns its result at once), 0
 * while it runs, -1 for NULL. Never blocks. */
PS_API int ps_req_done(ps_req *req);
/* Free a request; a request still running is canceled first (the call returns once the
 * library no longer touches its buffers). NULL is a no-op. */
PS_API void ps_req_free(ps_req *req);

/* ---------------------------------------------------------------- clock, barrier, metrics */

/* Finish the current iteration: tell every server this worker's clock advanced. In sync
 * mode a round is applied once every active worker has advanced past it. Does not wait
 * for the servers. Errors: PS_ERR_INVALID (NULL ctx), PS_ERR_NOMEM, PS_ERR_CLOSED. */
PS_API int ps_clock(ps_ctx *ctx);
/* Take a consistent checkpoint of the whole job (docs/checkpoint.md) into the job's
 * checkpoint directory (the scheduler's `--checkpoint-dir`), cut at the caller's clock
 * c (the number of its ps_clock calls): every sync table as it is once the rounds of
 * clocks before c are applied, every other table as it is when its server gets the
 * request. Blocks until the checkpoint is complete (its manifest written), at most
 * timeout_ms (< 0: the context's timeout_ms); its id into *id (may be NULL). The
 * scheduler fails it sooner when a server neither answers nor gets on with its file for
 * its checkpoint timeout (`pshard scheduler --checkpoint-timeout-ms`, 120 s): a server
 * writing a large table says every second that it got on, so a write of minutes
 * completes. In a sync
 * job the other workers wait at clock c meanwhile; `checkpoint_every` takes checkpoints
 * without stopping the caller. Thread-safe.
 * Errors: PS_ERR_INVALID (ctx is NULL), PS_ERR_CONFIG (the job has no checkpoint
 * directory), PS_ERR_UNAVAILABLE (another checkpoint is being taken, or a server left),
 * PS_ERR_CLOCK (a server was already past c: under sync:M a straggler's clock can be),
 * PS_ERR_IO (a file could not be written; the message names it), PS_ERR_TIMEOUT,
 * PS_ERR_CLOSED. */
PS_API int ps_checkpoint(ps_ctx *ctx, uint64_t *id, int timeout_ms);
/* As ps_checkpoint, into the directory dir instead of the job's checkpoint directory
 * (which the job then need not have): the checkpoint is dir/ckpt-<id>, id one past the
 * largest ckpt-<id> already in dir, and dir is made if missing (one level). Nothing in
 * dir is pruned (`checkpoint_keep` applies to the job's directory only). The scheduler
 * makes the directory and every server writes its file there, so dir must be a path
 * they all see; a relative dir is taken from the caller's working directory. dir is
 * borrowed for the call; NULL is ps_checkpoint. `pshard run --restore dir` (or
 * `pshard.load_checkpoint(dir)`) reads it back. Thread-safe.
 * Errors: those of ps_checkpoint, PS_ERR_CONFIG aside, and PS_ERR_INVALID (an empty or
 * too long dir: at most 991 bytes once made absolute), PS_ERR_IO (dir cannot be made
 * or is not a directory, on the scheduler's side; the message names it). */
PS_API int ps_checkpoint_to(ps_ctx *ctx, const char *dir, uint64_t *id, int timeout_ms);
/* Wait until every active worker reached the barrier. A call after a failed one enters
 * the same barrier again. Errors: PS_ERR_INVALID (NULL ctx), PS_ERR_TIMEOUT,
 * PS_ERR_UNAVAILABLE (the scheduler is gone), PS_ERR_NOMEM, PS_ERR_CLOSED. */
PS_API int ps_barrier(ps_ctx *ctx, int timeout_ms);
/* Report a named metric (e.g. "loss") to the scheduler; does not wait. Errors:
 * PS_ERR_INVALID (NULL ctx, a name of 0 or more than 63 bytes), PS_ERR_NOMEM,
 * PS_ERR_CLOSED. */
PS_API int ps_metric(ps_ctx *ctx, const char *name, double value);

/* ---------------------------------------------------------------- data-partition tasks */

/* The scheduler hands out a job's data partitions as tasks: a worker asks for the next
 * partition, processes it, reports it done. An epoch ends when every partition is done;
 * a dead worker's unfinished partitions go back to the queue. Without failures every
 * partition is processed exactly once per epoch. */
typedef struct ps_task {
  uint32_t partition; /* in [0, partitions) */
  uint32_t epoch;     /* in [0, epochs) */
} ps_task;

/* Declare the job's partitions and epochs. Every worker may call it; the first call
 * defines them and later calls must agree. Errors: PS_ERR_INVALID (NULL ctx, 0
 * partitions or epochs), PS_ERR_CONFLICT (other numbers than the first call's),
 * PS_ERR_TIMEOUT, PS_ERR_UNAVAILABLE, PS_ERR_NOMEM, PS_ERR_CLOSED. */
PS_API int ps_tasks_init(ps_ctx *ctx, uint32_t partitions, uint32_t epochs);
/* The next partition for this worker. If every partition of the current epoch is
 * handed out but some are still running elsewhere, waits up to timeout_ms for one to
 * come back or for the epoch to end (0 polls). Errors: PS_ERR_TIMEOUT (none came),
 * PS_ERR_DONE (every epoch is finished), PS_ERR_INVALID (NULL ctx or task, or tasks
 * not declared with ps_tasks_init), PS_ERR_UNAVAILABLE, PS_ERR_NOMEM, PS_ERR_CLOSED. */
PS_API int ps_task_next(ps_ctx *ctx, ps_task *task, int timeout_ms);
/* Report a partition processed. Errors: PS_ERR_INVALID (NULL ctx or task, or a
 * partition not assigned to this worker, for instance taken back after this worker
 * was declared dead), PS_ERR_TIMEOUT, PS_ERR_UNAVAILABLE, PS_ERR_NOMEM, PS_ERR_CLOSED. */
PS_API int ps_task_done(ps_ctx *ctx, const ps_task *task);

/* ---------------------------------------------------------------- statistics */

/* A counter of this worker, by name:
 *   uptime_s         seconds since ps_ctx_open
 *   pull_wait_s      seconds blocked waiting for pulls (blocking calls and ps_req_wait)
 *   push_wait_s      seconds blocked waiting for pushes
 *   other_wait_s     seconds blocked in control calls (declare, barrier, tasks)
 *   compute_s        uptime minus all waits: the time the worker spent on its own work
 *   pulls, pushes    requests started
 *   bytes_pushed, bytes_pulled   payload bytes (keys and values) sent and received
 *   dropped_pushes   pushes acknowledged but not applied (late under sync:M)
 *   fast_forwards    times the clock jumped ahead to the servers' round (sync:M)
 *   clock            the worker's clock
 *   examples         examples behind its pushes: per clock, the largest batch pushed
 *   direct_calls     blocking calls done on the caller's thread (lent links)
 *   peer_mem_parts   dense request parts whose values a same-host server read from
 *                    or wrote into the caller's buffers itself (config peer_mem)
 *   shared_parts     of those, parts in ps_alloc memory (a server's STATS:
 *                    shared_requests)
 *   http_port        the /metrics port of the server colocated in this process, -1
 *                    for none
 *   table_pushed_bytes, table_pulled_bytes, table_sent_frames, table_received_frames
 *                    by table: payload bytes pushed and pulled (as bytes_pushed and
 *                    bytes_pulled), request frames sent (one per server a push or pull
 *                    went to) and answers taken; "NAME:T" for table id T alone, NAME
 *                    alone the sum over the tables (PS_ERR_NO_TABLE: no table T)
 * With metrics=off, pulls, pushes, bytes_* and table_* stay 0.
 * Every worker also reports these to the scheduler about once a second (metrics named
 * "ps.<name>"), which `pshard plan --measured` reads.
 * Errors: PS_ERR_INVALID (a NULL argument or an unknown name). Thread-safe. */
PS_API int ps_ctx_stat(const ps_ctx *ctx, const char *name, double *value);
/* The counters of server i (0 <= i < ps_ctx_num_servers) as text, one "key value" line
 * each: tables (mode, rows, bytes, pushes, pulls, dropped and rejected pushes), clocks,
 * and staleness histograms ("push_staleness_max N", "push_staleness c0 c1 ...": counts
 * of applied async/ssp pushes by staleness in clocks, and the same for pulls, where
 * staleness is the pull's clock minus the slowest live worker's). The text is cut to
 * cap-1 bytes and NUL-terminated. Errors: PS_ERR_INVALID (NULL ctx or buf, cap 0),
 * PS_ERR_RANGE (no server i), PS_ERR_TIMEOUT, PS_ERR_UNAVAILABLE, PS_ERR_NOMEM,
 * PS_ERR_CLOSED. */
PS_API int ps_server_stats(ps_ctx *ctx, int server, char *buf, size_t cap, int timeout_ms);

/* ---------------------------------------------------------------- logging */

typedef void (*ps_log_fn)(int level, const char *msg, void *arg);
enum { PS_LOG_ERROR = 0, PS_LOG_WARN = 1, PS_LOG_INFO = 2, PS_LOG_DEBUG = 3 };
/* Route the library's log messages (default: none for workers). Process-wide. */
PS_API void ps_set_log(ps_log_fn fn, void *arg, int max_level);

#ifdef __cplusplus
}
#endif
#endif /* PSHARD_H */
