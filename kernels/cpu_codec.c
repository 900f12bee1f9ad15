/* FP8 casts for CPU emulation, fused: one read of the input, the FP8 codes and their float32 values written
 * in the same pass (the float32 values are what a CPU GEMM multiplies).
 *
 * Eager PyTorch needs five to ten passes over a tensor for the same result (scale, cast, decode, block amax,
 * block scale, dequantize), and its float8 conversion runs element by element. Every function here computes
 * exactly the bits of the pure-torch code in fp8_lightning/quantize.py (tests/core/test_cpu_codec.py compares
 * them on every class of input): the conversion is round to nearest even with saturation to the format's
 * largest finite value, and NaN stays NaN (code 0x7F with the input's sign), as torch's CPU cast after the
 * library's clamp. No -ffast-math: every float operation is the IEEE one torch performs.
 *
 * Inputs are float32 (dtype 0) or bfloat16 (dtype 1), contiguous. Formats: 0 = E4M3, 1 = E5M2. Every function
 * works on a range [begin, end) of its outer dimension, so that the caller can split a tensor across threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int shift;           /* 23 - mantissa bits: float32 bits dropped by the rounding */
    uint32_t rebias;     /* (127 - bias) << 23: float32 exponent field -> format exponent field */
    uint32_t min_normal; /* float32 bits of the smallest normal of the format */
    float denorm_magic;  /* adding it rounds a subnormal to the format's grid: its ulp is the subnormal step */
    uint32_t max_code;   /* largest finite magnitude code */
    float max_value;
    int emax;            /* exponent of the largest binade (MX: shared_exp = floor(log2 amax) - emax) */
    float subnormal_step;  /* value of the mantissa's last bit in the subnormal binade */
    uint32_t inf_code;     /* magnitude code of infinity (none: 0x100) */
    uint32_t nan_code;     /* smallest magnitude code of NaN */
} Format;

static const Format FORMATS[2] = {
    {20, 120u << 23, 121u << 23, 16384.0f, 0x7E, 448.0f, 8, 0x1p-9f, 0x100, 0x7F},  /* E4M3: bias 7, 3 mantissa bits */
    {21, 112u << 23, 113u << 23, 128.0f, 0x7B, 57344.0f, 15, 0x1p-16f, 0x7C, 0x7D}, /* E5M2: bias 15, 2 */
};

#define INLINE static inline __attribute__((always_inline))

INLINE uint32_t bits_of(float v) { uint32_t b; memcpy(&b, &v, 4); return b; }
INLINE float float_of(uint32_t b) { float v; memcpy(&v, &b, 4); return v; }

INLINE float load(const void *x, int dtype, int64_t i) {
    if (dtype == 1) return float_of((uint32_t)((const uint16_t *)x)[i] << 16);
    return ((const float *)x)[i];
}

/* |v|'s bits: as unsigned integers they order like the magnitudes, and every NaN is above infinity
 * (0x7F800000), so an integer max is an amax that propagates NaN, and it vectorizes. */
INLINE uint32_t magnitude_bits(float v) { return bits_of(v) & 0x7FFFFFFFu; }

/* Instantiates CALL(dtype, format) with both as constants, so that the loops inside compile without branches
 * (and vectorize). */
#define SPECIALIZE(dtype, format, CALL) \
    do { \
        if (dtype == 0 && format == 0) CALL(0, 0); \
        else if (dtype == 0) CALL(0, 1); \
        else if (format == 0) CALL(1, 0); \
        else CALL(1, 1); \
    } while (0)

/* All-ones where `condition` holds, else zero: selects written as masks compile without branches. */
INLINE uint32_t mask_if(int condition) { return -(uint32_t)(condition != 0); }
INLINE uint32_t pick(uint32_t mask, uint32_t yes, uint32_t no) { return (yes & mask) | (no & ~mask); }

/* The FP8 code of v and, in *value, the float32 value of that code (sign included). */
INLINE uint8_t encode(float v, const Format *f, float *value) {
    uint32_t b = bits_of(v);
    uint32_t sign = b & 0x80000000u, a = b ^ sign;
    /* normal: round the float32 mantissa to nearest even at bit `shift`, then move the exponent bias */
    uint32_t rounded = a + ((1u << (f->shift - 1)) - 1) + ((a >> f->shift) & 1);
    uint32_t code_n = (rounded - f->rebias) >> f->shift;
    uint32_t value_n = rounded & ~((1u << f->shift) - 1);
    /* subnormal: the FPU's own rounding, in a binade whose ulp is the format's subnormal step */
    float shifted = float_of(a) + f->denorm_magic;
    uint32_t code_s = bits_of(shifted) - bits_of(f->denorm_magic);
    uint32_t value_s = bits_of(shifted - f->denorm_magic);
    uint32_t normal = mask_if(a >= f->min_normal);
    uint32_t code = pick(normal, code_n, code_s), magnitude = pick(normal, value_n, value_s);
    uint32_t saturated = mask_if(code > f->max_code); /* also every infinity */
    code = pick(saturated, f->max_code, code);
    magnitude = pick(saturated, bits_of(f->max_value), magnitude);
    uint32_t nan = mask_if(a > 0x7F800000u);
    code = pick(nan, 0x7F, code);
    magnitude = pick(nan, 0x7FC00000u, magnitude);
    *value = float_of(magnitude | sign);
    return (uint8_t)(code | (sign >> 24));
}

INLINE void cast_range(const void *x, int dtype, int64_t begin, int64_t end, float scale, const Format *f,
                       uint8_t *restrict codes, float *restrict values, uint32_t *top) {
    uint32_t largest = 0;
    for (int64_t i = begin; i < end; ++i) {
        float v = load(x, dtype, i), value;
        uint32_t a = magnitude_bits(v);
        largest = a > largest ? a : largest;
        codes[i] = encode(v * scale, f, &value);
        values[i] = value;
    }
    *top = largest;
}

/* Per-tensor cast: codes = saturate(x * scale) and values = their float32 values for elements [begin, end);
 * with amax_out, also max |x| over the range (NaN when the range holds a NaN). */
void fp8_cast(const void *x, int dtype, int64_t begin, int64_t end, float scale, int format, uint8_t *codes,
              float *values, float *amax_out) {
    uint32_t top;
#define CAST(D, F) cast_range(x, D, begin, end, scale, &FORMATS[F], codes, values, &top)
    SPECIALIZE(dtype, format, CAST);
#undef CAST
    if (amax_out) *amax_out = top > 0x7F800000u ? NAN : float_of(top);
}

/* The E8M0 exponent of a block whose max |x| has the bits `top`: floor(log2 amax) - emax, plus one when rceil
 * and amax / 2**that exceeds the format's max, clamped to [-127, 127]; 0 (scale 1) where the amax is inf, so the
 * infinities saturate and the block's finite values keep scale 1. The bits tell it directly: for a normal amax = 1.m * 2**(E - 127),
 * floor(log2 amax) = E - 127 and amax / 2**floor > fp8_max / 2**emax = 1.75 exactly when m > 0.75. Zero,
 * subnormal and NaN-holding blocks (torch counts NaN as the smallest subnormal) all clamp to -127. */
INLINE int mx_exponent(uint32_t top, const Format *f, int rceil) {
    if (top < 0x00800000u || top > 0x7F800000u) return -127;
    if (top == 0x7F800000u) return 0;
    int rounds_up = rceil && (top & 0x7FFFFFu) > 0x600000u;
    int exp = (int)(top >> 23) - 127 - f->emax + rounds_up;
    return exp < -127 ? -127 : (exp > 127 ? 127 : exp);
}

/* 2**e, exactly, for e in [-127, 127] (2**-127 is a float32 subnormal). */
INLINE float power_of_two(int e) { return e >= -126 ? float_of((uint32_t)(e + 127) << 23) : float_of(0x00400000u); }

INLINE uint8_t e8m0_byte(uint32_t top, int exp) { return top > 0x7F800000u ? 255 : (uint8_t)(exp + 127); }
INLINE float block_scale(uint32_t top, int exp) { return top > 0x7F800000u ? NAN : power_of_two(exp); }

/* Rowwise blocks of rows [first, last) of x (m, k): scales (m, k / block), codes and values (m, k). */
INLINE void mx_rows(const void *x, int dtype, int64_t first, int64_t last, int64_t k, int block, const Format *f,
                    int rceil, uint8_t *restrict codes, uint8_t *restrict scales, float *restrict values) {
    int64_t blocks = k / block;
    for (int64_t r = first; r < last; ++r) {
        for (int64_t j = 0; j < blocks; ++j) {
            int64_t start = r * k + j * block;
            uint32_t top = 0;
            for (int i = 0; i < block; ++i) {
                uint32_t a = magnitude_bits(load(x, dtype, start + i));
                top = a > top ? a : top;
            }
            int exp = mx_exponent(top, f, rceil);
            float inverse = power_of_two(-exp), scale = block_scale(top, exp);
            scales[r * blocks + j] = e8m0_byte(top, exp);
            for (int i = 0; i < block; ++i) {
                float value;
                codes[start + i] = encode(load(x, dtype, start + i) * inverse, f, &value);
                values[start + i] = value * scale;
            }
        }
    }
}

/* Columnwise blocks of block row g: rows [first, first + block) of x, those from `last` on being zero padding.
 * scales (m_pad / block, k), codes and values (m_pad, k); with_values = 0 skips the values. */
INLINE void mx_cols(const void *x, int dtype, int64_t g, int64_t first, int64_t last, int64_t k, int block,
                    const Format *f, int rceil, uint8_t *restrict codes, uint8_t *restrict scales,
                    float *restrict values, int with_values, float *restrict inverse, float *restrict scale) {
    uint32_t *top = (uint32_t *)inverse; /* the column maxima, then (same memory) their inverse scales */
    for (int64_t c = 0; c < k; ++c) top[c] = 0;
    for (int64_t r = first; r < last; ++r)
        for (int64_t c = 0; c < k; ++c) {
            uint32_t a = magnitude_bits(load(x, dtype, r * k + c));
            top[c] = a > top[c] ? a : top[c];
        }
    for (int64_t c = 0; c < k; ++c) {
        uint32_t t = top[c];
        int exp = mx_exponent(t, f, rceil);
        scales[g * k + c] = e8m0_byte(t, exp);
        scale[c] = block_scale(t, exp);
        inverse[c] = power_of_two(-exp);
    }
    for (int64_t r = first; r < first + block; ++r)
        for (int64_t c = 0; c < k; ++c) {
            float v = r < last ? load(x, dtype, r * k + c) : 0.0f, value;
            codes[r * k + c] = encode(v * inverse[c], f, &value);
            if (with_values) values[r * k + c] = value * scale[c];
        }
}

INLINE void mx_range(const void *x, int dtype, int64_t m, int64_t begin, int64_t end, int64_t k, int block,
                     const Format *f, int rceil, uint8_t *row_codes, uint8_t *row_scales, float *row_values,
                     uint8_t *col_codes, uint8_t *col_scales, float *col_values, float *work) {
    for (int64_t g = begin; g < end; ++g) {
        int64_t first = g * block, last = first + block < m ? first + block : m;
        if (row_codes && block == 32) /* the MX standard's block: a constant trip count unrolls the block loops */
            mx_rows(x, dtype, first, last, k, 32, f, rceil, row_codes, row_scales, row_values);
        else if (row_codes)
            mx_rows(x, dtype, first, last, k, block, f, rceil, row_codes, row_scales, row_values);
        if (col_codes && col_values)
            mx_cols(x, dtype, g, first, last, k, block, f, rceil, col_codes, col_scales, col_values, 1, work,
                    work + k);
        else if (col_codes)
            mx_cols(x, dtype, g, first, last, k, block, f, rceil, col_codes, col_scales, NULL, 0, work, work + k);
    }
}

/* MXFP8 quantization of x (m, k), block rows [begin, end) (each `block` rows of x; the last may be short).
 * Rowwise (row_codes not NULL): blocks of `block` consecutive elements along each row; codes and values (m, k),
 * scales (m, k / block). Columnwise (col_codes not NULL): blocks of `block` consecutive rows in each column, the
 * rows padded with zeros to whole blocks; codes and values (m_pad, k), scales (m_pad / block, k): x's own
 * layout, the operand of x.T being their transpose; col_values may be NULL. A block holding NaN gets the scale
 * byte 255 and NaN values; values are the codes times their block scale. Both copies come from one read of x:
 * the columnwise pass re-reads the block row from cache. work: 2 * k floats of scratch. */
void mx_quantize(const void *x, int dtype, int64_t m, int64_t begin, int64_t end, int64_t k, int block, int format,
                 int rceil, uint8_t *row_codes, uint8_t *row_scales, float *row_values, uint8_t *col_codes,
                 uint8_t *col_scales, float *col_values, float *work) {
#define MX(D, F) mx_range(x, D, m, begin, end, k, block, &FORMATS[F], rceil, row_codes, row_scales, row_values, \
                          col_codes, col_scales, col_values, work)
    SPECIALIZE(dtype, format, MX);
#undef MX
}

/* The float32 value of FP8 code c: the inverse of encode (NaN codes give NaN with the code's sign). */
INLINE float decode(uint32_t c, const Format *f) {
    uint32_t sign = (c & 0x80u) << 24, magnitude = c & 0x7Fu;
    uint32_t normal = (magnitude << f->shift) + f->rebias;
    uint32_t mantissa = magnitude & ((1u << (23 - f->shift)) - 1);
    uint32_t subnormal = bits_of((float)mantissa * f->subnormal_step);
    uint32_t bits = pick(mask_if(magnitude >> (23 - f->shift)), normal, subnormal);
    bits = pick(mask_if(magnitude == f->inf_code), 0x7F800000u, bits);
    bits = pick(mask_if(magnitude >= f->nan_code), 0x7FC00000u, bits);
    return float_of(bits | sign);
}

/* 2**(byte - 127) for an E8M0 byte, exactly (byte 0 is the float32 subnormal 2**-127, byte 255 NaN). */
INLINE float e8m0_value(uint32_t byte) {
    uint32_t bits = pick(mask_if(byte == 0), 0x00400000u, byte << 23);
    return float_of(pick(mask_if(byte == 255), 0x7FC00000u, bits));
}

/* values = the float32 value of each code, for elements [begin, end). */
void fp8_decode(const uint8_t *codes, int64_t begin, int64_t end, int format, float *values) {
    if (format == 0)
        for (int64_t i = begin; i < end; ++i) values[i] = decode(codes[i], &FORMATS[0]);
    else
        for (int64_t i = begin; i < end; ++i) values[i] = decode(codes[i], &FORMATS[1]);
}

INLINE void mx_decode_range(const uint8_t *restrict codes, const uint8_t *restrict scales, int64_t begin,
                            int64_t end, int64_t k, int block, int columnwise, const Format *f,
                            float *restrict values) {
    for (int64_t r = begin; r < end; ++r) {
        const uint8_t *row = codes + r * k;
        float *out = values + r * k;
        if (columnwise) {
            const uint8_t *row_scales = scales + (r / block) * k;
            for (int64_t c = 0; c < k; ++c) out[c] = decode(row[c], f) * e8m0_value(row_scales[c]);
        } else {
            for (int64_t j = 0; j < k / block; ++j) {
                float scale = e8m0_value(scales[r * (k / block) + j]);
                for (int i = 0; i < block; ++i) out[j * block + i] = decode(row[j * block + i], f) * scale;
            }
        }
    }
}

/* MX values (codes times their block scale) of data (rows, k) with blocks along rows (columnwise = 0, scales
 * (rows, k / block)) or down columns (columnwise = 1, scales (rows / block, k)); rows [begin, end). */
void mx_decode(const uint8_t *codes, const uint8_t *scales, int64_t begin, int64_t end, int64_t k, int block,
               int columnwise, int format, float *values) {
    if (format == 0)
        mx_decode_range(codes, scales, begin, end, k, block, columnwise, &FORMATS[0], values);
    else
        mx_decode_range(codes, scales, begin, end, k, block, columnwise, &FORMATS[1], values);
}

/* ---- Rowwise and blockwise casts (fp8_lightning/rowwise.py, fp8_lightning/blockwise.py) ---- */

/* The float32 scale of a row, column or tile whose max |x| has the bits `top`: fp8_max / max(amax, eps) divided
 * in float64 and rounded once to float32, capped at float32's max; with power_of_2, the largest power of two not
 * above it (torch's frexp/ldexp: the mantissa bits cleared; every scale here is a positive normal). 1 where the
 * amax is inf or NaN, and with block_rule (blockwise, which ignores eps) where it is 0. */
INLINE float fine_scale(uint32_t top, const Format *f, float eps, int power_of_2, int block_rule) {
    if (top >= 0x7F800000u || (block_rule && top == 0)) return 1.0f;
    float amax = float_of(top), clamped = block_rule || amax > eps ? amax : eps; /* blockwise: no eps */
    float scale = (float)((double)f->max_value / (double)clamped); /* an amax of 0 (eps 0): inf, capped below */
    if (scale > 0x1.fffffep127f) scale = 0x1.fffffep127f;
    return power_of_2 ? float_of(bits_of(scale) & 0xFF800000u) : scale;
}

/* One band of rows [first, last) of x (m, k) whose tiles are `cols` wide (the last may be short): the amax of each
 * tile over the band, its scale and 1 / scale (written to scales and inverses, one row of tiles), then
 * codes = saturate(x * scale) and values = the codes' float32 values times `inverse` (1 / scale with block_rule:
 * dequantized, what the emulated blockwise GEMM multiplies; 1 otherwise: the codes' values, the rowwise GEMM
 * scaling its accumulator). */
INLINE void fine_band(const void *x, int dtype, int64_t first, int64_t last, int64_t k, int64_t cols,
                      const Format *f, float eps, int power_of_2, int block_rule, uint8_t *restrict codes,
                      float *restrict scales, float *restrict inverses, float *restrict values,
                      float *restrict scale, float *restrict inverse) {
    int64_t tiles = (k + cols - 1) / cols;
    uint32_t *top = (uint32_t *)scale; /* the tile maxima, then (same memory) their scales */
    for (int64_t j = 0; j < tiles; ++j) top[j] = 0;
    for (int64_t r = first; r < last; ++r) {
        if (cols == 1) {
            for (int64_t c = 0; c < k; ++c) {
                uint32_t a = magnitude_bits(load(x, dtype, r * k + c));
                top[c] = a > top[c] ? a : top[c];
            }
            continue;
        }
        for (int64_t j = 0; j < tiles; ++j) {
            int64_t start = j * cols, stop = start + cols < k ? start + cols : k;
            uint32_t t = top[j];
            for (int64_t c = start; c < stop; ++c) {
                uint32_t a = magnitude_bits(load(x, dtype, r * k + c));
                t = a > t ? a : t;
            }
            top[j] = t;
        }
    }
    for (int64_t j = 0; j < tiles; ++j) {
        float s = fine_scale(top[j], f, eps, power_of_2, block_rule);
        scale[j] = s;
        scales[j] = s;
        inverses[j] = 1.0f / s;
        inverse[j] = block_rule ? inverses[j] : 1.0f;
    }
    for (int64_t r = first; r < last; ++r) {
        const int64_t row = r * k;
        if (cols == 1) {
            for (int64_t c = 0; c < k; ++c) {
                float value;
                codes[row + c] = encode(load(x, dtype, row + c) * scale[c], f, &value);
                values[row + c] = value * inverse[c];
            }
            continue;
        }
        for (int64_t j = 0; j < tiles; ++j) {
            int64_t start = j * cols, stop = start + cols < k ? start + cols : k;
            float s = scale[j], inv = inverse[j];
            for (int64_t c = start; c < stop; ++c) {
                float value;
                codes[row + c] = encode(load(x, dtype, row + c) * s, f, &value);
                values[row + c] = value * inv;
            }
        }
    }
}

/* Rowwise or blockwise quantization of x (m, k) in tiles of `rows` x `cols` elements (rowwise: 1 x k, one scale
 * per row, or m x 1, one per column; blockwise: 1 x 128, 128 x 1 or 128 x 128, ragged at the edges), for the
 * bands of `rows` rows [begin, end). codes and values (m, k); scales and inverses (1 / scale, the factor a
 * scaled GEMM applies) (ceil(m / rows), ceil(k / cols)) float32.
 * block_rule: blockwise's scale rule and dequantized values (see fine_band). Returns 0, or -1 when the scratch
 * memory (2 * ceil(k / cols) floats) cannot be allocated. */
int fine_quantize(const void *x, int dtype, int64_t m, int64_t k, int64_t begin, int64_t end, int64_t rows,
                  int64_t cols, int format, float eps, int power_of_2, int block_rule, uint8_t *codes,
                  float *scales, float *inverses, float *values) {
    int64_t tiles = (k + cols - 1) / cols;
    float *work = malloc(2 * (size_t)tiles * sizeof(float));
    if (work == NULL) return -1;
    for (int64_t g = begin; g < end; ++g) {
        int64_t first = g * rows, last = first + rows < m ? first + rows : m;
#define FINE(D, F) fine_band(x, D, first, last, k, cols, &FORMATS[F], eps, power_of_2, block_rule, codes, \
                             scales + g * tiles, inverses + g * tiles, values, work, work + tiles)
        SPECIALIZE(dtype, format, FINE);
#undef FINE
    }
    free(work);
    return 0;
}

/* ---- NVFP4 (fp8_lightning/nvfp4.py) ---- */

/* max |x| over elements [begin, end) as float32 bits (NaN bits, above infinity's, where the range holds a NaN). */
void nvfp4_amax(const void *x, int dtype, int64_t begin, int64_t end, uint32_t *top_out) {
    uint32_t top = 0;
    if (dtype == 0)
        for (int64_t i = begin; i < end; ++i) { uint32_t a = magnitude_bits(load(x, 0, i)); top = a > top ? a : top; }
    else
        for (int64_t i = begin; i < end; ++i) { uint32_t a = magnitude_bits(load(x, 1, i)); top = a > top ? a : top; }
    *top_out = top;
}

/* torch.clamp(v, lo, hi): NaN stays the same NaN. */
INLINE float clamp_keep_nan(float v, float lo, float hi) { return v != v ? v : (v < lo ? lo : (v > hi ? hi : v)); }

/* The float32 value torch gives an E4M3 code (`.float()`): its NaN code 0x7F is 0x7FF00000 with the sign. */
INLINE float e4m3_value(uint8_t code) {
    if ((code & 0x7F) == 0x7F) return float_of(((uint32_t)(code & 0x80) << 24) | 0x7FF00000u);
    return decode(code, &FORMATS[0]);
}

/* The E2M1 code fp8_lightning.nvfp4._nan_codes gives the NaN with the bits b (sign not included). */
INLINE uint8_t e2m1_nan_code(uint32_t b) {
    int64_t bits = (int64_t)(b & 0x7FFFFFFFu), odd = (bits >> 22) & 1;
    return (uint8_t)(((bits + ((int64_t)(1 - 127) << 23) + (1 << 21) - 1 + odd) >> 22) & 0xFF);
}

static const float E2M1_TABLE[9] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 6.0f};

/* e2m1_codes (uniform NULL: nearest, ties to even) or stochastic_e2m1_codes of a float32 p within +-6 or NaN. */
INLINE uint8_t e2m1_code(float p, const float *uniform, int64_t at) {
    uint32_t b = bits_of(p);
    uint8_t sign = (uint8_t)((b >> 31) << 3), code;
    float mag = fabsf(p);
    if (p != p) return e2m1_nan_code(b) | sign;
    if (uniform == NULL) {
        code = (uint8_t)((mag > 0.25f) + (mag >= 0.75f) + (mag > 1.25f) + (mag >= 1.75f) + (mag > 2.5f) +
                         (mag >= 3.5f) + (mag > 5.0f));
    } else {
        int lower = (mag >= 0.5f) + (mag >= 1.0f) + (mag >= 1.5f) + (mag >= 2.0f) + (mag >= 3.0f) + (mag >= 4.0f) +
                    (mag >= 6.0f);
        float low = E2M1_TABLE[lower], high = E2M1_TABLE[lower + 1];
        float gap = high > low ? high - low : 1.0f;
        code = (uint8_t)(lower + ((uniform[at] < (mag - low) / gap) && lower < 7));
    }
    return code | sign;
}

/* One tile of R rows (R = 1: a 1x16 block; 16: a 16x16 weight tile) at padded row `first`, K block j, of x
 * (m, k) padded with zeros to (ceil(m / R) * R, pk): block amax, E4M3 scale, then the codes, packed. */
INLINE void nvfp4_tile(const void *x, int dtype, int64_t m, int64_t k, int64_t pk, int64_t first, int64_t j, int R,
                       float global_scale, float inverse_global, const float *restrict uniform,
                       uint8_t *restrict codes, uint8_t *restrict scales, int64_t scale_at) {
    int64_t c0 = j * 16, width = k - c0 < 16 ? k - c0 : 16;
    uint32_t top = 0;
    for (int r = 0; r < R; ++r) {
        int64_t row = first + r;
        if (row >= m) break;
        for (int64_t c = 0; c < width; ++c) {
            uint32_t a = magnitude_bits(load(x, dtype, row * k + c0 + c));
            top = a > top ? a : top;
        }
    }
    /* block_amax / 6 / global_scale, clamped to [2**-6, 448], to E4M3 (torch's round to nearest even) */
    float block_scale = clamp_keep_nan(float_of(top) / 6.0f / global_scale, 0x1p-6f, 448.0f), unused;
    uint8_t scale_code = encode(block_scale, &FORMATS[0], &unused);
    scales[scale_at] = scale_code;
    float factor = inverse_global / e4m3_value(scale_code);
    int factor_nan = factor != factor;
    for (int r = 0; r < R; ++r) {
        int64_t row = first + r;
        uint8_t *out = codes + row * (pk / 2) + c0 / 2;
        const float *u = uniform ? uniform + row * pk + c0 : NULL;
        uint8_t e[16];
        for (int c = 0; c < 16; ++c) {
            float v = (row < m && c < width) ? load(x, dtype, row * k + c0 + c) : 0.0f;
            /* torch's x * factor: with both NaN it keeps the second operand's (the factor's) NaN */
            float p = factor_nan ? factor : v * factor;
            e[c] = e2m1_code(clamp_keep_nan(p, -6.0f, 6.0f), u, c);
        }
        for (int c = 0; c < 8; ++c) out[c] = (uint8_t)(e[2 * c] | (e[2 * c + 1] << 4));
    }
}

INLINE void nvfp4_bands(const void *x, int dtype, int64_t m, int64_t k, int64_t begin, int64_t end, int R,
                        float global_scale, const float *uniform, uint8_t *codes, uint8_t *scales) {
    int64_t pk = (k + 15) / 16 * 16, blocks = pk / 16;
    float inverse_global = 1.0f / global_scale;
    for (int64_t g = begin; g < end; ++g)
        for (int64_t j = 0; j < blocks; ++j)
            nvfp4_tile(x, dtype, m, k, pk, g * R, j, R, global_scale, inverse_global, uniform, codes, scales,
                       g * blocks + j);
}

/* NVFP4 quantization of x (m, k), bands [begin, end) of tile_rows (1 or 16) rows: the bits of
 * fp8_lightning.nvfp4.quantize_nvfp4 with this global scale. Rows (to whole tiles) and K (to whole blocks of 16)
 * are padded with zeros. codes: uint8 (m_pad, pk / 2), the even element in the low nibble; scales: E4M3 bytes
 * (m_pad / tile_rows, pk / 16); uniform: NULL (round to nearest even) or float32 (m_pad, pk) in [0, 1)
 * (stochastic rounding). */
void nvfp4_quantize(const void *x, int dtype, int64_t m, int64_t k, int64_t begin, int64_t end, int tile_rows,
                    float global_scale, const float *uniform, uint8_t *codes, uint8_t *scales) {
#define NV(D, R) nvfp4_bands(x, D, m, k, begin, end, R, global_scale, uniform, codes, scales)
    if (tile_rows == 16) {
        if (dtype == 0) NV(0, 16); else NV(1, 16);
    } else {
        if (dtype == 0) NV(0, 1); else NV(1, 1);
    }
#undef NV
}

/* fp8_lightning.nvfp4.uniform_like for flat positions [begin, end): murmur3's finaliser of
 * index * 0x9E3779B1 + key (mod 2**32), its top 24 bits times 2**-24. */
void nvfp4_uniform(int64_t begin, int64_t end, uint32_t key, float *out) {
    for (int64_t i = begin; i < end; ++i) {
        uint32_t h = (uint32_t)i * 0x9E3779B1u + key;
        h ^= h >> 16;
        h *= 0x85EBCA6Bu;
        h ^= h >> 13;
        h *= 0xC2B2AE35u;
        h ^= h >> 16;
        out[i] = (float)(h >> 8) * 0x1p-24f;
    }
}
