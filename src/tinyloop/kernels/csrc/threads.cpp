#include "threads.h"
#include "tinyloop.h"
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#define TL_PAUSE() _mm_pause()
#else
#define TL_PAUSE() ((void)0)
#endif

namespace {
// A waiting thread spins SPIN_NS before it yields its core: long enough to cover the gaps between the jobs
// of one native call (a few microseconds of single-threaded work between two layers), short enough that a
// worker does not hold a core through the Python between calls (~0.3-0.5 ms), which the server's event loop
// needs. (A count of 4,096 pause instructions was ~190 us on Sapphire Rapids, whose pause takes ~140 cycles,
// and ~20 us where it takes ~10: a time is the same on every host.)
constexpr int64_t SPIN_NS = 30000;
constexpr int SPIN_CHECK = 32;  // pause instructions between two looks at the clock
constexpr int YIELDS = 64;      // yields before a worker sleeps on a futex
constexpr int MAX_THREADS = 64;

// A share's cursor packs the job's generation (16 bits), the share's end (24) and the next chunk (24), so
// that a thread still holding an old job's view can never claim a chunk of the next job by mistake.
inline uint64_t pack(uint64_t gen, uint64_t end, uint64_t next) { return (gen & 0xffff) << 48 | end << 24 | next; }

struct alignas(64) Cursor { std::atomic<uint64_t> v{0}; };

// whether a wait that began at t0 has spun its SPIN_NS (the clock read every SPIN_CHECK-th spin)
inline bool spun(std::chrono::steady_clock::time_point t0, int spins) {
    return spins % SPIN_CHECK == 0 && std::chrono::steady_clock::now() - t0 >= std::chrono::nanoseconds(SPIN_NS);
}

struct Pool {
    int n = 1;                            // threads a job runs on (the caller is thread 0)
    std::vector<std::thread> workers;     // threads 1 .. workers.size()
    std::atomic<uint32_t> gen{0};         // bumped once per job (workers wait on it)
    Cursor cursor[MAX_THREADS];
    std::atomic<int> done{0};             // chunks finished in the current job
    std::atomic<int> sleepers{0};
    std::atomic<bool> stop{false};
    const std::function<void(int, int)>* job = nullptr;

    // claim the next chunk of share s for job generation g; -1 when the share is done (or the job changed)
    int claim(int s, uint32_t g) {
        uint64_t v = cursor[s].v.load();
        for (;;) {
            if ((v >> 48) != (g & 0xffff)) return -1;
            const uint64_t end = (v >> 24) & 0xffffff, next = v & 0xffffff;
            if (next >= end) return -1;
            if (cursor[s].v.compare_exchange_weak(v, v + 1)) return (int)next;
        }
    }
    // thread t: its own share, then the others'
    void work(int t, uint32_t g, int nt) {
        for (int k = 0; k < nt; ++k) {
            const int s = (t + k) % nt;
            for (int c; (c = claim(s, g)) >= 0;) {
                (*job)(c, t);
                done.fetch_add(1);
            }
        }
    }
    void worker(int t, uint32_t seen) {
        for (;;) {
            int spins = 0, yields = 0;
            auto t0 = std::chrono::steady_clock::now();
            uint32_t g;
            while ((g = gen.load()) == seen) {
                if (yields == 0 && !spun(t0, ++spins)) { TL_PAUSE(); continue; }
                if (yields++ < YIELDS) { std::this_thread::yield(); continue; }
                sleepers.fetch_add(1);
                if (gen.load() == seen) gen.wait(seen);
                sleepers.fetch_sub(1);
                spins = yields = 0;
                t0 = std::chrono::steady_clock::now();
            }
            seen = g;
            if (stop.load()) return;
            const int nt = n;
            if (t < nt) work(t, g, nt);
        }
    }
    void resize(int threads) {
        n = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
        while ((int)workers.size() < n - 1) {
            const int t = (int)workers.size() + 1;
            const uint32_t seen = gen.load();   // a new worker waits for the next job, not the last one
            workers.emplace_back([this, t, seen] { worker(t, seen); });
        }
    }
    void run(int n_chunks, const std::function<void(int, int)>& fn) {
        if (n == 1 || n_chunks <= 1) {
            for (int c = 0; c < n_chunks; ++c) fn(c, 0);
            return;
        }
        const uint32_t g = gen.load() + 1;
        job = &fn;
        done.store(0);
        for (int s = 0; s < n; ++s) {
            int lo, hi;
            tl_split(n_chunks, s, n, 1, &lo, &hi);
            cursor[s].v.store(pack(g, hi, lo));
        }
        gen.store(g);
        if (sleepers.load() > 0) gen.notify_all();
        work(0, g, n);
        // the others finish the chunks they hold; yield the core if they are slow (descheduled)
        const auto t0 = std::chrono::steady_clock::now();
        bool spinning = true;
        for (int spins = 1; done.load() < n_chunks; ++spins) {
            if (spinning && !spun(t0, spins)) {
                TL_PAUSE();
                continue;
            }
            spinning = false;
            std::this_thread::yield();
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

void tl_parallel_for(int n_chunks, const std::function<void(int, int)>& fn) { pool().run(n_chunks, fn); }
int tl_nthreads() { return pool().n; }

extern "C" void tl_set_threads(int32_t n) { pool().resize(n); }
extern "C" int32_t tl_threads(void) { return pool().n; }
