/*
 * mailbox.c - post work to a loop from other threads: a locked queue and one
 * uv_async_t wake-up. ps__mailbox_post is the only function callable off-loop.
 */
#include <pthread.h>

#include "common/common.h"
#include "net/net.h"

typedef struct mail {
  struct mail *next;
  ps__mail_fn fn;
  void *arg;
} mail;

struct ps__mailbox {
  uv_async_t async;
  pthread_mutex_t mu;
  mail *head, *tail;
  int closed;
};

static void drain(uv_async_t *a) {
  ps__mailbox *m = a->data;
  for (;;) {
    pthread_mutex_lock(&m->mu);
    mail *list = m->head;
    m->head = m->tail = NULL;
    pthread_mutex_unlock(&m->mu);
    if (!list) break;
    while (list) {
      mail *next = list->next;
      list->fn(list->arg);
      free(list);
      list = next;
    }
  }
}

ps__mailbox *ps__mailbox_new(uv_loop_t *loop) {
  ps__mailbox *m = ps__calloc(1, sizeof *m);
  if (!m) return NULL;
  pthread_mutex_init(&m->mu, NULL);
  if (uv_async_init(loop, &m->async, drain) != 0) {
    free(m);
    return NULL;
  }
  m->async.data = m;
  return m;
}

int ps__mailbox_post(ps__mailbox *m, ps__mail_fn fn, void *arg) {
  mail *x = ps__malloc(sizeof *x);
  if (!x) return PS_ERR_NOMEM;
  x->fn = fn;
  x->arg = arg;
  x->next = NULL;
  pthread_mutex_lock(&m->mu);
  if (m->closed) {
    pthread_mutex_unlock(&m->mu);
    free(x);
    return PS_ERR_CLOSED;
  }
  if (m->tail)
    m->tail->next = x;
  else
    m->head = x;
  m->tail = x;
  pthread_mutex_unlock(&m->mu);
  uv_async_send(&m->async);
  return 0;
}

static void mailbox_closed(uv_handle_t *h) {
  ps__mailbox *m = h->data;
  pthread_mutex_destroy(&m->mu);
  free(m);
}

void ps__mailbox_close(ps__mailbox *m) {
  if (!m) return;
  pthread_mutex_lock(&m->mu);
  m->closed = 1;
  pthread_mutex_unlock(&m->mu);
  drain(&m->async);
  uv_close((uv_handle_t *)&m->async, mailbox_closed);
}
