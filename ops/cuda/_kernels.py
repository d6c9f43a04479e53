"""The fused resample kernel: crop + resize + flip + normalize + layout + dtype, one launch a batch.

Each thread makes one output pixel (all channels) of one sample. It reads Pillow's bilinear filter
(a triangle whose support widens with the downscale factor: antialiasing), with Pillow's two passes
(horizontal, rounded to uint8, then vertical, rounded again), so the GPU matches the CPU path within
one uint8 level before normalization. Samples differ in size: a per-sample table carries the source
pointer, its size and row stride, the box to read, the valid (non-padding) range, and the flips.

With ``offsets`` (not null) the outputs differ in size too (a pipeline without a fixed output size):
sample b is meta[b][5] x meta[b][6] and starts ``offsets[b]`` elements into ``out``; OH_MAX and
OW_MAX are then the batch's largest, which only bound the grid.
"""

from __future__ import annotations

import functools

__all__ = ["BLOCK", "OUT_TYPES", "grid", "resample_kernel"]

OUT_TYPES = {"uint8": "unsigned char", "float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}

_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float tri(float x) { x = fabsf(x); return x < 1.0f ? 1.0f - x : 0.0f; }
__device__ __forceinline__ float round_u8(float v) { return fminf(fmaxf(floorf(v + 0.5f), 0.0f), 255.0f); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(unsigned char* p, float v) { *p = (unsigned char)v; }

// meta[b] = {src_h, src_w, row_stride_bytes, flip_h, flip_v, out_h, out_w, 0}
// geo[b]  = {box_x0, box_y0, box_x1, box_y1, valid_x0, valid_y0, valid_x1, valid_y1}
extern "C" __global__ void resample_OUTNAME(
    const unsigned long long* __restrict__ src, const int* __restrict__ meta, const float* __restrict__ geo,
    OUT_T* __restrict__ out, const int OH_MAX, const int OW_MAX, const int C, const int chw, const int normalize,
    const float* __restrict__ mean, const float* __restrict__ inv_std, const long long* __restrict__ offsets)
{
    const int ox = blockIdx.x * blockDim.x + threadIdx.x;
    const int oy = blockIdx.y * blockDim.y + threadIdx.y;
    const int b = blockIdx.z;
    const int* m = meta + 8 * b;
    const float* g = geo + 8 * b;
    const int OH = offsets ? m[5] : OH_MAX, OW = offsets ? m[6] : OW_MAX;
    if (ox >= OW || oy >= OH) return;
    const int H = m[0], W = m[1], stride = m[2];
    const int xs = m[3] ? OW - 1 - ox : ox;
    const int ys = m[4] ? OH - 1 - oy : oy;
    const float sx = (g[2] - g[0]) / OW, sy = (g[3] - g[1]) / OH;
    const float cx = g[0] + (xs + 0.5f) * sx, cy = g[1] + (ys + 0.5f) * sy;

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (cx >= g[4] && cx < g[6] && cy >= g[5] && cy < g[7]) {
        const float supx = fmaxf(sx, 1.0f), supy = fmaxf(sy, 1.0f);
        const float ssx = 1.0f / supx, ssy = 1.0f / supy;
        const int x0 = max((int)(cx - supx + 0.5f), 0), x1 = min((int)(cx + supx + 0.5f), W);
        const int y0 = max((int)(cy - supy + 0.5f), 0), y1 = min((int)(cy + supy + 0.5f), H);
        float wxs = 0.0f, wys = 0.0f;
        for (int x = x0; x < x1; ++x) wxs += tri((x - cx + 0.5f) * ssx);
        for (int y = y0; y < y1; ++y) wys += tri((y - cy + 0.5f) * ssy);
        const float iwx = wxs > 0.0f ? 1.0f / wxs : 0.0f, iwy = wys > 0.0f ? 1.0f / wys : 0.0f;
        const unsigned char* base = (const unsigned char*)src[b];
        for (int y = y0; y < y1; ++y) {
            const float wy = tri((y - cy + 0.5f) * ssy) * iwy;
            const unsigned char* row = base + (long long)y * stride;
            float h[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int x = x0; x < x1; ++x) {
                const float wx = tri((x - cx + 0.5f) * ssx) * iwx;
                for (int c = 0; c < C; ++c) h[c] += wx * row[x * C + c];
            }
            for (int c = 0; c < C; ++c) acc[c] += wy * round_u8(h[c]);
        }
        for (int c = 0; c < C; ++c) acc[c] = round_u8(acc[c]);
    }
    const long long plane = (long long)OH * OW;
    OUT_T* const dst = out + (offsets ? offsets[b] : (long long)b * C * plane);
    for (int c = 0; c < C; ++c) {
        const float v = normalize ? (acc[c] - mean[c]) * inv_std[c] : acc[c];
        const long long i = chw ? c * plane + (long long)oy * OW + ox : ((long long)oy * OW + ox) * C + c;
        store(dst + i, v);
    }
}
"""


BLOCK = (32, 8, 1)  # a warp along a row


def grid(oh: int, ow: int, n: int) -> tuple[int, int, int]:
    """The launch grid for ``n`` outputs of (at most) ``oh`` x ``ow``: a thread an output pixel."""
    return (ow + BLOCK[0] - 1) // BLOCK[0], (oh + BLOCK[1] - 1) // BLOCK[1], n


@functools.cache
def resample_kernel(out_type: str):
    """The compiled kernel writing ``out_type`` (a key of OUT_TYPES); compiled once per process."""
    import cupy

    name = f"resample_{out_type}"
    code = _SOURCE.replace("OUTNAME", out_type).replace("OUT_T", OUT_TYPES[out_type])
    return cupy.RawKernel(code, name, options=("--std=c++17",))
