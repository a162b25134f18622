// What one decode step shares with the one-call speculation rounds (spec.cpp, tree.cpp): the scratch
// buffers of a step, the norm, one block over a batch of rows, and the argmax. step.cpp defines them (the
// argmax: sample.cpp, beside the draws that run it).
#pragma once
#include "tinyloop.h"

// y[:, 0:n] = x W^T, row stride ldy (matmul.cpp)
void tl_linear_rows(const tl_linear* L, const float* x, int m, float* y, int ldy, float* scratch);

namespace tl_step {
struct Buffers {   // carved from the caller's scratch
    float *x, *a, *e, *h, *qkv, *att, *y, *gu, *act, *lin, *attn, *tmp;
    float* e2;            // (M, e_width): loop inputs in another order (value embeddings only)
    int64_t attn_per_thread;
    const float* ve_e;    // the loop inputs (rows of ve_ld) of a pass's rows, read by core and coda blocks
    int64_t ve_ld;        // with value embeddings (null: none in this pass)
};

// the buffers of a step of M rows at contexts up to max_ctx, carved from s (null: only *total, their size)
Buffers carve(const tl_model* m, int M, int max_ctx, float* s, int64_t* total);
// F.rms_norm over rows of n: y = x / sqrt(mean(x^2) + eps) * w
void rmsnorm(const float* x, const float* w, float* y, int m, int n, float eps);
// one block (attention and MLP, the model's norms) over M rows at layer slot `slot` (or slots[i] per row)
void block(const tl_model* m, const tl_block* b, const tl_kv* kv, const tl_row* rows, int M, int slot,
           float* x, Buffers& B, const int* slots = nullptr);

// The optional pieces (features.cpp), each a step only models that have it take
// q and k (`heads` of D) RMS-normed per head, no weights (model/layers.py Attention, qk_norm)
void qk_norm(float* q, int heads, int D, float eps);
// v (Hkv * D) += 2 sigmoid(ve_gate . xn[:ve_channels]) * ve per kv head; ve: row's token in the block's table
// (prelude blocks) or the columns ve_col.. of the row's loop input e_row
void value_embed(const tl_model* m, const tl_block* b, const tl_row* row, const float* xn, const float* e_row,
                 float* v);
// a (n) = relu(a)^2
void relu2(float* a, int64_t n);
// x (M, dim) = h * decay + dt * (e[:, :dim] B^T), e rows ldE apart (the diagonal injection)
void diagonal_inject(const tl_model* m, const float* h, const float* e, int64_t ldE, float* x, int M, Buffers& B);
// the loop input's value-embedding columns (dim ..) of a row from its token
void loop_input_ve(const tl_model* m, int token, float* e_row);
// x (n, dim) = x C^T (the model's state_proj, or a draft exit's copy; uses B.y)
void project_state(const tl_linear* C, int dim, float* x, int n, Buffers& B);
// y (m rows of ld, first n) = c tanh(y / c)
void softcap(float* y, int m, int n, int64_t ld, float c);

// a row's new keys and values (a q|k|v row of H + 2 Hkv heads of D) into its page of cache slot `slot` at storage
// index `at` (step.cpp; `tmp`: D floats)
void store_kv(const tl_kv* kv, const tl_row& row, int at, int slot, const float* qkv, int H, int Hkv, int D,
              float* tmp);

// attention of M rows' queries (B.qkv) over the keys each sees in `slot` (or slots[i]) into B.att (step.cpp)
void attend(const tl_model* m, const tl_kv* kv, const tl_row* rows, int M, int slot, Buffers& B,
            const int* slots = nullptr);

// y (m rows of n) = x / sqrt(sum(x^2) + 1e-6) (y may be x): the unit sphere's normalisation (tl_model.sphere)
void l2norm(const float* x, float* y, int m, int n);
// the cache slot of the step's slot number s (m->slot_map; -1: the layer keeps no keys)
inline int map_slot(const tl_model* m, int s) { return m->slot_map ? m->slot_map[s] : s; }

// A family's own block (tl_block.own > 0), run by block() in place of the shared one. Its C++ file registers it
// once, at load, by name: `static const int kind = register_block("name", run);` (the kind numbers are this
// library's; Python asks tl_block_kind(name)). Returns the kind number.
using OwnBlock = void (*)(const tl_model* m, const tl_block* b, const tl_kv* kv, const tl_row* rows, int M,
                          int slot, float* x, Buffers& B, const int* slots);
int register_block(const char* name, OwnBlock run);

// index of the largest of x[0 .. n-1]: the first of equal maxima, or the first NaN (torch.argmax's rule)
int32_t argmax(const float* x, int n);
}  // namespace tl_step
