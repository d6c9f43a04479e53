/* The bytes objects that hold a shard reader's sample fields, recycled once nobody else holds them
 * (and the TFRecord and Caffe readers': hr_tf_examples and hr_datums, near the end).
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

#include "caffe_datum.h"
#include "tf_example.h"

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

/* One blob of `size` bytes, to be filled by the caller before anyone else sees it: the files
 * reader's reads (read_files.c's hr_read_chunk takes this function's address, and calls it with
 * the GIL held). NULL with MemoryError set. */
PyObject* hr_pool_blob(void* handle, int64_t size)
{
    Pool* pool = handle;
    reclaim(pool, BUDGET_A);
    PyObject* blob = blob_for(pool, size);
    trim(pool);
    return blob;
}

/* `plain` members' names are ASCII: Python's str.lower() on them is this. */
static char ascii_lower(char c)
{
    return (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
}

/* A member's field name as Python names it: the name's text after the key's dot, lowercased.
 * NULL with an exception set. */
static PyObject* field_name(const char* header, int64_t name_length, int64_t key_length)
{
    char lower[100];
    int64_t length = name_length - key_length - 1;
    for (int64_t i = 0; i < length; i++)
        lower[i] = ascii_lower(header[key_length + 1 + i]);
    return PyUnicode_DecodeASCII(lower, (Py_ssize_t)length, NULL);
}

/* Whether two members' field names are one name once lowercased. */
static int same_field(const char* a, const int64_t* ra, const char* b, const int64_t* rb)
{
    int64_t length = ra[3] - ra[4] - 1;
    if (length != rb[3] - rb[4] - 1)
        return 0;
    for (int64_t i = 0; i < length; i++)
        if (ascii_lower(a[ra[4] + 1 + i]) != ascii_lower(b[rb[4] + 1 + i]))
            return 0;
    return 1;
}

static int same_key(const char* base, const int64_t* ra, const int64_t* rb)
{
    return ra[4] == rb[4] && memcmp(base + ra[0], base + rb[0], (size_t)ra[4]) == 0;
}

typedef struct {
    char* to;
    const char* from;
    int64_t size;
} Copy;

/* The copies, with the GIL let go: they touch only blobs nobody else can reach yet and the
 * caller's spans. */
static void copy_all(const Copy* copies, int n)
{
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < n; i++)
        memcpy(copies[i].to, copies[i].from, (size_t)copies[i].size);
    Py_END_ALLOW_THREADS
}

/* A member's data as its field's value: a pooled blob to be filled (its copy added to `copies`)
 * from `span_min` bytes on, a bytes object made at once below. NULL with an exception set. */
static PyObject* member_value(Pool* pool, const char* data, int64_t size, int64_t span_min, Copy* copies, int* n_copies)
{
    if (size < span_min)
        return PyBytes_FromStringAndSize(data, (Py_ssize_t)size);
    PyObject* blob = blob_for(pool, size);
    if (blob != NULL)
        copies[(*n_copies)++] = (Copy){PyBytes_AS_STRING(blob), data, size};
    return blob;
}

/* The samples of a window of whole tar members: `records` are hr_tar_scan's six numbers a member
 * (header offset in the window at `base`, size, type flag, name length, key length, plain), `n`
 * of them. Consecutive members of one key make a sample, as the parser's Python loop groups them;
 * here the keys and field names are made and the data copied into the pool's blobs in one call,
 * the GIL let go around the copies: the parser thread holds the GIL for this, and on a busy GPU
 * host its Python per sample set the shard reader's pace (docs/benchmarks.md, fortieth session).
 *
 * The members continuing the caller's open sample (key `open_key`) go into `open_fields` (skipped
 * where it is None: a sample not selected, or one already failed). Each sample that starts here
 * gets the next ordinal after `ordinal`, and `select(ordinal)` (unless None) says whether it is
 * read: a list of (key, fields or None) comes back, one a sample started. Py_None comes back, and
 * nothing is changed, where a member is not plain (`key.field` in ASCII, a regular file, a safe
 * path) or a sample would hold a field twice: the caller's loop reads that window. NULL with an
 * exception set (MemoryError, or select's own). */
PyObject* hr_tar_groups(void* handle, const char* base, const int64_t* records, int n, int64_t span_min,
                        PyObject* select, int64_t ordinal, PyObject* open_key, PyObject* open_fields)
{
    Pool* pool = handle;
    const char* open_text = NULL;
    Py_ssize_t open_length = 0;
    if (open_key != Py_None) {
        open_text = PyUnicode_AsUTF8AndSize(open_key, &open_length);
        if (open_text == NULL) { /* a key the Python loop made from undecodable bytes: no plain key is it */
            PyErr_Clear();
            open_length = -1;
        }
    }
    /* First pass, nothing changed: every member plain, no field twice in a sample. */
    int continuing = 0; /* members at the start that belong to the open sample */
    for (int i = 0; i < n; i++) {
        const int64_t* r = records + 6 * i;
        if (!r[5])
            Py_RETURN_NONE;
        int starts = i == 0 ? !(open_text != NULL && r[4] == open_length && memcmp(base + r[0], open_text, (size_t)open_length) == 0)
                            : !same_key(base, r - 6, r);
        if (i == continuing && !starts)
            continuing++;
        for (int j = i - 1; j >= 0 && same_key(base, records + 6 * j, r); j--) /* the sample's members before it */
            if (same_field(base + records[6 * j], records + 6 * j, base + r[0], r))
                Py_RETURN_NONE;
        if (i < continuing && open_fields != Py_None) {
            PyObject* name = field_name(base + r[0], r[3], r[4]);
            if (name == NULL)
                return NULL;
            int there = PyDict_Contains(open_fields, name);
            Py_DECREF(name);
            if (there != 0)
                return there < 0 ? NULL : Py_NewRef(Py_None);
        }
    }
    /* Second pass: the values made, the samples listed; then the copies, the GIL let go. */
    Copy* copies = PyMem_Malloc(sizeof(Copy) * (size_t)(n > 0 ? n : 1));
    PyObject* samples = PyList_New(0);
    if (copies == NULL || samples == NULL) {
        PyMem_Free(copies);
        Py_XDECREF(samples);
        return PyErr_NoMemory();
    }
    reclaim(pool, BUDGET_A * (int64_t)n + 64);
    int n_copies = 0;
    PyObject* fields = open_fields; /* borrowed: the sample the members go into, or None */
    for (int i = 0; i < n; i++) {
        const int64_t* r = records + 6 * i;
        const char* header = base + r[0];
        if (i >= continuing && (i == continuing || !same_key(base, r - 6, r))) {
            ordinal++;
            int wanted = 1;
            if (select != Py_None) {
                PyObject* answer = PyObject_CallFunction(select, "L", (long long)ordinal);
                wanted = answer == NULL ? -1 : PyObject_IsTrue(answer);
                Py_XDECREF(answer);
                if (wanted < 0)
                    goto fail;
            }
            PyObject* key = PyUnicode_DecodeASCII(header, (Py_ssize_t)r[4], NULL);
            PyObject* sample = key == NULL ? NULL : Py_BuildValue("(NN)", key, wanted ? PyDict_New() : Py_NewRef(Py_None));
            if (sample == NULL || PyList_Append(samples, sample) < 0) {
                Py_XDECREF(sample);
                goto fail;
            }
            fields = PyTuple_GET_ITEM(sample, 1);
            Py_DECREF(sample); /* the list holds it */
        }
        if (fields == Py_None)
            continue;
        PyObject* name = field_name(header, r[3], r[4]);
        PyObject* value = name == NULL ? NULL : member_value(pool, header + 512, r[1], span_min, copies, &n_copies);
        int stored = value == NULL ? -1 : PyDict_SetItem(fields, name, value);
        Py_XDECREF(name);
        Py_XDECREF(value);
        if (stored < 0)
            goto fail;
    }
    copy_all(copies, n_copies);
    PyMem_Free(copies);
    trim(pool);
    return samples;
fail:
    PyMem_Free(copies);
    Py_DECREF(samples);
    return NULL;
}

/* What a chunk's scan keeps: each record's findings, whether it is plain, the copies to make. */
typedef struct {
    void* found;
    char* plain;
    Copy* copies;
    int n_copies;
    PyObject* out;
} Scan;

/* Room for `n` records' findings of `found_size` bytes and up to `max_copies` copies, and the list
 * of `n` to hand back; 0 with MemoryError set. */
static int scan_begin(Scan* scan, int n, size_t found_size, int max_copies)
{
    scan->found = PyMem_Malloc(found_size * (size_t)(n > 0 ? n : 1));
    scan->plain = PyMem_Malloc((size_t)(n > 0 ? n : 1));
    scan->copies = PyMem_Malloc(sizeof(Copy) * (size_t)(max_copies > 0 ? max_copies : 1));
    scan->n_copies = 0;
    scan->out = PyList_New(n);
    if (scan->found == NULL || scan->plain == NULL || scan->copies == NULL || scan->out == NULL) {
        Py_CLEAR(scan->out);
        return 0;
    }
    return 1;
}

/* The list, once every copy is made with the GIL let go (`failed`: NULL instead, the blobs made so
 * far going back to the stock at the next reclaim); the scan's memory freed either way. */
static PyObject* scan_end(Pool* pool, Scan* scan, int failed)
{
    if (failed) {
        Py_CLEAR(scan->out);
    } else {
        copy_all(scan->copies, scan->n_copies);
        trim(pool);
    }
    PyMem_Free(scan->found);
    PyMem_Free(scan->plain);
    PyMem_Free(scan->copies);
    if (scan->out == NULL && !PyErr_Occurred())
        PyErr_NoMemory();
    return scan->out;
}

/* A bytes blob of the pool for `size` bytes at `from`, its copy added to the scan's. */
static PyObject* scan_blob(Pool* pool, Scan* scan, const char* from, int64_t size)
{
    PyObject* blob = blob_for(pool, size);
    if (blob != NULL && size > 0)
        scan->copies[scan->n_copies++] = (Copy){PyBytes_AS_STRING(blob), from, size};
    return blob;
}

/* A chunk of TFRecord records, `sizes[i]` bytes of Example at address `records[i]` (the caller's
 * buffer, read into just before: `_record_files.ScratchGroups`): a list with, for each record, a
 * tuple of the `k` wanted features' values (a bytes in a blob of the pool, or an int) where the
 * record holds them in the plain form (tf_example.h), else None (for protobuf, which names the
 * error). NULL with MemoryError set. The scan keeps the GIL (the records are in memory just read:
 * scanning a chunk's headers costs less than handing the GIL over); the copies let it go. */
PyObject* hr_tf_examples(void* handle, int n, const uint64_t* records, const int64_t* sizes, int k,
                         const char* const* names, const int64_t* name_lengths)
{
    Pool* pool = handle;
    Scan scan;
    if (!scan_begin(&scan, n, sizeof(HrFeature) * (size_t)(k > 0 ? k : 1), n * k))
        return scan_end(pool, &scan, 1);
    HrFeature* found = scan.found;
    reclaim(pool, BUDGET_A * (int64_t)n * k + 64);
    for (int i = 0; i < n; i++) {
        const char* record = (const char*)(uintptr_t)records[i];
        PyObject* item = Py_NewRef(Py_None);
        if (hr_example_scan((const uint8_t*)record, sizes[i], k, names, name_lengths, found + i * k)) {
            Py_SETREF(item, PyTuple_New(k));
            for (int j = 0; item != NULL && j < k; j++) {
                HrFeature f = found[i * k + j];
                PyObject* value = f.kind == HR_FEATURE_INT64 ? PyLong_FromLongLong(f.a)
                                                             : scan_blob(pool, &scan, record + f.a, f.b);
                if (value == NULL)
                    Py_CLEAR(item);
                else
                    PyTuple_SET_ITEM(item, j, value);
            }
        }
        if (item == NULL)
            return scan_end(pool, &scan, 1);
        PyList_SET_ITEM(scan.out, i, item);
    }
    return scan_end(pool, &scan, 0);
}

/* The encoded caffe.Datum values of a chunk, `sizes[i]` bytes at address `values[i]` (views into an
 * LMDB map, valid until this returns): a list with, for each, a tuple (its image in a blob of the
 * pool, its label or None) where the Datum is plain (caffe_datum.h), else None (for protobuf, which
 * names the error). The scans (which may fault the map's pages in) and the copies run with the GIL
 * let go. NULL with MemoryError set. */
PyObject* hr_datums(void* handle, int n, const uint64_t* values, const int64_t* sizes)
{
    Pool* pool = handle;
    Scan scan;
    if (!scan_begin(&scan, n, sizeof(HrDatum), n))
        return scan_end(pool, &scan, 1);
    HrDatum* found = scan.found;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < n; i++)
        scan.plain[i] = (char)hr_datum_scan((const uint8_t*)(uintptr_t)values[i], sizes[i], found + i);
    Py_END_ALLOW_THREADS
    reclaim(pool, BUDGET_A * (int64_t)n + 64);
    for (int i = 0; i < n; i++) {
        PyObject* item = Py_NewRef(Py_None);
        if (scan.plain[i]) {
            HrDatum d = found[i];
            PyObject* image = scan_blob(pool, &scan, (const char*)(uintptr_t)values[i] + d.data_offset, d.data_length);
            PyObject* label = image == NULL ? NULL : d.has_label ? PyLong_FromLong(d.label) : Py_NewRef(Py_None);
            Py_SETREF(item, label == NULL ? NULL : PyTuple_Pack(2, image, label));
            Py_XDECREF(label);
            Py_XDECREF(image);
        }
        if (item == NULL)
            return scan_end(pool, &scan, 1);
        PyList_SET_ITEM(scan.out, i, item);
    }
    return scan_end(pool, &scan, 0);
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
