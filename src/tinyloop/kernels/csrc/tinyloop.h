// The native executor's C interface: what Python (kernels/executor.py) fills in with ctypes.
// Python owns every buffer; kernels are functions over raw pointers and sizes.
#pragma once
#include <stdint.h>

extern "C" {

// Weight formats of a linear layer y = x W^T, W (n out, k in), row-major.
enum { TL_F32 = 0, TL_F16 = 1, TL_BF16 = 2, TL_Q8 = 3, TL_Q4 = 4, TL_Q2 = 5 };
// KV pool formats (model/paged.py PagedKV, quant/kv.py KVTensor).
enum { TL_KV_F32 = 0, TL_KV_F16 = 1, TL_KV_BF16 = 2, TL_KV_I8 = 3, TL_KV_I4 = 4, TL_KV_I4H = 5 };
// consecutive rows of one sequence whose attention reads each key once (attention.cpp tl_attend_rows)
#define TL_ATTEND_ROWS 8

typedef struct {
    int32_t kind;            // TL_F32 .. TL_Q2
    int32_t n, k, group;     // group: input columns per scale (quantized kinds)
    const void* w;           // float kinds: (n, k); quantized: portable codes (n, k * bits / 8), quant/packing.py
    const uint16_t* scales;  // float16 (n, k / group)
    const uint8_t* zeros;    // uint8 (n, k / group): w = (q - zero) * scale
    int32_t act_q8;          // TL_Q8 / TL_Q4 with SIMD: activations quantized to int8 (integer dot products)
    int32_t streamed;        // the model's weights do not stay in cache: one row is read after the other
    const uint8_t* packed;   // int4 with int8 activations: the codes repacked 16 rows a vector (tl_pack_int4), or null
    const float* out_scale;  // (n) or null: output j is then y[j] * out_scale[j] (a per-token logit scale)
    const uint16_t* mins;    // TL_Q4 only: float16 (n, k / group) or null. Non-null: w = q * scale + min (GGUF's
                             // Q4_1 blocks, quant/packing.py dequantize_min) and `zeros` is unread; every int4 path
                             // forms the zero-point form's correction s z X_g as -min X_g (intdot.h group_sz)
    int32_t packed_f32;      // set before tl_pack_int4: `packed` strips hold fp32 scales and s z' (or -min), formed
                             // once (a model that stays in cache: fewer operations a call), else the file's bytes
} tl_linear;


typedef struct {
    tl_linear qkv[3]; int32_t n_qkv;   // outputs concatenated: q (H*D), k (Hkv*D), v (Hkv*D)
    tl_linear wo;
    tl_linear up[2]; int32_t n_up;     // swiglu: gate then up (one fused part or two); gelu: up
    tl_linear down;
    const float* attn_norm; const float* mlp_norm;
    const float* attn_out_norm; const float* mlp_out_norm;   // sandwich placements only
    const float* qk_bias;              // (H + Hkv, D) or null
    const float* q_norm; const float* k_norm;   // (H * D), (Hkv * D): OLMo-2's q/k norms over all heads
                                                // together, after the projection, before bias and RoPE
    // value embeddings (ve_gate null: none): v += 2 sigmoid(ve_gate . x[:ve_channels]) * ve per kv
    // head, x the normed block input; ve is row `token` of ve_table (ve_col < 0: prelude blocks) or the
    // loop input's columns ve_col .. ve_col + Hkv * D (core and coda blocks: tl_row.state_e, e_width wide)
    const float* ve_gate;              // (Hkv, ve_channels)
    const void* ve_table; int32_t ve_kind;   // (vocab, Hkv * D), TL_F32/F16/BF16
    int32_t ve_col;
    // A family's own block (own > 0; kernels/layers.py `describe`): the block kind its C++ file registered under
    // a name (tl_block_kind; step.h register_block) runs this block instead of the code above, and reads the
    // generic fields it wants (its projections in qkv, wo, up, down) and `own_fields`, a struct of that family's
    // own that its C++ file declares and its model module lays out field by field (`native_fields`)
    int32_t own;
    const void* own_fields;
} tl_block;

typedef struct {
    int32_t dim, n_heads, n_kv_heads, head_dim, ffn_dim, vocab;
    int32_t n_prelude, n_core, n_coda;
    int32_t swiglu;          // 1: silu(gate) * up; 0: gelu (tanh) of up
    int32_t injection;       // 0 none, 1 add, 2 concat-adapter
    int32_t placement;       // 0 pre, 1 sandwich, 2 sandwich-residual, 3 post (x + n2(f(x)), no input norms)
    int32_t loop_norm, post_loop_norm;
    float norm_eps, embed_scale;
    const void* embed; int32_t embed_kind;   // (vocab, dim), TL_F32/F16/BF16
    const tl_block* blocks;  // n_prelude + n_core + n_coda: prelude, core, coda
    const float* core_norm;  // loop_norm
    const float* final_norm; // post_loop_norm
    tl_linear adapter;       // injection 2: (dim, 2 * dim)
    const float* rope_cos; const float* rope_sin; int32_t rope_len;   // (rope_len, D / 2)
    const float* gate_w; double gate_b;     // the exit gate Linear(dim -> 1) (exit criterion "gate")
    const struct tl_readout* readouts;      // read-outs besides the coda (draft exits)
    int32_t n_readouts;
    const tl_linear* head;                  // the LM head, its norm (null: none) and eps: the kl criterion's
    const float* head_norm; float head_eps; // read-out after a loop (tl_head)
    int32_t loop_start;      // with an injection, loop 0 starts from: 0 the state (zeros or state_h), 1 the
                             // prelude output e, 2 e itself run through the core without the injection
    // the optional pieces (features.cpp; zero / null: off)
    int32_t relu2;                          // the MLP is down(relu(up x)^2) (swiglu 0)
    const float* inj_decay; const float* inj_dt; tl_linear inj_B;   // injection 3: h * decay + dt * (e B^T)
    const float* prelude_norm;              // an RMS norm ends the prelude
    tl_linear state_proj;                   // n > 0: the state times C^T before the coda (after final_norm)
    int32_t qk_norm; float qk_eps;          // q and k RMS-normed per head after RoPE, no weights
    int32_t ve_channels;                    // the value-embedding gates read x[:ve_channels]
    int32_t e_width;                        // the loop input's width: dim, then the core's and coda's
                                            // value embeddings (model/looped.py loop_input_width)
    float logit_softcap;                    // c > 0: logits -> c tanh(logits / c)
    // sphere 1: the state lives on the unit sphere (nGPT): loops enter as l2norm(h + e) and end with l2norm,
    // y = x / sqrt(sum(x^2) + 1e-6) (step.h l2norm). A second RoPE profile's tables (rope_len rows, as
    // rope_cos; null: none) for blocks that read it. slot_map: the cache slot of each slot number the step forms
    // (prelude i, n_prelude + coda i, n_prelude + n_coda + loop * n_core + j for loop < slot_loops; -1: a layer
    // that keeps no keys), model/cache.py SlotLayout (kv_mode last_loop: one per layer); null: the number itself
    int32_t sphere;
    const float* rope_cos2; const float* rope_sin2;
    const int32_t* slot_map; int32_t slot_loops;
} tl_model;

typedef struct tl_readout {                 // blocks that read a state out (a draft exit's coda copy)
    int32_t n_blocks;
    const tl_block* blocks;
    const int32_t* slots;                   // the cache slot of each block
    tl_linear state_proj;                   // n > 0: the state times the exit's C^T first
} tl_readout;

typedef struct {
    int32_t format, page_size;
    void* k; void* v;                       // floats or codes: (pages, page_size, Hkv, D or D * bits / 8)
    uint16_t* k_scale; uint16_t* k_offset;  // float16 (pages, page_size, Hkv) for quantized formats
    uint16_t* v_scale; uint16_t* v_offset;
} tl_kv;

enum { TL_EXIT_NONE = 0, TL_EXIT_LATENT = 1, TL_EXIT_GATE = 2, TL_EXIT_KL = 3 };   // model/exits.py criteria

typedef struct {
    // one token at storage index == position `pos`: from its embedding (first_loop 0) or from the state
    // (e, h) after loop first_loop - 1; then loops first_loop .. loops - 1, then the read-out
    int32_t token, pos, loops, window;
    const int64_t* table;                   // (n_blocks, stride): page of each (block, slot)
    int32_t stride, n_blocks;
    // adaptive depth (model/exits.py): checked after each loop from min_loops on; an exit copies the last
    // computed loop's keys into the skipped slots (PagedStep.fill_skipped)
    int32_t exit_kind, min_loops;
    double threshold;
    double survival;                        // in/out: the gate rule's probability of not having exited
    int32_t loops_run;                      // out: core loops this row ran
    int32_t first_loop;
    int32_t readout;                        // -1 none, 0 the model's coda, i > 0 readouts[i - 1]
    const float* state_e; const float* state_h;   // first_loop > 0: (e_width), (dim); a row from its token with an
                                            // injection may bring state_h: loop 0 starts from it (a random
                                            // initial state, model/looped.py init_state), else from zeros
    float* out_e; float* out_h;             // non-null: the state (e_width, dim) after the last loop is kept here
    // a tree node (engine/tree.py; tree_n > 0): its keys go to storage index `store`, not `pos` (its real
    // position: RoPE, window); it attends to the committed keys below storage index tree_base (window
    // permitting) and to the tree_n node keys at storage indices tree_keys (ascending: its ancestors
    // and itself; model/layers.py build_mask), at real positions tree_pos
    int32_t tree_n, store, tree_base;
    const int32_t* tree_keys; const int32_t* tree_pos;
} tl_row;

// One decode step for `n_rows` one-token rows (rows from tokens first). Writes `hidden` (n_rows, dim)
// after each row's read-out. `scratch` holds tl_scratch_floats(...) floats. Returns 0, or an error code.
int tl_decode(const tl_model* m, const tl_kv* kv, tl_row* rows, int32_t n_rows, float* hidden,
              float* scratch, int64_t scratch_len);
int64_t tl_scratch_floats(const tl_model* m, int32_t n_rows, int32_t max_ctx);

// y (m, n) = x (m, k) W^T, for the PyTorch path's layers of the same formats (multi-row: prefill).
int tl_linear_forward(const tl_linear* w, const float* x, int32_t m, float* y, float* scratch);

// The LM head: the final norm (norm_w; null: none), logits (m, n), and each row's argmax over its first
// `vocab` logits when argmax is non-null. scratch: 2 * m * k + m * k / 8 floats. With `draws` non-null, row r
// is drawn by tl_draw with draws[r] instead (its logits are overwritten). softcap c > 0: the logits are
// c tanh(logits / c) (model/looped.py logits) before the argmax or draw.
// A row's sampling: the key of its draw, 1 / T (0: the argmax), top-k (0: off) and top-p (1: off), and a
// grammar's bitmask (null: none; bit j of word i allows token 32 i + j: llguidance's layout): the tokens it
// forbids are -inf before anything else, so the argmax or draw is over the allowed tokens alone.
typedef struct tl_sampling { uint32_t key; float inv_temp; int32_t top_k; float top_p; const uint32_t* mask; } tl_sampling;
int tl_head(const tl_linear* head, const float* x, int32_t m, const float* norm_w, float eps, int32_t vocab,
            float* logits, int32_t* argmax, float* scratch, const tl_sampling* draws, float softcap);

// Sampling by shared noise (sample.cpp; engine/sampling.py): the key of output index n of a request seeded
// `seed`; the Gumbel noise g(key, token) of tokens ids[0 .. n-1] (null: 0 .. n-1); and the token a row
// draws: argmax_j x[j] * inv_temp + g(key, ids[j]) (inv_temp 0: the plain argmax); x is overwritten (the
// scores of the tokens that could be drawn, -inf for the rest).
// tl_draw: a row's token under its tl_sampling: what its mask forbids set to -inf (token ids[j], null: j), x / T,
// what top-k and top-p drop set to -inf, then the draw as tl_choose's (engine/sampling.py `truncate`); x is
// overwritten.
int32_t tl_draw(float* x, int32_t n, const int64_t* ids, const tl_sampling* s);
uint32_t tl_noise_key(uint64_t seed, int64_t n);
void tl_gumbel(uint32_t key, const int64_t* ids, int32_t n, float* out);
int32_t tl_choose(float* x, int32_t n, const int64_t* ids, float inv_temp, uint32_t key);
// x <- x / T, top-k and top-p applied (dropped: -inf), less the log-sum-exp of what is kept, plus every token's
// noise under s->key: the perturbed log-probabilities whose argmax is tl_draw's token (a tree's draft beam)
void tl_perturb(float* x, int32_t n, const int64_t* ids, const tl_sampling* s);

// One greedy chain-speculation round (engine/speculative.py): k drafts from `base` (the pending token at
// position base->pos; its table, stride, window), each prelude + loops 0..d-1 + read-out `draft_readout`
// and the argmax of the draft head's rows (after draft_norm; column -> token through draft_ids, null:
// identity; draft_head null: the model's head, read as the verification reads it); loops 0..d-1 of the last draft; the verification (loops d..V-1 of the k+1 positions, the
// coda) and the head's argmax after each position (k = 0 without backlog_h or last_h: one plain token).
// With backlog_h, position pos-1's draft-exit entry is
// written from that state first. last_h (dim) gets the last position's state after loop d-1.
typedef struct {
    int32_t k, d, V;
    int32_t draft_readout;
    const tl_linear* draft_head; const int64_t* draft_ids; const float* draft_norm; float draft_eps;
    const float* backlog_h;
    const tl_linear* head; const float* head_norm; float head_eps; int32_t vocab;
    int32_t* tokens;   // out (k + 1): the pending token, then the drafts
    int32_t* verify;   // out (k + 1): the verifier's token after each, up to the first that disagrees with the
                       // draft after it (the head runs lazily); the rest -1
    float* last_h;     // out (dim) or null
    double draft_ms, verify_ms;   // out: wall time of the two phases (the pipeline: all in verify_ms)
    int32_t n_emitted;            // out (the pipeline): tokens in `verify`, the round's output
    int32_t row_loops;            // out (the pipeline): core loops run, summed over positions
    // sampling (inv_temp > 0): every token of the round, draft or verified, is tl_draw's with the key of its
    // output index, n0 + its offset in the round (the token after the pending one is index n0)
    float inv_temp; int32_t n0; uint64_t seed; int32_t top_k; float top_p;
    int32_t ahead;   // the pipeline: at most this many drafts in flight, not yet verified (0: no bound)
    int32_t head_rows;   // verification rows per head call: the chain's (<= 0: 2), up to the first disagreement;
                         // the pipeline's parked positions (<= 0: 1; at most 16)
    // several chain rounds in one call (rounds > 1 with out and out_n; tl_spec_round only): after each, the
    // committed position advances by its output, the next round drafts from its last token (a draft exit's
    // backlog from the last draft's state where all k were accepted; sampled draws at the next output
    // indices), until `rounds` rounds or a round whose output holds a token of `stop`. Out: the rounds'
    // outputs one after another in `out` (rounds * (k + 1)), their lengths in `out_n`, n_rounds run;
    // draft_ms / verify_ms summed; last_h the last round's.
    int32_t rounds; const int32_t* stop; int32_t n_stop;
    int32_t* out; int32_t* out_n; int32_t n_rounds;
} tl_round;
int tl_spec_round(const tl_model* m, const tl_kv* kv, const tl_row* base, tl_round* R, float* scratch,
                  int64_t scratch_len);
int64_t tl_round_scratch_floats(const tl_model* m, const tl_round* R, int32_t max_ctx);
// The same round as a pipeline of depth-aligned passes (each in-flight position at its own loop in one
// pass over the weights; step.cpp): `verify` gets the n_emitted output tokens (accepted drafts, then the
// verifier's correction or bonus); every draft's exit entry is written (no backlog after it). k bounds the
// drafts of the whole call and `ahead` those in flight at once, so a call may run far past `ahead` drafts
// while they are accepted (the next drafts beside the verification of the earlier ones).
int tl_spec_pipeline(const tl_model* m, const tl_kv* kv, const tl_row* base, tl_round* R, float* scratch,
                     int64_t scratch_len);
int64_t tl_pipeline_scratch_floats(const tl_model* m, const tl_round* R, int32_t max_ctx);

// One tree-speculation round (tree.cpp; K > 1 branches, `depth` drafted levels): the pending token
// at base->pos is node 0; node i is stored at base->pos + i. Out: the nodes' tokens and parents, the
// round's output (`emitted`, n_emitted <= depth + 1) and the accepted path's nodes (`path`, path[0] = 0;
// the caller compacts them into consecutive positions).
typedef struct {
    int32_t depth, K, d, V;
    int32_t draft_readout, last_readout;   // the draft passes' read-out; the last pass's (-1 or a draft exit)
    const tl_linear* draft_head; const int64_t* draft_ids; const float* draft_norm; float draft_eps;
    const tl_linear* head; const float* head_norm; float head_eps; int32_t vocab;
    int32_t* tokens; int32_t* parents;     // out (1 + K * depth)
    int32_t* emitted; int32_t* path;       // out (depth + 1)
    int32_t n_nodes, n_emitted;            // out
    double draft_ms, verify_ms;            // out
    // sampling (inv_temp > 0; tl_round's fields): the verifier's token after a node at depth t is tl_draw's
    // with the key of output index n0 + t; the beam ranks children by their perturbed draft log-probability
    float inv_temp; int32_t n0; uint64_t seed; int32_t top_k; float top_p;
    int32_t n_verified;                    // out: nodes the verification ran (the chains the walk needed)
    int32_t head_rows;                     // rows of a chain per head call as the walk reaches them (<= 0: 2)
} tl_tree;
int tl_tree_round(const tl_model* m, const tl_kv* kv, const tl_row* base, tl_tree* T, float* scratch,
                  int64_t scratch_len);
int64_t tl_tree_scratch_floats(const tl_model* m, const tl_tree* T, int32_t max_ctx);

// `steps` plain tokens of one sequence in one call (spec.cpp): the row `base` (token, its position, its
// loops or exit rule) decoded, the head's argmax (inv_temp 0) or draw (the key of output index n0 + s) the
// next token, and so on; ends after a token in `stop`. `base` rows from tokens only (no random initial state).
// Under a grammar (engine/fast_steps.py's constrained lone steps) each pick is over the tokens the bitmask `mask`
// allows (it holds the first position's when the call starts), and grammar(token, room) after each pick returns
// once the grammar has taken the token and `mask` holds the next position's: the number of tokens it forces
// next (at most room; written to `forced`, taken by the grammar too, outputs of the call), or -1 to end it.
typedef struct {
    int32_t steps;
    const tl_linear* head; const float* head_norm; float head_eps; int32_t vocab;
    float inv_temp; int32_t n0; uint64_t seed; int32_t top_k; float top_p;
    const int32_t* stop; int32_t n_stop;
    const uint32_t* mask; int32_t (*grammar)(int32_t token, int32_t room);
    const int32_t* forced;                 // (steps) the callback's forced tokens; null: none are asked for
    int32_t* tokens; int32_t* loops;       // out (steps): each step's token and the core loops it ran
    int32_t n_out;                         // out: the steps run
} tl_gen;
int tl_generate(const tl_model* m, const tl_kv* kv, const tl_row* base, tl_gen* G, float* scratch,
                int64_t scratch_len);
int64_t tl_generate_scratch_floats(const tl_model* m, const tl_gen* G, int32_t max_ctx);

// An int4 layer's codes, scales and zero points repacked for 16 weight rows a 512-bit vector (intdot.cpp
// qq_packed: AVX-512 VNNI builds): the bytes it takes (-1: this build or layer has no such kernel), and the
// packing into out; the descriptor's `packed` then points at out (kept alive by the caller).
int64_t tl_pack_int4_size(const tl_linear* L);
int32_t tl_pack_int4(const tl_linear* L, uint8_t* out);

// The block kind a family's C++ file registered under `name` (tl_block.own), or 0: this library has none.
int32_t tl_block_kind(const char* name);

void tl_set_threads(int32_t n);
int32_t tl_threads(void);
const char* tl_isa(void);
}
