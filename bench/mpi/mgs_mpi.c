/* MGS with MPI: the baseline of bench/src/bin/mgs.rs (same kernel, same distribution).
 *
 * Modified Gram-Schmidt over N vectors of DIM doubles, vector i owned by rank i % size.
 * At step i the owner normalizes q_i and broadcasts it (MPI_Bcast of DIM doubles); every rank
 * then removes q_i's component from its own vectors j > i. This is the message an MPI
 * programmer sends where PSLS's ranks read q_i through shared memory after one barrier.
 *
 * Usage: mpirun -n P ./mgs_mpi [--vectors N] [--dim D]
 * Rank 0 prints one JSON line: {"ranks":P,"vectors":N,"dim":D,"run_s":..,"err":..}
 * where err is max |Q^T Q - I| (checked on rank 0 after gathering Q).
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* The same well-conditioned start as mgs.rs's `initial` (noise in [-0.5, 0.5), 4 on the
 * diagonal); the exact values need not match, the conditioning does. */
static double initial(size_t i, size_t k) {
    uint64_t r = mix64(((uint64_t)i << 32) ^ (uint64_t)k ^ 0x4d475300ULL);
    double noise = (double)(r >> 11) / (double)(1ULL << 53) - 0.5;
    return noise + (i == k ? 4.0 : 0.0);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    size_t n = 1024, dim = 1024;
    for (int a = 1; a < argc; a++) {
        if (strcmp(argv[a], "--vectors") == 0 && a + 1 < argc) {
            n = strtoul(argv[++a], NULL, 10);
        } else if (strcmp(argv[a], "--dim") == 0 && a + 1 < argc) {
            dim = strtoul(argv[++a], NULL, 10);
        } else {
            if (rank == 0) fprintf(stderr, "mgs_mpi: unknown argument %s (use --vectors N --dim D)\n", argv[a]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    if (n == 0 || dim == 0 || n > dim) {
        if (rank == 0) fprintf(stderr, "mgs_mpi: need 0 < vectors <= dim\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t mine = 0;
    for (size_t i = (size_t)rank; i < n; i += (size_t)size) mine++;
    double *v = malloc(sizeof(double) * dim * (mine ? mine : 1));
    double *q = malloc(sizeof(double) * dim);
    if (!v || !q) MPI_Abort(MPI_COMM_WORLD, 1);
    /* Local vector j is global vector rank + j * size. */
    for (size_t j = 0; j < mine; j++)
        for (size_t k = 0; k < dim; k++) v[j * dim + k] = initial((size_t)rank + j * (size_t)size, k);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (size_t i = 0; i < n; i++) {
        int owner = (int)(i % (size_t)size);
        if (owner == rank) {
            double *x = &v[(i / (size_t)size) * dim];
            double s = 0;
            for (size_t k = 0; k < dim; k++) s += x[k] * x[k];
            s = sqrt(s);
            for (size_t k = 0; k < dim; k++) x[k] /= s;
            memcpy(q, x, sizeof(double) * dim);
        }
        MPI_Bcast(q, (int)dim, MPI_DOUBLE, owner, MPI_COMM_WORLD);
        for (size_t j = 0; j < mine; j++) {
            size_t g = (size_t)rank + j * (size_t)size;
            if (g <= i) continue;
            double *x = &v[j * dim];
            double d = 0;
            for (size_t k = 0; k < dim; k++) d += q[k] * x[k];
            for (size_t k = 0; k < dim; k++) x[k] -= d * q[k];
        }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    double run = MPI_Wtime() - t0;
    /* Check on rank 0: every vector (broadcast by its owner) and max |Q^T Q - I|. */
    double *all = NULL;
    if (rank == 0) {
        all = malloc(sizeof(double) * dim * n);
        if (!all) MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (size_t i = 0; i < n; i++) {
        int owner = (int)(i % (size_t)size);
        if (owner == rank) memcpy(q, &v[(i / (size_t)size) * dim], sizeof(double) * dim);
        MPI_Bcast(q, (int)dim, MPI_DOUBLE, owner, MPI_COMM_WORLD);
        if (rank == 0) memcpy(&all[i * dim], q, sizeof(double) * dim);
    }
    if (rank == 0) {
        double worst = 0;
        for (size_t i = 0; i < n; i++)
            for (size_t j = i; j < n; j++) {
                double d = 0;
                for (size_t k = 0; k < dim; k++) d += all[i * dim + k] * all[j * dim + k];
                double e = fabs(d - (i == j ? 1.0 : 0.0));
                if (e > worst) worst = e;
            }
        printf("{\"ranks\":%d,\"vectors\":%zu,\"dim\":%zu,\"run_s\":%.6f,\"err\":%.3e}\n", size, n, dim, run, worst);
        free(all);
        if (worst > 1e-9) {
            fprintf(stderr, "mgs_mpi: result wrong: max |Q^T Q - I| = %g\n", worst);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
    free(v);
    free(q);
    MPI_Finalize();
    return 0;
}
