// Integer dot products against int8 activations: the vector tiles (qq_tile, qq_rows8) and the dispatch to
// them or to the AMX tiles (amx.cpp). Every kernel computes the same canonical reduction (below), so a row's
// result is bitwise the same whatever kernel, tile or batch produced it.
#include "intdot.h"
#include "amx.h"
#include "threads.h"
#include <algorithm>
#include <cstring>
#include <vector>

#if TL_SIMD
namespace {
constexpr int CHUNK = 32;   // output rows per unit of work the threads share (as matmul.cpp's)

// x is quantized per block of AB columns (`act_block`: the
// weight group, or 256 columns of a longer one; 32 where the group is not whole 64s) to q = round(x / d),
// d = max|x| / 127 (`quantize_q8`), as llama.cpp's q8_K blocks do; the integer sums of a block then need
// one conversion to float and one multiply, not one per 32 columns.
// - int4: 32 code bytes hold 64 columns, even columns in the low nibbles, odd ones in the high; q is
//   stored per 64 columns evens first, then odds, so one 32-byte load and two masks meet two loads of q.
//   maddubs takes the codes c (unsigned) against q; its int16 pair sums (<= 2 * 15 * 127) are added
//   across up to 256 columns (4 steps of 2: <= 30480) before madd widens them to int32.
// - int8: c - 128 fits a signed byte; maddubs takes |c - 128| (unsigned) against q with the sign of c - 128
//   moved onto it (a pair of products stays within int16: 128 * 127 * 2 < 32768), widened at once.
// Then, with c' = c (int4) or c - 128 (int8) and z' = z (int4) or z - 128 (int8):
//   sum_k (c - z) s x ~= sum_a s_a d_a (sum_{k in a} c' q) - sum_g s_g z'_g X_g,  X_g = sum_{a in g} d_a sum q.
// With 32-column blocks (SPLIT: int4, and int8 in Q8_0's groups of 32 with its codes and activations in split8's
// order; int8 takes int8 activations where its groups are whole 32s) a 64-column step holds two of them: the low four int32 lanes of its sums are the first block's, the
// high four the second's, and the scales are applied as two halves. K is a multiple of 64, or (SPLIT) of 32: a
// last 32 columns are a block of their own (qq_tail32).
// (act_block: intdot.h)

// What every tile of one call shares, computed once per call (no division in the loops below): per span
// of S columns (SPLIT: 64, two 32-column blocks; else one activation block), the weight group of its
// first and of its second half.
struct QQPlan {
    int S = 0, NS = 0;
    std::vector<int> g0, g1;      // (NS) weight group of the span's first / second half
};

static void qq_plan(const tl_linear* L, bool split, QQPlan& P) {
    const int K = L->k, G = L->group, AB = act_block(G);
    P.S = split ? 64 : AB;
    P.NS = K / P.S;
    P.g0.resize(P.NS);
    P.g1.resize(P.NS);
    for (int s = 0, g = 0, gend = G; s < P.NS; ++s) {   // groups are whole spans or (SPLIT) whole halves
        const int c0 = s * P.S;
        while (c0 >= gend) { ++g; gend += G; }
        P.g0[s] = g;
        P.g1[s] = split && c0 + 32 >= gend ? g + 1 : g;
    }
}

// a weight row's 64 columns at `at` as two vectors of unsigned codes: int4 the low and the high nibbles (the
// even and the odd columns), int8 the two 32s; int8 in 32-column blocks (SPLIT: Q8_0's groups of 32) as
// columns [0-15 32-47] and [16-31 48-63] (split8), the order quantize_q8 stores their activations in, so that
// int32 lanes 0-3 sum the first block and lanes 4-7 the second, as int4's nibbles do
static inline void split8(__m256i* wa, __m256i* wb) {
    const __m256i a = *wa, b = *wb;
    *wa = _mm256_permute2x128_si256(a, b, 0x20);
    *wb = _mm256_permute2x128_si256(a, b, 0x31);
}

template <int BITS, bool SPLIT = false>
static inline void load_codes(const uint8_t* at, __m256i low4, __m256i* wa, __m256i* wb) {
    if (BITS == 4) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)at);
        *wa = _mm256_and_si256(raw, low4);
        *wb = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
    } else {
        *wa = _mm256_loadu_si256((const __m256i*)at);
        *wb = _mm256_loadu_si256((const __m256i*)(at + 32));
        if (SPLIT) split8(wa, wb);
    }
}

// The last 32 columns of an int4 row that is not whole 64s (an activation block of its own; K % 64 == 32): the
// exact int32 sum of codes times activation codes, from its 16 code bytes (even columns in the low nibbles, odd
// in the high) and the 16 + 16 activation codes quantize_q8 stores there (evens, then odds). maddubs' pair sums
// stay within int16 (2 * 15 * 127), and the sum is exact whatever instructions form it (so VNNI builds take
// this one too).
static inline int32_t qq_tail32(const uint8_t* codes16, const int8_t* x32) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)codes16), low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    const __m128i p = _mm_add_epi16(_mm_maddubs_epi16(lo, _mm_loadu_si128((const __m128i*)x32)),
                                    _mm_maddubs_epi16(hi, _mm_loadu_si128((const __m128i*)(x32 + 16))));
    __m128i t = _mm_madd_epi16(p, _mm_set1_epi16(1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

// The canonical reduction every integer kernel computes (the tiles below and the AMX tiles: amx.cpp), so
// that an output is bitwise the same whichever kernel, tile shape, row count or position in a batch
// produced it: per activation block a (AB columns, in order) the exact int32 sum I_a = sum c' q, then
//   t = fma(float(I_a), d_a * s_g(a), t)   (fp32, t = 0 before the first block),
// and y = t - qq_zero_corr(...), the zero points' correction summed eight groups at a time in this fixed
// order. Integer sums are exact whatever order forms them (no overflow: |I_a| <= 256 * 128 * 127 < 2^31).
// With mins (int4's min form, mn non-null) each group's s z' is -min (intdot.h group_sz), in the same order.
template <int BITS>
static inline float qq_zero_corr(const float* sj, const uint8_t* zp, const uint16_t* mn, const float* Xr, int NG) {
    __m256 cv = _mm256_setzero_ps();
    int g = 0;
    if (mn) {
        const __m256 neg = _mm256_set1_ps(-0.f);
        for (; g + 8 <= NG; g += 8)
            cv = _mm256_fmadd_ps(_mm256_xor_ps(vload_f16(mn + g), neg), _mm256_loadu_ps(Xr + g), cv);
        float corr = vsum(cv);
        for (; g < NG; ++g) corr = fmaf(-f16_to_f32(mn[g]), Xr[g], corr);
        return corr;
    }
    for (; g + 8 <= NG; g += 8) {
        __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(zp + g))));
        if (BITS == 8) z = _mm256_sub_ps(z, _mm256_set1_ps(128.f));
        cv = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(sj + g), z), _mm256_loadu_ps(Xr + g), cv);
    }
    float corr = vsum(cv);
    for (; g < NG; ++g) corr = fmaf(sj[g] * ((float)zp[g] - (BITS == 4 ? 0.f : 128.f)), Xr[g], corr);
    return corr;
}

// MR input rows against NR weight rows at a time, rows [n0, n1) of W. Per 64 columns: one load (int4) or
// two (int8) of each weight row, unpacked once for the MR rows, whose codes come straight from L1
// (memory operands). A span's integer sums are scaled once: (weight scale x activation scale) per
// (row, weight row), the weight scales taken from a row's f16 scales converted once per tile. MR x NR
// accumulators and their float totals must fit the 16 vector registers (with SPLIT, whose sums are
// scaled every step, the totals alone): 4 x 2 and 2 x 2 tiles, 1 x 4 or a streamed 1 x 1.
template <int BITS, int MR, int NR, bool SPLIT>
void qq_tile(const tl_linear* L, const int8_t* xq, const QQPlan& P, const float* xd, const float* X, float* y,
             int ldy, int n0, int n1) {
    constexpr int NO = MR * NR, NQ = (NO + 3) / 4;   // outputs of the tile, in groups of four
    const int K = L->k, NG = K / L->group, NS = P.NS, NA = K / act_block(L->group);
    const int S = SPLIT ? 64 : P.S;   // (a constant with SPLIT: one step a span, its sums scaled at once)
    const int64_t row_bytes = (int64_t)K * BITS / 8;
    const uint8_t* codes = (const uint8_t*)L->w;
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    const __m256i ones8 = _mm256_set1_epi8(1);
    (void)ones; (void)flip; (void)ones8;
    constexpr int SF_LOCAL = 512;             // groups a weight row may have with its scales on the stack
    float sf_local[NR * SF_LOCAL];            // (NR, NG) the tile's weight scales as fp32
    float* sf = sf_local;
    if (NG > SF_LOCAL) {                      // (a thread_local costs a lookup per call: only when needed)
        thread_local std::vector<float> sf_heap;
        sf_heap.resize((size_t)NR * NG);
        sf = sf_heap.data();
    }
    const int* const g0 = P.g0.data();
    const int* const g1 = P.g1.data();
    int n = n0;
    for (; n + NR <= n1; n += NR) {
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
            const uint16_t* sc = L->scales + (int64_t)(n + j) * NG;
            int g = 0;
            for (; g + 8 <= NG; g += 8) _mm256_storeu_ps(&sf[(size_t)j * NG + g], vload_f16(sc + g));
            for (; g < NG; ++g) sf[(size_t)j * NG + g] = f16_to_f32(sc[g]);
        }
        __m128 tot[NQ];   // output o = r * NR + j in lane o % 4 of tot[o / 4]
#pragma GCC unroll 4
        for (int q = 0; q < NQ; ++q) tot[q] = _mm_setzero_ps();
        const uint8_t* row = codes + (int64_t)n * row_bytes;
        for (int s = 0; s < NS; ++s) {
            const int c0 = s * S;
            __m256i acc[MR][NR];
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
                for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_si256();
#if TL_VNNI
            __m256i qsum[MR];   // int8: per row, the sum of its activation codes (four bytes a lane)
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r) qsum[r] = _mm256_setzero_si256();
#endif
            for (int c = c0; c < c0 + S; c += 64) {
                const uint8_t* at = row + (int64_t)c * BITS / 8;   // row n's 64 columns at c
                if (L->streamed) {   // from memory
                    if (NR == 1)     // one row after the other: one stream, 4 KB ahead
                        for (int l = 0; l < BITS / 4; ++l) _mm_prefetch((const char*)(at + 4096 + 64 * l), _MM_HINT_T0);
                    else             // the next NR rows' lines, in order
#pragma GCC unroll 4
                        for (int j = 0; j < NR; ++j)
                            for (int l = 0; l < BITS / 4; ++l)
                                _mm_prefetch((const char*)(at + (NR + j) * row_bytes + 64 * l), _MM_HINT_T0);
                }
#if TL_VNNI
                if (BITS == 8)   // the sum of each row's codes, for the shift of c by 128 (below)
#pragma GCC unroll 4
                    for (int r = 0; r < MR; ++r)
                        qsum[r] = dpbusd(dpbusd(qsum[r], ones8, _mm256_loadu_si256((const __m256i*)(xq + (int64_t)r * K + c))),
                                         ones8, _mm256_loadu_si256((const __m256i*)(xq + (int64_t)r * K + c + 32)));
#pragma GCC unroll 4
                for (int j = 0; j < NR; ++j) {   // unsigned codes against signed activations, int32 sums
                    __m256i wa, wb;
                    load_codes<BITS, SPLIT>(at + j * row_bytes, low4, &wa, &wb);
#pragma GCC unroll 4
                    for (int r = 0; r < MR; ++r)
                        acc[r][j] = dpbusd(dpbusd(acc[r][j], wa, _mm256_loadu_si256((const __m256i*)(xq + (int64_t)r * K + c))),
                                           wb, _mm256_loadu_si256((const __m256i*)(xq + (int64_t)r * K + c + 32)));
                }
#else
#pragma GCC unroll 4
                for (int j = 0; j < NR; ++j) {
                    __m256i wa, wb;   // int4: low / high nibbles; int8: the two 32s with their sign flipped
                    if (BITS == 4) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i*)(at + j * row_bytes));
                        wa = _mm256_and_si256(raw, low4);
                        wb = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    } else {
                        wa = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(at + j * row_bytes)), flip);
                        wb = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(at + j * row_bytes + 32)), flip);
                        if (SPLIT) split8(&wa, &wb);
                    }
#pragma GCC unroll 4
                    for (int r = 0; r < MR; ++r) {
                        const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + (int64_t)r * K + c));
                        const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xq + (int64_t)r * K + c + 32));
                        if (BITS == 4) {
                            acc[r][j] = _mm256_add_epi16(acc[r][j], _mm256_add_epi16(
                                _mm256_maddubs_epi16(wa, x0), _mm256_maddubs_epi16(wb, x1)));
                        } else {
                            const __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(wa, wa), _mm256_sign_epi8(x0, wa));
                            const __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(wb, wb), _mm256_sign_epi8(x1, wb));
                            acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_add_epi32(_mm256_madd_epi16(p0, ones),
                                                                                     _mm256_madd_epi16(p1, ones)));
                        }
                    }
                }
#endif
            }
            // the span's exact int32 sums, one per activation block (SPLIT: two), each scaled and added in
            // block order: the canonical reduction (qq_zero_corr says it)
            __m256i s32[NQ * 4];
#pragma GCC unroll 8
            for (int o = 0; o < NQ * 4; ++o) {
                if (o >= NO) { s32[o] = _mm256_setzero_si256(); continue; }
                const int r = o / NR, j = o % NR;
#if TL_VNNI   // int8: sum (c - 128) q = sum c q - 128 sum q, lane for lane
                s32[o] = BITS == 4 ? acc[r][j] : _mm256_sub_epi32(acc[r][j], _mm256_slli_epi32(qsum[r], 7));
#else
                s32[o] = BITS == 4 ? _mm256_madd_epi16(acc[r][j], ones) : acc[r][j];
#endif
            }
#pragma GCC unroll 4
            for (int q = 0; q < NQ; ++q) {
                // lanes: each output's sum of int32 lanes 0-3, then of lanes 4-7 (exact integers)
                const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(s32[4 * q], s32[4 * q + 1]),
                                                    _mm256_hadd_epi32(s32[4 * q + 2], s32[4 * q + 3]));
                const __m128i lo = _mm256_castsi256_si128(t), hi = _mm256_extracti128_si256(t, 1);
                alignas(16) float sc0[4], sc1[4];
                for (int l = 0; l < 4; ++l) {
                    const int o = 4 * q + l < NO ? 4 * q + l : NO - 1, r = o / NR, j = o % NR;
                    const float* dr = xd + (int64_t)r * NA;
                    const float* sj = &sf[(size_t)j * NG];
                    sc0[l] = SPLIT ? dr[2 * s] * sj[g0[s]] : dr[s] * sj[g0[s]];
                    sc1[l] = SPLIT ? dr[2 * s + 1] * sj[g1[s]] : 0.f;
                }
                if (SPLIT) {
                    tot[q] = _mm_fmadd_ps(_mm_cvtepi32_ps(lo), _mm_load_ps(sc0), tot[q]);
                    tot[q] = _mm_fmadd_ps(_mm_cvtepi32_ps(hi), _mm_load_ps(sc1), tot[q]);
                } else {
                    tot[q] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_add_epi32(lo, hi)), _mm_load_ps(sc0), tot[q]);
                }
            }
        }
        alignas(16) float tv[NQ * 4];
        for (int q = 0; q < NQ; ++q) _mm_store_ps(tv + 4 * q, tot[q]);
        if (BITS == 4 && K % 64) {   // the last 32 columns, the last activation block (qq_tail32)
            const int c = K & ~63, g = c / L->group;
            for (int r = 0; r < MR; ++r)
                for (int j = 0; j < NR; ++j)
                    tv[r * NR + j] = fmaf((float)qq_tail32(row + j * row_bytes + c / 2, xq + (int64_t)r * K + c),
                                          xd[(int64_t)r * NA + NA - 1] * sf[(size_t)j * NG + g], tv[r * NR + j]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j)
                y[(int64_t)r * ldy + n + j] = tv[r * NR + j] - qq_zero_corr<BITS>(&sf[(size_t)j * NG],
                    L->mins ? nullptr : L->zeros + (int64_t)(n + j) * NG,
                    L->mins ? L->mins + (int64_t)(n + j) * NG : nullptr, X + (int64_t)r * NG, NG);
    }
    if (NR > 1 && n < n1) qq_tile<BITS, MR, 1, SPLIT>(L, xq, P, xd, X, y, ldy, n, n1);
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

// x (m, K) -> int8 codes xq (m, K) (layout 1, int4 weights: each 64 columns evens first, then odds; 0: in column
// order; 2, int8 weights in groups of 32: each 64 columns as split8 orders them), and per block of AB columns its scale d and the sum of its codes, xd and xs (m, K / AB). Vectorized,
// with what the scalar form computes: the block's max |x| (a max: in any order), q = round-to-nearest-even
// of x * (1 / d) (_mm256_round_ps as nearbyintf), |q| <= 127 (packs never saturate); the int4 order is a
// byte shuffle of the codes in column order.
void quantize_q8(const float* x, int m, int K, int AB, int8_t* xq, float* xd, float* xs, int layout) {
    const bool nibbles = layout == 1;
    const int K64 = K & ~63;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   // packs' lanes back in column order
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int r = 0; r < m; ++r) {
        int8_t* q = xq + (int64_t)r * K;
        for (int a = 0; a < K / AB; ++a) {   // AB is whole 32s
            const float* v = x + (int64_t)r * K + a * AB;
            __m256 mx = _mm256_setzero_ps();
            for (int i = 0; i < AB; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(v + i), absmask));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            const float amax = _mm_cvtss_f32(h), d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
            const __m256 vid = _mm256_set1_ps(id);
            __m256i sum = _mm256_setzero_si256();
            for (int i = 0; i < AB; i += 32) {
                __m256i e[4];
                for (int k = 0; k < 4; ++k) {
                    e[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * k), vid),
                                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                    sum = _mm256_add_epi32(sum, e[k]);
                }
                const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(e[0], e[1]), _mm256_packs_epi32(e[2], e[3]));
                _mm256_storeu_si256((__m256i*)(q + a * AB + i), _mm256_permutevar8x32_epi32(b, order));
            }
            xd[(int64_t)r * (K / AB) + a] = d;
            xs[(int64_t)r * (K / AB) + a] = (float)hsum_epi32(sum);
        }
        if (layout == 2) {   // int8 in 32-column blocks: each 64 columns as [0-15 32-47] [16-31 48-63] (split8)
            for (int c = 0; c < K64; c += 64) {
                const __m256i A = _mm256_loadu_si256((const __m256i*)(q + c));
                const __m256i B = _mm256_loadu_si256((const __m256i*)(q + c + 32));
                _mm256_storeu_si256((__m256i*)(q + c), _mm256_permute2x128_si256(A, B, 0x20));
                _mm256_storeu_si256((__m256i*)(q + c + 32), _mm256_permute2x128_si256(A, B, 0x31));
            }
            continue;
        }
        if (!nibbles) continue;
        for (int c = 0; c < K64; c += 64) {   // each 64 columns: the 32 evens, then the 32 odds
            const __m256i A = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)(q + c)), evens_odds);
            const __m256i B = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i*)(q + c + 32)), evens_odds);
            _mm256_storeu_si256((__m256i*)(q + c), _mm256_permute4x64_epi64(_mm256_unpacklo_epi64(A, B), 0xD8));
            _mm256_storeu_si256((__m256i*)(q + c + 32), _mm256_permute4x64_epi64(_mm256_unpackhi_epi64(A, B), 0xD8));
        }
        if (K > K64) {   // a last 32 columns (qq_tail32): its 16 evens, then its 16 odds
            int8_t t[32];
            for (int c = 0; c < 32; ++c) t[(c & 1) * 16 + c / 2] = q[K64 + c];
            memcpy(q + K64, t, 32);
        }
    }
}

// an 8 x 8 float transpose in registers: a[i] lane j <- a[j] lane i (exact: values are only moved)
static inline void transpose8(__m256* a) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        a[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        a[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// The eight int32 vectors a[0..7] -> their lane sums, a[j]'s in lane j: of lanes 0-3 (lo) and of lanes 4-7
// (hi) apart, or all eight (exact integers either way).
static inline void hsum8_halves(const __m256i* a, __m256i* lo, __m256i* hi) {
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    *lo = _mm256_permute2x128_si256(h0, h1, 0x20);
    *hi = _mm256_permute2x128_si256(h0, h1, 0x31);
}

// Eight weight rows at a time against each input row in turn (the block's 8 x K codes stay in L1 from the
// first input row on): the int32 sums of each activation block for the eight rows reduced together (a
// transposed reduction), then scaled, offset by the zero points and stored as one vector. The 4 x 2 tiles'
// epilogue (horizontal sums, scales gathered and the zero-point correction, per output: qq_tile) costs more
// than their products where outputs are many and short: the int8 head (50,257 x 256) and the int4 layers
// of groups of 32 (their sums are scaled every 32 columns). Lane j computes exactly what qq_tile computes
// for weight row n + j: the same int32 sums, t = fma(I_a, d_a * s_g(a), t) block by block, the zero points'
// correction in qq_zero_corr's order (eight partial sums over g mod 8 added as vsum adds them, then the
// rest one by one), y = t - corr; so the result is bitwise the other tiles' and AMX's.
// Returns where it stopped: the rows [n, n1) left over (fewer than eight) go to the tiles.
// With UB (many input rows: UB_MIN_ROWS_*), the block's weight-side work (int4: the nibbles unpacked; int8
// without VNNI: c - 128 and its magnitude) is done once, into an L1 buffer the input rows then read as
// operands, instead of once per input row: per 64 columns and weight row an input row costs 5 vector
// operations, not 9 (int4), 8 not 14 (int8); the multiplies among them (4 for int8) are what is left. The
// integer sums are the same, so are the outputs.
template <int BITS, bool SPLIT, bool UB>
static int qq_rows8(const tl_linear* L, const int8_t* xq, const QQPlan& P, const float* xd, const float* xs,
                    const float* X, int m, float* y, int ldy, int n0, int n1) {
    const int K = L->k, NG = K / L->group, NS = P.NS, S = SPLIT ? 64 : P.S, NA = K / act_block(L->group);
    const int NG8 = NG / 8 * 8;
    const int64_t row_bytes = (int64_t)K * BITS / 8;
    const uint8_t* codes = (const uint8_t*)L->w;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    (void)low4; (void)xs;
#if !TL_VNNI
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
#endif
    const int* const g0 = P.g0.data();
    const int* const g1 = P.g1.data();
    thread_local std::vector<float> tb;   // (NG, 8) twice: the block's weight scales, s z' (or -min: group_sz)
    tb.resize((size_t)16 * NG);
    float* const sT = tb.data();
    float* const zT = sT + (size_t)8 * NG;
    // UB: the columns in chunks of SPC spans (1,024 columns), so that the buffer (8 KB of int4 codes, 16 KB of
    // int8) stays in L1 while every input row reads it; each row's running total t waits in tacc between chunks
    constexpr int UB_STEP = BITS == 4 ? 64 : 128;   // buffer bytes per weight row and 64 columns
    const int SPC = UB ? std::max(1, 1024 / S) : std::max(NS, 1);
    struct alignas(32) Line { uint8_t b[32]; };
    thread_local std::vector<Line> ubv;             // (SPC * S / 64, 8, UB_STEP) the chunk's unpacked codes
    thread_local std::vector<Line> taccv;           // (m) the input rows' totals (8 floats each)
    if (UB) {
        ubv.resize((size_t)(SPC * S / 64) * 8 * UB_STEP / 32);
        taccv.resize(m);
    }
    uint8_t* const ub = UB ? (uint8_t*)ubv.data() : nullptr;
    float* const tacc = UB ? (float*)taccv.data() : nullptr;
    int n = n0;
    for (; n + 8 <= n1; n += 8) {
        int g = 0;
        for (; g + 8 <= NG; g += 8) {   // eight groups of the eight rows at a time, transposed in registers
            __m256 sv[8], zv[8];
            for (int j = 0; j < 8; ++j) {
                sv[j] = vload_f16(L->scales + (int64_t)(n + j) * NG + g);
                if (L->mins) {
                    zv[j] = _mm256_xor_ps(vload_f16(L->mins + (int64_t)(n + j) * NG + g), _mm256_set1_ps(-0.f));
                } else {
                    zv[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(L->zeros + (int64_t)(n + j) * NG + g))));
                    if (BITS == 8) zv[j] = _mm256_sub_ps(zv[j], _mm256_set1_ps(128.f));
                    zv[j] = _mm256_mul_ps(sv[j], zv[j]);   // s z' (one multiply, as at its use before)
                }
            }
            transpose8(sv);
            transpose8(zv);
            for (int l = 0; l < 8; ++l) {
                _mm256_storeu_ps(sT + (g + l) * 8, sv[l]);
                _mm256_storeu_ps(zT + (g + l) * 8, zv[l]);
            }
        }
        if (NG == 1 && !L->mins) {   // one group a row (the int8 head): the eight rows' scales and s z' side by side
            const __m256 s8 = vload_f16(L->scales + n);
            _mm256_storeu_ps(sT, s8);
            __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(L->zeros + n))));
            _mm256_storeu_ps(zT, _mm256_mul_ps(s8, BITS == 8 ? _mm256_sub_ps(z, _mm256_set1_ps(128.f)) : z));
            g = 1;
        }
        for (; g < NG; ++g)
            for (int j = 0; j < 8; ++j) {
                sT[g * 8 + j] = f16_to_f32(L->scales[(int64_t)(n + j) * NG + g]);
                zT[g * 8 + j] = group_sz(L, n + j, g, sT[g * 8 + j], BITS == 8 ? 128.f : 0.f);
            }
        const uint8_t* w = codes + (int64_t)n * row_bytes;
        for (int cb = 0; cb == 0 || cb < NS; cb += SPC) {   // (without UB: one chunk, every span)
            const int ce = std::min(NS, cb + SPC), c_ub = cb * S;   // spans [cb, ce); c_ub: the buffer's first column
            if (UB)
                for (int c = cb * S; c < ce * S; c += 64) {
                    const uint8_t* at = w + (int64_t)c * BITS / 8;
                    if (BITS == 8 || (L->streamed && c % 128 == 0))   // as the rows' loop below prefetches
                        for (int j = 0; j < 8; ++j) _mm_prefetch((const char*)(at + (32 + j) * row_bytes), _MM_HINT_T0);
                    for (int j = 0; j < 8; ++j) {
                        __m256i wa, wb;
                        load_codes<BITS, SPLIT>(at + j * row_bytes, low4, &wa, &wb);
                        __m256i* u = (__m256i*)(ub + ((int64_t)((c - c_ub) / 64) * 8 + j) * UB_STEP);
#if !TL_VNNI
                        if (BITS == 8) {
                            wa = _mm256_xor_si256(wa, flip);
                            wb = _mm256_xor_si256(wb, flip);
                            _mm256_store_si256(u + 2, wa);
                            _mm256_store_si256(u + 3, wb);
                            wa = _mm256_sign_epi8(wa, wa);
                            wb = _mm256_sign_epi8(wb, wb);
                        }
#endif
                        _mm256_store_si256(u, wa);
                        _mm256_store_si256(u + 1, wb);
                    }
                }
            for (int r = 0; r < m; ++r) {
                const int8_t* xr = xq + (int64_t)r * K;
                const float* dr = xd + (int64_t)r * NA;
                __m256 t = UB && cb > 0 ? _mm256_load_ps(tacc + 8 * r) : _mm256_setzero_ps();
                for (int s = cb; s < ce; ++s) {
                    __m256i acc[8];
#if TL_VNNI512
                    if (BITS == 8 && !SPLIT) {   // 64 columns of a weight row in one vpdpbusd on 512-bit vectors
                        __m512i a5[8];
                        for (int j = 0; j < 8; ++j) a5[j] = _mm512_setzero_si512();
                        for (int c = s * S; c < (s + 1) * S; c += 64) {
                            if (r == 0)   // four blocks ahead (from cache or memory)
                                for (int j = 0; j < 8; ++j) _mm_prefetch((const char*)(w + (32 + j) * row_bytes + c), _MM_HINT_T0);
                            const __m512i x = _mm512_loadu_si512((const void*)(xr + c));
#pragma GCC unroll 8
                            for (int j = 0; j < 8; ++j)
                                a5[j] = _mm512_dpbusd_epi32(a5[j], _mm512_loadu_si512((const void*)(w + j * row_bytes + c)), x);
                        }
                        for (int j = 0; j < 8; ++j)
                            acc[j] = _mm256_add_epi32(_mm512_castsi512_si256(a5[j]), _mm512_extracti64x4_epi64(a5[j], 1));
                    } else
#endif
                    {
                        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_si256();
                        for (int c = s * S; c < (s + 1) * S; c += 64) {
                            const uint8_t* at = w + (int64_t)c * BITS / 8;   // the block's 64 columns at c
                            // the line 32 rows ahead that holds these columns: one a step (int8: 64 bytes), one
                            // every other step (int4: 32 bytes); int4 layers in cache are not worth it
                            if (!UB && r == 0 && (BITS == 8 || (L->streamed && c % 128 == 0)))
                                for (int j = 0; j < 8; ++j)
                                    _mm_prefetch((const char*)(at + (32 + j) * row_bytes), _MM_HINT_T0);
                            const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xr + c));
                            const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xr + c + 32));
                            const __m256i* u = UB ? (const __m256i*)(ub + (int64_t)((c - c_ub) / 64) * 8 * UB_STEP) : nullptr;
#pragma GCC unroll 8
                            for (int j = 0; j < 8; ++j) {
                                __m256i wa, wb;
                                if (UB) {
                                    wa = _mm256_load_si256(u + j * (UB_STEP / 32));
                                    wb = _mm256_load_si256(u + j * (UB_STEP / 32) + 1);
                                } else {
                                    load_codes<BITS, SPLIT>(at + j * row_bytes, low4, &wa, &wb);
                                }
#if TL_VNNI   // unsigned codes c against q (int8: less 128 sum q below)
                                acc[j] = dpbusd(dpbusd(acc[j], wa, x0), wb, x1);
#else
                                if (BITS == 4) {
                                    acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_add_epi16(
                                        _mm256_maddubs_epi16(wa, x0), _mm256_maddubs_epi16(wb, x1)), ones));
                                } else {   // c - 128 as a signed byte: |c - 128| against q with its sign (as qq_tile)
                                    __m256i fa, fb, aa, ab;
                                    if (UB) {   // (the buffer: |c - 128|, then c - 128)
                                        aa = wa, ab = wb;
                                        fa = _mm256_load_si256(u + j * (UB_STEP / 32) + 2);
                                        fb = _mm256_load_si256(u + j * (UB_STEP / 32) + 3);
                                    } else {
                                        fa = _mm256_xor_si256(wa, flip), fb = _mm256_xor_si256(wb, flip);
                                        aa = _mm256_sign_epi8(fa, fa), ab = _mm256_sign_epi8(fb, fb);
                                    }
                                    const __m256i p0 = _mm256_maddubs_epi16(aa, _mm256_sign_epi8(x0, fa));
                                    const __m256i p1 = _mm256_maddubs_epi16(ab, _mm256_sign_epi8(x1, fb));
                                    acc[j] = _mm256_add_epi32(acc[j], _mm256_add_epi32(_mm256_madd_epi16(p0, ones),
                                                                                       _mm256_madd_epi16(p1, ones)));
                                }
#endif
                            }
                        }
                    }
                    __m256i lo, hi;
                    hsum8_halves(acc, &lo, &hi);
                    if (SPLIT) {   // two 32-column blocks: lanes 0-3 the first, 4-7 the second
#if TL_VNNI   // int8 (VNNI: unsigned c against q): sum (c - 128) q = sum c q - 128 sum q, block by block
                        if (BITS == 8) {
                            lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(128 * (int32_t)xs[(int64_t)r * NA + 2 * s]));
                            hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(128 * (int32_t)xs[(int64_t)r * NA + 2 * s + 1]));
                        }
#endif
                        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(_mm256_set1_ps(dr[2 * s]),
                                            _mm256_loadu_ps(sT + g0[s] * 8)), t);
                        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(_mm256_set1_ps(dr[2 * s + 1]),
                                            _mm256_loadu_ps(sT + g1[s] * 8)), t);
                    } else {
                        __m256i I = _mm256_add_epi32(lo, hi);
#if TL_VNNI
                        if (BITS == 8) I = _mm256_sub_epi32(I, _mm256_set1_epi32(128 * (int32_t)xs[(int64_t)r * NA + s]));
#endif
                        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(_mm256_set1_ps(dr[s]),
                                            _mm256_loadu_ps(sT + g0[s] * 8)), t);
                    }
                }
                if (UB && ce < NS) {   // more chunks to come
                    _mm256_store_ps(tacc + 8 * r, t);
                    continue;
                }
                if (BITS == 4 && K % 64) {   // the last 32 columns, the last activation block (qq_tail32)
                    const int c = K & ~63;
                    alignas(32) int32_t It[8];
                    for (int j = 0; j < 8; ++j) It[j] = qq_tail32(w + j * row_bytes + c / 2, xr + c);
                    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)It)),
                                        _mm256_mul_ps(_mm256_set1_ps(dr[NA - 1]), _mm256_loadu_ps(sT + (c / L->group) * 8)), t);
                }
                const float* Xr = X + (int64_t)r * NG;
                __m256 part[8];   // qq_zero_corr's eight lanes (groups g mod 8), for the eight weight rows
                for (int l = 0; l < 8; ++l) part[l] = _mm256_setzero_ps();
                for (int g = 0; g < NG8; g += 8)
                    for (int l = 0; l < 8; ++l)
                        part[l] = _mm256_fmadd_ps(_mm256_loadu_ps(zT + (g + l) * 8), _mm256_set1_ps(Xr[g + l]), part[l]);
                // vsum's order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
                __m256 corr = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(part[0], part[4]), _mm256_add_ps(part[2], part[6])),
                                            _mm256_add_ps(_mm256_add_ps(part[1], part[5]), _mm256_add_ps(part[3], part[7])));
                for (int g = NG8; g < NG; ++g)
                    corr = _mm256_fmadd_ps(_mm256_loadu_ps(zT + g * 8), _mm256_set1_ps(Xr[g]), corr);
                _mm256_storeu_ps(y + (int64_t)r * ldy + n, _mm256_sub_ps(t, corr));
            }
        }
    }
    return n;
}

// qq_rows8 first for int8 weights and int4 ones in groups of 32 (SPLIT) at every row count, for int4 in
// larger groups up to Q4_ROWS8_MAX rows: past it the 4 x 2 tiles, which unpack a weight row's codes once
// for four input rows and scale once per group, were faster (the 1.4B real shape's 2048 x 2048 and 5632 x 2048,
// group 128, one thread: qq_rows8 1.07-1.16x at 1-2 rows, 0.89-0.93x at 4; the shipped model's 768 x 256
// group 32: 1.07x at 1 row to 1.22x at 7; the shipped head 1.66x at 5)
constexpr int Q4_ROWS8_MAX = 2;
// qq_rows8's buffer from these row counts (the shipped model, one thread, against the codes unpacked for each
// input row: its int4 core layers 0.99x the time at 4 rows, 0.94 at 8, 0.89-0.91 at 16-64; its int8 head 1.1x
// at 4, 0.99 at 8, 0.87-0.91 at 16-64: the multiplies, two ports' worth, bound both forms; the 4 x 2 tiles
// stay faster for the 1.4B real shape's int4 layers in groups of 128 at 3-8 rows: 1.13-1.42x with the buffer)
constexpr int UB_MIN_ROWS_Q4 = 8, UB_MIN_ROWS_Q8 = 16;
template <int BITS, bool SPLIT>
void qq_rows(const tl_linear* L, const int8_t* xq, const QQPlan& P, const float* xd, const float* xs, const float* X,
             int m, float* y, int ldy, int n0, int n1) {
    const int K = L->k, NG = K / L->group, NA = K / act_block(L->group);
    const bool ub = m >= (BITS == 8 ? UB_MIN_ROWS_Q8 : UB_MIN_ROWS_Q4) && !(BITS == 8 && TL_VNNI);   // (VNNI: int8 codes as they are)
    if (BITS == 8 || SPLIT || m <= Q4_ROWS8_MAX)
        n0 = ub ? qq_rows8<BITS, SPLIT, true>(L, xq, P, xd, xs, X, m, y, ldy, n0, n1)
                : qq_rows8<BITS, SPLIT, false>(L, xq, P, xd, xs, X, m, y, ldy, n0, n1);
    if (n0 >= n1) return;
    int mt = 0;
    for (; mt + 4 <= m; mt += 4)
        qq_tile<BITS, 4, 2, SPLIT>(L, xq + (int64_t)mt * K, P, xd + (int64_t)mt * NA, X + (int64_t)mt * NG,
                                   y + (int64_t)mt * ldy, ldy, n0, n1);
    if (mt + 3 == m)   // three rows in one pass (2 x 2 then a lone row read the weights twice: 1.8x one row)
        qq_tile<BITS, 3, 2, SPLIT>(L, xq + (int64_t)mt * K, P, xd + (int64_t)mt * NA, X + (int64_t)mt * NG,
                                   y + (int64_t)mt * ldy, ldy, n0, n1), mt += 3;
    for (; mt + 2 <= m; mt += 2)
        qq_tile<BITS, 2, 2, SPLIT>(L, xq + (int64_t)mt * K, P, xd + (int64_t)mt * NA, X + (int64_t)mt * NG,
                                   y + (int64_t)mt * ldy, ldy, n0, n1);
    // a lone row of streamed weights: one sequential stream reads at the bandwidth; a last row after tiles
    // finds its chunk's weights in cache (the tiles above just read them): four weight rows at a time
    if (mt < m && L->streamed && mt == 0)
        qq_tile<BITS, 1, 1, SPLIT>(L, xq + (int64_t)mt * K, P, xd + (int64_t)mt * NA, X + (int64_t)mt * NG,
                                   y + (int64_t)mt * ldy, ldy, n0, n1);
    else if (mt < m)
        qq_tile<BITS, 1, 4, SPLIT>(L, xq + (int64_t)mt * K, P, xd + (int64_t)mt * NA, X + (int64_t)mt * NG,
                                   y + (int64_t)mt * ldy, ldy, n0, n1);
}

// ---- int4 codes repacked 16 weight rows a vector (small models: the executor packs layers whose model stays
// in cache, tl_pack_int4) ----
// A strip of 16 weight rows lies as (K / 8) octets of 64 bytes, byte 4 w + i holding column 8 o + i of row w
// in its low nibble and column 8 o + 4 + i in its high one; then the 16 rows' scales as stored (float16, NG x 16)
// and their zero points (uint8, NG x 16) or, int4's min form, minimums (float16, NG x 16): the bytes the portable
// layout holds, so a packed layer reads no more than its file's (fp32 scales and s z' took 8 bytes a group and
// row, against 3: 1.26x the bytes of an int4 layer in groups of 32). Against an input row's int8 codes in column order, a 512-bit vpdpbusd takes
// 4 columns of all 16 rows at once (the row's 4 codes broadcast), so an activation block's sums come out one
// per lane with no horizontal reduction, and the unpacked codes serve every input row of the call (up to 8 at
// a time). Lane w
// computes the canonical reduction for weight row 16 s + w (exact int32 sums per activation block, then t =
// fma(I_a, d_a * s_g(a), t) block by block, the zero points' correction in qq_zero_corr's order: eight
// partial sums over g mod 8 added as vsum adds them, then the rest), so its outputs are bitwise the other
// kernels'. Measured: benchmarks/pass_cost.py (docs/decode.md).
#if TL_VNNI512

static inline int64_t packed_strip_bytes(const tl_linear* L) {
    return (int64_t)L->k * 8 + (int64_t)(L->k / L->group) * (L->packed_f32 ? 128 : L->mins ? 64 : 48);
}

// group g's s z' (fp32, as the other kernels form it) or -min (exact) for strip P's 16 rows
static inline __m512 packed_sz(const tl_linear* L, const uint8_t* P, int g) {
    const int K = L->k, NG = K / L->group;
    const uint16_t* sv = (const uint16_t*)(P + (int64_t)K * 8);
    const uint8_t* zs = (const uint8_t*)(sv + (int64_t)NG * 16);   // zero points, or (mins) float16 minimums
    return L->mins
        ? _mm512_xor_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)zs + g * 16))),
                        _mm512_set1_ps(-0.f))
        : _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sv + g * 16))),
                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(zs + g * 16)))));
}

// MR input rows against strips s0..s1. F32 (packed_f32): the strips' fp32 scales and s z' are read as they lie;
// else szp: (NG, 16) the strip's s z' formed once for all its input rows (qq_packed; one strip a call then), or
// null: formed where the correction reads them (one input row)
template <int MR, bool F32>
static void qq_packed_strips(const tl_linear* L, const int8_t* xq, const float* xd, const float* X, float* y,
                             int ldy, int s0, int s1, const float* szp) {
    const int K = L->k, NG = K / L->group, AB = act_block(L->group), NA = K / AB, opb = AB / 8, NG8 = NG / 8 * 8;
    const int64_t SB = packed_strip_bytes(L);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int s = s0; s < s1; ++s) {
        const uint8_t* P = L->packed + s * SB;
        const uint16_t* sv = (const uint16_t*)(P + (int64_t)K * 8);
        const float* sf = (const float*)(P + (int64_t)K * 8);   // (F32: scales, then s z' or -min, NG x 16 each)
        auto szg = [&](int g) -> __m512 {
            return F32 ? _mm512_loadu_ps(sf + (int64_t)(NG + g) * 16)
                       : szp ? _mm512_loadu_ps(szp + (int64_t)g * 16) : packed_sz(L, P, g);
        };
        __m512 t[MR];
        for (int r = 0; r < MR; ++r) t[r] = _mm512_setzero_ps();
        for (int a = 0; a < NA; ++a) {
            // up to 6 rows, two accumulators a row (the low nibbles' and the high ones'): two chains of vpdpbusd,
            // not one of twice the length, whose latency bound a lone row (the 4B nGPT shape's core from memory,
            // two threads: 1.15-1.3x at one row, about the same at 2-5); integer sums, the same whichever order
            // forms them
            constexpr bool TWO = MR <= 6;
            __m512i acc[MR], acc2[MR];
            for (int r = 0; r < MR; ++r) acc[r] = acc2[r] = _mm512_setzero_si512();
            for (int o = a * opb; o < (a + 1) * opb; ++o) {
                const __m512i raw = _mm512_loadu_si512(P + 64 * o);
                const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
#pragma GCC unroll 8
                for (int r = 0; r < MR; ++r) {
                    const int8_t* xr = xq + (int64_t)r * K + 8 * o;
                    int32_t x0, x1;
                    memcpy(&x0, xr, 4);
                    memcpy(&x1, xr + 4, 4);
                    acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(x0));
                    if (TWO) acc2[r] = _mm512_dpbusd_epi32(acc2[r], hi, _mm512_set1_epi32(x1));
                    else acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(x1));
                }
            }
            if (TWO)
                for (int r = 0; r < MR; ++r) acc[r] = _mm512_add_epi32(acc[r], acc2[r]);
            const int64_t gi = (int64_t)(a * AB / L->group) * 16;
            const __m512 s_g = F32 ? _mm512_loadu_ps(sf + gi) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sv + gi)));
            for (int r = 0; r < MR; ++r)
                t[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(_mm512_set1_ps(xd[(int64_t)r * NA + a]), s_g), t[r]);
        }
        const int n0 = 16 * s, nr = L->n - n0 < 16 ? L->n - n0 : 16;
        const __mmask16 live = (__mmask16)((1u << nr) - 1);
        for (int r = 0; r < MR; ++r) {
            const float* Xr = X + (int64_t)r * NG;
            __m512 part[8];
            for (int l = 0; l < 8; ++l) part[l] = _mm512_setzero_ps();
            for (int g = 0; g < NG8; g += 8)
                for (int l = 0; l < 8; ++l)
                    part[l] = _mm512_fmadd_ps(szg(g + l), _mm512_set1_ps(Xr[g + l]), part[l]);
            __m512 corr = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(part[0], part[4]), _mm512_add_ps(part[2], part[6])),
                                        _mm512_add_ps(_mm512_add_ps(part[1], part[5]), _mm512_add_ps(part[3], part[7])));
            for (int g = NG8; g < NG; ++g)
                corr = _mm512_fmadd_ps(szg(g), _mm512_set1_ps(Xr[g]), corr);
            _mm512_mask_storeu_ps(y + (int64_t)r * ldy + n0, live, _mm512_sub_ps(t[r], corr));
        }
    }
}

// qq_packed_strips for mr (1-8) input rows
template <bool F32>
static void packed_rows(int mr, const tl_linear* L, const int8_t* xq, const float* xd, const float* X, float* y,
                        int ldy, int s0, int s1, const float* szp) {
    switch (mr) {
        case 1: return qq_packed_strips<1, F32>(L, xq, xd, X, y, ldy, s0, s1, szp);
        case 2: return qq_packed_strips<2, F32>(L, xq, xd, X, y, ldy, s0, s1, szp);
        case 3: return qq_packed_strips<3, F32>(L, xq, xd, X, y, ldy, s0, s1, szp);
        case 4: return qq_packed_strips<4, F32>(L, xq, xd, X, y, ldy, s0, s1, szp);
        case 5: return qq_packed_strips<5, F32>(L, xq, xd, X, y, ldy, s0, s1, szp);
        case 6: return qq_packed_strips<6, F32>(L, xq, xd, X, y, ldy, s0, s1, szp);
        case 7: return qq_packed_strips<7, F32>(L, xq, xd, X, y, ldy, s0, s1, szp);
        default: return qq_packed_strips<8, F32>(L, xq, xd, X, y, ldy, s0, s1, szp);
    }
}

// m input rows (codes in column order) against every strip: units of 8 strips over the threads, each unit's
// input rows up to 8 at a time (its 16 KB of codes stay in L1 from the first row block on)
static void qq_packed(const tl_linear* L, const int8_t* xq, const float* xd, const float* X, int m, float* y, int ldy) {
    const int K = L->k, NG = K / L->group, NA = K / act_block(L->group);
    const int strips = (L->n + 15) / 16;
    constexpr int UNIT = 8;
    if (L->packed_f32) {   // (scales and s z' as they lie: each unit's input rows 8 at a time over its strips)
        tl_parallel_for((strips + UNIT - 1) / UNIT, [&](int c, int) {
            const int s0 = c * UNIT, s1 = std::min(strips, s0 + UNIT);
            for (int r0 = 0; r0 < m; r0 += 8) {
                const int8_t* xr = xq + (int64_t)r0 * K;
                const float *dr = xd + (int64_t)r0 * NA, *Xr = X + (int64_t)r0 * NG;
                float* yr = y + (int64_t)r0 * ldy;
                packed_rows<true>(std::min(8, m - r0), L, xr, dr, Xr, yr, ldy, s0, s1, nullptr);
            }
        });
        return;
    }
    if (m == 1) {   // (a lone row: its unit's strips in one call, s z' formed in the correction)
        tl_parallel_for((strips + UNIT - 1) / UNIT, [&](int c, int) {
            qq_packed_strips<1, false>(L, xq, xd, X, y, ldy, c * UNIT, std::min(strips, c * UNIT + UNIT), nullptr);
        });
        return;
    }
    const int NG16 = NG * 16;
    tl_parallel_for((strips + UNIT - 1) / UNIT, [&](int c, int) {
        thread_local std::vector<float> szb;   // (NG, 16) the strip's s z' (or -min), formed once for every input row
        if ((int)szb.size() < NG16) szb.resize(NG16);
        float* const szp = szb.data();   // (read once: a thread_local in a shared library is a call)
        const int s0 = c * UNIT, s1 = std::min(strips, s0 + UNIT);
        for (int s = s0; s < s1; ++s) {
            const uint8_t* P = L->packed + s * packed_strip_bytes(L);
            for (int g = 0; g < NG; ++g) _mm512_storeu_ps(szp + (int64_t)g * 16, packed_sz(L, P, g));
            for (int r0 = 0; r0 < m; r0 += 8) {   // (the strip's codes stay in L1 from the first row block on)
                const int8_t* xr = xq + (int64_t)r0 * K;
                const float *dr = xd + (int64_t)r0 * NA, *Xr = X + (int64_t)r0 * NG;
                float* yr = y + (int64_t)r0 * ldy;
                packed_rows<false>(std::min(8, m - r0), L, xr, dr, Xr, yr, ldy, s, s + 1, szp);
            }
        }
    });
}
#endif
}  // namespace

void qq_linear_rows(const tl_linear* L, const float* x, int m, float* y, int ldy, float* scratch) {
    const int K = L->k, AB = act_block(L->group), NA = K / AB, NG = K / L->group, APG = L->group / AB;
    int8_t* xq = (int8_t*)scratch;                       // m * k bytes (scratch holds m * k floats)
    float* xd = scratch + (int64_t)m * K;                // then 2 * m * k / 32 floats (<= m * k / 8)
    float* xs = xd + (int64_t)m * NA;
    float* X = xs + (int64_t)m * NA;                     // then m * k / group (<= m * k / 32) floats
#if TL_VNNI512
    // (at every row count: the shipped model's loop, one thread, 0.31 ms at 17 rows against 0.71 with the AMX
    // tiles, 0.87 against 1.58 at 64, 1.65 against 3.04 at 128: the tiles' per-strip unpacking and scaling)
    const bool packed = L->packed && L->kind == TL_Q4;
#else
    const bool packed = false;
#endif
    // int4: evens then odds per 64 columns (the packed kernel: column order); int8 in 32-column blocks: split8's
    quantize_q8(x, m, K, AB, xq, xd, xs, L->kind == TL_Q4 ? (packed ? 0 : 1) : AB == 32 ? 2 : 0);
    for (int r = 0; r < m; ++r)
        for (int g = 0; g < NG; ++g) {
            float t = 0.f;
            for (int a = g * APG; a < (g + 1) * APG; ++a) t = fmaf(xd[(int64_t)r * NA + a], xs[(int64_t)r * NA + a], t);
            X[(int64_t)r * NG + g] = t;
        }
#if TL_VNNI512
    if (packed) return qq_packed(L, xq, xd, X, m, y, ldy);
#endif
    if (L->kind == TL_Q8) {
        if (AB % 64 == 0 && m >= AMX_MIN_ROWS_Q8 && amx_ready()) return amx_rows_q8(L, AB, xq, xd, xs, X, m, y, ldy);
    } else if (m >= (AB == 32 ? AMX_MIN_ROWS_SPLIT : AMX_MIN_ROWS) && K % 64 == 0 && amx_ready()) {
        return amx_rows(L, AB, xq, xd, X, m, y, ldy);
    }
    thread_local QQPlan plan;   // the calling thread's; the workers read it during the call
    qq_plan(L, AB == 32, plan);
    const QQPlan& P = plan;
    // (a long matrix, the head: chunks of 256 rows, so that the per-chunk set-up is not paid 1,571 times;
    // the threads still get dozens of chunks each)
    const int chunk = L->n >= 16384 ? 8 * CHUNK : CHUNK;
    tl_parallel_for((L->n + chunk - 1) / chunk, [&](int c, int) {
        const int n0 = c * chunk, n1 = std::min(L->n, (c + 1) * chunk);
        if (L->kind == TL_Q8 && AB == 32) qq_rows<8, true>(L, xq, P, xd, xs, X, m, y, ldy, n0, n1);   // Q8_0's groups
        else if (L->kind == TL_Q8) qq_rows<8, false>(L, xq, P, xd, xs, X, m, y, ldy, n0, n1);
        else if (AB == 32) qq_rows<4, true>(L, xq, P, xd, xs, X, m, y, ldy, n0, n1);
        else qq_rows<4, false>(L, xq, P, xd, xs, X, m, y, ldy, n0, n1);
    });
}
#endif

extern "C" int64_t tl_pack_int4_size(const tl_linear* L) {
#if TL_SIMD && TL_VNNI512
    if (L->kind != TL_Q4 || !int8_activations(L) || L->k % 8) return -1;
    return (int64_t)((L->n + 15) / 16) * packed_strip_bytes(L);
#else
    (void)L;
    return -1;
#endif
}

extern "C" int32_t tl_pack_int4(const tl_linear* L, uint8_t* out) {
#if TL_SIMD && TL_VNNI512
    if (tl_pack_int4_size(L) < 0) return 1;
    const int K = L->k, NG = K / L->group, strips = (L->n + 15) / 16;
    const int64_t SB = packed_strip_bytes(L), row_bytes = K / 2;
    const uint8_t* w = (const uint8_t*)L->w;
    for (int s = 0; s < strips; ++s) {
        uint8_t* P = out + s * SB;
        for (int wr = 0; wr < 16; ++wr) {
            // a row's 4 code bytes b0-b3 of columns 8 o .. 8 o + 7 (column 2 i in b_i's low nibble, 2 i + 1 in its
            // high one) -> byte i: column 8 o + i low, 8 o + 4 + i high
            const int row = 16 * s + wr;
            const uint8_t* src = w + (int64_t)row * row_bytes;
            for (int o = 0; o < K / 8; ++o) {
                uint8_t* dst = P + 64 * o + 4 * wr;
                if (row >= L->n) {
                    memset(dst, 0, 4);
                    continue;
                }
                const uint8_t b0 = src[4 * o], b1 = src[4 * o + 1], b2 = src[4 * o + 2], b3 = src[4 * o + 3];
                dst[0] = (uint8_t)((b0 & 15) | (b2 & 15) << 4);
                dst[1] = (uint8_t)((b0 >> 4) | (b2 & 0xF0));
                dst[2] = (uint8_t)((b1 & 15) | (b3 & 15) << 4);
                dst[3] = (uint8_t)((b1 >> 4) | (b3 & 0xF0));
            }
        }
        uint16_t* sv = (uint16_t*)(P + (int64_t)K * 8);
        uint8_t* zs = (uint8_t*)(sv + (int64_t)NG * 16);
        float* sf = (float*)(P + (int64_t)K * 8);
        for (int g = 0; g < NG; ++g)
            for (int wr = 0; wr < 16; ++wr) {   // (rows past n: scale 0, zero point 0 or min 0)
                const int row = 16 * s + wr;
                const int64_t i = (int64_t)row * NG + g;
                if (L->packed_f32) {   // s and s z' (or -min) in fp32, as packed_sz forms them
                    const float sc = row < L->n ? f16_to_f32(L->scales[i]) : 0.f;
                    sf[g * 16 + wr] = sc;
                    sf[(NG + g) * 16 + wr] = row < L->n ? group_sz(L, row, g, sc, 0.f) : 0.f;
                    continue;
                }
                sv[g * 16 + wr] = row < L->n ? L->scales[i] : 0;
                if (L->mins) ((uint16_t*)zs)[g * 16 + wr] = row < L->n ? L->mins[i] : 0;
                else zs[g * 16 + wr] = row < L->n ? L->zeros[i] : 0;
            }
    }
    return 0;
#else
    (void)L;
    (void)out;
    return 1;
#endif
}
