/*
 * fault.h - built-in fault injection: drop, delay or duplicate chosen frames, fail
 * chosen allocations. Off by default.
 *
 * A fault spec (configuration key `fault`, environment variable PSHARD_FAULT) is a list
 * of rules; docs/operations.md describes the grammar. The rules are process-wide and
 * armed once at startup, before traffic flows. Each rule counts the events it matches
 * (frames of its type and direction, or allocations) and fires on the n-th of them, on
 * every k-th, or on each from the n-th on. When a rule fires it logs a warning line
 * beginning with "fault:" and its counter grows.
 *
 * Cost when off: the hooks in net/conn.c and in the allocation wrappers test one global
 * flag (ps__fault_active), a single predictable branch.
 *
 * Nodes: a rule may name a node (role, or role and rank, or node id) and then matches
 * only events on that node. A node knows itself once its registration with the
 * scheduler was answered (the scheduler once it received its first registration); the
 * connection layer sees both go by and tells this module (ps__fault_self_*). Identity is
 * kept per thread, since an event loop runs on one thread and several roles may share a
 * process (embedded mode, a colocated server); a thread that is no node's loop (a
 * worker's caller threads) takes the process's identity when the process holds exactly
 * one node. Until a node knows itself, rules that name a node match nothing there.
 *
 * This module is in common and knows nothing of the wire: frame types are plain bytes
 * (PS_FRAME_REPLY is the 0x80 bit), and roles use the numbers of proto/msg.h.
 *
 * Threads: ps__fault_frame and ps__fault_alloc may be called from any thread (counters
 * are atomic); arming and disarming must not race with them.
 */
#ifndef PS_FAULT_H
#define PS_FAULT_H

#include <stddef.h>
#include <stdint.h>

#define PS_FAULT_MAX_RULES 16
#define PS_FAULT_SPEC_MAX 1024
#define PS_FAULT_DELAY_MAX_MS 600000u

typedef enum {
  PS__FAULT_DROP = 1,
  PS__FAULT_DELAY = 2,
  PS__FAULT_DUP = 3,
  PS__FAULT_ALLOC = 4,
  PS__FAULT_SLOWDISK = 5 /* a checkpoint data file's write, or the scheduler's state
                          * file's, waits delay_ms */
} ps__fault_kind;

/* Directions of a frame as seen by the node: received or sent. */
enum { PS__FAULT_IN = 1, PS__FAULT_OUT = 2 };
/* Roles (the numbers of PS_ROLE_* in proto/msg.h). */
enum { PS__FAULT_SCHEDULER = 1, PS__FAULT_SERVER = 2, PS__FAULT_WORKER = 3 };
/* type of a rule that matches every frame type; node fields that match anything. */
#define PS__FAULT_ANY (-1)

typedef struct ps__fault_rule {
  ps__fault_kind kind;
  int type;           /* frame type byte (reply bit included) or PS__FAULT_ANY; for alloc:
                       * the type of the received frame being handled, or any allocation */
  unsigned dir;       /* PS__FAULT_IN or PS__FAULT_OUT (frame rules) */
  uint32_t delay_ms;  /* delay rules */
  int role;           /* PS__FAULT_ANY or a role */
  int64_t rank;       /* PS__FAULT_ANY or a rank within role */
  int64_t id;         /* PS__FAULT_ANY or a node id */
  uint64_t n;         /* the first event that fires (1-based) */
  uint64_t every;     /* then every this many events (0: only the n-th) */
  uint64_t seen;      /* events matched so far (atomic) */
  uint64_t fired;     /* times fired (atomic) */
  char text[96];      /* the rule as written, for log lines */
} ps__fault_rule;

typedef struct ps__fault_set {
  unsigned n;
  ps__fault_rule r[PS_FAULT_MAX_RULES];
} ps__fault_set;

/* Parse a spec into out (counters zero). 0, or -1 with a message in err (which rule and
 * what is wrong with it). An empty spec parses to no rules. Never reads past the string. */
int ps__fault_parse(const char *spec, ps__fault_set *out, char *err, size_t errlen);

/* Arm the rules of spec for this process (counters start at zero; allocations are
 * counted from now on), replacing any armed before; a spec equal to the one armed keeps
 * the counters. NULL or "" disarms. 0, or PS_ERR_CONFIG with a message (ps_errmsg) and
 * nothing changed. */
int ps__fault_arm(const char *spec);
/* Arm PSHARD_FAULT once per process, unless ps__fault_arm armed rules before (then the
 * configuration wins). Called by the connection layer before a node's first socket;
 * later calls return the first call's result. 0, or PS_ERR_CONFIG with a message. */
int ps__fault_arm_env(void);
/* Disarm and forget the identities learnt (tests). */
void ps__fault_disarm(void);

/* The hot-path flag: nonzero while any rule is armed. */
extern int ps__fault_active;
static inline int ps__fault_on(void) { return __builtin_expect(__atomic_load_n(&ps__fault_active, __ATOMIC_RELAXED), 0); }

/* What fired for one frame. */
typedef struct ps__fault_act {
  uint8_t drop, dup;
  uint32_t delay_ms; /* 0: not delayed */
} ps__fault_act;
/* Count a frame of `type` going in direction dir on the calling thread's node against
 * every armed frame rule; fill act with what fired (zero: nothing). Returns nonzero
 * when anything fired. */
int ps__fault_frame(unsigned dir, uint8_t type, ps__fault_act *act);
/* Count an allocation; nonzero: it must fail. */
int ps__fault_alloc(void);
/* Count a write to disk (one buffer of a checkpoint data file, or the scheduler's state
 * file), named `what` in the log line; the ms it must wait first (0: none). */
uint32_t ps__fault_disk(const char *what);
/* Sleep ms milliseconds (a slow disk's wait). */
void ps__fault_sleep_ms(uint32_t ms);

/* The calling thread handles a received frame of this type (for alloc rules with a
 * type) until ps__fault_scope_end(previous value). */
int ps__fault_scope_begin(uint8_t type);
void ps__fault_scope_end(int prev);

/* Identity of the calling thread's node: it sent a registration as `role`; its
 * registration was answered with rank and id; it received a registration (so it is the
 * scheduler). See the top of this file. */
void ps__fault_self_hello(int role);
void ps__fault_self_registered(uint32_t rank, uint32_t id);
void ps__fault_self_scheduler(void);
/* Set the calling thread's identity directly (role PS__FAULT_*, rank and id or -1). */
void ps__fault_self_set(int role, int64_t rank, int64_t id);
/* The calling thread's node as text ("server.0", "scheduler", "unknown"). */
void ps__fault_self_name(char *out, size_t n);

/* Times fired, by all rules; ps__fault_report writes "fault_fired N" and one
 * "fault_rule_I_fired N" line per rule (I from 1) into out and returns the length it
 * needed (as snprintf does). */
uint64_t ps__fault_fired_total(void);
size_t ps__fault_report(char *out, size_t n);
/* The rules armed now (tests; valid until the next arm or disarm). */
const ps__fault_set *ps__fault_rules(void);

/* Name of a frame type as rules write it ("push", "pull-reply"), NULL if unknown. */
const char *ps__fault_type_name(int type);

#endif
