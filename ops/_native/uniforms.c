/* headrace's counter-based uniforms (ops/_random.py) in one call.
 *
 * Why: NumPy computes them a block of rows at a time, each block a dozen array operations kept
 * under the size at which NumPy lets the GIL go (ops/_gil.py); a policy drawing 35 numbers a
 * sample (AugMix) took ~300 such calls a batch of 256 in the GPU path's prep thread. Here the
 * same numbers, bit for bit, are one short call that holds the GIL (ctypes.PyDLL).
 */
#include <stdint.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL

static inline uint64_t mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* out[r * count + c] = the uniform of counter first + c + 1 of sample index[r], under key (the
   splitmix64 hash of seed, epoch and op), as ops/_random.py's uniforms() computes it. */
void hr_uniforms(uint64_t key, const int64_t* index, int64_t n, int64_t count, int64_t first, double* out)
{
    for (int64_t r = 0; r < n; ++r) {
        uint64_t base = mix((uint64_t)index[r] * GOLDEN + key);
        double* row = out + r * count;
        for (int64_t c = 0; c < count; ++c) {
            uint64_t bits = mix(base + (uint64_t)(first + c + 1) * GOLDEN);
            row[c] = (double)(bits >> 11) * (1.0 / 9007199254740992.0);
        }
    }
}
