// NVIDIA Dory's pieces of the decode step (model/families/dory.py, the one definition): justnorm and the nGPT
// single-sublayer blocks, an attention layer (S: sliding window, *: full) or an MLP layer, each followed by the
// residual step toward its normalized output. What Dory changes elsewhere is a line each: the loops enter as
// justnorm(h + e) and end with justnorm (step.cpp, spec.cpp), the head's logits are scaled per token (the
// head's out_scale, matmul.cpp), a layer's cache slot is model/cache.py SlotLayout's (tl_model.slot_map:
// last_loop keeps one slot per layer for every loop, MLP layers none) and a layer's window narrows the
// row's own (attention.cpp reads tl_row.window).
#include <algorithm>
#include <cmath>
#include <vector>
#include "tinyloop.h"
#include "vec.h"
#include "step.h"

void tl_rope(float* x, int n_heads, int D, const float* cos, const float* sin);

namespace tl_step {
void linears(const tl_linear* parts, int n, const float* x, int M, float* y, int ldy, float* lin);   // step.cpp

namespace {
float sum_squares(const float* x, int n) {
    vf s = vzero();
    int i = 0;
    for (; i + TL_W <= n; i += TL_W) s = vfma(vload(x + i), vload(x + i), s);
    float t = vsum(s);
    for (; i < n; ++i) t += x[i] * x[i];
    return t;
}

void scale_row(const float* x, float c, float* y, int n) {
    const vf vc = vset1(c);
    int i = 0;
    for (; i + TL_W <= n; i += TL_W) vstore(y + i, vmul(vload(x + i), vc));
    for (; i < n; ++i) y[i] = x[i] * c;
}

// the nGPT residual step (NGPTBlock.forward) over M rows: x = justnorm(a + alpha (b - a)), a = justnorm(x),
// b = justnorm(y); y is clobbered
void ngpt_residual(const float* alpha, float* x, float* y, int M, int dim) {
    justnorm(x, x, M, dim);
    justnorm(y, y, M, dim);
    for (int r = 0; r < M; ++r) {
        float* a = x + (int64_t)r * dim;
        const float* b = y + (int64_t)r * dim;
        for (int i = 0; i < dim; i += TL_W) {
            const vf av = vload(a + i);
            vstore(a + i, vfma(vload(alpha + i), vsub(vload(b + i), av), av));
        }
    }
    justnorm(x, x, M, dim);
}

// silu(g) = g / (1 + e^-g) (F.silu) and 1 / (1 + e^-z) (torch.sigmoid), n values
void silu_mul(const float* g, const float* sg, const float* u, const float* su, float* out, int n) {
    const vf one = vset1(1.0f), zero = vzero();
    int i = 0;
    for (; i + TL_W <= n; i += TL_W) {
        const vf gv = vmul(vload(g + i), vload(sg + i));
        const vf uv = vmul(vload(u + i), vload(su + i));
        vstore(out + i, vmul(vdiv(gv, vadd(one, vexp(vsub(zero, gv)))), uv));
    }
    for (; i < n; ++i) {
        const float gv = g[i] * sg[i];
        out[i] = gv / (1.0f + expf(-gv)) * (u[i] * su[i]);
    }
}
}  // namespace

void justnorm(const float* x, float* y, int m, int n) {
    for (int r = 0; r < m; ++r) {
        const float* xr = x + (int64_t)r * n;
        scale_row(xr, 1.0f / sqrtf(sum_squares(xr, n) + 1e-6f), y + (int64_t)r * n, n);
    }
}

// One Dory layer over M rows x (M, dim) at the step's slot number `slot` (or slots[i] per row), in place.
//   attention: q, k, v = x's projections (no input norm: x is on the sphere); RoPE of the layer's profile; q and
//   k justnormed per head, q times sqk; keys and values into the layer's slot; attention over the layer's
//   window (and the row's own); times sigmoid(g s_gate), g = wg x; justnorm over all heads; wo
//   MLP: justnorm(silu(gate suv_gate) (up suv_up)); down
void ngpt_block(const tl_model* m, const tl_block* b, const tl_kv* kv, const tl_row* rows, int M, int slot,
                float* x, Buffers& B, const int* slots) {
    const int dim = m->dim, D = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads, F = m->ffn_dim;
    if (b->ngpt == 2) {
        linears(b->up, b->n_up, x, M, B.gu, 2 * F, B.lin);   // gate, then up
        for (int r = 0; r < M; ++r) {
            const float* g = B.gu + (int64_t)r * 2 * F;
            float* a = B.act + (int64_t)r * F;
            silu_mul(g, b->suv_gate, g + F, b->suv_up, a, F);
            justnorm(a, a, 1, F);
        }
        tl_linear_rows(&b->down, B.act, M, B.y, dim, B.lin);
        ngpt_residual(b->alpha, x, B.y, M, dim);
        return;
    }
    const int QKV = (H + 2 * Hkv) * D, HD = H * D;
    linears(b->qkv, b->n_qkv, x, M, B.qkv, QKV, B.lin);
    const float* cos = b->profile == 2 ? m->rope_cos2 : m->rope_cos;
    const float* sin = b->profile == 2 ? m->rope_sin2 : m->rope_sin;
    // the rows as this layer's attention reads them: its window within the row's own, its slot(s)
    thread_local std::vector<tl_row> own_tl;
    thread_local std::vector<int> slot_tl;
    std::vector<tl_row>& own = own_tl;
    std::vector<int>& mapped = slot_tl;
    own.assign(rows, rows + M);
    mapped.resize(M);
    for (int r = 0; r < M; ++r) {
        if (b->window > 0) own[r].window = own[r].window > 0 ? std::min(own[r].window, b->window) : b->window;
        mapped[r] = map_slot(m, slots ? slots[r] : slot);
        float* q = B.qkv + (int64_t)r * QKV;
        const int pos = rows[r].pos, at = rows[r].tree_n > 0 ? rows[r].store : pos;   // position, storage index
        tl_rope(q, H + Hkv, D, cos + (int64_t)pos * (D / 2), sin + (int64_t)pos * (D / 2));
        justnorm(q, q, H + Hkv, D);   // every head on its sphere
        for (int i = 0; i < HD; i += TL_W) vstore(q + i, vmul(vload(q + i), vload(b->sqk + i)));
        store_kv(kv, rows[r], at, mapped[r], q, H, Hkv, D, B.tmp);
    }
    attend(m, kv, own.data(), M, mapped[0], B, mapped.data());
    // the output gate: g = wg x into B.qkv (free now), rows H * D apart
    tl_linear_rows(&b->wg, x, M, B.qkv, HD, B.lin);
    const vf one = vset1(1.0f), zero = vzero();
    for (int r = 0; r < M; ++r) {
        float* o = B.att + (int64_t)r * HD;
        const float* g = B.qkv + (int64_t)r * HD;
        for (int i = 0; i < HD; i += TL_W) {
            const vf z = vmul(vload(g + i), vload(b->s_gate + i));
            vstore(o + i, vmul(vload(o + i), vdiv(one, vadd(one, vexp(vsub(zero, z))))));
        }
    }
    justnorm(B.att, B.att, M, HD);
    tl_linear_rows(&b->wo, B.att, M, B.y, dim, B.lin);
    ngpt_residual(b->alpha, x, B.y, M, dim);
}
}  // namespace tl_step
