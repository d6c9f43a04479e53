/* One call per batch into nvImageCodec's C API, with no Python in between.
 *
 * Why this exists: nvImageCodec's Python binding drops and retakes the GIL for every image
 * (header read, output allocation), so a decode thread stalls whenever any other Python thread
 * runs, and lanes cannot overlap (measured on the H100: ops/README.md). ctypes releases the GIL for
 * the whole of each call below, so a lane's header parse, region views and decode run beside the
 * event loop and the other lanes.
 *
 * A batch is parsed (headers only, needs just the library instance) into an hr_parsed, then decoded
 * by an hr_decoder: so the next batch's parse runs in one thread while a decoder works in another.
 *
 * Output memory is the caller's: one device (or, for the CPU-only decoder, host) buffer per image,
 * tightly packed rows, so there is no allocation per image and no third memory pool.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <dlfcn.h>

#include "nvimgcodec.h"

#define HR_OK 1

/* The parsed headers of one batch. Parsing needs only the instance, so a batch is parsed in one
   thread while a decoder decodes the previous one in another; the handles are reused by the next
   batch parsed into the same object. */
typedef struct {
    int capacity;
    nvimgcodecCodeStream_t* streams;
    int32_t* encodings; /* a JPEG's encoding (its SOF marker, nvimgcodecJpegEncoding_t); 0 for other formats */
    const unsigned char** data; /* the callers' bytes and sizes, for frames cut below a window */
    size_t* sizes;
    int32_t* upright;   /* 1: no EXIF rotation or flip (with exif, rows as displayed are rows as stored) */
} hr_parsed;

/* One image of a decode call, set up: where it comes from (the whole stream or a region view of
   it), the image it decodes into, and which of the call's images it is. */
typedef struct {
    nvimgcodecCodeStream_t source;
    nvimgcodecImage_t image;
    int j;         /* its index in the call's pick, region, out and status */
    int hw;        /* 1: offered to the hardware engine (a baseline JPEG), 2: given to it */
    int64_t area;  /* of its window: the engine takes the largest */
    double bytes;  /* of its JPEG that its window needs read (up to the window's last row): hw_share is a share of these */
    nvimgcodecProcessingStatus_t status;
    int full_h;    /* its image's height as displayed */
    int rows_as_stored; /* 1: its rows as displayed are its rows as stored (no EXIF turn, or exif off) */
    int cut;       /* the frame height its bytes are given with (0: as they are) */
    size_t cut_at; /* where that height is written in them */
} hr_item;

/* Two (or three) nvImageCodec decoders, each with a chain that never hands a failed sample on to another
 * backend inside nvImageCodec: `hw`, the hardware JPEG engine alone, and `cuda`, the CUDA decoder
 * (hybrid, then GPU). Why not one decoder with the chain engine -> CUDA decoder: when the engine
 * (a batched backend) fails a sample during the decode, nvImageCodec 0.9 schedules the sample on
 * its next backend while its own threads may still pick the same sample up, so two threads
 * decode one sample at once. Fuzzed JPEGs crashed the process that way now and then (SIGSEGV in
 * ImageGenericCodec::processSample, reading the sample's backend that the other thread had just
 * cleared: docs/gpu-notes.md section 5). Here the split between the two is ours (hw_share of each
 * batch, the largest baseline JPEGs), the CUDA decoder's call runs in its threads while the engine
 * decodes in this one, and what the engine fails goes to the CUDA decoder in a second call.
 * The third, `gpu`, is a second CUDA decoder whose nvJPEG runs every image's Huffman stage on the
 * GPU (its GPU-hybrid backend) rather than on the host threads: given gpu_share of a batch (the
 * windows next in size after the engine's), it spends GPU time where `cuda` would spend host cores
 * (through nvImageCodec's pixel threshold on the H200, the GPU's Huffman decode saved 5-18% of the
 * host cores an image, and taking the CUDA decoder's whole share it lost 3-22% of the rate; a share
 * sets how much it takes, which a threshold in pixels cannot: docs/benchmarks.md, issue 22). */
typedef struct {
    nvimgcodecInstance_t instance;
    nvimgcodecDecoder_t hw;   /* NULL: no engine (hw_load 0, the CPU-only decoder, or none on this GPU) */
    nvimgcodecDecoder_t cuda; /* the CPU backend alone for the CPU-only decoder */
    nvimgcodecDecoder_t gpu;  /* NULL: none (gpu_load 0); else the CUDA decoder with every Huffman stage on the GPU */
    int cpu_only;
    float hw_share;
    float gpu_share;          /* of each batch, the windows after the engine's, to `gpu` */
    int adaptive;             /* move hw_share batch by batch, towards no wait on the CUDA decoder */
    int capacity;
    nvimgcodecCodeStream_t* views; /* region views, reused between batches */
    hr_item* items;
    nvimgcodecCodeStream_t* sources; /* one decode call's arguments */
    nvimgcodecImage_t* images;
    nvimgcodecProcessingStatus_t* status;
    int cut_frames;                   /* give the engine frames cut below their windows (hr_frame_cut) */
    nvimgcodecCodeStream_t* cut_streams; /* the engine share's cut copies and their region views, reused */
    nvimgcodecCodeStream_t* cut_views;
    unsigned char* cut_bytes;         /* the copies, one buffer for a batch */
    size_t cut_capacity;
} hr_decoder;

static void set_error(char* err, size_t len, const char* what, int code)
{
    if (err && len)
        snprintf(err, len, "%s failed (nvimgcodecStatus %d)", what, code);
}

nvimgcodecInstance_t hr_instance_create(const char* extensions_path, char* err, size_t errlen)
{
    nvimgcodecInstanceCreateInfo_t info;
    memset(&info, 0, sizeof(info));
    info.struct_type = NVIMGCODEC_STRUCTURE_TYPE_INSTANCE_CREATE_INFO;
    info.struct_size = sizeof(info);
    info.load_builtin_modules = 1;
    info.load_extension_modules = 1;
    info.extension_modules_path = extensions_path;
    /* No debug messenger: failures come back as per-sample statuses, which the caller reports
       with the sample's key; the library's own stderr lines would only duplicate them. */
    info.create_debug_messenger = 0;
    nvimgcodecInstance_t instance = NULL;
    nvimgcodecStatus_t st = nvimgcodecInstanceCreate(&instance, &info);
    if (st != NVIMGCODEC_STATUS_SUCCESS) {
        set_error(err, errlen, "nvimgcodecInstanceCreate", st);
        return NULL;
    }
    return instance;
}

void hr_instance_destroy(nvimgcodecInstance_t instance)
{
    if (instance)
        nvimgcodecInstanceDestroy(instance);
}

/* A decoder with the backends kinds[0..n) in that order, their load hints loads[0..n). */
static nvimgcodecDecoder_t make_decoder(nvimgcodecInstance_t instance, int device_id, int n, const nvimgcodecBackendKind_t* kinds,
                                        const float* loads, int threads, const char* options, char* err, size_t errlen)
{
    nvimgcodecBackend_t backends[4];
    memset(backends, 0, sizeof(backends));
    for (int i = 0; i < n; ++i) {
        backends[i].struct_type = NVIMGCODEC_STRUCTURE_TYPE_BACKEND;
        backends[i].struct_size = sizeof(nvimgcodecBackend_t);
        backends[i].kind = kinds[i];
        backends[i].params.struct_type = NVIMGCODEC_STRUCTURE_TYPE_BACKEND_PARAMS;
        backends[i].params.struct_size = sizeof(nvimgcodecBackendParams_t);
        backends[i].params.load_hint = loads[i];
        backends[i].params.load_hint_policy = NVIMGCODEC_LOAD_HINT_POLICY_FIXED;
    }
    nvimgcodecExecutionParams_t exec;
    memset(&exec, 0, sizeof(exec));
    exec.struct_type = NVIMGCODEC_STRUCTURE_TYPE_EXECUTION_PARAMS;
    exec.struct_size = sizeof(exec);
    exec.device_id = device_id;
    exec.max_num_cpu_threads = threads;
    exec.num_backends = n;
    exec.backends = backends;
    nvimgcodecDecoder_t decoder = NULL;
    nvimgcodecStatus_t st = nvimgcodecDecoderCreate(instance, &decoder, &exec, options ? options : "");
    if (st != NVIMGCODEC_STATUS_SUCCESS || decoder == NULL) {
        set_error(err, errlen, "nvimgcodecDecoderCreate", st);
        return NULL;
    }
    return decoder;
}

/* device_id < 0 with cpu_only: the CPU backend only (libjpeg-turbo and friends), host output.
   Otherwise the GPU backends only: the hardware engine for hw_load of each batch (none at 0), and
   the CUDA decoder (hybrid, taking cuda_load of what reaches it, then GPU) for the rest. What they
   fail on comes back as failed and the caller decodes it another way: with nvImageCodec's CPU
   backend in the chain, fuzzed JPEGs hung a decode now and then on the H100 (2 of 40 slices of
   1,000; none without it). adaptive: hw_load is where the share starts. */
hr_decoder* hr_decoder_create(nvimgcodecInstance_t instance, int device_id, int cpu_only, int threads,
                              float hw_load, float cuda_load, float gpu_load, int gpu_threads, int adaptive,
                              const char* options, char* err, size_t errlen)
{
    hr_decoder* d = (hr_decoder*)calloc(1, sizeof(hr_decoder));
    if (!d) {
        set_error(err, errlen, "calloc", 0);
        return NULL;
    }
    d->instance = instance;
    d->cpu_only = cpu_only;
    d->hw_share = hw_load;
    d->gpu_share = gpu_load < 0.0f ? 0.0f : gpu_load > 1.0f ? 1.0f : gpu_load;
    d->adaptive = adaptive;
    if (cpu_only) {
        const nvimgcodecBackendKind_t kinds[1] = {NVIMGCODEC_BACKEND_KIND_CPU_ONLY};
        const float loads[1] = {1.0f};
        d->cuda = make_decoder(instance, NVIMGCODEC_DEVICE_CPU_ONLY, 1, kinds, loads, threads, options, err, errlen);
    } else {
        const nvimgcodecBackendKind_t kinds[2] = {NVIMGCODEC_BACKEND_KIND_HYBRID_CPU_GPU, NVIMGCODEC_BACKEND_KIND_GPU_ONLY};
        const float loads[2] = {cuda_load, 1.0f};
        d->cuda = make_decoder(instance, device_id, 2, kinds, loads, threads, options, err, errlen);
        if (d->cuda && (hw_load > 0.0f || adaptive)) {
            const nvimgcodecBackendKind_t hw_kind[1] = {NVIMGCODEC_BACKEND_KIND_HW_GPU_ONLY};
            const float hw_loads[1] = {1.0f};
            /* One thread: the engine's batch is decoded in the calling thread anyway. */
            d->hw = make_decoder(instance, device_id, 1, hw_kind, hw_loads, 1, options, NULL, 0);
        }
        if (d->cuda && d->gpu_share > 0.0f) {
            /* nvImageCodec reads its options in order: the threshold last, so it holds here. */
            const char* threshold = "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0";
            size_t len = strlen(options ? options : "") + strlen(threshold) + 2;
            char* gpu_options = (char*)malloc(len);
            if (gpu_options) {
                snprintf(gpu_options, len, "%s %s", options ? options : "", threshold);
                /* Its threads mostly wait for the GPU (each keeps one image there at a time), so it may
                   have more than the host decoder: gpu_threads, or as many when 0. */
                d->gpu = make_decoder(instance, device_id, 2, kinds, loads, gpu_threads > 0 ? gpu_threads : threads,
                                      gpu_options, err, errlen);
                free(gpu_options);
            }
            if (!d->gpu) {
                nvimgcodecDecoderDestroy(d->cuda);
                d->cuda = NULL;
                if (d->hw)
                    nvimgcodecDecoderDestroy(d->hw);
                d->hw = NULL;
                if (err && errlen && !err[0])
                    set_error(err, errlen, "the GPU-Huffman decoder's creation", 0);
            }
        }
    }
    if (!d->cuda) {
        free(d);
        return NULL;
    }
    return d;
}

static void release_handles(nvimgcodecCodeStream_t* handles, int n)
{
    for (int i = 0; i < n; ++i) {
        if (handles[i]) {
            nvimgcodecCodeStreamDestroy(handles[i]);
            handles[i] = NULL;
        }
    }
}

/* Grow the arrays *ptrs[k] (element sizes sizes[k]) from *capacity to at least n, keeping contents. */
static int grow(void** ptrs[], const size_t* sizes, int count, int* capacity, int n)
{
    if (n <= *capacity)
        return 1;
    int cap = n > 2 * *capacity ? n : 2 * *capacity;
    void* p[8];
    for (int k = 0; k < count; ++k) {
        p[k] = calloc((size_t)cap, sizes[k]);
        if (!p[k]) {
            for (int j = 0; j < k; ++j)
                free(p[j]);
            return 0;
        }
    }
    for (int k = 0; k < count; ++k) {
        if (*ptrs[k])
            memcpy(p[k], *ptrs[k], (size_t)*capacity * sizes[k]);
        free(*ptrs[k]);
        *ptrs[k] = p[k];
    }
    *capacity = cap;
    return 1;
}

static int reserve(hr_decoder* d, int n)
{
    void** ptrs[7] = {(void**)&d->views, (void**)&d->items, (void**)&d->sources, (void**)&d->images, (void**)&d->status,
                      (void**)&d->cut_streams, (void**)&d->cut_views};
    size_t sizes[7] = {sizeof(nvimgcodecCodeStream_t), sizeof(hr_item), sizeof(nvimgcodecCodeStream_t), sizeof(nvimgcodecImage_t),
                       sizeof(nvimgcodecProcessingStatus_t), sizeof(nvimgcodecCodeStream_t), sizeof(nvimgcodecCodeStream_t)};
    return grow(ptrs, sizes, 7, &d->capacity, n);
}

static int reserve_parsed(hr_parsed* p, int n)
{
    void** ptrs[5] = {(void**)&p->streams, (void**)&p->encodings, (void**)&p->data, (void**)&p->sizes, (void**)&p->upright};
    size_t sizes[5] = {sizeof(nvimgcodecCodeStream_t), sizeof(int32_t), sizeof(unsigned char*), sizeof(size_t), sizeof(int32_t)};
    return grow(ptrs, sizes, 5, &p->capacity, n);
}

/* The stream's image info, and its height and width as displayed (EXIF rotations by 90 or 270
   degrees swap them when exif is set); a JPEG's encoding into *encoding when it is not NULL.
   0 when the header cannot be read. */
static int displayed_info(nvimgcodecCodeStream_t cs, int exif, nvimgcodecImageInfo_t* ii, int* h, int* w, int32_t* encoding)
{
    nvimgcodecJpegImageInfo_t jpeg;
    memset(&jpeg, 0, sizeof(jpeg));
    jpeg.struct_type = NVIMGCODEC_STRUCTURE_TYPE_JPEG_IMAGE_INFO;
    jpeg.struct_size = sizeof(jpeg);
    memset(ii, 0, sizeof(*ii));
    ii->struct_type = NVIMGCODEC_STRUCTURE_TYPE_IMAGE_INFO;
    ii->struct_size = sizeof(*ii);
    ii->struct_next = encoding ? &jpeg : NULL;
    if (nvimgcodecCodeStreamGetImageInfo(cs, ii) != NVIMGCODEC_STATUS_SUCCESS || ii->num_planes < 1)
        return 0;
    ii->struct_next = NULL;
    if (encoding)
        *encoding = strcmp(ii->codec_name, "jpeg") == 0 ? (int32_t)jpeg.encoding : 0;
    int rotated = exif && (ii->orientation.rotated / 90) % 2;
    *h = (int)(rotated ? ii->plane_info[0].width : ii->plane_info[0].height);
    *w = (int)(rotated ? ii->plane_info[0].height : ii->plane_info[0].width);
    return 1;
}

hr_parsed* hr_parsed_create(void)
{
    return (hr_parsed*)calloc(1, sizeof(hr_parsed));
}

/* Drop the parsed streams (and their references to the callers' data); the object stays usable. */
void hr_parsed_release(hr_parsed* p)
{
    if (p)
        release_handles(p->streams, p->capacity);
}

void hr_parsed_destroy(hr_parsed* p)
{
    if (!p)
        return;
    hr_parsed_release(p);
    free(p->streams);
    free(p->encodings);
    free(p->data);
    free(p->sizes);
    free(p->upright);
    free(p);
}

/* JPEG encodings nvImageCodec is given: sequential Huffman-coded DCT (baseline and extended).
   Progressive JPEGs go to the caller: nvJPEG's host decode of a damaged progressive scan writes
   outside its coefficient buffer (a refinement pass in libnvjpeg.so.13 at +0xaae27, found by
   fuzzing with each file ending at a guard page on the H100): a SIGSEGV when the write reaches
   unmapped memory, heap corruption when it does not (a later malloc aborted). A lossless JPEG
   would go to nvImageCodec's lossless decoder, a batched backend with a fallback, the case
   hr_decoder avoids; arithmetic coding it does not decode. */
static int decodable_jpeg(int32_t encoding)
{
    return encoding == NVIMGCODEC_JPEG_ENCODING_BASELINE_DCT || encoding == NVIMGCODEC_JPEG_ENCODING_EXTENDED_SEQUENTIAL_DCT_HUFFMAN;
}

/* Read the headers of n encoded images into p. For each: info[4i..4i+3] = height, width (as
 * displayed when exif is set: EXIF rotations by 90 or 270 degrees swap them), channels in the file,
 * and 1 when nvImageCodec is to decode it (else 0: the caller decodes it another way; JPEGs other
 * than sequential Huffman-coded DCT are among those). The data must stay alive and unchanged until
 * hr_decode_launch returns: the parsed streams point into it. Needs only the instance (any
 * thread). Returns 0 on allocation failure. */
int hr_parse(nvimgcodecInstance_t instance, hr_parsed* p, int n, const unsigned char* const* data, const size_t* sizes,
             int exif, int32_t* info)
{
    if (!reserve_parsed(p, n))
        return 0;
    for (int i = 0; i < n; ++i) {
        int32_t* row = info + 4 * i;
        row[0] = row[1] = row[2] = row[3] = 0;
        p->encodings[i] = 0;
        p->data[i] = data[i];
        p->sizes[i] = sizes[i];
        p->upright[i] = 0;
        /* The handle of the previous batch is reused in place (no allocation per image). */
        if (nvimgcodecCodeStreamCreateFromHostMem(instance, &p->streams[i], data[i], sizes[i], NULL) !=
            NVIMGCODEC_STATUS_SUCCESS) {
            release_handles(&p->streams[i], 1);
            continue;
        }
        nvimgcodecImageInfo_t ii;
        int h, w;
        int32_t encoding = 0;
        if (!displayed_info(p->streams[i], exif, &ii, &h, &w, &encoding)) {
            release_handles(&p->streams[i], 1);
            continue;
        }
        row[0] = h;
        row[1] = w;
        row[2] = (int32_t)(ii.num_planes > 1 ? ii.num_planes : ii.plane_info[0].num_channels);
        p->encodings[i] = encoding;
        p->upright[i] = ii.orientation.rotated % 360 == 0 && !ii.orientation.flip_x && !ii.orientation.flip_y;
        if (strcmp(ii.codec_name, "jpeg") == 0 && !decodable_jpeg(encoding)) {
            release_handles(&p->streams[i], 1); /* the size stands; the caller decodes it */
            continue;
        }
        row[3] = HR_OK;
    }
    return 1;
}

/* The image for item `it` (its source set): window r of channels uint8 per pixel into out, rows
   packed, on cuda_stream. */
static int make_image(hr_decoder* d, hr_item* it, const int32_t* r, void* out, int channels, int exif, void* cuda_stream)
{
    nvimgcodecImageInfo_t ii;
    int full_h, full_w;
    if (!displayed_info(it->source, exif, &ii, &full_h, &full_w, NULL))
        return 0;
    int rh = r[2] - r[0], rw = r[3] - r[1];
    ii.cuda_stream = (cudaStream_t)cuda_stream;
    ii.chroma_subsampling = NVIMGCODEC_SAMPLING_NONE;
    if (channels == 1) {
        ii.sample_format = NVIMGCODEC_SAMPLEFORMAT_P_Y;
        ii.color_spec = NVIMGCODEC_COLORSPEC_GRAY;
    } else {
        ii.sample_format = NVIMGCODEC_SAMPLEFORMAT_I_RGB;
        ii.color_spec = NVIMGCODEC_COLORSPEC_SRGB;
    }
    ii.num_planes = 1;
    ii.plane_info[0].struct_type = NVIMGCODEC_STRUCTURE_TYPE_IMAGE_PLANE_INFO;
    ii.plane_info[0].struct_size = sizeof(nvimgcodecImagePlaneInfo_t);
    ii.plane_info[0].height = (uint32_t)rh;
    ii.plane_info[0].width = (uint32_t)rw;
    ii.plane_info[0].num_channels = (uint32_t)channels;
    ii.plane_info[0].row_stride = (size_t)rw * (size_t)channels;
    ii.plane_info[0].sample_type = NVIMGCODEC_SAMPLE_DATA_TYPE_UINT8;
    ii.plane_info[0].precision = 0;
    ii.buffer = out;
    ii.buffer_kind = d->cpu_only ? NVIMGCODEC_IMAGE_BUFFER_KIND_STRIDED_HOST : NVIMGCODEC_IMAGE_BUFFER_KIND_STRIDED_DEVICE;
    it->image = NULL;
    return nvimgcodecImageCreate(d->instance, &it->image, &ii) == NVIMGCODEC_STATUS_SUCCESS;
}

/* *view (a handle reused between batches) becomes the window r = (y0, x0, y1, x1) of stream `whole`;
   0 (and the handle released) when it cannot. */
static int region_view(nvimgcodecCodeStream_t whole, const int32_t* r, nvimgcodecCodeStream_t* view)
{
    nvimgcodecCodeStreamView_t v;
    memset(&v, 0, sizeof(v));
    v.struct_type = NVIMGCODEC_STRUCTURE_TYPE_CODE_STREAM_VIEW;
    v.struct_size = sizeof(v);
    v.region.struct_type = NVIMGCODEC_STRUCTURE_TYPE_REGION;
    v.region.struct_size = sizeof(v.region);
    v.region.ndim = 2;
    v.region.start[0] = r[0];
    v.region.start[1] = r[1];
    v.region.end[0] = r[2];
    v.region.end[1] = r[3];
    if (nvimgcodecCodeStreamGetSubCodeStream(whole, view, &v) != NVIMGCODEC_STATUS_SUCCESS) {
        release_handles(view, 1);
        return 0;
    }
    return 1;
}

/* Item k for image j: its source (a region view in d->views[k] unless the window is the whole
   image) and its image. 0 when it cannot be set up (it stays failed). */
static int setup_item(hr_decoder* d, const hr_parsed* p, int j, int k, const int32_t* pick, const int32_t* region,
                      void* const* out, int channels, int exif, void* cuda_stream, hr_item* it)
{
    nvimgcodecCodeStream_t whole = pick[j] < p->capacity ? p->streams[pick[j]] : NULL;
    if (!whole)
        return 0;
    const int32_t* r = region + 4 * j;
    if (r[2] - r[0] < 1 || r[3] - r[1] < 1)
        return 0;
    nvimgcodecImageInfo_t ii;
    int full_h, full_w;
    if (!displayed_info(whole, exif, &ii, &full_h, &full_w, NULL))
        return 0;
    it->source = whole;
    if (r[0] != 0 || r[1] != 0 || r[2] != full_h || r[3] != full_w) {
        if (!region_view(whole, r, &d->views[k]))
            return 0;
        it->source = d->views[k];
    }
    it->j = j;
    it->full_h = full_h;
    it->area = (int64_t)(r[2] - r[0]) * (int64_t)(r[3] - r[1]);
    /* Rows are stored as displayed unless EXIF turns the image: then the window's last row says
       nothing about how far into the scan it lies, and all of it counts (and no frame is cut). */
    it->rows_as_stored = !exif || p->upright[pick[j]];
    it->bytes = (double)p->sizes[pick[j]] * (it->rows_as_stored ? (double)r[2] / (double)full_h : 1.0);
    it->hw = d->hw && !d->cpu_only && pick[j] < p->capacity && p->encodings[pick[j]] == NVIMGCODEC_JPEG_ENCODING_BASELINE_DCT;
    it->status = NVIMGCODEC_PROCESSING_STATUS_UNKNOWN;
    return make_image(d, it, r, out[j], channels, exif, cuda_stream);
}

/* The frame height to give a sequential (SOF0/SOF1) JPEG whose window ends at row `bottom` of its
   `height` rows, so that a decoder stops there: the MCU row holding row bottom - 1, plus one more
   (the window's last rows read the chroma row below them when it is upsampled smoothly). 0 when
   nothing is cut (the window reaches that far, another encoding, a frame that does not say
   `height`, or malformed headers); else *at is where the frame's height field is (2 bytes, big
   endian). Why: the hardware engines decode every row of an image whatever its window (nvJPEG's
   host Huffman decode already stops at the window's end); cut frames gave them 10-13% more
   training windows a second on the H200 (docs/benchmarks.md, issue 22). Reads no byte past size. */
int hr_frame_cut(const unsigned char* data, size_t size, int bottom, int height, size_t* at)
{
    if (size < 4 || data[0] != 0xFF || data[1] != 0xD8 || bottom < 1 || bottom > height)
        return 0;
    size_t i = 2;
    while (i + 4 <= size) {
        if (data[i] != 0xFF)
            return 0;
        unsigned marker = data[i + 1];
        if (marker == 0xFF) { /* a fill byte */
            ++i;
            continue;
        }
        size_t length = ((size_t)data[i + 2] << 8) | data[i + 3];
        if (length < 2 || i + 2 + length > size)
            return 0;
        if (marker == 0xC0 || marker == 0xC1) {
            if (length < 8)
                return 0;
            int stored = (data[i + 5] << 8) | data[i + 6];
            int components = data[i + 9];
            if (stored != height || components < 1 || length < 8 + 3 * (size_t)components)
                return 0;
            int vmax = 0;
            for (int c = 0; c < components; ++c) {
                int v = data[i + 11 + 3 * c] & 0x0F;
                if (v < 1 || v > 4)
                    return 0;
                vmax = v > vmax ? v : vmax;
            }
            int mcu = components == 1 ? 8 : 8 * vmax; /* one component: its scan's MCU is one block */
            int cut = (bottom + mcu - 1) / mcu * mcu + mcu;
            if (cut >= height)
                return 0;
            *at = i + 5;
            return cut;
        }
        if ((marker >= 0xC2 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC) || marker == 0xDA)
            return 0; /* another encoding, or the scan before any frame */
        i += 2 + length;
    }
    return 0;
}

/* The engine's share (items[0..n)) decodes from copies of their bytes with the frame cut below
   each window (hr_frame_cut), where that cuts anything and the rows are stored as displayed. An
   item whose copy cannot be set up keeps its own bytes: the cut saves time, it changes no pixel.
   The copies of a batch take at most HR_CUT_BYTES (a decoder keeps that buffer until it ends:
   ~11 MB a lane for 256 ImageNet-sized JPEGs at hw_load 0.65). */
#define HR_CUT_BYTES ((size_t)64 << 20)

static void cut_frames(hr_decoder* d, const hr_parsed* p, const int32_t* pick, const int32_t* region, int n)
{
    size_t total = 0;
    for (int i = 0; i < n; ++i) {
        hr_item* it = &d->items[i];
        int src = pick[it->j];
        const int32_t* r = region + 4 * it->j;
        it->cut = 0;
        if (!it->rows_as_stored)
            continue;
        it->cut = hr_frame_cut(p->data[src], p->sizes[src], r[2], it->full_h, &it->cut_at);
        if (it->cut && total + p->sizes[src] > HR_CUT_BYTES)
            it->cut = 0; /* past the copies' bound: the rest of the share decodes from its own bytes */
        total += it->cut ? p->sizes[src] : 0;
    }
    if (total > d->cut_capacity) {
        /* The handles may point into the old buffer: let them go before it does. */
        release_handles(d->cut_views, d->capacity);
        release_handles(d->cut_streams, d->capacity);
        free(d->cut_bytes);
        d->cut_capacity = 0;
        size_t capacity = total + total / 4 < HR_CUT_BYTES ? total + total / 4 : HR_CUT_BYTES;
        d->cut_bytes = (unsigned char*)malloc(capacity);
        if (!d->cut_bytes)
            return;
        d->cut_capacity = capacity;
    }
    size_t used = 0;
    for (int i = 0; i < n; ++i) {
        hr_item* it = &d->items[i];
        if (!it->cut)
            continue;
        int src = pick[it->j];
        const int32_t* r = region + 4 * it->j;
        unsigned char* copy = d->cut_bytes + used;
        memcpy(copy, p->data[src], p->sizes[src]);
        copy[it->cut_at] = (unsigned char)(it->cut >> 8);
        copy[it->cut_at + 1] = (unsigned char)(it->cut & 0xFF);
        used += p->sizes[src];
        if (nvimgcodecCodeStreamCreateFromHostMem(d->instance, &d->cut_streams[i], copy, p->sizes[src], NULL) !=
            NVIMGCODEC_STATUS_SUCCESS) {
            release_handles(&d->cut_streams[i], 1);
            continue;
        }
        if (region_view(d->cut_streams[i], r, &d->cut_views[i]))
            it->source = d->cut_views[i];
    }
}

/* Offered to the engine first, then the larger windows first (nvImageCodec's own order). */
static int engine_first(const void* a, const void* b)
{
    const hr_item* x = (const hr_item*)a;
    const hr_item* y = (const hr_item*)b;
    if (x->hw != y->hw)
        return y->hw - x->hw;
    return (y->area > x->area) - (y->area < x->area);
}

/* How many of items[0..k) (in engine_first order, the first `offered` of them baseline JPEGs) the
 * engine takes: the largest windows until it has `share` of the bytes the batch's windows need read.
 * Why bytes, not images: the engines and the host's Huffman decode are both bound by the bytes they
 * read, and a count hands the engine more of them where the largest windows are the largest images
 * (validation's centre crops: 0.79 of the bytes at 0.65 of the images, training's random crops 0.76;
 * at the same share of images validation's decode floor ran below training's). docs/benchmarks.md,
 * issue 22. Each item goes to the side that leaves the share nearer its target. */
static int engine_count(const hr_item* items, int k, int offered, float share)
{
    share = share < 0.0f ? 0.0f : share > 1.0f ? 1.0f : share;
    double total = 0.0;
    for (int i = 0; i < k; ++i)
        total += items[i].bytes;
    double target = (double)share * total, taken = 0.0;
    int n = 0;
    while (n < offered && taken + 0.5 * items[n].bytes <= target)
        taken += items[n++].bytes;
    return n;
}

/* engine_count over k <= 64 items of these `bytes` (in engine_first order), for the tests; -1 past 64. */
int hr_engine_count(const double* bytes, int k, int offered, float share)
{
    hr_item items[64];
    if (k < 0 || k > 64)
        return -1;
    for (int i = 0; i < k; ++i)
        items[i].bytes = bytes[i];
    return engine_count(items, k, offered, share);
}

/* Start decoding items[0..n) with dec: NULL when nothing was started (each item then failed). */
static nvimgcodecFuture_t start(hr_decoder* d, nvimgcodecDecoder_t dec, hr_item* items, int n, const nvimgcodecDecodeParams_t* params)
{
    if (n <= 0)
        return NULL;
    nvimgcodecCodeStream_t* sources = d->sources + (items - d->items);
    nvimgcodecImage_t* images = d->images + (items - d->items);
    for (int i = 0; i < n; ++i) {
        sources[i] = items[i].source;
        images[i] = items[i].image;
        items[i].status = NVIMGCODEC_PROCESSING_STATUS_FAIL;
    }
    nvimgcodecFuture_t future = NULL;
    if (nvimgcodecDecoderDecode(dec, sources, images, n, params, &future) != NVIMGCODEC_STATUS_SUCCESS)
        return NULL;
    return future;
}

/* Wait for a started call; each item's status. */
static void finish(hr_decoder* d, nvimgcodecFuture_t future, hr_item* items, int n)
{
    if (!future)
        return;
    nvimgcodecFutureWaitForAll(future);
    nvimgcodecProcessingStatus_t* status = d->status + (items - d->items);
    size_t count = (size_t)n;
    if (nvimgcodecFutureGetProcessingStatus(future, status, &count) == NVIMGCODEC_STATUS_SUCCESS)
        for (size_t i = 0; i < count && i < (size_t)n; ++i)
            items[i].status = status[i];
    nvimgcodecFutureDestroy(future);
}

static double now(void);

/* Decode m of the images parsed into p: pick[j] is the index given to hr_parse, region[4j..4j+3] the
 * window y0, x0, y1, x1 to decode (in displayed coordinates when exif; the whole image is just the
 * full window), out[j] the buffer for its (y1-y0) x (x1-x0) x channels uint8 pixels, rows packed.
 * channels is 3 (RGB) or 1 (gray). Work goes on cuda_stream. status[j] = 1 when decoded, else
 * nvImageCodec's processing status (or 0 when the image could not be set up). Blocks until the host
 * part of the decode is done; the device part is ordered on cuda_stream. Returns 0 when no decode
 * call could be made (nothing decoded), else 1. */
static int decode_batch(hr_decoder* d, const hr_parsed* p, int m, const int32_t* pick, const int32_t* region, void* const* out,
                        int channels, int exif, void* cuda_stream, int32_t* status)
{
    if (!reserve(d, m))
        return 0;
    int k = 0, offered = 0;
    for (int j = 0; j < m; ++j) {
        status[j] = 0;
        hr_item* it = &d->items[k];
        memset(it, 0, sizeof(*it));
        if (setup_item(d, p, j, k, pick, region, out, channels, exif, cuda_stream, it)) {
            offered += it->hw != 0;
            ++k;
        }
    }
    if (k == 0)
        return 1;
    int n_hw = 0, n_gpu = 0;
    if (offered) {
        qsort(d->items, (size_t)k, sizeof(hr_item), engine_first);
        n_hw = engine_count(d->items, k, offered, d->hw_share);
        for (int i = 0; i < n_hw; ++i)
            d->items[i].hw = 2;
        if (d->cut_frames && n_hw)
            cut_frames(d, p, pick, region, n_hw);
    }
    nvimgcodecDecodeParams_t params;
    memset(&params, 0, sizeof(params));
    params.struct_type = NVIMGCODEC_STRUCTURE_TYPE_DECODE_PARAMS;
    params.struct_size = sizeof(params);
    params.apply_exif_orientation = exif;
    /* gpu's share comes after the engine's in engine_first order: the windows offered to the engine
       and not given to it (baseline JPEGs), largest first, then the others, largest first. A start()
       that fails leaves its items failed (status FAIL), the others decode: ok says a call was made. */
    if (d->gpu) {
        if (!offered) /* no engine share: the windows were not sorted */
            qsort(d->items, (size_t)k, sizeof(hr_item), engine_first);
        n_gpu = (int)(d->gpu_share * (float)k + 0.5f);
        n_gpu = n_gpu < k - n_hw ? n_gpu : k - n_hw;
    }
    /* The CUDA decoders' shares run in their threads while the engine decodes its share here. */
    int n_rest = k - n_hw - n_gpu;
    nvimgcodecFuture_t rest = start(d, d->cuda, d->items + n_hw + n_gpu, n_rest, &params);
    nvimgcodecFuture_t on_gpu = start(d, d->gpu, d->items + n_hw, n_gpu, &params);
    int ok = rest != NULL || on_gpu != NULL || k - n_hw == 0;
    if (n_hw) {
        nvimgcodecFuture_t engine = start(d, d->hw, d->items, n_hw, &params);
        finish(d, engine, d->items, n_hw);
        ok |= engine != NULL;
    }
    double t0 = now();
    finish(d, on_gpu, d->items + n_hw, n_gpu);
    finish(d, rest, d->items + n_hw + n_gpu, n_rest);
    double waited = now() - t0;
    if (n_hw && d->adaptive && k > n_hw) {
        /* Waiting on the CUDA decoder: the engine can take more; no wait: it may be the slower. */
        d->hw_share += waited > 0.002 ? 0.01f : -0.005f;
        d->hw_share = d->hw_share < 0.0f ? 0.0f : d->hw_share > 1.0f ? 1.0f : d->hw_share;
    }
    /* What the engine failed, the CUDA decoder tries (new images: a failed one is not reused). */
    int retry = 0, unsupported = 0;
    for (int i = 0; i < n_hw; ++i) {
        hr_item* it = &d->items[i];
        if (it->status == NVIMGCODEC_PROCESSING_STATUS_SUCCESS)
            continue;
        unsupported += it->status == NVIMGCODEC_PROCESSING_STATUS_CODEC_UNSUPPORTED;
        nvimgcodecImageDestroy(it->image);
        it->image = NULL;
        if (make_image(d, it, region + 4 * it->j, out[it->j], channels, exif, cuda_stream)) {
            hr_item moved = *it;
            *it = d->items[retry];
            d->items[retry++] = moved;
        }
    }
    if (n_hw && unsupported == n_hw)
        d->hw_share = 0.0f; /* no engine on this GPU: nvImageCodec has no hardware JPEG decoder here */
    if (retry) {
        nvimgcodecFuture_t again = start(d, d->cuda, d->items, retry, &params);
        finish(d, again, d->items, retry);
        ok |= again != NULL;
    }
    for (int i = 0; i < k; ++i) {
        hr_item* it = &d->items[i];
        if (it->image) {
            status[it->j] = (int32_t)it->status;
            nvimgcodecImageDestroy(it->image);
            it->image = NULL;
        }
    }
    return ok;
}

/* ---- Decode, then launch: the lane's whole batch in one GIL-free call ----
 *
 * Why: after a decode returns, each CUDA call a Python thread makes (a copy, a launch, an event)
 * drops the GIL and waits to take it back, up to the switch interval (5 ms) when another thread
 * runs Python; with two lanes those waits cost 2-10 ms a batch on the H100 (ops/README.md). Here
 * the wait for the buffers' last reader, the decode, the tables' copy, the kernel, the labels' copy
 * and the event are one call, and the lane takes the GIL back once.
 *
 * The CUDA driver is resolved from libcuda at first use (not linked), so the shim still loads,
 * and decodes, where it is missing; the caller launches from Python then. The calling thread's
 * current context must be the device's primary context (CUDA runtime calls on it set that). */
typedef int (*hr_cu_launch)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**, void**);
typedef int (*hr_cu_copy)(unsigned long long, const void*, size_t, void*);
typedef int (*hr_cu_event)(void*, void*);
typedef int (*hr_cu_sync)(void*);
typedef int (*hr_cu_memset)(unsigned long long, unsigned char, size_t, void*);

static struct {
    int loaded;
    hr_cu_launch launch;
    hr_cu_copy copy;
    hr_cu_event record;
    hr_cu_sync sync;
    hr_cu_memset memset;
} driver;

/* 1 when the driver's entry points resolved (once per process; the caller serialises the first call). */
int hr_driver_load(char* err, size_t errlen)
{
    if (driver.loaded)
        return driver.loaded > 0;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib) {
        driver.launch = (hr_cu_launch)dlsym(lib, "cuLaunchKernel");
        driver.copy = (hr_cu_copy)dlsym(lib, "cuMemcpyHtoDAsync_v2");
        driver.record = (hr_cu_event)dlsym(lib, "cuEventRecord");
        driver.sync = (hr_cu_sync)dlsym(lib, "cuEventSynchronize");
        driver.memset = (hr_cu_memset)dlsym(lib, "cuMemsetD8Async");
    }
    driver.loaded = (lib && driver.launch && driver.copy && driver.record && driver.sync && driver.memset) ? 1 : -1;
    if (driver.loaded < 0 && err && errlen)
        snprintf(err, errlen, "the CUDA driver's entry points did not resolve: %s", lib ? "missing symbols" : dlerror());
    return driver.loaded > 0;
}

/* What follows the decode. Addresses are device pointers (copies' destinations), host pointers
   (their sources, pinned) or CUDA handles (function, events), all as the caller's Python saw them. */
typedef struct {
    void* wait_event;     /* host-wait for it before decoding (the last reader of the output buffers), or NULL */
    void* function;       /* the kernel; NULL: decode only */
    unsigned grid[3];
    unsigned block[3];
    void** params;        /* the kernel's arguments, as cuLaunchKernel takes them */
    unsigned long long copy_dst[2]; /* [0] before the kernel (its tables), [1] after it (e.g. labels) */
    const void* copy_src[2];
    size_t copy_size[2];  /* 0: no copy */
    void* event;          /* recorded after the kernel, or NULL */
    /* The fused kernel's tables (ops/cuda/_kernels.py), filled here before copy 0 when meta_src is
       set, so the lane's Python copies no arrays (NumPy gives up the GIL for copies of more than a
       few hundred elements): in the pinned block `tables`, each image's address (uint64) at 0, its
       meta row (8 int32: meta_src's, with the row stride put in column 2) at meta_offset, its geo
       row (8 float32) at geo_offset, and its label (int64, when labels_src is set) at labels_offset. */
    unsigned char* tables;
    size_t meta_offset, geo_offset, labels_offset;
    const int32_t* meta_src;
    const float* geo_src;
    const int64_t* labels_src;
    double seconds[3];    /* out: waiting, decoding, launching */
    int cuda_error;       /* out: the driver's error code when a call failed, else 0 */
} hr_launch;

static void fill_tables(const hr_launch* l, int m, const int32_t* region, void* const* out, int channels)
{
    uint64_t* ptrs = (uint64_t*)l->tables;
    int32_t* meta = (int32_t*)(l->tables + l->meta_offset);
    for (int j = 0; j < m; ++j)
        ptrs[j] = (uint64_t)(uintptr_t)out[j];
    memcpy(meta, l->meta_src, sizeof(int32_t) * 8 * (size_t)m);
    for (int j = 0; j < m; ++j)
        meta[8 * j + 2] = (region[4 * j + 3] - region[4 * j + 1]) * channels; /* rows are packed */
    memcpy(l->tables + l->geo_offset, l->geo_src, sizeof(float) * 8 * (size_t)m);
    if (l->labels_src)
        memcpy(l->tables + l->labels_offset, l->labels_src, sizeof(int64_t) * (size_t)m);
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int after_decode(hr_launch* l, void* stream)
{
    int e = 0;
    if (l->copy_size[0])
        e = driver.copy(l->copy_dst[0], l->copy_src[0], l->copy_size[0], stream);
    if (!e)
        e = driver.launch(l->function, l->grid[0], l->grid[1], l->grid[2], l->block[0], l->block[1], l->block[2], 0, stream,
                          l->params, NULL);
    if (!e && l->copy_size[1])
        e = driver.copy(l->copy_dst[1], l->copy_src[1], l->copy_size[1], stream);
    if (!e && l->event)
        e = driver.record(l->event, stream);
    return e;
}

/* decode_batch, preceded by a host wait on l->wait_event and followed, when every image decoded, by
 * the copies, the kernel and the event of l, all on cuda_stream. Returns 0 when the decode call
 * failed as a whole, 1 when it decoded but launched nothing (an image failed, no function, or
 * l->cuda_error says a driver call failed), 2 when the kernel was launched. */
int hr_decode_launch(hr_decoder* d, const hr_parsed* p, int m, const int32_t* pick, const int32_t* region, void* const* out,
                     int channels, int exif, void* cuda_stream, int32_t* status, hr_launch* l)
{
    double t0 = now();
    l->cuda_error = 0;
    if (l->wait_event && driver.loaded > 0)
        l->cuda_error = driver.sync(l->wait_event);
    double t1 = now();
    int ok = l->cuda_error ? 0 : decode_batch(d, p, m, pick, region, out, channels, exif, cuda_stream, status);
    double t2 = now();
    int launched = 0;
    l->seconds[2] = 0.0;
    if (ok && l->function && driver.loaded > 0) {
        int all = 1;
        for (int j = 0; j < m; ++j)
            all &= status[j] == 1;
        if (all) {
            if (l->meta_src)
                fill_tables(l, m, region, out, channels);
            l->cuda_error = after_decode(l, cuda_stream);
            launched = !l->cuda_error;
            l->seconds[2] = now() - t2;
        }
    }
    l->seconds[0] = t1 - t0;
    l->seconds[1] = t2 - t1;
    return ok ? 1 + launched : 0;
}

#define HR_SPACES 5       /* address spaces of a plan (ops/cuda/_plan.py); 0 is real addresses */
#define HR_SPACE_SHIFT 56

/* One step of a plan: a kernel launch, or (function NULL) zeroing `size` bytes at device address `dst`. */
typedef struct {
    void* function;
    unsigned grid[3];
    unsigned block[3];
    void** params;
    unsigned long long dst;
    size_t size;
} hr_step;

/* A batch's post-op work as data (ops/cuda/_plan.py): host-wait for wait_event (the last reader of
   the pinned block), copy `size` bytes of tables from `src` into the pinned block `pinned` and up to
   `device`, run the steps in order, record the events; all on `stream`, in one call without the GIL:
   from Python each of these calls would drop the GIL and wait to take it back.
   A plan may have been built before its memory existed (in the prep thread): its addresses are then
   named, (space << 56) | offset, and made real here from `bases` (space 0, a real address or NULL,
   is left alone). They are the runs `relocs` of the tables (offset in bytes, count), the argument
   `values` (in place) and the zeroing steps' `dst`. */
typedef struct {
    void* wait_event;
    const void* src;
    void* pinned;
    unsigned long long device;
    size_t size;
    const hr_step* steps;
    int n_steps;
    void* events[2];      /* recorded after the steps (NULL: none) */
    int cuda_error;       /* out: the driver's error code when a call failed, else 0 */
    const unsigned long long* relocs;
    int n_relocs;
    unsigned long long* values;
    int n_values;
    unsigned long long bases[HR_SPACES];
} hr_plan;

static unsigned long long relocated(unsigned long long v, const unsigned long long* bases)
{
    unsigned long long space = v >> HR_SPACE_SHIFT;
    return space > 0 && space < HR_SPACES ? bases[space] + (v & ((1ULL << HR_SPACE_SHIFT) - 1)) : v;
}

/* The tables copied from `src` into the pinned block, and the plan's named addresses made real there
   and in its argument values (needs no driver: tests/ops/test_cuda_plan.py calls it on its own). */
void hr_relocate_plan(hr_plan* plan)
{
    for (int i = 0; i < plan->n_values; ++i)
        plan->values[i] = relocated(plan->values[i], plan->bases);
    if (!plan->size)
        return;
    memcpy(plan->pinned, plan->src, plan->size);
    for (int r = 0; r < plan->n_relocs; ++r) {
        unsigned long long* run = (unsigned long long*)((char*)plan->pinned + plan->relocs[2 * r]);
        for (unsigned long long j = 0; j < plan->relocs[2 * r + 1]; ++j)
            run[j] = relocated(run[j], plan->bases);
    }
}

/* 1 when every call succeeded; else 0, with plan->cuda_error set (the steps after it not issued). */
int hr_run_plan(hr_plan* plan, void* stream)
{
    int e = 0;
    if (driver.loaded <= 0) {
        plan->cuda_error = -1;
        return 0;
    }
    if (plan->wait_event)
        e = driver.sync(plan->wait_event);
    if (!e)
        hr_relocate_plan(plan);
    if (!e && plan->size)
        e = driver.copy(plan->device, plan->pinned, plan->size, stream);
    for (int i = 0; !e && i < plan->n_steps; ++i) {
        const hr_step* s = &plan->steps[i];
        if (s->function)
            e = driver.launch(s->function, s->grid[0], s->grid[1], s->grid[2], s->block[0], s->block[1], s->block[2], 0,
                              stream, s->params, NULL);
        else
            e = driver.memset(relocated(s->dst, plan->bases), 0, s->size, stream);
    }
    for (int k = 0; !e && k < 2; ++k)
        if (plan->events[k])
            e = driver.record(plan->events[k], stream);
    plan->cuda_error = e;
    return !e;
}

/* Whether the engine's share decodes from frames cut below their windows (cut_frames). */
void hr_decoder_set_cut_frames(hr_decoder* d, int on)
{
    d->cut_frames = on;
}

/* The engine's share the decoder gives now (hw_load, or where "adaptive" has moved it; 0 once no
   engine was found). */
float hr_decoder_hw_share(const hr_decoder* d)
{
    return d->hw ? d->hw_share : 0.0f;
}

void hr_decoder_destroy(hr_decoder* d)
{
    if (!d)
        return;
    release_handles(d->views, d->capacity);
    release_handles(d->cut_views, d->capacity);
    release_handles(d->cut_streams, d->capacity);
    free(d->cut_bytes);
    free(d->cut_streams);
    free(d->cut_views);
    if (d->hw)
        nvimgcodecDecoderDestroy(d->hw);
    if (d->gpu)
        nvimgcodecDecoderDestroy(d->gpu);
    nvimgcodecDecoderDestroy(d->cuda);
    free(d->views);
    free(d->items);
    free(d->sources);
    free(d->images);
    free(d->status);
    free(d);
}
