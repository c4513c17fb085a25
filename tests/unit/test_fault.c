/*
 * test_fault.c - fault injection (common/fault.c and its hooks in net/conn.c).
 *
 * The parser: what each rule means, that every malformed spec is an error with a
 * message (never a crash or a silent default), including random and truncated specs.
 * The decisions: which event of a rule fires (n, n+, every), that direction, type and
 * node filter what is counted, how a node learns who it is, and the allocation rules
 * (counted from arming on, optionally only while a frame type is handled). The hooks:
 * two connections on one loop joined by a socketpair, where a rule drops, delays or
 * duplicates a frame sent or received, and the frames around it keep their order.
 * Every loop is bounded by a deadline.
 */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "common/common.h"
#include "agent/agent.h"
#include "common/fault.h"
#include "net/conn_int.h"
#include "net/net.h"
#include "proto/frame.h"
#include "proto/msg.h"
#include "pshard.h"

#define OK(call)                                                                                    \
  do {                                                                                              \
    int rc_ = (call);                                                                               \
    cr_assert(eq(int, rc_, 0), "%s -> %s: %s", #call, ps_err_name(rc_), ps_errmsg());               \
  } while (0)

static void disarm(void) { ps__fault_disarm(); }

static const ps__fault_rule *parse1(const char *spec, ps__fault_set *s) {
  char err[256] = "";
  int rc = ps__fault_parse(spec, s, err, sizeof err);
  cr_assert(eq(int, rc, 0), "'%s' should parse: %s", spec, err);
  cr_assert(ge(int, (int)s->n, 1));
  return &s->r[0];
}

/* ---------------------------------------------------------------- parser */

Test(fault_parse, the_rules_of_the_documentation) {
  ps__fault_set s;
  const ps__fault_rule *r = parse1("drop:type=PUSH:n=3:node=server.0", &s);
  cr_expect(eq(int, r->kind, PS__FAULT_DROP));
  cr_expect(eq(int, r->type, PS_MSG_PUSH));
  cr_expect(eq(u64, r->n, 3));
  cr_expect(eq(u64, r->every, 0));
  cr_expect(eq(int, r->role, PS__FAULT_SERVER));
  cr_expect(eq(i64, r->rank, 0));
  cr_expect(eq(i64, r->id, PS__FAULT_ANY));
  cr_expect(eq(int, (int)r->dir, PS__FAULT_IN));

  r = parse1("delay=200ms:type=PULL:n=1", &s);
  cr_expect(eq(int, r->kind, PS__FAULT_DELAY));
  cr_expect(eq(u32, r->delay_ms, 200));
  cr_expect(eq(int, r->type, PS_MSG_PULL));
  cr_expect(eq(int, r->role, PS__FAULT_ANY));

  r = parse1("dup:type=CLOCK:n=2", &s);
  cr_expect(eq(int, r->kind, PS__FAULT_DUP));
  cr_expect(eq(int, r->type, PS_MSG_CLOCK));
  cr_expect(eq(u64, r->n, 2));

  r = parse1("alloc:n=500", &s);
  cr_expect(eq(int, r->kind, PS__FAULT_ALLOC));
  cr_expect(eq(int, r->type, PS__FAULT_ANY));
  cr_expect(eq(u64, r->n, 500));
}

Test(fault_parse, counts_types_nodes_directions_durations) {
  ps__fault_set s;
  const ps__fault_rule *r = parse1("drop:type=push-dense:n=4+", &s);
  cr_expect(eq(int, r->type, PS_MSG_PUSH_DENSE));
  cr_expect(eq(u64, r->n, 4));
  cr_expect(eq(u64, r->every, 1));
  r = parse1("dup:type=pull_dense_REPLY:every=3", &s);
  cr_expect(eq(int, r->type, PS_MSG_PULL_DENSE | PS_FRAME_REPLY));
  cr_expect(eq(u64, r->n, 3));
  cr_expect(eq(u64, r->every, 3));
  r = parse1("dup:type=any:n=2:every=5:dir=out:node=worker", &s);
  cr_expect(eq(int, r->type, PS__FAULT_ANY));
  cr_expect(eq(u64, r->n, 2));
  cr_expect(eq(u64, r->every, 5));
  cr_expect(eq(int, (int)r->dir, PS__FAULT_OUT));
  cr_expect(eq(int, r->role, PS__FAULT_WORKER));
  cr_expect(eq(i64, r->rank, PS__FAULT_ANY));
  r = parse1("delay=2s:type=*:node=7", &s);
  cr_expect(eq(u32, r->delay_ms, 2000));
  cr_expect(eq(int, r->type, PS__FAULT_ANY));
  cr_expect(eq(i64, r->id, 7));
  cr_expect(eq(int, r->role, PS__FAULT_ANY));
  r = parse1("delay=15:type=hello-reply:node=scheduler", &s);
  cr_expect(eq(u32, r->delay_ms, 15));
  cr_expect(eq(int, r->type, PS_MSG_HELLO | PS_FRAME_REPLY));
  cr_expect(eq(int, r->role, PS__FAULT_SCHEDULER));
  r = parse1("alloc:type=push:n=1:node=server.12", &s);
  cr_expect(eq(int, r->type, PS_MSG_PUSH));
  cr_expect(eq(i64, r->rank, 12));
}

Test(fault_parse, several_rules_and_blanks) {
  ps__fault_set s;
  parse1(" drop:type=push:n=3 ; delay=10ms:type=pull,dup:type=clock:n=2;alloc:n=9 ", &s);
  cr_assert(eq(u32, s.n, 4));
  cr_expect(eq(int, s.r[0].kind, PS__FAULT_DROP));
  cr_expect(eq(int, s.r[1].kind, PS__FAULT_DELAY));
  cr_expect(eq(int, s.r[2].kind, PS__FAULT_DUP));
  cr_expect(eq(int, s.r[3].kind, PS__FAULT_ALLOC));
  cr_expect(eq(str, s.r[1].text, "delay=10ms:type=pull"));
  char err[64];
  cr_expect(eq(int, ps__fault_parse("", &s, err, sizeof err), 0));
  cr_expect(eq(u32, s.n, 0));
  cr_expect(eq(int, ps__fault_parse("  ", &s, err, sizeof err), 0));
  cr_expect(eq(u32, s.n, 0));
}

Test(fault_parse, errors_say_what_is_wrong) {
  static const struct {
    const char *spec, *says;
  } bad[] = {
      {"drop", "needs type="},
      {"dup:n=2", "needs type="},
      {"explode:type=push", "unknown kind"},
      {"drop:type=pussh", "unknown frame type"},
      {"drop:type=push-replyy", "unknown frame type"},
      {"drop:type=push:n=0", "bad count"},
      {"drop:type=push:n=-1", "bad count"},
      {"drop:type=push:n=+", "bad count"},
      {"drop:type=push:n=3x", "bad count"},
      {"drop:type=push:n=99999999999999999999999", "bad count"},
      {"drop:type=push:every=0", "bad period"},
      {"drop:type=push:n=2+:every=3", "together"},
      {"drop:type=push:node=server.x", "bad node"},
      {"drop:type=push:node=scheduler.0", "bad node"},
      {"drop:type=push:node=router", "bad node"},
      {"drop:type=push:node=server.", "bad node"},
      {"drop:type=push:dir=sideways", "bad direction"},
      {"drop:type=push:type=pull", "given twice"},
      {"drop:type=push:n=1:n=2", "given twice"},
      {"drop:type=push:colour=red", "unknown key"},
      {"drop:type=push:n", "not key=value"},
      {"drop:type=", "has no value"},
      {"drop:type=push:", "empty field"},
      {"drop::type=push", "empty field"},
      {"delay:type=push", "needs a duration"},
      {"delay=0ms:type=push", "bad delay"},
      {"delay=10h:type=push", "bad delay"},
      {"delay=601s:type=push", "bad delay"},
      {"delay=ms:type=push", "bad delay"},
      {"drop=3:type=push", "unknown kind"},
      {"alloc:n=1:dir=out", "not alloc"},
      {"slowdisk", "needs a duration"},
      {"slowdisk=5ms:type=push", "not for slowdisk"},
      {"slowdisk=5ms:dir=in", "not alloc or slowdisk"},
      {"drop:type=push;", "empty rule"},
      {";drop:type=push", "empty rule"},
      {"drop:type=push;;alloc", "empty rule"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ps__fault_set s;
    char err[256] = "";
    int rc = ps__fault_parse(bad[i].spec, &s, err, sizeof err);
    cr_expect(eq(int, rc, -1), "'%s' must be refused", bad[i].spec);
    cr_expect(strstr(err, bad[i].says) != NULL, "'%s': message '%s' should say '%s'", bad[i].spec, err, bad[i].says);
    cr_expect(strstr(err, "fault rule") != NULL, "'%s': message '%s' names no rule", bad[i].spec, err);
  }
  /* Which rule is wrong. */
  ps__fault_set s;
  char err[256];
  cr_expect(eq(int, ps__fault_parse("drop:type=push;dup:type=nope", &s, err, sizeof err), -1));
  cr_expect(strstr(err, "fault rule 2 'dup:type=nope'") != NULL, "%s", err);
}

Test(fault_parse, limits) {
  ps__fault_set s;
  char err[256], spec[PS_FAULT_SPEC_MAX + 64];
  size_t n = 0;
  for (int i = 0; i < PS_FAULT_MAX_RULES + 1; i++) n += (size_t)snprintf(spec + n, sizeof spec - n, "alloc:n=%d;", i + 1);
  spec[n - 1] = '\0';
  cr_expect(eq(int, ps__fault_parse(spec, &s, err, sizeof err), -1));
  cr_expect(strstr(err, "more than") != NULL, "%s", err);
  memset(spec, 'a', sizeof spec - 1);
  spec[sizeof spec - 1] = '\0';
  cr_expect(eq(int, ps__fault_parse(spec, &s, err, sizeof err), -1));
  cr_expect(strstr(err, "longer than") != NULL, "%s", err);
  /* A NULL or tiny message buffer is fine. */
  cr_expect(eq(int, ps__fault_parse("drop", &s, NULL, 0), -1));
  cr_expect(eq(int, ps__fault_parse("drop", &s, err, 1), -1));
  cr_expect(eq(int, ps__fault_parse(NULL, &s, err, sizeof err), 0));
}

/* The parser's frame type names are those of the wire layer. */
Test(fault_parse, type_names_agree_with_the_codec) {
  for (int t = 1; t < PS_MSG__MAX; t++) {
    char spec[80];
    ps__fault_set s;
    cr_assert(not(eq(ptr, (void *)ps__fault_type_name(t), NULL)), "type %d has no name", t);
    cr_expect(eq(str, (char *)ps__fault_type_name(t), (char *)ps__frame_type_name((uint8_t)t)));
    snprintf(spec, sizeof spec, "drop:type=%s-reply", ps__frame_type_name((uint8_t)t));
    cr_expect(eq(int, parse1(spec, &s)->type, t | PS_FRAME_REPLY));
  }
  cr_expect(eq(ptr, (void *)ps__fault_type_name(PS_MSG__MAX), NULL));
  cr_expect(eq(ptr, (void *)ps__fault_type_name(0), NULL));
}

/* Random and truncated specs: an answer (0 or -1 with a message), never a crash or a
 * read past the string (ASan runs this too). */
Test(fault_parse, fuzz_random_and_truncated) {
  static const char *const frags[] = {"drop", "dup", "delay=", "alloc", ":", ";", ",", "=", "type=", "push", "PULL",
                                      "-reply", "n=", "3", "+", "every=", "node=", "server", ".", "worker", "scheduler",
                                      "dir=", "in", "out", "ms", "s", "200", "0", "*", "any", " ", "\xff", "99999999999999999999"};
  static const char *const good[] = {"drop:type=PUSH:n=3:node=server.0", "delay=200ms:type=PULL:n=1",
                                     "dup:type=CLOCK:n=2", "alloc:n=500",
                                     "drop:type=pull-dense-reply:n=2+:dir=out;alloc:type=push:every=7:node=worker.3"};
  uint64_t x = 12345;
  ps__fault_set s;
  char err[256];
  for (int it = 0; it < 20000; it++) {
    char spec[256];
    size_t n = 0;
    x = ps__mix64(x);
    int parts = (int)(x % 12) + 1;
    for (int p = 0; p < parts; p++) {
      x = ps__mix64(x);
      const char *f = frags[x % (sizeof frags / sizeof frags[0])];
      size_t fl = strlen(f);
      if (n + fl + 1 >= sizeof spec) break;
      memcpy(spec + n, f, fl);
      n += fl;
    }
    if (x % 7 == 0 && n > 0) spec[(x >> 8) % n] = (char)(x >> 16); /* a random byte */
    spec[n] = '\0';
    err[0] = '\0';
    int rc = ps__fault_parse(spec, &s, err, sizeof err);
    cr_assert(rc == 0 || rc == -1);
    if (rc) cr_assert(err[0] != '\0', "no message for '%s'", spec);
    else cr_assert(le(u32, s.n, PS_FAULT_MAX_RULES));
  }
  for (size_t g = 0; g < sizeof good / sizeof good[0]; g++) {
    size_t len = strlen(good[g]);
    for (size_t cut = 0; cut <= len; cut++) {
      char *p = malloc(cut + 1); /* exactly the prefix: ASan sees any overread */
      cr_assert(p != NULL);
      memcpy(p, good[g], cut);
      p[cut] = '\0';
      int rc = ps__fault_parse(p, &s, err, sizeof err);
      cr_assert(rc == 0 || rc == -1);
      if (rc) cr_assert(err[0] != '\0');
      free(p);
    }
    cr_expect(eq(int, ps__fault_parse(good[g], &s, err, sizeof err), 0), "%s: %s", good[g], err);
  }
}

/* ---------------------------------------------------------------- decisions */

static int fires(unsigned dir, uint8_t type) {
  ps__fault_act a;
  return ps__fault_frame(dir, type, &a);
}

Test(fault_decide, nth_from_nth_on_every_kth, .fini = disarm) {
  OK(ps__fault_arm("drop:type=push:n=3;drop:type=pull:n=2+;drop:type=clock:every=3;drop:type=stats:n=2:every=4"));
  cr_expect(ps__fault_on());
  char seq[4][13];
  for (int i = 0; i < 12; i++) {
    seq[0][i] = fires(PS__FAULT_IN, PS_MSG_PUSH) ? 'x' : '.';
    seq[1][i] = fires(PS__FAULT_IN, PS_MSG_PULL) ? 'x' : '.';
    seq[2][i] = fires(PS__FAULT_IN, PS_MSG_CLOCK) ? 'x' : '.';
    seq[3][i] = fires(PS__FAULT_IN, PS_MSG_STATS) ? 'x' : '.';
  }
  for (int k = 0; k < 4; k++) seq[k][12] = '\0';
  cr_expect(eq(str, seq[0], "..x........."));
  cr_expect(eq(str, seq[1], ".xxxxxxxxxxx"));
  cr_expect(eq(str, seq[2], "..x..x..x..x"));
  cr_expect(eq(str, seq[3], ".x...x...x.."));
  cr_expect(eq(u64, ps__fault_fired_total(), 1 + 11 + 4 + 3));
  char rep[256];
  ps__fault_report(rep, sizeof rep);
  cr_expect(strstr(rep, "fault_fired 19\n") && strstr(rep, "fault_rule_2_fired 11\n"), "%s", rep);
}

Test(fault_decide, slow_disk_rules_count_checkpoint_writes, .fini = disarm) {
  OK(ps__fault_arm("slowdisk=40ms:n=2;slowdisk=70ms:n=3+;drop:type=push"));
  cr_expect(eq(u32, ps__fault_disk("checkpoint write"), 0));
  cr_expect(eq(u32, ps__fault_disk("checkpoint write"), 40));
  cr_expect(eq(u32, ps__fault_disk("checkpoint write"), 70), "the longer wait of two rules");
  cr_expect(eq(u32, ps__fault_disk("checkpoint write"), 70));
  cr_expect(not(fires(PS__FAULT_IN, PS_MSG_PULL)), "frame rules do not see disk writes");
  cr_expect(eq(u64, ps__fault_fired_total(), 3));
}

Test(fault_decide, direction_and_type_filter_what_is_counted, .fini = disarm) {
  OK(ps__fault_arm("delay=50ms:type=pull-reply:n=2:dir=out;dup:type=push:n=2"));
  ps__fault_act a;
  cr_expect(eq(int, ps__fault_frame(PS__FAULT_IN, PS_MSG_PULL | PS_FRAME_REPLY, &a), 0));  /* other direction */
  cr_expect(eq(int, ps__fault_frame(PS__FAULT_OUT, PS_MSG_PULL, &a), 0));                   /* request, not reply */
  cr_expect(eq(int, ps__fault_frame(PS__FAULT_OUT, PS_MSG_PULL | PS_FRAME_REPLY, &a), 0));  /* #1 */
  cr_expect(ps__fault_frame(PS__FAULT_OUT, PS_MSG_PULL | PS_FRAME_REPLY, &a));       /* #2 */
  cr_expect(eq(u32, a.delay_ms, 50));
  cr_expect(eq(int, a.drop | a.dup, 0));
  cr_expect(eq(int, ps__fault_frame(PS__FAULT_OUT, PS_MSG_PUSH, &a), 0));                   /* out: not counted */
  cr_expect(eq(int, ps__fault_frame(PS__FAULT_IN, PS_MSG_PUSH, &a), 0));
  cr_expect(ps__fault_frame(PS__FAULT_IN, PS_MSG_PUSH, &a));
  cr_expect(a.dup && !(a.drop) && a.delay_ms == 0);
  cr_expect(eq(u64, ps__fault_rules()->r[0].seen, 2));
  cr_expect(eq(u64, ps__fault_rules()->r[1].seen, 2));
}

Test(fault_decide, several_rules_on_one_frame_combine, .fini = disarm) {
  OK(ps__fault_arm("delay=30ms:type=any:n=1;delay=80ms:type=clock:n=1;dup:type=clock:n=1"));
  ps__fault_act a;
  cr_expect(ps__fault_frame(PS__FAULT_IN, PS_MSG_CLOCK, &a));
  cr_expect(eq(u32, a.delay_ms, 80));
  cr_expect(a.dup);
}

Test(fault_decide, arming_replaces_and_a_bad_spec_changes_nothing, .fini = disarm) {
  OK(ps__fault_arm("drop:type=push:n=2"));
  cr_expect(eq(int, fires(PS__FAULT_IN, PS_MSG_PUSH), 0));
  OK(ps__fault_arm("drop:type=push:n=2")); /* the same spec: counters kept */
  cr_expect(fires(PS__FAULT_IN, PS_MSG_PUSH));
  cr_expect(eq(int, ps__fault_arm("drop:type=push:n=zero"), PS_ERR_CONFIG));
  cr_expect(strstr(ps_errmsg(), "bad count") != NULL, "%s", ps_errmsg());
  cr_expect(ps__fault_on());
  cr_expect(eq(u64, ps__fault_rules()->r[0].seen, 2));
  OK(ps__fault_arm("drop:type=pull:n=1"));
  cr_expect(eq(int, fires(PS__FAULT_IN, PS_MSG_PUSH), 0));
  cr_expect(fires(PS__FAULT_IN, PS_MSG_PULL));
  OK(ps__fault_arm(""));
  cr_expect(eq(int, ps__fault_on(), 0));
  OK(ps__fault_arm(NULL));
  cr_expect(eq(int, ps__fault_on(), 0));
}

/* PSHARD_FAULT is read once, and only if the configuration armed nothing. */
Test(fault_decide, environment, .fini = disarm) {
  setenv("PSHARD_FAULT", "drop:type=push:n=1:node=sever", 1);
  cr_expect(eq(int, ps__fault_arm_env(), PS_ERR_CONFIG));
  cr_expect(strstr(ps_errmsg(), "PSHARD_FAULT: fault rule 1") && strstr(ps_errmsg(), "bad node"), "%s", ps_errmsg());
  cr_expect(eq(int, ps__fault_arm_env(), PS_ERR_CONFIG)); /* the same answer every time */
  cr_expect(eq(int, ps__fault_on(), 0));
  ps__fault_disarm();
  setenv("PSHARD_FAULT", "drop:type=push:n=1", 1);
  OK(ps__fault_arm_env());
  cr_expect(ps__fault_on());
  cr_expect(fires(PS__FAULT_IN, PS_MSG_PUSH));
  ps__fault_disarm();
  OK(ps__fault_arm("dup:type=clock"));
  OK(ps__fault_arm_env()); /* the configuration wins */
  cr_expect(eq(int, ps__fault_rules()->r[0].kind, PS__FAULT_DUP));
  unsetenv("PSHARD_FAULT");
}

Test(fault_decide, configuration_key, .fini = disarm) {
  ps_config *cfg;
  OK(ps_config_new(&cfg));
  cr_expect(eq(int, ps_config_set(cfg, "fault", "drop:type=push:n=3:node=server.0;alloc:n=500"), 0));
  cr_expect(eq(str, (char *)ps_config_get(cfg, "fault"), "drop:type=push:n=3:node=server.0;alloc:n=500"));
  cr_expect(eq(int, ps_config_set(cfg, "fault", "drop:tpye=push"), PS_ERR_CONFIG));
  cr_expect(strstr(ps_errmsg(), "unknown key 'tpye'") != NULL, "%s", ps_errmsg());
  setenv("PSHARD_FAULT", "delay=5s5:type=pull", 1);
  cr_expect(eq(int, ps_config_from_env(cfg), PS_ERR_CONFIG));
  cr_expect(strstr(ps_errmsg(), "PSHARD_FAULT") && strstr(ps_errmsg(), "bad delay"), "%s", ps_errmsg());
  setenv("PSHARD_FAULT", "delay=5s:type=pull", 1);
  OK(ps_config_from_env(cfg));
  cr_expect(eq(str, (char *)ps_config_get(cfg, "fault"), "delay=5s:type=pull"));
  unsetenv("PSHARD_FAULT");
  OK(ps__fault_arm(ps_config_get(cfg, "fault")));
  cr_expect(eq(u32, ps__fault_rules()->r[0].delay_ms, 5000));
  ps_config_free(cfg);
}

/* ---------------------------------------------------------------- nodes */

Test(fault_node, a_rule_naming_a_node_waits_until_the_node_knows_itself, .fini = disarm) {
  OK(ps__fault_arm("drop:type=push:n=2:node=server.1"));
  char name[32];
  ps__fault_self_name(name, sizeof name);
  cr_expect(eq(str, name, "unknown node"));
  /* Before registration: not matched, not counted. */
  for (int i = 0; i < 5; i++) cr_expect(eq(int, fires(PS__FAULT_IN, PS_MSG_PUSH), 0));
  cr_expect(eq(u64, ps__fault_rules()->r[0].seen, 0));
  /* Registering as server: the hello goes out, the answer gives rank 1, id 4. */
  ps__fault_self_hello(PS__FAULT_SERVER);
  ps__fault_self_registered(1, 4);
  ps__fault_self_name(name, sizeof name);
  cr_expect(eq(str, name, "server.1"));
  cr_expect(eq(int, fires(PS__FAULT_IN, PS_MSG_PUSH), 0));
  cr_expect(fires(PS__FAULT_IN, PS_MSG_PUSH));
  cr_expect(eq(int, fires(PS__FAULT_IN, PS_MSG_PUSH), 0));
}

Test(fault_node, role_rank_and_id, .fini = disarm) {
  OK(ps__fault_arm("drop:type=push:n=1+:node=worker.0;drop:type=pull:n=1+:node=server;"
                   "drop:type=clock:n=1+:node=9;drop:type=stats:n=1+:node=scheduler"));
  ps__fault_self_set(PS__FAULT_SERVER, 3, 9);
  cr_expect(eq(int, fires(PS__FAULT_IN, PS_MSG_PUSH), 0));
  cr_expect(fires(PS__FAULT_IN, PS_MSG_PULL));
  cr_expect(fires(PS__FAULT_IN, PS_MSG_CLOCK));
  cr_expect(eq(int, fires(PS__FAULT_IN, PS_MSG_STATS), 0));
  ps__fault_self_set(PS__FAULT_WORKER, 0, 2);
  cr_expect(fires(PS__FAULT_IN, PS_MSG_PUSH));
  cr_expect(eq(int, fires(PS__FAULT_IN, PS_MSG_PULL), 0));
  cr_expect(eq(int, fires(PS__FAULT_IN, PS_MSG_CLOCK), 0));
  ps__fault_disarm();
  OK(ps__fault_arm("drop:type=stats:n=1+:node=scheduler"));
  ps__fault_self_scheduler(); /* it received a registration */
  cr_expect(fires(PS__FAULT_IN, PS_MSG_STATS));
  /* A registration answer without a hello sent first changes nothing. */
  ps__fault_self_registered(5, 5);
  char name[32];
  ps__fault_self_name(name, sizeof name);
  cr_expect(eq(str, name, "scheduler"));
}

typedef struct thread_arg {
  int set_role;  /* 0: leave this thread unknown */
  int64_t rank;
  int fired;
  char name[32];
} thread_arg;

static void *other_thread(void *p) {
  thread_arg *a = p;
  if (a->set_role) ps__fault_self_set(a->set_role, a->rank, a->rank + 1);
  a->fired = fires(PS__FAULT_IN, PS_MSG_PUSH);
  ps__fault_self_name(a->name, sizeof a->name);
  return NULL;
}

static void run_thread(thread_arg *a) {
  pthread_t t;
  cr_assert(eq(int, pthread_create(&t, NULL, other_thread, a), 0));
  cr_assert(eq(int, pthread_join(t, NULL), 0));
}

/* Identity is per thread (one loop each); a thread that is no node's loop takes the
 * process's node while the process holds exactly one. */
Test(fault_node, threads_and_the_process, .fini = disarm) {
  OK(ps__fault_arm("drop:type=push:n=1+:node=worker.0"));
  thread_arg a = {0};
  run_thread(&a);
  cr_expect(eq(int, a.fired, 0));
  cr_expect(eq(str, a.name, "unknown node"));
  thread_arg w = {PS__FAULT_WORKER, 0, 0, ""};
  run_thread(&w); /* the worker's loop thread */
  cr_expect(w.fired);
  memset(&a, 0, sizeof a);
  run_thread(&a); /* a caller thread of that worker */
  cr_expect(a.fired);
  cr_expect(eq(str, a.name, "worker.0"));
  thread_arg s = {PS__FAULT_SERVER, 0, 0, ""};
  run_thread(&s); /* a colocated server: two nodes in the process now */
  cr_expect(eq(int, s.fired, 0));
  memset(&a, 0, sizeof a);
  run_thread(&a);
  cr_expect(eq(int, a.fired, 0));
  cr_expect(eq(str, a.name, "unknown node"));
}

/* ---------------------------------------------------------------- allocations */

Test(fault_alloc, the_nth_allocation_after_arming_fails, .fini = disarm) {
  void *before = ps__malloc(16); /* before arming: not counted */
  cr_assert(before != NULL);
  OK(ps__fault_arm("alloc:n=3"));
  void *a = ps__malloc(8), *b = ps__calloc(2, 8), *c = ps__realloc(NULL, 8), *d = ps__strdup("x");
  cr_expect(a != NULL);
  cr_expect(b != NULL);
  cr_expect(eq(ptr, c, NULL));
  cr_expect(d != NULL);
  free(a);
  free(b);
  free(d);
  free(before);
  ps__fault_disarm();
  OK(ps__fault_arm("alloc:n=2:every=2"));
  int got[6];
  for (int i = 0; i < 6; i++) {
    void *p = ps__malloc(4);
    got[i] = p != NULL;
    free(p);
  }
  cr_expect(got[0] && !got[1] && got[2] && !got[3] && got[4] && !got[5]);
}

Test(fault_alloc, only_while_a_frame_type_is_handled, .fini = disarm) {
  OK(ps__fault_arm("alloc:type=push:n=2"));
  void *p = ps__malloc(4); /* outside any frame: not counted */
  cr_expect(p != NULL);
  free(p);
  int prev = ps__fault_scope_begin(PS_MSG_PULL);
  p = ps__malloc(4);
  cr_expect(p != NULL);
  free(p);
  int inner = ps__fault_scope_begin(PS_MSG_PUSH);
  p = ps__malloc(4);
  cr_expect(p != NULL);
  free(p);
  p = ps__malloc(4);
  cr_expect(eq(ptr, p, NULL));
  ps__fault_scope_end(inner);
  ps__fault_scope_end(prev);
  cr_expect(eq(u64, ps__fault_rules()->r[0].seen, 2));
}

/* ---------------------------------------------------------------- log lines */

static char logged[16][256];
static int nlogged;
static void capture(int level, const char *msg, void *arg) {
  (void)level, (void)arg;
  if (nlogged < 16) snprintf(logged[nlogged++], sizeof logged[0], "%s", msg);
}

Test(fault_log, a_fired_fault_is_logged, .fini = disarm) {
  nlogged = 0;
  ps_set_log(capture, NULL, PS_LOG_WARN);
  OK(ps__fault_arm("drop:type=push:n=2:node=server.0;alloc:n=1:type=pull"));
  ps__fault_self_set(PS__FAULT_SERVER, 0, 1);
  fires(PS__FAULT_IN, PS_MSG_PUSH);
  fires(PS__FAULT_IN, PS_MSG_PUSH);
  int prev = ps__fault_scope_begin(PS_MSG_PULL);
  cr_expect(eq(ptr, ps__malloc(1), NULL));
  ps__fault_scope_end(prev);
  ps_set_log(NULL, NULL, 0);
  cr_assert(eq(int, nlogged, 3), "%d lines", nlogged);
  cr_expect(strstr(logged[0], "fault injection armed") != NULL, "%s", logged[0]);
  cr_expect(eq(str, logged[1], "fault: dropped received push frame #2 on server.0 (rule 1: drop:type=push:n=2:node=server.0)"));
  cr_expect(eq(str, logged[2],
               "fault: failed allocation #1 on server.0 while handling a received pull (rule 2: alloc:n=1:type=pull)"));
}

/* ---------------------------------------------------------------- hooks in conn.c */

/* Two connections on one loop, joined by a socketpair: tx sends, rx records. */
typedef struct got_frame {
  uint8_t type;
  int64_t clock;
  uint64_t at_ms;
  char body[32];
  size_t len;
} got_frame;

typedef struct pair {
  uv_loop_t loop;
  ps__pool *pool;
  ps__conn *tx, *rx;
  got_frame got[64];
  int ngot;
  int sent_ok, sent_err, last_err;
  int closed, tx_closed, rx_closed;
  int alloc_failed_in_frame;
  int produced;
  char bodies[64][16];
} pair;

static int rx_header(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  (void)c, (void)h, (void)b;
  return 0;
}

static void rx_frame(ps__conn *c, const ps__frame_hdr *h, ps__body *b) {
  pair *p = c->udata;
  if (p->ngot == 64) return;
  got_frame *g = &p->got[p->ngot++];
  g->type = h->type;
  g->clock = h->clock;
  g->at_ms = ps__now_ms();
  g->len = b->len < sizeof g->body - 1 ? b->len : sizeof g->body - 1;
  if (b->buf) memcpy(g->body, b->buf, g->len);
  g->body[g->len] = '\0';
  void *m = ps__malloc(64); /* an allocation while handling the frame */
  if (!m) p->alloc_failed_in_frame++;
  free(m);
}

static void pair_closed(ps__conn *c, int status) {
  pair *p = c->udata;
  (void)status;
  p->closed++;
  if (c == p->tx) p->tx_closed = 1;
  else p->rx_closed = 1;
}

static const ps__conn_ops pair_ops = {rx_header, rx_frame, pair_closed};

static ps__conn *wrap(pair *p, int fd) {
  ps__conn *c = ps__conn_alloc(&p->loop, &pair_ops, p, p->pool, 1u << 24);
  cr_assert(c != NULL);
  cr_assert(eq(int, uv_pipe_init(&p->loop, &c->h.pipe, 0), 0));
  cr_assert(eq(int, uv_pipe_open(&c->h.pipe, fd), 0));
  c->is_unix = 1;
  OK(ps__conn_start(c));
  return c;
}

static void pair_open(pair *p) {
  int fds[2];
  memset(p, 0, sizeof *p);
  cr_assert(eq(int, uv_loop_init(&p->loop), 0));
  cr_assert(eq(int, socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0));
  p->pool = ps__pool_new(16u << 20);
  cr_assert(p->pool != NULL);
  p->tx = wrap(p, fds[0]);
  p->rx = wrap(p, fds[1]);
}

/* Run the loop until rx got `want` frames or timeout_ms passed. */
static void pair_run(pair *p, int want, uint64_t timeout_ms) {
  uint64_t end = ps__now_ms() + timeout_ms;
  while (p->ngot < want && ps__now_ms() < end) {
    uv_run(&p->loop, UV_RUN_NOWAIT);
    usleep(200);
  }
  uv_run(&p->loop, UV_RUN_NOWAIT);
}

static void pair_close(pair *p) {
  ps__conn_close(p->tx, 0);
  ps__conn_close(p->rx, 0);
  uv_run(&p->loop, UV_RUN_DEFAULT);
  cr_assert(eq(int, p->closed, 2));
  cr_assert(eq(int, uv_loop_close(&p->loop), 0), "a handle is left on the loop");
  ps__pool_free(p->pool);
}

static void on_sent(void *arg, int status) {
  pair *p = arg;
  if (status == 0) p->sent_ok++;
  else {
    p->sent_err++;
    p->last_err = status;
  }
}

/* Send a clock frame whose clock is seq and whose body is "f<seq>" (borrowed from
 * the pair until the send completes). */
static void send_seq(pair *p, int64_t seq) {
  char *body = p->bodies[seq % 64];
  int n = snprintf(body, sizeof p->bodies[0], "f%lld", (long long)seq);
  ps__frame_hdr h = {.type = PS_MSG_CLOCK, .clock = seq};
  uv_buf_t b = uv_buf_init(body, (unsigned)n);
  OK(ps__conn_send(p->tx, &h, &b, 1, on_sent, p));
}

static void send_ctrl_seq(pair *p, int64_t seq) {
  char body[16];
  int n = snprintf(body, sizeof body, "f%lld", (long long)seq);
  ps__frame_hdr h = {.type = PS_MSG_CLOCK, .clock = seq};
  OK(ps__conn_send_ctrl(p->tx, &h, body, (size_t)n));
}

static void order_is(pair *p, const char *want) {
  char seq[128];
  size_t n = 0;
  for (int i = 0; i < p->ngot && n + 8 < sizeof seq; i++) {
    n += (size_t)snprintf(seq + n, sizeof seq - n, "%s%lld", i ? "," : "", (long long)p->got[i].clock);
    char expect[16];
    snprintf(expect, sizeof expect, "f%lld", (long long)p->got[i].clock);
    cr_expect(eq(str, p->got[i].body, expect), "frame %d carries '%s'", i, p->got[i].body);
  }
  seq[n] = '\0';
  cr_expect(eq(str, seq, (char *)want));
}

Test(fault_conn, nothing_armed_nothing_changes, .fini = disarm) {
  pair p;
  pair_open(&p);
  for (int i = 1; i <= 3; i++) send_ctrl_seq(&p, i);
  pair_run(&p, 3, 2000);
  order_is(&p, "1,2,3");
  cr_expect(eq(ptr, p.tx->fq, NULL));
  cr_expect(eq(ptr, p.rx->fq, NULL));
  pair_close(&p);
}

Test(fault_conn, drop_a_sent_frame, .fini = disarm) {
  OK(ps__fault_arm("drop:type=clock:n=2:dir=out"));
  pair p;
  pair_open(&p);
  for (int i = 1; i <= 4; i++) send_seq(&p, i);
  pair_run(&p, 3, 2000);
  pair_run(&p, 4, 100); /* nothing more comes */
  order_is(&p, "1,3,4");
  cr_expect(eq(int, p.sent_ok, 4), "every send completes, the dropped one too");
  cr_expect(eq(u64, p.tx->frames_out, 3));
  pair_close(&p);
}

Test(fault_conn, delay_a_sent_frame_and_keep_the_order, .fini = disarm) {
  OK(ps__fault_arm("delay=150ms:type=clock:n=2:dir=out"));
  pair p;
  pair_open(&p);
  uint64_t t0 = ps__now_ms();
  for (int i = 1; i <= 4; i++) send_seq(&p, i);
  pair_run(&p, 1, 2000);
  cr_expect(eq(int, p.ngot, 1));
  cr_expect(lt(u64, p.got[0].at_ms - t0, 100));
  cr_expect(ps__conn_pause(p.tx) < 0, "a connection with held frames is not lent");
  pair_run(&p, 4, 3000);
  order_is(&p, "1,2,3,4");
  cr_expect(ge(u64, p.got[1].at_ms - t0, 150), "the delayed frame came after %llu ms",
            (unsigned long long)(p.got[1].at_ms - t0));
  cr_expect(eq(int, p.sent_ok, 4));
  cr_expect(eq(u64, p.tx->write_queue_bytes, 0));
  pair_close(&p);
}

static size_t produce_all(void *arg) {
  pair *p = arg;
  p->produced++;
  return 4 * 4; /* everything final */
}

/* A frame sent with ps__conn_send_produced is finished (produce called) and copied
 * before the call returns, then goes out after the delay. */
Test(fault_conn, delay_a_produced_frame, .fini = disarm) {
  OK(ps__fault_arm("delay=100ms:type=pull-reply:dir=out"));
  pair p;
  pair_open(&p);
  float v[4] = {1, 2, 3, 4};
  uv_buf_t b = uv_buf_init((char *)v, sizeof v);
  ps__frame_hdr h = {.type = PS_MSG_PULL | PS_FRAME_REPLY, .req_id = 1, .clock = 5};
  uint64_t t0 = ps__now_ms();
  OK(ps__conn_send_produced(p.tx, &h, &b, 1, 4, produce_all, &p));
  cr_expect(ge(int, p.produced, 1));
  memset(v, 0xee, sizeof v); /* the frame carries what it was at the call */
  send_ctrl_seq(&p, 6);
  pair_run(&p, 2, 3000);
  cr_assert(eq(int, p.ngot, 2), "got %d frames, the first of type %d (%s)", p.ngot, p.got[0].type, p.got[0].body);
  cr_expect(eq(u8, p.got[0].type, PS_MSG_PULL | PS_FRAME_REPLY));
  cr_expect(ge(u64, p.got[0].at_ms - t0, 100));
  float got[4];
  memcpy(got, p.got[0].body, sizeof got);
  cr_expect(got[0] == 1 && got[3] == 4);
  cr_expect(eq(i64, p.got[1].clock, 6));
  pair_close(&p);
}

Test(fault_conn, duplicate_a_sent_frame, .fini = disarm) {
  OK(ps__fault_arm("dup:type=clock:n=1:dir=out"));
  pair p;
  pair_open(&p);
  for (int i = 1; i <= 2; i++) send_ctrl_seq(&p, i);
  pair_run(&p, 3, 2000);
  order_is(&p, "1,1,2");
  pair_close(&p);
}

Test(fault_conn, drop_a_received_frame, .fini = disarm) {
  OK(ps__fault_arm("drop:type=clock:n=2"));
  pair p;
  pair_open(&p);
  for (int i = 1; i <= 3; i++) send_ctrl_seq(&p, i);
  pair_run(&p, 2, 2000);
  pair_run(&p, 3, 100);
  order_is(&p, "1,3");
  cr_expect(eq(u64, p.rx->frames_in, 3), "the dropped frame was read");
  pair_close(&p);
}

Test(fault_conn, delay_a_received_frame_and_keep_the_order, .fini = disarm) {
  OK(ps__fault_arm("delay=150ms:type=clock:n=1"));
  pair p;
  pair_open(&p);
  uint64_t t0 = ps__now_ms();
  for (int i = 1; i <= 3; i++) send_ctrl_seq(&p, i);
  pair_run(&p, 1, 80);
  cr_expect(eq(int, p.ngot, 0), "frames behind the delayed one wait too");
  pair_run(&p, 3, 3000);
  order_is(&p, "1,2,3");
  cr_expect(ge(u64, p.got[0].at_ms - t0, 150));
  cr_expect(ge(u64, p.got[2].at_ms, p.got[0].at_ms));
  /* Reading resumed: a later frame comes at once. */
  uint64_t t1 = ps__now_ms();
  send_ctrl_seq(&p, 4);
  pair_run(&p, 4, 2000);
  order_is(&p, "1,2,3,4");
  cr_expect(lt(u64, p.got[3].at_ms - t1, 100));
  pair_close(&p);
}

Test(fault_conn, duplicate_a_received_frame, .fini = disarm) {
  OK(ps__fault_arm("dup:type=clock:n=2"));
  pair p;
  pair_open(&p);
  for (int i = 1; i <= 3; i++) send_ctrl_seq(&p, i);
  pair_run(&p, 4, 2000);
  order_is(&p, "1,2,2,3");
  pair_close(&p);
}

Test(fault_conn, allocation_while_handling_a_type, .fini = disarm) {
  OK(ps__fault_arm("alloc:type=clock:n=2"));
  pair p;
  pair_open(&p);
  for (int i = 1; i <= 3; i++) send_ctrl_seq(&p, i);
  pair_run(&p, 3, 2000);
  order_is(&p, "1,2,3");
  cr_expect(eq(int, p.alloc_failed_in_frame, 1));
  pair_close(&p);
}

/* Closing with frames held: their callbacks say canceled, nothing leaks (ASan), the
 * loop is left without handles. */
Test(fault_conn, close_with_held_frames, .fini = disarm) {
  OK(ps__fault_arm("delay=5s:type=clock:n=1:dir=out;delay=5s:type=clock:n=1"));
  pair p;
  pair_open(&p);
  send_seq(&p, 1);
  send_seq(&p, 2);
  pair_run(&p, 1, 50);
  cr_expect(eq(int, p.ngot, 0));
  pair_close(&p);
  cr_expect(eq(int, p.sent_err, 2));
  cr_expect(eq(int, p.last_err, PS_ERR_CANCELED));
}

/* Close after flush waits for the held frames, then closes. */
Test(fault_conn, close_after_flush_sends_the_held_frames, .fini = disarm) {
  OK(ps__fault_arm("delay=100ms:type=clock:n=1:dir=out"));
  pair p;
  pair_open(&p);
  send_ctrl_seq(&p, 1);
  send_ctrl_seq(&p, 2);
  ps__conn_close_after_flush(p.tx, 0);
  pair_run(&p, 1, 50);
  cr_expect(eq(int, p.tx_closed, 0), "tx waits for its held frame");
  pair_run(&p, 2, 3000);
  order_is(&p, "1,2");
  uint64_t end = ps__now_ms() + 2000;
  while (!p.tx_closed && ps__now_ms() < end) {
    uv_run(&p.loop, UV_RUN_NOWAIT);
    usleep(200);
  }
  cr_expect(eq(int, p.tx_closed, 1), "tx closed after its frames went");
  if (!p.rx_closed) ps__conn_close(p.rx, 0); /* else it saw the end of the stream */
  uv_run(&p.loop, UV_RUN_DEFAULT);
  cr_expect(eq(int, p.closed, 2));
  cr_expect(eq(int, uv_loop_close(&p.loop), 0));
  ps__pool_free(p.pool);
}

/* A connection closing after its flush, with fault state, then a loop-wide walk that
 * closes every handle (as a context's shutdown does): the walk skips the closing
 * connection, so the fault timers must have been closed with it, or their state leaks.
 * Everything closes, the state is freed and the loop is left without handles. */
Test(fault_conn, close_after_flush_then_a_loop_walk_leaves_nothing, .fini = disarm) {
  OK(ps__fault_arm("delay=10ms:type=clock:n=1:dir=out"));
  pair p;
  pair_open(&p);
  send_ctrl_seq(&p, 1);
  pair_run(&p, 1, 3000);
  order_is(&p, "1");
  cr_expect(eq(sz, ps__conn_fault_states(), 1));
  ps__conn_close_after_flush(p.tx, 0);
  ps__loop_close_all(&p.loop);
  uv_run(&p.loop, UV_RUN_DEFAULT);
  cr_expect(eq(int, p.closed, 2));
  cr_expect(eq(sz, ps__conn_fault_states(), 0), "the fault state outlived its connection");
  cr_expect(eq(int, uv_loop_close(&p.loop), 0), "a handle is left on the loop");
  ps__pool_free(p.pool);
}
