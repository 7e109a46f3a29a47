/* A step's decoder layers in one call: the Llama-family layer (models/llama.py) over the
 * kernels of linear.c, pointwise.c and attention.c, reached through function pointers taken
 * from those libraries. The same kernels in the same order as the per-op Python path, so the
 * same bits; what goes is the Python between ~10 kernel calls per layer (ctypes, views,
 * allocation: 2-4 ms per decode step of the bundled model).
 *
 * Per layer l, for N tokens with hidden size H:
 *   x, res = add_rmsnorm(h, res)          (layer 0: res = h)
 *   qkv = x Wqkv^T (+ b)                  [N, (heads + 2 kv_heads) D]
 *   rope_(q and k heads of qkv)           in place
 *   o = attention(q, k, v)                stores k, v in slots first; [N, heads D]
 *   x, res = add_rmsnorm(o Wo^T, res)
 *   h = silu_mul(x Wgu^T) Wdown^T         gate-up [N, 2I], then [N, I], then [N, H]; where
 *                                         linear_silu takes it (AMX), [N, I] in one pass
 * Under tensor parallelism (a rank's share of heads and of I) o Wo^T and the down projection
 * are partial sums, added over the ranks by `allreduce` before they are used.
 */
#include <stdint.h>
#include <stdlib.h>

typedef void (*linear_fn)(const void *, int64_t, int64_t, int64_t, const void *, int64_t, const void *, void *, int64_t, int64_t);
typedef void (*norm_fn)(const void *, int64_t, void *, int64_t, int, const void *, void *, int64_t, int64_t, int64_t, float, int, int64_t);
typedef void (*rope_fn)(void *, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t *, const float *, const float *, int, int64_t);
typedef void (*silu_fn)(const void *, int64_t, void *, int64_t, int64_t, int64_t, int, int64_t);
typedef int (*linear_silu_fn)(const void *, int64_t, int64_t, int64_t, const void *, int64_t, const void *, void *, int64_t, int64_t);
typedef int (*allreduce_fn)(void *, void *, int64_t);
typedef int (*attn_fn)(const void *, int64_t, int64_t, int64_t, int64_t, int64_t, void *, void *, int64_t, const void *, const void *,
                       int64_t, const int64_t *, const int32_t *, int64_t, const int32_t *, const int64_t *, int64_t, float, void *, int,
                       int64_t);

/* The model, fixed at load (ops.py builds it). Per layer, `weights` holds 12 pointers:
 * packed Wqkv, bqkv, packed Wo, bo, packed Wgu, bgu, packed Wdown, bdown (biases may be NULL),
 * input norm weight, post-attention norm weight, the layer's K pool, its V pool. */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, kv_head_stride, block_size, bf, nthreads;
    float eps, scale;
    const void *const *weights;
    const float *cos, *sin;
    linear_fn linear;
    norm_fn add_rmsnorm;
    rope_fn rope;
    silu_fn silu_mul;
    attn_fn attention;
    allreduce_fn allreduce; /* tensor parallel: the sum over ranks of a row-parallel layer's output, in place; NULL alone */
    void *allreduce_ctx;
    linear_silu_fn linear_silu; /* the gate-up projection and silu_mul in one pass (linear.c's linear_silu_bf16), or NULL */
} decoder_model;

/* h: [N, H] the embeddings in, the last layer's output out; res: [N, H] the residual out.
 * positions, slots: [N] int64; token_seq: [N] int32; block_tables: [S, max_blocks] int32.
 * Returns 0; -1 when the attention kernel refuses the head layout; -2 when out of memory; -3
 * when an all-reduce timed out (a tensor-parallel peer died or hung). */
int decoder_layers(const decoder_model *m, void *h, void *res, int64_t N, const int64_t *positions, const int64_t *slots,
                   const int32_t *token_seq, const int32_t *block_tables, int64_t max_blocks) {
    const int64_t H = m->hidden, D = m->head_dim, I = m->intermediate, es = m->bf ? 2 : 4;
    const int64_t QKV = (m->heads + 2 * m->kv_heads) * D, O = m->heads * D;
    /* 64-byte aligned, as torch's tensors are: malloc's 16 would start every row of these
     * activations mid cache line, and each vector and tile load of them would touch two */
    char *mem = 0;
    if (posix_memalign((void **)&mem, 64, (size_t)(N * (H + QKV + O + H + 2 * I + I) * es))) return -2;
    char *x = mem, *qkv = x + N * H * es, *o = qkv + N * QKV * es, *t = o + N * O * es, *gu = t + N * H * es, *act = gu + N * 2 * I * es;
    int rc = 0;
    for (int64_t l = 0; l < m->layers && rc == 0; l++) {
        const void *const *w = m->weights + 12 * l;
        m->add_rmsnorm(h, H, res, H, l > 0, w[8], x, H, N, H, m->eps, (int)m->bf, m->nthreads);
        m->linear(x, N, H, H, w[0], QKV, w[1], qkv, QKV, m->nthreads);
        m->rope(qkv, N, m->heads + m->kv_heads, D, QKV, D, positions, m->cos, m->sin, (int)m->bf, m->nthreads);
        rc = m->attention(qkv, N, QKV, m->heads, m->kv_heads, D, (void *)w[10], (void *)w[11], m->kv_head_stride, qkv + O * es,
                          qkv + (O + m->kv_heads * D) * es, QKV, slots, block_tables, max_blocks, token_seq, positions, m->block_size,
                          m->scale, o, (int)m->bf, m->nthreads);
        m->linear(o, N, O, O, w[2], H, w[3], t, H, m->nthreads);
        if (m->allreduce && m->allreduce(m->allreduce_ctx, t, N * H)) rc = -3;
        m->add_rmsnorm(t, H, res, H, 1, w[9], x, H, N, H, m->eps, (int)m->bf, m->nthreads);
        if (!m->linear_silu || m->linear_silu(x, N, H, H, w[4], I, w[5], act, I, m->nthreads) != 0) {
            m->linear(x, N, H, H, w[4], 2 * I, w[5], gu, 2 * I, m->nthreads);
            m->silu_mul(gu, 2 * I, act, I, N, I, (int)m->bf, m->nthreads);
        }
        m->linear(act, N, I, I, w[6], H, w[7], h, H, m->nthreads);
        if (rc == 0 && m->allreduce && m->allreduce(m->allreduce_ctx, h, N * H)) rc = -3;
    }
    free(mem);
    return rc;
}
