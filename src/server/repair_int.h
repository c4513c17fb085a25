/*
 * repair_int.h - what the two sides of a repair share (repair.c: the replacement's side,
 * membership and ticks; repair_out.c: a tail streaming its rows to a replacement).
 * Everything here runs on the server's loop thread.
 */
#ifndef PS_SERVER_REPAIR_INT_H
#define PS_SERVER_REPAIR_INT_H

#include "server/server_int.h"

/* One table of a stream: its cut and which of its chains go to the replacement. */
typedef struct rp_table {
  ps__snap_table snap;
  int cut;            /* snap holds a cut */
  int sent_decl;      /* a frame of it went (a table with no rows still sends one) */
  uint8_t *sel;       /* per chain index: streamed */
  size_t nsel;
  uint32_t *cks;      /* a sync table: the chains streamed, and the rounds of each in the cut */
  int64_t *rounds;
  size_t nck;
  uint64_t next;      /* next row of the cut to read */
} rp_table;

/* A copy from this server to replacement `to`. */
typedef struct rp_out {
  struct rp_out *next;
  uint32_t to, stream;
  uint64_t cut_epoch; /* the epoch of the cut: sent in each frame's clock */
  rp_table *t;
  size_t nt, cur;
  uint8_t *done_body; /* SYNC_DONE's body, encoded at the cut */
  size_t done_len;
  uint8_t *frame;     /* the frame in flight (kept until answered), pooled-size independent */
  size_t flen;
  ps__frame_hdr fh;
  int inflight, done_sent;
  unsigned failures;
  uint64_t retry_at;
  uint64_t rows;
} rp_out;

/* A forward a replacement holds until its source's copy is in. */
typedef struct rp_held {
  struct rp_held *next;
  ps__frame_hdr h;
  void *buf; /* pooled */
  size_t len;
} rp_held;

typedef struct rp_src {
  uint32_t id;
  int done;
  int gone;           /* it left the job: its chains come from the new tails */
  uint32_t stream;    /* the stream being taken (0: none yet) */
  uint64_t cut_epoch; /* ... and the epoch of its cut */
  uint64_t min_epoch; /* streams cut before this epoch are stale (a death since) */
  rp_held *head, *tail;
  uint64_t rows, held;
} rp_src;

struct srv_repair {
  rp_out *outs;
  uint32_t next_stream;
  uint32_t *want;     /* replacements a stream must start to (a checkpoint's cut delayed it) */
  size_t nwant;
  uint32_t *served;   /* replacements whose stream from here is done */
  size_t nserved;
  uint32_t *live;     /* the live servers of the last membership: a death since restarts copies */
  size_t nlive;
  uint64_t streams_done, rows_out, restarts;
  /* as a replacement */
  int syncing;        /* the sources are known */
  rp_src *src;
  size_t nsrc;
  uint64_t held_bytes, rows_in, replayed;
  uint64_t replay_refused; /* held forwards refused when applied (answered when held) */
  uint64_t last_progress, synced_sent_at;
  int synced;         /* every source is done */
  ps__conn sink;      /* the replies of held forwards, applied later, go nowhere */
};

/* Add id to the set *v of *n server ids (small: a job's servers). 0 or PS_ERR_NOMEM. */
int ps__rp_ids_add(uint32_t **v, size_t *n, uint32_t id);

/* ---- the tail's streams (repair_out.c) */
/* Start the copy to replacement x (the cut, the chains, SYNC_DONE's body): 0,
 * PS_ERR_UNAVAILABLE (a checkpoint's cut is being read: later) or PS_ERR_NOMEM. */
int ps__rp_out_start(ps__server *s, uint32_t x);
/* Send stream o's next frame unless one is in flight or waits for its retry. */
void ps__rp_out_pump(ps__server *s, rp_out *o);
/* Take stream o off the server's list; free it (its cuts released). */
void ps__rp_out_unlink(ps__server *s, rp_out *o);
void ps__rp_out_free(ps__server *s, rp_out *o);

#endif
