/* Example: N ranks each add 1 to a shared counter M times under a lock, then check N*M (also
 * through a read-only mapping). Every 40 iterations the ranks call the safe-point
 * psls_checkpoint with their loop counter as private state; a rank restarted from a
 * checkpoint (psls_restarted) goes on from the counter it saved there.
 * Usage: psls run -n 4 -- ./counter [M]   (exit status 0 when the count is exact). */
#include <stdio.h>
#include <stdlib.h>
#include "psls.h"

#define CHECK(call)                                                                      \
    do {                                                                                 \
        int rc_ = (call);                                                                \
        if (rc_ < 0) {                                                                   \
            fprintf(stderr, "%s: %s (%s)\n", #call, psls_strerror(rc_), psls_last_error()); \
            return 1;                                                                    \
        }                                                                                \
    } while (0)

int main(int argc, char **argv) {
    long m = argc > 1 ? atol(argv[1]) : 100;
    void *addr = NULL;
    CHECK(psls_init());
    int rank = psls_rank(), size = psls_size();
    CHECK(psls_map("c-counter", 4096, 1, &addr));
    volatile long *counter = (volatile long *)addr;
    long start = 0;
    size_t len = 0;
    int restarted = psls_restarted(&start, sizeof start, &len);
    CHECK(restarted);
    if (restarted) {
        printf("rank %d restarted at iteration %ld\n", rank, start);
    } else {
        if (rank == 0) *counter = 0;
        CHECK(psls_barrier());
    }
    for (long i = start; i < m; i++) {
        if (i % 40 == 0) {
            int epoch = psls_checkpoint(&i, sizeof i);
            CHECK(epoch);
            if (rank == 0 && epoch > 0) printf("checkpoint %d at iteration %ld\n", epoch, i);
        }
        CHECK(psls_lock(1));
        *counter = *counter + 1;
        CHECK(psls_unlock(1));
    }
    CHECK(psls_barrier());
    long got = *counter;
    printf("rank %d of %d: counter %ld (expected %ld)\n", rank, size, got, (long)size * m);
    /* A read-only mapping of the same file sees the same count. */
    const void *ro = NULL;
    CHECK(psls_map_ro("c-counter", 4096, &ro));
    if (*(const volatile long *)ro != got) { fprintf(stderr, "read-only mapping disagrees\n"); return 1; }
    CHECK(psls_unmap(ro));
    /* Bad input gets an error code, not a crash. */
    if (psls_unlock(1) != PSLS_EINVAL) { fprintf(stderr, "unlock of a lock not held succeeded\n"); return 1; }
    CHECK(psls_barrier());
    CHECK(psls_unmap(addr));
    if (psls_unmap(addr) != PSLS_ENOTMAPPED) { fprintf(stderr, "double unmap not detected\n"); return 1; }
    CHECK(psls_finalize());
    return got == (long)size * m ? 0 : 2;
}
