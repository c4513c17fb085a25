/*
 * fault.c - fault injection: the spec parser, the armed rules and their decisions, and
 * what each thread's node knows of itself. See fault.h.
 *
 * The rules live in one static set, written only while arming (at startup, under
 * `mu`, with the active flag down) and read without a lock by the hooks; their counters
 * are updated atomically, so the n-th event is the n-th whatever thread saw it.
 */
#include "common/fault.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/common.h"

int ps__fault_active;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static ps__fault_set armed;
static char armed_spec[PS_FAULT_SPEC_MAX + 1];
static int armed_by_call; /* ps__fault_arm was called: PSHARD_FAULT is not read */
static int env_done, env_rc;
static char env_msg[320];
static uint64_t fired_total;

/* ------------------------------------------------------------------ frame type names */

/* The names of proto/frame.c (ps__frame_type_name); test_fault.c checks they agree. */
static const char *const type_names[] = {
    [1] = "hello",      [2] = "membership", [3] = "heartbeat",  [4] = "declare",   [5] = "create",
    [6] = "barrier",    [7] = "metric",     [8] = "leave",      [9] = "push",      [10] = "pull",
    [11] = "push-dense", [12] = "pull-dense", [13] = "clock",    [14] = "error",    [15] = "stats",
    [16] = "task-init", [17] = "task-next", [18] = "task-done", [19] = "ckpt",     [20] = "checkpoint",
    [21] = "forward",   [22] = "forward-dense", [23] = "stall",     [24] = "forward-agg", [25] = "forward-round",
    [26] = "replayed",     [27] = "node-metrics",
    [28] = "sync-rows",  [29] = "sync-done", [30] = "synced",
};
#define NTYPES (sizeof type_names / sizeof type_names[0])
#define REPLY_BIT 0x80

const char *ps__fault_type_name(int type) {
  static const char *const reply_names[NTYPES] = {
      [1] = "hello-reply",      [2] = "membership-reply", [3] = "heartbeat-reply", [4] = "declare-reply",
      [5] = "create-reply",     [6] = "barrier-reply",    [7] = "metric-reply",    [8] = "leave-reply",
      [9] = "push-reply",       [10] = "pull-reply",      [11] = "push-dense-reply", [12] = "pull-dense-reply",
      [13] = "clock-reply",     [14] = "error-reply",     [15] = "stats-reply",    [16] = "task-init-reply",
      [17] = "task-next-reply", [18] = "task-done-reply", [19] = "ckpt-reply",   [20] = "checkpoint-reply",
      [21] = "forward-reply",   [22] = "forward-dense-reply", [23] = "stall-reply", [24] = "forward-agg-reply",
      [25] = "forward-round-reply", [26] = "replayed-reply", [27] = "node-metrics-reply",
      [28] = "sync-rows-reply", [29] = "sync-done-reply", [30] = "synced-reply",
  };
  if (type == PS__FAULT_ANY) return "any";
  if (type < 0 || type > 0xff) return NULL;
  unsigned t = (unsigned)type & ~(unsigned)REPLY_BIT;
  if (t == 0 || t >= NTYPES) return NULL;
  return (type & REPLY_BIT) ? reply_names[t] : type_names[t];
}

/* ------------------------------------------------------------------ parsing */

typedef struct perr {
  char *buf;
  size_t len;
  unsigned rule;
  const char *text; /* the rule being parsed, printable copy */
} perr;

static int fail_at(perr *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail_at(perr *e, const char *fmt, ...) {
  char what[200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  if (e->rule) snprintf(e->buf, e->len, "fault rule %u '%s': %s", e->rule, e->text, what);
  else snprintf(e->buf, e->len, "bad fault spec: %s", what);
  return -1;
}

/* A printable copy of s[0..n) for messages (at most cap-1 bytes, '?' for others). */
static void printable(char *out, size_t cap, const char *s, size_t n) {
  size_t j = 0;
  for (size_t i = 0; i < n && j + 1 < cap; i++) out[j++] = isprint((unsigned char)s[i]) ? s[i] : '?';
  out[j] = '\0';
  if (n >= cap && cap > 4) memcpy(out + cap - 4, "...", 3); /* cut short: say so */
}

/* Case-insensitive compare of s[0..n) with a lowercase name, '_' taken as '-'. */
static int name_eq(const char *s, size_t n, const char *name) {
  size_t m = strlen(name);
  if (n != m) return 0;
  for (size_t i = 0; i < n; i++) {
    int c = tolower((unsigned char)s[i]);
    if (c == '_') c = '-';
    if (c != name[i]) return 0;
  }
  return 1;
}

/* An unsigned decimal of s[0..n) (digits only, no sign or blanks). 0 or -1. */
static int parse_num(const char *s, size_t n, uint64_t *out) {
  char tmp[24];
  if (n == 0 || n >= sizeof tmp) return -1;
  memcpy(tmp, s, n);
  tmp[n] = '\0';
  return ps__parse_u64(tmp, out);
}

static int parse_type(const char *v, size_t n, int *out) {
  if (name_eq(v, n, "any") || (n == 1 && v[0] == '*')) {
    *out = PS__FAULT_ANY;
    return 0;
  }
  for (int t = 1; t < (int)NTYPES; t++) {
    const char *nm = type_names[t];
    if (!nm) continue; /* an opcode never given (test_fault.c checks there is none) */
    size_t m = strlen(nm);
    if (name_eq(v, n, nm)) {
      *out = t;
      return 0;
    }
    if (n == m + 6 && name_eq(v, m, nm) && name_eq(v + m, 6, "-reply")) {
      *out = t | REPLY_BIT;
      return 0;
    }
  }
  return -1;
}

/* "200", "200ms", "2s": milliseconds in [1, PS_FAULT_DELAY_MAX_MS]. */
static int parse_duration(const char *v, size_t n, uint32_t *ms) {
  size_t d = 0;
  uint64_t x, mul = 1;
  while (d < n && v[d] >= '0' && v[d] <= '9') d++;
  if (d == 0 || parse_num(v, d, &x)) return -1;
  if (n - d == 2 && name_eq(v + d, 2, "ms")) mul = 1;
  else if (n - d == 1 && name_eq(v + d, 1, "s")) mul = 1000;
  else if (n != d) return -1;
  if (x == 0 || x > PS_FAULT_DELAY_MAX_MS / mul) return -1;
  *ms = (uint32_t)(x * mul);
  return 0;
}

static const char *const role_names[] = {[PS__FAULT_SCHEDULER] = "scheduler", [PS__FAULT_SERVER] = "server",
                                         [PS__FAULT_WORKER] = "worker"};

/* "server", "server.2", "worker.0", "scheduler", or a node id "7". */
static int parse_node(const char *v, size_t n, ps__fault_rule *r) {
  const char *dot = memchr(v, '.', n);
  size_t rn = dot ? (size_t)(dot - v) : n;
  uint64_t x;
  if (n > 0 && v[0] >= '0' && v[0] <= '9') {
    if (parse_num(v, n, &x) || x > UINT32_MAX) return -1;
    r->id = (int64_t)x;
    return 0;
  }
  for (int role = PS__FAULT_SCHEDULER; role <= PS__FAULT_WORKER; role++) {
    if (!name_eq(v, rn, role_names[role])) continue;
    r->role = role;
    if (!dot) return 0;
    if (role == PS__FAULT_SCHEDULER) return -1; /* there is one scheduler */
    if (parse_num(dot + 1, n - rn - 1, &x) || x > UINT32_MAX) return -1;
    r->rank = (int64_t)x;
    return 0;
  }
  return -1;
}

/* One rule, s[0..n) without surrounding blanks. */
static int parse_rule(const char *s, size_t n, ps__fault_rule *r, perr *e) {
  enum { HAVE_TYPE = 1, HAVE_N = 2, HAVE_EVERY = 4, HAVE_NODE = 8, HAVE_DIR = 16 };
  unsigned have = 0;
  uint64_t n_first = 1, every = 0;
  int from_on = 0;
  memset(r, 0, sizeof *r);
  r->type = PS__FAULT_ANY;
  r->role = PS__FAULT_ANY;
  r->rank = PS__FAULT_ANY;
  r->id = PS__FAULT_ANY;
  r->dir = PS__FAULT_IN;
  printable(r->text, sizeof r->text, s, n);
  size_t pos = 0;
  for (unsigned tok = 0; pos <= n; tok++) {
    const char *t = s + pos;
    const char *colon = memchr(t, ':', n - pos);
    size_t tn = colon ? (size_t)(colon - t) : n - pos;
    pos += tn + 1;
    if (tn == 0) return fail_at(e, "empty field (fields are separated by one ':')");
    const char *eq = memchr(t, '=', tn);
    size_t kn = eq ? (size_t)(eq - t) : tn;
    const char *v = eq ? eq + 1 : NULL;
    size_t vn = eq ? tn - kn - 1 : 0;
    if (eq && vn == 0) return fail_at(e, "'%.*s' has no value", (int)kn, t);
    if (tok == 0) {
      if (name_eq(t, kn, "drop") && !eq) r->kind = PS__FAULT_DROP;
      else if (name_eq(t, kn, "dup") && !eq) r->kind = PS__FAULT_DUP;
      else if (name_eq(t, kn, "alloc") && !eq) r->kind = PS__FAULT_ALLOC;
      else if (name_eq(t, kn, "delay") || name_eq(t, kn, "slowdisk")) {
        r->kind = name_eq(t, kn, "delay") ? PS__FAULT_DELAY : PS__FAULT_SLOWDISK;
        if (!eq) return fail_at(e, "%s needs a duration: %s=200ms", r->kind == PS__FAULT_DELAY ? "delay" : "slowdisk",
                                r->kind == PS__FAULT_DELAY ? "delay" : "slowdisk");
        if (parse_duration(v, vn, &r->delay_ms))
          return fail_at(e, "bad delay '%.*s' (1ms to %us: 200, 200ms or 2s)", (int)vn, v,
                         PS_FAULT_DELAY_MAX_MS / 1000);
      } else {
        return fail_at(e, "unknown kind '%.*s' (drop, delay=DURATION, dup, alloc or slowdisk=DURATION)",
                       (int)(kn > 32 ? 32 : kn), t);
      }
      continue;
    }
    if (!eq) return fail_at(e, "'%.*s' is not key=value", (int)(tn > 32 ? 32 : tn), t);
    unsigned bit;
    if (name_eq(t, kn, "type")) {
      bit = HAVE_TYPE;
      if (parse_type(v, vn, &r->type))
        return fail_at(e, "unknown frame type '%.*s' (push, pull, clock, ..., pull-reply, ... or any)",
                       (int)(vn > 32 ? 32 : vn), v);
    } else if (name_eq(t, kn, "n")) {
      bit = HAVE_N;
      from_on = vn > 1 && v[vn - 1] == '+';
      if (parse_num(v, vn - (size_t)from_on, &n_first) || n_first == 0)
        return fail_at(e, "bad count '%.*s' (n=N or n=N+ with N >= 1)", (int)(vn > 32 ? 32 : vn), v);
    } else if (name_eq(t, kn, "every")) {
      bit = HAVE_EVERY;
      if (parse_num(v, vn, &every) || every == 0)
        return fail_at(e, "bad period '%.*s' (every=K with K >= 1)", (int)(vn > 32 ? 32 : vn), v);
    } else if (name_eq(t, kn, "node")) {
      bit = HAVE_NODE;
      if (parse_node(v, vn, r))
        return fail_at(e, "bad node '%.*s' (scheduler, server, server.RANK, worker, worker.RANK or a node id)",
                       (int)(vn > 32 ? 32 : vn), v);
    } else if (name_eq(t, kn, "dir")) {
      bit = HAVE_DIR;
      if (name_eq(v, vn, "in")) r->dir = PS__FAULT_IN;
      else if (name_eq(v, vn, "out")) r->dir = PS__FAULT_OUT;
      else return fail_at(e, "bad direction '%.*s' (in or out)", (int)(vn > 32 ? 32 : vn), v);
    } else {
      return fail_at(e, "unknown key '%.*s' (type, n, every, node, dir)", (int)(kn > 32 ? 32 : kn), t);
    }
    if (have & bit) return fail_at(e, "'%.*s' given twice", (int)kn, t);
    have |= bit;
  }
  int frame = r->kind != PS__FAULT_ALLOC && r->kind != PS__FAULT_SLOWDISK;
  if (frame && !(have & HAVE_TYPE)) return fail_at(e, "a frame rule needs type=TYPE (type=any for every frame)");
  if (!frame && (have & HAVE_DIR)) return fail_at(e, "dir= is for frame rules, not alloc or slowdisk");
  if (r->kind == PS__FAULT_SLOWDISK && (have & HAVE_TYPE)) return fail_at(e, "type= is not for slowdisk");
  if (from_on && (have & HAVE_EVERY)) return fail_at(e, "n=N+ and every=K together (use n=N:every=1)");
  if ((have & HAVE_EVERY) && !(have & HAVE_N)) n_first = every;
  r->n = n_first;
  r->every = from_on ? 1 : every;
  return 0;
}

static int is_blank(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

int ps__fault_parse(const char *spec, ps__fault_set *out, char *err, size_t errlen) {
  char dummy[8];
  perr e = {err ? err : dummy, err ? errlen : sizeof dummy, 0, NULL};
  memset(out, 0, sizeof *out);
  if (!spec) return 0;
  size_t len = strnlen(spec, PS_FAULT_SPEC_MAX + 1);
  if (len > PS_FAULT_SPEC_MAX) return fail_at(&e, "longer than %u bytes", PS_FAULT_SPEC_MAX);
  size_t a = 0;
  while (a < len && is_blank(spec[a])) a++;
  if (a == len) return 0;
  for (unsigned i = 1; a <= len; i++) {
    size_t b = a;
    while (b < len && spec[b] != ';' && spec[b] != ',') b++;
    size_t s = a, t = b;
    while (s < t && is_blank(spec[s])) s++;
    while (t > s && is_blank(spec[t - 1])) t--;
    char shown[64];
    printable(shown, sizeof shown, spec + s, t - s);
    e.rule = i;
    e.text = shown;
    if (t == s) return fail_at(&e, "empty rule (rules are separated by ';' or ',')");
    if (out->n == PS_FAULT_MAX_RULES) return fail_at(&e, "more than %d rules", PS_FAULT_MAX_RULES);
    if (parse_rule(spec + s, t - s, &out->r[out->n], &e)) return -1;
    out->n++;
    a = b + 1;
  }
  return 0;
}

/* ------------------------------------------------------------------ arming */

/* Arm under mu. 0 or -1 with the parser's message in msg. */
static int arm_locked(const char *spec, char *msg, size_t msglen) {
  ps__fault_set s;
  const char *sp = spec ? spec : "";
  if (ps__fault_parse(sp, &s, msg, msglen)) return -1;
  if (__atomic_load_n(&ps__fault_active, __ATOMIC_RELAXED) && !strcmp(sp, armed_spec)) return 0;
  __atomic_store_n(&ps__fault_active, 0, __ATOMIC_SEQ_CST);
  armed = s;
  snprintf(armed_spec, sizeof armed_spec, "%s", sp);
  __atomic_store_n(&fired_total, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&ps__fault_active, s.n > 0, __ATOMIC_SEQ_CST);
  if (s.n) ps__log(PS_LOG_WARN, "fault injection armed: %s", armed_spec);
  return 0;
}

int ps__fault_arm(const char *spec) {
  char msg[256];
  pthread_mutex_lock(&mu);
  int rc = arm_locked(spec, msg, sizeof msg);
  if (rc == 0) armed_by_call = 1;
  pthread_mutex_unlock(&mu);
  return rc ? ps__fail(PS_ERR_CONFIG, "%s", msg) : 0;
}

int ps__fault_arm_env(void) {
  pthread_mutex_lock(&mu);
  if (!env_done) {
    env_done = 1;
    const char *v = getenv("PSHARD_FAULT");
    char msg[256];
    if (!armed_by_call && v && *v && arm_locked(v, msg, sizeof msg)) {
      env_rc = PS_ERR_CONFIG;
      snprintf(env_msg, sizeof env_msg, "PSHARD_FAULT: %s", msg);
    }
  }
  int rc = env_rc;
  pthread_mutex_unlock(&mu);
  return rc ? ps__fail(rc, "%s", env_msg) : 0;
}

/* ------------------------------------------------------------------ identity */

typedef struct ident {
  int known;
  int role;
  int64_t rank, id;
} ident;

static _Thread_local ident t_self;
static _Thread_local int t_pending_role;
static _Thread_local int t_scope = -1;
static ident p_self;   /* the process's node, when it holds one (p_count == 1) */
static int p_count;    /* 0 none, 1 one, 2 several */

void ps__fault_disarm(void) {
  pthread_mutex_lock(&mu);
  __atomic_store_n(&ps__fault_active, 0, __ATOMIC_SEQ_CST);
  memset(&armed, 0, sizeof armed);
  armed_spec[0] = '\0';
  armed_by_call = env_done = env_rc = 0;
  env_msg[0] = '\0';
  memset(&p_self, 0, sizeof p_self);
  p_count = 0;
  __atomic_store_n(&fired_total, 0, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&mu);
  memset(&t_self, 0, sizeof t_self);
  t_pending_role = 0;
  t_scope = -1;
}

void ps__fault_self_set(int role, int64_t rank, int64_t id) {
  ident me = {1, role, rank, id};
  if (t_self.known && t_self.role == role && t_self.rank == rank && t_self.id == id) return;
  t_self = me;
  pthread_mutex_lock(&mu);
  if (p_count == 0) {
    p_self = me;
    p_count = 1;
  } else if (p_self.role != role || p_self.rank != rank || p_self.id != id) {
    p_count = 2;
  }
  pthread_mutex_unlock(&mu);
}

void ps__fault_self_hello(int role) { t_pending_role = role; }

void ps__fault_self_registered(uint32_t rank, uint32_t id) {
  if (t_pending_role) ps__fault_self_set(t_pending_role, rank, id);
}

void ps__fault_self_scheduler(void) {
  if (!t_self.known) ps__fault_self_set(PS__FAULT_SCHEDULER, PS__FAULT_ANY, PS__FAULT_ANY);
}

static ident self_now(void) {
  ident me = t_self;
  if (!me.known) {
    pthread_mutex_lock(&mu);
    if (p_count == 1) me = p_self;
    pthread_mutex_unlock(&mu);
  }
  return me;
}

static void name_of(const ident *me, char *out, size_t n) {
  if (!me->known) snprintf(out, n, "unknown node");
  else if (me->rank == PS__FAULT_ANY) snprintf(out, n, "%s", role_names[me->role]);
  else snprintf(out, n, "%s.%lld", role_names[me->role], (long long)me->rank);
}

void ps__fault_self_name(char *out, size_t n) {
  ident me = self_now();
  name_of(&me, out, n);
}

static int names_node(const ps__fault_rule *r) { return r->role != PS__FAULT_ANY || r->id != PS__FAULT_ANY; }

/* Does rule r apply on node me (loaded lazily into *me, *loaded)? */
static int node_match(const ps__fault_rule *r, ident *me, int *loaded) {
  if (!names_node(r)) return 1;
  if (!*loaded) {
    *me = self_now();
    *loaded = 1;
  }
  if (!me->known) return 0;
  if (r->role != PS__FAULT_ANY && r->role != me->role) return 0;
  if (r->rank != PS__FAULT_ANY && r->rank != me->rank) return 0;
  if (r->id != PS__FAULT_ANY && r->id != me->id) return 0;
  return 1;
}

/* ------------------------------------------------------------------ decisions */

/* Count one event for r; nonzero if this one fires. */
static int count_fires(ps__fault_rule *r, uint64_t *nth) {
  uint64_t i = __atomic_add_fetch(&r->seen, 1, __ATOMIC_RELAXED);
  *nth = i;
  if (i < r->n) return 0;
  if (r->every ? (i - r->n) % r->every != 0 : i != r->n) return 0;
  __atomic_add_fetch(&r->fired, 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&fired_total, 1, __ATOMIC_RELAXED);
  return 1;
}

int ps__fault_frame(unsigned dir, uint8_t type, ps__fault_act *act) {
  ident me;
  int loaded = 0, any = 0;
  memset(act, 0, sizeof *act);
  for (unsigned k = 0; k < armed.n; k++) {
    ps__fault_rule *r = &armed.r[k];
    uint64_t nth;
    if (r->kind == PS__FAULT_ALLOC || r->kind == PS__FAULT_SLOWDISK || r->dir != dir) continue;
    if (r->type != PS__FAULT_ANY && r->type != type) continue;
    if (!node_match(r, &me, &loaded) || !count_fires(r, &nth)) continue;
    any = 1;
    char who[48];
    if (!loaded) {
      me = self_now();
      loaded = 1;
    }
    name_of(&me, who, sizeof who);
    const char *tn = ps__fault_type_name(type);
    const char *way = dir == PS__FAULT_IN ? "received" : "sent";
    switch (r->kind) {
    case PS__FAULT_DROP:
      act->drop = 1;
      ps__log(PS_LOG_WARN, "fault: dropped %s %s frame #%llu on %s (rule %u: %s)", way, tn ? tn : "unknown",
              (unsigned long long)nth, who, k + 1, r->text);
      break;
    case PS__FAULT_DUP:
      act->dup = 1;
      ps__log(PS_LOG_WARN, "fault: duplicated %s %s frame #%llu on %s (rule %u: %s)", way, tn ? tn : "unknown",
              (unsigned long long)nth, who, k + 1, r->text);
      break;
    case PS__FAULT_DELAY:
      if (r->delay_ms > act->delay_ms) act->delay_ms = r->delay_ms;
      ps__log(PS_LOG_WARN, "fault: delayed %s %s frame #%llu by %u ms on %s (rule %u: %s)", way,
              tn ? tn : "unknown", (unsigned long long)nth, r->delay_ms, who, k + 1, r->text);
      break;
    default: break;
    }
  }
  return any;
}

int ps__fault_alloc(void) {
  ident me;
  int loaded = 0, fail = 0;
  for (unsigned k = 0; k < armed.n; k++) {
    ps__fault_rule *r = &armed.r[k];
    uint64_t nth;
    if (r->kind != PS__FAULT_ALLOC) continue;
    if (r->type != PS__FAULT_ANY && r->type != t_scope) continue;
    if (!node_match(r, &me, &loaded) || !count_fires(r, &nth)) continue;
    fail = 1;
    char who[48];
    if (!loaded) {
      me = self_now();
      loaded = 1;
    }
    name_of(&me, who, sizeof who);
    const char *tn = t_scope >= 0 ? ps__fault_type_name(t_scope) : NULL;
    ps__log(PS_LOG_WARN, "fault: failed allocation #%llu on %s%s%s (rule %u: %s)", (unsigned long long)nth, who,
            tn ? " while handling a received " : "", tn ? tn : "", k + 1, r->text);
  }
  return fail;
}

void ps__fault_sleep_ms(uint32_t ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  while (ms && nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

uint32_t ps__fault_disk(const char *what) {
  ident me;
  int loaded = 0;
  uint32_t ms = 0;
  for (unsigned k = 0; k < armed.n; k++) {
    ps__fault_rule *r = &armed.r[k];
    uint64_t nth;
    if (r->kind != PS__FAULT_SLOWDISK) continue;
    if (!node_match(r, &me, &loaded) || !count_fires(r, &nth)) continue;
    if (r->delay_ms > ms) ms = r->delay_ms;
    char who[48];
    if (!loaded) {
      me = self_now();
      loaded = 1;
    }
    name_of(&me, who, sizeof who);
    ps__log(PS_LOG_WARN, "fault: %s #%llu on %s waits %u ms (rule %u: %s)", what, (unsigned long long)nth, who,
            r->delay_ms, k + 1, r->text);
  }
  return ms;
}

int ps__fault_scope_begin(uint8_t type) {
  int prev = t_scope;
  t_scope = type;
  return prev;
}

void ps__fault_scope_end(int prev) { t_scope = prev; }

/* ------------------------------------------------------------------ counters */

uint64_t ps__fault_fired_total(void) { return __atomic_load_n(&fired_total, __ATOMIC_RELAXED); }

size_t ps__fault_report(char *out, size_t n) {
  size_t len = 0;
  char dummy[1];
  if (!out || n == 0) {
    out = dummy;
    n = sizeof dummy;
  }
  out[0] = '\0';
  int w = snprintf(out, n, "fault_fired %llu\n", (unsigned long long)ps__fault_fired_total());
  len += w > 0 ? (size_t)w : 0;
  for (unsigned k = 0; k < armed.n; k++) {
    w = snprintf(len < n ? out + len : dummy, len < n ? n - len : sizeof dummy, "fault_rule_%u_fired %llu\n", k + 1,
                 (unsigned long long)__atomic_load_n(&armed.r[k].fired, __ATOMIC_RELAXED));
    len += w > 0 ? (size_t)w : 0;
  }
  return len;
}

const ps__fault_set *ps__fault_rules(void) { return &armed; }
