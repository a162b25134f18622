// A persistent thread pool. `tl_parallel_for(n, fn)` runs fn(chunk, thread) for chunk 0 .. n-1 over the
// threads (the caller is thread 0; `thread` indexes per-thread scratch) and returns when all are done. Each thread owns a contiguous share of the chunks
// (the same share every call, so a thread keeps reading the same weight rows: they stay in its cache) and,
// once its share is done, takes chunks from the others' shares: a thread the OS has descheduled (another
// process holds its core) delays nobody. Idle workers spin briefly, yield, then sleep on a futex.
#pragma once
#include <functional>

void tl_parallel_for(int n_chunks, const std::function<void(int, int)>& fn);
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
