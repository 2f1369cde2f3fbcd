/* The GEMM epilogue (gemm_epilogue): out = cast((acc * scale_b) * scale_a + bias[c]).
 *
 * The float32 sum of a per-tensor scaled GEMM dequantized in the order aclnnQuantMatmulV5 documents (x2's
 * scale, then x1's), the bias added in float32, and the result written as float32, as bfloat16 (round to
 * nearest even, NaN as 0x7FC0, as torch's scalar cast) or added to a float32 `out`: one pass where torch
 * makes one per op. Built with -ffp-contract=off, so no multiply and add are fused into one rounding. */
#include "kernels.h"

#include "codecs.h"
#include "codecs_x86.h"

#include <stdint.h>

enum { EPI_F32 = 0, EPI_BF16 = 1, EPI_ACCUMULATE = 2 };
typedef struct {
    const float *acc, *bias;
    void *out;
    int64_t cols, row_begin, row_end;
    float scale_b, scale_a;
    int kind;
} EpilogueJob;

#if defined(__x86_64__)
/* The bfloat16 epilogue of one row, 16 columns at a time (the compiler's own vectors of the loop below run at
 * half this speed); returns where the scalar loop takes over. */
AVX512 static int64_t epilogue_bf16_avx512(const float *acc, const float *bias, uint16_t *out, int64_t cols,
                                           float sb, float sa) {
    const __m512 vb = _mm512_set1_ps(sb), va = _mm512_set1_ps(sa);
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(acc + c), vb), va);
        if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + c));
        _mm256_storeu_si256((__m256i *)(out + c), bf16_bits16(y));
    }
    return c;
}
#endif

#if defined(__x86_64__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void epilogue_rows(EpilogueJob *j) {
    const int64_t cols = j->cols;
    const float sb = j->scale_b, sa = j->scale_a;
#if defined(__x86_64__)
    const int avx512 = simd_level() >= SIMD_AVX512;
#endif
    for (int64_t r = j->row_begin; r < j->row_end; ++r) {
        const float *restrict acc = j->acc + r * cols;
        const float *restrict bias = j->bias;
        if (j->kind == EPI_ACCUMULATE) {
            float *restrict out = (float *)j->out + r * cols;
            for (int64_t c = 0; c < cols; ++c) out[c] += acc[c] * sb * sa;
        } else if (j->kind == EPI_F32) { /* may write over acc: no restrict here */
            const float *in = j->acc + r * cols;
            float *out = (float *)j->out + r * cols;
            if (bias) for (int64_t c = 0; c < cols; ++c) out[c] = in[c] * sb * sa + bias[c];
            else for (int64_t c = 0; c < cols; ++c) out[c] = in[c] * sb * sa;
        } else {
            uint16_t *restrict out = (uint16_t *)j->out + r * cols;
            int64_t c = 0;
#if defined(__x86_64__)
            if (avx512) c = epilogue_bf16_avx512(acc, bias, out, cols, sb, sa);
#endif
            if (bias) for (; c < cols; ++c) out[c] = bf16_bits(acc[c] * sb * sa + bias[c]);
            else for (; c < cols; ++c) out[c] = bf16_bits(acc[c] * sb * sa);
        }
    }
}

static void *run_epilogue(void *arg) { epilogue_rows((EpilogueJob *)arg); return NULL; }

PyObject *py_gemm_epilogue(PyObject *self, PyObject *args) {
    unsigned long long acc, bias, out, scale_b, scale_a;
    long long m, n;
    int kind, threads;
    if (!PyArg_ParseTuple(args, "KLLKKKKii", &acc, &m, &n, &scale_b, &scale_a, &bias, &out, &kind, &threads))
        return NULL;
    if (m < 0 || n < 0 || kind < EPI_F32 || kind > EPI_ACCUMULATE || (kind == EPI_ACCUMULATE && bias)) {
        PyErr_SetString(PyExc_ValueError, "gemm_epilogue: bad shape or kind, or a bias with accumulation");
        return NULL;
    }
    const float sb = scale_b ? *(const float *)scale_b : 1.0f, sa = scale_a ? *(const float *)scale_a : 1.0f;
    const int64_t t = row_threads(m, m * n, threads);
    EpilogueJob jobs[MAX_THREADS];
    Py_BEGIN_ALLOW_THREADS
    const int64_t step = (m + t - 1) / t;
    for (int64_t i = 0; i < t; ++i)
        jobs[i] = (EpilogueJob){(const float *)acc, (const float *)bias, (void *)out, n,
                                job_start(i, step, m), job_start(i + 1, step, m), sb, sa, kind};
    run_jobs(run_epilogue, jobs, sizeof(EpilogueJob), t);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
