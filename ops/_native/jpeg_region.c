/* Region-of-interest JPEG decode on the CPU with libjpeg-turbo, on a pool of threads.
 *
 * Why: the GPU lanes leave about half of the machine's cores idle while nvImageCodec's hardware
 * engine and CUDA decoder are its pace (ops/README.md). libjpeg-turbo decodes just a crop window
 * (jpeg_crop_scanline skips the columns' inverse DCT and colour conversion, jpeg_skip_scanlines
 * the rows'), so a share of each batch decoded here, beside the GPU's share, adds to the decode
 * floor instead of competing with it.
 *
 * The library is not linked: hr_jpeg_load dlopens the libjpeg-turbo the caller names (Pillow's
 * bundled one) and checks its ABI by creating a decompressor (libjpeg refuses a struct of another
 * size or version). The headers under jpeg/ are libjpeg-turbo's (ABI 62, README.ijg).
 *
 * An image that libjpeg cannot decode cleanly, or decodes with a warning (corrupt or truncated
 * data), fails here and is handed back to the caller's other decoder, whose verdict stands.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dlfcn.h>

#include "jpeg/jpeglib.h"

#include "jpeg_region.h"

static struct {
    int loaded;
    struct jpeg_error_mgr* (*std_error)(struct jpeg_error_mgr*);
    void (*create)(j_decompress_ptr, int, size_t);
    void (*mem_src)(j_decompress_ptr, const unsigned char*, unsigned long);
    int (*read_header)(j_decompress_ptr, boolean);
    boolean (*start)(j_decompress_ptr);
    void (*crop)(j_decompress_ptr, JDIMENSION*, JDIMENSION*);
    JDIMENSION (*skip)(j_decompress_ptr, JDIMENSION);
    JDIMENSION (*read)(j_decompress_ptr, JSAMPARRAY, JDIMENSION);
    void (*abort)(j_decompress_ptr);
    void (*destroy)(j_decompress_ptr);
} jpeg;

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
} hr_jpeg_error;

/* One thread's decompressor, reused image after image (jpeg_abort keeps it). */
typedef struct {
    struct jpeg_decompress_struct info;
    hr_jpeg_error error;
    int created;
    unsigned char* row;
    size_t row_capacity;
} hr_jpeg_worker;

static void on_error(j_common_ptr info)
{
    longjmp(((hr_jpeg_error*)info->err)->jump, 1);
}

/* Warnings (corrupt data, premature end) are counted in num_warnings and checked after the
   decode; nothing is printed. */
static void on_message(j_common_ptr info, int level)
{
    if (level < 0)
        info->err->num_warnings++;
}

static int worker_init(hr_jpeg_worker* w)
{
    memset(w, 0, sizeof(*w));
    w->info.err = jpeg.std_error(&w->error.pub);
    w->error.pub.error_exit = on_error;
    w->error.pub.emit_message = on_message;
    if (setjmp(w->error.jump))
        return 0;
    jpeg.create(&w->info, JPEG_LIB_VERSION, sizeof(struct jpeg_decompress_struct));
    w->created = 1;
    return 1;
}

static void worker_free(hr_jpeg_worker* w)
{
    if (w->created && !setjmp(w->error.jump))
        jpeg.destroy(&w->info);
    w->created = 0;
    free(w->row);
    w->row = NULL;
}

int hr_jpeg_load(const char* path, char* err, size_t errlen)
{
    if (jpeg.loaded)
        return jpeg.loaded > 0;
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    const char* why = lib ? NULL : dlerror();
    if (lib) {
        jpeg.std_error = dlsym(lib, "jpeg_std_error");
        jpeg.create = dlsym(lib, "jpeg_CreateDecompress");
        jpeg.mem_src = dlsym(lib, "jpeg_mem_src");
        jpeg.read_header = dlsym(lib, "jpeg_read_header");
        jpeg.start = dlsym(lib, "jpeg_start_decompress");
        jpeg.crop = dlsym(lib, "jpeg_crop_scanline");
        jpeg.skip = dlsym(lib, "jpeg_skip_scanlines");
        jpeg.read = dlsym(lib, "jpeg_read_scanlines");
        jpeg.abort = dlsym(lib, "jpeg_abort_decompress");
        jpeg.destroy = dlsym(lib, "jpeg_destroy_decompress");
        if (!(jpeg.std_error && jpeg.create && jpeg.mem_src && jpeg.read_header && jpeg.start && jpeg.crop && jpeg.skip &&
              jpeg.read && jpeg.abort && jpeg.destroy))
            why = "it lacks libjpeg-turbo's region entry points (jpeg_crop_scanline, jpeg_skip_scanlines)";
    }
    if (!why) {
        hr_jpeg_worker probe;
        if (!worker_init(&probe))
            why = "its ABI is not libjpeg's version 62 (jpeg_CreateDecompress refused our struct)";
        worker_free(&probe);
    }
    jpeg.loaded = why ? -1 : 1;
    if (why && err && errlen)
        snprintf(err, errlen, "%s: %s", path, why);
    return jpeg.loaded > 0;
}

/* Decode the window y0, x0, y1, x1 of one JPEG into out: (y1-y0) rows of (x1-x0) * channels bytes,
   packed; channels 3 (RGB) or 1 (gray). 1 when decoded cleanly, else 0 (out is then undefined). */
static int decode_region(hr_jpeg_worker* w, const unsigned char* data, size_t size, const int32_t* region, int channels,
                         int fancy, unsigned char* out)
{
    j_decompress_ptr info = &w->info;
    int y0 = region[0], x0 = region[1], h = region[2] - region[0], wd = region[3] - region[1];
    if (setjmp(w->error.jump)) {
        jpeg.abort(info);
        return 0;
    }
    w->error.pub.num_warnings = 0;
    jpeg.mem_src(info, data, (unsigned long)size);
    if (jpeg.read_header(info, TRUE) != JPEG_HEADER_OK)
        goto fail;
    /* CMYK and YCCK need more than libjpeg's conversions: the other decoder takes them. */
    if (channels == 3 && info->jpeg_color_space != JCS_YCbCr && info->jpeg_color_space != JCS_GRAYSCALE &&
        info->jpeg_color_space != JCS_RGB)
        goto fail;
    info->out_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
    /* Beside nvJPEG, chroma is upsampled by replication as it does (closer to the GPU's pixels,
       and faster); on its own, smoothly, as Pillow does. */
    info->do_fancy_upsampling = fancy ? TRUE : FALSE;
    info->dct_method = JDCT_ISLOW;
    if (!jpeg.start(info))
        goto fail;
    if (h < 1 || wd < 1 || y0 < 0 || x0 < 0 || (JDIMENSION)(y0 + h) > info->output_height ||
        (JDIMENSION)(x0 + wd) > info->output_width || info->output_components != channels)
        goto fail;
    /* libjpeg widens the window to whole blocks, and upsamples chroma at its edges as at the
       image's: a margin of one block (16 pixels at most) on each side keeps the window's own
       pixels those of the whole image. */
    JDIMENSION left = x0 > 16 ? (JDIMENSION)x0 - 16 : 0;
    JDIMENSION right = (JDIMENSION)(x0 + wd) + 16 < info->output_width ? (JDIMENSION)(x0 + wd) + 16 : info->output_width;
    JDIMENSION xoff = left, cw = right - left;
    if (xoff != 0 || cw != info->output_width)
        jpeg.crop(info, &xoff, &cw);
    size_t row_bytes = (size_t)cw * (size_t)channels;
    if (row_bytes > w->row_capacity) {
        free(w->row);
        w->row = malloc(row_bytes);
        w->row_capacity = w->row ? row_bytes : 0;
        if (!w->row)
            goto fail;
    }
    if (y0 > 0 && jpeg.skip(info, (JDIMENSION)y0) != (JDIMENSION)y0)
        goto fail;
    size_t shift = (size_t)((JDIMENSION)x0 - xoff) * (size_t)channels, out_bytes = (size_t)wd * (size_t)channels;
    int direct = shift == 0 && row_bytes == out_bytes;
    for (int r = 0; r < h; ++r) {
        JSAMPROW row = direct ? out + (size_t)r * out_bytes : w->row;
        if (jpeg.read(info, &row, 1) != 1)
            goto fail;
        if (!direct)
            memcpy(out + (size_t)r * out_bytes, w->row + shift, out_bytes);
    }
    if (w->error.pub.num_warnings)
        goto fail;
    jpeg.abort(info);
    return 1;
fail:
    jpeg.abort(info);
    return 0;
}

/* ---- The pool: batches of jobs, taken one image at a time by whichever thread is free ---- */

struct hr_jpeg_pool {
    pthread_mutex_t lock;
    pthread_cond_t work, finished;
    hr_jpeg_batch* head;
    hr_jpeg_batch* tail;
    int stopping;
    int threads;
    pthread_t* ids;
};

static void* pool_main(void* arg)
{
    hr_jpeg_pool* pool = (hr_jpeg_pool*)arg;
    hr_jpeg_worker w;
    int usable = worker_init(&w);
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!pool->stopping && !pool->head)
            pthread_cond_wait(&pool->work, &pool->lock);
        if (!pool->head)
            break; /* stopping, and nothing left */
        hr_jpeg_batch* b = pool->head;
        int j = b->next++;
        if (b->next == b->n) { /* every job of it taken: the queue moves on */
            pool->head = b->queued;
            if (!pool->head)
                pool->tail = NULL;
        }
        pthread_mutex_unlock(&pool->lock);
        b->ok[j] = usable && decode_region(&w, b->data[j], b->sizes[j], b->regions + 4 * j, b->channels, b->fancy, b->out[j]);
        pthread_mutex_lock(&pool->lock);
        if (++b->done == b->n)
            pthread_cond_broadcast(&pool->finished);
    }
    pthread_mutex_unlock(&pool->lock);
    if (usable)
        worker_free(&w);
    return NULL;
}

hr_jpeg_pool* hr_jpeg_pool_create(int threads)
{
    if (jpeg.loaded <= 0 || threads < 1)
        return NULL;
    hr_jpeg_pool* pool = (hr_jpeg_pool*)calloc(1, sizeof(hr_jpeg_pool));
    if (!pool)
        return NULL;
    pool->ids = (pthread_t*)calloc((size_t)threads, sizeof(pthread_t));
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->work, NULL);
    pthread_cond_init(&pool->finished, NULL);
    for (int i = 0; pool->ids && i < threads; ++i) {
        if (pthread_create(&pool->ids[i], NULL, pool_main, pool) != 0)
            break;
        pool->threads++;
    }
    if (pool->threads == 0) {
        hr_jpeg_pool_destroy(pool);
        return NULL;
    }
    return pool;
}

/* Queue a batch; the caller keeps b (and what it points to) alive until hr_jpeg_wait returns. */
void hr_jpeg_submit(hr_jpeg_pool* pool, hr_jpeg_batch* b)
{
    b->next = b->done = 0;
    b->queued = NULL;
    if (b->n <= 0)
        return;
    pthread_mutex_lock(&pool->lock);
    if (pool->tail)
        pool->tail->queued = b;
    else
        pool->head = b;
    pool->tail = b;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
}

void hr_jpeg_wait(hr_jpeg_pool* pool, hr_jpeg_batch* b)
{
    if (b->n <= 0)
        return;
    pthread_mutex_lock(&pool->lock);
    while (b->done < b->n)
        pthread_cond_wait(&pool->finished, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
}

/* Decode n images on the pool and wait: ok[j] = 1 when image j decoded into out[j]. */
void hr_jpeg_decode(hr_jpeg_pool* pool, int n, const unsigned char* const* data, const size_t* sizes, const int32_t* regions,
                    unsigned char* const* out, int channels, int fancy, int32_t* ok)
{
    hr_jpeg_batch b;
    memset(&b, 0, sizeof(b));
    b.n = n;
    b.data = data;
    b.sizes = sizes;
    b.regions = regions;
    b.out = out;
    b.channels = channels;
    b.fancy = fancy;
    b.ok = ok;
    hr_jpeg_submit(pool, &b);
    hr_jpeg_wait(pool, &b);
}

/* Stops the threads once the queued batches are done. */
void hr_jpeg_pool_destroy(hr_jpeg_pool* pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->lock);
    pool->stopping = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->threads; ++i)
        pthread_join(pool->ids[i], NULL);
    pthread_mutex_destroy(&pool->lock);
    pthread_cond_destroy(&pool->work);
    pthread_cond_destroy(&pool->finished);
    free(pool->ids);
    free(pool);
}
