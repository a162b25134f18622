// One tree-speculation round in one call (engine/tree_rounds.py TreeRounds._tree_round, K > 1), greedy or
// sampled by shared noise (the walk accepts the child equal to the verifier's draw, so the output is plain
// sampling's for the seed).
// Node 0 is the pending token at position L = base->pos, storage index L; node i is stored at L + i and sits
// at position L + depth(i). Pass t (1 .. depth) drafts the frontier's K nodes (the root alone first) in one
// tl_decode call of tree rows (prelude + loops 0..d-1 + the draft read-out, states kept), scores their
// children with the draft head and keeps a beam of K (engine/tree.py beam_step: the greedy child of the
// frontier's first node, then the K-1 best other children by cumulative draft log-probability); pass
// depth + 1 runs the last frontier's loops 0..d-1 (and a draft exit's entries). The verification runs loops
// d..V-1 from the draft states with the ancestor mask, then the coda and the head, a chain of nodes at a
// time as the walk needs them: the greedy chain first, then the best chain below any node the walk leaves
// it at (the stepwise _accept_tree scores the head the same way, after verifying every node).
// The accepted path is returned; the caller moves its entries into positions L+1.. (PagedKV.copy_positions).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <vector>
#include "tinyloop.h"

namespace {
double now_ms() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

int draft_cols(const tl_tree* T) { return T->draft_head ? T->draft_head->n : T->vocab; }

struct Layout {   // the call's part of the scratch; the rest is tl_decode's
    int64_t es, hs, hid, tmp, logits, hsc, total;
};

Layout layout(const tl_model* m, const tl_tree* T) {
    const int64_t n = 1 + (int64_t)T->K * T->depth, dim = m->dim;
    const int64_t W = m->e_width > dim ? m->e_width : dim;   // the loop input (value embeddings after dim)
    const tl_linear* DH = T->draft_head ? T->draft_head : T->head;
    Layout l;
    l.es = 0;
    l.hs = l.es + n * W;
    l.hid = l.hs + n * dim;
    l.tmp = l.hid + n * dim;
    l.logits = l.tmp + n * dim;
    l.hsc = l.logits + std::max<int64_t>((int64_t)T->head->n * (T->depth + 1), (int64_t)DH->n * T->K);
    l.total = l.hsc + 3 * n * dim + n * (dim / 8) + 64;   // tl_head: a normed copy, then the linear's scratch
    return l;
}
}  // namespace

extern "C" int64_t tl_tree_scratch_floats(const tl_model* m, const tl_tree* T, int32_t max_ctx) {
    const int n = 1 + T->K * T->depth;
    return layout(m, T).total + tl_scratch_floats(m, n, max_ctx + n);
}

extern "C" int tl_tree_round(const tl_model* m, const tl_kv* kv, const tl_row* base, tl_tree* T, float* scratch,
                             int64_t scratch_len) {
    const int K = T->K, depth = T->depth, d = T->d, V = T->V, L0 = base->pos;
    const int n = 1 + K * depth;
    const int64_t dim = m->dim;
    if (K < 2 || depth < 1 || d < 1 || d >= V) return 10;
    const int64_t W = m->e_width > dim ? m->e_width : dim;   // es: (n, W) loop inputs
    if (tl_tree_scratch_floats(m, T, L0 + 1) > scratch_len) return 1;
    const Layout lay = layout(m, T);
    float *es = scratch + lay.es, *hs = scratch + lay.hs, *hid = scratch + lay.hid, *tmp = scratch + lay.tmp;
    float *logits = scratch + lay.logits, *hsc = scratch + lay.hsc;
    float* dec = scratch + lay.total;
    const int64_t dec_len = scratch_len - lay.total;
    const tl_linear* DH = T->draft_head ? T->draft_head : T->head;
    const int cols = draft_cols(T);
    const bool sampled = T->inv_temp > 0.0f;
    auto draw_at = [&](int offset) {   // how the token at `offset` after the pending one is picked
        tl_sampling s{};
        s.key = sampled ? tl_noise_key(T->seed, (int64_t)T->n0 + offset) : 0u;
        s.inv_temp = T->inv_temp;
        s.top_k = T->top_k;
        s.top_p = T->top_p;
        return s;
    };
    const double t0 = now_ms();

    // the tree: tokens, parents, depths, cumulative scores; each node's visible node keys (storage
    // indices, ascending: its ancestors, then itself) and their positions
    std::vector<int32_t> depth_of(n), keys((size_t)n * (depth + 1)), kpos((size_t)n * (depth + 1)), nkeys(n);
    std::vector<double> score(n);
    int32_t* tok = T->tokens;
    int32_t* par = T->parents;
    int count = 0;
    auto add = [&](int32_t token, int parent, double s) {
        const int i = count++;
        tok[i] = token;
        par[i] = parent;
        depth_of[i] = parent < 0 ? 0 : depth_of[parent] + 1;
        score[i] = s;
        int32_t* k = &keys[(size_t)i * (depth + 1)];
        int32_t* p = &kpos[(size_t)i * (depth + 1)];
        int c = 0;
        if (parent >= 0) {
            c = nkeys[parent];
            std::copy_n(&keys[(size_t)parent * (depth + 1)], c, k);
            std::copy_n(&kpos[(size_t)parent * (depth + 1)], c, p);
        }
        k[c] = L0 + i;
        p[c] = L0 + depth_of[i];
        nkeys[i] = c + 1;
        return i;
    };
    auto row_of = [&](int i) {   // node i as a tree row of the round's table
        tl_row r = *base;
        r.token = tok[i];
        r.pos = L0 + depth_of[i];
        r.store = L0 + i;
        r.tree_base = L0;
        r.tree_n = nkeys[i];
        r.tree_keys = &keys[(size_t)i * (depth + 1)];
        r.tree_pos = &kpos[(size_t)i * (depth + 1)];
        r.exit_kind = TL_EXIT_NONE;
        r.state_e = r.state_h = nullptr;
        r.out_e = r.out_h = nullptr;
        return r;
    };

    add(base->token, -1, 0.0);
    std::vector<int> frontier{0}, greedy_path{0};
    std::vector<tl_row> rows;
    std::vector<double> total;
    for (int t = 1; t <= depth + 1; ++t) {
        rows.clear();
        for (int i : frontier) {
            tl_row r = row_of(i);
            r.first_loop = 0;
            r.loops = d;
            r.readout = t <= depth ? T->draft_readout : T->last_readout;
            r.out_e = es + (int64_t)i * W;
            r.out_h = hs + (int64_t)i * dim;
            rows.push_back(r);
        }
        const int F = (int)rows.size();
        int rc = tl_decode(m, kv, rows.data(), F, hid, dec, dec_len);
        if (rc) return rc;
        if (t > depth) break;
        rc = tl_head(DH, hid, F, T->draft_norm, T->draft_eps, cols, logits, nullptr, hsc, nullptr,
                     0.0f);   // the draft head's logits are not capped (engine/draft_head.py)
        if (rc) return 20 + rc;
        // log-softmax of each frontier row (float64, as the Python path) plus the node's score; sampled: the
        // perturbed log-probabilities under the key of the children's output index (tl_perturb), whose
        // argmax is the draft's own draw
        total.assign((size_t)F * cols, 0.0);
        int greedy = 0;
        for (int f = 0; f < F && sampled; ++f) {
            float* x = logits + (int64_t)f * DH->n;
            const tl_sampling sd = draw_at(t - 1);
            tl_perturb(x, cols, T->draft_ids, &sd);
            const double s0 = score[frontier[f]];
            for (int c = 0; c < cols; ++c) total[(size_t)f * cols + c] = (double)x[c] + s0;
            if (f == 0)
                for (int c = 1; c < cols; ++c)
                    if (x[c] > x[greedy]) greedy = c;
        }
        for (int f = 0; f < F && !sampled; ++f) {
            const float* x = logits + (int64_t)f * DH->n;
            double mx = -INFINITY;
            for (int c = 0; c < cols; ++c) mx = std::max(mx, (double)x[c]);
            double se = 0;
            for (int c = 0; c < cols; ++c) se += std::exp((double)x[c] - mx);
            const double lse = mx + std::log(se), s0 = score[frontier[f]];
            for (int c = 0; c < cols; ++c) total[(size_t)f * cols + c] = (double)x[c] - lse + s0;
            if (f == 0)   // the greedy child of the greedy node: the first of equal maxima (torch.argmax)
                for (int c = 1; c < cols; ++c)
                    if (x[c] > x[greedy]) greedy = c;
        }
        // the beam: the greedy child first, then the K - 1 best other (row, column) pairs
        std::vector<int> idx;
        idx.push_back(greedy);
        const double greedy_score = total[greedy];
        total[greedy] = -INFINITY;
        std::vector<int> order((size_t)F * cols);
        for (size_t i = 0; i < order.size(); ++i) order[i] = (int)i;
        const int rest = std::min<int>(K - 1, (int)order.size() - 1);
        std::partial_sort(order.begin(), order.begin() + rest, order.end(),
                          [&](int a, int b) { return total[a] > total[b] || (total[a] == total[b] && a < b); });
        for (int i = 0; i < rest; ++i) idx.push_back(order[i]);
        std::vector<int> next;
        for (size_t i = 0; i < idx.size(); ++i) {
            const int f = idx[i] / cols, c = idx[i] % cols;
            const int32_t token = T->draft_ids ? (int32_t)T->draft_ids[c] : c;
            next.push_back(add(token, frontier[f], i == 0 ? greedy_score : total[idx[i]]));
        }
        frontier.swap(next);
        greedy_path.push_back(frontier[0]);
    }
    const double t1 = now_ms();

    // verification, lazily: loops d..V-1 (from each node's draft state, under the ancestor mask) and the coda
    // of a chain of nodes at a time, in one pass; then the head over that chain, head_rows rows at a time as
    // the walk reaches them. The first chain is the best path from the root (the greedy path: a greedy
    // node's first child is its best-scored); where the walk leaves a chain for another child, the best
    // chain below that child is verified the same way. A node's pass sees the keys a pass over every node
    // would give it (its ancestors are on the walk, verified before it; the keys below loop d are the
    // draft's), and a row's result does not depend on the rows beside it (the canonical reductions), so
    // the walk is the one a verification of every node gives; what goes is the work on the siblings that
    // the walk never reaches: a K = 2 tree verifies what a chain of its depth verifies, plus a chain below
    // each sibling taken.
    std::vector<int32_t> pick(count, -1), picks(depth + 1);
    std::vector<char> verified(count, 0);
    std::vector<std::vector<std::pair<int32_t, int>>> children(count);   // (token, node) in drafting order
    for (int i = 1; i < count; ++i) children[par[i]].push_back({tok[i], i});
    std::vector<tl_sampling> draws(depth + 1);
    int n_verified = 0;
    auto verify_chain = [&](const std::vector<int>& chain) -> int {
        std::vector<int> todo;
        rows.clear();
        for (int i : chain) {
            if (verified[i]) continue;
            tl_row r = row_of(i);
            r.first_loop = d;
            r.loops = V;
            r.readout = 0;
            r.state_e = es + (int64_t)i * W;
            r.state_h = hs + (int64_t)i * dim;
            rows.push_back(r);
            todo.push_back(i);
        }
        if (todo.empty()) return 0;
        const int rc = tl_decode(m, kv, rows.data(), (int)todo.size(), tmp, dec, dec_len);
        if (rc) return rc;
        for (size_t j = 0; j < todo.size(); ++j) {
            memcpy(hid + (int64_t)todo[j] * dim, tmp + (int64_t)j * dim, sizeof(float) * dim);
            verified[todo[j]] = 1;
        }
        n_verified += (int)todo.size();
        return 0;
    };
    // (the caller's choice, as spec.cpp's: what a call costs by rows depends on the host; rows past a
    // rejection are skipped)
    const size_t HEAD_ROWS = T->head_rows > 0 ? (size_t)T->head_rows : 2;
    auto score_rows = [&](const std::vector<int>& chain, size_t at) -> int {   // the head over chain[at, at + HEAD_ROWS)
        const int c = (int)std::min<size_t>(HEAD_ROWS, chain.size() - at);
        for (int j = 0; j < c; ++j) {
            memcpy(tmp + (int64_t)j * dim, hid + (int64_t)chain[at + j] * dim, sizeof(float) * dim);
            draws[j] = draw_at(depth_of[chain[at + j]]);   // (the token after the node)
        }
        const int r = tl_head(T->head, tmp, c, T->head_norm, T->head_eps, T->vocab, logits, picks.data(), hsc,
                              sampled ? draws.data() : nullptr, m->logit_softcap);
        for (int j = 0; j < c && !r; ++j) pick[chain[at + j]] = picks[j];
        return r;
    };
    std::vector<int> chain;   // the chain being scored; `at`: its first node not yet scored
    size_t at = 0;
    int node = 0, ne = 0;
    int rc = 0;
    T->path[0] = 0;
    while (true) {
        if (pick[node] < 0) {
            if (at >= chain.size() || chain[at] != node) {   // a new chain: the best path below this node
                chain.assign(1, node);
                while (!children[chain.back()].empty()) {
                    int best = children[chain.back()][0].second;
                    for (auto& ch : children[chain.back()]) if (score[ch.second] > score[best]) best = ch.second;
                    chain.push_back(best);
                }
                if ((rc = verify_chain(chain))) return rc;
                at = 0;
            }
            if ((rc = score_rows(chain, at))) return 20 + rc;
            at += std::min<size_t>(HEAD_ROWS, chain.size() - at);
        }
        const int32_t y = pick[node];
        T->emitted[ne++] = y;
        int child = -1;
        for (auto& ch : children[node]) if (ch.first == y) { child = ch.second; break; }
        if (child < 0) break;
        T->path[ne] = child;
        node = child;
    }
    T->n_verified = n_verified;
    T->n_nodes = count;
    T->n_emitted = ne;
    T->draft_ms = t1 - t0;
    T->verify_ms = now_ms() - t1;
    return 0;
}
