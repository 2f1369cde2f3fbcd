/* The thread runner: run_jobs runs one job per thread, on the team of torch's OpenMP runtime when built with
 * OpenMP, else on pthreads; parallel splits a per-tensor pass into ranges of elements, row_threads says how many
 * threads a pass split by rows gets. Every kernel runs its threads through here: this is the one file that
 * starts them. */
#include "kernels.h"

#if !defined(_OPENMP)
#include <pthread.h>
#endif

typedef struct { RangeFn fn; Job *job; } Task;

static void *run_task(void *arg) { Task *t = (Task *)arg; t->fn(t->job); return NULL; }

/* Runs worker on each of the t jobs (job_size bytes apart) and returns when all are done. Built with OpenMP,
 * the jobs run on the team of the OpenMP runtime torch has loaded (the same libgomp.so.1): its workers are
 * still spinning after the last torch op, so they start at once instead of a new thread competing with them
 * for a core. Without OpenMP: jobs 1.. on new threads (here when no thread can be started), job 0 on the
 * caller's thread. */
void run_jobs(void *(*worker)(void *), void *jobs, size_t job_size, int64_t t) {
    char *job = (char *)jobs;
#if defined(_OPENMP)
    if (t < 2) { /* no region at all: the caller's thread alone (as in a forked child, where torch uses one) */
        worker(job);
        return;
    }
#pragma omp parallel for num_threads((int)t) schedule(static, 1)
    for (int64_t i = 0; i < t; ++i) worker(job + i * job_size);
#else
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t i = 1; i < t; ++i) {
        started[i] = pthread_create(&ids[i], NULL, worker, job + i * job_size) == 0;
        if (!started[i]) worker(job + i * job_size);
    }
    worker(job);
    for (int64_t i = 1; i < t; ++i) if (started[i]) pthread_join(ids[i], NULL);
#endif
}

/* Splits [0, n) over up to `threads` threads (the caller's thread takes the first range). */
void parallel(RangeFn fn, const Job *proto, int64_t n, int threads, Job *jobs, int *used) {
    int64_t by_size = n / MIN_PER_THREAD;
    int t = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (by_size < t) t = by_size < 1 ? 1 : (int)by_size;
    int64_t step = ((n + t - 1) / t + 63) & ~(int64_t)63;
    Task tasks[MAX_THREADS];
    for (int k = 0; k < t; ++k) {
        jobs[k] = *proto;
        jobs[k].begin = job_start(k, step, n);
        jobs[k].end = job_start(k + 1, step, n);
        tasks[k] = (Task){fn, &jobs[k]};
    }
    run_jobs(run_task, tasks, sizeof(Task), t);
    *used = t;
}

/* Threads for a job split by rows: one per MIN_PER_THREAD elements, at most `threads`, `m` and MAX_THREADS. */
int64_t row_threads(int64_t m, int64_t numel, int threads) {
    int64_t t = numel / MIN_PER_THREAD;
    t = t > threads ? threads : t;
    t = t > m ? m : t;
    return t > MAX_THREADS ? MAX_THREADS : t < 1 ? 1 : t;
}
