/* The decoded-sample cache: one arena of bytes holding reduced (decode_max_side) samples,
 * keyed by sample index, filled by whoever decodes a sample first and read by everyone else.
 *
 * The arena is a raw pointer + size that the caller owns: an anonymous mapping (one loader's
 * threads) or a node's MPI shared-memory window (every producer of the node), so nothing here
 * allocates, locks or knows which process it runs in. All coordination is GCC __atomic
 * builtins on the arena's own words, which work across processes that map the same memory.
 *
 * Layout (offsets from the base, all little-endian machine words):
 *   DpcHeader                         magic, sizes, the reservation counter, the stats
 *   DpcEntry[num_entries]             one per sample index of the source (DPC_ENTRY_BYTES)
 *   pixels, from data_off (64-aligned) to size: uint8 (h, w, 3) samples, each at a
 *                                     DPC_ALIGN-aligned offset, in the order they were stored
 *
 * An entry goes EMPTY -> FILLING (one writer won the CAS) -> READY (its pixels complete, the
 * state stored with release order) or DID_NOT_FIT (no room left: never stored, decoded every
 * time). Readers take a sample only in state READY (load-acquire), so a writer that dies in
 * the middle of a fill leaves an entry that is never read (its bytes stay reserved). There is
 * no eviction: the arena fills up once and then only serves.
 */
#ifndef DPU_PIPE_CACHE_H
#define DPU_PIPE_CACHE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define DPC_MAGIC 0x3148434143555044ULL      /* "DPUCACH1" */
#define DPC_VERSION 1
#define DPC_ALIGN 16                          /* pixel offsets: SIMD loads, no torn lines */

enum { DPC_EMPTY = 0, DPC_FILLING = 1, DPC_READY = 2, DPC_DID_NOT_FIT = 3 };

typedef struct {
    uint32_t state;       /* DPC_* (atomic) */
    uint32_t height;      /* the stored sample's pixels, valid once READY */
    uint32_t width;
    uint32_t scale;       /* DCT scale (eighths) the sample was decoded at */
    uint64_t offset;      /* from the arena base */
} DpcEntry;

#define DPC_ENTRY_BYTES ((size_t)sizeof(DpcEntry))

typedef struct {
    uint64_t magic;
    uint64_t version;
    uint64_t size;        /* bytes of the whole arena */
    uint64_t num_entries;
    uint64_t data_off;    /* first pixel byte */
    uint64_t used;        /* pixel bytes reserved, padding included (atomic) */
    uint64_t pad_[2];
    /* Counters (atomic, relaxed): the stats, on a cache line of their own. */
    uint64_t hits;        /* lookups that found the sample */
    uint64_t misses;      /* lookups that did not */
    uint64_t did_not_fit; /* samples refused for lack of room */
    uint64_t entries;     /* samples stored */
    uint64_t bytes;       /* pixel bytes stored (h * w * 3 summed, padding excluded) */
    uint64_t pad2_[3];
} DpcHeader;

/* Bytes of the header and the table for n samples: what the arena holds before any pixel. */
static inline size_t dpc_table_bytes(uint64_t n) {
    size_t t = sizeof(DpcHeader) + (size_t)n * DPC_ENTRY_BYTES;
    return (t + 63) & ~(size_t)63;
}

/* Lay out an empty cache for n samples over [base, base + size). The arena need not be
 * zeroed: the header and table are written here (the pixel area is left untouched, so an
 * anonymous mapping stays unresident until samples land in it). Returns 0, or -1 when
 * size cannot hold the table (or base is not 8-byte aligned). One process only, before
 * anyone else uses the arena. */
static inline int dpc_init(void *base, size_t size, uint64_t n) {
    DpcHeader *h = (DpcHeader *)base;
    size_t t = dpc_table_bytes(n);
    if (base == NULL || ((uintptr_t)base & 7) || n == 0 || n > ((uint64_t)1 << 40)
            || size < t)
        return -1;
    memset(base, 0, t);
    h->version = DPC_VERSION;
    h->size = size;
    h->num_entries = n;
    h->data_off = t;
    h->used = 0;
    __atomic_store_n(&h->magic, DPC_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

/* Whether [base, base + size) holds a cache for n samples laid out by dpc_init (another
 * process's, mapped here). */
static inline int dpc_valid(const void *base, size_t size, uint64_t n) {
    const DpcHeader *h = (const DpcHeader *)base;
    if (base == NULL || ((uintptr_t)base & 7) || size < sizeof(DpcHeader))
        return 0;
    return __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == DPC_MAGIC
        && h->version == DPC_VERSION && h->size == size && h->num_entries == n
        && h->data_off == dpc_table_bytes(n);
}

static inline DpcEntry *dpc_entry(void *base, uint64_t index) {
    return (DpcEntry *)((char *)base + sizeof(DpcHeader)) + index;
}

/* Whether sample `index` is stored (not counted as a lookup). */
static inline int dpc_ready(void *base, uint64_t index) {
    DpcHeader *h = (DpcHeader *)base;
    if (index >= h->num_entries)
        return 0;
    return __atomic_load_n(&dpc_entry(base, index)->state, __ATOMIC_ACQUIRE) == DPC_READY;
}

/* The state of sample `index`'s entry (DPC_*; not counted as a lookup). */
static inline uint32_t dpc_state(void *base, uint64_t index) {
    return __atomic_load_n(&dpc_entry(base, index)->state, __ATOMIC_ACQUIRE);
}

/* Sample `index`'s pixels (height x width x 3, rows of width * 3 bytes) and the DCT scale
 * it was decoded at, or NULL when it is not stored. Counts a hit or a miss. */
static inline const uint8_t *dpc_lookup(void *base, uint64_t index, uint32_t *height,
                                        uint32_t *width, uint32_t *scale) {
    DpcHeader *h = (DpcHeader *)base;
    DpcEntry *e;
    if (index < h->num_entries) {
        e = dpc_entry(base, index);
        if (__atomic_load_n(&e->state, __ATOMIC_ACQUIRE) == DPC_READY) {
            __atomic_fetch_add(&h->hits, 1, __ATOMIC_RELAXED);
            *height = e->height;
            *width = e->width;
            *scale = e->scale;
            return (const uint8_t *)base + e->offset;
        }
    }
    __atomic_fetch_add(&h->misses, 1, __ATOMIC_RELAXED);
    return NULL;
}

/* Store sample `index` (height x width x 3 bytes at `pixels`, rows contiguous) unless
 * another writer has it, it was refused before, or the arena is full. Returns 1 when
 * stored, 0 when someone else holds (or held) the entry, -1 when it did not fit. Never
 * blocks: the caller keeps its own copy of the pixels whatever happens.
 * `stall_ms` (tests only, else 0) holds the entry in FILLING that long with half its
 * pixels copied: the window in which a writer killed mid-fill leaves it. */
static inline int dpc_insert_stalled(void *base, uint64_t index, uint32_t height,
                                     uint32_t width, uint32_t scale, const uint8_t *pixels,
                                     uint32_t stall_ms) {
    DpcHeader *h = (DpcHeader *)base;
    DpcEntry *e;
    uint32_t expected = DPC_EMPTY;
    uint64_t nbytes = (uint64_t)height * width * 3;
    uint64_t need = (nbytes + DPC_ALIGN - 1) & ~(uint64_t)(DPC_ALIGN - 1);
    uint64_t cap = h->size - h->data_off;
    uint64_t used;
    if (index >= h->num_entries || nbytes == 0)
        return 0;
    e = dpc_entry(base, index);
    if (!__atomic_compare_exchange_n(&e->state, &expected, DPC_FILLING, 0,
                                     __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
        return 0;
    used = __atomic_load_n(&h->used, __ATOMIC_RELAXED);
    do {
        if (need > cap - used) {
            __atomic_store_n(&e->state, DPC_DID_NOT_FIT, __ATOMIC_RELEASE);
            __atomic_fetch_add(&h->did_not_fit, 1, __ATOMIC_RELAXED);
            return -1;
        }
    } while (!__atomic_compare_exchange_n(&h->used, &used, used + need, 1,
                                          __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    e->height = height;
    e->width = width;
    e->scale = scale;
    e->offset = h->data_off + used;
    if (stall_ms > 0) {
        /* Tests: half the pixels copied, the rest after the stall (a writer killed here
         * leaves an entry whose fields are set and whose pixels are not). */
        size_t half = (size_t)nbytes / 2;
        memcpy((char *)base + e->offset, pixels, half);
        while (stall_ms > 0) {
            uint32_t step = stall_ms < 100 ? stall_ms : 100;
            usleep(step * 1000u);
            stall_ms -= step;
        }
        memcpy((char *)base + e->offset + half, pixels + half, (size_t)nbytes - half);
    } else {
        memcpy((char *)base + e->offset, pixels, (size_t)nbytes);
    }
    __atomic_store_n(&e->state, DPC_READY, __ATOMIC_RELEASE);
    __atomic_fetch_add(&h->entries, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&h->bytes, nbytes, __ATOMIC_RELAXED);
    return 1;
}

/* The counters: out = {hits, misses, bytes, entries, did_not_fit}. */
static inline void dpc_stats(void *base, uint64_t out[5]) {
    DpcHeader *h = (DpcHeader *)base;
    out[0] = __atomic_load_n(&h->hits, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&h->misses, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&h->bytes, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&h->entries, __ATOMIC_RELAXED);
    out[4] = __atomic_load_n(&h->did_not_fit, __ATOMIC_RELAXED);
}

#endif
