/* Split [0, total) into nthreads contiguous ranges (multiples of `align`) and run fn on each:
 * the caller takes the first range, pthreads the others, joined before return. A kernel's
 * output element is computed by one thread from start to end, so the thread count never
 * changes a result's bits. */
#ifndef PDSERVE_PARALLEL_H
#define PDSERVE_PARALLEL_H

#include <pthread.h>
#include <stdint.h>

typedef void (*range_fn)(const void *args, int64_t begin, int64_t end);

typedef struct {
    range_fn fn;
    const void *args;
    int64_t begin, end;
} range_job;

static void *range_thread(void *p) {
    range_job *j = (range_job *)p;
    j->fn(j->args, j->begin, j->end);
    return 0;
}

static void parallel_ranges(range_fn fn, const void *args, int64_t total, int64_t align, int64_t nthreads) {
    if (nthreads > 16) nthreads = 16;
    int64_t units = (total + align - 1) / align;
    if (nthreads > units) nthreads = units;
    if (nthreads <= 1) {
        fn(args, 0, total);
        return;
    }
    pthread_t tid[16];
    range_job jobs[16];
    int started[16] = {0};
    for (int64_t t = 0; t < nthreads; t++) {
        int64_t b = units * t / nthreads * align, e = units * (t + 1) / nthreads * align;
        jobs[t] = (range_job){fn, args, b, e < total ? e : total};
        if (t > 0) started[t] = pthread_create(&tid[t], 0, range_thread, &jobs[t]) == 0;
    }
    fn(args, jobs[0].begin, jobs[0].end);
    for (int64_t t = 1; t < nthreads; t++) {
        if (started[t]) pthread_join(tid[t], 0);
        else fn(args, jobs[t].begin, jobs[t].end); /* no thread: run it here */
    }
}

#endif
