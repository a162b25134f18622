// One decode step of the looped model for a batch of one-token rows: embedding and prelude (rows from
// tokens) or a draft's states, the core over each row's loop range (injection, loop norm, adaptive exits),
// then each row's read-out (the coda, a draft exit, or none). The math is model/looped.py's and
// model/layers.py's; this file only runs it with fewer, fused passes. At each loop the rows taking part
// are packed first (a stable partition), so every pass is one batched call over contiguous rows.
#include <algorithm>
#include <cstring>
#include <ctime>
#include <vector>
#include "tinyloop.h"
#include "amx.h"
#include "threads.h"
#include "vec.h"
#include "step.h"

void tl_rope(float* x, int n_heads, int D, const float* cos, const float* sin);
void tl_kv_write(const tl_kv* kv, int which, int64_t e, int D, float* x);
void tl_kv_copy(const tl_kv* kv, int64_t src, int64_t dst, int64_t n, int D);
void tl_attend_row(const tl_kv* kv, const tl_row* row, int slot, int H, int Hkv, int D, const float* q,
                   float* out, int g, float* scratch);
int64_t tl_attend_scratch(int rep, int max_ctx, int D);
bool tl_attend_pairable(const tl_kv* kv, const tl_row* a, const tl_row* b, int D);
void tl_attend_rows(const tl_kv* kv, const tl_row* rows, int R, int slot, int H, int Hkv, int D, const float* q,
                    int64_t q_ld, float* out, int64_t o_ld, int g, float* scratch);

namespace tl_step {
// F.rms_norm over rows of n: y = x / sqrt(mean(x^2) + eps) * w
void rmsnorm(const float* x, const float* w, float* y, int m, int n, float eps) {
    for (int r = 0; r < m; ++r) {
        const float* xr = x + (int64_t)r * n;
        float* yr = y + (int64_t)r * n;
        const float inv = 1.0f / sqrtf(dot_f32(xr, xr, n) / (float)n + eps);
        vf vi = vset1(inv);
        for (int i = 0; i < n; i += TL_W) vstore(yr + i, vmul(vmul(vload(xr + i), vi), vload(w + i)));
    }
}


// y = x / sqrt(sum(x^2) + 1e-6) per row of n (nGPT's justnorm, model/layers.py l2norm), any n
void l2norm(const float* x, float* y, int m, int n) {
    for (int r = 0; r < m; ++r) {
        const float* xr = x + (int64_t)r * n;
        float* yr = y + (int64_t)r * n;
        vf s = vzero();
        int i = 0;
        for (; i + TL_W <= n; i += TL_W) s = vfma(vload(xr + i), vload(xr + i), s);
        float t = vsum(s);
        for (; i < n; ++i) t += xr[i] * xr[i];
        const float c = 1.0f / sqrtf(t + 1e-6f);
        const vf vc = vset1(c);
        for (i = 0; i + TL_W <= n; i += TL_W) vstore(yr + i, vmul(vload(xr + i), vc));
        for (; i < n; ++i) yr[i] = xr[i] * c;
    }
}

// the families' own blocks, by kind number (1..): registered at load by their C++ files (register_block)
namespace {
struct OwnKind { const char* name; OwnBlock run; };
std::vector<OwnKind>& own_kinds() { static std::vector<OwnKind> kinds; return kinds; }   // (any load order)
}  // namespace

int register_block(const char* name, OwnBlock run) {
    own_kinds().push_back({name, run});
    return (int)own_kinds().size();
}


int64_t max_k(const tl_model* m) {
    int64_t k = std::max<int64_t>(2 * m->dim, m->ffn_dim);
    return std::max<int64_t>(k, (int64_t)m->n_heads * m->head_dim);
}

Buffers carve(const tl_model* m, int M, int max_ctx, float* s, int64_t* total) {
    const int64_t dim = m->dim, D = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads, F = m->ffn_dim;
    const int64_t rep = H / Hkv, K = max_k(m);
    Buffers b;
    int64_t o = 0;
    auto take = [&](int64_t n) { float* p = s ? s + o : nullptr; o += (n + 15) / 16 * 16; return p; };
    const int64_t W = m->e_width > dim ? m->e_width : dim;   // the loop input (value embeddings after dim)
    b.x = take(M * dim); b.a = take(M * 2 * dim); b.e = take(M * W); b.h = take(M * dim);
    b.qkv = take(M * (H + 2 * Hkv) * D); b.att = take(M * H * D); b.y = take(M * dim);
    b.gu = take(M * 2 * F); b.act = take(M * F);
    b.lin = take(M * K + M * (K / 8));
    b.attn_per_thread = (tl_attend_scratch(TL_ATTEND_ROWS * rep, max_ctx, D) + 15) / 16 * 16;   // (tl_attend_rows')
    b.attn = take(b.attn_per_thread * 64);   // up to 64 threads
    b.tmp = take(D);
    b.e2 = W > dim ? take(M * W) : nullptr;
    b.ve_e = nullptr;
    b.ve_ld = W;
    *total = o;
    return b;
}

void linears(const tl_linear* parts, int n, const float* x, int M, float* y, int ldy, float* lin) {
    int off = 0;
    for (int i = 0; i < n; ++i) {
        tl_linear_rows(&parts[i], x, M, y + off, ldy, lin);
        off += parts[i].n;
    }
}

// the branch output y joins the residual stream x by the block's norm placement
void residual(const tl_model* m, float* x, float* y, const float* out_norm, int M) {
    const int n = m->dim;
    const int64_t total = (int64_t)M * n;
    if (m->placement == 0) {
        for (int64_t i = 0; i < total; i += TL_W) vstore(x + i, vadd(vload(x + i), vload(y + i)));
    } else if (m->placement == 1 || m->placement == 3) {   // sandwich, post: x + n2(y)
        rmsnorm(y, out_norm, y, M, n, m->norm_eps);
        for (int64_t i = 0; i < total; i += TL_W) vstore(x + i, vadd(vload(x + i), vload(y + i)));
    } else {
        for (int64_t i = 0; i < total; i += TL_W) vstore(y + i, vadd(vload(x + i), vload(y + i)));
        rmsnorm(y, out_norm, x, M, n, m->norm_eps);
    }
}

// Attention of M rows' queries (B.qkv, rows (H + 2 Hkv) * D apart) over the keys each sees in its slot (`slot`,
// or slots[i] per row), into B.att (M, H * D); the rows' own keys are in the pool already.
void store_kv(const tl_kv* kv, const tl_row& row, int at, int slot, const float* qkv, int H, int Hkv, int D,
              float* tmp) {
    const int ps = kv->page_size;
    const int64_t page = row.table[(int64_t)(at / ps) * row.stride + slot];
    for (int g = 0; g < Hkv; ++g) {
        const int64_t e = (page * ps + at % ps) * Hkv + g;
        memcpy(tmp, qkv + (int64_t)(H + g) * D, sizeof(float) * D);
        tl_kv_write(kv, 0, e, D, tmp);
        memcpy(tmp, qkv + (int64_t)(H + Hkv + g) * D, sizeof(float) * D);
        tl_kv_write(kv, 1, e, D, tmp);
    }
}

void attend(const tl_model* m, const tl_kv* kv, const tl_row* rows, int M, int slot, Buffers& B, const int* slots) {
    const int D = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads;
    const int QKV = (H + 2 * Hkv) * D;
    // a prefill chunk's (or a verification's) rows in groups of up to TL_ATTEND_ROWS where tl_attend_pairable holds
    // between neighbours (each key read once for the group, the same bits as each row alone), the others alone
    thread_local std::vector<int> units_tl;   // first row of each unit; a group's other rows follow it
    std::vector<int>& units = units_tl;       // (the calling thread's: the workers read it)
    units.clear();
    for (int r = 0; r < M;) {
        units.push_back(r);
        int n = 1;
        while (n < TL_ATTEND_ROWS && r + n < M && (slots ? slots[r + n - 1] == slots[r + n] : true)
               && tl_attend_pairable(kv, &rows[r + n - 1], &rows[r + n], D))
            ++n;
        r += n;
    }
    tl_parallel_for((int)units.size() * Hkv, [&](int task, int t) {   // a (unit, kv head) each
        const int u = task / Hkv, g = task % Hkv, r = units[u];
        const int n = (u + 1 < (int)units.size() ? units[u + 1] : M) - r;
        float* sc = B.attn + B.attn_per_thread * t;
        if (n > 1)
            tl_attend_rows(kv, &rows[r], n, slots ? slots[r] : slot, H, Hkv, D, B.qkv + (int64_t)r * QKV, QKV,
                           B.att + (int64_t)r * H * D, (int64_t)H * D, g, sc);
        else
            tl_attend_row(kv, &rows[r], slots ? slots[r] : slot, H, Hkv, D, B.qkv + (int64_t)r * QKV,
                          B.att + (int64_t)r * H * D, g, sc);
    });
}

// `slots` (one per row; null: `slot` for every row): rows of one pass may sit at different loops, each
// writing and reading its own loop's cache slot (depth-aligned passes: tl_spec_pipeline)
void block(const tl_model* m, const tl_block* b, const tl_kv* kv, const tl_row* rows, int M, int slot,
           float* x, Buffers& B, const int* slots) {
    if (b->own) return own_kinds()[b->own - 1].run(m, b, kv, rows, M, slot, x, B, slots);   // a family's own
    const int dim = m->dim, D = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads, F = m->ffn_dim;
    const int QKV = (H + 2 * Hkv) * D;
    // attention: norm, q/k/v, bias, RoPE, keys into the pool, attention over the row's pages, output
    if (m->placement == 3) memcpy(B.a, x, sizeof(float) * M * dim);   // post: the branch reads x itself
    else rmsnorm(x, b->attn_norm, B.a, M, dim, m->norm_eps);
    linears(b->qkv, b->n_qkv, B.a, M, B.qkv, QKV, B.lin);
    for (int r = 0; r < M; ++r) {
        float* q = B.qkv + (int64_t)r * QKV;
        if (b->q_norm) {   // all q heads as one vector, all k heads as another (in place)
            rmsnorm(q, b->q_norm, q, 1, H * D, m->norm_eps);
            rmsnorm(q + (int64_t)H * D, b->k_norm, q + (int64_t)H * D, 1, Hkv * D, m->norm_eps);
        }
        if (b->qk_bias)
            for (int i = 0; i < (H + Hkv) * D; ++i) q[i] += b->qk_bias[i];
        const int pos = rows[r].pos, at = rows[r].tree_n > 0 ? rows[r].store : pos;   // position, storage index
        tl_rope(q, H + Hkv, D, m->rope_cos + (int64_t)pos * (D / 2), m->rope_sin + (int64_t)pos * (D / 2));
        if (m->qk_norm) qk_norm(q, H + Hkv, D, m->qk_eps);
        if (b->ve_gate)
            value_embed(m, b, &rows[r], B.a + (int64_t)r * dim, B.ve_e ? B.ve_e + r * B.ve_ld : nullptr,
                        q + (int64_t)(H + Hkv) * D);
        store_kv(kv, rows[r], at, slots ? slots[r] : slot, q, H, Hkv, D, B.tmp);
    }
    attend(m, kv, rows, M, slot, B, slots);
    tl_linear_rows(&b->wo, B.att, M, B.y, dim, B.lin);
    residual(m, x, B.y, b->attn_out_norm, M);
    // MLP
    if (m->placement == 3) memcpy(B.a, x, sizeof(float) * M * dim);
    else rmsnorm(x, b->mlp_norm, B.a, M, dim, m->norm_eps);
    if (m->swiglu) {
        linears(b->up, b->n_up, B.a, M, B.gu, 2 * F, B.lin);
        const vf one = vset1(1.0f), zero = vzero();
        for (int r = 0; r < M; ++r) {   // silu(gate) * up = gate / (1 + e^-gate) * up
            const float* g = B.gu + (int64_t)r * 2 * F;
            float* o = B.act + (int64_t)r * F;
            int i = 0;
            for (; i + TL_W <= F; i += TL_W) {
                const vf gv = vload(g + i);
                const vf den = vadd(one, vexp(vsub(zero, gv)));
                vstore(o + i, vmul(vdiv(gv, den), vload(g + F + i)));
            }
            for (; i < F; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * g[F + i];
        }
    } else if (m->relu2) {
        linears(b->up, b->n_up, B.a, M, B.act, F, B.lin);
        relu2(B.act, (int64_t)M * F);
    } else {
        linears(b->up, b->n_up, B.a, M, B.act, F, B.lin);
        const float c = 0.7978845608028654f;   // sqrt(2 / pi)
        const int64_t n = (int64_t)M * F;
        int64_t i = 0;
        // 0.5 v (1 + tanh(u)) = v - v / (e^2u + 1), u = c (v + 0.044715 v^3)
        const vf one = vset1(1.0f), vc = vset1(2.0f * c), k3 = vset1(0.044715f);
        for (; i + TL_W <= n; i += TL_W) {
            const vf v = vload(B.act + i);
            const vf u2 = vmul(vc, vfma(vmul(k3, vmul(v, v)), v, v));
            vstore(B.act + i, vsub(v, vdiv(v, vadd(vexp(u2), one))));
        }
        for (; i < n; ++i) {
            const float v = B.act[i];
            B.act[i] = 0.5f * v * (1.0f + tanhf(c * (v + 0.044715f * v * v * v)));
        }
    }
    tl_linear_rows(&b->down, B.act, M, B.y, dim, B.lin);
    residual(m, x, B.y, b->mlp_out_norm, M);
}
}  // namespace tl_step

using namespace tl_step;

extern "C" int64_t tl_scratch_floats(const tl_model* m, int32_t n_rows, int32_t max_ctx) {
    int64_t total;
    carve(m, n_rows, max_ctx, nullptr, &total);
    return total;
}

// A row that exits after `used` of `upto` loops: its keys and values of loops used .. upto-1 (every core
// layer) become copies of loop used-1's, the slots deeper tokens read (model/paged.py fill_skipped)
void fill_skipped(const tl_model* m, const tl_kv* kv, const tl_row* r, int used, int upto) {
    const int ps = kv->page_size, Hkv = m->n_kv_heads, core0 = m->n_prelude + m->n_coda;
    const int64_t* tab = r->table + (int64_t)(r->pos / ps) * r->stride;
    for (int l = used; l < upto; ++l)
        for (int j = 0; j < m->n_core; ++j) {
            const int a = map_slot(m, core0 + (used - 1) * m->n_core + j), b = map_slot(m, core0 + l * m->n_core + j);
            if (a < 0 || a == b) continue;   // (an MLP layer keeps no keys; last_loop: one slot for every loop)
            const int64_t src = (tab[a] * ps + r->pos % ps) * Hkv;
            const int64_t dst = (tab[b] * ps + r->pos % ps) * Hkv;
            tl_kv_copy(kv, src, dst, Hkv, m->head_dim);
        }
}

// the exit criterion of row r after loop `loop` (0-based): old and new states (dim), updates survival;
// kl: the kl rule's divergence after this loop (kl_readout; infinite before a previous distribution)
bool should_exit(const tl_model* m, tl_row* r, int loop, const float* h_old, const float* h_new, double kl) {
    if (r->exit_kind == TL_EXIT_NONE || r->loops <= loop + 1) return false;
    if (r->exit_kind == TL_EXIT_GATE) {   // every loop's gate counts, checked or not
        double logit = m->gate_b;
        for (int i = 0; i < m->dim; ++i) logit += (double)m->gate_w[i] * (double)h_new[i];
        r->survival *= 1.0 - 1.0 / (1.0 + exp(-logit));
    }
    if (loop + 1 < r->min_loops) return false;
    if (r->exit_kind == TL_EXIT_GATE) return 1.0 - r->survival >= r->threshold;
    if (r->exit_kind == TL_EXIT_KL) return kl < r->threshold;
    double d2 = 0, n2 = 0;
    for (int i = 0; i < m->dim; ++i) {
        const double a = h_new[i], b = h_old[i];
        d2 += (a - b) * (a - b);
        n2 += a * a;
    }
    return sqrt(d2) / std::max(sqrt(n2), 1e-30) < r->threshold;
}

// The kl rule's read-out after loop `loop` (model/looped.py _adaptive_exits): for each of the loop's Ml
// packed rows that asks for it (min_loops - 1 <= loop + 1 < its loops), the coda on its new state (B.y; after
// the final norm where that ends the recurrence; its coda keys are written again by the final read-out),
// then the final norm and the head; log-probabilities in double as torch.log_softmax forms them, x - max -
// log(sum exp(x - max)); kl[p] = KL(p || p_prev) = sum exp(lp) (lp - lp_prev) against the row's previous
// read-out in this call (logp, by caller row: `orig`), infinite before one. B.y is kept.
static void kl_readout(const tl_model* m, const tl_kv* kv, const tl_row* ph, const int* orig, int Ml, int loop,
                Buffers& B, std::vector<double>& logp, std::vector<char>& have, double* kl) {
    const int64_t dim = m->dim, V = m->vocab, N = m->head->n;
    std::vector<tl_row> sel;
    std::vector<int> at;
    for (int p = 0; p < Ml; ++p) {
        kl[p] = INFINITY;
        const tl_row& r = ph[p];
        if (r.exit_kind == TL_EXIT_KL && r.min_loops - 1 <= loop + 1 && loop + 1 < r.loops) {
            sel.push_back(r);
            at.push_back(p);
        }
    }
    if (sel.empty()) return;
    const int n = (int)sel.size();
    std::vector<float> x(n * dim), keep(B.y, B.y + Ml * dim);
    for (int i = 0; i < n; ++i) {
        const float* h = B.y + at[i] * dim;
        if (m->post_loop_norm) rmsnorm(h, m->final_norm, x.data() + i * dim, 1, (int)dim, m->norm_eps);
        else memcpy(x.data() + i * dim, h, sizeof(float) * dim);
    }
    if (m->state_proj.n) project_state(&m->state_proj, (int)dim, x.data(), n, B);
    const float* ve_e = B.ve_e;   // the coda's value embeddings: the selected rows' loop inputs
    std::vector<float> ev(B.ve_e ? n * B.ve_ld : 0);
    for (int i = 0; i < n && B.ve_e; ++i)
        memcpy(ev.data() + i * B.ve_ld, ve_e + at[i] * B.ve_ld, sizeof(float) * B.ve_ld);
    if (ve_e) B.ve_e = ev.data();
    const tl_block* coda = m->blocks + m->n_prelude + m->n_core;
    for (int i = 0; i < m->n_coda; ++i) block(m, &coda[i], kv, sel.data(), n, m->n_prelude + i, x.data(), B);
    B.ve_e = ve_e;
    memcpy(B.y, keep.data(), sizeof(float) * Ml * dim);
    std::vector<float> logits(n * N), hs(2 * n * dim + n * (dim / 8) + 16);
    tl_head(m->head, x.data(), n, m->head_norm, m->head_eps, (int32_t)V, logits.data(), nullptr, hs.data(), nullptr,
            m->logit_softcap);
    for (int i = 0; i < n; ++i) {
        const float* y = logits.data() + i * N;
        double mx = -INFINITY, sum = 0.0;
        for (int64_t v = 0; v < V; ++v) mx = std::max(mx, (double)y[v]);
        for (int64_t v = 0; v < V; ++v) sum += exp((double)y[v] - mx);
        const double lse = log(sum);
        const int r = orig[at[i]];
        double* lp = logp.data() + r * V;
        double d = 0.0;
        for (int64_t v = 0; v < V; ++v) {
            const double l = ((double)y[v] - mx) - lse;
            if (have[r]) d += exp(l) * (l - lp[v]);
            lp[v] = l;
        }
        kl[at[i]] = have[r] ? d : INFINITY;
        have[r] = 1;
    }
}

extern "C" int tl_decode(const tl_model* m, const tl_kv* kv, tl_row* rows, int32_t M, float* hidden,
                         float* scratch, int64_t scratch_len) {
    if (M <= 0) return 0;
    if (tl_nthreads() > 64) return 3;
    int max_ctx = 0, n_fresh = 0, max_loops = 0;
    for (int r = 0; r < M; ++r) {
        max_ctx = std::max(max_ctx, rows[r].pos + 1);
        if (rows[r].tree_n > 0) {   // a tree node sees at most its committed keys and its tree keys
            if (rows[r].store < rows[r].tree_base || rows[r].exit_kind != TL_EXIT_NONE) return 6;
            max_ctx = std::max(max_ctx, rows[r].tree_base + rows[r].tree_n);
        }
        max_loops = std::max(max_loops, rows[r].loops);
        if (rows[r].pos >= m->rope_len) return 2;
        if (rows[r].first_loop == 0) {
            if (n_fresh != r) return 4;   // rows from tokens come first
            ++n_fresh;
        }
        if (rows[r].readout > m->n_readouts) return 5;
        if (m->slot_map && rows[r].loops > m->slot_loops) return 8;   // (past the slots described)
    }
    int64_t need;
    Buffers B = carve(m, M, max_ctx, scratch, &need);
    if (need > scratch_len) return 1;
    const int64_t dim = m->dim;
    // rows from tokens: embedding (times embed_scale), the prelude; e is its output, h the state loop 0
    // starts from (e itself without injection, else zeros). Other rows bring their (e, h).
    for (int r = 0; r < n_fresh; ++r) {
        float* xr = B.x + r * dim;
        const int64_t o = (int64_t)rows[r].token * dim;
        for (int i = 0; i < dim; ++i) {
            float v = m->embed_kind == TL_F32 ? ((const float*)m->embed)[o + i]
                    : m->embed_kind == TL_F16 ? f16_to_f32(((const uint16_t*)m->embed)[o + i])
                    : bf16_to_f32(((const uint16_t*)m->embed)[o + i]);
            xr[i] = m->embed_scale != 1.0f ? v * m->embed_scale : v;
        }
    }
    if (n_fresh)
        for (int i = 0; i < m->n_prelude; ++i) block(m, &m->blocks[i], kv, rows, n_fresh, i, B.x, B);
    if (n_fresh && m->prelude_norm) rmsnorm(B.x, m->prelude_norm, B.x, n_fresh, dim, m->norm_eps);
    const int64_t W = B.ve_ld;   // the loop input's width: dim, then the core's and coda's value embeddings
    if (W == dim) memcpy(B.e, B.x, sizeof(float) * n_fresh * dim);
    else
        for (int r = 0; r < n_fresh; ++r) {
            memcpy(B.e + r * W, B.x + r * dim, sizeof(float) * dim);
            loop_input_ve(m, rows[r].token, B.e + r * W);
        }
    if (m->injection == 0 || m->loop_start != 0) memcpy(B.h, B.x, sizeof(float) * n_fresh * dim);   // from e
    else
        for (int r = 0; r < n_fresh; ++r) {
            if (rows[r].state_h) memcpy(B.h + r * dim, rows[r].state_h, sizeof(float) * dim);
            else memset(B.h + r * dim, 0, sizeof(float) * dim);
        }
    for (int r = n_fresh; r < M; ++r) {
        memcpy(B.e + r * W, rows[r].state_e, sizeof(float) * W);
        memcpy(B.h + r * dim, rows[r].state_h, sizeof(float) * dim);
    }
    const tl_block* core = m->blocks + m->n_prelude;
    const int core_slot0 = m->n_prelude + m->n_coda;
    // Each loop runs on the rows it concerns, packed first: `ph` holds the rows in that physical order
    // (e and h rows move with them), `orig` maps a physical row back to the caller's.
    std::vector<tl_row> ph(rows, rows + M);
    std::vector<int> orig(M), order(M);
    std::vector<double> logp, kl(M, INFINITY);   // the kl rule's last log-probabilities (M, vocab), divergences
    std::vector<char> have(M, 0);
    bool any_kl = false;
    for (int r = 0; r < M; ++r) any_kl |= rows[r].exit_kind == TL_EXIT_KL;
    if (any_kl && !m->head) return 7;
    if (any_kl) logp.resize((size_t)M * m->vocab);
    for (int r = 0; r < M; ++r) orig[r] = r;
    for (int loop = 0; loop < max_loops; ++loop) {
        int Ml = 0;
        auto active = [&](const tl_row& r) { return r.first_loop <= loop && loop < r.loops; };
        for (int p = 0; p < M; ++p) if (active(ph[p])) order[Ml++] = p;
        if (Ml == 0) continue;
        bool moved = false;
        for (int p = 0, q = Ml; p < M; ++p) if (!active(ph[p])) order[q++] = p;
        for (int p = 0; p < M; ++p) moved |= order[p] != p;
        if (moved) {   // a stable partition
            std::vector<tl_row> ph2(M);
            std::vector<int> orig2(M);
            float* et = W == dim ? B.a : B.e2;
            for (int p = 0; p < M; ++p) {
                ph2[p] = ph[order[p]];
                orig2[p] = orig[order[p]];
                memcpy(et + p * W, B.e + order[p] * W, sizeof(float) * W);
                memcpy(B.y + p * dim, B.h + order[p] * dim, sizeof(float) * dim);
            }
            ph.swap(ph2);
            orig.swap(orig2);
            memcpy(B.e, et, sizeof(float) * M * W);
            memcpy(B.h, B.y, sizeof(float) * M * dim);
        }
        if (m->injection == 0 || (loop == 0 && m->loop_start == 2)) {   // (skip: loop 0 runs on e = h itself)
            memcpy(B.x, B.h, sizeof(float) * Ml * dim);
        } else if (m->injection == 1 && W == dim) {
            for (int64_t i = 0; i < Ml * dim; i += TL_W) vstore(B.x + i, vadd(vload(B.h + i), vload(B.e + i)));
        } else if (m->injection == 1) {
            for (int r = 0; r < Ml; ++r)
                for (int64_t i = 0; i < dim; i += TL_W)
                    vstore(B.x + r * dim + i, vadd(vload(B.h + r * dim + i), vload(B.e + r * W + i)));
        } else if (m->injection == 3) {
            diagonal_inject(m, B.h, B.e, W, B.x, Ml, B);
        } else {
            for (int r = 0; r < Ml; ++r) {
                memcpy(B.a + r * 2 * dim, B.h + r * dim, sizeof(float) * dim);
                memcpy(B.a + r * 2 * dim + dim, B.e + r * W, sizeof(float) * dim);
            }
            tl_linear_rows(&m->adapter, B.a, Ml, B.x, dim, B.lin);
        }
        if (m->sphere) l2norm(B.x, B.x, Ml, (int)dim);   // the sum back on the sphere
        B.ve_e = W > dim ? B.e : nullptr;   // value embeddings of the core's blocks (packed with the rows)
        for (int j = 0; j < m->n_core; ++j)
            block(m, &core[j], kv, ph.data(), Ml, core_slot0 + loop * m->n_core + j, B.x, B);
        if (m->loop_norm) rmsnorm(B.x, m->core_norm, B.y, Ml, dim, m->norm_eps);
        else if (m->sphere) l2norm(B.x, B.y, Ml, (int)dim);   // the state is l2norm(h)
        else memcpy(B.y, B.x, sizeof(float) * Ml * dim);
        if (any_kl) kl_readout(m, kv, ph.data(), orig.data(), Ml, loop, B, logp, have, kl.data());
        for (int p = 0; p < Ml; ++p)
            if (should_exit(m, &ph[p], loop, B.h + p * dim, B.y + p * dim, kl[p])) {
                fill_skipped(m, kv, &ph[p], loop + 1, ph[p].loops);
                ph[p].loops = loop + 1;
            }
        memcpy(B.h, B.y, sizeof(float) * Ml * dim);
    }
    // back in the caller's order: the states (kept where asked), loops run, survival, the loop inputs
    // (value embeddings: the coda's read-out reads them)
    for (int p = 0; p < M; ++p) {
        const int r = orig[p];
        memcpy(B.a + (int64_t)r * dim, B.h + (int64_t)p * dim, sizeof(float) * dim);
        if (W > dim) memcpy(B.e2 + (int64_t)r * W, B.e + (int64_t)p * W, sizeof(float) * W);
        rows[r].loops_run = ph[p].loops;
        rows[r].survival = ph[p].survival;
        if (rows[r].out_h) {
            memcpy(rows[r].out_e, B.e + (int64_t)p * W, sizeof(float) * W);
            memcpy(rows[r].out_h, B.h + (int64_t)p * dim, sizeof(float) * dim);
        }
    }
    memcpy(hidden, B.a, sizeof(float) * M * dim);
    // read-outs, one pass per kind over its rows: the coda (after the final norm when it ends the
    // recurrence), or a draft exit's blocks on their own slots
    for (int ro = 0; ro <= m->n_readouts; ++ro) {
        std::vector<tl_row> sel;
        std::vector<int> idx;
        for (int r = 0; r < M; ++r)
            if (rows[r].readout == ro) { sel.push_back(rows[r]); idx.push_back(r); }
        if (sel.empty()) continue;
        const int n = (int)sel.size();
        for (int i = 0; i < n; ++i) {
            float* x = B.x + (int64_t)i * dim;
            const float* h = hidden + (int64_t)idx[i] * dim;
            if (ro == 0 && m->post_loop_norm) rmsnorm(h, m->final_norm, x, 1, dim, m->norm_eps);
            else memcpy(x, h, sizeof(float) * dim);
            if (ro == 0 && W > dim) memcpy(B.e + i * W, B.e2 + idx[i] * W, sizeof(float) * W);
        }
        if (ro == 0 && m->state_proj.n) project_state(&m->state_proj, (int)dim, B.x, n, B);
        if (ro > 0 && m->readouts[ro - 1].state_proj.n) project_state(&m->readouts[ro - 1].state_proj, (int)dim, B.x, n, B);
        B.ve_e = ro == 0 && W > dim ? B.e : nullptr;
        if (ro == 0) {
            const tl_block* coda = core + m->n_core;
            for (int i = 0; i < m->n_coda; ++i) block(m, &coda[i], kv, sel.data(), n, m->n_prelude + i, B.x, B);
        } else {
            const tl_readout* x = &m->readouts[ro - 1];
            for (int i = 0; i < x->n_blocks; ++i) block(m, &x->blocks[i], kv, sel.data(), n, x->slots[i], B.x, B);
        }
        for (int i = 0; i < n; ++i) memcpy(hidden + (int64_t)idx[i] * dim, B.x + (int64_t)i * dim, sizeof(float) * dim);
    }
    return 0;
}

// The LM head of m rows x (m, k): the final norm (norm_w; null: none), logits (m, n) = x W^T, and with
// `argmax` non-null each row's argmax over its first `vocab` logits. scratch: m * k * 2 + m * k / 8 floats.
extern "C" int tl_head(const tl_linear* L, const float* x, int32_t m, const float* norm_w, float eps,
                       int32_t vocab, float* logits, int32_t* argmax_out, float* scratch,
                       const tl_sampling* draws, float softcap) {
    if (L->k % TL_W || vocab > L->n) return 1;
    const float* xin = x;
    if (norm_w) {
        rmsnorm(x, norm_w, scratch, m, L->k, eps);
        xin = scratch;
    }
    tl_linear_rows(L, xin, m, logits, L->n, scratch + (int64_t)m * L->k);
    if (softcap > 0.0f) tl_step::softcap(logits, m, L->n, L->n, softcap);
    if (argmax_out)
        for (int r = 0; r < m; ++r)
            argmax_out[r] = draws ? tl_draw(logits + (int64_t)r * L->n, vocab, nullptr, &draws[r])
                                  : argmax(logits + (int64_t)r * L->n, vocab);
    return 0;
}

extern "C" int32_t tl_block_kind(const char* name) {
    const auto& kinds = tl_step::own_kinds();
    for (size_t i = 0; i < kinds.size(); ++i)
        if (strcmp(kinds[i].name, name) == 0) return (int32_t)(i + 1);
    return 0;
}

extern "C" const char* tl_isa(void) {
#if defined(__AVX512F__) && TL_SIMD && TL_VNNI
    return amx_ready() ? "avx512 host, avx2+fma+f16c kernels, vnni int8 dot products, amx int8 tiles"
                       : "avx512 host, avx2+fma+f16c kernels, vnni int8 dot products";
#elif defined(__AVX512F__) && TL_SIMD
    return "avx512 host, avx2+fma+f16c kernels";
#elif TL_SIMD && TL_VNNI
    return "avx2+fma+f16c, avx-vnni int8 dot products";
#elif TL_SIMD
    return "avx2+fma+f16c";
#else
    return "portable scalar";
#endif
}
