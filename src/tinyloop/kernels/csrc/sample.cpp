// Sampling as a noisy argmax (engine/sampling.py, "Sampling by shared noise"): the token drawn at output
// index n of a request with seed s is argmax_j (x_j / T + g(key(s, n), j)), g a Gumbel variate made from a
// counter-based hash of (key, token id). The same (seed, index) gives the same token whatever else the step
// holds, whichever path computes it (plain rows, speculation's drafts and verification), on every build.
//
// The noise is defined by float32 operations, each rounded on its own: separate multiplies and adds (no
// fused multiply-add), a division, integer hashing. engine/sampling.py computes the same operations in
// PyTorch; tests/kernels/test_sample.py checks the two bit for bit, on every build the host runs.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <algorithm>
#include <vector>
#include "tinyloop.h"
#include "step.h"
#include "vec.h"

// (the argmax every draw runs is here, with the draws: step.cpp's greedy heads call it, as they call tl_draw)
// index of the largest of x[0 .. n-1]: the first of equal maxima, or the first NaN (torch.argmax's rule)
int32_t tl_step::argmax(const float* x, int n) {
    // the first NaN if there is one, else the first index holding the maximum (-0 == +0, as the scalar rule)
    int i = 0;
    float best = -INFINITY;
    bool nan = false;
#if TL_SIMD
    // four independent chains (the max of a max is exact: the order they meet in changes nothing), then
    // the first lane equal to it, 8 at a time; a NaN seen anywhere: the scalar scan below finds the first
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0, un = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        un = _mm256_or_ps(un, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
        m0 = _mm256_max_ps(a, m0), m1 = _mm256_max_ps(b, m1), m2 = _mm256_max_ps(c, m2), m3 = _mm256_max_ps(d, m3);
    }
    best = vhmax(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    nan = _mm256_movemask_ps(un) != 0;
#endif
    for (; i < n; ++i) {
        nan = nan || x[i] != x[i];
        best = x[i] > best ? x[i] : best;
    }
    if (nan) {
        for (i = 0; i < n; ++i)
            if (x[i] != x[i]) return i;
    }
    i = 0;
#if TL_SIMD
    const __m256 vb = _mm256_set1_ps(best);
    for (; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vb, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < n; ++i)
        if (x[i] == best) return i;
    return 0;
}

namespace {
constexpr uint32_t MIX1 = 0x7feb352du, MIX2 = 0x846ca68bu, GOLD = 0x9e3779b9u;
constexpr float C3 = 0x1.555556p-2f, C5 = 0x1.99999ap-3f, C7 = 0x1.24924ap-3f, C9 = 0x1.c71c72p-4f;
constexpr float SQRT2 = 0x1.6a09e6p+0f, LN2 = 0x1.62e430p-1f, TWO_M24 = 0x1p-24f;

inline uint32_t mix32(uint32_t x) {   // a 32-bit integer hash (lowbias32)
    x ^= x >> 16; x *= MIX1; x ^= x >> 15; x *= MIX2; x ^= x >> 16;
    return x;
}

// ln x for a positive normal float: x = 2^e m, m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(t), t = (m-1)/(m+1),
// by its series to t^9 (|t| <= 0.172: the next term is below 1e-9)
inline float ln32(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    int32_t e = (int32_t)((b >> 23) & 0xffu) - 127;
    const uint32_t mb = (b & 0x7fffffu) | 0x3f800000u;
    float m;
    memcpy(&m, &mb, 4);
    if (m > SQRT2) { m = m * 0.5f; e = e + 1; }
    const float t = (m - 1.0f) / (m + 1.0f);
    const float t2 = t * t;
    float s = C9 * t2;
    s = s + C7; s = s * t2; s = s + C5; s = s * t2; s = s + C3; s = s * t2; s = s + 1.0f;
    const float lnm = (t * s) * 2.0f;
    return (float)e * LN2 + lnm;
}

inline uint32_t token_hash(uint32_t key, uint32_t tok) { return mix32((tok * GOLD) ^ key); }

inline float gumbel_of(uint32_t h) {
    const float v = (float)(((h >> 9) << 1) | 1u) * TWO_M24;   // (0, 1), exactly: an odd multiple of 2^-24
    return -ln32(-ln32(v));
}

inline float gumbel(uint32_t key, uint32_t tok) { return gumbel_of(token_hash(key, tok)); }

#if TL_SIMD
inline __m256i vmix32(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)MIX1));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)MIX2));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

inline __m256 vln32(__m256 x) {   // ln32's operations, lane by lane
    const __m256i b = _mm256_castps_si256(x);
    __m256i e = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 23), _mm256_set1_epi32(0xff)),
                                 _mm256_set1_epi32(127));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffff)),
                                                   _mm256_set1_epi32(0x3f800000)));
    const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(SQRT2), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
    e = _mm256_sub_epi32(e, _mm256_castps_si256(big));   // the mask is -1 where big
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one));
    const __m256 t2 = _mm256_mul_ps(t, t);
    __m256 s = _mm256_mul_ps(_mm256_set1_ps(C9), t2);
    s = _mm256_add_ps(s, _mm256_set1_ps(C7)); s = _mm256_mul_ps(s, t2);
    s = _mm256_add_ps(s, _mm256_set1_ps(C5)); s = _mm256_mul_ps(s, t2);
    s = _mm256_add_ps(s, _mm256_set1_ps(C3)); s = _mm256_mul_ps(s, t2);
    s = _mm256_add_ps(s, one);
    const __m256 lnm = _mm256_mul_ps(_mm256_mul_ps(t, s), _mm256_set1_ps(2.0f));
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(e), _mm256_set1_ps(LN2)), lnm);
}

inline __m256i vtoken_hash(uint32_t key, __m256i tok) {
    return vmix32(_mm256_xor_si256(_mm256_mullo_epi32(tok, _mm256_set1_epi32((int)GOLD)), _mm256_set1_epi32((int)key)));
}

inline __m256 vgumbel_of(__m256i h) {
    const __m256i odd = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(h, 9), 1), _mm256_set1_epi32(1));
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(odd), _mm256_set1_ps(TWO_M24));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return _mm256_xor_ps(vln32(_mm256_xor_ps(vln32(v), sign)), sign);
}
#endif

// What lets a draw skip most of the row. g = -ln(-ln v) <= -ln(1 - v) (as -ln v >= 1 - v), and 1 - v is an
// odd multiple of 2^-24 at least 2^e (e its float exponent), so g <= -e ln 2: an integer hash and an exponent
// bound every token's noise. A token whose x / T plus that bound (and a margin far above the float error of
// the computed g) stays below the score of the row's argmax cannot be drawn, and its noise is never computed.
constexpr float BOUND_MARGIN = 1e-3f;

inline float noise_bound_of(uint32_t h) {
    const uint32_t odd_w = (1u << 24) - (((h >> 9) << 1) | 1u);   // (1 - v) * 2^24
    const float fw = (float)odd_w;
    uint32_t b;
    memcpy(&b, &fw, 4);
    return (float)(151 - (int32_t)(b >> 23)) * LN2 + BOUND_MARGIN;
}

#if TL_SIMD
inline __m256 vnoise_bound_of(__m256i h) {
    const __m256i odd_v = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(h, 9), 1), _mm256_set1_epi32(1));
    const __m256 fw = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_set1_epi32(1 << 24), odd_v));
    const __m256i e = _mm256_sub_epi32(_mm256_set1_epi32(151), _mm256_srli_epi32(_mm256_castps_si256(fw), 23));
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(e), _mm256_set1_ps(LN2)), _mm256_set1_ps(BOUND_MARGIN));
}

inline __m256i tokens8(const int64_t* ids, int j) {
    if (!ids) return _mm256_add_epi32(_mm256_set1_epi32(j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    alignas(32) int32_t t[8];
    for (int i = 0; i < 8; ++i) t[i] = (int32_t)ids[j + i];
    return _mm256_load_si256((const __m256i*)t);
}
#endif

// x[j] <- x[j] * inv_temp + g(key, token of j), j < n; the token of j is ids[j] (null: j)
void add_noise(float* x, int n, const int64_t* ids, float inv_temp, uint32_t key) {
    int j = 0;
#if TL_SIMD
    const __m256 it = _mm256_set1_ps(inv_temp);
    for (; j + 8 <= n; j += 8) {
        const __m256 g = vgumbel_of(vtoken_hash(key, tokens8(ids, j)));
        _mm256_storeu_ps(x + j, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), it), g));
    }
#endif
    for (; j < n; ++j) x[j] = x[j] * inv_temp + gumbel(key, ids ? (uint32_t)ids[j] : (uint32_t)j);
}


// x[j] <- x[j] * inv_temp + g(key, token of j) where token j could be drawn, -inf where it cannot (the row's
// argmax unchanged), j < n; the token of j is ids[j] (null: j)
void add_noise_pruned(float* x, int n, const int64_t* ids, float inv_temp, uint32_t key) {
    const int j0 = tl_step::argmax(x, n);
    const uint32_t t0 = ids ? (uint32_t)ids[j0] : (uint32_t)j0;
    const float s0 = x[j0] * inv_temp + gumbel(key, t0);
    if (!(s0 > -INFINITY && s0 < INFINITY)) {   // a NaN or an infinity: the whole row, no pruning
        add_noise(x, n, ids, inv_temp, key);
        return;
    }
    int j = 0;
#if TL_SIMD
    const __m256 it = _mm256_set1_ps(inv_temp), vs0 = _mm256_set1_ps(s0), ninf = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) {
        const __m256i h = vtoken_hash(key, tokens8(ids, j));
        const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + j), it);
        const __m256 can = _mm256_cmp_ps(_mm256_add_ps(t, vnoise_bound_of(h)), vs0, _CMP_GE_OQ);
        if (__builtin_expect(_mm256_movemask_ps(can) != 0, 0)) _mm256_storeu_ps(x + j, _mm256_add_ps(t, vgumbel_of(h)));
        else _mm256_storeu_ps(x + j, ninf);
    }
#endif
    for (; j < n; ++j) {
        const uint32_t h = token_hash(key, ids ? (uint32_t)ids[j] : (uint32_t)j);
        const float t = x[j] * inv_temp;
        x[j] = t + noise_bound_of(h) >= s0 ? t + gumbel_of(h) : -INFINITY;
    }
}

// top-k and top-p on scores y (x / T), in place: a dropped token's score becomes -inf. top-k keeps the
// scores at least the k-th largest; top-p then keeps, in descending order of score (ties by index), the
// tokens whose probability mass before them is below p (the first always). Probabilities are exp(y - max)
// in float32 over their sum in double. engine/sampling.py `truncate` is the same rule in PyTorch (its sums
// run in sorted order, these bucket by bucket: a cut within rounding of p may fall differently).
//
// No sort of the row: scores are bucketed by their distance below the maximum (1/16 wide, the last bucket
// open), the bucket that holds the k-th score or the p cut is found from the buckets' counts or masses, and
// only that bucket's tokens are ordered. Every token of a nearer bucket scores higher than every token of a
// farther one, so the kept set is the sorted rule's.
constexpr int N_BUCKETS = 1024;
constexpr float BUCKETS_PER_UNIT = 16.0f;

inline int bucket(float mx, float y) {
    const float d = (mx - y) * BUCKETS_PER_UNIT;
    return d < (float)(N_BUCKETS - 1) ? (int)d : N_BUCKETS - 1;
}

float row_max(const float* y, int n) {
    float mx = -INFINITY;
    for (int j = 0; j < n; ++j) mx = y[j] > mx ? y[j] : mx;
    return mx;
}

void truncate(float* y, int n, int top_k, float top_p) {
    thread_local std::vector<float> w;
    thread_local std::vector<int32_t> in_cut;
    float mx = row_max(y, n);
    if (!(mx > -INFINITY && mx < INFINITY)) return;   // nothing finite, or an infinity: no cut
    if (top_k > 0 && top_k < n) {
        int32_t count[N_BUCKETS] = {0};
        for (int j = 0; j < n; ++j)
            if (y[j] > -INFINITY) ++count[bucket(mx, y[j])];
        int b = 0, before = 0;
        while (b < N_BUCKETS - 1 && before + count[b] < top_k) before += count[b++];
        if (before + count[b] >= top_k) {   // the k-th largest is in bucket b
            w.clear();
            for (int j = 0; j < n; ++j)
                if (y[j] > -INFINITY && bucket(mx, y[j]) == b) w.push_back(y[j]);
            const int r = top_k - before - 1;
            std::nth_element(w.begin(), w.begin() + r, w.end(), std::greater<float>());
            const float kth = w[r];
            for (int j = 0; j < n; ++j)
                if (y[j] < kth) y[j] = -INFINITY;
        }
    }
    if (!(top_p < 1.0f)) return;
    w.resize(n);
    int j = 0;
#if TL_SIMD
    const vf vmx = vset1(mx);
    for (; j + TL_W <= n; j += TL_W) vstore(&w[j], vexp(vsub(vload(y + j), vmx)));
#endif
    for (; j < n; ++j) w[j] = expf(y[j] - mx);
    double mass[N_BUCKETS] = {0.0};
    for (j = 0; j < n; ++j)
        if (y[j] > -INFINITY) mass[bucket(mx, y[j])] += w[j];
    double Z = 0.0;
    for (int b = 0; b < N_BUCKETS; ++b) Z += mass[b];
    const double target = (double)top_p * Z;
    int b = 0;
    double before = 0.0;
    while (b < N_BUCKETS - 1 && before + mass[b] < target) before += mass[b++];
    // bucket b holds the cut: its tokens in descending order (ties by index), kept while the mass before is
    // below the target (the row's first token always)
    in_cut.clear();
    for (j = 0; j < n; ++j)
        if (y[j] > -INFINITY && bucket(mx, y[j]) == b) in_cut.push_back(j);
    std::stable_sort(in_cut.begin(), in_cut.end(), [&](int32_t a, int32_t c) { return y[a] > y[c]; });
    size_t keep = in_cut.size();
    for (size_t i = 0; i < in_cut.size(); ++i) {
        if ((b > 0 || i > 0) && before >= target) { keep = i; break; }
        before += w[in_cut[i]];
    }
    for (size_t i = keep; i < in_cut.size(); ++i) y[in_cut[i]] = -INFINITY;
    for (j = 0; j < n; ++j)
        if (y[j] > -INFINITY && bucket(mx, y[j]) > b) y[j] = -INFINITY;
}
}  // namespace

extern "C" uint32_t tl_noise_key(uint64_t seed, int64_t n) {
    return mix32(mix32((uint32_t)seed ^ mix32((uint32_t)n)) ^ (uint32_t)(seed >> 32));
}

extern "C" void tl_gumbel(uint32_t key, const int64_t* ids, int32_t n, float* out) {
    for (int j = 0; j < n; ++j) out[j] = 0.0f;
    add_noise(out, n, ids, 1.0f, key);
}

extern "C" int32_t tl_choose(float* x, int32_t n, const int64_t* ids, float inv_temp, uint32_t key) {
    if (inv_temp > 0.0f) add_noise_pruned(x, n, ids, inv_temp, key);
    return tl_step::argmax(x, n);
}

extern "C" int32_t tl_draw(float* x, int32_t n, const int64_t* ids, const tl_sampling* s) {
    if (s->mask) {   // the grammar's forbidden tokens out first (a word of all ones: 32 allowed, skipped)
        const uint32_t* w = s->mask;
        if (ids) {
            for (int j = 0; j < n; ++j)
                if (!((w[ids[j] >> 5] >> (ids[j] & 31)) & 1u)) x[j] = -INFINITY;
        } else {
            for (int i = 0; 32 * i < n; ++i) {
                const uint32_t bits = w[i];
                if (bits == 0xffffffffu) continue;
                const int end = std::min(n, 32 * i + 32);
                if (bits == 0u)
                    std::fill(x + 32 * i, x + end, -INFINITY);
                else
                    for (int j = 32 * i; j < end; ++j)
                        if (!((bits >> (j & 31)) & 1u)) x[j] = -INFINITY;
            }
        }
    }
    if (!(s->inv_temp > 0.0f)) return tl_step::argmax(x, n);
    if ((s->top_k > 0 && s->top_k < n) || s->top_p < 1.0f) {
        for (int j = 0; j < n; ++j) x[j] = x[j] * s->inv_temp;
        truncate(x, n, s->top_k, s->top_p);
        add_noise_pruned(x, n, ids, 1.0f, s->key);
        return tl_step::argmax(x, n);
    }
    return tl_choose(x, n, ids, s->inv_temp, s->key);
}

extern "C" void tl_perturb(float* x, int32_t n, const int64_t* ids, const tl_sampling* s) {
    for (int j = 0; j < n; ++j) x[j] = x[j] * s->inv_temp;
    if ((s->top_k > 0 && s->top_k < n) || s->top_p < 1.0f) truncate(x, n, s->top_k, s->top_p);
    const float mx = row_max(x, n);
    if (!(mx > -INFINITY && mx < INFINITY)) return;
    double z = 0.0;
    for (int j = 0; j < n; ++j) z += x[j] > -INFINITY ? exp((double)(x[j] - mx)) : 0.0;
    const float lse = mx + (float)log(z);
    for (int j = 0; j < n; ++j) x[j] -= lse;
    add_noise(x, n, ids, 1.0f, s->key);
}
