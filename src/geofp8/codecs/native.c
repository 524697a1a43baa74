/* GeoFP8's E4M3 and E2M1 kernels for a CPU: one pass over a range of elements, bit for bit what
 * torch's eager ops compute (see geofp8/codecs/native.py, which compiles and loads this file and
 * splits a call's elements across threads).
 *
 * Scale groups come as runs of equal groups (geofp8.codecs.base.group_runs): run r of `runs` is
 * (first element, first group, groups, group length), the runs covering the elements in order.
 * Every kernel works on the elements [lo, hi) only, so that threads can share a call: the
 * E2M1 ones need an even `lo`, the amax one whole groups.
 *
 * Compiled without -ffast-math: divisions and products stay IEEE operations, not reciprocals or
 * fused multiply-adds.
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

enum { PIECE = 1 << 13 }; /* elements a kernel takes at a time: their temporaries stay in L1/L2 */

/* out[i] = the low byte of c[i]: a loop of its own, so that the codes' arithmetic stays in
 * 32-bit lanes and only this loop packs them to bytes. */
static inline void narrow(uint8_t *restrict out, const uint32_t *restrict c, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = (uint8_t)c[i];
}

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* A run's groups k0 <= k < k1 that meet the elements [lo, hi). */
typedef struct {
    int64_t first, g0, size, k0, k1;
} run_t;

static inline run_t run_in(const int64_t *run, int64_t lo, int64_t hi) {
    run_t r = {run[0], run[1], run[3], 0, 0};
    const int64_t end = r.first + run[2] * r.size;
    if (r.size > 0 && end > lo && r.first < hi) {
        r.k0 = lo > r.first ? (lo - r.first) / r.size : 0;
        r.k1 = hi < end ? (hi - r.first + r.size - 1) / r.size : run[2];
    }
    return r;
}

/* `...` (a block) for every group g meeting [lo, hi), with its elements [a, b) there. */
#define FOR_EACH_GROUP(runs, n_runs, lo, hi, ...)                                           \
    for (int64_t q_ = 0; q_ < (n_runs); q_++) {                                             \
        const run_t r_ = run_in((runs) + 4 * q_, (lo), (hi));                               \
        for (int64_t k_ = r_.k0; k_ < r_.k1; k_++) {                                        \
            const int64_t g = r_.g0 + k_, start = r_.first + k_ * r_.size;                  \
            const int64_t a = max64(start, (lo)), b = min64(start + r_.size, (hi));         \
            __VA_ARGS__                                                                     \
        }                                                                                   \
    }

/* ---- E4M3 (FP8's elements) --------------------------------------------------------------
 * encode: codes[i] = e4m3(x[i] / s_g), the IEEE FP32 quotient converted as torch 2.13's c10
 *         converts (round to nearest even; overflow and Inf saturate at 0x7E = 448; NaN is 0x7F),
 *         and, where `error` is not NULL, error[i] = x[i] - value(codes[i]) * s_g (the decode's
 *         product, then the FP32 difference: the rounding error, in the same pass; `error`
 *         may be `x` itself, each element read before its error is written, so neither
 *         pointer is `restrict`);
 * decode: out[i] = value(codes[i]) * s_g (the FP32 product of torch's value of the byte). */

/* c10's fp8e4m3fn_from_fp32_value, branch-free: |q| clamped to 448 (above saturates; NaN
 * becomes 448, then code 0x7F), from 2^-6 up the mantissa rounded to 3 bits in place (the
 * bits of the rounded value), below it a magic add rounds to a multiple of 2^-9. Also, in
 * *value, that code's FP32 value as e4m3_value gives it (NaN for 0x7F). */
static inline uint32_t e4m3_round(float q, float *value) {
    const uint32_t denorm = UINT32_C(141) << 23, top = UINT32_C(0x43E00000);
    uint32_t b = bits_of(q);
    uint32_t mag = b & UINT32_C(0x7FFFFFFF), sign = b & UINT32_C(0x80000000);
    uint32_t nan = mask_if(mag > UINT32_C(0x7F800000));
    uint32_t m = mag < top ? mag : top;
    uint32_t below = bits_of(float_of(m) + float_of(denorm));
    uint32_t rounded = (m + UINT32_C(0x7FFFF) + ((m >> 20) & 1u)) & UINT32_C(0xFFF00000);
    uint32_t subnormal = mask_if(m < (UINT32_C(121) << 23));
    uint32_t v = select(subnormal, bits_of(float_of(below) - float_of(denorm)), rounded);
    *value = float_of(select(nan, UINT32_C(0x7FF00000), v) | sign);
    uint32_t code = select(subnormal, below - denorm, (rounded - (UINT32_C(120) << 23)) >> 20);
    return code | (nan & UINT32_C(0x7F)) | (sign >> 24);
}

static inline uint32_t e4m3_of(float q) {
    float value;
    return e4m3_round(q, &value);
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

void geofp8_e4m3_encode(const float *x, uint8_t *restrict codes, float *error,
                        const float *restrict scales, const int64_t *runs, int64_t n_runs,
                        int64_t lo, int64_t hi) {
    uint32_t c[PIECE];
    FOR_EACH_GROUP(runs, n_runs, lo, hi, {
        const float s = scales[g];
        for (int64_t p = a; p < b; p += PIECE) {
            const int64_t n = min64(PIECE, b - p);
            const float *xp = x + p;
            if (error) {
                float *ep = error + p;
                for (int64_t i = 0; i < n; i++) {
                    float v;
                    c[i] = e4m3_round(xp[i] / s, &v);
                    ep[i] = xp[i] - v * s;
                }
            } else
                for (int64_t i = 0; i < n; i++)
                    c[i] = e4m3_of(xp[i] / s);
            narrow(codes + p, c, n);
        }
    })
}

void geofp8_e4m3_decode(const uint8_t *restrict codes, float *restrict out,
                        const float *restrict scales, const int64_t *runs, int64_t n_runs,
                        int64_t lo, int64_t hi) {
    FOR_EACH_GROUP(runs, n_runs, lo, hi, {
        const float s = scales[g];
        for (int64_t i = a; i < b; i++)
            out[i] = e4m3_value(codes[i]) * s;
    })
}

/* ---- E2M1 (NVFP4's elements), two per byte, element 2i in the low nibble ----------------
 * encode: nibble i = e2m1(x[i] / d_g), rounded as geofp8.codecs.fp4.e2m1_encode rounds:
 *         to nearest, ties to even, above 6 saturating, NaN a signed zero;
 * decode: out[i] = value(nibble i) * scale_g, the FP32 product. */

/* By the bits, as e4m3_of: |v| clamped to 6 (above saturates), below 1 a magic add rounds to a
 * multiple of 0.5, from 1 up the exponent is rebiased by 126 over one mantissa bit; NaN is 0. */
static inline uint32_t e2m1_of(float v) {
    const uint32_t six = UINT32_C(0x40C00000), one = UINT32_C(0x3F800000);
    uint32_t b = bits_of(v);
    uint32_t mag = b & UINT32_C(0x7FFFFFFF);
    uint32_t m = mag < six ? mag : six;
    uint32_t subnormal = bits_of(float_of(m) + 0x1p22f) - bits_of(0x1p22f);
    uint32_t normal = (m - (UINT32_C(126) << 23) + UINT32_C(0x1FFFFF) + ((m >> 22) & 1u)) >> 22;
    uint32_t code = select(mask_if(m < one), subnormal, normal);
    code &= ~mask_if(mag > UINT32_C(0x7F800000));
    return code | ((b >> 28) & 8u);
}

/* 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0): exponent e = m >> 1 over a
 * one-bit mantissa, 0.5 and 0 below (all exact). */
static inline float e2m1_value(uint32_t c) {
    uint32_t m = c & 7u, e = m >> 1, mant = m & 1u;
    uint32_t normal = ((e + 126u) << 23) | (mant << 22);
    uint32_t v = select(mask_if(e == 0), mant * UINT32_C(0x3F000000), normal);
    return float_of(v | ((c & 8u) << 28));
}

/* buf[i - p] = scale of the group holding element i, for the elements [p, q): a group of
 * NVFP4 is 16 elements, too short a loop to divide or multiply in. */
static void spread(float *restrict buf, const float *restrict scale, const int64_t *runs,
                   int64_t n_runs, int64_t p, int64_t q) {
    FOR_EACH_GROUP(runs, n_runs, p, q, {
        const float v = scale[g];
        for (int64_t i = a; i < b; i++)
            buf[i - p] = v;
    })
}

/* The divisor of a group is its scale, or 1 where the scale is not positive (0: an all-zero
 * block; NaN: a non-finite one), as NVFP4Codec divides; `error` (or NULL): x - value * scale,
 * as the decode's product and the FP32 difference; it may be `x` itself (each element is read
 * before its error is written). */
void geofp8_e2m1_encode(const float *x, uint8_t *restrict packed, float *error,
                        const float *restrict scale, const int64_t *runs, int64_t n_runs,
                        int64_t lo, int64_t hi) {
    float d[PIECE];
    uint32_t codes[PIECE]; /* in 32-bit lanes (see narrow()), packed to nibbles below */
    for (int64_t p = lo; p < hi; p += PIECE) {
        const int64_t n = min64(PIECE, hi - p), pairs = n / 2;
        spread(d, scale, runs, n_runs, p, p + n);
        for (int64_t i = 0; i < n; i++) {
            const float di = float_of(select(mask_if(d[i] > 0.0f), bits_of(d[i]), bits_of(1.0f)));
            codes[i] = e2m1_of(x[p + i] / di);
        }
        if (error)
            for (int64_t i = 0; i < n; i++)
                error[p + i] = x[p + i] - e2m1_value(codes[i]) * d[i];
        uint8_t *out = packed + p / 2;
        for (int64_t k = 0; k < pairs; k++)
            out[k] = (uint8_t)(codes[2 * k] | (codes[2 * k + 1] << 4));
        if (n & 1)
            out[pairs] = codes[n - 1];
    }
}

void geofp8_e2m1_decode(const uint8_t *restrict packed, float *restrict out,
                        const float *restrict scale, const int64_t *runs, int64_t n_runs,
                        int64_t lo, int64_t hi) {
    float sc[PIECE];
    uint32_t c[PIECE]; /* the nibbles, one per element */
    for (int64_t p = lo; p < hi; p += PIECE) {
        const int64_t n = min64(PIECE, hi - p), pairs = n / 2;
        const uint8_t *in = packed + p / 2;
        float *o = out + p;
        spread(sc, scale, runs, n_runs, p, p + n);
        for (int64_t k = 0; k < pairs; k++) {
            c[2 * k] = in[k] & 15u;
            c[2 * k + 1] = in[k] >> 4;
        }
        if (n & 1)
            c[n - 1] = in[pairs] & 15u;
        for (int64_t i = 0; i < n; i++)
            o[i] = e2m1_value(c[i]) * sc[i];
    }
}

/* amax[g] = max |x_i| over group g, +Inf for a group holding NaN or +-Inf (`finite_only`:
 * non-finite values count as 0 instead). On the magnitudes' bit patterns, whose integer order
 * is the float order with every NaN above +Inf, so the maximum vectorizes without fast-math. */
void geofp8_runs_amax(const float *restrict x, float *restrict amax, const int64_t *runs,
                      int64_t n_runs, int64_t finite_only, int64_t lo, int64_t hi) {
    const uint32_t inf = UINT32_C(0x7F800000), below = finite_only ? inf : UINT32_MAX;
    FOR_EACH_GROUP(runs, n_runs, lo, hi, {
        uint32_t m = 0;
        for (int64_t i = a; i < b; i++) {
            uint32_t v = bits_of(x[i]) & UINT32_C(0x7FFFFFFF);
            v &= mask_if(v < below);
            m = v > m ? v : m;
        }
        amax[g] = float_of(m < inf ? m : inf);
    })
}

/* ---- NVFP4's block scales ----------------------------------------------------------------
 * Block g of segment j (a run's group is a segment, its elements the segment's blocks), with
 * its amax (+Inf: non-finite) and the segment's FP32 scale s_j:
 *   r = min(amax_g / (6 s_j), 448), code_g = the E4M3 code of r rounded up (to nearest, then
 *   one code up where its value is below r), 0x7F (NaN) for a non-finite block;
 *   scale_g = value(code_g) * s_j, as geofp8.codecs.fp4.NVFP4Codec computes them in torch. */
void geofp8_nvfp4_scales(const float *restrict amax, uint8_t *restrict code,
                         float *restrict scale, const float *restrict s, const int64_t *runs,
                         int64_t n_runs, int64_t lo, int64_t hi) {
    FOR_EACH_GROUP(runs, n_runs, lo, hi, {
        const float sj = s[g], t = 6.0f * sj;
        for (int64_t i = a; i < b; i++) {
            const float q = amax[i] / t;
            const float r = float_of(select(mask_if(q > 448.0f), bits_of(448.0f), bits_of(q)));
            uint32_t c = e4m3_of(r);
            c += (uint32_t)(e4m3_value((uint8_t)c) < r);
            c = select(mask_if(bits_of(amax[i]) == UINT32_C(0x7F800000)), UINT32_C(0x7F), c);
            code[i] = (uint8_t)c;
            scale[i] = e4m3_value((uint8_t)c) * sj;
        }
    })
}

/* Stochastic rounding's uniforms (codecs/uniforms.py), elements [lo, hi) of a segment with
 * key halves (k_lo, k_hi): u_j = floor(h_j / 2^8) * 2^-24, h_j = mix32(mix32(j + k_lo) ^ k_hi),
 * mix32 the lowbias32 hash, all modulo 2^32. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= UINT32_C(0x7FEB352D);
    x ^= x >> 15;
    x *= UINT32_C(0x846CA68B);
    return x ^ (x >> 16);
}

void geofp8_hash_uniforms(float *restrict u, int64_t k_lo, int64_t k_hi, int64_t lo,
                          int64_t hi) {
    for (int64_t j = lo; j < hi; j++) {
        uint32_t h = mix32(mix32((uint32_t)j + (uint32_t)k_lo) ^ (uint32_t)k_hi);
        u[j] = (float)(h >> 8) * 0x1p-24f;
    }
}
