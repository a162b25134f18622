// A persistent thread pool: `parallel(fn)` runs fn(thread, n_threads) on every thread (the caller is
// thread 0) and returns when all are done. Workers spin between jobs for a short while (a decode step
// issues ~100 jobs, microseconds apart), then sleep on a futex (std::atomic wait) until the next one.
#pragma once
#include <functional>

void tl_parallel(const std::function<void(int, int)>& fn);
int tl_nthreads();

// the share [lo, hi) of `total` items for thread `t` of `n`, in multiples of `align`
static inline void tl_split(int total, int t, int n, int align, int* lo, int* hi) {
    int units = (total + align - 1) / align;
    int per = units / n, extra = units % n;
    int u0 = t * per + (t < extra ? t : extra);
    int u1 = u0 + per + (t < extra ? 1 : 0);
    *lo = u0 * align < total ? u0 * align : total;
    *hi = u1 * align < total ? u1 * align : total;
}
