// Integer dot products against int8 activations (intdot.cpp): the layers that take them, the activations'
// int8 round trip, and their rows.
#pragma once
#include "tinyloop.h"
#include "vec.h"

// A quantized layer's per-group offset as every kernel subtracts it, y = sum_g (s_g sum_{k in g} c x - sz_g X_g)
// with X_g the group's activation sum: sz = s (z - zbias) in the zero-point form (zbias 128 for int8 codes
// taken as c - 128, else 0), -min in the min form (L->mins, int4 only: w = c s + min). The product s (z - zbias)
// is one fp32 multiply wherever it is formed (scalar or vector), so precomputing it changes no bit.
static inline float group_sz(const tl_linear* L, int64_t row, int g, float s, float zbias) {
    const int64_t i = row * (L->k / L->group) + g;
    return L->mins ? -f16_to_f32(L->mins[i]) : s * ((float)L->zeros[i] - zbias);
}

// the layers the integer kernels take (the executor sets act_q8 where these hold): rows of whole 64s, or for
// int4 in activation blocks of 32 (groups not whole 64s) whole 32s, the last 32 columns a block of their own
// (a real model's width, 5280 = 82 x 64 + 32)
static inline bool int8_activations(const tl_linear* L) {
#if TL_SIMD
    return L->act_q8 && L->group % 32 == 0
           && ((L->kind == TL_Q4 && (L->k % 64 == 0 || (L->k % 32 == 0 && L->group % 64 != 0)))
               || (L->kind == TL_Q8 && L->group % 32 == 0 && L->k % 64 == 0));   // (groups of 32: Q8_0's)
#else
    (void)L;
    return false;
#endif
}

// the activation block of a layer with groups of G: the group, or 256 columns of a longer one; 32 where
// the group is not whole 64s
static inline int act_block(int G) {
    if (G % 64) return 32;
    for (int a = 256; a >= 64; a -= 64)
        if (G % a == 0) return a;
    return 64;
}

#if TL_SIMD
// the int8 scale of n activations: d = max |v| / 127 (and 1 / d, 0 for an all-zero block)
static inline float q8_scale(const float* v, int n, float* id) {
    float amax = 0.f;
    for (int i = 0; i < n; ++i) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    const float d = amax / 127.f;
    *id = d > 0 ? 1.f / d : 0.f;
    return d;
}

// n activations -> round(v / d) * d, what the integer dot products compute with
static inline void q8_roundtrip(const float* v, int n, float* out) {
    float id;
    const float d = q8_scale(v, n, &id);
    for (int i = 0; i < n; ++i) out[i] = nearbyintf(v[i] * id) * d;
}

// y[:, 0:n] (row stride ldy) for a layer with int8_activations(L): x quantized per activation block, then the
// integer tiles or AMX. scratch: m * k + m * k / 8 floats. Runs on the pool.
void qq_linear_rows(const tl_linear* L, const float* x, int m, float* y, int ldy, float* scratch);
#endif
