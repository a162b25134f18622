// What one decode step shares with the one-call speculation rounds (spec.cpp, tree.cpp): the scratch
// buffers of a step, the norm, one block over a batch of rows, and the argmax. step.cpp defines them.
#pragma once
#include "tinyloop.h"

// y[:, 0:n] = x W^T, row stride ldy (matmul.cpp)
void tl_linear_rows(const tl_linear* L, const float* x, int m, float* y, int ldy, float* scratch);

namespace tl_step {
struct Buffers {   // carved from the caller's scratch
    float *x, *a, *e, *h, *qkv, *att, *y, *gu, *act, *lin, *attn, *tmp;
    int64_t attn_per_thread;
};

// the buffers of a step of M rows at contexts up to max_ctx, carved from s (null: only *total, their size)
Buffers carve(const tl_model* m, int M, int max_ctx, float* s, int64_t* total);
// F.rms_norm over rows of n: y = x / sqrt(mean(x^2) + eps) * w
void rmsnorm(const float* x, const float* w, float* y, int m, int n, float eps);
// one block (attention and MLP, the model's norms) over M rows at layer slot `slot` (or slots[i] per row)
void block(const tl_model* m, const tl_block* b, const tl_kv* kv, const tl_row* rows, int M, int slot,
           float* x, Buffers& B, const int* slots = nullptr);
// index of the largest of x[0 .. n-1]: the first of equal maxima, or the first NaN (torch.argmax's rule)
int32_t argmax(const float* x, int n);
}  // namespace tl_step
