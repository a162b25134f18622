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
constexpr int SPIN = 4096;      // pause instructions before a waiting thread yields its core (~30-100 us)
constexpr int YIELDS = 64;      // yields before a worker sleeps on a futex

// Workers are started once, up to the most threads ever asked for; a job uses the first `n` of them.
struct Pool {
    int n = 1;                        // threads a job runs on (the caller is thread 0)
    std::vector<std::thread> workers; // threads 1 .. workers.size()
    std::atomic<uint32_t> gen{0};     // bumped once per job
    std::atomic<int> pending{0};      // workers still running the current job
    std::atomic<int> sleepers{0};
    std::atomic<bool> stop{false};
    const std::function<void(int, int)>* job = nullptr;

    void worker(int t, uint32_t seen) {
        for (;;) {
            int spins = 0;
            uint32_t g;
            while ((g = gen.load()) == seen) {
                if (++spins < SPIN) { TL_PAUSE(); continue; }
                if (spins < SPIN + YIELDS) { std::this_thread::yield(); continue; }
                sleepers.fetch_add(1);
                if (gen.load() == seen) gen.wait(seen);
                sleepers.fetch_sub(1);
                spins = 0;
            }
            seen = g;
            if (stop.load()) return;
            if (t < n) {
                (*job)(t, n);
                pending.fetch_sub(1);
            }
        }
    }
    void resize(int threads) {
        n = threads < 1 ? 1 : threads;
        while ((int)workers.size() < n - 1) {
            const int t = (int)workers.size() + 1;
            const uint32_t seen = gen.load();   // a new worker waits for the next job, not the last one
            workers.emplace_back([this, t, seen] { worker(t, seen); });
        }
    }
    void run(const std::function<void(int, int)>& fn) {
        if (n == 1) { fn(0, 1); return; }
        job = &fn;
        pending.store(n - 1);
        gen.fetch_add(1);
        if (sleepers.load() > 0) gen.notify_all();
        fn(0, n);
        // spin while the others finish; yield the core if they are slow (another process may hold it)
        for (int spins = 0; pending.load() > 0; ++spins) {
            if (spins < SPIN) TL_PAUSE(); else std::this_thread::yield();
        }
    }
    ~Pool() {
        stop = true;
        gen.fetch_add(1);
        gen.notify_all();
        for (auto& w : workers) w.join();
    }
};

Pool& pool() { static Pool p; return p; }
}  // namespace

void tl_parallel(const std::function<void(int, int)>& fn) { pool().run(fn); }
int tl_nthreads() { return pool().n; }

extern "C" void tl_set_threads(int32_t n) { pool().resize(n); }
extern "C" int32_t tl_threads(void) { return pool().n; }
