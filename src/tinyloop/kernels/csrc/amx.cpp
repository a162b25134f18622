// AMX int8 tiles (Intel Advanced Matrix Extensions) for layers with int8 activations: a tile product
// C (16 x 16 int32) += A (16 x 64 bytes) . B (16 x 64 bytes) is 16,384 multiply-adds in one instruction.
//   A: 16 weight rows' codes (int4: their nibbles unpacked to bytes once per strip of 16 weight rows, into a
//      per-thread buffer; no copy of the model is kept; int8 weights are read in place: amx_rows_q8, below);
//   B: 16 input rows' int8 activations, laid out once per call as the tiles want them (four consecutive
//      columns of one row per 32-bit column of the tile);
//   C: the exact int32 sums of one activation block (matmul.cpp's canonical reduction), stored, then scaled
//      and added per output in block order with AVX-512 across the 16 input rows. The zero points'
//      correction is summed in the same order as qq_zero_corr. The result is bitwise the vector tiles'.
// int4 layers with 32-column activation blocks (SPLIT) take two half products a 64-column step, one per
// block (their A bytes ordered block by block); other layers one product a 64-column step, their block's
// sum kept in C across the block's steps.
#include "amx.h"
#include "threads.h"
#include "vec.h"
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__linux__)
#define TL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define TL_AMX 0
#endif

namespace {
int amx_switch = -1;   // -1: not read yet (TINYLOOP_NATIVE_AMX=0 turns the tiles off); 0 off; 1 on

bool amx_permitted() {
#if TL_AMX
    // Linux keeps the 8 KB of tile data out of a process's state until it asks for it
    // (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18); a kernel, hypervisor or CPU without it
    // refuses, and the vector tiles serve. ARCH_GET_XCOMP_PERM (0x1022) confirms the grant.
    static const bool ok = [] {
        if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return false;
        unsigned long bits = 0;
        return syscall(SYS_arch_prctl, 0x1022, &bits) == 0 && (bits >> 18 & 1);
    }();
    return ok;
#else
    return false;
#endif
}
}  // namespace

bool amx_ready() {
    if (amx_switch < 0) {
        const char* e = getenv("TINYLOOP_NATIVE_AMX");
        amx_switch = !(e && e[0] == '0');
    }
    return amx_switch && amx_permitted();
}

// on = 0 / 1 switches the AMX tiles off / on (where permitted), on < 0 asks; returns whether they ran before
extern "C" int32_t tl_set_amx(int32_t on) {
    const int32_t was = amx_ready();
    if (on >= 0) amx_switch = on ? 1 : 0;
    return was;
}

extern "C" int32_t tl_amx(void) { return amx_ready(); }

#if TL_AMX
namespace {
struct alignas(64) TileCfg {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tiles 0-3: C, four blocks' sums in flight; 4-5: A; 6-7: B (SPLIT: each step's first and second block)
void load_config(bool split) {
    TileCfg c;
    for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;                   // 16 weight rows x 16 int32
    for (int t = 4; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = split ? 32 : 64;      // 16 weight rows x K bytes
    for (int t = 6; t < 8; ++t) c.rows[t] = split ? 8 : 16, c.colsb[t] = 64;       // K / 4 rows x 16 input rows
    _tile_loadconfig(&c);
}

// one block's sums into tile CT, its steps' A and B alternating between two tiles each, then stored: the
// products of up to four blocks are in flight at once (a product's latency is several times its issue
// interval) and the stores are read back only after the last block's (the scaling runs apart, below).
// (Macros: the tile intrinsics take their tile numbers as literal tokens.)
#define TL_BLOCK_SUMS(CT, A, astride, Bb, t0, t1, out)        \
    do {                                                        \
        _tile_zero(CT);                                         \
        for (int t_ = (t0); t_ < (t1); ++t_) {                  \
            if ((t_ - (t0)) & 1) {                              \
                _tile_loadd(5, (A) + 1024 * t_, (astride));       \
                _tile_loadd(7, (Bb) + 1024 * t_, 64);           \
                _tile_dpbusd(CT, 5, 7);                         \
            } else {                                            \
                _tile_loadd(4, (A) + 1024 * t_, (astride));       \
                _tile_loadd(6, (Bb) + 1024 * t_, 64);           \
                _tile_dpbusd(CT, 4, 6);                         \
            }                                                   \
        }                                                       \
        _tile_stored(CT, (out), 64);                            \
    } while (0)

// a SPLIT step's two blocks into tiles C0 and C1
#define TL_SPLIT_SUMS(C0, C1, A, astride, Bb, t, out)           \
    do {                                                        \
        _tile_zero(C0);                                         \
        _tile_zero(C1);                                         \
        _tile_loadd(4, (A) + 1024 * (t), (astride));              \
        _tile_loadd(6, (Bb) + 1024 * (t), 64);                  \
        _tile_dpbusd(C0, 4, 6);                                 \
        _tile_loadd(5, (A) + 1024 * (t) + 32, (astride));         \
        _tile_loadd(7, (Bb) + 1024 * (t) + 512, 64);            \
        _tile_dpbusd(C1, 5, 7);                                 \
        _tile_stored(C0, (out), 64);                            \
        _tile_stored(C1, (out) + 256, 64);                      \
    } while (0)

// a SPLIT step's A byte k holds column position pos(k) of xq's 64 (evens 0-31, then odds): the first
// block's evens and odds, then the second's
static inline int split_pos(int k) { return k < 16 ? k : k < 32 ? k + 16 : k < 48 ? k - 16 : k; }

struct Prep {   // what the call's strips share, laid out by the calling thread
    int K, NT, NA, NG, MB, AB;
    bool split;
    std::vector<int8_t> B;      // (MB, NT, 16, 64) activation tiles
    std::vector<float> dT;      // (MB, NA, 16) block scales
    std::vector<float> XT;      // (MB, NG, 16) zero-point sums
    std::vector<int> ga;        // (NA) weight group of each block
};

void strip(const tl_linear* L, const Prep& P, int n0, float* y, int ldy, int m) {
    const int K = P.K, NG = P.NG, NA = P.NA, nr = L->n - n0 < 16 ? L->n - n0 : 16;
    const int64_t row_bytes = (int64_t)K / 2;
    const uint8_t* codes = (const uint8_t*)L->w + (int64_t)n0 * row_bytes;
    thread_local std::vector<uint8_t> wbuf;
    thread_local std::vector<float> sfbuf;
    sfbuf.assign((size_t)16 * NG, 0.f);
    float* sf = sfbuf.data();   // (16, NG) the weight scales as fp32
    for (int w = 0; w < nr; ++w) {   // (16 at a time: a scalar conversion chains on its register's old value)
        const uint16_t* sc = L->scales + (int64_t)(n0 + w) * NG;
        int g = 0;
        for (; g + 16 <= NG; g += 16)
            _mm512_storeu_ps(sf + (size_t)w * NG + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + g))));
        for (; g < NG; ++g) sf[(size_t)w * NG + g] = f16_to_f32(sc[g]);
    }
    // The strip runs in chunks of up to four blocks (the four C tiles; SPLIT: two steps), software-pipelined:
    // a chunk's codes are unpacked into one of two buffers, its products issued (the tile unit works on
    // them alone), and meanwhile the vector units scale the previous chunk's sums. A chunk's A tiles lie
    // tile by tile (step t's 16 rows of 64 bytes together: a tile load reads 1 KB in a row) and the whole
    // working set (two chunks of A and of C, the chunk's B) stays in the L1 cache.
    const int spb = P.split ? 1 : P.AB / 64;             // steps a block (SPLIT: two blocks a step)
    const int csteps = P.split ? 2 : 4 * spb;            // steps a chunk
    const int cblocks = 4, nchunks = (P.NT + csteps - 1) / csteps;
    wbuf.resize((size_t)2 * csteps * 1024);
    thread_local std::vector<int32_t> cbuf;
    thread_local std::vector<float> totbuf;
    cbuf.resize((size_t)2 * P.MB * cblocks * 256);
    totbuf.assign((size_t)P.MB * 256, 0.f);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m512i low4z = _mm512_set1_epi8(0x0F);
    // int4, two steps at a time: 64 code bytes -> low nibbles [E(t) E(t+1)] and high [O(t) O(t+1)] (32 bytes
    // each), then the steps' A rows [E(t) O(t)] and [E(t+1) O(t+1)] (SPLIT: in 16-byte quarters, block by block)
    const __m512i ia = P.split ? _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0) : _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i ib = P.split ? _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4) : _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    auto unpack = [&](int t0, int t1, uint8_t* A) {   // steps [t0, t1) -> A + 1024 (t - t0) + 64 w
        for (int w = 0; w < 16; ++w) {
            uint8_t* out = A + 64 * w - (int64_t)1024 * t0;
            if (w >= nr) {
                for (int t = t0; t < t1; ++t) _mm512_storeu_si512(out + 1024 * t, _mm512_setzero_si512());
                continue;
            }
            const uint8_t* row = codes + (int64_t)w * row_bytes;
            int t = t0;
            for (; t + 2 <= t1; t += 2) {
                const __m512i raw = _mm512_loadu_si512(row + 32 * t);
                const __m512i lo = _mm512_and_si512(raw, low4z), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4z);
                _mm512_storeu_si512(out + 1024 * t, _mm512_permutex2var_epi64(lo, ia, hi));
                _mm512_storeu_si512(out + 1024 * (t + 1), _mm512_permutex2var_epi64(lo, ib, hi));
            }
            for (; t < t1; ++t) {
                const __m256i raw = _mm256_loadu_si256((const __m256i*)(row + 32 * t));
                const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                __m256i x0 = lo, x1 = hi;
                if (P.split) x0 = _mm256_permute2x128_si256(lo, hi, 0x20), x1 = _mm256_permute2x128_si256(lo, hi, 0x31);
                _mm256_storeu_si256((__m256i*)(out + 1024 * t), x0);
                _mm256_storeu_si256((__m256i*)(out + 1024 * t + 32), x1);
            }
        }
    };
    // the next strip's codes (into L2: into L1 they would evict this strip's tiles), scales and zero
    // points, fetched while this one computes
    const int64_t lines = n0 + 16 < L->n ? (16 * row_bytes + 63) / 64 : 0;
    const char* ncodes = (const char*)(codes + 16 * row_bytes);
    for (int w = 0; lines && w < 16 && n0 + 16 + w < L->n; ++w) {
        _mm_prefetch((const char*)(L->scales + (int64_t)(n0 + 16 + w) * NG), _MM_HINT_T0);
        _mm_prefetch(L->mins ? (const char*)(L->mins + (int64_t)(n0 + 16 + w) * NG)
                             : (const char*)(L->zeros + (int64_t)(n0 + 16 + w) * NG), _MM_HINT_T0);
    }
    int64_t fetched = 0;
    // chunk c's blocks, scaled into the totals in block order: t = fma(float(I), d * s, t)
    auto scale = [&](int c) {
        const int a0 = c * cblocks, a1 = a0 + cblocks < NA ? a0 + cblocks : NA;
        const int32_t* Cc = cbuf.data() + (size_t)(c & 1) * P.MB * cblocks * 256;
        for (int b = 0; b < P.MB; ++b) {
            const float* dT = P.dT.data() + (size_t)b * NA * 16;
            float* tb = totbuf.data() + (size_t)b * 256;
            __m512 tot[16];
#pragma GCC unroll 16
            for (int w = 0; w < 16; ++w) tot[w] = _mm512_loadu_ps(tb + 16 * w);
            for (int a = a0; a < a1; ++a) {
                const __m512 dv = _mm512_loadu_ps(dT + (size_t)a * 16);
                const int g = P.ga[a];
                const int32_t* Ca = Cc + ((size_t)b * cblocks + (a - a0)) * 256;
#pragma GCC unroll 16
                for (int w = 0; w < 16; ++w) {
                    const __m512i s = _mm512_loadu_si512(Ca + 16 * w);
                    tot[w] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(sf[(size_t)w * NG + g])), tot[w]);
                }
            }
#pragma GCC unroll 16
            for (int w = 0; w < 16; ++w) _mm512_storeu_ps(tb + 16 * w, tot[w]);
        }
    };
    for (int c = 0; c < nchunks; ++c) {
        const int t0 = c * csteps, t1 = t0 + csteps < P.NT ? t0 + csteps : P.NT;
        const uint8_t* A = wbuf.data() + (size_t)(c & 1) * csteps * 1024 - (int64_t)1024 * t0;   // (indexed by t)
        constexpr int64_t astride = 64;
        unpack(t0, t1, wbuf.data() + (size_t)(c & 1) * csteps * 1024);
        int32_t* Cc = cbuf.data() + (size_t)(c & 1) * P.MB * cblocks * 256;
        for (int b = 0; b < P.MB; ++b) {
            const int8_t* Bb = P.B.data() + (size_t)b * P.NT * 1024;
            int32_t* Cb = Cc + (size_t)b * cblocks * 256;
            if (P.split) {
                TL_SPLIT_SUMS(0, 1, A, astride, Bb, t0, Cb);
                if (t0 + 1 < t1) TL_SPLIT_SUMS(2, 3, A, astride, Bb, t0 + 1, Cb + 512);
            } else {
                const int a0 = t0 / spb, a1 = t1 / spb;
                for (int a = a0; a < a1; ++a) {
                    int32_t* out = Cb + (size_t)256 * (a - a0);
                    switch (a - a0) {
                        case 0: TL_BLOCK_SUMS(0, A, astride, Bb, a * spb, (a + 1) * spb, out); break;
                        case 1: TL_BLOCK_SUMS(1, A, astride, Bb, a * spb, (a + 1) * spb, out); break;
                        case 2: TL_BLOCK_SUMS(2, A, astride, Bb, a * spb, (a + 1) * spb, out); break;
                        default: TL_BLOCK_SUMS(3, A, astride, Bb, a * spb, (a + 1) * spb, out); break;
                    }
                }
            }
        }
        if (c > 0) scale(c - 1);   // (while the tile unit runs chunk c)
        for (const int64_t upto = lines * (c + 1) / nchunks; fetched < upto; ++fetched)
            _mm_prefetch(ncodes + 64 * fetched, _MM_HINT_T1);
    }
    scale(nchunks - 1);
    const uint8_t* zp = L->mins ? nullptr : L->zeros + (int64_t)n0 * NG;
    const uint16_t* mp = L->mins ? L->mins + (int64_t)n0 * NG : nullptr;   // the min form: s z' is -min
    for (int b = 0; b < P.MB; ++b) {
        const float* tb = totbuf.data() + (size_t)b * 256;
        // the zero points (qq_zero_corr's order, the 16 input rows side by side), then the outputs
        const float* XT = P.XT.data() + (size_t)b * NG * 16;
        const int rows = m - 16 * b < 16 ? m - 16 * b : 16;
        const __mmask16 live = (__mmask16)((1u << rows) - 1);
        const __m512i rowoff = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                  _mm512_set1_epi32(ldy));
        float* yb = y + (int64_t)16 * b * ldy + n0;
        for (int w = 0; w < nr; ++w) {
            const float* sj = sf + (size_t)w * NG;
            const uint8_t* zj = zp ? zp + (int64_t)w * NG : nullptr;
            const uint16_t* mj = mp ? mp + (int64_t)w * NG : nullptr;
            auto szg = [&](int g) { return mj ? -f16_to_f32(mj[g]) : sj[g] * (float)zj[g]; };   // (group_sz)
            alignas(64) float sz[16];
            __m512 cv[8];
            for (int l = 0; l < 8; ++l) cv[l] = _mm512_setzero_ps();
            int g = 0;
            for (; g + 16 <= NG; g += 16) {   // s_g z'_g (or -min_g) for 16 groups, then one product a group
                if (mj) {
                    _mm512_store_ps(sz, _mm512_xor_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mj + g))),
                                                      _mm512_set1_ps(-0.f)));
                } else {
                    const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(zj + g))));
                    _mm512_store_ps(sz, _mm512_mul_ps(_mm512_loadu_ps(sj + g), z));
                }
#pragma GCC unroll 16
                for (int l = 0; l < 16; ++l)
                    cv[l & 7] = _mm512_fmadd_ps(_mm512_set1_ps(sz[l]), _mm512_loadu_ps(XT + (size_t)(g + l) * 16), cv[l & 7]);
            }
            for (; g + 8 <= NG; g += 8)
                for (int l = 0; l < 8; ++l)
                    cv[l] = _mm512_fmadd_ps(_mm512_set1_ps(szg(g + l)), _mm512_loadu_ps(XT + (size_t)(g + l) * 16), cv[l]);
            __m512 corr = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(cv[0], cv[4]), _mm512_add_ps(cv[2], cv[6])),
                                        _mm512_add_ps(_mm512_add_ps(cv[1], cv[5]), _mm512_add_ps(cv[3], cv[7])));
            for (; g < NG; ++g)
                corr = _mm512_fmadd_ps(_mm512_set1_ps(szg(g)), _mm512_loadu_ps(XT + (size_t)g * 16), corr);
            _mm512_mask_i32scatter_ps(yb + w, live, rowoff, _mm512_sub_ps(_mm512_loadu_ps(tb + 16 * w), corr), 4);
        }
    }
}
}  // namespace

// ---- int8 weights whose activation blocks are whole 64s (the int8 head): the weight rows straight from the
// model as A tiles (no copy), the call's activation tiles as B (kept in tiles 4-7 for the whole call where
// they fit), one C tile a block, and an epilogue per input row with the 16 weight rows in the vector's lanes:
// C holds (weight row, input row) sums, read a column at a time (one gather an input row), so a call of m
// rows costs m short epilogues a strip, not amx_rows' 16 scaled and scattered weight rows. Lane w computes
// what qq_rows8 computes for weight row n0 + w (the same int32 sums, t = fma(I_a, d_a * s_g(a), t) block by
// block, the zero points' correction in qq_zero_corr's order), so the outputs are bitwise the other kernels'.
// The shipped head (50,257 x 256), one thread, against the vector tiles (qq_rows8 with VNNI): 2 rows 0.53 ms
// against 0.47, 4 0.59 / 0.64, 5 0.61 / 0.75-0.78, 8 0.70 / 1.14, 16 0.93 / 1.45 (amx_rows), 32 1.7 / 2.2.
// (Two C tiles a block, alternating steps, cost 0.60 / 0.73 / 1.15 at 2 / 5 / 16 rows; prefetching strips
// ahead into L1 or L2 made it slower.)
namespace {
void load_config_q8(int NT, bool resident) {
    TileCfg c;
    for (int t = 0; t < 2; ++t) c.rows[t] = 16, c.colsb[t] = 64;    // C: 16 weight rows x 16 int32
    for (int t = 2; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;    // A: 16 weight rows x 64 code bytes
    for (int t = 4; t < (resident ? 4 + NT : 6); ++t) c.rows[t] = 16, c.colsb[t] = 64;   // B: 16 x (4 cols x 16 rows)
    _tile_loadconfig(&c);
}

// the activation tiles of a call: (MB, NT, 16, 64), tile row k / 4 holding column k % 4 of each input row
void fill_b(const int8_t* xq, int m, int K, bool split, std::vector<int8_t>& B) {
    const int NT = K / 64, MB = (m + 15) / 16;
    B.assign((size_t)MB * NT * 1024, 0);
    int pos[64];
    for (int k = 0; k < 64; ++k) pos[k] = split ? split_pos(k) : k;
    for (int r = 0; r < m; ++r) {
        const int b = r / 16, br = r % 16;
        const int8_t* q = xq + (int64_t)r * K;
        for (int t = 0; t < NT; ++t) {
            int8_t* tile = B.data() + ((size_t)b * NT + t) * 1024;
            for (int k = 0; k < 64; ++k) tile[(k / 4) * 64 + br * 4 + k % 4] = q[64 * t + pos[k]];
        }
    }
}

#define TL_Q8_STEP(CT, AT, BT, a_ptr, astride, b_ptr, resident) \
    do {                                                          \
        _tile_loadd(AT, (a_ptr), (astride));                      \
        if (!(resident)) _tile_loadd(BT, (b_ptr), 64);            \
        _tile_dpbusd(CT, AT, BT);                                 \
    } while (0)

// steps [t0, t1) of one block into C0 (even steps) and C1 (odd), stored to out and out + 256
void q8_block(const uint8_t* A, int64_t astride, const int8_t* Bb, int t0, int t1, bool resident, int32_t* out) {
    _tile_zero(0);
    for (int t = t0; t < t1; ++t) {
        const uint8_t* at = A + 64 * t;
        const int8_t* bt = Bb + 1024 * t;
        if (resident) {   // the B tiles stay loaded for the whole call (tiles 4 + t)
            switch (t) {
                case 0: TL_Q8_STEP(0, 2, 4, at, astride, bt, true); break;
                case 1: TL_Q8_STEP(0, 3, 5, at, astride, bt, true); break;
                case 2: TL_Q8_STEP(0, 2, 6, at, astride, bt, true); break;
                default: TL_Q8_STEP(0, 3, 7, at, astride, bt, true); break;
            }
        } else if ((t - t0) & 1) {
            TL_Q8_STEP(0, 3, 5, at, astride, bt, false);
        } else {
            TL_Q8_STEP(0, 2, 4, at, astride, bt, false);
        }
    }
    _tile_stored(0, out, 64);
}

void tiles_q8(const tl_linear* L, const int8_t* B, int AB, int m, int n0, bool resident, int32_t* cb) {
    const int K = L->k, NT = K / 64, NA = K / AB, spb = AB / 64, MB = (m + 15) / 16;
    const int nr = L->n - n0 < 16 ? L->n - n0 : 16;
    const int64_t row_bytes = K;
    const uint8_t* A = (const uint8_t*)L->w + (int64_t)n0 * row_bytes;
    thread_local std::vector<uint8_t> pad;   // a last strip of fewer than 16 rows, zero-padded (no read past the model)
    if (nr < 16) {
        pad.assign((size_t)16 * row_bytes, 0);
        memcpy(pad.data(), A, (size_t)nr * row_bytes);
        A = pad.data();
    }
    for (int b = 0; b < MB; ++b)
        for (int a = 0; a < NA; ++a)
            q8_block(A, row_bytes, B + (size_t)b * NT * 1024, a * spb, (a + 1) * spb, resident && MB == 1,
                     cb + ((size_t)b * NA + a) * 256);
}

// a strip's outputs from its sums cb (tiles_q8), one input row at a time
void epilogue_q8(const tl_linear* L, int AB, const float* xd, const float* xs, const float* X, int m, int n0,
                 const int32_t* cb, float* y, int ldy) {
    const int K = L->k, NA = K / AB, NG = K / L->group, NG8 = NG / 8 * 8;
    const int nr = L->n - n0 < 16 ? L->n - n0 : 16;
    thread_local std::vector<float> szv;
    szv.resize((size_t)2 * NG * 16);
    // the strip's weight scales and zero points (- 128) per group, the 16 weight rows side by side
    float* sv = szv.data();
    float* zv = sv + (size_t)NG * 16;
    const __mmask16 live = (__mmask16)((1u << nr) - 1);
    if (NG == 1) {
        _mm512_storeu_ps(sv, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, L->scales + n0)));
        _mm512_storeu_ps(zv, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, L->zeros + n0))),
                                           _mm512_set1_ps(128.f)));
    } else {
        for (int w = 0; w < 16; ++w)
            for (int g = 0; g < NG; ++g) {
                const bool in = w < nr;
                sv[(size_t)g * 16 + w] = in ? f16_to_f32(L->scales[(int64_t)(n0 + w) * NG + g]) : 0.f;
                zv[(size_t)g * 16 + w] = in ? (float)L->zeros[(int64_t)(n0 + w) * NG + g] - 128.f : 0.f;
            }
    }
    const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    for (int r = 0; r < m; ++r) {
        const int b = r / 16, br = r % 16;
        const __m512i idx = _mm512_add_epi32(col, _mm512_set1_epi32(br));
        __m512 t = _mm512_setzero_ps();
        for (int a = 0; a < NA; ++a) {
            __m512i I = _mm512_i32gather_epi32(idx, cb + ((size_t)b * NA + a) * 256, 4);
            I = _mm512_sub_epi32(I, _mm512_set1_epi32(128 * (int32_t)xs[(int64_t)r * NA + a]));   // sum (c - 128) q
            const int g = a * AB / L->group;
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(_mm512_set1_ps(xd[(int64_t)r * NA + a]),
                                                                      _mm512_loadu_ps(sv + (size_t)g * 16)), t);
        }
        const float* Xr = X + (int64_t)r * NG;
        __m512 part[8];
        for (int l = 0; l < 8; ++l) part[l] = _mm512_setzero_ps();
        for (int g = 0; g < NG8; g += 8)
            for (int l = 0; l < 8; ++l)
                part[l] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(sv + (size_t)(g + l) * 16), _mm512_loadu_ps(zv + (size_t)(g + l) * 16)),
                                          _mm512_set1_ps(Xr[g + l]), part[l]);
        __m512 corr = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(part[0], part[4]), _mm512_add_ps(part[2], part[6])),
                                    _mm512_add_ps(_mm512_add_ps(part[1], part[5]), _mm512_add_ps(part[3], part[7])));
        for (int g = NG8; g < NG; ++g)
            corr = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(sv + (size_t)g * 16), _mm512_loadu_ps(zv + (size_t)g * 16)),
                                   _mm512_set1_ps(Xr[g]), corr);
        _mm512_mask_storeu_ps(y + (int64_t)r * ldy + n0, live, _mm512_sub_ps(t, corr));
    }
}
}  // namespace

void amx_rows_q8(const tl_linear* L, int AB, const int8_t* xq, const float* xd, const float* xs, const float* X,
                 int m, float* y, int ldy) {
    thread_local std::vector<int8_t> Bv;   // the calling thread's; the workers read it during the call
    fill_b(xq, m, L->k, false, Bv);
    const int8_t* B = Bv.data();
    const int NT = L->k / 64;
    const bool resident = NT <= 4 && m <= 16;
    // weight rows a unit of work: 16 strips, so that the pipeline below runs long (2 strips a unit: 1.2x the time)
    constexpr int UNIT = 256;
    tl_parallel_for((L->n + UNIT - 1) / UNIT, [&](int c, int) {
        load_config_q8(NT, resident);   // (every unit: see amx_rows)
        if (resident)
            for (int t = 0; t < NT; ++t) switch (t) {
                case 0: _tile_loadd(4, B, 64); break;
                case 1: _tile_loadd(5, B + 1024, 64); break;
                case 2: _tile_loadd(6, B + 2048, 64); break;
                default: _tile_loadd(7, B + 3072, 64); break;
            }
        // software-pipelined: a strip's products are issued before the previous strip's epilogue reads its
        // sums (stored one strip earlier), so the tile unit and the vector units work side by side
        thread_local std::vector<int32_t> cbv;
        const size_t per = (size_t)((m + 15) / 16) * (L->k / AB) * 256;
        cbv.resize(2 * per);
        const int first = c * UNIT, last = std::min(L->n, (c + 1) * UNIT);
        int i = 0;
        for (int n0 = first; n0 < last; n0 += 16, ++i) {
            tiles_q8(L, B, AB, m, n0, resident, cbv.data() + (i & 1) * per);
            if (n0 > first) epilogue_q8(L, AB, xd, xs, X, m, n0 - 16, cbv.data() + ((i - 1) & 1) * per, y, ldy);
        }
        if (i > 0) epilogue_q8(L, AB, xd, xs, X, m, first + 16 * (i - 1), cbv.data() + ((i - 1) & 1) * per, y, ldy);
        _tile_release();
    });
}

void amx_rows(const tl_linear* L, int AB, const int8_t* xq, const float* xd, const float* X, int m, float* y,
              int ldy) {
    thread_local Prep P;   // the calling thread's; the workers read it during the call
    const int K = L->k, G = L->group;
    P.K = K, P.NT = K / 64, P.AB = AB, P.NA = K / AB, P.NG = K / G, P.MB = (m + 15) / 16, P.split = AB == 32;
    const int NT = P.NT, NA = P.NA, NG = P.NG, MB = P.MB;
    fill_b(xq, m, K, P.split, P.B);
    P.dT.assign((size_t)MB * NA * 16, 0.f);
    P.XT.assign((size_t)MB * NG * 16, 0.f);
    P.ga.resize(NA);
    for (int a = 0, g = 0, gend = G; a < NA; ++a) {   // (by counting: blocks lie within groups)
        while (a * AB >= gend) { ++g; gend += G; }
        P.ga[a] = g;
    }
    for (int r = 0; r < m; ++r) {
        const int b = r / 16, br = r % 16;
        for (int a = 0; a < NA; ++a) P.dT[((size_t)b * NA + a) * 16 + br] = xd[(int64_t)r * NA + a];
        for (int g = 0; g < NG; ++g) P.XT[((size_t)b * NG + g) * 16 + br] = X[(int64_t)r * NG + g];
    }
    const Prep& PP = P;   // (a thread_local is not captured: each worker would see its own)
    constexpr int UNIT = 32;   // weight rows a unit of work: two strips
    tl_parallel_for((L->n + UNIT - 1) / UNIT, [&](int c, int) {
        // configured every unit (~44 ns): another library on this thread (oneDNN's AMX kernels under
        // PyTorch) may have loaded its own configuration since; released after, for the same reason
        load_config(PP.split);
        for (int n0 = c * UNIT; n0 < L->n && n0 < (c + 1) * UNIT; n0 += 16) strip(L, PP, n0, y, ldy, m);
        _tile_release();
    });
}
#else
void amx_rows(const tl_linear*, int, const int8_t*, const float*, const float*, int, float*, int) {
    abort();   // amx_ready() is false in this build
}
void amx_rows_q8(const tl_linear*, int, const int8_t*, const float*, const float*, const float*, int, float*, int) {
    abort();
}
#endif
