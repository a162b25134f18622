// The optional pieces of the decode step (model/layers.py, model/looped.py): q/k norms, value embeddings, the
// ReLU^2 MLP, the diagonal injection, the projection C after the loops and the logit soft-cap. A model
// without them never calls these; each is a step of its own after the math the other families share.
#include <cmath>
#include <cstring>
#include "tinyloop.h"
#include "vec.h"
#include "step.h"

namespace tl_step {
namespace {
// row i of a float table (TL_F32/F16/BF16) of n columns, as floats
void table_row(const void* t, int kind, int64_t i, int n, float* out) {
    const int64_t o = i * n;
    for (int c = 0; c < n; ++c)
        out[c] = kind == TL_F32 ? ((const float*)t)[o + c]
               : kind == TL_F16 ? f16_to_f32(((const uint16_t*)t)[o + c])
               : bf16_to_f32(((const uint16_t*)t)[o + c]);
}
}  // namespace

// F.rms_norm(x, (D,)) over each head: x / sqrt(mean(x^2) + eps), eps torch's default (the dtype's epsilon)
void qk_norm(float* q, int heads, int D, float eps) {
    for (int hd = 0; hd < heads; ++hd) {
        float* x = q + (int64_t)hd * D;
        const vf inv = vset1(1.0f / sqrtf(dot_f32(x, x, D) / (float)D + eps));
        for (int i = 0; i < D; i += TL_W) vstore(x + i, vmul(vload(x + i), inv));
    }
}

// v = v + gate * ve, gate = 2 sigmoid(ve_gate(xn[:C])) per kv head (Attention.forward)
void value_embed(const tl_model* m, const tl_block* b, const tl_row* row, const float* xn, const float* e_row,
                 float* v) {
    const int Hkv = m->n_kv_heads, D = m->head_dim, C = m->ve_channels;
    float looked[1024];
    const float* ve = b->ve_col >= 0 ? e_row + b->ve_col : looked;
    for (int g = 0; g < Hkv; ++g) {
        float z = 0.0f;
        for (int c = 0; c < C; ++c) z += b->ve_gate[(int64_t)g * C + c] * xn[c];
        const float gate = 2.0f * (1.0f / (1.0f + expf(-z)));
        const float* src = ve + (int64_t)g * D;
        if (b->ve_col < 0) {   // a prelude block: the row's token in the block's table, a head at a time
            table_row(b->ve_table, b->ve_kind, (int64_t)row->token * Hkv + g, D, looked);
            src = looked;
        }
        float* vg = v + (int64_t)g * D;
        const vf gv = vset1(gate);
        for (int i = 0; i < D; i += TL_W) vstore(vg + i, vadd(vload(vg + i), vmul(gv, vload(src + i))));
    }
}

void relu2(float* a, int64_t n) {
    const vf zero = vzero();
    int64_t i = 0;
    for (; i + TL_W <= n; i += TL_W) {
        const vf r = vmax(vload(a + i), zero);
        vstore(a + i, vmul(r, r));
    }
    for (; i < n; ++i) {
        const float r = a[i] > 0.0f ? a[i] : 0.0f;
        a[i] = r * r;
    }
}

// DiagonalInjection.forward: h * decay + dt * (e B^T), decay and dt per channel (fp32, made in Python)
void diagonal_inject(const tl_model* m, const float* h, const float* e, int64_t ldE, float* x, int M, Buffers& B) {
    const int64_t dim = m->dim;
    const float* in = e;
    if (ldE != dim) {   // the value embeddings ride after the first dim columns: the state's part, packed
        for (int r = 0; r < M; ++r) memcpy(B.a + r * dim, e + r * ldE, sizeof(float) * dim);
        in = B.a;
    }
    tl_linear_rows(&m->inj_B, in, M, x, (int)dim, B.lin);
    for (int r = 0; r < M; ++r) {
        const float* hr = h + r * dim;
        float* xr = x + r * dim;
        for (int64_t i = 0; i < dim; i += TL_W)
            vstore(xr + i, vadd(vmul(vload(hr + i), vload(m->inj_decay + i)),
                                vmul(vload(m->inj_dt + i), vload(xr + i))));
    }
}

// the core's and coda's value embeddings of a token, at their columns of the loop input (embed_prelude)
void loop_input_ve(const tl_model* m, int token, float* e_row) {
    const int nb = m->n_prelude + m->n_core + m->n_coda, kvd = m->n_kv_heads * m->head_dim;
    for (int i = m->n_prelude; i < nb; ++i) {
        const tl_block* b = &m->blocks[i];
        if (b->ve_gate && b->ve_col >= 0) table_row(b->ve_table, b->ve_kind, token, kvd, e_row + b->ve_col);
    }
}

void project_state(const tl_linear* C, int dim, float* x, int n, Buffers& B) {
    tl_linear_rows(C, x, n, B.y, dim, B.lin);
    memcpy(x, B.y, sizeof(float) * n * dim);
}

// LoopedTransformer.logits: c * tanh(out / c)
void softcap(float* y, int m, int n, int64_t ld, float c) {
    for (int r = 0; r < m; ++r) {
        float* yr = y + r * ld;
        for (int i = 0; i < n; ++i) yr[i] = c * tanhf(yr[i] / c);
    }
}
}  // namespace tl_step
