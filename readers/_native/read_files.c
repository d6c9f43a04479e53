/* Read a chunk of whole files in two calls, with no Python in between.
 *
 * Why this exists: each open, fstat, read and close from Python drops and retakes the GIL, and
 * retaking it waits for whichever thread holds it to reach its switch interval (5 ms). With one
 * other Python thread busy, the files reader fell from 20k to under 200 files/s on a 2-core
 * machine (readers/README.md). ctypes releases the GIL for the whole of each call below.
 *
 * Two calls per chunk: hr_open_files opens the files and says their sizes, the caller allocates a
 * buffer of each size (Python bytes objects, so samples own their memory as with a plain read),
 * and hr_read_files fills them and closes the files. hr_close_files closes what is still open if
 * the caller fails in between. A chunk larger than the descriptors left to the process goes in
 * several such rounds (hr_open_files stops where it runs out), as Python reading one file at a
 * time would read it all.
 *
 * Only regular files are read, each up to the size it had when opened: a FIFO, socket or device
 * has no size and may never end (opening a FIFO without O_NONBLOCK waits for a writer forever).
 * The Python fallback (readers/_read_files.py) follows the same rules, so both read the same.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "lmdb_tree.h"

/* `len` bytes at `offset` into `buf`: how many were read (fewer at the file's end), -errno on an error. */
static int64_t read_at(int fd, uint8_t* buf, int64_t len, int64_t offset)
{
    int64_t done = 0;
    while (done < len) {
        ssize_t r = pread(fd, buf + done, (size_t)(len - done), (off_t)(offset + done));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -errno;
        if (r == 0)
            break;
        done += r;
    }
    return done;
}

/* Records at known offsets of open files, read one after another into `scratch` (at least the
 * lengths' sum): record i's bytes read in `got[i]` (short at the file's end), -errno where a read
 * failed. For the record readers, which keep the scratch from chunk to chunk (its pages stay
 * faulted in) and copy out only what a sample keeps. */
void hr_pread_records(int n, const int* fds, const int64_t* offsets, const int64_t* lengths, uint8_t* scratch,
                      int64_t* got)
{
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        got[i] = read_at(fds[i], scratch + at, lengths[i], offsets[i]);
        at += lengths[i];
    }
}

/* The record readers' scans of a file without an index (readers/tfrecord.py, recordio.py): from
 * byte `pos` of a file of `size` bytes, up to `cap` records found from their headers in one call
 * without the GIL, as out[2i] (offset) and out[2i + 1] (length) pairs, as the Python scan gives
 * them; *end is where the next header starts. A pread a record from Python let the GIL go and take
 * it back each time: beside a thread busy in Python, a scan of 8,192 TFRecord records took 11 s
 * on the 2-core VM. Only plain records: the first header that is short, runs past the end, fails
 * a check, or ends the file inside a record, ends the call at that record, for Python to read as
 * before (it names what is wrong). Returns how many were found; -errno where a read failed. */
int64_t hr_scan_tfrecords(int fd, int64_t pos, int64_t size, int64_t cap, int64_t* out, int64_t* end)
{
    int64_t n = 0;
    uint8_t header[12]; /* the data's length, the length's CRC */
    while (n < cap && size - pos >= 16) {
        int64_t got = read_at(fd, header, 12, pos);
        if (got < 0)
            return got;
        uint64_t length;
        memcpy(&length, header, 8);
        if (got < 12 || length > (uint64_t)(size - pos - 16))
            break;
        out[2 * n] = pos + 12;
        out[2 * n + 1] = (int64_t)length;
        n++;
        pos += 16 + (int64_t)length;
    }
    *end = pos;
    return n;
}

#define RECORDIO_MAGIC 0xCED7230Au
#define RECORDIO_LENGTH_BITS ((1u << 29) - 1)

/* RecordIO's: out[2i] is a record's first header, out[2i + 1] its span on disk, its parts' data
 * padded to 4 bytes (a record whose data holds the magic is written in parts, flags 1, 2 ... 3; a
 * whole one is flag 0). *end is the first header of the record not found whole. */
int64_t hr_scan_recordio(int fd, int64_t pos, int64_t size, int64_t cap, int64_t* out, int64_t* end)
{
    int64_t n = 0, start = pos;
    uint8_t header[8]; /* the magic, then the part's flag (3 bits) and length (29) */
    while (n < cap && pos < size) {
        int64_t got = read_at(fd, header, 8, pos);
        if (got < 0)
            return got;
        uint32_t magic, word;
        memcpy(&magic, header, 4);
        memcpy(&word, header + 4, 4);
        int64_t length = word & RECORDIO_LENGTH_BITS;
        if (got < 8 || magic != RECORDIO_MAGIC || pos + 8 + length > size)
            break;
        pos += 8 + ((length + 3) & ~(int64_t)3);
        if (pos > size)
            pos = size;
        uint32_t flag = word >> 29;
        if (flag == 0 || flag == 3) { /* the record's last part */
            out[2 * n] = start;
            out[2 * n + 1] = pos - start;
            n++;
            start = pos;
        }
    }
    *end = start;
    return n;
}

/* A folder's entries, "." and ".." left out, in one call without the GIL (readers/files.py lists
 * class folders with it): each name NUL-terminated in `names` (`names_cap` bytes) and its d_type in
 * `types` (`cap` of them), in the order readdir gives them, as long as all so far fit. Returns how
 * many entries there are, *total the bytes their names take; the caller calls again with room for
 * them where either is more than it gave. -errno where the folder cannot be opened or read.
 *
 * Why: os.scandir lets the GIL go around every readdir, and beside a thread busy in Python each
 * time may wait to take it back: 8,192 files in 16 folders took 2.4 s to list so on the 2-core VM
 * (0.1 s alone). */
int64_t hr_list_folder(const char* path, uint8_t* names, int64_t names_cap, uint8_t* types, int64_t cap,
                       int64_t* total)
{
    DIR* dir = opendir(path);
    if (dir == NULL)
        return -errno;
    int64_t n = 0, bytes = 0;
    int fits = 1;
    for (;;) {
        errno = 0;
        struct dirent* entry = readdir(dir);
        if (entry == NULL) {
            int err = errno;
            closedir(dir);
            if (err)
                return -err;
            break;
        }
        const char* name = entry->d_name;
        if (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0)))
            continue;
        int64_t len = (int64_t)strlen(name) + 1;
        fits = fits && n < cap && bytes + len <= names_cap;
        if (fits) {
            memcpy(names + bytes, name, (size_t)len);
            types[n] = entry->d_type;
        }
        n++;
        bytes += len;
    }
    *total = bytes;
    return n;
}

/* Out of descriptors: worth trying again once this process has closed some of its own. */
static int out_of_descriptors(int err)
{
    return err == EMFILE || err == ENFILE;
}

/* A descriptor for path, or -1 with errno set. O_NONBLOCK so that a FIFO without a writer opens
 * at once (to be refused by its type) instead of hanging; regular files ignore the flag. */
static int open_for_reading(const char* path)
{
    int fd;
    do
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    while (fd < 0 && errno == EINTR);
    return fd;
}

/* 0 for a regular file of fd (its size in *size), else the errno to report for it. */
static int regular_file_size(int fd, int64_t* size)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return errno;
    if (S_ISDIR(st.st_mode))
        return EISDIR; /* what Python's open() raises for a folder */
    if (!S_ISREG(st.st_mode))
        return EINVAL; /* a FIFO, socket or device: see the top of this file */
    /* Blocking again for the reads: local file systems ignore O_NONBLOCK on regular files, but a
     * FUSE or network one may pass it on and answer a read with EAGAIN. */
    if (fcntl(fd, F_SETFL, 0) != 0)
        return errno;
    *size = (int64_t)st.st_size;
    return 0;
}

/* Open paths[0..n): fds[i] and sizes[i] (its length now), or fds[i] = -1 with errs[i] = errno.
 * Returns how many paths it went through: fewer than n where the process ran out of descriptors
 * while this call held some, which the caller frees (hr_read_files) before opening the rest.
 * Running out while holding none is that file's error, as it would be for Python's open(). */
int hr_open_files(int n, const char** paths, int* fds, int64_t* sizes, int* errs)
{
    int held = 0;
    for (int i = 0; i < n; i++) {
        sizes[i] = 0;
        errs[i] = 0;
        fds[i] = open_for_reading(paths[i]);
        if (fds[i] < 0) {
            if (held > 0 && out_of_descriptors(errno))
                return i;
            errs[i] = errno;
            continue;
        }
        errs[i] = regular_file_size(fds[i], &sizes[i]);
        if (errs[i] != 0) {
            close(fds[i]);
            fds[i] = -1;
            continue;
        }
        held++;
    }
    return n;
}

/* Read each open file into outs[i] (sizes[i] bytes of room) and close it: sizes[i] becomes what was
 * read (less if the file shrank; a file that grew is cut at the size it had when opened), or
 * errs[i] = errno. Every fds[i] is -1 afterwards. */
void hr_read_files(int n, int* fds, char** outs, int64_t* sizes, int* errs)
{
    for (int i = 0; i < n; i++) {
        if (fds[i] < 0)
            continue;
        int64_t got = 0;
        while (got < sizes[i]) {
            ssize_t r = read(fds[i], outs[i] + got, (size_t)(sizes[i] - got));
            if (r < 0) {
                if (errno == EINTR)
                    continue;
                errs[i] = errno;
                break;
            }
            if (r == 0)
                break;
            got += r;
        }
        sizes[i] = got;
        close(fds[i]);
        fds[i] = -1;
    }
}

/* Close the files still open (the caller failed between the two calls above). */
void hr_close_files(int n, int* fds)
{
    for (int i = 0; i < n; i++) {
        if (fds[i] >= 0) {
            close(fds[i]);
            fds[i] = -1;
        }
    }
}

/* Copy n spans of downloaded memory into their buffers (fresh, uninitialised bytes objects), for
 * a remote shard's parser: a chunk of members in one call, so the GIL is let go once a chunk, not
 * once a member, and the page faults of the fresh buffers (tens of microseconds a 68 KB member)
 * come while other threads run. */
void hr_copy_spans(int n, char** outs, const uint64_t* sources, const int64_t* sizes)
{
    for (int i = 0; i < n; i++)
        memcpy(outs[i], (const char*)(uintptr_t)sources[i], (size_t)sizes[i]);
}

/* Tar headers, for a shard's parser (readers/_tar.py): the plain members lying wholly in
 * base[0..len), as records of six int64 each at out: header offset, data size, type flag, name
 * length (the name is at the header's offset), the length of its WebDataset key (the name up to the
 * first dot of its base name), and 1 for a plain field (see plain_field) else 0. At most max
 * records; returns how many.
 *
 * The Python loop over a header (checksum, octal size, name) cost ~10 µs a member with the GIL
 * held, a third of a local sample's parse; here it is well under one. Conservative by design: it
 * stops before anything it does not read exactly as Python would (an end or corrupt block, a long
 * name or pax header, a base-256 size, a ustar prefix, a field with other than octal digits, a
 * member cut off by the end of the window) and Python reads that member, errors included. */
static int octal_field(const uint8_t* field, int width, int64_t* value)
{
    int end = 0;
    while (end < width && field[end] != 0)
        end++;
    int start = 0;
    while (start < end && (field[start] == ' ' || (field[start] >= '\t' && field[start] <= '\r')))
        start++;
    while (end > start && (field[end - 1] == ' ' || (field[end - 1] >= '\t' && field[end - 1] <= '\r')))
        end--;
    if (start == end)
        return 0;
    int64_t v = 0;
    for (int i = start; i < end; i++) {
        if (field[i] < '0' || field[i] > '7')
            return 0;
        v = v * 8 + (field[i] - '0');
    }
    *value = v;
    return 1;
}

/* The length of a plain field's key, or -1. Plain: a regular file whose name is ASCII, has a key
 * and an extension (a dot inside its base name, not last), is no WebDataset meta member ("__x__"
 * first) and whose key stays inside the archive (no leading '/', no '..' part, no '\\', no
 * drive). Python reads such a member without its own name checks; any other goes through them. */
static int64_t plain_field(const uint8_t* name, int64_t len, uint8_t kind)
{
    if (kind != '0' && kind != 0 && kind != '7')
        return -1;
    int64_t slash = 0, first_slash = len;
    for (int64_t i = 0; i < len; i++) {
        if (name[i] >= 0x80 || name[i] == '\\')
            return -1;
        if (name[i] == '/') {
            slash = i + 1;
            if (first_slash == len)
                first_slash = i;
        }
    }
    if (first_slash >= 4 && name[0] == '_' && name[1] == '_' && name[first_slash - 1] == '_'
        && name[first_slash - 2] == '_')
        return -1;
    int64_t dot = slash;
    while (dot < len && name[dot] != '.')
        dot++;
    if (dot == len || dot == slash || dot == len - 1)
        return -1;
    if (name[0] == '/' || (dot > 2 && name[1] == ':' && name[2] == '/'))
        return -1;
    for (int64_t start = 0; start < dot;) { /* a ".." part of the key */
        int64_t end = start;
        while (end < dot && name[end] != '/')
            end++;
        if (end - start == 2 && name[start] == '.' && name[start + 1] == '.')
            return -1;
        start = end + 1;
    }
    return dot;
}

int64_t hr_tar_scan(const uint8_t* base, int64_t len, int64_t max, int64_t* out)
{
    int64_t pos = 0, n = 0;
    while (n < max && pos + 512 <= len) {
        const uint8_t* h = base + pos;
        uint8_t kind = h[156];
        if (kind == 'L' || kind == 'x' || kind == 'g' || kind == 'K')
            break;
        int64_t sum = 256; /* the checksum field counts as eight spaces */
        for (int i = 0; i < 512; i++)
            sum += h[i];
        for (int i = 148; i < 156; i++)
            sum -= h[i];
        int64_t stored, size;
        if (!octal_field(h + 148, 8, &stored) || stored != sum)
            break;
        if ((h[124] & 0x80) || !octal_field(h + 124, 12, &size))
            break;
        if (memcmp(h + 257, "ustar\0", 6) == 0 && h[345] != 0)
            break;
        int64_t padded = (size + 511) & ~(int64_t)511;
        if (pos + 512 + padded > len)
            break;
        int64_t name_len = 0;
        while (name_len < 100 && h[name_len] != 0)
            name_len++;
        int64_t key_len = plain_field(h, name_len, kind);
        out[6 * n] = pos;
        out[6 * n + 1] = size;
        out[6 * n + 2] = kind;
        out[6 * n + 3] = name_len;
        out[6 * n + 4] = key_len;
        out[6 * n + 5] = key_len >= 0;
        n++;
        pos += 512 + padded;
    }
    return n;
}

/* For the LMDB reader: the values of keys `keys[starts[i] .. + lengths[i])` in the mapped data file
 * `map` (`map_len` bytes, pages of `psize`) as of read transaction `txnid`, found in C for a caller
 * that keeps the GIL (ctypes.PyDLL; lmdb_tree.h says why): offsets[i] into the map and sizes[i], or
 * offsets[i] = -1 (not there) / -2 (for py-lmdb to look up). Returns how many were found, -1 where
 * the tree cannot be read at all (every key for py-lmdb). */
int64_t hr_lmdb_find(const uint8_t* map, int64_t map_len, int64_t psize, uint64_t txnid, int n, const uint8_t* keys,
                     const int64_t* starts, const int64_t* lengths, int64_t* offsets, int64_t* sizes)
{
    LmdbTree tree;
    if (lmdb_open_tree(&tree, map, map_len, psize, txnid) < 0)
        return -1;
    int64_t found = 0;
    for (int i = 0; i < n; i++) {
        sizes[i] = 0;
        offsets[i] = lmdb_find(&tree, keys + starts[i], lengths[i], &sizes[i]);
        found += offsets[i] >= 0;
    }
    return found;
}

/* For the LMDB reader given no key list: the main database's keys in order as of read transaction
 * `txnid` (lmdb_walk_keys: packed into `keys`, their lengths in `lengths`, as far as the caps go),
 * for a caller that keeps the GIL, as hr_lmdb_find's does: py-lmdb's cursor lets it go a key, and
 * listing 32,768 keys beside a thread busy in Python took 12 s on the 2-core VM, 45 ms alone.
 * Returns how many keys there are, their total length in *total; -1 where the cursor must list. */
int64_t hr_lmdb_keys(const uint8_t* map, int64_t map_len, int64_t psize, uint64_t txnid, uint8_t* keys,
                     int64_t keys_cap, int64_t* lengths, int64_t n_cap, int64_t* total)
{
    LmdbTree tree;
    *total = 0;
    if (lmdb_open_tree(&tree, map, map_len, psize, txnid) < 0)
        return -1;
    return lmdb_walk_keys(&tree, keys, keys_cap, lengths, n_cap, total);
}

#ifdef HR_WITH_PYTHON
/* The whole chunk in one call, for a caller that loads this library with ctypes.PyDLL (so it holds
 * the GIL). Python's own work per file, making the bytes object and handing over its storage,
 * cost more than the reads themselves when done one ctypes call per file; here it is a loop in C,
 * between the two GIL-free phases above.
 *
 * Returns (blobs, failed): blobs[i] is file i's bytes, or its errno as an int where opening or
 * reading it failed; failed counts those. NULL with an exception set (MemoryError) leaves no file
 * open.
 *
 * `new_blob(pool, size)`, where not NULL, makes the bytes objects instead of a fresh allocation
 * each: the sample pool's hr_pool_blob (sample_pool.c), a recycled blob whose pages are already
 * faulted in. A fresh ~70 KB bytes costs malloc and page faults on this thread, and its free on
 * the consumer's thread trims the arena again: the files reader alone on the 2-core VM read 48k
 * files/s into fresh bytes let go at once, 82k/s into the pool's (docs/benchmarks.md). Called with
 * the GIL held. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

typedef PyObject* (*NewBlob)(void* pool, int64_t size);

/* Files [start, end) are open (or failed): put a bytes object of each open file's size (fresh, or
 * new_blob's), or the errno of each failure, in blobs, and point outs at the bytes' storage. -1
 * with an exception set where Python runs out of memory. */
static int make_buffers(PyObject* blobs, int start, int end, const int* fds, const int64_t* sizes,
                        const int* errs, char** outs, int* failed, NewBlob new_blob, void* pool)
{
    for (int i = start; i < end; i++) {
        outs[i] = NULL;
        PyObject* item;
        if (fds[i] >= 0) {
            item = new_blob != NULL ? new_blob(pool, sizes[i]) : PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizes[i]);
            if (item != NULL)
                outs[i] = PyBytes_AS_STRING(item);
        } else {
            item = PyLong_FromLong(errs[i]);
            (*failed)++;
        }
        if (item == NULL)
            return -1;
        PyList_SET_ITEM(blobs, i, item);
    }
    return 0;
}

/* Files [start, end) have been read: replace the bytes of each that failed by its errno, and of
 * each that shrank meanwhile by what was read. -1 with an exception set as above. */
static int settle_reads(PyObject* blobs, int start, int end, char* const* outs, const int64_t* sizes,
                        const int64_t* wanted, const int* errs, int* failed)
{
    for (int i = start; i < end; i++) {
        if (outs[i] == NULL)
            continue;
        PyObject* item;
        if (errs[i] != 0) {
            item = PyLong_FromLong(errs[i]);
            (*failed)++;
        } else if (sizes[i] != wanted[i]) {
            item = PyBytes_FromStringAndSize(outs[i], (Py_ssize_t)sizes[i]);
        } else {
            continue;
        }
        if (item == NULL)
            return -1;
        PyList_SetItem(blobs, i, item); /* drops the old bytes */
    }
    return 0;
}

PyObject* hr_read_chunk(int n, const char** paths, NewBlob new_blob, void* pool)
{
    PyObject* blobs = NULL;
    int failed = 0;
    int* fds = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1) * 2);
    int64_t* sizes = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1) * 2);
    char** outs = malloc(sizeof(char*) * (size_t)(n > 0 ? n : 1));
    if (fds == NULL || sizes == NULL || outs == NULL) {
        free(fds), free(sizes), free(outs);
        return PyErr_NoMemory();
    }
    int* errs = fds + n;
    int64_t* wanted = sizes + n;
    for (int i = 0; i < n; i++)
        fds[i] = -1;
    blobs = PyList_New(n);
    if (blobs == NULL)
        goto fail;

    /* One round unless the process runs out of descriptors partway (see hr_open_files). */
    for (int start = 0, end; start < n; start = end) {
        Py_BEGIN_ALLOW_THREADS
        end = start + hr_open_files(n - start, paths + start, fds + start, sizes + start, errs + start);
        Py_END_ALLOW_THREADS
        if (make_buffers(blobs, start, end, fds, sizes, errs, outs, &failed, new_blob, pool) < 0)
            goto fail;
        memcpy(wanted + start, sizes + start, sizeof(int64_t) * (size_t)(end - start));

        Py_BEGIN_ALLOW_THREADS
        hr_read_files(end - start, fds + start, outs + start, sizes + start, errs + start);
        Py_END_ALLOW_THREADS
        if (settle_reads(blobs, start, end, outs, sizes, wanted, errs, &failed) < 0)
            goto fail;
    }
    free(fds), free(sizes), free(outs);
    return Py_BuildValue("(Ni)", blobs, failed);

fail:
    hr_close_files(n, fds);
    free(fds), free(sizes), free(outs);
    Py_XDECREF(blobs);
    return NULL;
}
#endif
