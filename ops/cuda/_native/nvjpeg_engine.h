/* The hardware JPEG engines driven through nvJPEG's batched decode directly, beside nvImageCodec.
 *
 * Why: nvImageCodec's hardware decoder keeps one nvJPEG state per decoder and costs host time per
 * image around nvJPEG's call; on the H100 one thread calling nvJPEG itself decoded 22k images/s
 * where one nvImageCodec hardware decoder did 13.6k, and two such threads beside the CUDA decoder
 * reached 30k where nvImageCodec's best shape reached 28.6k (docs/benchmarks.md, issue 22). A lane
 * of the shim gives its engine share to this instead of to nvImageCodec's hardware decoder when
 * asked (hr_decoder_create's engine_library).
 *
 * nvJPEG is opened with dlopen from the path the caller found (the nvidia-nvjpeg wheel's library,
 * which nvImageCodec loads too), so the shim builds without the CUDA toolkit and loads without
 * nvJPEG. Only the declarations used here are copied from nvjpeg.h: their ABI is stable across
 * nvJPEG 12 and 13.
 *
 * What this path takes: baseline JPEGs of three channels, in stored orientation (the caller offers
 * only those: EXIF rotations and gray images go to the CUDA decoder), decoded to interleaved RGB,
 * whole or a region of interest. nvJPEG's batched call succeeds or fails for the whole
 * batch; when it fails, every image of it goes to the CUDA decoder, which reports the bad one. */
#ifndef HEADRACE_NVJPEG_ENGINE_H
#define HEADRACE_NVJPEG_ENGINE_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NVJ_BACKEND_HARDWARE = 3, NVJ_OUTPUT_RGBI = 5, NVJ_MAX_COMPONENT = 4 };

typedef struct {
    unsigned char* channel[NVJ_MAX_COMPONENT];
    size_t pitch[NVJ_MAX_COMPONENT];
} nvj_image; /* nvjpegImage_t */

/* nvJPEG's entry points, resolved once per process. Handles are opaque pointers. */
static struct {
    int loaded; /* 1: resolved */
    int (*create_ex)(int backend, void* dev_allocator, void* pinned_allocator, unsigned flags, void** handle);
    int (*destroy)(void* handle);
    int (*state_create)(void* handle, void** state);
    int (*state_destroy)(void* state);
    int (*batched_initialize)(void* handle, void* state, int batch_size, int max_cpu_threads, int output_format);
    int (*batched_ex)(void* handle, void* state, const unsigned char* const* data, const size_t* lengths, nvj_image* destinations,
                      void** decode_params, void* cuda_stream);
    int (*params_create)(void* handle, void** params);
    int (*params_destroy)(void* params);
    int (*params_output_format)(void* params, int output_format);
    int (*params_roi)(void* params, int offset_x, int offset_y, int width, int height);
    int (*stream_create)(void* handle, void** jpeg_stream);
    int (*stream_destroy)(void* jpeg_stream);
    int (*stream_parse_header)(void* handle, const unsigned char* data, size_t length, void* jpeg_stream);
    int (*batched_supported_ex)(void* handle, void* jpeg_stream, void* params, int* is_supported);
    int (*batched_preallocate)(void* handle, void* state, int batch_size, int width, int height, int subsampling, int output_format);
    /* From the CUDA driver: an event per state, so a state is reused only once its last decode is done. */
    int (*event_create)(void** event, unsigned flags);
    int (*event_destroy)(void* event);
    int (*event_record)(void* event, void* stream);
    int (*event_synchronize)(void* event);
} nvj;

/* Two JPEG states used in turn: nvJPEG's batched call returns once the host part is done, and a
   state's buffers may still be read by its last decode on the GPU (nvImageCodec's hardware decoder
   waits there for its one state's last batch; with two, one thread's engine rate went from 22k to
   24.9k images/s on the H100: docs/benchmarks.md, tenth session). */
enum { HR_ENGINE_STATES = 2 };

/* One lane's way to the engines: a handle with the hardware backend, its states and their events,
   a parsed stream for the support check, and one call's arguments (grown as batches need). */
typedef struct {
    void* handle;
    void* states[HR_ENGINE_STATES];
    void* events[HR_ENGINE_STATES];
    int used[HR_ENGINE_STATES]; /* an event was recorded after the state's last decode */
    int turn;
    void* jpeg_stream;
    int capacity;
    void** params;
    const unsigned char** data;
    size_t* lengths;
    nvj_image* destinations;
} hr_engine;

/* Resolve nvJPEG (at path) and the driver's event calls: 1 when they resolved (then for good; after a
   failure another path may be tried). The caller serialises the calls. */
static int nvj_load(const char* path, char* err, size_t errlen)
{
    if (nvj.loaded)
        return 1;
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    int missing = 0;
#define NVJ_SYM(field, name)                                   \
    do {                                                       \
        *(void**)(&nvj.field) = lib ? dlsym(lib, name) : NULL; \
        missing += nvj.field == NULL;                          \
    } while (0)
    NVJ_SYM(create_ex, "nvjpegCreateEx");
    NVJ_SYM(destroy, "nvjpegDestroy");
    NVJ_SYM(state_create, "nvjpegJpegStateCreate");
    NVJ_SYM(state_destroy, "nvjpegJpegStateDestroy");
    NVJ_SYM(batched_initialize, "nvjpegDecodeBatchedInitialize");
    NVJ_SYM(batched_ex, "nvjpegDecodeBatchedEx");
    NVJ_SYM(params_create, "nvjpegDecodeParamsCreate");
    NVJ_SYM(params_destroy, "nvjpegDecodeParamsDestroy");
    NVJ_SYM(params_output_format, "nvjpegDecodeParamsSetOutputFormat");
    NVJ_SYM(params_roi, "nvjpegDecodeParamsSetROI");
    NVJ_SYM(stream_create, "nvjpegJpegStreamCreate");
    NVJ_SYM(stream_destroy, "nvjpegJpegStreamDestroy");
    NVJ_SYM(stream_parse_header, "nvjpegJpegStreamParseHeader");
    NVJ_SYM(batched_supported_ex, "nvjpegDecodeBatchedSupportedEx");
    int nvjpeg_missing = missing;
    void* nvjpeg = lib;
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    NVJ_SYM(event_create, "cuEventCreate");
    NVJ_SYM(event_destroy, "cuEventDestroy_v2");
    NVJ_SYM(event_record, "cuEventRecord");
    NVJ_SYM(event_synchronize, "cuEventSynchronize");
#undef NVJ_SYM
    /* Optional: a memory pool for the hardware decoder (nvImageCodec found it worth >20% on 8 GPUs). */
    *(void**)(&nvj.batched_preallocate) = nvjpeg ? dlsym(nvjpeg, "nvjpegDecodeBatchedPreAllocate") : NULL;
    nvj.loaded = nvjpeg && lib && !missing;
    if (!nvj.loaded && err && errlen)
        snprintf(err, errlen, "nvJPEG or the CUDA driver did not load (%s): %s", path,
                 !nvjpeg || !lib ? dlerror() : nvjpeg_missing ? "nvJPEG lacks entry points" : "the driver lacks entry points");
    return nvj.loaded > 0;
}

static void engine_destroy(hr_engine* e)
{
    if (!e)
        return;
    for (int i = 0; i < e->capacity; ++i)
        if (e->params[i])
            nvj.params_destroy(e->params[i]);
    if (e->jpeg_stream)
        nvj.stream_destroy(e->jpeg_stream);
    for (int s = 0; s < HR_ENGINE_STATES; ++s) {
        if (e->events[s])
            nvj.event_destroy(e->events[s]);
        if (e->states[s])
            nvj.state_destroy(e->states[s]);
    }
    if (e->handle)
        nvj.destroy(e->handle);
    free(e->params);
    free(e->data);
    free(e->lengths);
    free(e->destinations);
    free(e);
}

/* An engine on the calling thread's current device (its current context must be the device's
   primary context), or NULL with the reason in err (no nvJPEG at path, or no hardware decoder on
   this GPU: nvjpegCreateEx refuses the hardware backend). */
static hr_engine* engine_create(char* err, size_t errlen)
{
    if (!nvj.loaded) {
        if (err && errlen)
            snprintf(err, errlen, "nvJPEG is not loaded (hr_engine_load)");
        return NULL;
    }
    hr_engine* e = (hr_engine*)calloc(1, sizeof(hr_engine));
    if (!e)
        return NULL;
    int st = nvj.create_ex(NVJ_BACKEND_HARDWARE, NULL, NULL, 0, &e->handle);
    for (int s = 0; s < HR_ENGINE_STATES && st == 0; ++s) {
        st = nvj.state_create(e->handle, &e->states[s]);
        if (st == 0 && nvj.batched_preallocate)
            nvj.batched_preallocate(e->handle, e->states[s], 1, 1, 1, 0 /* NVJPEG_CSS_444 */, NVJ_OUTPUT_RGBI);
    }
    if (st == 0)
        st = nvj.stream_create(e->handle, &e->jpeg_stream);
    int cu = 0;
    for (int s = 0; s < HR_ENGINE_STATES && st == 0 && cu == 0; ++s)
        cu = nvj.event_create(&e->events[s], 2 /* CU_EVENT_DISABLE_TIMING */);
    if (st != 0 || cu != 0) {
        if (err && errlen)
            snprintf(err, errlen, "nvJPEG's hardware decoder is unavailable (nvjpegStatus %d, CUresult %d)", st, cu);
        engine_destroy(e);
        return NULL;
    }
    return e;
}

static int engine_reserve(hr_engine* e, int n)
{
    if (n <= e->capacity)
        return 1;
    int cap = n > 2 * e->capacity ? n : 2 * e->capacity;
    void** params = (void**)realloc(e->params, sizeof(void*) * (size_t)cap);
    if (!params)
        return 0;
    e->params = params;
    for (int i = e->capacity; i < cap; ++i)
        e->params[i] = NULL;
    const unsigned char** data = (const unsigned char**)realloc(e->data, sizeof(*data) * (size_t)cap);
    if (data)
        e->data = data;
    size_t* lengths = (size_t*)realloc(e->lengths, sizeof(size_t) * (size_t)cap);
    if (lengths)
        e->lengths = lengths;
    nvj_image* destinations = (nvj_image*)realloc(e->destinations, sizeof(nvj_image) * (size_t)cap);
    if (destinations)
        e->destinations = destinations;
    if (!data || !lengths || !destinations)
        return 0;
    for (int i = e->capacity; i < cap; ++i) {
        if (nvj.params_create(e->handle, &e->params[i]) != 0 || nvj.params_output_format(e->params[i], NVJ_OUTPUT_RGBI) != 0)
            return 0; /* the params made so far are kept and destroyed with the engine */
        e->capacity = i + 1;
    }
    return 1;
}

/* Image i's window (y0, x0, y1, x1 in stored coordinates; the whole image when it covers it) into
   its call slot k: 1 when the engine can decode it, 0 when not (the caller hands it on). */
static int engine_add(hr_engine* e, int k, const unsigned char* data, size_t length, const int32_t* r, int whole, void* out)
{
    void* params = e->params[k];
    int st = whole ? nvj.params_roi(params, 0, 0, -1, -1) : nvj.params_roi(params, r[1], r[0], r[3] - r[1], r[2] - r[0]);
    if (st != 0 || nvj.stream_parse_header(e->handle, data, length, e->jpeg_stream) != 0)
        return 0;
    int unsupported = 1;
    if (nvj.batched_supported_ex(e->handle, e->jpeg_stream, params, &unsupported) != 0 || unsupported != 0)
        return 0; /* nvJPEG's convention: 0 is supported */
    e->data[k] = data;
    e->lengths[k] = length;
    memset(&e->destinations[k], 0, sizeof(nvj_image));
    e->destinations[k].channel[0] = (unsigned char*)out;
    e->destinations[k].pitch[0] = (size_t)(r[3] - r[1]) * 3; /* rows packed, RGB interleaved */
    return 1;
}

/* Decode the n images added (slots 0..n) on cuda_stream: 1 when nvJPEG took the batch (the pixels
   are ordered on the stream), 0 when it refused it as a whole. */
static int engine_decode(hr_engine* e, int n, void* cuda_stream)
{
    if (n <= 0)
        return 1;
    int s = e->turn++ % HR_ENGINE_STATES;
    if (e->used[s] && nvj.event_synchronize(e->events[s]) != 0)
        return 0;
    e->used[s] = 0;
    if (nvj.batched_initialize(e->handle, e->states[s], n, 1, NVJ_OUTPUT_RGBI) != 0)
        return 0;
    if (nvj.batched_ex(e->handle, e->states[s], e->data, e->lengths, e->destinations, e->params, cuda_stream) != 0)
        return 0;
    /* Should the record fail, the next wait on this event fails too, and the engine takes no more. */
    nvj.event_record(e->events[s], cuda_stream);
    e->used[s] = 1;
    return 1;
}

#endif
