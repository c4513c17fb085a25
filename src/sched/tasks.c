/*
 * tasks.c - the scheduler's data-partition tasks (ps_tasks_init, ps_task_next,
 * ps_task_done): P partitions handed out one at a time for each of E epochs, the
 * workers that wait for one when every partition of the epoch is out, and a dead
 * worker's partitions put back. An epoch ends when all P are done. The state
 * (ps__sched_tasks, sched_int.h) is saved in checkpoints and the scheduler's state file
 * (ckpt.c, state.c). Everything here runs on the scheduler's loop thread.
 */
#include <string.h>

#include "sched/sched_int.h"

typedef ps__sched_node node;
typedef ps__task_waiter task_waiter;
typedef ps__sched_tasks tasks;
enum { TASK_PENDING = PS__TASK_PENDING, TASK_ASSIGNED = PS__TASK_ASSIGNED, TASK_DONE = PS__TASK_DONE };

static void task_reply(ps__conn *c, uint64_t req_id, int status, uint32_t part, uint32_t epoch) {
  ps__frame_hdr h = {.type = PS_MSG_TASK_NEXT | PS_FRAME_REPLY, .req_id = req_id, .status = status,
                     .table = part, .clock = epoch};
  ps__conn_send_ctrl(c, &h, NULL, 0);
}

/* Give node a partition: 0 with *part (taken: saved before it is answered), PS_ERR_DONE
 * past the last epoch, or 1 when it must wait. */
static int task_take(ps__sched *s, uint32_t node_id, uint32_t *part) {
  tasks *t = &s->tk;
  if (t->epoch >= t->epochs) return PS_ERR_DONE;
  for (uint32_t p = 0; p < t->parts; p++) {
    if (t->state[p] != TASK_PENDING) continue;
    t->state[p] = TASK_ASSIGNED;
    t->owner[p] = node_id;
    t->handed++;
    *part = p;
    return 0;
  }
  return 1;
}

/* Serve waiting workers after partitions came back or an epoch ended: what they take is
 * saved once, then answered. */
static void task_serve_waiters(ps__sched *s) {
  task_waiter *served = NULL, **tail = &served, **pp = &s->tk.waiters;
  int taken = 0;
  while (*pp) {
    task_waiter *w = *pp;
    int rc = task_take(s, w->node, &w->part);
    if (rc == 1) {
      pp = &w->next;
      continue;
    }
    taken |= rc == 0;
    w->status = rc;
    *pp = w->next;
    w->next = NULL;
    *tail = w;
    tail = &w->next;
  }
  if (taken) ps__sched_state_save(s);
  while (served) {
    task_waiter *w = served;
    served = w->next;
    task_reply(w->conn, w->req_id, w->status, w->status ? 0 : w->part, s->tk.epoch);
    free(w);
  }
}

void ps__sched_task_drop_waiters(ps__sched *s, ps__conn *c, int expired_only) {
  uint64_t now = ps__now_ms();
  task_waiter **pp = &s->tk.waiters;
  while (*pp) {
    task_waiter *w = *pp;
    if ((c && w->conn == c) || (expired_only && now >= w->deadline_ms)) {
      if (expired_only) task_reply(w->conn, w->req_id, PS_ERR_TIMEOUT, 0, s->tk.epoch);
      *pp = w->next;
      free(w);
    } else {
      pp = &w->next;
    }
  }
}

void ps__sched_on_task_init(ps__sched *s, ps__conn *c, const ps__frame_hdr *h) {
  tasks *t = &s->tk;
  uint32_t parts = h->table, epochs = h->batch;
  if (parts == 0 || epochs == 0 || parts > (1u << 24)) {
    ps__conn_send_error(c, h, PS_ERR_INVALID, "tasks need 1..16777216 partitions and at least one epoch");
    return;
  }
  if (t->init) {
    if (t->parts != parts || t->epochs != epochs) {
      char msg[160];
      snprintf(msg, sizeof msg, "tasks already declared with %u partitions and %u epochs", t->parts, t->epochs);
      ps__conn_send_error(c, h, PS_ERR_CONFLICT, msg);
      return;
    }
  } else {
    t->state = ps__calloc(parts, 1);
    t->owner = ps__calloc(parts, sizeof *t->owner);
    if (!t->state || !t->owner) {
      free(t->state);
      free(t->owner);
      t->state = NULL;
      t->owner = NULL;
      ps__conn_send_error(c, h, PS_ERR_NOMEM, "scheduler out of memory");
      return;
    }
    t->init = 1;
    t->parts = parts;
    t->epochs = epochs;
    ps__sched_ckpt_tasks_restore(s);
    ps__sched_state_save(s);
  }
  ps__frame_hdr r = {.type = PS_MSG_TASK_INIT | PS_FRAME_REPLY, .req_id = h->req_id};
  ps__conn_send_ctrl(c, &r, NULL, 0);
}

void ps__sched_on_task_next(ps__sched *s, node *n, ps__conn *c, const ps__frame_hdr *h) {
  tasks *t = &s->tk;
  if (!t->init) {
    ps__conn_send_error(c, h, PS_ERR_INVALID, "no tasks declared (call ps_tasks_init first)");
    return;
  }
  uint32_t part = 0;
  int rc = task_take(s, n->m.id, &part);
  if (rc != 1) {
    if (rc == 0) ps__sched_state_save(s); /* kept before it is handed out */
    task_reply(c, h->req_id, rc, part, t->epoch);
    return;
  }
  /* Everything of this epoch is handed out: wait up to the caller's timeout (ms in batch). */
  if (h->batch == 0) {
    task_reply(c, h->req_id, PS_ERR_TIMEOUT, 0, t->epoch);
    return;
  }
  task_waiter *w = ps__malloc(sizeof *w);
  if (!w) {
    ps__conn_send_error(c, h, PS_ERR_NOMEM, "scheduler out of memory");
    return;
  }
  w->conn = c;
  w->node = n->m.id;
  w->req_id = h->req_id;
  w->deadline_ms = ps__now_ms() + h->batch;
  w->next = t->waiters;
  t->waiters = w;
}

void ps__sched_on_task_done(ps__sched *s, node *n, ps__conn *c, const ps__frame_hdr *h) {
  tasks *t = &s->tk;
  uint32_t p = h->table;
  if (!t->init || p >= t->parts || (uint64_t)h->clock != t->epoch || t->state[p] != TASK_ASSIGNED ||
      t->owner[p] != n->m.id) {
    char msg[160];
    snprintf(msg, sizeof msg, "partition %u of epoch %lld is not assigned to this worker", p, (long long)h->clock);
    ps__conn_send_error(c, h, PS_ERR_INVALID, msg);
    return;
  }
  t->state[p] = TASK_DONE;
  t->ndone++;
  t->completed++;
  int next_epoch = t->ndone == t->parts;
  if (next_epoch) {
    ps__log(PS_LOG_INFO, "epoch %u finished (%u partitions)", t->epoch, t->parts);
    t->epoch++;
    t->ndone = 0;
    memset(t->state, TASK_PENDING, t->parts);
  }
  ps__sched_state_save(s); /* kept before it is answered */
  ps__frame_hdr r = {.type = PS_MSG_TASK_DONE | PS_FRAME_REPLY, .req_id = h->req_id};
  ps__conn_send_ctrl(c, &r, NULL, 0);
  if (next_epoch) task_serve_waiters(s);
}

/* A dead worker's unfinished partitions go back to the queue. */
void ps__sched_task_requeue(ps__sched *s, uint32_t node_id) {
  tasks *t = &s->tk;
  int any = 0;
  for (uint32_t p = 0; t->init && p < t->parts; p++) {
    if (t->state[p] == TASK_ASSIGNED && t->owner[p] == node_id) {
      t->state[p] = TASK_PENDING;
      t->requeued++;
      any = 1;
    }
  }
  if (any) task_serve_waiters(s);
}
