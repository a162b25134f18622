// The nGPT single-sublayer blocks of NVIDIA's Dory (model/families/dory.py, the one definition): an attention
// layer (S: sliding window, *: full) or an MLP layer, each followed by the residual step toward its normalized
// output. Registered as the block kind "ngpt" (step.h register_block); what else the family needs is shared:
// the state on the unit sphere (tl_model.sphere), a per-token logit scale (the head's out_scale), a second RoPE
// profile's tables and the cache slot map (tl_model), a row's window (attention.cpp reads tl_row.window).
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
// What the library reads of one nGPT layer besides the shared block fields (its projections: qkv, wo, and up
// and down), laid out in this order by NGPTBlock.native_fields (kernels/layers.py fills it). kind 1: an attention
// layer (wg the output gate's projection; window > 0: an S layer's sliding window; RoPE profile 1 or 2); 2: an
// MLP layer. The scales are the products the model forms, in fp32: sqk (H * D) = (sqk sqrt(D) / std)^2, s_gate
// (H * D) = (s_gate sqrt(g0) / std)^2, alpha (dim) = |alpha alpha_init / std|, suv_gate and suv_up (ffn) =
// suv * sqrt(dim)
struct NGPT {
    int32_t kind, window, profile;
    tl_linear wg;
    const float* sqk; const float* s_gate; const float* alpha;
    const float* suv_gate; const float* suv_up;
};

// the nGPT residual step (NGPTBlock.forward) over M rows: x = justnorm(a + alpha (b - a)), a = justnorm(x),
// b = justnorm(y); y is clobbered
void ngpt_residual(const float* alpha, float* x, float* y, int M, int dim) {
    l2norm(x, x, M, dim);
    l2norm(y, y, M, dim);
    for (int r = 0; r < M; ++r) {
        float* a = x + (int64_t)r * dim;
        const float* b = y + (int64_t)r * dim;
        for (int i = 0; i < dim; i += TL_W) {
            const vf av = vload(a + i);
            vstore(a + i, vfma(vload(alpha + i), vsub(vload(b + i), av), av));
        }
    }
    l2norm(x, x, M, dim);
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
// One nGPT layer over M rows x (M, dim) at the step's slot number `slot` (or slots[i] per row), in place.
//   attention: q, k, v = x's projections (no input norm: x is on the sphere); RoPE of the layer's profile; q and
//   k justnormed per head, q times sqk; keys and values into the layer's slot; attention over the layer's
//   window (and the row's own); times sigmoid(g s_gate), g = wg x; justnorm over all heads; wo
//   MLP: justnorm(silu(gate suv_gate) (up suv_up)); down
void ngpt_block(const tl_model* m, const tl_block* b, const tl_kv* kv, const tl_row* rows, int M, int slot,
                float* x, Buffers& B, const int* slots) {
    const NGPT* nb = (const NGPT*)b->own_fields;
    const int dim = m->dim, D = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads, F = m->ffn_dim;
    if (nb->kind == 2) {
        linears(b->up, b->n_up, x, M, B.gu, 2 * F, B.lin);   // gate, then up
        for (int r = 0; r < M; ++r) {
            const float* g = B.gu + (int64_t)r * 2 * F;
            float* a = B.act + (int64_t)r * F;
            silu_mul(g, nb->suv_gate, g + F, nb->suv_up, a, F);
            l2norm(a, a, 1, F);
        }
        tl_linear_rows(&b->down, B.act, M, B.y, dim, B.lin);
        ngpt_residual(nb->alpha, x, B.y, M, dim);
        return;
    }
    const int QKV = (H + 2 * Hkv) * D, HD = H * D;
    linears(b->qkv, b->n_qkv, x, M, B.qkv, QKV, B.lin);
    const float* cos = nb->profile == 2 ? m->rope_cos2 : m->rope_cos;
    const float* sin = nb->profile == 2 ? m->rope_sin2 : m->rope_sin;
    // the rows as this layer's attention reads them: its window within the row's own, its slot(s)
    thread_local std::vector<tl_row> own_tl;
    thread_local std::vector<int> slot_tl;
    std::vector<tl_row>& own = own_tl;
    std::vector<int>& mapped = slot_tl;
    own.assign(rows, rows + M);
    mapped.resize(M);
    for (int r = 0; r < M; ++r) {
        if (nb->window > 0) own[r].window = own[r].window > 0 ? std::min(own[r].window, nb->window) : nb->window;
        mapped[r] = map_slot(m, slots ? slots[r] : slot);
        float* q = B.qkv + (int64_t)r * QKV;
        const int pos = rows[r].pos, at = rows[r].tree_n > 0 ? rows[r].store : pos;   // position, storage index
        tl_rope(q, H + Hkv, D, cos + (int64_t)pos * (D / 2), sin + (int64_t)pos * (D / 2));
        l2norm(q, q, H + Hkv, D);   // every head on its sphere
        for (int i = 0; i < HD; i += TL_W) vstore(q + i, vmul(vload(q + i), vload(nb->sqk + i)));
        store_kv(kv, rows[r], at, mapped[r], q, H, Hkv, D, B.tmp);
    }
    attend(m, kv, own.data(), M, mapped[0], B, mapped.data());
    // the output gate: g = wg x into B.qkv (free now), rows H * D apart
    tl_linear_rows(&nb->wg, x, M, B.qkv, HD, B.lin);
    const vf one = vset1(1.0f), zero = vzero();
    for (int r = 0; r < M; ++r) {
        float* o = B.att + (int64_t)r * HD;
        const float* g = B.qkv + (int64_t)r * HD;
        for (int i = 0; i < HD; i += TL_W) {
            const vf z = vmul(vload(g + i), vload(nb->s_gate + i));
            vstore(o + i, vmul(vload(o + i), vdiv(one, vadd(one, vexp(vsub(zero, z))))));
        }
    }
    l2norm(B.att, B.att, M, HD);
    tl_linear_rows(&b->wo, B.att, M, B.y, dim, B.lin);
    ngpt_residual(nb->alpha, x, B.y, M, dim);
}

[[maybe_unused]] const int kind = register_block("ngpt", ngpt_block);
}  // namespace
}  // namespace tl_step
