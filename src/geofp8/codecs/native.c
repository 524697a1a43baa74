/* GeoFP8's E4M3 and E2M1 kernels for a CPU: one pass over a run of scale groups, bit for bit what
 * torch's eager ops compute (see geofp8/codecs/native.py, which compiles and loads this file).
 *
 * encode: codes[i] = e4m3(x[i] / s_g), the IEEE FP32 quotient converted as torch 2.13's c10
 *         converts (round to nearest even; overflow and Inf saturate at 0x7E = 448; NaN is 0x7F);
 * decode: out[i] = value(codes[i]) * s_g (the FP32 product of torch's value of the byte).
 *
 * Group g holds lengths[g] consecutive elements. Compiled without -ffast-math: the division and
 * the product must stay IEEE operations, not a reciprocal or a fused multiply-add.
 */
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline float float_of(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* All ones where `c` holds, else zero: selects without branches, so that loops vectorize. */
static inline uint32_t mask_if(int c) { return UINT32_C(0) - (uint32_t)c; }

static inline uint32_t select(uint32_t mask, uint32_t a, uint32_t b) {
    return (a & mask) | (b & ~mask);
}

/* c10's fp8e4m3fn_from_fp32_value, branch-free. */
static inline uint8_t e4m3_of(float f) {
    const uint32_t denorm = UINT32_C(141) << 23; /* below 2^-6: a magic add rounds */
    uint32_t b = bits_of(f);
    uint32_t sign = (b >> 24) & UINT32_C(0x80);
    uint32_t mag = b & UINT32_C(0x7FFFFFFF);
    uint32_t subnormal = bits_of(float_of(mag) + float_of(denorm)) - denorm;
    uint32_t normal = (mag + (UINT32_C(0) - (UINT32_C(120) << 23)) + UINT32_C(0x7FFFF) +
                       ((mag >> 20) & 1u)) >> 20;
    uint32_t code = select(mask_if(mag < (UINT32_C(121) << 23)), subnormal, normal);
    code = select(mask_if(code > UINT32_C(0x7E)), UINT32_C(0x7E), code);
    code = select(mask_if(mag > UINT32_C(0x7F800000)), UINT32_C(0x7F), code);
    return (uint8_t)(code | sign);
}

void geofp8_e4m3_encode(const float *x, uint8_t *codes, const int64_t *lengths,
                        const float *scales, int64_t groups) {
    for (int64_t g = 0; g < groups; g++) {
        const float s = scales[g];
        const int64_t n = lengths[g];
        for (int64_t i = 0; i < n; i++)
            codes[i] = e4m3_of(x[i] / s);
        x += n;
        codes += n;
    }
}

/* torch's FP32 value of an E4M3 byte, branch-free: a normal code's bits under an exponent
 * rebiased by 120, a subnormal one (exponent 0) is its mantissa times 2^-9 (both exact),
 * S.1111.111 is NaN (0x7FF00000 and the sign, the bits c10 gives). */
static inline float e4m3_value(uint8_t c) {
    uint32_t m = c & UINT32_C(0x7F);
    uint32_t normal = (m << 20) + (UINT32_C(120) << 23);
    uint32_t subnormal = bits_of((float)(int32_t)(m & 7u) * 0x1p-9f);
    uint32_t v = select(mask_if((m >> 3) == 0), subnormal, normal);
    v = select(mask_if(m == UINT32_C(0x7F)), UINT32_C(0x7FF00000), v);
    return float_of(v | ((uint32_t)(c & 0x80u) << 24));
}

void geofp8_e4m3_decode(const uint8_t *codes, float *out, const int64_t *lengths,
                        const float *scales, int64_t groups) {
    for (int64_t g = 0; g < groups; g++) {
        const float s = scales[g];
        const int64_t n = lengths[g];
        for (int64_t i = 0; i < n; i++)
            out[i] = e4m3_value(codes[i]) * s;
        codes += n;
        out += n;
    }
}

/* ---- E2M1 (NVFP4's elements) ------------------------------------------------------------
 * A run r of `runs` is (first element, first group, groups, group length): a shard's groups
 * as runs of equal lengths (geofp8.codecs.fp4.block_runs), covering its elements in order.
 *
 * encode: codes[i] = e2m1(x[i] / divisor_g), one code per byte, as geofp8.codecs.fp4.e2m1_encode
 *         rounds: to nearest, ties to even, above 6 saturating, NaN a signed zero;
 * pack:   two codes per byte, element 2i in the low nibble (an odd count: a last byte alone);
 * decode: out[i] = value(nibble i of packed) * scale_g, the FP32 product;
 * amax:   every group's largest magnitude. */

static inline uint8_t e2m1_of(float v) {
    uint32_t b = bits_of(v);
    float a = float_of(b & UINT32_C(0x7FFFFFFF));
    uint32_t code = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) +
                    (uint32_t)(a >= 1.75f) + (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) +
                    (uint32_t)(a > 5.0f);
    return (uint8_t)(code | ((b >> 28) & 8u));
}

/* 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0): exponent e = m >> 1 over a
 * one-bit mantissa, 0.5 and 0 below (all exact). */
static inline float e2m1_value(uint32_t c) {
    uint32_t m = c & 7u, e = m >> 1, mant = m & 1u;
    uint32_t normal = ((e + 126u) << 23) | (mant << 22);
    uint32_t v = select(mask_if(e == 0), mant * UINT32_C(0x3F000000), normal);
    return float_of(v | ((c & 8u) << 28));
}

void geofp8_e2m1_encode(const float *x, uint8_t *codes, const float *divisor,
                        const int64_t *runs, int64_t n_runs) {
    for (int64_t r = 0; r < n_runs; r++) {
        const int64_t lo = runs[4 * r], g0 = runs[4 * r + 1];
        const int64_t count = runs[4 * r + 2], size = runs[4 * r + 3];
        for (int64_t k = 0; k < count; k++) {
            const float d = divisor[g0 + k];
            const float *xg = x + lo + k * size;
            uint8_t *cg = codes + lo + k * size;
            for (int64_t j = 0; j < size; j++)
                cg[j] = e2m1_of(xg[j] / d);
        }
    }
}

void geofp8_pack_nibbles(const uint8_t *codes, uint8_t *out, int64_t n) {
    const int64_t pairs = n / 2;
    for (int64_t i = 0; i < pairs; i++)
        out[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
    if (n & 1)
        out[pairs] = codes[n - 1];
}

/* amax[g] = max |x_i| over group g; NaN (some NaN pattern) for a group holding a NaN. On
 * the magnitudes' bit patterns, whose integer order is the float order with every NaN
 * above +Inf, so the maximum vectorizes without fast-math. */
void geofp8_runs_amax(const float *restrict x, float *restrict amax, const int64_t *runs,
                      int64_t n_runs) {
    for (int64_t r = 0; r < n_runs; r++) {
        const int64_t lo = runs[4 * r], g0 = runs[4 * r + 1];
        const int64_t count = runs[4 * r + 2], size = runs[4 * r + 3];
        for (int64_t k = 0; k < count; k++) {
            const float *xg = x + lo + k * size;
            uint32_t m = 0;
            for (int64_t j = 0; j < size; j++) {
                uint32_t a = bits_of(xg[j]) & UINT32_C(0x7FFFFFFF);
                m = a > m ? a : m;
            }
            amax[g0 + k] = float_of(m);
        }
    }
}

/* Two passes over the shard, each a long vectorized loop: every nibble's value, then every
 * group's product (a group is short: 16 elements for NVFP4). */
void geofp8_e2m1_decode(const uint8_t *restrict packed, float *restrict out,
                        const float *restrict scale, const int64_t *runs, int64_t n_runs) {
    if (n_runs == 0)
        return;
    const int64_t n = runs[4 * (n_runs - 1)] + runs[4 * (n_runs - 1) + 2] * runs[4 * (n_runs - 1) + 3];
    const int64_t pairs = n / 2;
    for (int64_t k = 0; k < pairs; k++) {
        out[2 * k] = e2m1_value(packed[k] & 15u);
        out[2 * k + 1] = e2m1_value(packed[k] >> 4);
    }
    if (n & 1)
        out[n - 1] = e2m1_value(packed[pairs] & 15u);
    for (int64_t r = 0; r < n_runs; r++) {
        const int64_t lo = runs[4 * r], g0 = runs[4 * r + 1];
        const int64_t count = runs[4 * r + 2], size = runs[4 * r + 3];
        for (int64_t k = 0; k < count; k++) {
            const float s = scale[g0 + k];
            float *o = out + lo + k * size;
            for (int64_t j = 0; j < size; j++)
                o[j] *= s;
        }
    }
}
