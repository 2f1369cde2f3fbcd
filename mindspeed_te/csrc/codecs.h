/* The scalar codecs the kernel files share: the input dtype and output format codes the Python side passes, float32 bit
 * views, the float32 / bfloat16 input's elements, the saturating round-to-nearest-even encode to E4M3 / E5M2, HiF8 by
 * its table, the float32 -> bfloat16 rounding and current scaling's scale rule. Static inline: they sit in the kernels'
 * hot loops, and each file inlines its own copy. codecs_x86.h and the kernels' vector loops give the same results bit
 * for bit. */
#ifndef MINDSPEED_TE_CODECS_H
#define MINDSPEED_TE_CODECS_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { IN_F32 = 0, IN_BF16 = 1 };
enum { OUT_E4M3 = 0, OUT_E5M2 = 1, OUT_HIF8 = 2, OUT_E2M1 = 3 };

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Element i of an input of float32 or bfloat16 (in_dtype), as float32; and |element i| as float32 bits (above
 * 0x7F800000 for NaN), which order as the magnitudes do. */
static inline float input_value(const void *in, int in_dtype, int64_t i) {
    return in_dtype == IN_F32 ? ((const float *)in)[i] : float_of((uint32_t)((const uint16_t *)in)[i] << 16);
}
static inline uint32_t input_abs_bits(const void *in, int in_dtype, int64_t i) {
    if (in_dtype == IN_F32) return ((const uint32_t *)in)[i] & 0x7FFFFFFFu;
    return ((uint32_t)(((const uint16_t *)in)[i] & 0x7FFFu)) << 16;
}

/* Saturating round-to-nearest-even of q to an OCP 8-bit float with `mbits` mantissa bits whose smallest
 * normal has float32 exponent field `min_normal` and whose largest finite value has float32 bits `max_bits`.
 *
 * One float addition does the rounding: adding 2^(e + 23 - mbits), with e the binade of |q| (at least the
 * smallest normal one), leaves exactly the mantissa bits the format keeps, rounded to nearest even, in
 * the sum's low bits, subnormals included. The code is then the binade's code plus that count.
 * Branch-free so that it vectorizes. A NaN becomes the next value past max_bits (its `nan_bit` set),
 * which is the format's NaN code 0x7F. */
static inline uint8_t to_fp8(float q, int32_t mbits, int32_t min_normal, int32_t max_bits, int32_t nan_bit) {
    uint32_t u = bits_of(q);
    int32_t a = (int32_t)(u & 0x7FFFFFFFu);
    int32_t nan = -(int32_t)(a > 0x7F800000) & nan_bit;
    a = (a < max_bits ? a : max_bits) | nan;
    int32_t e = a >> 23;
    e = e > min_normal ? e : min_normal;
    int32_t magic = (e + 23 - mbits) << 23;
    int32_t count = (int32_t)bits_of(float_of((uint32_t)a) + float_of((uint32_t)magic)) - magic;
    return (uint8_t)((((e - min_normal) << mbits) + count) | (int32_t)((u >> 24) & 0x80u));
}

/* E4M3: 3 mantissa bits, smallest normal 2^-6, max 448, NaN 0x7F (no Inf). */
static inline uint8_t to_e4m3(float q) { return to_fp8(q, 3, 121, 0x43E00000, 0x00100000); }
/* E5M2: 2 mantissa bits, smallest normal 2^-14, max 57344, NaN 0x7F. */
static inline uint8_t to_e5m2(float q) { return to_fp8(q, 2, 113, 0x47600000, 0x00800000); }

/* E2M1 (FP4), one code per byte in the low nibble: to_fp8's rounding with 1 mantissa bit, smallest normal 1
 * (float32 exponent field 127) and max 6 (0x40C00000), saturating; the sign in bit 3. NaN, which E2M1 cannot
 * hold, becomes +6 (code 7), as mindspeed_te.fp4.e2m1_encode has it. */
static inline uint8_t to_e2m1(float q) {
    const uint32_t u = bits_of(q);
    int32_t a = (int32_t)(u & 0x7FFFFFFFu);
    const int nan = a > 0x7F800000;
    a = a < 0x40C00000 ? a : 0x40C00000;
    const int32_t e = (a >> 23) > 127 ? (a >> 23) : 127;
    const int32_t magic = (e + 22) << 23;
    const int32_t count = (int32_t)bits_of(float_of((uint32_t)a) + float_of((uint32_t)magic)) - magic;
    const uint8_t code = (uint8_t)((((e - 127) << 1) + count) | (int32_t)((u >> 28) & 0x8u));
    return nan ? 0x7 : code;
}

/* HiF8: the code of q from the 65536-entry table, indexed by q's top 16 bits. */
static inline uint8_t to_hif8(const uint8_t *restrict table, float q) { return table[bits_of(q) >> 16]; }

/* bfloat16 bits of x, rounded to nearest even; NaN as 0x7FC0 (torch's float32 -> bfloat16 cast). */
static inline uint16_t bf16_bits(float x) {
    const uint32_t u = bits_of(x);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

/* Current scaling's decode scale from an amax, as mindspeed_te.scaling.current_scale_inv computes it with
 * tensor ops (float32 throughout): max(amax, eps) / fp8_max, at least 1/FLT_MAX, and 1 for an amax that is
 * 0, Inf or NaN; with pow2, the reciprocal of the scale fp8_max / max(amax, eps) (FLT_MAX at most) rounded
 * down to a power of two. One call instead of half a dozen tensor ops on one element. */
static inline float current_scale_inv(float amax, float fp8_max, float eps, int pow2) {
    if (eps > 0 && amax < eps) amax = eps;
    if (!(amax > 0) || amax == INFINITY) return 1.0f;
    if (pow2) {
        float scale = fp8_max / amax;
        if (scale > FLT_MAX) scale = FLT_MAX;
        return 1.0f / float_of(bits_of(scale) & 0x7F800000u);
    }
    float scale_inv = amax / fp8_max;
    const float min_scale_inv = (float)(1.0 / FLT_MAX);
    return scale_inv < min_scale_inv ? min_scale_inv : scale_inv;
}

#endif
