/* Values of an LMDB's main database found by walking its B+tree in the mapped data file, a chunk of
 * keys in one call that keeps the GIL (read_files.c's hr_lmdb_find; readers/_lmdb_tree.py); and its
 * keys listed in order the same way (hr_lmdb_keys), for a reader given no key list.
 *
 * Why: py-lmdb lets the GIL go around every lookup, and taking it back waits for the thread that
 * holds it to reach its switch interval (5 ms) when that thread runs Python: beside one busy
 * Python thread the LMDB reader fell from ~7,000 to ~460 values/s on the 2-core VM (the files
 * reader, a chunk per two GIL-free calls, to ~7,200 files/s). Alone, a lookup here is a few
 * binary searches (~0.3 us) against ~0.5 us and a GIL hand-over for py-lmdb's.
 *
 * Read-only and conservative: the caller holds a py-lmdb read transaction over the call (its
 * reader slot keeps writers from reusing the pages of its snapshot, and of any later one), and
 * gives its id; the root is taken from the meta page of that transaction, read twice around. Any
 * key this does not read exactly as mdb_get would (a meta page of another transaction, a page
 * outside the map or of an unexpected kind, a node that does not fit its page, a duplicate-sorted,
 * reverse-key or integer-key database, a key LMDB refuses) comes back as -2, and the caller asks
 * py-lmdb, which also names every error; -1 is a key that is not there (py-lmdb says so too).
 *
 * The on-disk format is LMDB 0.9's (data version 1, the one py-lmdb bundles): little-endian,
 * 64-bit page numbers. Elsewhere every key is -2. */
#ifndef HR_LMDB_TREE_H
#define HR_LMDB_TREE_H

#include <stdint.h>
#include <string.h>

#define LMDB_MAGIC 0xBEEFC0DEu
#define LMDB_DATA_VERSION 1u
#define LMDB_PAGE_HEADER 16 /* page number, pad, flags, lower, upper */
#define LMDB_NODE_HEADER 8  /* lo, hi, flags, key size */
#define LMDB_P_BRANCH 0x01
#define LMDB_P_LEAF 0x02
#define LMDB_P_OVERFLOW 0x04
#define LMDB_F_BIGDATA 0x01
#define LMDB_F_SUBDATA 0x02 /* a named database's name: its value is that tree's record, not data */
#define LMDB_F_DUPDATA 0x04
#define LMDB_DB_UNREAD (0x02 | 0x04 | 0x08 | 0x10 | 0x20 | 0x40) /* reverse key, dupsort, integer key, ... */
#define LMDB_MAX_KEY 511
#define LMDB_MAX_DEPTH 32 /* LMDB's cursor stack: a deeper path is its error */

typedef struct {
    const uint8_t* map;
    int64_t map_len, psize;
    uint64_t root, last_page, entries, depth;
} LmdbTree;

static uint16_t lmdb_u16(const uint8_t* p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static uint64_t lmdb_u64(const uint8_t* p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Page `pgno` if it lies whole in the map, names itself and is exactly one of `kinds` (a page on
 * disk has one kind and no other flag: LMDB clears its in-memory ones before writing; one with
 * more is damaged, and LMDB may refuse it where its type check is stricter); else NULL. */
static const uint8_t* lmdb_page(const LmdbTree* t, uint64_t pgno, uint16_t kinds)
{
    if (pgno > t->last_page || pgno >= (uint64_t)(t->map_len / t->psize))
        return NULL;
    const uint8_t* page = t->map + (int64_t)pgno * t->psize;
    uint16_t flags = lmdb_u16(page + 10);
    if (lmdb_u64(page) != pgno || !(flags & kinds) || (flags & (flags - 1)))
        return NULL;
    return page;
}

/* Node i of a branch or leaf page with `n` nodes, if it and its key lie in the page; else NULL. */
static const uint8_t* lmdb_node(const LmdbTree* t, const uint8_t* page, int i)
{
    uint16_t at = lmdb_u16(page + LMDB_PAGE_HEADER + 2 * i);
    if (at < LMDB_PAGE_HEADER || at + LMDB_NODE_HEADER > t->psize)
        return NULL;
    const uint8_t* node = page + at;
    if (at + LMDB_NODE_HEADER + lmdb_u16(node + 6) > t->psize)
        return NULL;
    return node;
}

/* The number of nodes of a page, or -1 where its header does not fit the page. */
static int lmdb_count(const LmdbTree* t, const uint8_t* page)
{
    uint16_t lower = lmdb_u16(page + 12);
    if (lower < LMDB_PAGE_HEADER || lower > t->psize || (lower - LMDB_PAGE_HEADER) % 2)
        return -1;
    return (lower - LMDB_PAGE_HEADER) / 2;
}

/* mdb_cmp_memn: bytes first, then the shorter key first. */
static int lmdb_compare(const uint8_t* a, int64_t na, const uint8_t* b, int64_t nb)
{
    int c = memcmp(a, b, (size_t)(na < nb ? na : nb));
    return c ? c : (na < nb ? -1 : na > nb);
}

/* The value of `key` as an offset into the map and a length, or -1 (not there) / -2 (ask py-lmdb). */
static int64_t lmdb_find(const LmdbTree* t, const uint8_t* key, int64_t key_len, int64_t* value_len)
{
    if (key_len <= 0 || key_len > LMDB_MAX_KEY)
        return -2;
    uint64_t pgno = t->root;
    for (int depth = 0; depth < LMDB_MAX_DEPTH; depth++) {
        const uint8_t* page = lmdb_page(t, pgno, LMDB_P_BRANCH | LMDB_P_LEAF);
        int n = page ? lmdb_count(t, page) : -1;
        if (n <= 0)
            return -2;
        if (lmdb_u16(page + 10) & LMDB_P_BRANCH) {
            /* The child whose first key is the greatest at most `key` (node 0's counts as the
             * least), probed exactly as mdb_node_search and mdb_page_search_root probe it, so that
             * a damaged page (keys out of order) leads both to the same child. */
            int low = 1, high = n - 1, mid = 0, c = 0;
            while (low <= high) {
                mid = (low + high) / 2;
                const uint8_t* node = lmdb_node(t, page, mid);
                if (node == NULL)
                    return -2;
                c = lmdb_compare(key, key_len, node + LMDB_NODE_HEADER, lmdb_u16(node + 6));
                if (c == 0)
                    break;
                if (c > 0)
                    low = mid + 1;
                else
                    high = mid - 1;
            }
            int child = c > 0 ? mid : (c < 0 ? mid - 1 : mid);
            if (child >= n)
                child = n - 1;
            if (child < 0)
                return -2;
            const uint8_t* node = lmdb_node(t, page, child);
            if (node == NULL)
                return -2;
            pgno = (uint64_t)lmdb_u16(node) | (uint64_t)lmdb_u16(node + 2) << 16 | (uint64_t)lmdb_u16(node + 4) << 32;
            continue;
        }
        int low = 0, high = n - 1;
        while (low <= high) {
            int mid = (low + high) / 2;
            const uint8_t* node = lmdb_node(t, page, mid);
            if (node == NULL)
                return -2;
            uint16_t ksize = lmdb_u16(node + 6);
            int c = lmdb_compare(key, key_len, node + LMDB_NODE_HEADER, ksize);
            if (c > 0) {
                low = mid + 1;
            } else if (c < 0) {
                high = mid - 1;
            } else {
                uint16_t flags = lmdb_u16(node + 4);
                int64_t size = (int64_t)lmdb_u16(node) | (int64_t)lmdb_u16(node + 2) << 16;
                int64_t data = (node - t->map) + LMDB_NODE_HEADER + ksize;
                if (flags & LMDB_F_DUPDATA)
                    return -2;
                if (!(flags & LMDB_F_BIGDATA)) { /* in the node, on this page */
                    if (data + size > (page - t->map) + t->psize)
                        return -2;
                    *value_len = size;
                    return data;
                }
                if (data + 8 > (page - t->map) + t->psize)
                    return -2;
                const uint8_t* over = lmdb_page(t, lmdb_u64(t->map + data), LMDB_P_OVERFLOW);
                if (over == NULL || (over - t->map) + LMDB_PAGE_HEADER + size > t->map_len)
                    return -2;
                *value_len = size;
                return (over - t->map) + LMDB_PAGE_HEADER;
            }
        }
        return -1;
    }
    return -2;
}

/* Every key of the main database in order, but named databases' names, packed into `keys`
 * (`keys_cap` bytes) with their lengths in `lengths` (`n_cap` of them), as far as they fit; the
 * number of such keys, with their total length in *total, or -1 where the tree is not read
 * exactly as LMDB would (the caller's cursor lists the keys then). A call with caps of 0 counts.
 *
 * Exactly: every page of the right kind and whole, every leaf at the database's depth, each key
 * greater than the one before (so a damaged page that points back up the tree ends the walk), as
 * many leaf nodes as the database's record counts. A named database's name is told by its node's
 * flag, which py-lmdb's cursor does not show. */
static int64_t lmdb_walk_keys(const LmdbTree* t, uint8_t* keys, int64_t keys_cap, int64_t* lengths, int64_t n_cap,
                              int64_t* total)
{
    *total = 0;
    if (t->root == UINT64_MAX)
        return t->entries == 0 && t->depth == 0 ? 0 : -1; /* an empty database */
    if (t->depth < 1 || t->depth > LMDB_MAX_DEPTH)
        return -1;
    const uint8_t* pages[LMDB_MAX_DEPTH];
    int next[LMDB_MAX_DEPTH], counts[LMDB_MAX_DEPTH];
    int top = 0;
    pages[0] = lmdb_page(t, t->root, LMDB_P_BRANCH | LMDB_P_LEAF);
    const uint8_t* last_key = NULL;
    uint16_t last_len = 0;
    uint64_t nodes = 0;
    int64_t n = 0, bytes = 0;
    if (pages[0] == NULL || (counts[0] = lmdb_count(t, pages[0])) <= 0)
        return -1;
    next[0] = 0;
    while (top >= 0) {
        const uint8_t* page = pages[top];
        int is_leaf = lmdb_u16(page + 10) & LMDB_P_LEAF;
        if (is_leaf != ((uint64_t)top + 1 == t->depth ? LMDB_P_LEAF : 0))
            return -1;
        if (next[top] == counts[top]) {
            top--;
            continue;
        }
        const uint8_t* node = lmdb_node(t, page, next[top]++);
        if (node == NULL)
            return -1;
        if (!is_leaf) {
            uint64_t child = (uint64_t)lmdb_u16(node) | (uint64_t)lmdb_u16(node + 2) << 16
                             | (uint64_t)lmdb_u16(node + 4) << 32;
            top++;
            pages[top] = lmdb_page(t, child, LMDB_P_BRANCH | LMDB_P_LEAF);
            if (pages[top] == NULL || (counts[top] = lmdb_count(t, pages[top])) <= 0)
                return -1;
            next[top] = 0;
            continue;
        }
        uint16_t flags = lmdb_u16(node + 4), ksize = lmdb_u16(node + 6);
        const uint8_t* key = node + LMDB_NODE_HEADER;
        if (ksize == 0 || ksize > LMDB_MAX_KEY || (flags & LMDB_F_DUPDATA)
            || (last_key != NULL && lmdb_compare(key, ksize, last_key, last_len) <= 0))
            return -1;
        last_key = key;
        last_len = ksize;
        nodes++;
        if (flags & LMDB_F_SUBDATA)
            continue;
        if (n < n_cap && bytes + ksize <= keys_cap) {
            memcpy(keys + bytes, key, ksize);
            lengths[n] = ksize;
        }
        n++;
        bytes += ksize;
    }
    if (nodes != t->entries)
        return -1;
    *total = bytes;
    return n;
}

/* The main database's root in the meta page of transaction `txnid`, read twice around: 0, or -1
 * where no meta page is that transaction's (a writer moved on) or the format is not LMDB 0.9's. */
static int lmdb_open_tree(LmdbTree* t, const uint8_t* map, int64_t map_len, int64_t psize, uint64_t txnid)
{
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__ || UINTPTR_MAX != 0xFFFFFFFFFFFFFFFFu
    return -1;
#else
    if (psize < 512 || map_len < 2 * psize)
        return -1;
    for (int m = 0; m < 2; m++) {
        const uint8_t* meta = map + m * psize + LMDB_PAGE_HEADER;
        const volatile uint64_t* stamp = (const volatile uint64_t*)(meta + 128); /* mm_txnid */
        if (*stamp != txnid)
            continue;
        uint32_t magic, version;
        memcpy(&magic, meta, 4);
        memcpy(&version, meta + 4, 4);
        const uint8_t* main_db = meta + 24 + 48; /* mm_dbs[MAIN_DBI] */
        uint16_t flags = lmdb_u16(main_db + 4);
        t->map = map;
        t->map_len = map_len;
        t->psize = psize;
        t->root = lmdb_u64(main_db + 40);
        t->entries = lmdb_u64(main_db + 32);
        t->depth = lmdb_u16(main_db + 6);
        t->last_page = lmdb_u64(meta + 120); /* mm_last_pg */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (*stamp != txnid || magic != LMDB_MAGIC || version != LMDB_DATA_VERSION || (flags & LMDB_DB_UNREAD))
            return -1;
        return 0;
    }
    return -1;
#endif
}

#endif
