// Greedy speculation rounds in one call each (engine/speculative.py): a chain round (tl_spec_round) and the
// depth-aligned passes of a pipeline round (tl_spec_pipeline), built from the decode step's pieces (step.h).
#include <algorithm>
#include <cstring>
#include <ctime>
#include <vector>
#include "tinyloop.h"
#include "step.h"
#include "vec.h"

using namespace tl_step;

// ---- one greedy speculation round in one call (engine/speculative.py Speculator._chain_round) ----------
// The draft: k tokens, each its own tl_decode pass (prelude + loops 0..d-1 + the draft read-out) and the
// draft head's argmax over its rows (the reduced draft vocabulary) feeding the next; then the last drafted
// token's loops 0..d-1 (no read-out); then the verification, loops d..V-1 of all k+1 positions from the
// draft's states, the coda and the full head's argmax. The rounds of Python between these passes are what
// this call removes; the math and the order of every pass are the stepwise path's.
namespace {
// the loop input's width beyond dim (value embeddings: model/looped.py loop_input_width), 0 without them
int64_t ve_extra(const tl_model* m) { return m->e_width > m->dim ? m->e_width - m->dim : 0; }

int64_t round_extra(const tl_model* m, const tl_round* R) {
    const int64_t n = R->k + 1, dim = m->dim, X = ve_extra(m);
    const int64_t hn = std::max<int64_t>(R->head->n * n, R->draft_head ? R->draft_head->n : 0);
    return 4 * n * dim + hn + 2 * n * dim + n * (dim / 8) + 64 + (X ? (n + 1) * X + dim : 0);
}
}  // namespace

extern "C" int64_t tl_round_scratch_floats(const tl_model* m, const tl_round* R, int32_t max_ctx) {
    return round_extra(m, R) + tl_scratch_floats(m, R->k + 2, max_ctx);
}

// how the token at offset j of a round (after the pending token) is picked: greedy rounds take the argmax
// (inv_temp 0), sampled ones draw under the key of its output index
static tl_sampling round_draw(const tl_round* R, int j) {
    tl_sampling s{};
    s.key = R->inv_temp > 0.0f ? tl_noise_key(R->seed, (int64_t)R->n0 + j) : 0u;
    s.inv_temp = R->inv_temp;
    s.top_k = R->top_k;
    s.top_p = R->top_p;
    return s;
}

// the draft head's pick of the token at offset j: its argmax, or its draw under the round's noise
static int32_t draft_pick(const tl_round* R, float* logits, int cols, int j) {
    const tl_sampling s = round_draw(R, j);
    const int32_t col = tl_draw(logits, cols, R->draft_ids, &s);
    return R->draft_ids ? (int32_t)R->draft_ids[col] : col;
}

static double now_ms() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int spec_round_once(const tl_model* m, const tl_kv* kv, const tl_row* base, tl_round* R,
                           float* scratch, int64_t scratch_len) {
    const int k = R->k, d = R->d, V = R->V;
    const int64_t dim = m->dim, n = k + 1;
    if (k < 0 || d < 1 || d >= V) return 10;
    const int64_t W = dim + ve_extra(m);   // the loop input's width
    // (a backlog entry read out by the coda would need its position's value embeddings: never asked for)
    if (W > dim && R->backlog_h && R->draft_readout == 0) return 11;
    // the draft's rows: a reduced draft head, or (null) the model's own head over the whole vocabulary
    const tl_linear* DH = R->draft_head ? R->draft_head : R->head;
    const int draft_cols = R->draft_head ? DH->n : R->vocab;
    const int max_ctx = base->pos + k + 1;
    const int64_t extra = round_extra(m, R);
    if (extra + tl_scratch_floats(m, k + 2, max_ctx) > scratch_len) return 1;
    float* es = scratch;                 // (n, W) loop inputs (prelude outputs, value embeddings) of the round's positions
    float* be = es + n * W;              // (W, with value embeddings) a backlog row's loop input (not read)
    float* hs = be + (W > dim ? W : 0);  // (n, dim) their states after loop d-1
    float* hid = hs + n * dim;           // (2n, dim) read-outs
    float* logits = hid + 2 * n * dim;
    float* hsc = logits + std::max<int64_t>(R->head->n * n, R->draft_head ? R->draft_head->n : 0);
    float* dec = scratch + extra;
    const int64_t dec_len = scratch_len - extra;
    const double t0 = now_ms();
    double t1 = t0;
    R->tokens[0] = base->token;
    if (k == 0 && !R->last_h && !R->backlog_h) {   // no draft and no exit state wanted: a plain token
        tl_row row = *base;
        row.loops = V;
        row.first_loop = 0;
        row.exit_kind = TL_EXIT_NONE;
        row.readout = 0;
        row.state_e = row.state_h = nullptr;
        row.out_e = row.out_h = nullptr;
        int rc = tl_decode(m, kv, &row, 1, hid, dec, dec_len);
        if (rc) return rc;
        const tl_sampling s = round_draw(R, 0);
        rc = tl_head(R->head, hid, 1, R->head_norm, R->head_eps, R->vocab, logits, R->verify, hsc, &s,
                     m->logit_softcap);
        if (rc) return 20 + rc;
        R->draft_ms = 0;
        R->verify_ms = now_ms() - t0;
        return 0;
    }
    for (int j = 0; j <= k; ++j) {
        if (j == k) t1 = now_ms();   // the drafts are done; the last draft's loops count with the verification
        tl_row rows[2];
        rows[0] = *base;
        rows[0].token = R->tokens[j];
        rows[0].pos = base->pos + j;
        rows[0].loops = d;
        rows[0].first_loop = 0;
        rows[0].exit_kind = TL_EXIT_NONE;
        rows[0].readout = j < k ? R->draft_readout : -1;
        rows[0].state_e = rows[0].state_h = nullptr;
        rows[0].out_e = es + j * W;
        rows[0].out_h = hs + j * dim;
        int M = 1;
        if (j == 0 && R->backlog_h) {    // position pos-1's draft-exit entry, due since the last round
            rows[1] = rows[0];
            rows[1].pos = base->pos - 1;
            rows[1].first_loop = rows[1].loops = d;
            rows[1].readout = R->draft_readout;
            rows[1].state_e = rows[1].state_h = R->backlog_h;
            if (W > dim) {
                memset(be, 0, sizeof(float) * W);
                rows[1].state_e = be;
            }
            rows[1].out_e = rows[1].out_h = nullptr;
            M = 2;
        }
        int rc = tl_decode(m, kv, rows, M, hid, dec, dec_len);
        if (rc) return rc;
        if (j == k) break;
        const float* x = hid;
        if (R->draft_norm) {
            rmsnorm(hid, R->draft_norm, hsc, 1, (int)dim, R->draft_eps);
            x = hsc;
        }
        tl_linear_rows(DH, x, 1, logits, DH->n, hsc + dim);
        R->tokens[j + 1] = draft_pick(R, logits, draft_cols, j);
    }
    std::vector<tl_row> vr(n);
    for (int j = 0; j < n; ++j) {
        vr[j] = *base;
        vr[j].token = R->tokens[j];
        vr[j].pos = base->pos + j;
        vr[j].first_loop = d;
        vr[j].loops = V;
        vr[j].exit_kind = TL_EXIT_NONE;
        vr[j].readout = 0;
        vr[j].state_e = es + j * W;
        vr[j].state_h = hs + j * dim;
        vr[j].out_e = vr[j].out_h = nullptr;
    }
    int rc = tl_decode(m, kv, vr.data(), (int)n, hid, dec, dec_len);
    if (rc) return rc;
    // The head, lazily, head_rows rows at a time: row j's token is needed only while the drafts before it
    // were all accepted (the caller's walk stops at the first disagreement; later entries stay -1). A head
    // row is bitwise the same whatever rows share its call (intdot.cpp's canonical reduction), so the
    // tokens are those of one call over all n rows. What a call costs by its rows depends on the host (the
    // shipped int8 head: 0.39, 0.70, 1.30 and 1.67 ms for 1, 2, 4 and 5 rows on AVX2, where pairs keep most
    // of what a batch saves and skip the rows after a rejection; 0.46, 0.47, 0.59, 0.61 with AMX tiles, where
    // one call over all rows costs less), so the caller chooses (engine/draft_policy.py head_chunk).
    std::vector<tl_sampling> draws(n);
    for (int j = 0; j < n; ++j) {
        draws[j] = round_draw(R, j);
        R->verify[j] = -1;
    }
    const int head_rows = R->head_rows > 0 ? R->head_rows : 2;
    for (int j0 = 0; j0 < n;) {
        const int c = (int)std::min<int64_t>(head_rows, n - j0);
        rc = tl_head(R->head, hid + j0 * dim, c, R->head_norm, R->head_eps, R->vocab, logits, R->verify + j0, hsc,
                     draws.data() + j0, m->logit_softcap);
        if (rc) return 20 + rc;
        bool agree = true;
        for (int j = j0; j < j0 + c && agree; ++j) agree = j == k || R->verify[j] == R->tokens[j + 1];
        j0 += c;
        if (!agree) break;
    }
    if (R->last_h) memcpy(R->last_h, hs + k * dim, sizeof(float) * dim);
    const double t2 = now_ms();
    R->draft_ms = t1 - t0;
    R->verify_ms = t2 - t1;
    return 0;
}

// One round, or several back to back (R->rounds > 1: a lone request's rounds at the policy's k, so that the
// Python between rounds, ~0.2-0.4 ms a round, is paid once a call): each round as above, from the position and
// token the last one ended on; the tokens are those of the rounds run one call each.
extern "C" int tl_spec_round(const tl_model* m, const tl_kv* kv, const tl_row* base, tl_round* R,
                             float* scratch, int64_t scratch_len) {
    if (R->rounds <= 1 || !R->out || !R->out_n || R->k < 1) return spec_round_once(m, kv, base, R, scratch, scratch_len);
    tl_row b = *base;
    const float* const backlog0 = R->backlog_h;
    const int32_t n0 = R->n0;
    double dms = 0, vms = 0;
    int total = 0, rc = 0;
    R->n_rounds = 0;
    for (int r = 0; r < R->rounds; ++r) {
        if ((rc = spec_round_once(m, kv, &b, R, scratch, scratch_len))) break;
        dms += R->draft_ms;
        vms += R->verify_ms;
        int e = 0;
        bool stop = false;
        for (int j = 0; j <= R->k; ++j) {   // the round's output: accepted drafts, then the verifier's token
            const int32_t y = R->verify[j];
            R->out[total + e++] = y;
            for (int s = 0; s < R->n_stop; ++s) stop = stop || y == R->stop[s];
            if (j == R->k || y != R->tokens[j + 1]) break;
        }
        R->out_n[r] = e;
        total += e;
        R->n_rounds = r + 1;
        b.pos += e;
        b.token = R->out[total - 1];
        R->n0 += e;
        // every draft accepted: the last one's exit entry is due, from its state (read by the next round's first
        // pass before that round writes last_h again)
        R->backlog_h = R->last_h && e == R->k + 1 ? R->last_h : nullptr;
        if (stop) break;
    }
    R->backlog_h = backlog0;
    R->n0 = n0;
    R->draft_ms = dms;
    R->verify_ms = vms;
    return rc;
}

// ---- greedy speculation as a pipeline of depth-aligned passes (memory-bound models) ----------------------
// Every pass runs each in-flight position through its own next loop, all rows in one pass over the core's
// weights (each row's keys in its own loop's slots). The newest position, once through loop d-1, is read
// out by the draft (exit or coda, draft head argmax) and its draft enters at loop 0 the pass after; the
// oldest, once through loop V-1, is read out by the coda and the head: its greedy token is emitted and
// checked against the draft after it. A mismatch ends the round (the later positions are dropped: the
// caller's committed length does not cover them); so does the k-th draft's verification. Position q at
// loop l reads loop l's keys of q-1, written one pass earlier (q-1 runs a loop ahead), so each position
// sees exactly the keys plain decoding gives it.
namespace {
void embed_row(const tl_model* m, int token, float* x) {
    const int64_t o = (int64_t)token * m->dim;
    for (int i = 0; i < m->dim; ++i) {
        float v = m->embed_kind == TL_F32 ? ((const float*)m->embed)[o + i]
                : m->embed_kind == TL_F16 ? f16_to_f32(((const uint16_t*)m->embed)[o + i])
                : bf16_to_f32(((const uint16_t*)m->embed)[o + i]);
        x[i] = m->embed_scale != 1.0f ? v * m->embed_scale : v;
    }
}

// one row's read-out `ro` (0: the coda after the final norm where it ends the recurrence; i > 0: a draft
// exit) of state h into out (dim); e_row: the row's loop input (the coda's value embeddings)
void read_out(const tl_model* m, const tl_kv* kv, const tl_row* row, int ro, const float* h, float* out,
              Buffers& B, const float* e_row) {
    const int dim = m->dim;
    if (ro == 0 && m->post_loop_norm) rmsnorm(h, m->final_norm, B.x, 1, dim, m->norm_eps);
    else memcpy(B.x, h, sizeof(float) * dim);
    if (ro == 0 && m->state_proj.n) project_state(&m->state_proj, dim, B.x, 1, B);
    if (ro > 0 && m->readouts[ro - 1].state_proj.n) project_state(&m->readouts[ro - 1].state_proj, dim, B.x, 1, B);
    B.ve_e = ro == 0 && m->e_width > dim ? e_row : nullptr;
    if (ro == 0) {
        const tl_block* coda = m->blocks + m->n_prelude + m->n_core;
        for (int i = 0; i < m->n_coda; ++i) block(m, &coda[i], kv, row, 1, m->n_prelude + i, B.x, B);
    } else {
        const tl_readout* x = &m->readouts[ro - 1];
        for (int i = 0; i < x->n_blocks; ++i) block(m, &x->blocks[i], kv, row, 1, x->slots[i], B.x, B);
    }
    memcpy(out, B.x, sizeof(float) * dim);
}
}  // namespace

// the verification rows a pipeline's head call scores at once (R->head_rows, within the call's positions)
static int pipeline_batch(const tl_round* R) { return std::max(1, std::min({R->head_rows, R->k + 1, 16})); }

extern "C" int64_t tl_pipeline_scratch_floats(const tl_model* m, const tl_round* R, int32_t max_ctx) {
    const int64_t n = R->k + 1, dim = m->dim, rows = pipeline_batch(R) + 1;
    return 2 * n * dim + n * ve_extra(m) + 4 * dim + rows * dim
           + rows * std::max<int64_t>(R->head->n, R->draft_head ? R->draft_head->n : 0)
           + rows * (2 * dim + dim / 8) + 64 + tl_scratch_floats(m, R->k + 2, max_ctx);
}

extern "C" int tl_spec_pipeline(const tl_model* m, const tl_kv* kv, const tl_row* base, tl_round* R,
                                float* scratch, int64_t scratch_len) {
    const int k = R->k, d = R->d, V = R->V;
    const int64_t dim = m->dim, n = k + 1;
    if (k < 1 || d < 1 || d >= V) return 10;
    const int64_t W = dim + ve_extra(m);   // the loop input's width
    if (W > dim && R->backlog_h && R->draft_readout == 0) return 11;   // (as tl_spec_round)
    if (tl_pipeline_scratch_floats(m, R, base->pos + k + 1) > scratch_len) return 1;
    const tl_linear* DH = R->draft_head ? R->draft_head : R->head;
    const int draft_cols = R->draft_head ? DH->n : R->vocab;
    const int Bv = pipeline_batch(R);
    const int64_t LN = std::max<int64_t>(R->head->n, R->draft_head ? R->draft_head->n : 0);
    float* es = scratch;                 // (n, W) loop inputs (prelude outputs, value embeddings)
    float* hs = es + n * W;              // (n, dim) states
    float* tmp = hs + n * dim;           // (4 dim) read-outs
    float* hin = tmp + 4 * dim;          // (Bv + 1, dim) the head's rows: parked verifications, then a draft
    float* logits = hin + (Bv + 1) * dim;   // (Bv + 1, LN) their logits
    float* hsc = logits + (Bv + 1) * LN;    // the head's scratch: the linear's m * k + m * k / 8 floats
    int64_t total;
    Buffers B = carve(m, k + 2, base->pos + k + 1, hsc + (Bv + 1) * (2 * dim + dim / 8) + 64, &total);
    const double t0 = now_ms();
    std::vector<tl_row> rows(n);
    std::vector<int> loop(n, 0), slots(n);
    auto row_at = [&](int j) {
        tl_row r = *base;
        r.token = R->tokens[j];
        r.pos = base->pos + j;
        r.first_loop = 0;
        r.loops = V;
        r.exit_kind = TL_EXIT_NONE;
        r.state_e = r.state_h = nullptr;
        r.out_e = r.out_h = nullptr;
        return r;
    };
    auto enter = [&](int j) {   // embedding and prelude of position j; its state for loop 0
        rows[j] = row_at(j);
        embed_row(m, R->tokens[j], B.x);
        for (int i = 0; i < m->n_prelude; ++i) block(m, &m->blocks[i], kv, &rows[j], 1, i, B.x, B);
        if (m->prelude_norm) rmsnorm(B.x, m->prelude_norm, B.x, 1, (int)dim, m->norm_eps);
        memcpy(es + j * W, B.x, sizeof(float) * dim);
        if (W > dim) loop_input_ve(m, R->tokens[j], es + j * W);
        if (m->injection == 0 || m->loop_start != 0) memcpy(hs + j * dim, B.x, sizeof(float) * dim);   // from e
        else memset(hs + j * dim, 0, sizeof(float) * dim);
        loop[j] = 0;
    };
    auto normed = [&](const float* x, const float* w, float eps, float* out) {
        if (w) rmsnorm(x, w, out, 1, (int)dim, eps);
        else memcpy(out, x, sizeof(float) * dim);
    };
    if (R->backlog_h) {   // position pos-1's draft-exit entry, due since the last (chain) round
        tl_row r = row_at(0);
        r.pos = base->pos - 1;
        read_out(m, kv, &r, R->draft_readout, R->backlog_h, tmp, B, nullptr);
    }
    R->tokens[0] = base->token;
    enter(0);
    // oldest: the oldest position still in the passes; parked: positions oldest - parked .. oldest - 1, through
    // loop V-1 and the coda, their head rows waiting in hin to be scored together (one read of the head for up
    // to Bv of them: on a model whose head outweighs a loop, the head is most of a pipeline token's cost)
    int oldest = 0, newest = 0, parked = 0, emitted = 0, row_loops = 0, picked = 0;   // picked: the newest drafted token's position
    const tl_block* core = m->blocks + m->n_prelude;
    const int core_slot0 = m->n_prelude + m->n_coda;
    const int64_t HN = R->head->n;
    // the next position enters at loop 0 once its draft is picked, while fewer than `ahead` drafts are in the
    // passes (its loop-l reads of the position before it find those keys written: that one is ahead)
    auto admit = [&] {
        if (picked > newest && (R->ahead <= 0 || picked - oldest <= R->ahead)) {
            newest = picked;
            enter(newest);
        }
    };
    for (;;) {
        const int M = newest - oldest + 1;
        tl_row* pr = &rows[oldest];
        for (int r = 0; r < M; ++r) {   // the core's input of each row at its loop
            const float* e = es + (oldest + r) * W;
            const float* h = hs + (oldest + r) * dim;
            float* x = B.x + r * dim;
            if (m->injection == 0) memcpy(x, h, sizeof(float) * dim);
            else if (m->injection == 1) for (int64_t i = 0; i < dim; i += TL_W) vstore(x + i, vadd(vload(h + i), vload(e + i)));
            else if (m->injection == 2) {
                memcpy(B.a + r * 2 * dim, h, sizeof(float) * dim);
                memcpy(B.a + r * 2 * dim + dim, e, sizeof(float) * dim);
            }
        }
        if (m->injection == 2) tl_linear_rows(&m->adapter, B.a, M, B.x, dim, B.lin);
        if (m->injection == 3) diagonal_inject(m, hs + oldest * dim, es + oldest * W, W, B.x, M, B);
        if (m->sphere) l2norm(B.x, B.x, M, (int)dim);   // the sum back on the sphere
        if (m->loop_start == 2)   // skip: a row at loop 0 runs on e (its h) itself, without the injection
            for (int r = 0; r < M; ++r)
                if (loop[oldest + r] == 0) memcpy(B.x + r * dim, hs + (oldest + r) * dim, sizeof(float) * dim);
        B.ve_e = W > dim ? es + oldest * W : nullptr;   // the core's value embeddings, row by row
        for (int jj = 0; jj < m->n_core; ++jj) {
            for (int r = 0; r < M; ++r) slots[r] = core_slot0 + loop[oldest + r] * m->n_core + jj;
            block(m, &core[jj], kv, pr, M, 0, B.x, B, slots.data());
        }
        if (m->loop_norm) rmsnorm(B.x, m->core_norm, hs + oldest * dim, M, (int)dim, m->norm_eps);
        else if (m->sphere) l2norm(B.x, hs + oldest * dim, M, (int)dim);
        else memcpy(hs + oldest * dim, B.x, sizeof(float) * M * dim);
        for (int j = oldest; j <= newest; ++j) ++loop[j];
        row_loops += M;
        // after the pass: the oldest, through loop V-1, is read out by the coda (its coda keys written before the
        // next position's coda reads them) and parked; the newest, through loop d-1, is read out by the draft
        // (its exit entry) and its draft picked
        if (loop[oldest] == V) {
            read_out(m, kv, &rows[oldest], 0, hs + oldest * dim, tmp, B, es + oldest * W);
            normed(tmp, R->head_norm, R->head_eps, hin + parked * dim);
            ++parked;
            ++oldest;
        }
        admit();   // (a draft held back by `ahead` enters as soon as a position leaves the passes)
        const bool at_d = oldest <= newest && loop[newest] == d;
        const bool draft_now = at_d && (newest < k || R->draft_readout > 0);   // (the last draft's exit entry too)
        const bool pick_now = at_d && newest < k;
        if (draft_now) read_out(m, kv, &rows[newest], R->draft_readout, hs + newest * dim, tmp, B, es + newest * W);
        // the parked rows are scored once Bv wait, or when nothing else can run (no position in the passes: the
        // cap's last draft is among them)
        const bool flush = parked > 0 && (parked >= Bv || oldest > newest);
        // where the draft reads the model's own head, a pick due with them shares the call (a row's logits do
        // not depend on the rows beside it: matmul.cpp)
        const bool shared = flush && pick_now && !R->draft_head;
        if (flush) {
            int rows_n = parked;
            if (shared) normed(tmp, R->draft_norm, R->draft_eps, hin + rows_n++ * dim);
            tl_linear_rows(R->head, hin, rows_n, logits, HN, hsc);
            if (m->logit_softcap > 0.0f) tl_step::softcap(logits, parked, HN, HN, m->logit_softcap);   // (not a draft's)
            bool stop = false;
            for (int i = 0; i < parked && !stop; ++i) {   // in order, up to the first draft that disagrees
                const int p = oldest - parked + i;
                const tl_sampling s = round_draw(R, p);
                const int32_t y = tl_draw(logits + (int64_t)i * HN, R->vocab, nullptr, &s);
                R->verify[emitted++] = y;
                // the draft after it holds only if it was entered (else y is a correction or the last draft's bonus)
                stop = !(p < newest && R->tokens[p + 1] == y);
            }
            parked = 0;
            if (stop) break;
            if (shared) R->tokens[newest + 1] = draft_pick(R, logits + (int64_t)(rows_n - 1) * HN, draft_cols, newest);
        }
        if (pick_now && !shared) {
            float* x = hin + (int64_t)Bv * dim;      // (the last row: parked ones stay where they are)
            float* lg = logits + (int64_t)Bv * LN;
            normed(tmp, R->draft_norm, R->draft_eps, x);
            tl_linear_rows(DH, x, 1, lg, DH->n, hsc);
            R->tokens[newest + 1] = draft_pick(R, lg, draft_cols, newest);
        }
        if (pick_now) {
            picked = newest + 1;
            admit();
        }
    }
    R->n_emitted = emitted;
    R->row_loops = row_loops;
    R->draft_ms = 0;
    R->verify_ms = now_ms() - t0;
    return 0;
}

// ---- plain tokens in one call (engine/fast_steps.py: a lone plain request) --------------------------------
// Step s runs the row of token t_s at position base->pos + s (tl_decode: prelude, its loops or its own exit,
// the coda), then the head's argmax or draw under the key of output index n0 + s (tl_head) gives t_{s+1};
// after a token in `stop` the call ends. The steps are the engine's own decode steps, back to back: what
// goes is each step's Python (scheduling, the rows, the two calls: ~0.3 ms a token on the shipped model).
// Under a grammar, the callback may hand back tokens the grammar forces after the pick (G->forced: each the
// only token its position's mask allows, so the pick a step would make there, whatever the draw's key): they
// are outputs at once, and their rows run in the next pass with the row of the pick before them, one pass
// over the weights and one head row (the last) for them all; each row's bits are those it has alone
// (step.cpp's rows do not depend on the rows beside them), so the outputs are the steps'. Forced tokens
// are only taken while a pick follows them in the call, so every output's row has run when the call ends.
extern "C" int64_t tl_generate_scratch_floats(const tl_model* m, const tl_gen* G, int32_t max_ctx) {
    const int64_t k = G->head->k, rows = G->forced ? std::max<int32_t>(G->steps, 1) : 1;
    return rows * m->dim + G->head->n + 2 * k + k / 8 + 64 + tl_scratch_floats(m, (int32_t)rows, max_ctx);
}

extern "C" int tl_generate(const tl_model* m, const tl_kv* kv, const tl_row* base, tl_gen* G, float* scratch,
                           int64_t scratch_len) {
    G->n_out = 0;
    if (G->steps < 1) return 10;
    const int64_t k = G->head->k, dim = m->dim;
    const int64_t most = G->forced ? G->steps : 1;   // rows a pass may hold
    const int64_t extra = most * dim + G->head->n + 2 * k + k / 8 + 64;
    if (tl_generate_scratch_floats(m, G, base->pos + G->steps) > scratch_len) return 1;
    float* hid = scratch;
    float* logits = hid + most * dim;
    float* hsc = logits + G->head->n;
    float* dec = scratch + extra;
    std::vector<int32_t> seq(G->steps + 1);   // the base token, then the outputs: row j feeds seq[j]
    std::vector<tl_row> rows(most);
    seq[0] = base->token;
    int n = 0, fed = 0;   // outputs made, rows run
    while (n < G->steps) {
        const int M = n + 1 - fed;   // the rows of seq[fed..n]: the last pick's, then the tokens forced after it
        for (int i = 0; i < M; ++i) {
            rows[i] = *base;   // (a fresh row each step: its exit rule's survival starts again, as the engine's)
            rows[i].token = seq[fed + i];
            rows[i].pos = base->pos + fed + i;
        }
        int rc = tl_decode(m, kv, rows.data(), M, hid, dec, scratch_len - extra);
        if (rc) return rc;
        for (int i = 0; i < M; ++i) G->loops[fed + i] = rows[i].loops_run;   // row j made output j
        fed += M;
        tl_sampling d{};
        d.key = G->inv_temp > 0.0f ? tl_noise_key(G->seed, (int64_t)G->n0 + n) : 0u;
        d.inv_temp = G->inv_temp;
        d.top_k = G->top_k;
        d.top_p = G->top_p;
        d.mask = G->mask;   // (this position's: the caller's, then grammar()'s fill)
        int32_t token;
        rc = tl_head(G->head, hid + (int64_t)(M - 1) * dim, 1, G->head_norm, G->head_eps, G->vocab, logits, &token,
                     hsc, G->inv_temp > 0.0f || d.mask ? &d : nullptr, m->logit_softcap);
        if (rc) return 20 + rc;
        G->tokens[n] = seq[n + 1] = token;
        G->n_out = ++n;
        bool stop = false;
        for (int i = 0; i < G->n_stop && !stop; ++i) stop = G->stop[i] == token;
        if (G->grammar) {   // the grammar takes it, fills the next position's mask (and says what it forces)
            const int room = stop || !G->forced ? 0 : std::max(0, G->steps - n - 1);
            const int f = G->grammar(token, room);
            if (f < 0 || f > room) return 31;
            for (int i = 0; i < f; ++i) G->tokens[n + i] = seq[n + 1 + i] = G->forced[i];
            n += f;
            G->n_out = n;
        }
        if (stop) break;
    }
    return 0;
}
