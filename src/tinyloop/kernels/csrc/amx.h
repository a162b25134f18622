// AMX int8 tiles for layers with int8 activations (amx.cpp): many rows at once (a batch of decode rows,
// verification rows, a prefill chunk), bitwise equal to the AVX2/VNNI tiles (matmul.cpp's canonical
// reduction). Built where the compiler targets AMX-INT8 and AVX-512; used where the OS grants the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM) and it is not switched off (tl_set_amx, TINYLOOP_NATIVE_AMX=0).
#pragma once
#include "tinyloop.h"

// whether the AMX tiles run in this process (the first call asks the OS for the tile state)
bool amx_ready();
// the fewest rows a call takes the AMX tiles from (fewer take the vector tiles). Measured on the 1.4B
// shape's 5632 x 2048 int4 layer, one thread, Xeon KVM guest (AMX time / vector tiles' time): 1.8x at 4
// rows, 0.8-0.9x at 8, 0.45-0.5x at 16, 0.37x at 64. A strip of 16 weight rows costs about the same
// from 1 to 16 rows (its unpacking, scaling and stores); below 8 rows the vector tiles are cheaper.
constexpr int AMX_MIN_ROWS = 8;
// int4 layers with 32-column activation blocks (group 32: the shipped model's) scale two blocks every 64
// columns, twice the work: over the shipped model's core layers AMX was 0.82x the vector tiles' speed at
// 8 rows, 1.10x at 16, 1.23x at 32 (two threads, benchmarks/amx.py)
constexpr int AMX_MIN_ROWS_SPLIT = 16;
// int8 weights (per channel: the int8 head) take amx_rows_q8 from 3 rows (the shipped head, one thread: 0.53
// ms against the vector tiles' 0.47 at 2 rows, 0.59 against 0.64 at 4; amx.cpp)
constexpr int AMX_MIN_ROWS_Q8 = 3;
// y (m, n) for an int4 layer with int8 activations (int8 weights: amx_rows_q8): xq (m, K) codes in matmul.cpp's
// order, xd (m, K / AB) the scale of each activation block of AB columns, X (m, K / group) the zero points' sums.
// Runs on the pool.
void amx_rows(const tl_linear* L, int AB, const int8_t* xq, const float* xd, const float* X, int m, float* y,
              int ldy);
// the same for int8 weights whose activation blocks are whole 64s (the int8 head), from AMX_MIN_ROWS_Q8 rows: the
// weight rows read in place as tiles, an epilogue per input row (amx.cpp); xs (m, K / AB) each block's code sum
void amx_rows_q8(const tl_linear* L, int AB, const int8_t* xq, const float* xd, const float* xs, const float* X,
                 int m, float* y, int ldy);
