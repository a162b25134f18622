// Rotary embedding, the KV write in every pool format, and paged decode attention (one query token per
// row, grouped-query heads, sliding windows). The pool is model/paged.py's PagedKV: page p, offset o,
// kv head g of a slot is entry ((p * page_size + o) * Hkv + g) of keys and values.
#include "tinyloop.h"
#include "threads.h"
#include "vec.h"
#include <algorithm>

// GPT-NeoX half-split RoPE in place on n_heads vectors of D: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
void tl_rope(float* x, int n_heads, int D, const float* cos, const float* sin) {
    const int h2 = D / 2;
    for (int h = 0; h < n_heads; ++h) {
        float* v = x + (int64_t)h * D;
        for (int i = 0; i < h2; ++i) {
            const float a = v[i], b = v[i + h2];
            v[i] = a * cos[i] + b * -sin[i];
            v[i + h2] = b * cos[i] + a * sin[i];
        }
    }
}

// orthonormal fast Walsh-Hadamard transform (Sylvester order) of n floats in place: x @ H = H x
void tl_fwht(float* x, int n) {
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float s = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; ++i) x[i] *= s;
}

namespace {
int kv_bits(int format) { return format == TL_KV_I8 ? 8 : 4; }

// quant/kv.py quantize_vectors for one vector of D: asymmetric, float16 scale and offset (the minimum)
void quantize_vector(const float* x, int D, int bits, uint8_t* codes, uint16_t* scale, uint16_t* offset) {
    const int maxq = (1 << bits) - 1;
    float lo = x[0], hi = x[0];
    for (int i = 1; i < D; ++i) { lo = x[i] < lo ? x[i] : lo; hi = x[i] > hi ? x[i] : hi; }
    const uint16_t lo16 = f32_to_f16(lo);
    const float lof = f16_to_f32(lo16);
    float sc = (hi - lof) / (float)maxq;
    sc = sc < 1e-6f ? 1e-6f : sc;
    const uint16_t sc16 = f32_to_f16(sc);
    const float scf = f16_to_f32(sc16);
    *scale = sc16;
    *offset = lo16;
    if (bits == 8) {
        for (int i = 0; i < D; ++i) {
            float q = nearbyintf((x[i] - lof) / scf);
            codes[i] = (uint8_t)(q < 0 ? 0 : q > maxq ? maxq : q);
        }
    } else {
        for (int i = 0; i < D; i += 2) {
            float q0 = nearbyintf((x[i] - lof) / scf), q1 = nearbyintf((x[i + 1] - lof) / scf);
            uint8_t c0 = (uint8_t)(q0 < 0 ? 0 : q0 > maxq ? maxq : q0);
            uint8_t c1 = (uint8_t)(q1 < 0 ? 0 : q1 > maxq ? maxq : q1);
            codes[i / 2] = (uint8_t)(c0 | (c1 << 4));
        }
    }
}

// entry e of a pool tensor (keys or values) -> D floats
inline void read_entry(const tl_kv* kv, int which, int64_t e, int D, float* out) {
    const void* base = which ? kv->v : kv->k;
    switch (kv->format) {
        case TL_KV_F32: memcpy(out, (const float*)base + e * D, sizeof(float) * D); return;
        case TL_KV_F16: { const uint16_t* p = (const uint16_t*)base + e * D;
            for (int i = 0; i < D; i += TL_W) vstore(out + i, vload_f16(p + i)); return; }
        case TL_KV_BF16: { const uint16_t* p = (const uint16_t*)base + e * D;
            for (int i = 0; i < D; i += TL_W) vstore(out + i, vload_bf16(p + i)); return; }
        default: break;
    }
    const uint16_t* sc = which ? kv->v_scale : kv->k_scale;
    const uint16_t* of = which ? kv->v_offset : kv->k_offset;
    const float s = f16_to_f32(sc[e]), o = f16_to_f32(of[e]);
    if (kv->format == TL_KV_I8) {
        const uint8_t* c = (const uint8_t*)base + e * D;
        for (int i = 0; i < D; ++i) out[i] = (float)c[i] * s + o;
    } else {
        const uint8_t* c = (const uint8_t*)base + e * (D / 2);
        for (int i = 0; i < D; i += 2) {
            out[i] = (float)(c[i / 2] & 15) * s + o;
            out[i + 1] = (float)(c[i / 2] >> 4) * s + o;
        }
    }
}
}  // namespace

// store one kv head's key or value vector x (D floats; rotated first for int4-h, x is clobbered)
void tl_kv_write(const tl_kv* kv, int which, int64_t e, int D, float* x) {
    void* base = which ? kv->v : kv->k;
    switch (kv->format) {
        case TL_KV_F32: memcpy((float*)base + e * D, x, sizeof(float) * D); return;
        case TL_KV_F16: {
            uint16_t* o = (uint16_t*)base + e * D;
            int i = 0;
#if TL_SIMD   // (F16C's conversion rounds to nearest even, as f32_to_f16)
            for (; i + 8 <= D; i += 8)
                _mm_storeu_si128((__m128i*)(o + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
            for (; i < D; ++i) o[i] = f32_to_f16(x[i]);
            return;
        }
        case TL_KV_BF16: for (int i = 0; i < D; ++i) ((uint16_t*)base)[e * D + i] = f32_to_bf16(x[i]); return;
        default: break;
    }
    if (kv->format == TL_KV_I4H) tl_fwht(x, D);
    const int bits = kv_bits(kv->format);
    uint16_t* sc = which ? kv->v_scale : kv->k_scale;
    uint16_t* of = which ? kv->v_offset : kv->k_offset;
    quantize_vector(x, D, bits, (uint8_t*)base + e * (D * bits / 8), sc + e, of + e);
}

namespace {
// the pool entry of each key position lo .. hi of one slot's kv head g, a page at a time
void entries(const tl_kv* kv, const tl_row* row, int slot, int Hkv, int g, int lo, int hi, int64_t* ent) {
    const int ps = kv->page_size;
    for (int t = lo; t <= hi;) {
        const int pi = t / ps, off = t - pi * ps, n = std::min(ps - off, hi - t + 1);
        const int64_t e0 = (row->table[(int64_t)pi * row->stride + slot] * ps + off) * Hkv + g;
        for (int i = 0; i < n; ++i) ent[t - lo + i] = e0 + (int64_t)i * Hkv;
        t += n;
    }
}

// the pool entry of storage index t of one slot's kv head g
inline int64_t entry(const tl_kv* kv, const tl_row* row, int slot, int Hkv, int g, int t) {
    const int ps = kv->page_size;
    return (row->table[(int64_t)(t / ps) * row->stride + slot] * ps + t % ps) * Hkv + g;
}

// the keys row `row` attends to: committed storage indices lo .. hi (storage index == position there),
// then a tree node's visible node keys; returns their count, writes their pool entries to ent if non-null
int visible_keys(const tl_kv* kv, const tl_row* row, int slot, int Hkv, int g, int64_t* ent) {
    const int pos = row->pos, win = row->window;
    const int lo = win > 0 && pos - win + 1 > 0 ? pos - win + 1 : 0;
    const int hi = row->tree_n > 0 ? std::min(pos, row->tree_base - 1) : pos;
    int L = hi >= lo ? hi - lo + 1 : 0;
    if (ent && L) entries(kv, row, slot, Hkv, g, lo, hi, ent);
    for (int i = 0; i < row->tree_n; ++i)
        if (win <= 0 || pos - row->tree_pos[i] < win) {
            if (ent) ent[L] = entry(kv, row, slot, Hkv, g, row->tree_keys[i]);
            ++L;
        }
    return L;
}

#if TL_SIMD && defined(__AVX512F__) && defined(__AVX512DQ__)
// 512-bit vectors where the build has them, for the same arithmetic: two keys' eight lanes side by side in one
// vector (each lane the chain over d that the 8-lane code forms), sixteen outputs of an fma chain over t, or
// sixteen e^x at once; every result bitwise the 8-lane code's (so the AVX2 and AVX-512 builds agree)
#define TL_WIDE 1
template <typename T, vf (*LOAD)(const T*)> inline __m512 wload(const T* p);   // sixteen values as floats
template <> inline __m512 wload<float, vload>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 wload<uint16_t, vload_f16>(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
template <> inline __m512 wload<uint16_t, vload_bf16>(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
template <typename T, vf (*LOAD)(const T*)>
inline __m512 wload2(const T* a, const T* b) {   // eight values of a, then eight of b
    return _mm512_insertf32x8(_mm512_castps256_ps512(LOAD(a)), LOAD(b), 1);
}
inline __m512 wq(const float* q) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(q)); }   // q's eight, twice
inline void wsplit(const __m512* a, int n, vf* out) {   // n two-key vectors -> 2n eight-lane ones
    for (int i = 0; i < n; ++i) {
        out[2 * i] = _mm512_castps512_ps256(a[i]);
        out[2 * i + 1] = _mm512_extractf32x8_ps(a[i], 1);
    }
}
#else
#define TL_WIDE 0
#endif

// the pool entries ent[t0 .. t1) (D values of T each), a cache line at a time: a row's keys lie a page's
// entries apart, one of Hkv heads' in every Hkv, spread over pages, so the hardware's stream prefetch does not
// see them coming; decode's attention waited on these loads (16 sequences, two threads: perf put 30% of the
// time in attention, a quarter of its samples on one key load)
template <typename T>
inline void prefetch_entries(const T* base, const int64_t* ent, int t0, int t1, int D) {
#if TL_SIMD
    for (int t = t0; t < t1; ++t)
        for (int b = 0; b < D * (int)sizeof(T); b += 64) _mm_prefetch((const char*)(base + ent[t] * D) + b, _MM_HINT_T0);
#else
    (void)base; (void)ent; (void)t0; (void)t1; (void)D;
#endif
}

// s[t] = scale * q . key(ent[t]) for float keys read as stored (T: float or 16-bit, LOAD: TL_W as floats)
template <typename T, vf (*LOAD)(const T*)>
void scores(const T* keys, const int64_t* ent, int L, const float* q, int D, float scale, float* s, int t0 = 0) {
    int t = t0;   // (a multiple of 8: the blocks below start where they would from 0)
    prefetch_entries(keys, ent, t, std::min(L, t + 16), D);
#if TL_WIDE
    for (; t + 8 <= L; t += 8) {   // eight keys at a time, two a vector: eight independent sums, finished together
        prefetch_entries(keys, ent, t + 16, std::min(L, t + 24), D);   // (two blocks on, while this one runs)
        __m512 acc[4];
        for (int j = 0; j < 4; ++j) acc[j] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += TL_W) {
            const __m512 qv = wq(q + d);
            for (int j = 0; j < 4; ++j)
                acc[j] = _mm512_fmadd_ps(wload2<T, LOAD>(keys + ent[t + 2 * j] * D + d, keys + ent[t + 2 * j + 1] * D + d),
                                         qv, acc[j]);
        }
        vf a8[8];
        wsplit(acc, 4, a8);
        vstore(s + t, vmul(vsum8(a8), vset1(scale)));
    }
#elif TL_SIMD
    for (; t + 8 <= L; t += 8) {   // eight keys at a time: eight independent sums, finished together
        prefetch_entries(keys, ent, t + 16, std::min(L, t + 24), D);
        vf acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = vzero();
        for (int d = 0; d < D; d += TL_W) {
            const vf qv = vload(q + d);
            for (int j = 0; j < 8; ++j) acc[j] = vfma(LOAD(keys + ent[t + j] * D + d), qv, acc[j]);
        }
        vstore(s + t, vmul(vsum8(acc), vset1(scale)));
    }
#endif
    for (; t < L; ++t) s[t] = dot_as_f32<T, LOAD>(keys + ent[t] * D, q, D) * scale;
}

// out (D) = sum_t p[t] value(ent[t]), 8 vectors of out at a time held in registers
template <typename T, vf (*LOAD)(const T*)>
void weighted_sum(const T* vals, const int64_t* ent, int L, const float* p, int D, float* out) {
    constexpr int CH = 8 * TL_W;
    int d0 = 0;
#if TL_WIDE
    for (; d0 + CH <= D; d0 += CH) {   // (each output the same chain: 16 lanes a vector instead of 8)
        __m512 acc[4];
        for (int i = 0; i < 4; ++i) acc[i] = _mm512_setzero_ps();
        if (d0 == 0) prefetch_entries(vals, ent, 0, std::min(L, 16), D);
        for (int t = 0; t < L; ++t) {
            if (d0 == 0 && t + 16 < L) prefetch_entries(vals, ent, t + 16, t + 17, D);
            const __m512 pv = _mm512_set1_ps(p[t]);
            const T* v = vals + ent[t] * D + d0;
            for (int i = 0; i < 4; ++i) acc[i] = _mm512_fmadd_ps(pv, wload<T, LOAD>(v + 16 * i), acc[i]);
        }
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + d0 + 16 * i, acc[i]);
    }
#endif
    for (; d0 + CH <= D; d0 += CH) {
        vf acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = vzero();
        if (d0 == 0) prefetch_entries(vals, ent, 0, std::min(L, 16), D);
        for (int t = 0; t < L; ++t) {
            if (d0 == 0 && t + 16 < L) prefetch_entries(vals, ent, t + 16, t + 17, D);
            const vf pv = vset1(p[t]);
            const T* v = vals + ent[t] * D + d0;
            for (int i = 0; i < 8; ++i) acc[i] = vfma(pv, LOAD(v + i * TL_W), acc[i]);
        }
        for (int i = 0; i < 8; ++i) vstore(out + d0 + i * TL_W, acc[i]);
    }
    if (d0 == D) return;
    for (int d = d0; d < D; d += TL_W) vstore(out + d, vzero());
    for (int t = 0; t < L; ++t) {
        const vf pv = vset1(p[t]);
        const T* v = vals + ent[t] * D;
        for (int d = d0; d < D; d += TL_W) vstore(out + d, vfma(pv, LOAD(v + d), vload(out + d)));
    }
}

// softmax of s (n) in place
void softmax(float* s, int n) {
    float mx = s[0];
    int t = 1;
#if TL_WIDE   // (the maximum is exact in any order; NaNs are passed over as the scalar compare does)
    if (n >= 17) {
        __m512 m = _mm512_set1_ps(mx);
        for (; t + 16 <= n; t += 16) m = _mm512_max_ps(_mm512_loadu_ps(s + t), m);
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, m);
        for (int i = 0; i < 16; ++i) mx = lanes[i] > mx ? lanes[i] : mx;
    }
#endif
    for (; t < n; ++t) mx = s[t] > mx ? s[t] : mx;
    const vf vmx = vset1(mx);
    vf vs = vzero();
    t = 0;
#if TL_WIDE   // sixteen exps a vector, summed eight lanes at a time in the 8-lane code's order
    const __m512 wmx = _mm512_set1_ps(mx);
    for (; t + 16 <= n; t += 16) {
        const __m512 e = wexp(_mm512_sub_ps(_mm512_loadu_ps(s + t), wmx));
        _mm512_storeu_ps(s + t, e);
        vs = vadd(vs, _mm512_castps512_ps256(e));
        vs = vadd(vs, _mm512_extractf32x8_ps(e, 1));
    }
#endif
    for (; t + TL_W <= n; t += TL_W) {
        const vf e = vexp(vsub(vload(s + t), vmx));
        vstore(s + t, e);
        vs = vadd(vs, e);
    }
    float sum = vsum(vs);
    for (; t < n; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }
    const float inv = 1.0f / sum;
    for (t = 0; t < n; ++t) s[t] *= inv;
}
#if TL_SIMD
// scores() of R rows over their common keys [0, n) (n whole 8s), each key read once for all of them: the same
// eight sums per block (each key's accumulator over d in order), the same vsum8, so the same bits as each alone
template <typename T, vf (*LOAD)(const T*), int R>
void scores_rows(const T* keys, const int64_t* ent, int n, const float* const* q, int D, float scale,
                 float* const* s) {
#if TL_WIDE
    constexpr int P = R <= 4 ? 4 : 2;   // key pairs a pass (two keys a vector): R * P accumulators, R queries
    for (int t = 0; t < n; t += 8) {
        __m512 S[R][4];
        for (int h = 0; h < 4; h += P) {
            __m512 a[R][P];
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < P; ++j) a[r][j] = _mm512_setzero_ps();
            for (int d = 0; d < D; d += TL_W) {
                __m512 qv[R];
                for (int r = 0; r < R; ++r) qv[r] = wq(q[r] + d);
                for (int j = 0; j < P; ++j) {
                    const int k0 = t + 2 * (h + j);
                    const __m512 k = wload2<T, LOAD>(keys + ent[k0] * D + d, keys + ent[k0 + 1] * D + d);
                    for (int r = 0; r < R; ++r) a[r][j] = _mm512_fmadd_ps(k, qv[r], a[r][j]);
                }
            }
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < P; ++j) S[r][h + j] = a[r][j];
        }
        for (int r = 0; r < R; ++r) {
            vf a8[8];
            wsplit(S[r], 4, a8);
            vstore(s[r] + t, vmul(vsum8(a8), vset1(scale)));
        }
    }
#else
    constexpr int KB = R <= 2 ? 4 : R <= 4 ? 2 : 1;   // keys a pass: R * KB accumulators, R queries, a key
    for (int t = 0; t < n; t += 8) {
        vf S[R][8];
        for (int h = 0; h < 8; h += KB) {
            vf a[R][KB];
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < KB; ++j) a[r][j] = vzero();
            for (int d = 0; d < D; d += TL_W) {
                vf qv[R];
                for (int r = 0; r < R; ++r) qv[r] = vload(q[r] + d);
                for (int j = 0; j < KB; ++j) {
                    const vf k = LOAD(keys + ent[t + h + j] * D + d);
                    for (int r = 0; r < R; ++r) a[r][j] = vfma(k, qv[r], a[r][j]);
                }
            }
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < KB; ++j) S[r][h + j] = a[r][j];
        }
        for (int r = 0; r < R; ++r) vstore(s[r] + t, vmul(vsum8(S[r]), vset1(scale)));
    }
#endif
}

// weighted_sum() of R rows whose keys are [0, La + r) (row r one position after row r - 1), each value read once
// for all of them: every output an fma chain over t in order from zero, as weighted_sum's (D whole 32s)
template <typename T, vf (*LOAD)(const T*), int R>
void weighted_sum_rows(const T* vals, const int64_t* ent, int La, const float* const* p, int D, float* const* o) {
#if TL_WIDE
    for (int d0 = 0; d0 < D; d0 += 32) {   // two 16-lane vectors a row
        __m512 a[R][2];
        for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int t = 0; t < La; ++t) {
            const T* v = vals + ent[t] * D + d0;
            const __m512 x0 = wload<T, LOAD>(v), x1 = wload<T, LOAD>(v + 16);
            for (int r = 0; r < R; ++r) {
                const __m512 pv = _mm512_set1_ps(p[r][t]);
                a[r][0] = _mm512_fmadd_ps(pv, x0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(pv, x1, a[r][1]);
            }
        }
        for (int r = 1; r < R; ++r)   // each later row's own last keys, La .. La + r - 1
            for (int t = La; t < La + r; ++t) {
                const __m512 pv = _mm512_set1_ps(p[r][t]);
                const T* v = vals + ent[t] * D + d0;
                a[r][0] = _mm512_fmadd_ps(pv, wload<T, LOAD>(v), a[r][0]);
                a[r][1] = _mm512_fmadd_ps(pv, wload<T, LOAD>(v + 16), a[r][1]);
            }
        for (int r = 0; r < R; ++r) {
            _mm512_storeu_ps(o[r] + d0, a[r][0]);
            _mm512_storeu_ps(o[r] + d0 + 16, a[r][1]);
        }
    }
#else
    constexpr int CW = R <= 2 ? 4 : R <= 4 ? 2 : 1;   // output vectors a row at a time
    for (int d0 = 0; d0 < D; d0 += CW * TL_W) {
        vf a[R][CW];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < CW; ++i) a[r][i] = vzero();
        for (int t = 0; t < La; ++t) {
            vf pv[R];
            for (int r = 0; r < R; ++r) pv[r] = vset1(p[r][t]);
            const T* v = vals + ent[t] * D + d0;
            for (int i = 0; i < CW; ++i) {
                const vf x = LOAD(v + i * TL_W);
                for (int r = 0; r < R; ++r) a[r][i] = vfma(pv[r], x, a[r][i]);
            }
        }
        for (int r = 1; r < R; ++r)   // each later row's own last keys, La .. La + r - 1
            for (int t = La; t < La + r; ++t) {
                const vf pv = vset1(p[r][t]);
                const T* v = vals + ent[t] * D + d0;
                for (int i = 0; i < CW; ++i) a[r][i] = vfma(pv, LOAD(v + i * TL_W), a[r][i]);
            }
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < CW; ++i) vstore(o[r] + d0 + i * TL_W, a[r][i]);
    }
#endif
}

// R rows' attention for one kv head: q[r] (rep, D), s[r] (rep, La + r) scores, o[r] (rep, D)
template <typename T, vf (*LOAD)(const T*), int R>
void attend_rows(const T* keys, const T* vals, const int64_t* ent, int La, int rep, int D, const float* const* q,
                 float* const* s, float* const* o) {
    const float scale = 1.0f / sqrtf((float)D);
    const int T8 = La / 8 * 8;
    for (int i = 0; i < rep; ++i) {
        const float* qi[R];
        float* si[R];
        float* oi[R];
        for (int r = 0; r < R; ++r) {
            qi[r] = q[r] + (int64_t)i * D;
            si[r] = s[r] + (int64_t)i * (La + r);
            oi[r] = o[r] + (int64_t)i * D;
        }
        scores_rows<T, LOAD, R>(keys, ent, T8, qi, D, scale, si);
        for (int r = 0; r < R; ++r) scores<T, LOAD>(keys, ent, La + r, qi[r], D, scale, si[r], T8);   // the rest
        for (int r = 0; r < R; ++r) softmax(si[r], La + r);
        weighted_sum_rows<T, LOAD, R>(vals, ent, La, si, D, oi);
    }
}

template <typename T, vf (*LOAD)(const T*)>
void attend_rows_n(int R, const T* keys, const T* vals, const int64_t* ent, int La, int rep, int D,
                   const float* const* q, float* const* s, float* const* o) {
    switch (R) {
        case 8: attend_rows<T, LOAD, 8>(keys, vals, ent, La, rep, D, q, s, o); break;
        case 7: attend_rows<T, LOAD, 7>(keys, vals, ent, La, rep, D, q, s, o); break;
        case 6: attend_rows<T, LOAD, 6>(keys, vals, ent, La, rep, D, q, s, o); break;
        case 5: attend_rows<T, LOAD, 5>(keys, vals, ent, La, rep, D, q, s, o); break;
        case 4: attend_rows<T, LOAD, 4>(keys, vals, ent, La, rep, D, q, s, o); break;
        case 3: attend_rows<T, LOAD, 3>(keys, vals, ent, La, rep, D, q, s, o); break;
        default: attend_rows<T, LOAD, 2>(keys, vals, ent, La, rep, D, q, s, o); break;
    }
}
#endif
}  // namespace

// Two to TL_ATTEND_ROWS rows of one sequence at consecutive positions (a prefill chunk's, a verification's), no
// tree keys, no window, a float pool, D whole 32s (tl_attend_pairable says when, pair by pair): tl_attend_row's
// results for each, bit for bit, each key and value read once for all of them (attention over a long prompt is
// bound by reading them). q: row r's queries at q + r * q_ld; out likewise. scratch: tl_attend_scratch(
// TL_ATTEND_ROWS * H / Hkv, keys seen by the last row, D) floats.
bool tl_attend_pairable(const tl_kv* kv, const tl_row* a, const tl_row* b, int D) {
#if TL_SIMD
    return (kv->format == TL_KV_F32 || kv->format == TL_KV_F16 || kv->format == TL_KV_BF16) && D % 32 == 0
           && a->table == b->table && a->stride == b->stride && a->tree_n == 0 && b->tree_n == 0
           && a->window <= 0 && b->window <= 0 && b->pos == a->pos + 1;
#else
    (void)kv; (void)a; (void)b; (void)D;
    return false;
#endif
}

void tl_attend_rows(const tl_kv* kv, const tl_row* rows, int R, int slot, int H, int Hkv, int D, const float* q,
                    int64_t q_ld, float* out, int64_t o_ld, int g, float* scratch) {
#if TL_SIMD
    const int rep = H / Hkv, La = rows[0].pos + 1;
    const float* qs[TL_ATTEND_ROWS];
    float* ss[TL_ATTEND_ROWS];
    float* os[TL_ATTEND_ROWS];
    int64_t at = 0;
    for (int r = 0; r < R; ++r) {   // (rep, La + r) scores each
        qs[r] = q + r * q_ld + (int64_t)g * rep * D;
        os[r] = out + r * o_ld + (int64_t)g * rep * D;
        ss[r] = scratch + at;
        at += (int64_t)rep * (La + r);
    }
    int64_t* ent = (int64_t*)(scratch + ((at + 1) & ~(int64_t)1));   // (La + R - 1), 8-byte aligned
    entries(kv, &rows[R - 1], slot, Hkv, g, 0, rows[R - 1].pos, ent);
    if (kv->format == TL_KV_F32)
        attend_rows_n<float, vload>(R, (const float*)kv->k, (const float*)kv->v, ent, La, rep, D, qs, ss, os);
    else if (kv->format == TL_KV_F16)
        attend_rows_n<uint16_t, vload_f16>(R, (const uint16_t*)kv->k, (const uint16_t*)kv->v, ent, La, rep, D, qs, ss, os);
    else
        attend_rows_n<uint16_t, vload_bf16>(R, (const uint16_t*)kv->k, (const uint16_t*)kv->v, ent, La, rep, D, qs, ss, os);
#else
    (void)kv; (void)rows; (void)R; (void)slot; (void)H; (void)Hkv; (void)D; (void)q; (void)q_ld; (void)out; (void)o_ld;
    (void)g; (void)scratch;
#endif
}

// Attention of one row's H query heads (q: (H, D), already rotated) over the keys it sees in one slot
// (pages from `table` column `slot`): storage indices lo .. pos (the window's), or for a tree node the
// committed ones and its ancestors' (`visible_keys`); out: (H, D). Work split over kv heads: this is kv
// head g and its H / Hkv query heads. scratch: tl_attend_scratch(H / Hkv, keys seen, D) floats.
void tl_attend_row(const tl_kv* kv, const tl_row* row, int slot, int H, int Hkv, int D, const float* q,
                   float* out, int g, float* scratch) {
    const int rep = H / Hkv;
    const int L = visible_keys(kv, row, slot, Hkv, g, nullptr);
    const float scale = 1.0f / sqrtf((float)D);
    float* sc = scratch;                                    // (rep, L) scores, then probabilities
    int64_t* ent = (int64_t*)(sc + (((int64_t)rep * L + 1) & ~(int64_t)1));   // (L) pool entries, 8-byte aligned
    float* kbuf = (float*)(ent + L);                        // one entry as floats (quantized pools)
    float* qr = kbuf + D;                                   // rotated queries (int4-h): rep * D
    visible_keys(kv, row, slot, Hkv, g, ent);
    const float* qg = q + (int64_t)g * rep * D;
    float* og = out + (int64_t)g * rep * D;
    const uint16_t* k16 = (const uint16_t*)kv->k;
    const uint16_t* v16 = (const uint16_t*)kv->v;
    switch (kv->format) {   // the float pools are read in place
        case TL_KV_F32:
            for (int i = 0; i < rep; ++i) scores<float, vload>((const float*)kv->k, ent, L, qg + i * D, D, scale, sc + (int64_t)i * L);
            for (int i = 0; i < rep; ++i) softmax(sc + (int64_t)i * L, L);
            for (int i = 0; i < rep; ++i) weighted_sum<float, vload>((const float*)kv->v, ent, L, sc + (int64_t)i * L, D, og + i * D);
            return;
        case TL_KV_F16:
            for (int i = 0; i < rep; ++i) scores<uint16_t, vload_f16>(k16, ent, L, qg + i * D, D, scale, sc + (int64_t)i * L);
            for (int i = 0; i < rep; ++i) softmax(sc + (int64_t)i * L, L);
            for (int i = 0; i < rep; ++i) weighted_sum<uint16_t, vload_f16>(v16, ent, L, sc + (int64_t)i * L, D, og + i * D);
            return;
        case TL_KV_BF16:
            for (int i = 0; i < rep; ++i) scores<uint16_t, vload_bf16>(k16, ent, L, qg + i * D, D, scale, sc + (int64_t)i * L);
            for (int i = 0; i < rep; ++i) softmax(sc + (int64_t)i * L, L);
            for (int i = 0; i < rep; ++i) weighted_sum<uint16_t, vload_bf16>(v16, ent, L, sc + (int64_t)i * L, D, og + i * D);
            return;
        default: break;
    }
    // quantized pools: each entry dequantized once into kbuf (int4-h: queries and outputs rotated instead of keys)
    const bool rot = kv->format == TL_KV_I4H;
    if (rot) {
        for (int i = 0; i < rep * D; ++i) qr[i] = qg[i];
        for (int i = 0; i < rep; ++i) tl_fwht(qr + (int64_t)i * D, D);
        qg = qr;
    }
    for (int t = 0; t < L; ++t) {
        read_entry(kv, 0, ent[t], D, kbuf);
        for (int i = 0; i < rep; ++i) sc[(int64_t)i * L + t] = dot_f32(qg + (int64_t)i * D, kbuf, D) * scale;
    }
    for (int i = 0; i < rep; ++i) softmax(sc + (int64_t)i * L, L);
    for (int i = 0; i < rep * D; ++i) og[i] = 0.f;
    for (int t = 0; t < L; ++t) {
        read_entry(kv, 1, ent[t], D, kbuf);
        for (int i = 0; i < rep; ++i) axpy_f32(sc[(int64_t)i * L + t], kbuf, og + (int64_t)i * D, D);
    }
    if (rot)
        for (int i = 0; i < rep; ++i) tl_fwht(og + (int64_t)i * D, D);
}

int64_t tl_attend_scratch(int rep, int max_ctx, int D) {
    return (int64_t)rep * max_ctx + 1 + 2 * (int64_t)max_ctx + D + (int64_t)rep * D;
}

// copy `n` consecutive pool entries (keys and values, codes with their scales) from entry `src` to `dst`
void tl_kv_copy(const tl_kv* kv, int64_t src, int64_t dst, int64_t n, int D) {
    int64_t bytes;
    switch (kv->format) {
        case TL_KV_F32: bytes = 4 * (int64_t)D; break;
        case TL_KV_F16: case TL_KV_BF16: bytes = 2 * (int64_t)D; break;
        case TL_KV_I8: bytes = D; break;
        default: bytes = D / 2; break;
    }
    for (int which = 0; which < 2; ++which) {
        char* base = (char*)(which ? kv->v : kv->k);
        memmove(base + dst * bytes, base + src * bytes, n * bytes);
        if (kv->format >= TL_KV_I8) {
            uint16_t* sc = which ? kv->v_scale : kv->k_scale;
            uint16_t* of = which ? kv->v_offset : kv->k_offset;
            memmove(sc + dst, sc + src, n * 2);
            memmove(of + dst, of + src, n * 2);
        }
    }
}
