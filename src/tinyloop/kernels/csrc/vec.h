// SIMD mappings behind one interface: 8 float lanes (`vf`) with AVX2 + FMA + F16C, or one lane in the
// portable scalar build. Kernels are written once against these functions (ggml's vec.h idea).
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>

// e^x's constants (Cephes' expf): the 8-lane vexp and the 16-lane wexp share them, so their lanes are bitwise equal
namespace tl_exp {
constexpr float LIM = 88.0f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;
}  // namespace tl_exp
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TL_SIMD 1
// int8 dot products of four bytes a lane into int32 (vpdpbusd: unsigned x signed): AVX-512 VNNI on 256-bit
// vectors (with VL), or AVX-VNNI. Their int32 lanes hold exactly the sums the AVX2 maddubs + madd sequence
// forms (no saturation either way: matmul.cpp), so both builds compute bit-identical layers.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TL_VNNI 1
#define TL_VNNI512 1   // and on 512-bit vectors (matmul.cpp qq_rows8)
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define TL_VNNI 1
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define TL_VNNI 0
#endif
#ifndef TL_VNNI512
#define TL_VNNI512 0
#endif
#define TL_W 8
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vload_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline vf vload_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline float vhmax(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
// the sums of a[0] .. a[7], one per lane (eight dot products finished at once, no per-dot horizontal sum);
// lane j is bitwise vsum(a[j]): ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), so a dot product finished
// eight at a time equals the same one finished alone (batch invariance: matmul.cpp)
static inline vf vsum8(const vf* a) {
    vf s[4];   // s[j] = [a[j] lanes i + (i + 4) | a[j + 4] lanes i + (i + 4)], i = 0..3
    for (int j = 0; j < 4; ++j)
        s[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[j], a[j + 4], 0x20), _mm256_permute2f128_ps(a[j], a[j + 4], 0x31));
    // [(s0 + s2), (s1 + s3)] of two vectors side by side, then the two added
    const vf p = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], 0x44), _mm256_shuffle_ps(s[0], s[1], 0xEE));
    const vf q = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], 0x44), _mm256_shuffle_ps(s[2], s[3], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(p, q, 0x88), _mm256_shuffle_ps(p, q, 0xDD));
}
// e^x, relative error ~2e-7 (Cephes' expf polynomial); x is clamped to +-88 (e^88 is still finite)
static inline vf vexp(vf x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-tl_exp::LIM)), _mm256_set1_ps(tl_exp::LIM));
    const vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(tl_exp::LOG2E)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(tl_exp::LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(tl_exp::LN2_LO), r);
    vf p = _mm256_set1_ps(tl_exp::P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(tl_exp::P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(tl_exp::P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(tl_exp::P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(tl_exp::P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(tl_exp::P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#if defined(__AVX512F__)
// vexp on sixteen lanes (AVX-512 builds: attention.cpp's softmax): the same operations lane by lane, so each
// lane is bitwise vexp's
static inline __m512 wexp(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-tl_exp::LIM)), _mm512_set1_ps(tl_exp::LIM));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(tl_exp::LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(tl_exp::LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(tl_exp::LN2_LO), r);
    __m512 p = _mm512_set1_ps(tl_exp::P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(tl_exp::P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(tl_exp::P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(tl_exp::P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(tl_exp::P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(tl_exp::P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif
// 8 bytes -> 8 int lanes; codes of `bits` at bit offset `shift` of each byte -> floats
typedef __m256i vi;
static inline vi vload_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline vf vcodes(vi b, int shift, int mask) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, shift), _mm256_set1_epi32(mask)));
}
#else
#define TL_SIMD 0
#define TL_W 1
typedef float vf;
static inline vf vzero() { return 0.0f; }
static inline vf vset1(float a) { return a; }
static inline vf vload(const float* p) { return *p; }
static inline void vstore(float* p, vf a) { *p = a; }
static inline float f16_to_f32(uint16_t h);
static inline vf vload_f16(const uint16_t* p) { return f16_to_f32(*p); }
static inline vf vload_bf16(const uint16_t* p) { uint32_t u = (uint32_t)*p << 16; float f; memcpy(&f, &u, 4); return f; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline float vsum(vf a) { return a; }
static inline float vhmax(vf a) { return a; }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline vf vexp(vf x) { return expf(x); }
typedef int32_t vi;
static inline vi vload_u8(const uint8_t* p) { return *p; }
static inline vf vcodes(vi b, int shift, int mask) { return (float)((b >> shift) & mask); }
#endif

// scalar conversions (IEEE round-to-nearest-even, as torch's .to())
static inline float f16_to_f32(uint16_t h) {
    _Float16 v; memcpy(&v, &h, 2); return (float)v;
}
static inline uint16_t f32_to_f16(float f) {
    _Float16 v = (_Float16)f; uint16_t h; memcpy(&h, &v, 2); return h;
}
static inline float bf16_to_f32(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);   // NaN stays NaN
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// dot of n values with n floats (n a multiple of TL_W), two accumulators; LOAD reads TL_W values as floats
template <typename T, vf (*LOAD)(const T*)>
static inline float dot_as_f32(const T* a, const float* b, int n) {
    vf s0 = vzero(), s1 = vzero();
    int i = 0;
    for (; i + 2 * TL_W <= n; i += 2 * TL_W) {
        s0 = vfma(LOAD(a + i), vload(b + i), s0);
        s1 = vfma(LOAD(a + i + TL_W), vload(b + i + TL_W), s1);
    }
    for (; i < n; i += TL_W) s0 = vfma(LOAD(a + i), vload(b + i), s0);
    return vsum(vadd(s0, s1));
}
static inline float dot_f32(const float* a, const float* b, int n) { return dot_as_f32<float, vload>(a, b, n); }
static inline float dot_f16(const uint16_t* a, const float* b, int n) { return dot_as_f32<uint16_t, vload_f16>(a, b, n); }

// y += a * x over n floats
static inline void axpy_f32(float a, const float* x, float* y, int n) {
    vf va = vset1(a);
    for (int i = 0; i < n; i += TL_W) vstore(y + i, vfma(va, vload(x + i), vload(y + i)));
}
