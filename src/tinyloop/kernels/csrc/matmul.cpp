// Linear layers y (m, n) = x (m, k) W^T for every weight format, fp32 activations and accumulation.
// Weight-stationary: each thread owns a range of output rows n and streams those weights once for all m
// input rows (a decode step's rows, or a prefill chunk in tiles of MR rows).
//
// Quantized weights are read in the project's portable layout (quant/packing.py) as they lie in the file:
// per 8-byte chunk, byte j holds the codes of columns c0 + per*j + i (i = 0 .. per-1, per = 8 / bits) at
// bit bits*i. `permute_x` reorders each input row once per call so that lane j of sub-vector i is
// column c0 + per*j + i; then sum_k (q - z) s x = s * (sum_k q x) - s * z * (sum of x over the group).
#include "tinyloop.h"
#include "amx.h"
#include "intdot.h"
#include "threads.h"
#include "vec.h"
#include <algorithm>
#include <vector>

namespace {
constexpr int CHUNK = 32;   // output rows per unit of work the threads share
constexpr int PF = 4;       // float weights: prefetch this many tiles ahead
static inline vf load_w(int kind, const void* w, int64_t i) {
    if (kind == TL_F32) return vload((const float*)w + i);
    if (kind == TL_F16) return vload_f16((const uint16_t*)w + i);
    return vload_bf16((const uint16_t*)w + i);
}

static inline void tl_prefetch(const void* w, int kind, int64_t i) {
#if TL_SIMD
    _mm_prefetch((const char*)w + i * (kind == TL_F32 ? 4 : 2), _MM_HINT_T0);
#else
    (void)w; (void)kind; (void)i;
#endif
}

// float weights: rows [n0, n1) of W against MR input rows, NR weight rows at a time (MR * NR independent
// accumulators; compile-time sizes keep them in registers)
template <int KIND, int MR, int NR>
void float_tile(const tl_linear* L, const float* x, float* y, int ldy, int n0, int n1) {
    const int K = L->k;
    int n = n0;
    for (; n + NR <= n1; n += NR) {
        vf acc[MR][NR];
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NR; ++j) acc[r][j] = vzero();
        for (int k = 0; k < K; k += TL_W) {
            if (k % 32 == 0)   // the next NR rows, a cache line per row at a time (the streams a head reads)
                for (int j = 0; j < NR; ++j) tl_prefetch(L->w, KIND, (int64_t)(n + PF * NR + j) * K + k);
            vf w[NR];
            for (int j = 0; j < NR; ++j) w[j] = load_w(KIND, L->w, (int64_t)(n + j) * K + k);
            for (int r = 0; r < MR; ++r) {
                vf xv = vload(x + (int64_t)r * K + k);
                for (int j = 0; j < NR; ++j) acc[r][j] = vfma(w[j], xv, acc[r][j]);
            }
        }
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NR; ++j) y[(int64_t)r * ldy + n + j] = vsum(acc[r][j]);
    }
    if (NR > 1 && n < n1) float_tile<KIND, MR, 1>(L, x, y, ldy, n, n1);
}

#if TL_SIMD
// One input row (a GEMV), eight weight rows at a time, eight sums finished by one vsum8. Every output is
// one accumulator over k in order, finished by vsum's order: what float_tile computes for it at any tile
// shape, so a row's result does not depend on the rows beside it (batch invariance). The eight rows are read
// side by side, the rows a few blocks on prefetched a cache line per row at a time: two blocks on for weights
// in cache (a looped block's layers, re-read every loop), 32 KB on for weights streamed from memory (a head, a
// big model's layers). (Until session 20 a streamed row was read alone with four accumulators, which made its
// sums differ from the tiles' in the last bits; 1.0-1.15x its time on the shipped fp16 head, 1.03x on the
// 1.4B real shape's bf16 head, both noisy.)
constexpr int64_t STREAM_BYTES = 4 << 20;

template <int KIND>
void float_gemv(const tl_linear* L, const float* x, float* y, int n0, int n1) {
    constexpr int ES = KIND == TL_F32 ? 4 : 2;   // bytes per weight
    const int K = L->k;
    const bool stream = (int64_t)L->n * K * ES > STREAM_BYTES;
    int n = n0;
    for (; n + 8 <= n1; n += 8) {
        vf acc[8];
        const int64_t base = (int64_t)n * K;
        for (int j = 0; j < 8; ++j) acc[j] = vzero();
        // the rows `ahead` rows on, a cache line per row at a time: two blocks in cache; streamed, at least
        // 32 KB on (the streams' next lines must be on their way well before they are read)
        const int ahead = stream ? std::max(16, 32768 / (K * ES) / 8 * 8) : 16;
        for (int k = 0; k < K; k += TL_W) {
            if ((k * ES) % 64 == 0)
                for (int j = 0; j < 8; ++j) tl_prefetch(L->w, KIND, base + (int64_t)(ahead + j) * K + k);
            const vf xv = vload(x + k);
            for (int j = 0; j < 8; ++j) acc[j] = vfma(load_w(KIND, L->w, base + (int64_t)j * K + k), xv, acc[j]);
        }
        vstore(y + n, vsum8(acc));
    }
    if (n < n1) float_tile<KIND, 1, 1>(L, x, y, 0, n, n1);
}
#endif

#if TL_SIMD && defined(__AVX512F__) && defined(__AVX512DQ__)
#define TL_WIDE_TILE 1
// float_tile on 512-bit vectors: two weight rows' eight lanes side by side in one vector, against the input
// row's eight lanes twice, so each lane holds the accumulator float_tile forms for that output (over k in
// order, finished by vsum): the same bits as every other tile shape and the AVX2 build, half the multiply-adds'
// instructions. MR input rows, 2 NP weight rows at a time.
template <int KIND, int MR, int NP>
void float_tile_wide(const tl_linear* L, const float* x, float* y, int ldy, int n0, int n1) {
    const int K = L->k;
    int n = n0;
    for (; n + 2 * NP <= n1; n += 2 * NP) {
        __m512 acc[MR][NP];
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
        for (int k = 0; k < K; k += TL_W) {
            if (k % 32 == 0)
                for (int j = 0; j < 2 * NP; ++j) tl_prefetch(L->w, KIND, (int64_t)(n + PF * 2 * NP + j) * K + k);
            __m512 w[NP];
            for (int j = 0; j < NP; ++j)
                w[j] = _mm512_insertf32x8(_mm512_castps256_ps512(load_w(KIND, L->w, (int64_t)(n + 2 * j) * K + k)),
                                          load_w(KIND, L->w, (int64_t)(n + 2 * j + 1) * K + k), 1);
            for (int r = 0; r < MR; ++r) {
                const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (int64_t)r * K + k));
                for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(w[j], xv, acc[r][j]);
            }
        }
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NP; ++j) {
                y[(int64_t)r * ldy + n + 2 * j] = vsum(_mm512_castps512_ps256(acc[r][j]));
                y[(int64_t)r * ldy + n + 2 * j + 1] = vsum(_mm512_extractf32x8_ps(acc[r][j], 1));
            }
    }
    if (n < n1) float_tile<KIND, MR, 1>(L, x, y, ldy, n, n1);
}

// 16-bit weights against many input rows (a prefill chunk): a work unit's weight rows converted to fp32 once,
// eight rows at a time laid out as float_tile_wide reads them (per 8-column step, four vectors of two rows'
// eight lanes each), then MR input rows x 8 weight rows a tile: 4 MR multiply-adds per step against 4 loads
// and MR broadcasts, no conversion or lane insert in the loop (float_tile_wide's on-the-fly ones held it to
// about one multiply-add a cycle). Each output is the same accumulator over k in order, finished by vsum8
// (lane j = vsum of accumulator j): the same bits as every tile shape, the one-row product and the AVX2 build.
constexpr int WIDE_PANEL_ROWS = 24;   // fewest input rows that take it (below, converting the unit is not repaid)

template <int KIND>
void wide_panel(const tl_linear* L, int n, int nr8, float* wp) {   // rows [n, n + 8 nr8) into wp
    const int K = L->k, S = K / TL_W;
    for (int o = 0; o < nr8; ++o)
        for (int j = 0; j < 4; ++j)
            for (int h = 0; h < 2; ++h) {
                const int64_t row = (int64_t)(n + 8 * o + 2 * j + h) * K;
                float* dst = wp + (int64_t)o * S * 64 + 16 * j + 8 * h;
                for (int s = 0; s < S; ++s) vstore(dst + (int64_t)s * 64, load_w(KIND, L->w, row + (int64_t)s * TL_W));
            }
}

template <int MR>
void wide_panel_tile(const float* wp, int K, const float* x, float* y, int ldy) {   // 8 outputs x MR rows
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += TL_W, wp += 64) {
        const __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
        const __m512 w2 = _mm512_loadu_ps(wp + 32), w3 = _mm512_loadu_ps(wp + 48);
        for (int r = 0; r < MR; ++r) {
            const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (int64_t)r * K + k));
            acc[r][0] = _mm512_fmadd_ps(w0, xv, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, xv, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(w2, xv, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(w3, xv, acc[r][3]);
        }
    }
    for (int r = 0; r < MR; ++r) {
        vf h[8];
        for (int j = 0; j < 4; ++j) {
            h[2 * j] = _mm512_castps512_ps256(acc[r][j]);
            h[2 * j + 1] = _mm512_extractf32x8_ps(acc[r][j], 1);
        }
        vstore(y + (int64_t)r * ldy, vsum8(h));
    }
}

template <int KIND>
void float_rows_wide(const tl_linear* L, const float* x, int m, float* y, int ldy, int n0, int n1) {
    const int K = L->k, nr8 = (n1 - n0) / 8, n8 = n0 + 8 * nr8;
    thread_local std::vector<float> buf;   // per pool thread, kept between calls
    if (nr8) {
        if (buf.size() < (size_t)nr8 * 8 * K + 16) buf.resize((size_t)nr8 * 8 * K + 16);
        float* wp = buf.data() + (16 - ((uintptr_t)buf.data() / 4) % 16) % 16;   // (64-byte aligned: one line a load)
        wide_panel<KIND>(L, n0, nr8, wp);
        int mt = 0;
        for (; mt + 6 <= m; mt += 6)
            for (int o = 0; o < nr8; ++o)
                wide_panel_tile<6>(wp + (int64_t)o * 8 * K, K, x + (int64_t)mt * K, y + (int64_t)mt * ldy + n0 + 8 * o, ldy);
        for (int o = 0; o < nr8; ++o) {
            const float* w = wp + (int64_t)o * 8 * K;
            const float* xt = x + (int64_t)mt * K;
            float* yt = y + (int64_t)mt * ldy + n0 + 8 * o;
            switch (m - mt) {
                case 5: wide_panel_tile<5>(w, K, xt, yt, ldy); break;
                case 4: wide_panel_tile<4>(w, K, xt, yt, ldy); break;
                case 3: wide_panel_tile<3>(w, K, xt, yt, ldy); break;
                case 2: wide_panel_tile<2>(w, K, xt, yt, ldy); break;
                case 1: wide_panel_tile<1>(w, K, xt, yt, ldy); break;
                default: break;
            }
        }
    }
    if (n8 < n1) {   // the unit's last rows (fewer than eight)
        int mt = 0;
        for (; mt + 4 <= m; mt += 4) float_tile<KIND, 4, 1>(L, x + (int64_t)mt * K, y + (int64_t)mt * ldy, ldy, n8, n1);
        for (; mt < m; ++mt) float_tile<KIND, 1, 1>(L, x + (int64_t)mt * K, y + (int64_t)mt * ldy, ldy, n8, n1);
    }
}
#else
#define TL_WIDE_TILE 0
#endif

template <int KIND>
void float_rows(const tl_linear* L, const float* x, int m, float* y, int ldy, int n0, int n1) {
    const int K = L->k;
#if TL_SIMD
    if (m == 1) return float_gemv<KIND>(L, x, y, n0, n1);
#endif
    int mt = 0;
#if TL_WIDE_TILE
    if (KIND != TL_F32 && m >= WIDE_PANEL_ROWS) return float_rows_wide<KIND>(L, x, m, y, ldy, n0, n1);
    for (; mt + 8 <= m; mt += 8) float_tile_wide<KIND, 8, 2>(L, x + (int64_t)mt * K, y + (int64_t)mt * ldy, ldy, n0, n1);
#endif
    for (; mt + 4 <= m; mt += 4) float_tile<KIND, 4, 2>(L, x + (int64_t)mt * K, y + (int64_t)mt * ldy, ldy, n0, n1);
    const float* xt = x + (int64_t)mt * K;
    float* yt = y + (int64_t)mt * ldy;
    switch (m - mt) {
        case 1: float_tile<KIND, 1, 4>(L, xt, yt, ldy, n0, n1); break;
        case 2: float_tile<KIND, 2, 4>(L, xt, yt, ldy, n0, n1); break;
        case 3: float_tile<KIND, 3, 2>(L, xt, yt, ldy, n0, n1); break;
        default: break;
    }
}

// quantized weights (codes of BITS bits): rows [n0, n1) against MR permuted input rows xp with group sums
// xs (m, k / group), NR weight rows at a time
template <int BITS, int MR, int NR>
void quant_tile(const tl_linear* L, const float* xp, const float* xs, float* y, int ldy, int n0, int n1) {
    constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1;
    const int K = L->k, G = L->group, NG = K / G;
    const int64_t row_bytes = (int64_t)K * BITS / 8;
    const uint8_t* codes = (const uint8_t*)L->w;
    int n = n0;
    for (; n + NR <= n1; n += NR) {
        vf tot[MR][NR];
        float corr[MR][NR];
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NR; ++j) { tot[r][j] = vzero(); corr[r][j] = 0.f; }
        for (int g = 0; g < NG; ++g) {
            vf ga[MR][NR], gb[MR][NR];
            for (int r = 0; r < MR; ++r)
                for (int j = 0; j < NR; ++j) { ga[r][j] = vzero(); gb[r][j] = vzero(); }
            // a group is G codes = G * BITS / 8 bytes, in chunks of TL_W bytes (TL_W * PER codes)
            for (int c = g * G; c < (g + 1) * G; c += TL_W * PER) {
                vi b[NR];
                for (int j = 0; j < NR; ++j) b[j] = vload_u8(codes + (int64_t)(n + j) * row_bytes + (int64_t)c * BITS / 8);
                for (int i = 0; i < PER; ++i) {
                    vf w[NR];
                    for (int j = 0; j < NR; ++j) w[j] = vcodes(b[j], BITS * i, MASK);
                    for (int r = 0; r < MR; ++r) {
                        vf xv = vload(xp + (int64_t)r * K + c + i * TL_W);
                        for (int j = 0; j < NR; ++j) {
                            if (i & 1) gb[r][j] = vfma(w[j], xv, gb[r][j]);
                            else ga[r][j] = vfma(w[j], xv, ga[r][j]);
                        }
                    }
                }
            }
            for (int j = 0; j < NR; ++j) {
                const float s = f16_to_f32(L->scales[(int64_t)(n + j) * NG + g]);
                const float sz = group_sz(L, n + j, g, s, 0.f);   // s z, or -min (intdot.h)
                vf vs = vset1(s);
                for (int r = 0; r < MR; ++r) {
                    tot[r][j] = vfma(vs, vadd(ga[r][j], gb[r][j]), tot[r][j]);
                    corr[r][j] += sz * xs[(int64_t)r * NG + g];
                }
            }
        }
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NR; ++j) y[(int64_t)r * ldy + n + j] = vsum(tot[r][j]) - corr[r][j];
    }
    if (NR > 1 && n < n1) quant_tile<BITS, MR, 1>(L, xp, xs, y, ldy, n, n1);
}

template <int BITS>
void quant_rows(const tl_linear* L, const float* xp, const float* xs, int m, float* y, int ldy, int n0, int n1) {
    const int K = L->k, NG = K / L->group;
    int mt = 0;
    for (; mt + 3 <= m; mt += 3)
        quant_tile<BITS, 3, 1>(L, xp + (int64_t)mt * K, xs + (int64_t)mt * NG, y + (int64_t)mt * ldy, ldy, n0, n1);
    const float* xt = xp + (int64_t)mt * K;
    const float* st = xs + (int64_t)mt * NG;
    float* yt = y + (int64_t)mt * ldy;
    switch (m - mt) {
        case 1: quant_tile<BITS, 1, 2>(L, xt, st, yt, ldy, n0, n1); break;
        case 2: quant_tile<BITS, 2, 1>(L, xt, st, yt, ldy, n0, n1); break;
        default: break;
    }
}

int bits_of(int kind) { return kind == TL_Q8 ? 8 : kind == TL_Q4 ? 4 : 2; }


#if TL_SIMD
// Many input rows (a batch of decode rows, a head over them, a prefill chunk): outer products, as a GEMM
// micro-kernel does. x is transposed once per call into xt (k, MP) (MP = m rounded up to 8, zero rows
// added; quantized kinds in the permuted column order above). Each thread turns NR weight rows at a time
// into fp32 (converted, or dequantized (q - z) * s) in a small buffer wb (NR, k), then for every 16 rows
// of xt keeps NR x 2 accumulators of 8 rows each: per column, two loads of xt, NR broadcasts of wb, 2 NR
// FMAs, and no horizontal sums. Measured on the shipped model's shapes (m = 16, one thread, thread CPU
// time, against the dot-product tiles): fp16 1.07-1.45x, int4 1.6-1.75x, the int8 head 2.16x (fp16 53-66
// GFLOP/s; this core's FMA peak: ~90).
constexpr int PNR = 6;           // weight rows per micro-tile
// Fewer input rows than this take the dot-product tiles (below it the transposes and the padding to 8 rows
// cost more than the panels save): float weights from 12 rows, quantized ones from 6 (measured one thread,
// thread CPU time: int4 768 x 256 panels/tiles 0.84x at 5 rows, 1.04x at 6, 1.20x at 7; fp16 1536 x 256
// 0.88x at 8, 1.08x at 12, 1.45x at 16). Layers with int8 activations keep their integer tiles (or AMX)
// at every row count, for batch invariance (their 4 x 2 tiles took 0.84-1.29x the panels' time at 16 rows
// and 0.86-1.12x at 24, session 12). `panel_forced` (tests): every layer's.
int panel_forced = 0;
// Batch-invariant mode (`tl_set_batch_invariant`, on by default; lib.py turns it off for
// TINYLOOP_BATCH_INVARIANT=0): no layer takes the panels, so every output of every layer is reduced in its
// kernel's one fixed order (the float and fp32-activation tiles and the one-row products share one; the
// integer kernels have their own canonical one) and a row's result does not depend on how many rows share
// the call. Off, 16-bit and fp32-activation quantized layers take the panels from 12 / 6 rows.
int batch_invariant = 1;

static inline int panel_min_rows(const tl_linear* L) {
    if (panel_forced) return panel_forced;
    if (batch_invariant) return 1 << 30;
    // int8 activations never take the panels by themselves: the panels' fp32 sums would make a row's result
    // depend on how many rows share the call (the tiles' canonical reduction does not)
    return L->kind <= TL_BF16 ? 12 : int8_activations(L) ? 1 << 30 : 6;
}

// rows [n, n + nr) of W as fp32 into wb (nr, K), in xt's column order
template <int KIND>
void weights_fp32(const tl_linear* L, int n, int nr, float* wb) {
    const int K = L->k;
    if (KIND <= TL_BF16) {
        for (int j = 0; j < nr; ++j)
            for (int k = 0; k < K; k += TL_W)
                vstore(wb + (int64_t)j * K + k, load_w(KIND, L->w, (int64_t)(n + j) * K + k));
        return;
    }
    constexpr int BITS = KIND == TL_Q8 ? 8 : KIND == TL_Q4 ? 4 : 2, PER = 8 / BITS, MASK = (1 << BITS) - 1;
    const int G = L->group, NG = K / G;
    const int64_t row_bytes = (int64_t)K * BITS / 8;
    const uint8_t* codes = (const uint8_t*)L->w;
    for (int j = 0; j < nr; ++j) {
        const uint8_t* row = codes + (int64_t)(n + j) * row_bytes;
        float* out = wb + (int64_t)j * K;
        for (int g = 0; g < NG; ++g) {
            const float s = f16_to_f32(L->scales[(int64_t)(n + j) * NG + g]);
            const vf vs = vset1(s), vzs = vset1(-group_sz(L, n + j, g, s, 0.f));   // -s z, or +min
            for (int c = g * G; c < (g + 1) * G; c += TL_W * PER) {
                const vi b = vload_u8(row + (int64_t)c * BITS / 8);
                for (int i = 0; i < PER; ++i) vstore(out + c + i * TL_W, vfma(vcodes(b, BITS * i, MASK), vs, vzs));
            }
        }
    }
}

// tb (NR, MP) [rows r0 .. r0 + 8 MV) = wb (NR, K) . xt (K, MP) [r0 .. r0 + 8 MV)
template <int NR, int MV>
void panel_tile(const float* wb, int K, const float* xt, int MP, int r0, float* tb) {
    vf acc[NR][MV];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
        for (int v = 0; v < MV; ++v) acc[j][v] = vzero();
    const float* xp = xt + r0;
    for (int k = 0; k < K; ++k) {
        vf xv[MV];
#pragma GCC unroll 2
        for (int v = 0; v < MV; ++v) xv[v] = vload(xp + (int64_t)k * MP + TL_W * v);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            const vf wv = _mm256_broadcast_ss(wb + (int64_t)j * K + k);
#pragma GCC unroll 2
            for (int v = 0; v < MV; ++v) acc[j][v] = vfma(wv, xv[v], acc[j][v]);
        }
    }
    // stored whole (a lane loop here makes GCC keep the accumulators in memory)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
        for (int v = 0; v < MV; ++v) vstore(tb + (int64_t)j * MP + r0 + TL_W * v, acc[j][v]);
}

template <int NR>
void panel_rows(const float* wb, int K, const float* xt, int MP, float* tb) {
    int r0 = 0;
    for (; r0 + 2 * TL_W <= MP; r0 += 2 * TL_W) panel_tile<NR, 2>(wb, K, xt, MP, r0, tb);
    if (r0 < MP) panel_tile<NR, 1>(wb, K, xt, MP, r0, tb);
}

// xt is kept in slabs of `slab` input rows (the last one shorter), each (K, rows in it): a slab and a
// six-row weight block stay in cache while the micro-tiles run, however many rows the call has
static inline int panel_slab(int K) {
    const int rows = (32768 / K) / (2 * TL_W) * (2 * TL_W);   // ~128 KB of fp32 per slab
    return rows < 2 * TL_W ? 2 * TL_W : rows > 64 ? 64 : rows;
}

template <int KIND>
void panel_chunk(const tl_linear* L, const float* xt, int m, int MP, float* y, int ldy, int n0, int n1) {
    const int K = L->k, slab = panel_slab(K);
    thread_local std::vector<float> wb, tb;   // per pool thread, kept between calls
    if (wb.size() < (size_t)PNR * K) wb.resize((size_t)PNR * K);
    if (tb.size() < (size_t)(n1 - n0) * slab) tb.resize((size_t)(n1 - n0) * slab);
    for (int s0 = 0; s0 < MP; s0 += slab) {
        const int ms = std::min(slab, MP - s0);          // rows of this slab (a multiple of 8)
        const float* xs = xt + (int64_t)K * s0;
        for (int n = n0; n < n1; n += PNR) {
            const int nr = std::min(PNR, n1 - n);
            float* t = tb.data() + (int64_t)(n - n0) * ms;
            weights_fp32<KIND>(L, n, nr, wb.data());
            switch (nr) {
                case 6: panel_rows<6>(wb.data(), K, xs, ms, t); break;
                case 5: panel_rows<5>(wb.data(), K, xs, ms, t); break;
                case 4: panel_rows<4>(wb.data(), K, xs, ms, t); break;
                case 3: panel_rows<3>(wb.data(), K, xs, ms, t); break;
                case 2: panel_rows<2>(wb.data(), K, xs, ms, t); break;
                default: panel_rows<1>(wb.data(), K, xs, ms, t); break;
            }
        }
        // the chunk's outputs, a row at a time (one run of n1 - n0 floats each; column by column would
        // touch a cache line, and for a head a page, per value)
        const int rows = std::min(ms, m - s0);
        for (int r = 0; r < rows; ++r) {
            float* yr = y + (int64_t)(s0 + r) * ldy + n0;
            for (int j = 0; j < n1 - n0; ++j) yr[j] = tb[(int64_t)j * ms + r];
        }
    }
}

void panel_rows_all(const tl_linear* L, const float* x, int m, float* y, int ldy) {
    const int K = L->k, MP = (m + TL_W - 1) / TL_W * TL_W, slab = panel_slab(K);
    thread_local std::vector<float> xt;    // the calling thread's
    xt.assign((size_t)K * MP, 0.f);
    // input row r, column k -> its slab's (K, ms) block
    auto at = [&](int r, int k) -> float& {
        const int s0 = r / slab * slab, ms = std::min(slab, MP - s0);
        return xt[(size_t)K * s0 + (size_t)k * ms + (r - s0)];
    };
    if (L->kind <= TL_BF16) {
        for (int r = 0; r < m; ++r)
            for (int k = 0; k < K; ++k) at(r, k) = x[(int64_t)r * K + k];
    } else {   // the permuted column order the dequantized weights come in
        const int per = 8 / bits_of(L->kind), chunk = TL_W * per;
        thread_local std::vector<float> xr;
        xr.resize(K);
        for (int r = 0; r < m; ++r) {
            const float* src = x + (int64_t)r * K;
            if (int8_activations(L)) {   // the int8 activations the integer kernels use, as floats: a row's result
                const int AB = act_block(L->group);   // does not depend on how many rows share the call
                for (int a = 0; a < K / AB; ++a) q8_roundtrip(src + a * AB, AB, xr.data() + a * AB);
                src = xr.data();
            }
            for (int c0 = 0; c0 < K; c0 += chunk)
                for (int i = 0; i < per; ++i)
                    for (int j = 0; j < TL_W; ++j) at(r, c0 + i * TL_W + j) = src[c0 + per * j + i];
        }
    }
    constexpr int PCHUNK = 8 * PNR;
    const float* xtp = xt.data();   // (a thread_local is not captured: each thread would see its own)
    tl_parallel_for((L->n + PCHUNK - 1) / PCHUNK, [&](int c, int) {
        const int n0 = c * PCHUNK, n1 = std::min(L->n, (c + 1) * PCHUNK);
        switch (L->kind) {
            case TL_F32: panel_chunk<TL_F32>(L, xtp, m, MP, y, ldy, n0, n1); break;
            case TL_F16: panel_chunk<TL_F16>(L, xtp, m, MP, y, ldy, n0, n1); break;
            case TL_BF16: panel_chunk<TL_BF16>(L, xtp, m, MP, y, ldy, n0, n1); break;
            case TL_Q8: panel_chunk<TL_Q8>(L, xtp, m, MP, y, ldy, n0, n1); break;
            case TL_Q4: panel_chunk<TL_Q4>(L, xtp, m, MP, y, ldy, n0, n1); break;
            default: panel_chunk<TL_Q2>(L, xtp, m, MP, y, ldy, n0, n1); break;
        }
    });
}
#endif
}  // namespace

// x (m, k) -> xp (m, k) in the chunk order above, xs (m, k / group) group sums
void tl_permute(const tl_linear* L, const float* x, int m, float* xp, float* xs) {
    const int K = L->k, G = L->group, bits = bits_of(L->kind), per = 8 / bits, chunk = TL_W * per;
    for (int r = 0; r < m; ++r) {
        const float* xr = x + (int64_t)r * K;
        float* pr = xp + (int64_t)r * K;
        for (int c0 = 0; c0 < K; c0 += chunk)
            for (int i = 0; i < per; ++i)
                for (int j = 0; j < TL_W; ++j) pr[c0 + i * TL_W + j] = xr[c0 + per * j + i];
        for (int g = 0; g < K / G; ++g) {
            float s = 0.f;
            for (int c = g * G; c < (g + 1) * G; ++c) s += xr[c];
            xs[(int64_t)r * (K / G) + g] = s;
        }
    }
}

// y[:, 0:n] with row stride ldy; runs on the pool. scratch (quantized kinds): m * k + m * k / 8 floats.
static void linear_rows(const tl_linear* L, const float* x, int m, float* y, int ldy, float* scratch) {
#if TL_SIMD
    if (m >= panel_min_rows(L)) return panel_rows_all(L, x, m, y, ldy);
    if (int8_activations(L)) return qq_linear_rows(L, x, m, y, ldy, scratch);
#endif
    const float* xp = x;
    const float* xs = nullptr;
    if (L->kind > TL_BF16) {
        tl_permute(L, x, m, scratch, scratch + (int64_t)m * L->k);
        xp = scratch;
        xs = scratch + (int64_t)m * L->k;
    }
    tl_parallel_for((L->n + CHUNK - 1) / CHUNK, [&](int c, int) {
        const int n0 = c * CHUNK, n1 = std::min(L->n, (c + 1) * CHUNK);
        switch (L->kind) {
            case TL_F32: float_rows<TL_F32>(L, x, m, y, ldy, n0, n1); break;
            case TL_F16: float_rows<TL_F16>(L, x, m, y, ldy, n0, n1); break;
            case TL_BF16: float_rows<TL_BF16>(L, x, m, y, ldy, n0, n1); break;
            case TL_Q8: quant_rows<8>(L, xp, xs, m, y, ldy, n0, n1); break;
            case TL_Q4: quant_rows<4>(L, xp, xs, m, y, ldy, n0, n1); break;
            default: quant_rows<2>(L, xp, xs, m, y, ldy, n0, n1); break;
        }
    });
}

void tl_linear_rows(const tl_linear* L, const float* x, int m, float* y, int ldy, float* scratch) {
    linear_rows(L, x, m, y, ldy, scratch);
    if (L->out_scale)   // (a per-token logit scale: y * s, the product model/looped.py logits forms)
        for (int r = 0; r < m; ++r)
            for (int j = 0; j < L->n; ++j) y[(int64_t)r * ldy + j] *= L->out_scale[j];
}

// batch-invariant mode on (1) or off (0); returns the old setting
extern "C" int32_t tl_set_batch_invariant(int32_t on) {
#if TL_SIMD
    const int old = batch_invariant;
    batch_invariant = on ? 1 : 0;
    return old;
#else
    (void)on;
    return 1;   // (the portable build has no panels: always invariant)
#endif
}

// the fewest input rows that take the outer-product path, for every layer (tests and benchmarks compare
// both paths); 0: each kind's own (above). Returns the old setting.
extern "C" int32_t tl_set_panel_min_rows(int32_t rows) {
#if TL_SIMD
    const int old = panel_forced;
    panel_forced = rows > 0 ? rows : 0;
    return old;
#else
    (void)rows;
    return 0;
#endif
}

extern "C" int tl_linear_forward(const tl_linear* L, const float* x, int32_t m, float* y, float* scratch) {
    if (L->k % TL_W) return 1;
    if (L->mins && L->kind != TL_Q4) return 2;   // the min form is int4's alone
    tl_linear_rows(L, x, m, y, L->n, scratch);
    return 0;
}
