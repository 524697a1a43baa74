/* GeoFP8's E4M3 kernels for a CPU: one pass over a run of scale groups, bit for bit what
 * torch's eager ops compute (see geofp8/codecs/native.py, which compiles and loads this file).
 *
 * encode: codes[i] = e4m3(x[i] / s_g), the IEEE FP32 quotient converted as torch 2.13's c10
 *         converts (round to nearest even; overflow and Inf saturate at 0x7E = 448; NaN is 0x7F);
 * decode: out[i] = value(codes[i]) * s_g (the FP32 product of torch's value of the byte), or
 *         minus[i] - value(codes[i]) * s_g when `minus` is given.
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
static inline float value_of(uint8_t c) {
    uint32_t m = c & UINT32_C(0x7F);
    uint32_t normal = (m << 20) + (UINT32_C(120) << 23);
    uint32_t subnormal = bits_of((float)(int32_t)(m & 7u) * 0x1p-9f);
    uint32_t v = select(mask_if((m >> 3) == 0), subnormal, normal);
    v = select(mask_if(m == UINT32_C(0x7F)), UINT32_C(0x7FF00000), v);
    return float_of(v | ((uint32_t)(c & 0x80u) << 24));
}

void geofp8_e4m3_decode(const uint8_t *codes, float *out, const int64_t *lengths,
                        const float *scales, int64_t groups, const float *minus) {
    for (int64_t g = 0; g < groups; g++) {
        const float s = scales[g];
        const int64_t n = lengths[g];
        if (minus) {
            for (int64_t i = 0; i < n; i++)
                out[i] = minus[i] - value_of(codes[i]) * s;
            minus += n;
        } else {
            for (int64_t i = 0; i < n; i++)
                out[i] = value_of(codes[i]) * s;
        }
        codes += n;
        out += n;
    }
}
