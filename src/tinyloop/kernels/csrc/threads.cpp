#include "threads.h"
#include "tinyloop.h"
#include <atomic>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#define TL_PAUSE() _mm_pause()
#else
#define TL_PAUSE() ((void)0)
#endif

namespace {
constexpr int SPIN = 1 << 16;   // pause instructions before a worker sleeps (~100-300 us)

struct Pool {
    int n = 1;
    std::vector<std::thread> workers;
    std::atomic<uint32_t> gen{0};     // bumped once per job
    std::atomic<int> pending{0};      // workers still running the current job
    std::atomic<int> sleepers{0};
    std::atomic<bool> stop{false};
    const std::function<void(int, int)>* job = nullptr;

    void worker(int t) {
        uint32_t seen = 0;
        for (;;) {
            int spins = 0;
            uint32_t g;
            while ((g = gen.load(std::memory_order_acquire)) == seen) {
                if (++spins < SPIN) { TL_PAUSE(); continue; }
                sleepers.fetch_add(1);
                if (gen.load(std::memory_order_acquire) == seen) gen.wait(seen);
                sleepers.fetch_sub(1);
                spins = 0;
            }
            seen = g;
            if (stop.load()) return;
            (*job)(t, n);
            pending.fetch_sub(1, std::memory_order_acq_rel);
        }
    }
    void start(int threads) {
        finish();
        n = threads < 1 ? 1 : threads;
        stop = false;
        for (int t = 1; t < n; ++t) workers.emplace_back([this, t] { worker(t); });
    }
    void finish() {
        if (workers.empty()) return;
        stop = true;
        gen.fetch_add(1, std::memory_order_release);
        gen.notify_all();
        for (auto& w : workers) w.join();
        workers.clear();
    }
    void run(const std::function<void(int, int)>& fn) {
        if (n == 1) { fn(0, 1); return; }
        job = &fn;
        pending.store(n - 1, std::memory_order_release);
        gen.fetch_add(1, std::memory_order_release);
        if (sleepers.load() > 0) gen.notify_all();
        fn(0, n);
        while (pending.load(std::memory_order_acquire) > 0) TL_PAUSE();
    }
    ~Pool() { finish(); }
};

Pool& pool() { static Pool p; return p; }
}  // namespace

void tl_parallel(const std::function<void(int, int)>& fn) { pool().run(fn); }
int tl_nthreads() { return pool().n; }

extern "C" void tl_set_threads(int32_t n) {
    if (n != pool().n || (n > 1 && pool().workers.empty())) pool().start(n);
}
extern "C" int32_t tl_threads(void) { return pool().n; }
