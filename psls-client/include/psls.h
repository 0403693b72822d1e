/* PSLS client library: map parallel files as sequentially consistent shared memory across a
 * cluster, with barriers and locks. Link with libpsls_client.a (plus -lpthread -ldl -lm) or
 * libpsls_client.so. Run programs with `psls run -n N -- ./prog`.
 *
 * Every function returns 0 (or a value >= 0) on success and a negative PSLS_E* code on
 * failure; psls_strerror describes a code and psls_last_error gives the calling thread's last
 * failure message (valid until its next failure).
 *
 * If the node daemon dies, or a fault on mapped memory cannot be served (e.g. the page was
 * lost with a failed node), the process is ended with a message on stderr (exit status 70). */
#ifndef PSLS_H
#define PSLS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PSLS_EINIT      (-1)  /* psls_init not called or failed */
#define PSLS_EINVAL     (-2)  /* invalid argument (size, name, count, lock not held, ...) */
#define PSLS_ENOENT     (-3)  /* no such parallel file */
#define PSLS_EEXIST     (-4)  /* already exists */
#define PSLS_EPERM      (-5)  /* the caller may not read or write the file */
#define PSLS_ENOSPC     (-6)  /* no space left */
#define PSLS_EUNAVAIL   (-7)  /* daemon or cluster unavailable (or a rank left a barrier) */
#define PSLS_EIO        (-8)  /* I/O error */
#define PSLS_EINTERNAL  (-9)  /* internal error */
#define PSLS_ECONNECT   (-10) /* cannot connect to the node daemon */
#define PSLS_ENOTMAPPED (-11) /* not a PSLS mapping (e.g. unmapped twice) */

/* Connects to the local node daemon (PSLS_SOCKET, set by `psls run`). Idempotent. */
int psls_init(void);
/* Unmaps what is still mapped. */
int psls_finalize(void);
/* This process's rank in its job, and the number of ranks. */
int psls_rank(void);
int psls_size(void);
/* Maps `size` bytes of parallel file `name`, creating it with that size if `create` is
 * non-zero and it does not exist; the address goes to *addr (page-aligned). */
int psls_map(const char *name, size_t size, int create, void **addr);
/* Maps `size` bytes of the existing parallel file `name` for reading only (read permission
 * suffices); it sees every write made in the cluster; a store to it is a segmentation fault. */
int psls_map_ro(const char *name, size_t size, const void **addr);
/* Unmaps a mapping of psls_map or psls_map_ro. */
int psls_unmap(const void *addr);
/* The safe-point call: every rank calls it at the same point of its main loop with its
 * private state (at most 1 MiB). Once all have, the coordinator decides for all: a checkpoint
 * of the job's files and states (the job's --checkpoint-interval elapsed, or `psls checkpoint`
 * / `psls halt` asked) at the job's --level: in the nodes' memories, or persistent on the
 * mirrored disks (auto: memory, and persistent now and then), or nothing. Returns the
 * checkpoint's epoch, 0 when none was taken, or a negative error. After `psls halt` (which
 * asks for a persistent one) the job's ranks are stopped. */
int psls_checkpoint(const void *state, size_t len);
/* Whether this rank restarted from a checkpoint: 1 with the state it saved copied to `buf`
 * and its length in *len; 0 on a fresh start; negative on error (PSLS_EINVAL when `cap` is
 * too small, *len then being the size needed). */
int psls_restarted(void *buf, size_t cap, size_t *len);
/* Makes the process's writes to the parallel files it maps writable durable: a persistent
 * checkpoint of them, on both disk copies, before it returns (the last psls_unmap of a
 * writable mapping does the same for its file). */
int psls_sync(void);
/* Waits until every rank of the job has called psls_barrier. */
int psls_barrier(void);
/* Waits until `count` ranks have called the barrier `name` (a name of more than about 8000
 * bytes is PSLS_EINVAL). */
int psls_barrier_named(const char *name, uint32_t count);
/* Locks are per job, identified by a number; unlocking a lock not held is an error. */
int psls_lock(uint64_t id);
int psls_unlock(uint64_t id);
const char *psls_strerror(int err);
const char *psls_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* PSLS_H */
