// Rotary embedding, the KV write in every pool format, and paged decode attention (one query token per
// row, grouped-query heads, sliding windows). The pool is model/paged.py's PagedKV: page p, offset o,
// kv head g of a slot is entry ((p * page_size + o) * Hkv + g) of keys and values.
#include "tinyloop.h"
#include "threads.h"
#include "vec.h"

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
        case TL_KV_F16: for (int i = 0; i < D; ++i) ((uint16_t*)base)[e * D + i] = f32_to_f16(x[i]); return;
        case TL_KV_BF16: for (int i = 0; i < D; ++i) ((uint16_t*)base)[e * D + i] = f32_to_bf16(x[i]); return;
        default: break;
    }
    if (kv->format == TL_KV_I4H) tl_fwht(x, D);
    const int bits = kv_bits(kv->format);
    uint16_t* sc = which ? kv->v_scale : kv->k_scale;
    uint16_t* of = which ? kv->v_offset : kv->k_offset;
    quantize_vector(x, D, bits, (uint8_t*)base + e * (D * bits / 8), sc + e, of + e);
}

// Attention of one row's H query heads (q: (H, D), already rotated) over keys at storage indices
// lo .. hi of one slot (pages from `table` column `slot`); out: (H, D). Work split over kv heads.
// scratch per thread: rep * (hi - lo + 1) + 3 * D floats.
void tl_attend_row(const tl_kv* kv, const tl_row* row, int slot, int H, int Hkv, int D, const float* q,
                   float* out, int g, float* scratch) {
    const int rep = H / Hkv, ps = kv->page_size;
    const int lo = row->window > 0 && row->pos - row->window + 1 > 0 ? row->pos - row->window + 1 : 0;
    const int hi = row->pos, L = hi - lo + 1;
    const float scale = 1.0f / sqrtf((float)D);
    float* sc = scratch;                     // (rep, L)
    float* kbuf = scratch + (int64_t)rep * L;
    float* qr = kbuf + D;                    // rotated queries (int4-h): rep * D
    const bool rot = kv->format == TL_KV_I4H;
    const float* qg = q + (int64_t)g * rep * D;
    if (rot) {
        for (int i = 0; i < rep * D; ++i) qr[i] = qg[i];
        for (int i = 0; i < rep; ++i) tl_fwht(qr + (int64_t)i * D, D);
        qg = qr;
    }
    const bool f16 = kv->format == TL_KV_F16, f32 = kv->format == TL_KV_F32;
    for (int t = lo; t <= hi; ++t) {
        const int64_t page = row->table[(int64_t)(t / ps) * row->stride + slot];
        const int64_t e = (page * ps + t % ps) * Hkv + g;
        const float* kv_f = kbuf;
        if (f16) {        // the common pool: dot products straight from the fp16 keys
            const uint16_t* kp = (const uint16_t*)kv->k + e * D;
            for (int i = 0; i < rep; ++i) sc[(int64_t)i * L + (t - lo)] = dot_f16(kp, qg + (int64_t)i * D, D) * scale;
            continue;
        }
        if (f32) kv_f = (const float*)kv->k + e * D;
        else read_entry(kv, 0, e, D, kbuf);
        for (int i = 0; i < rep; ++i) sc[(int64_t)i * L + (t - lo)] = dot_f32(qg + (int64_t)i * D, kv_f, D) * scale;
    }
    for (int i = 0; i < rep; ++i) {
        float* s = sc + (int64_t)i * L;
        float mx = s[0];
        for (int t = 1; t < L; ++t) mx = s[t] > mx ? s[t] : mx;
        float sum = 0.f;
        int t = 0;
        const vf vmx = vset1(mx);
        vf vs = vzero();
        for (; t + TL_W <= L; t += TL_W) {
            const vf e = vexp(vsub(vload(s + t), vmx));
            vstore(s + t, e);
            vs = vadd(vs, e);
        }
        sum = vsum(vs);
        for (; t < L; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }
        const float inv = 1.0f / sum;
        for (int t = 0; t < L; ++t) s[t] *= inv;
    }
    float* og = out + (int64_t)g * rep * D;
    for (int i = 0; i < rep * D; ++i) og[i] = 0.f;
    for (int t = lo; t <= hi; ++t) {
        const int64_t page = row->table[(int64_t)(t / ps) * row->stride + slot];
        const int64_t e = (page * ps + t % ps) * Hkv + g;
        if (f16) {        // out += p * V straight from the fp16 values
            const uint16_t* vp = (const uint16_t*)kv->v + e * D;
            for (int i = 0; i < rep; ++i) {
                const vf p = vset1(sc[(int64_t)i * L + (t - lo)]);
                float* o = og + (int64_t)i * D;
                for (int d = 0; d < D; d += TL_W) vstore(o + d, vfma(p, vload_f16(vp + d), vload(o + d)));
            }
            continue;
        }
        const float* v_f = kbuf;
        if (f32) v_f = (const float*)kv->v + e * D;
        else read_entry(kv, 1, e, D, kbuf);
        for (int i = 0; i < rep; ++i) axpy_f32(sc[(int64_t)i * L + (t - lo)], v_f, og + (int64_t)i * D, D);
    }
    if (rot)
        for (int i = 0; i < rep; ++i) tl_fwht(og + (int64_t)i * D, D);
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
