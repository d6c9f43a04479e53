/* The bytes objects that hold a shard reader's sample fields, recycled once nobody else holds them.
 *
 * Why: a shard's parser thread copies each member out of the mapped shard or the downloaded block
 * into a fresh bytes object (its own glibc arena), and the consumer frees it later on another
 * thread. Behind a shuffle buffer each parser thread's arena grew to the buffer's size (RSS ~270
 * against ~120 MB), and freeing 64 KiB and larger chunks trims the arena, so the next copies fault
 * their pages in again: with or without a buffer, most of the copy's cost was page faults and
 * malloc, not the copy. Here the blobs handed out are remembered; one whose only reference left is
 * the pool's (Py_REFCNT == 1: no sample, view, array or buffer export holds it) is reused for a
 * later member of its size class, its pages already faulted in.
 *
 * Reuse writes into a bytes object, which Python otherwise never changes; that is safe only because
 * nothing else can reach it (the pool's reference is its last, and the pool gives it to no one
 * until it is reused): it is what freeing it and allocating a new one at the same address would
 * be. Its cached hash is reset and its size set to the member's (the capacity is its class's).
 *
 * Every call holds the GIL (ctypes.PyDLL), and lets it go only around the copies, which touch
 * nothing but the blobs being filled (referenced by the list being built, so no other call reuses
 * them) and the caller's spans. Bounds: the pool follows at most `track` blobs handed out (the
 * oldest is forgotten, then freed by whoever holds it last), and keeps at most as many bytes free
 * as the blobs it follows held at their peak.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifdef Py_GIL_DISABLED
#error "the sample pool relies on the GIL" /* a free-threaded build copies into fresh bytes instead */
#endif

#define PAGE 4096
#define SMALL (64 << 10)   /* up to here, classes a page apart */
#define LARGEST (16 << 20) /* larger members are not pooled */
#define N_CLASSES (16 + 8 * 8)
#ifndef BUDGET_A
#define BUDGET_A 4
#endif

/* The size class of a member of `size` bytes (1 to LARGEST) and its capacity: pages up to 64 KiB,
 * then eight classes a doubling (at most 1/8 more than the member needs). */
static int class_of(int64_t size, int64_t* capacity)
{
    if (size <= SMALL) {
        int64_t pages = (size + PAGE - 1) / PAGE;
        *capacity = pages * PAGE;
        return (int)pages - 1;
    }
    int p = 63 - __builtin_clzll((unsigned long long)(size - 1)); /* 2^p < size <= 2^(p+1) */
    int64_t step = (int64_t)1 << (p - 3);
    int64_t k = (size + step - 1) / step; /* 9 to 16 */
    *capacity = k * step;
    return 16 + (p - 16) * 8 + (int)(k - 9);
}

typedef struct {
    PyObject* blob;
    int64_t capacity;
    int cls;
} Held;

typedef struct {
    Held* ring; /* blobs handed out, oldest first from head */
    int64_t track, head, count;
    PyObject** stock[N_CLASSES]; /* free blobs of each class, the most recently freed last */
    int64_t stocked[N_CLASSES], room[N_CLASSES];
    int64_t stock_bytes, held_bytes, peak_held;
    int64_t hits, misses;
} Pool;

void* hr_pool_new(int64_t track)
{
    Pool* pool = PyMem_Calloc(1, sizeof(Pool));
    if (pool == NULL)
        return NULL;
    pool->track = track > 0 ? track : 1;
    pool->ring = PyMem_Calloc((size_t)pool->track, sizeof(Held));
    if (pool->ring == NULL) {
        PyMem_Free(pool);
        return NULL;
    }
    return pool;
}

/* A blob nobody else holds goes to its class's stock (freed instead where that cannot grow). */
static void to_stock(Pool* pool, Held h)
{
    if (pool->stocked[h.cls] == pool->room[h.cls]) {
        int64_t room = pool->room[h.cls] ? 2 * pool->room[h.cls] : 16;
        PyObject** grown = PyMem_Realloc(pool->stock[h.cls], sizeof(PyObject*) * (size_t)room);
        if (grown == NULL) {
            Py_DECREF(h.blob);
            return;
        }
        pool->stock[h.cls] = grown;
        pool->room[h.cls] = room;
    }
    pool->stock[h.cls][pool->stocked[h.cls]++] = h.blob;
    pool->stock_bytes += h.capacity;
}

static Held pop_oldest(Pool* pool)
{
    Held h = pool->ring[pool->head];
    pool->head = (pool->head + 1) % pool->track;
    pool->count--;
    pool->held_bytes -= h.capacity;
    return h;
}

static void push_newest(Pool* pool, Held h)
{
    pool->ring[(pool->head + pool->count) % pool->track] = h;
    pool->count++;
    pool->held_bytes += h.capacity;
    if (pool->held_bytes > pool->peak_held)
        pool->peak_held = pool->held_bytes;
}

/* Look at up to `budget` of the oldest blobs handed out: those released go to the stock, the
 * others to the back of the line. */
static void reclaim(Pool* pool, int64_t budget)
{
    for (int64_t k = 0; k < budget && pool->count > 0; k++) {
        Held h = pop_oldest(pool);
        if (Py_REFCNT(h.blob) == 1)
            to_stock(pool, h);
        else
            push_newest(pool, h);
    }
}

static int64_t capacity_of(int cls)
{
    if (cls < 16)
        return (int64_t)(cls + 1) * PAGE;
    int p = 16 + (cls - 16) / 8;
    return (int64_t)(9 + (cls - 16) % 8) << (p - 3);
}

/* Free the coldest blobs of the stock's fullest class until the stock holds no more than the
 * blobs followed held at their peak. */
static void trim(Pool* pool)
{
    while (pool->stock_bytes > pool->peak_held) {
        int fullest = -1;
        int64_t most = 0;
        for (int c = 0; c < N_CLASSES; c++) {
            int64_t bytes = pool->stocked[c] * capacity_of(c);
            if (bytes > most) {
                most = bytes;
                fullest = c;
            }
        }
        if (fullest < 0)
            return;
        PyObject* coldest = pool->stock[fullest][0];
        pool->stocked[fullest]--;
        memmove(pool->stock[fullest], pool->stock[fullest] + 1, sizeof(PyObject*) * (size_t)pool->stocked[fullest]);
        pool->stock_bytes -= capacity_of(fullest);
        Py_DECREF(coldest);
    }
}

/* A blob for a member of `size` bytes: reused from the stock, or new; followed unless too large. */
static PyObject* blob_for(Pool* pool, int64_t size)
{
    if (size <= 0 || size > LARGEST)
        return PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    int64_t capacity;
    int cls = class_of(size, &capacity);
    PyObject* blob;
    if (pool->stocked[cls] > 0) {
        blob = pool->stock[cls][--pool->stocked[cls]];
        pool->stock_bytes -= capacity;
        pool->hits++;
    } else {
        blob = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)capacity);
        if (blob == NULL)
            return NULL;
        pool->misses++;
    }
    Py_SET_SIZE(blob, (Py_ssize_t)size);
    PyBytes_AS_STRING(blob)[size] = '\0';
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
    ((PyBytesObject*)blob)->ob_shash = -1; /* another member's bytes: its hash is not known yet */
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
    if (pool->count == pool->track) { /* forget the oldest: freed by whoever holds it last */
        Held oldest = pop_oldest(pool);
        if (Py_REFCNT(oldest.blob) == 1)
            to_stock(pool, oldest);
        else
            Py_DECREF(oldest.blob);
    }
    Py_INCREF(blob);
    push_newest(pool, (Held){blob, capacity, cls});
    return blob;
}

/* A bytes object of each span's bytes (sizes[i] bytes at address sources[i]), in a list; NULL with
 * MemoryError set. The spans' memory must stay valid until this returns. */
PyObject* hr_pool_copy(void* handle, int n, const uint64_t* sources, const int64_t* sizes)
{
    Pool* pool = handle;
    reclaim(pool, BUDGET_A * (int64_t)n + 64);
    PyObject* blobs = PyList_New(n);
    char** outs = PyMem_Malloc(sizeof(char*) * (size_t)(n > 0 ? n : 1));
    if (blobs == NULL || outs == NULL) {
        Py_XDECREF(blobs);
        PyMem_Free(outs);
        return PyErr_NoMemory();
    }
    for (int i = 0; i < n; i++) {
        PyObject* blob = blob_for(pool, sizes[i]);
        if (blob == NULL) { /* the blobs made so far go back to the stock at the next reclaim */
            Py_DECREF(blobs);
            PyMem_Free(outs);
            return NULL;
        }
        outs[i] = PyBytes_AS_STRING(blob);
        PyList_SET_ITEM(blobs, i, blob);
    }
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < n; i++)
        memcpy(outs[i], (const char*)(uintptr_t)sources[i], (size_t)sizes[i]);
    Py_END_ALLOW_THREADS
    PyMem_Free(outs);
    trim(pool);
    return blobs;
}

/* Blobs followed, blobs and bytes in stock, the followed blobs' peak bytes, reuses, new blobs. */
void hr_pool_stats(void* handle, int64_t* out)
{
    Pool* pool = handle;
    int64_t stocked = 0;
    for (int c = 0; c < N_CLASSES; c++)
        stocked += pool->stocked[c];
    int64_t values[6] = {pool->count, stocked, pool->stock_bytes, pool->peak_held, pool->hits, pool->misses};
    memcpy(out, values, sizeof(values));
}

/* Drop the pool's references: the stock is freed, blobs still held live on with their holders. */
void hr_pool_free(void* handle)
{
    Pool* pool = handle;
    while (pool->count > 0)
        Py_DECREF(pop_oldest(pool).blob);
    for (int c = 0; c < N_CLASSES; c++) {
        for (int64_t i = 0; i < pool->stocked[c]; i++)
            Py_DECREF(pool->stock[c][i]);
        PyMem_Free(pool->stock[c]);
    }
    PyMem_Free(pool->ring);
    PyMem_Free(pool);
}
