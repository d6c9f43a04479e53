"""CUDA source of the post-op kernels: colour twist, affine warp, separable Gaussian blur, tone
curves (histogram, tone_build, tone_apply), sharpness, AugMix's mix (mix_chains), a copy, finish.

Each kernel is one launch for a whole batch of images of different sizes: thread (x, y) of block
z makes output pixel (x, y), all channels, of sample z, and returns when (x, y) lies outside that
sample (``histogram`` and ``tone_build`` have grids of their own, given above each). Per-sample
tables (device memory, filled from pinned host memory by ``_post.py``):

- ``ptrs[2 z]``, ``ptrs[2 z + 1]``: source and destination addresses (uint64);
- ``meta[4 z .. 4 z + 3]``: height, width, source row stride, destination row stride (bytes);
- ``par[P z ..]``: the op's numbers (``P`` floats a sample, given per op below).

The channel count ``CH`` is a compile-time constant (one module per count), so the channel loops
unroll and the accumulators stay in registers. Results round once, half up, clamped to 0..255.
"""

from __future__ import annotations

import functools

__all__ = ["FINISH_TYPES", "module"]

FINISH_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}

_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define CH CHANNELS
typedef unsigned char u8;
typedef unsigned long long u64;

__device__ __forceinline__ float round_u8(float v) { return fminf(fmaxf(floorf(v + 0.5f), 0.0f), 255.0f); }

// Index i reflected into [0, n) without repeating the edge (torch's "reflect"), as often as needed.
__device__ __forceinline__ int reflect(int i, const int n) {
    if (i >= 0 && i < n) return i;
    if (n == 1) return 0;
    const int period = 2 * (n - 1);
    i = abs(i) % period;
    return i < n ? i : period - i;
}

// par: 12 floats, [M | o] row-major, 3 x 4 (gray: gain in par[0], offset in par[3]).
// Source and destination may be the same buffer: a thread reads its pixel before it writes it.
extern "C" __global__ void color_twist(const u64* ptrs, const int* meta, const float* par)
{
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    const int b = blockIdx.z;
    const int* m = meta + 4 * b;
    if (x >= m[1] || y >= m[0]) return;
    const u8* s = (const u8*)ptrs[2 * b] + (long long)y * m[2] + (long long)x * CH;
    u8* d = (u8*)ptrs[2 * b + 1] + (long long)y * m[3] + (long long)x * CH;
    const float* t = par + 12 * b;
#if CH == 3
    const float r = s[0], g = s[1], bl = s[2];
    const float o0 = t[0] * r + t[1] * g + t[2] * bl + t[3];
    const float o1 = t[4] * r + t[5] * g + t[6] * bl + t[7];
    const float o2 = t[8] * r + t[9] * g + t[10] * bl + t[11];
    d[0] = (u8)round_u8(o0);
    d[1] = (u8)round_u8(o1);
    d[2] = (u8)round_u8(o2);
#else
    const float v = t[0] * (float)s[0] + t[3];
    d[0] = (u8)round_u8(v);
#endif
}

// par: 10 floats, {a00, a01, a02, a10, a11, a12, fill[0..3]}: output pixel (x, y) reads the input
// at index coordinates (a00 x + a01 y + a02, a10 x + a11 y + a12) (pixel centres at integers),
// bilinearly; each of the four neighbours outside the image reads fill. Source != destination.
extern "C" __global__ void warp_affine(const u64* ptrs, const int* meta, const float* par)
{
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    const int b = blockIdx.z;
    const int* m = meta + 4 * b;
    const int H = m[0], W = m[1];
    if (x >= W || y >= H) return;
    const float* t = par + 10 * b;
    const float xf = (float)x, yf = (float)y;
    // Clamped: further out, all four neighbours read fill anyway, and the ints cannot overflow.
    const float sx = fminf(fmaxf(t[0] * xf + t[1] * yf + t[2], -2.0f), (float)W + 1.0f);
    const float sy = fminf(fmaxf(t[3] * xf + t[4] * yf + t[5], -2.0f), (float)H + 1.0f);
    const float fx = floorf(sx), fy = floorf(sy);
    const float ax = sx - fx, ay = sy - fy;
    const int x0 = (int)fx, y0 = (int)fy;
    const bool in_x0 = x0 >= 0 && x0 < W, in_x1 = x0 + 1 >= 0 && x0 + 1 < W;
    const bool in_y0 = y0 >= 0 && y0 < H, in_y1 = y0 + 1 >= 0 && y0 + 1 < H;
    // Only in-image pixels are read; the clamps keep even the unused addresses inside the image.
    const u8* s = (const u8*)ptrs[2 * b];
    const u8* row0 = s + (long long)min(max(y0, 0), H - 1) * m[2];
    const u8* row1 = s + (long long)min(max(y0 + 1, 0), H - 1) * m[2];
    const long long c0 = (long long)min(max(x0, 0), W - 1) * CH;
    const long long c1 = (long long)min(max(x0 + 1, 0), W - 1) * CH;
    u8* d = (u8*)ptrs[2 * b + 1] + (long long)y * m[3] + (long long)x * CH;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
        const float f = t[6 + c];
        const float p00 = (in_y0 && in_x0) ? (float)row0[c0 + c] : f;
        const float p01 = (in_y0 && in_x1) ? (float)row0[c1 + c] : f;
        const float p10 = (in_y1 && in_x0) ? (float)row1[c0 + c] : f;
        const float p11 = (in_y1 && in_x1) ? (float)row1[c1 + c] : f;
        const float top = p00 * (1.0f - ax) + p01 * ax;
        const float bottom = p10 * (1.0f - ax) + p11 * ax;
        d[c] = (u8)round_u8(top * (1.0f - ay) + bottom * ay);
    }
}

// Gaussian blur, pass 1 along rows: uint8 source -> float32 scratch (its row stride in bytes).
// par: P floats a sample, the row weights first (K of them). acc + w[k] x[k] in order, each
// operation rounded (no FMA): the CPU path's arithmetic.
extern "C" __global__ void blur_rows(const u64* ptrs, const int* meta, const float* par, const int K, const int P)
{
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    const int b = blockIdx.z;
    const int* m = meta + 4 * b;
    const int W = m[1];
    if (x >= W || y >= m[0]) return;
    const u8* s = (const u8*)ptrs[2 * b] + (long long)y * m[2];
    float* d = (float*)((char*)ptrs[2 * b + 1] + (long long)y * m[3]) + (long long)x * CH;
    const float* w = par + (long long)P * b;
    const int r = K / 2;
    float acc[CH];
#pragma unroll
    for (int c = 0; c < CH; ++c) acc[c] = 0.0f;
    for (int k = 0; k < K; ++k) {
        const u8* p = s + (long long)reflect(x - r + k, W) * CH;
        const float wk = w[k];
#pragma unroll
        for (int c = 0; c < CH; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(wk, (float)p[c]));
    }
#pragma unroll
    for (int c = 0; c < CH; ++c) d[c] = acc[c];
}

// Pass 2 along columns: float32 scratch (row stride in bytes) -> uint8 destination; the column
// weights start at par[P z + offset].
extern "C" __global__ void blur_cols(const u64* ptrs, const int* meta, const float* par, const int K, const int P,
                                     const int offset)
{
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    const int b = blockIdx.z;
    const int* m = meta + 4 * b;
    const int H = m[0];
    if (x >= m[1] || y >= H) return;
    const char* s = (const char*)ptrs[2 * b];
    u8* d = (u8*)ptrs[2 * b + 1] + (long long)y * m[3] + (long long)x * CH;
    const float* w = par + (long long)P * b + offset;
    const int r = K / 2;
    float acc[CH];
#pragma unroll
    for (int c = 0; c < CH; ++c) acc[c] = 0.0f;
    for (int k = 0; k < K; ++k) {
        const float* p = (const float*)(s + (long long)reflect(y - r + k, H) * m[2]) + (long long)x * CH;
        const float wk = w[k];
#pragma unroll
        for (int c = 0; c < CH; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(wk, p[c]));
    }
#pragma unroll
    for (int c = 0; c < CH; ++c) d[c] = (u8)round_u8(acc[c]);
}

// Level counts of each channel: hist (CH x 256 ints at ptrs[2 z + 1], zeroed) += the image's.
// Grid (blocks a sample, 1, n) of 256 threads; each block counts a stride of pixels in shared
// memory, then adds its counts to the sample's (few global atomics: one per level a block saw).
extern "C" __global__ void histogram(const u64* ptrs, const int* meta, const float* par)
{
    __shared__ unsigned int counts[CH * 256];
    const int b = blockIdx.z;
    const int* m = meta + 4 * b;
    const int H = m[0], W = m[1];
    for (int i = threadIdx.x; i < CH * 256; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    const u8* s = (const u8*)ptrs[2 * b];
    const long long pixels = (long long)H * W;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pixels; i += (long long)gridDim.x * blockDim.x) {
        const u8* p = s + (i / W) * m[2] + (i % W) * CH;
#pragma unroll
        for (int c = 0; c < CH; ++c) atomicAdd(&counts[c * 256 + p[c]], 1u);
    }
    __syncthreads();
    unsigned int* out = (unsigned int*)ptrs[2 * b + 1];
    for (int i = threadIdx.x; i < CH * 256; i += blockDim.x)
        if (counts[i]) atomicAdd(&out[i], counts[i]);
}

// Tone tables (ops/_tone.py tone_tables, operation for operation): CH x 256 levels at
// ptrs[2 z + 1] from par[2 z .. 2 z + 1] = (kind, value) and, for the kinds read off the image
// (5 <= kind <= 7), the level counts at ptrs[2 z]. One block of 256 threads a sample; thread v makes level v.
extern "C" __global__ void tone_build(const u64* ptrs, const int* meta, const float* par)
{
    __shared__ int counts[CH * 256];
    __shared__ long long cdf[CH * 256];
    __shared__ int lo[CH], hi[CH];
    __shared__ long long step[CH];
    __shared__ float mean;
    const int b = blockIdx.z;
    const int v = threadIdx.x;
    const int kind = (int)par[2 * b];
    const float value = par[2 * b + 1];
    u8* lut = (u8*)ptrs[2 * b + 1];
    if (kind >= 5 && kind <= 7) {
        const int* h = (const int*)ptrs[2 * b];
        for (int c = 0; c < CH; ++c) counts[c * 256 + v] = h[c * 256 + v];
        __syncthreads();
        if (v < CH) {  // one thread a channel: its running sum, darkest and brightest level
            const int c = v;
            long long run = 0;
            int first = -1, last = -1;
            for (int k = 0; k < 256; ++k) {
                const int n = counts[c * 256 + k];
                run += n;
                cdf[c * 256 + k] = run;
                if (n > 0) { if (first < 0) first = k; last = k; }
            }
            lo[c] = first < 0 ? 0 : first;
            hi[c] = last < 0 ? 0 : last;
            step[c] = (run - (last < 0 ? 0 : counts[c * 256 + last])) / 255;
        }
        __syncthreads();
        if (v == 0) {  // the mean gray level, in double as tone_tables computes it
            double sums[CH];
            for (int c = 0; c < CH; ++c) {
                double t = 0.0;
                for (int k = 0; k < 256; ++k) t = __dadd_rn(t, __dmul_rn((double)k, (double)counts[c * 256 + k]));
                sums[c] = t;
            }
            double count = (double)(cdf[255] > 0 ? cdf[255] : 1);
#if CH >= 3
            const double total = __dadd_rn(__dadd_rn(__dmul_rn(0.2989, sums[0]), __dmul_rn(0.587, sums[1])),
                                           __dmul_rn(0.114, sums[2]));
#else
            const double total = sums[0];
#endif
            mean = (float)__ddiv_rn(total, count);
        }
        __syncthreads();
    }
#pragma unroll
    for (int c = 0; c < CH; ++c) {
        int out = v;
        switch (kind) {
        case 1: out = v & ((255 << (8 - (int)value)) & 255); break;            // posterize
        case 2: out = ((float)v >= value) ? 255 - v : v; break;                 // solarize
        case 3: out = 255 - v; break;                                           // invert
        case 4: out = (int)round_u8(__fmul_rn(value, (float)v)); break;         // brightness
        case 5: out = (int)round_u8(__fadd_rn(__fmul_rn(value, (float)v),       // contrast
                                              __fmul_rn(__fsub_rn(1.0f, value), mean))); break;
        case 6: {                                                               // autocontrast
            const int span = hi[c] - lo[c];
            if (span > 0) out = min(max((2 * 255 * (v - lo[c]) + span) / (2 * span), 0), 255);
            break;
        }
        case 8: out = v < 128 ? min(v + (int)value, 255) : v; break;           // solarize-add (timm's)
        case 7: {                                                               // equalize
            const long long st = step[c];
            if (st > 0) out = v == 0 ? 0 : (int)min((cdf[c * 256 + v - 1] + st / 2) / st, 255LL);
            break;
        }
        default: break;
        }
        lut[c * 256 + v] = (u8)out;
    }
}

// Each channel's level through its sample's table: luts + (z0 + z) * CH * 256 (from tone_build).
// Source and destination may be the same buffer.
extern "C" __global__ void tone_apply(const u64* ptrs, const int* meta, const float* par, const u8* luts, const int z0)
{
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    const int b = blockIdx.z;
    const int* m = meta + 4 * b;
    if (x >= m[1] || y >= m[0]) return;
    const u8* s = (const u8*)ptrs[2 * b] + (long long)y * m[2] + (long long)x * CH;
    u8* d = (u8*)ptrs[2 * b + 1] + (long long)y * m[3] + (long long)x * CH;
    const u8* lut = luts + (long long)(z0 + b) * CH * 256;
#pragma unroll
    for (int c = 0; c < CH; ++c) d[c] = lut[c * 256 + s[c]];
}

// adjust_sharpness: par[z] = factor f. Off the border the smoothed pixel is
// round((8 neighbours + 5 centre) / 13), in integers; on it, the pixel itself; the output is
// round(f v + (1 - f) smoothed) in float32. Source != destination.
extern "C" __global__ void sharpen(const u64* ptrs, const int* meta, const float* par)
{
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    const int b = blockIdx.z;
    const int* m = meta + 4 * b;
    const int H = m[0], W = m[1];
    if (x >= W || y >= H) return;
    const u8* s = (const u8*)ptrs[2 * b];
    const u8* p = s + (long long)y * m[2] + (long long)x * CH;
    u8* d = (u8*)ptrs[2 * b + 1] + (long long)y * m[3] + (long long)x * CH;
    const float f = par[b];
    const float g = __fsub_rn(1.0f, f);
    const bool border = x == 0 || y == 0 || x == W - 1 || y == H - 1;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
        int smooth = p[c];
        if (!border) {
            int t = 4 * p[c];
            for (int dy = -1; dy <= 1; ++dy)
                for (int dx = -1; dx <= 1; ++dx) t += s[(long long)(y + dy) * m[2] + (long long)(x + dx) * CH + c];
            smooth = (2 * t + 13) / 26;
        }
        d[c] = (u8)round_u8(__fadd_rn(__fmul_rn(f, (float)p[c]), __fmul_rn(g, (float)smooth)));
    }
}

// AugMix's mix of each sample's W chains with its original. ptrs: W + 2 a sample (the original, the
// destination, the chains); meta: 4 + W (height, width, the original's and the destination's row
// strides, each chain's); par: W + 1 weights (the original's first). w0 x, then + w_c chain_c, each
// multiply and add rounded (the CPU path's order), truncated to uint8 as torchvision's .to(uint8).
extern "C" __global__ void mix_chains(const u64* ptrs, const int* meta, const float* par, const int W)
{
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    const int b = blockIdx.z;
    const int* m = meta + (4 + W) * b;
    if (x >= m[1] || y >= m[0]) return;
    const u64* p = ptrs + (W + 2) * b;
    const float* w = par + (W + 1) * b;
    const u8* s = (const u8*)p[0] + (long long)y * m[2] + (long long)x * CH;
    float acc[CH];
#pragma unroll
    for (int c = 0; c < CH; ++c) acc[c] = __fmul_rn((float)s[c], w[0]);
    for (int k = 0; k < W; ++k) {
        const u8* q = (const u8*)p[2 + k] + (long long)y * m[4 + k] + (long long)x * CH;
#pragma unroll
        for (int c = 0; c < CH; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn((float)q[c], w[1 + k]));
    }
    u8* d = (u8*)p[1] + (long long)y * m[3] + (long long)x * CH;
#pragma unroll
    for (int c = 0; c < CH; ++c) d[c] = (u8)truncf(fminf(fmaxf(acc[c], 0.0f), 255.0f));
}

// A plain copy of each sample's pixels (gathering a batch's samples into one buffer).
extern "C" __global__ void copy_pixels(const u64* ptrs, const int* meta, const float* par)
{
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    const int y = blockIdx.y * blockDim.y + threadIdx.y;
    const int b = blockIdx.z;
    const int* m = meta + 4 * b;
    if (x >= m[1] || y >= m[0]) return;
    const u8* s = (const u8*)ptrs[2 * b] + (long long)y * m[2] + (long long)x * CH;
    u8* d = (u8*)ptrs[2 * b + 1] + (long long)y * m[3] + (long long)x * CH;
#pragma unroll
    for (int c = 0; c < CH; ++c) d[c] = s[c];
}

// Normalize + layout + dtype of a contiguous N x H x W x CH uint8 batch: (x - mean) * inv_std
// (mean and inv_std already scaled to 0..255), to N x CH x H x W (chw) or N x H x W x CH.
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

#define FINISH(NAME, OUT_T)                                                                      \
extern "C" __global__ void NAME(const u8* __restrict__ src, OUT_T* __restrict__ out, const int H,   \
                                const int W, const int chw, const float* __restrict__ mean,         \
                                const float* __restrict__ inv_std)                                  \
{                                                                                                \
    const int x = blockIdx.x * blockDim.x + threadIdx.x;                                         \
    const int y = blockIdx.y * blockDim.y + threadIdx.y;                                         \
    const int b = blockIdx.z;                                                                    \
    if (x >= W || y >= H) return;                                                                \
    const long long pixel = ((long long)b * H + y) * W + x;                                      \
    const long long plane = (long long)H * W;                                                    \
    const u8* p = src + pixel * CH;                                                              \
    _Pragma("unroll")                                                                            \
    for (int c = 0; c < CH; ++c) {                                                               \
        const float v = __fmul_rn(__fsub_rn((float)p[c], mean[c]), inv_std[c]);                 \
        const long long i = chw ? ((long long)b * CH + c) * plane + (long long)y * W + x         \
                                : pixel * CH + c;                                                \
        store(out + i, v);                                                                       \
    }                                                                                            \
}

FINISH(finish_float32, float)
FINISH(finish_float16, __half)
FINISH(finish_bfloat16, __nv_bfloat16)
"""


def source(channels: int) -> str:
    """The CUDA source for images of ``channels`` channels (1 to 4; the colour twist takes 1 or 3)."""
    if not 1 <= channels <= 4:
        raise ValueError(f"post-op kernels take 1 to 4 channels, got {channels}")
    return _SOURCE.replace("CHANNELS", str(int(channels)))


@functools.cache
def module(channels: int):
    """The compiled ``cupy.RawModule`` for ``channels``; compiled once per process (CuPy also caches
    the binary on disk). Functions: color_twist, warp_affine, blur_rows, blur_cols, histogram, tone_build,
    tone_apply, sharpen, mix_chains, copy_pixels, finish_<dtype>."""
    import cupy

    return cupy.RawModule(code=source(channels), options=("--std=c++17",))
