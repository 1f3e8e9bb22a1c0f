/* The native host helpers of sglang_tev (loaded by sglang_tev/native/__init__.py).
 *
 * DDTree on the host, one call per batch: the same trees as sglang_tev.draft.ddtree._build_heap
 * on the ranked lists of sglang_tev.draft.ddtree._ranked_survivors (see their docstrings), without
 * a per-depth top-k over the vocabulary and without Python objects per node.
 *
 * Per tree: (0) best log q m_j and its lowest-id token per depth; P_j = m_0 + ... + m_{j-1}
 * summed in double in depth order, as the heap sums scores. (1) L = the budget-th largest
 * Y(j, x) = P_j + lq_j(x) over the depths the bound may use (before the depth limit, not below a
 * leaf token on the chain): a lower bound on the budget-th tree score. (2) every token with
 * Y >= L (minus a 1e-6 relative margin) is a candidate; each depth's candidates are ranked by
 * (lq desc, id asc) and capped at k = min(budget, V). (3) best-first heap: pop the best prefix,
 * push its next sibling and its first child; ties by score are broken by the rank tuple,
 * lexicographically, a prefix before its extensions.
 *
 * Built on first use by sglang_tev/native/__init__.py with the system C compiler (no
 * -ffast-math: scores must round exactly as Python floats do). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HMAX 64 /* deepest supported depth (block size - 1); callers check */
#define BLK 64  /* tokens per block: block maxima give the bound and say which tokens to scan */

typedef struct {
    double score;
    int32_t parent, depth, rank;
} item_t;

typedef struct {
    float lq;
    int32_t id;
} cand_t;

/* a pops before b */
static int before(const item_t *a, const item_t *b, const int32_t *tup) {
    if (a->score != b->score) return a->score > b->score;
    int la = a->depth, lb = b->depth, l = la < lb ? la : lb;
    for (int j = 0; j < l; j++) {
        int ra = j == la - 1 ? a->rank : tup[a->parent * HMAX + j];
        int rb = j == lb - 1 ? b->rank : tup[b->parent * HMAX + j];
        if (ra != rb) return ra < rb;
    }
    return la < lb;
}

static void heap_push(item_t *h, int *n, item_t it, const int32_t *tup) {
    int i = (*n)++;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!before(&it, &h[p], tup)) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = it;
}

static item_t heap_pop(item_t *h, int *n, const int32_t *tup) {
    item_t top = h[0], last = h[--(*n)];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && before(&h[c + 1], &h[c], tup)) c++;
        if (!before(&h[c], &last, tup)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) h[i] = last;
    return top;
}

/* min-heap of doubles (the budget largest Y seen so far) */
static void min_sift_down(double *h, int n, int i) {
    double x = h[i];
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h[c + 1] < h[c]) c++;
        if (!(h[c] < x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

static void min_push(double *h, int *n, double x) {
    int i = (*n)++;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!(x < h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

/* max of x[0..n) (n >= 1) and whether one is NaN: 8 independent lanes, so compilers emit packed
 * max / unordered compares (a > m ? a : m is exactly the packed max; NaN never wins it) */
static float max_and_nan(const float *x, int64_t n, int *nan_out) {
    float m[8];
    int32_t nan[8] = {0};
    for (int l = 0; l < 8; l++) m[l] = -INFINITY; /* the max of the non-NaN entries (-inf if none) */
    int64_t t = 0;
    for (; t + 8 <= n; t += 8)
        for (int l = 0; l < 8; l++) {
            float a = x[t + l];
            m[l] = a > m[l] ? a : m[l];
            nan[l] |= a != a;
        }
    for (; t < n; t++) {
        m[0] = x[t] > m[0] ? x[t] : m[0];
        nan[0] |= x[t] != x[t];
    }
    float best = m[0];
    int any = nan[0];
    for (int l = 1; l < 8; l++) {
        best = m[l] > best ? m[l] : best;
        any |= nan[l];
    }
    *nan_out = any;
    return best;
}

static int cand_cmp(const void *pa, const void *pb) {
    const cand_t *a = pa, *b = pb;
    if (a->lq != b->lq) return a->lq > b->lq ? -1 : 1;
    return a->id < b->id ? -1 : (a->id > b->id);
}

/* lq: float32 [b, H, V] log q (contiguous). limits: int64 [b] deepest depth per tree (<= H).
 * leaves: int64 [b, S] leaf tokens (-1 unused). roots: int64 [b].
 * Outputs (all written): parents, tokens, depth int64 [b, n]; valid uint8 [b, n];
 * anc uint8 [b, n, n]; counts int64 [b] (valid nodes, root included). n = 1 + budget.
 * Returns the largest depth, or -1 when out of memory, -2 when H > HMAX. */
int64_t ddtree_build(const float *lq, int64_t b, int64_t H, int64_t V, int64_t budget,
                     const int64_t *limits, const int64_t *leaves, int64_t S, const int64_t *roots,
                     int64_t *parents, int64_t *tokens, int64_t *depth, uint8_t *valid, uint8_t *anc,
                     int64_t *counts) {
    if (H > HMAX) return -2;
    const int64_t n = 1 + budget, k = budget < V ? budget : V;
    int64_t max_depth = 0, status = 0;
    const int64_t nblk = (V + BLK - 1) / BLK;
    double *ybest = malloc(sizeof(double) * (budget > 0 ? budget : 1));
    float *blk = malloc(sizeof(float) * (size_t)(H * nblk > 0 ? H * nblk : 1));
    item_t *heap = malloc(sizeof(item_t) * (2 * n + 2));
    int32_t *tup = malloc(sizeof(int32_t) * n * HMAX);
    double *nscore = malloc(sizeof(double) * n);
    cand_t *cand = NULL;
    int64_t cand_cap = 0;
    if (!ybest || !blk || !heap || !tup || !nscore) {
        status = -1;
        goto done;
    }
    for (int64_t r = 0; r < b; r++) {
        const float *x = lq + r * H * V;
        int64_t *par = parents + r * n, *tok = tokens + r * n, *dep = depth + r * n;
        uint8_t *val = valid + r * n, *an = anc + r * n * n;
        for (int64_t i = 0; i < n; i++) {
            par[i] = 0;
            tok[i] = 0;
            dep[i] = 1;
            val[i] = 0;
        }
        memset(an, 0, (size_t)(n * n));
        for (int64_t i = 0; i < n; i++) {
            an[i * n + i] = 1;
            an[i * n] = 1; /* padded nodes see the root and themselves */
        }
        par[0] = -1;
        dep[0] = 0;
        val[0] = 1;
        tok[0] = roots[r];
        an[0] = 1;
        int64_t cnt = 0;
        int64_t hl = limits[r] < H ? limits[r] : H;
        if (budget < 1 || hl < 1) {
            counts[r] = 1;
            continue;
        }
        const int64_t *leaf = S > 0 ? leaves + r * S : NULL;
        /* (0) best per block of BLK tokens and per depth, the chain, P_j */
        double P[HMAX + 1], m[HMAX];
        int64_t hb = hl;
        P[0] = 0.0;
        for (int64_t j = 0; j < hl; j++) {
            const float *row = x + j * V;
            float *bm = blk + j * nblk;
            float best = -INFINITY;
            for (int64_t g = 0; g < nblk; g++) {
                int64_t lo = g * BLK, hi = lo + BLK < V ? lo + BLK : V;
                int nan;
                float mx = max_and_nan(row + lo, hi - lo, &nan); /* NaN entries never win (nor survive) */
                bm[g] = mx;
                best = mx > best ? mx : best;
            }
            m[j] = (double)best;
            P[j + 1] = P[j] + m[j];
            if (S > 0 && hb == hl) {
                int64_t arg = 0;
                while (arg < V - 1 && !(row[arg] == best || (best == -INFINITY && row[arg] != row[arg])))
                    arg++; /* the lowest-id best token (NaN reads as -inf) */
                for (int64_t s = 0; s < S; s++)
                    if (leaf[s] >= 0 && leaf[s] == arg) {
                        hb = j + 1; /* prefixes through the chain's leaf token do not exist */
                        break;
                    }
            }
        }
        /* (1) the bound: the budget-th largest Y over the block maxima (distinct prefixes);
         * NaN entries read as -inf throughout (block maxima skip them) */
        int nb = 0;
        for (int64_t j = 0; j < hb; j++) {
            double pj = P[j];
            if (nb == budget && !(pj + m[j] > ybest[0])) continue;
            const float *bm = blk + j * nblk;
            for (int64_t g = 0; g < nblk; g++) {
                double y = pj + (double)bm[g];
                if (nb < budget) {
                    if (y == y) min_push(ybest, &nb, y);
                } else if (y > ybest[0]) {
                    ybest[0] = y;
                    min_sift_down(ybest, nb, 0);
                }
            }
        }
        double thr = -INFINITY;
        if (nb == budget && isfinite(ybest[0])) thr = ybest[0] - 1e-6 * (1.0 + fabs(ybest[0]));
        /* (2) candidates per depth: scan only the blocks whose maximum reaches the bound */
        int64_t start[HMAX + 1], len[HMAX], total = 0;
        for (int64_t j = 0; j < hl; j++) {
            const float *row = x + j * V, *bm = blk + j * nblk;
            double pj = P[j];
            start[j] = total;
            if (!(pj + m[j] < thr))
                for (int64_t g = 0; g < nblk; g++) {
                    if (!(pj + (double)bm[g] >= thr)) continue;
                    int64_t lo = g * BLK, hi = lo + BLK < V ? lo + BLK : V;
                    if (total + BLK > cand_cap) {
                        int64_t cap = 2 * (cand_cap + BLK);
                        cand_t *grown = realloc(cand, sizeof(cand_t) * (size_t)cap);
                        if (!grown) {
                            status = -1;
                            goto done;
                        }
                        cand = grown;
                        cand_cap = cap;
                    }
                    for (int64_t t = lo; t < hi; t++) {
                        float v = row[t] == row[t] ? row[t] : -INFINITY;
                        if (pj + (double)v >= thr) {
                            cand[total].lq = v;
                            cand[total].id = (int32_t)t;
                            total++;
                        }
                    }
                }
            qsort(cand + start[j], (size_t)(total - start[j]), sizeof(cand_t), cand_cmp);
            len[j] = total - start[j] < k ? total - start[j] : k;
        }
        /* (3) best-first heap */
        if (len[0] == 0) {
            counts[r] = 1;
            continue;
        }
        int nh = 0;
        nscore[0] = 0.0;
        item_t first = {(double)cand[start[0]].lq, 0, 1, 0};
        heap_push(heap, &nh, first, tup);
        while (nh > 0 && cnt < budget) {
            item_t it = heap_pop(heap, &nh, tup);
            int64_t node = ++cnt, d = it.depth, rk = it.rank, p = it.parent;
            int64_t t = cand[start[d - 1] + rk].id;
            par[node] = p;
            tok[node] = t;
            dep[node] = d;
            nscore[node] = it.score;
            for (int64_t j = 0; j < d - 1; j++) tup[node * HMAX + j] = tup[p * HMAX + j];
            tup[node * HMAX + d - 1] = (int32_t)rk;
            memcpy(an + node * n, an + p * n, (size_t)node); /* the parent's ancestors */
            an[node * n + node] = 1;
            if (d > max_depth) max_depth = d;
            if (rk + 1 < len[d - 1]) {
                item_t sib = {nscore[p] + (double)cand[start[d - 1] + rk + 1].lq, (int32_t)p, (int32_t)d,
                              (int32_t)(rk + 1)};
                heap_push(heap, &nh, sib, tup);
            }
            int is_leaf = 0;
            for (int64_t s = 0; s < S; s++)
                if (leaf[s] >= 0 && leaf[s] == t) is_leaf = 1;
            if (d < hl && !is_leaf && len[d] > 0) {
                item_t ch = {it.score + (double)cand[start[d]].lq, (int32_t)node, (int32_t)(d + 1), 0};
                heap_push(heap, &nh, ch, tup);
            }
        }
        for (int64_t i = 0; i <= cnt; i++) val[i] = 1;
        counts[r] = cnt + 1;
    }
done:
    free(ybest);
    free(blk);
    free(heap);
    free(tup);
    free(nscore);
    free(cand);
    return status < 0 ? status : max_depth;
}

/* Greedy (argmax-follow) verification of b trees on the host: the same decision as
 * sglang_tev.verify._greedy_on_host. logits: float32 [b, N, V] (contiguous); parents, tokens:
 * int64 [b, N]; valid: uint8 [b, N] (a prefix mask). Writes out: int64 [b, 2N + 4] = path (node
 * indices root-first, -1 padded) | path tokens (-1 padded) | accept_len | bonus | valid nodes |
 * the first valid node whose row max is not finite (a NaN, +inf, or only -inf in its row), or -1.
 * One packed pass per row (max and NaN test per block), then a scan of the first block holding the
 * max for its first occurrence (NumPy's argmax: the first maximum, or the first NaN); the walk
 * looks for the child carrying the argmax among later nodes. Returns 0, or -1 when out of memory. */
int64_t greedy_follow(const float *logits, int64_t b, int64_t N, int64_t V, const int64_t *parents,
                      const int64_t *tokens, const uint8_t *valid, int64_t *out) {
    int64_t *top = malloc(sizeof(int64_t) * (size_t)(b * N));
    if (!top) return -1;
    for (int64_t r = 0; r < b; r++) {
        const int64_t *par = parents + r * N, *tok = tokens + r * N;
        int64_t *o = out + r * (2 * N + 4), *tp = top + r * N;
        int64_t count = 0, bad = -1;
        while (count < N && valid[r * N + count]) count++;
        for (int64_t v = 0; v < N; v++) {
            const float *row = logits + (r * N + v) * V;
            /* per block of BLK: its max (packed) and any NaN; then the first block holding the
             * row max, scanned for its first occurrence */
            float mx = -INFINITY;
            int64_t first_blk = 0, nan_blk = -1;
            for (int64_t g = 0; g * BLK < V; g++) {
                int64_t lo = g * BLK, hi = lo + BLK < V ? lo + BLK : V;
                int nan;
                float m = max_and_nan(row + lo, hi - lo, &nan);
                if (nan && nan_blk < 0) nan_blk = g;
                if (g == 0 || m > mx) { /* strictly greater: ties keep the earlier block */
                    mx = m;
                    first_blk = g;
                }
            }
            int64_t arg;
            if (nan_blk >= 0) {
                arg = nan_blk * BLK;
                while (row[arg] == row[arg]) arg++;
                mx = row[arg];
            } else {
                arg = first_blk * BLK;
                while (arg < V - 1 && !(row[arg] == mx)) arg++;
            }
            tp[v] = arg;
            if (bad < 0 && v < count && !isfinite(mx)) bad = v;
        }
        for (int64_t i = 0; i < 2 * N; i++) o[i] = -1;
        int64_t cur = 0, len = 0;
        o[0] = 0;
        o[N] = tok[0];
        for (;;) {
            int64_t want = tp[cur], nxt = -1;
            for (int64_t i = cur + 1; i < count; i++)
                if (par[i] == cur && tok[i] == want) {
                    nxt = i;
                    break;
                }
            if (nxt < 0) break;
            cur = nxt;
            len++;
            o[len] = cur;
            o[N + len] = tok[cur];
        }
        o[2 * N] = len;
        o[2 * N + 1] = tp[cur];
        o[2 * N + 2] = count;
        o[2 * N + 3] = bad;
    }
    free(top);
    return 0;
}

/* The runtime's KV commit for one row on the host: in each of `outer` blocks (layer x K/V x head;
 * block i starts at base + i0 * s0 + i1 * s1 + i2 * s2 bytes for i = (i0, i1, i2) over sizes
 * n0 x n1 x n2), slot src[j] moves to slot dst_start + j, each slot `slot_bytes` long. Paths have
 * src[j] >= dst_start + j, increasing, so copying in order never reads a slot already written. */
void kv_move(char *base, int64_t n0, int64_t n1, int64_t n2, int64_t s0, int64_t s1, int64_t s2,
             int64_t slot_bytes, const int64_t *src, int64_t w, int64_t dst_start) {
    /* src: absolute slots */
    for (int64_t i0 = 0; i0 < n0; i0++)
        for (int64_t i1 = 0; i1 < n1; i1++)
            for (int64_t i2 = 0; i2 < n2; i2++) {
                char *blk = base + i0 * s0 + i1 * s1 + i2 * s2;
                for (int64_t j = 0; j < w; j++)
                    if (src[j] != dst_start + j)
                        memmove(blk + (dst_start + j) * slot_bytes, blk + src[j] * slot_bytes, (size_t)slot_bytes);
            }
}

/* The runtime's kept additive tree mask, one row: `mask` is float32 [n, row_len] (the row's
 * [N, max_len] slice). Columns [done, L) become context (0) and the tree window [L, L + n) gets the
 * ancestor mask (0 where anc[q, j], `low` elsewhere). */
void mask_update(float *mask, int64_t n, int64_t row_len, int64_t done, int64_t L, const uint8_t *anc, float low) {
    for (int64_t q = 0; q < n; q++) {
        float *row = mask + q * row_len;
        for (int64_t c = done; c < L; c++) row[c] = 0.0f;
        for (int64_t j = 0; j < n; j++) row[L + j] = anc[q * n + j] ? 0.0f : low;
    }
}

/* Rows idx[0..w) of a row-major buffer (row_bytes each) copied, in order, into dst. */
void gather_rows(const char *src, int64_t row_bytes, const int64_t *idx, int64_t w, char *dst) {
    for (int64_t j = 0; j < w; j++) memcpy(dst + j * row_bytes, src + idx[j] * row_bytes, (size_t)row_bytes);
}
