/* Region-of-interest JPEG decode on the CPU (jpeg_region.c): a pool of threads, each with its own
 * libjpeg-turbo decompressor, taking a batch's images one at a time. */
#ifndef HR_JPEG_REGION_H
#define HR_JPEG_REGION_H

#include <stddef.h>
#include <stdint.h>

typedef struct hr_jpeg_pool hr_jpeg_pool;
/* One batch of jobs; the caller owns it and what it points to until hr_jpeg_wait returns. */
typedef struct hr_jpeg_batch {
    int n;
    const unsigned char* const* data;
    const size_t* sizes;
    const int32_t* regions; /* 4 per job */
    unsigned char* const* out;
    int channels;
    int fancy;              /* libjpeg's smooth chroma upsampling (Pillow's pixels); 0: replication (nvJPEG's) */
    int32_t* ok;            /* per job: 1 decoded, 0 failed */
    int next, done;
    struct hr_jpeg_batch* queued; /* the next batch in the pool's queue */
} hr_jpeg_batch;

/* dlopen libjpeg-turbo at path and check its ABI, once per process: 1 when usable, else 0 and err says why. */
int hr_jpeg_load(const char* path, char* err, size_t errlen);
/* threads threads, or NULL (libjpeg not loaded, or no thread would start). */
hr_jpeg_pool* hr_jpeg_pool_create(int threads);
void hr_jpeg_pool_destroy(hr_jpeg_pool* pool);
void hr_jpeg_submit(hr_jpeg_pool* pool, hr_jpeg_batch* b);
void hr_jpeg_wait(hr_jpeg_pool* pool, hr_jpeg_batch* b);
void hr_jpeg_decode(hr_jpeg_pool* pool, int n, const unsigned char* const* data, const size_t* sizes, const int32_t* regions,
                    unsigned char* const* out, int channels, int fancy, int32_t* ok);

#endif
