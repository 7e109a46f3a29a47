/* Split [0, total) into contiguous chunks (multiples of `align`, CHUNKS_PER_THREAD per
 * thread) and run fn on each: the caller and up to nthreads - 1 pool workers take chunks in
 * turn until none are left, all finished before return. A kernel's output element is
 * computed by one thread from start to end, so neither the thread count nor which thread
 * takes a chunk ever changes a result's bits.
 *
 * The pool (one per kernel library, started on first use; cpu/__init__.py points every
 * library at the linear library's, parallel_use) keeps its workers between calls: a worker spins for a few microseconds after a job, so the next kernel call of a step finds
 * it awake, then sleeps on a condition variable. One caller at a time uses the pool; a
 * second thread calling meanwhile (two engines in one process) starts threads of its own, as
 * does a child after fork (the pool's threads are not there).
 */
#ifndef PDSERVE_PARALLEL_H
#define PDSERVE_PARALLEL_H

#include <immintrin.h>
#include <pthread.h>
#include <x86intrin.h>
#include <stdint.h>
#include <unistd.h>

typedef void (*range_fn)(const void *args, int64_t begin, int64_t end);

typedef struct {
    range_fn fn;
    const void *args;
    int64_t begin, end;
} range_job;

#define POOL_MAX 15   /* workers besides the caller */
#define POOL_SPIN_TICKS 60000 /* time stamp counter ticks a waiter spins before sleeping (~20-30 us) */

static struct {
    pthread_mutex_t busy, mu; /* busy: the one caller; mu: guards the fields below */
    pthread_cond_t work, done;
    range_job jobs[POOL_MAX];
    int workers, pending;     /* started; still running this round */
    uint64_t round;           /* bumped per dispatch */
    pid_t pid;                /* the process whose workers these are */
    uint64_t start[POOL_MAX]; /* the round a worker starts after */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void *range_thread(void *p) {
    range_job *j = (range_job *)p;
    j->fn(j->args, j->begin, j->end);
    return 0;
}

/* Spin while the round is `seen`, for about POOL_SPIN_TICKS at most. */
static inline void spin_on_round(uint64_t seen) {
    uint64_t t0 = __rdtsc();
    while (__atomic_load_n(&pool.round, __ATOMIC_ACQUIRE) == seen && __rdtsc() - t0 < POOL_SPIN_TICKS) _mm_pause();
}

static void *pool_worker(void *arg) {
    int i = (int)(intptr_t)arg;
    uint64_t seen = pool.start[i];
    for (;;) {
        spin_on_round(seen);
        pthread_mutex_lock(&pool.mu);
        while (pool.round == seen) pthread_cond_wait(&pool.work, &pool.mu);
        seen = pool.round;
        range_job j = pool.jobs[i];
        pthread_mutex_unlock(&pool.mu);
        if (j.fn && j.begin < j.end) j.fn(j.args, j.begin, j.end);
        pthread_mutex_lock(&pool.mu);
        if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_ACQ_REL) == 0) pthread_cond_signal(&pool.done);
        pthread_mutex_unlock(&pool.mu);
    }
    return 0;
}

/* Workers 0 .. n - 1 exist (started here where missing); 0 if they cannot. Under pool.busy. */
static int pool_ready(int n) {
    while (pool.workers < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.start[pool.workers] = pool.round;
        int rc = pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)pool.workers);
        pthread_attr_destroy(&attr);
        if (rc != 0) return 0;
        pool.workers++;
    }
    return 1;
}

/* The pool as this process's own: a fresh one in a forked child, whose parent's workers (and
 * whatever lock one of them held) did not come along. Under pool.busy. */
static void pool_adopt(void) {
    if (pool.pid == getpid()) return;
    pthread_mutex_init(&pool.mu, 0);
    pthread_cond_init(&pool.work, 0);
    pthread_cond_init(&pool.done, 0);
    pool.workers = pool.pending = 0;
    pool.pid = getpid();
}

/* A call's work in chunks that the threads take in turn (an atomic counter): a thread that
 * finishes early, or has its core to itself while another shares one, takes more of them. */
typedef struct {
    range_fn fn;
    const void *args;
    int64_t total, align, units, chunks;
    int64_t next; /* the next chunk to take */
} chunked;

#define CHUNKS_PER_THREAD 8

static void run_chunks(const void *job, int64_t begin, int64_t end) {
    (void)begin, (void)end;
    chunked *c = (chunked *)job;
    for (;;) {
        int64_t i = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED);
        if (i >= c->chunks) return;
        int64_t b = c->units * i / c->chunks * c->align, e = c->units * (i + 1) / c->chunks * c->align;
        if (e > c->total) e = c->total;
        if (b < e) c->fn(c->args, b, e);
    }
}

static void run_ranges(range_fn fn, const void *args, int64_t total, int64_t align, int64_t nthreads) {
    if (nthreads > POOL_MAX + 1) nthreads = POOL_MAX + 1;
    int64_t units = (total + align - 1) / align;
    if (nthreads > units) nthreads = units;
    if (nthreads <= 1) {
        fn(args, 0, total);
        return;
    }
    chunked work = {fn, args, total, align, units, units < nthreads * CHUNKS_PER_THREAD ? units : nthreads * CHUNKS_PER_THREAD, 0};
    const range_job job = {run_chunks, &work, 0, 1};
    if (pthread_mutex_trylock(&pool.busy) == 0) {
        pool_adopt();
        if (pool_ready((int)nthreads - 1)) {
            pthread_mutex_lock(&pool.mu);
            for (int i = 0; i < pool.workers; i++) pool.jobs[i] = i + 1 < nthreads ? job : (range_job){0, 0, 0, 0};
            __atomic_store_n(&pool.pending, pool.workers, __ATOMIC_RELEASE);
            __atomic_add_fetch(&pool.round, 1, __ATOMIC_RELEASE);
            pthread_cond_broadcast(&pool.work);
            pthread_mutex_unlock(&pool.mu);
            run_chunks(&work, 0, 1);
            uint64_t t0 = __rdtsc(); /* the workers' last chunks end about when ours does: spin first */
            while (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) > 0 && __rdtsc() - t0 < POOL_SPIN_TICKS) _mm_pause();
            pthread_mutex_lock(&pool.mu);
            while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
            pthread_mutex_unlock(&pool.busy);
            return;
        }
        pthread_mutex_unlock(&pool.busy);
    }
    /* the pool is busy (another caller) or has no threads: threads of this call's own */
    pthread_t tid[POOL_MAX + 1];
    range_job jobs[POOL_MAX + 1];
    for (int64_t t = 1; t < nthreads; t++) jobs[t] = job;
    int started[POOL_MAX + 1] = {0};
    for (int64_t t = 1; t < nthreads; t++) started[t] = pthread_create(&tid[t], 0, range_thread, &jobs[t]) == 0;
    run_chunks(&work, 0, 1); /* takes whatever threads that did not start leave */
    for (int64_t t = 1; t < nthreads; t++)
        if (started[t]) pthread_join(tid[t], 0);
}

typedef void (*ranges_fn)(range_fn fn, const void *args, int64_t total, int64_t align, int64_t nthreads);
static ranges_fn pool_owner; /* another library's parallel_run, whose pool this one uses (parallel_use) */

/* This library's pool, for other libraries to share (exported; ops.py hands it over). */
void parallel_run(range_fn fn, const void *args, int64_t total, int64_t align, int64_t nthreads) {
    run_ranges(fn, args, total, align, nthreads);
}

/* Use `owner`'s pool (another library's parallel_run) instead of one of this library's own:
 * one set of workers for all kernels of a step, so that no library's workers spin on a core
 * while another's wait for it. NULL goes back to the own pool. */
void parallel_use(ranges_fn owner) { pool_owner = owner; }

static void parallel_ranges(range_fn fn, const void *args, int64_t total, int64_t align, int64_t nthreads) {
    if (pool_owner) pool_owner(fn, args, total, align, nthreads);
    else run_ranges(fn, args, total, align, nthreads);
}

#endif
