/* The step micro-benchmark with MPI: the baseline of `step-bench`.
 *
 * barrier: ITERS MPI_Barrier calls; step: rank 0 writes 2 pages (8 KiB), MPI_Bcast of them
 * (what "write, barrier, read" costs in MPI), timed on the last rank (a receiver) from the
 * barrier that starts the iteration. The last rank prints one JSON line with the median and
 * the 90th percentile of each, in microseconds.
 *
 * Usage: mpirun -n P ./step_mpi [--iters N]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *t, int n, double p) {
    qsort(t, (size_t)n, sizeof(double), cmp);
    int k = (int)(p * (n - 1));
    return t[k] * 1e6;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int iters = 2000;
    for (int a = 1; a < argc; a++) {
        if (strcmp(argv[a], "--iters") == 0 && a + 1 < argc) {
            iters = atoi(argv[++a]);
        } else {
            if (rank == 0) fprintf(stderr, "step_mpi: unknown argument %s (use --iters N)\n", argv[a]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    if (iters < 10) iters = 10;
    double *bt = malloc(sizeof(double) * (size_t)iters);
    double *st = malloc(sizeof(double) * (size_t)iters);
    char *pages = malloc(8192);
    if (!bt || !st || !pages) MPI_Abort(MPI_COMM_WORLD, 1);
    for (int w = 0; w < 100; w++) MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < iters; i++) {
        double t = MPI_Wtime();
        MPI_Barrier(MPI_COMM_WORLD);
        bt[i] = MPI_Wtime() - t;
    }
    long sum = 0;
    for (int i = 0; i < iters; i++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t = MPI_Wtime();
        if (rank == 0) memset(pages, (char)i, 8192);
        MPI_Bcast(pages, 8192, MPI_CHAR, 0, MPI_COMM_WORLD);
        sum += pages[4096];
        st[i] = MPI_Wtime() - t;
    }
    if (rank == size - 1)
        printf("{\"ranks\":%d,\"iters\":%d,\"barrier_p50_us\":%.1f,\"barrier_p90_us\":%.1f,\"step_p50_us\":%.1f,\"step_p90_us\":%.1f,\"check\":%ld}\n",
               size, iters, pct(bt, iters, 0.5), pct(bt, iters, 0.9), pct(st, iters, 0.5), pct(st, iters, 0.9), sum);
    free(bt);
    free(st);
    free(pages);
    MPI_Finalize();
    return 0;
}
