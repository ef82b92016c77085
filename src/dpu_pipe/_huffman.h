/* Baseline Huffman entropy decoding of JPEG restart intervals into DCT coefficient blocks,
 * written from ITU-T T.81 (Annex B syntax, Annex C tables, F.2.2 decoding, F.2.2.1 EXTEND).
 *
 * Scope: one sequential Huffman scan holding every component (SOF0/SOF1, 8-bit samples) — the
 * files a transcoded pack holds and most camera files. Anything else is HP_UNSUPPORTED and the
 * caller keeps libjpeg-turbo. The input is untrusted: every byte read is bounded by the
 * segment or interval it belongs to; an interval that runs out of data, has a code no table
 * holds, or is not followed by the restart marker T.81 requires is HP_EDATA, and the caller
 * falls back to libjpeg-turbo, whose own decode says what is wrong (or decodes it its way).
 *
 * Coefficients are stored as libjpeg-turbo's jpeg_read_coefficients stores them: int16, 64 per
 * block in natural (row-major) order, blocks of an MCU row by row, the DC value the running sum
 * of differences wrapped to 16 bits. A run that overshoots the block's last coefficient (only
 * in damaged data) lands on coefficient 63, as libjpeg-turbo's extended zigzag table makes it.
 *
 * All functions are pure C over raw pointers, no allocation, no global state: safe without the
 * GIL on any number of threads.
 */
#ifndef DPU_PIPE_HUFFMAN_H
#define DPU_PIPE_HUFFMAN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum {
    HP_OK = 0,
    HP_EDATA = -1,        /* damaged or inconsistent data */
    HP_ESIZE = -3,        /* caller's rectangle or buffer does not fit */
    HP_UNSUPPORTED = -6   /* valid perhaps, but not a stream this decoder takes */
};

/* Bits resolved by one table lookup: 10 measured faster than 9 (fewer codes and values
 * left to the slow path) and than 11 (larger tables to build per image), entropy.md. */
#define HP_LOOKAHEAD 10
#define HP_MAX_COMPS 4
#define HP_MAX_BLOCKS_IN_MCU 10   /* T.81 B.2.3: at most 10 blocks in an interleaved MCU */

typedef struct {
    /* Codes of at most HP_LOOKAHEAD bits, indexed by the next HP_LOOKAHEAD bits of the stream:
     * (code length << 8) | symbol; 0 for longer codes and unused prefixes. */
    uint16_t fast[1 << HP_LOOKAHEAD];
    /* AC only: code and its extra bits together when both fit in HP_LOOKAHEAD bits:
     * value << 16 | (run + 1) << 8 | bits consumed; run field 0xFF for EOB; 0 otherwise. */
    int32_t acfast[1 << HP_LOOKAHEAD];
    int32_t maxcode[18];    /* largest code of each length (F.2.2.3), -1 when none */
    int32_t valoffset[17];  /* index into vals of a code c of length l: c + valoffset[l] */
    uint8_t vals[256];
    int defined;
} hp_table;

typedef struct {
    int id, h, v, tq, td, ta;
    int bw, bh;             /* blocks of this component the scan codes (padded to MCUs when
                               interleaved) */
} hp_comp;

typedef struct {
    int width, height, ncomp, hmax, vmax;
    int interleaved;        /* ncomp > 1: an MCU is h x v blocks of every component */
    int mcux, mcuy;         /* MCUs per row, MCU rows */
    int blocks_in_mcu;
    int restart_interval;   /* MCUs per interval, 0 = one interval */
    int64_t n_mcu, n_int;
    size_t scan_start;      /* offset of the entropy-coded data */
    hp_comp comp[HP_MAX_COMPS];
    uint16_t qt[4][64];     /* natural order */
    int qt_defined[4];
    /* What libjpeg-turbo infers the colour space from (B.2.4.6 leaves it to the application):
     * a JFIF APP0, an Adobe APP14 and its transform flag (the last one read), and whether
     * bytes that are not a marker preceded one (libjpeg-turbo warns about those). */
    int saw_jfif, saw_adobe, adobe_transform, junk;
    hp_table dc[4], ac[4];
} hp_header;

/* Zigzag index -> natural index (T.81 Figure A.6), 16 extra entries at 63 so an overshooting
 * run in damaged data stays in the block (where libjpeg-turbo puts it too). */
static const uint8_t hp_natural[80] = {
     0,  1,  8, 16,  9,  2,  3, 10, 17, 24, 32, 25, 18, 11,  4,  5,
    12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13,  6,  7, 14, 21, 28,
    35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51,
    58, 59, 52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
    63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63, 63};

static inline int hp_be16(const uint8_t* p) { return ((int)p[0] << 8) | p[1]; }

/* F.2.2.1: the value of a T-bit magnitude category given its T raw bits. */
static inline int hp_extend(int v, int t) {
    return v < (1 << (t - 1)) ? v - (1 << t) + 1 : v;
}

/* Annex C: derive code lengths and codes from BITS/HUFFVAL, and the decoding tables of
 * F.2.2.3. Returns HP_EDATA when the counts describe no prefix code, or a DC symbol exceeds
 * the largest magnitude category (15). */
static int hp_build_table(hp_table* t, const uint8_t* bits, const uint8_t* vals, int nvals,
                          int is_dc) {
    int l, i, k = 0, code = 0, j;
    memset(t, 0, sizeof(*t));
    memcpy(t->vals, vals, (size_t)nvals);
    for (l = 1; l <= 16; l++) {
        int n = bits[l - 1];
        if (n) {
            t->valoffset[l] = k - code;
            for (i = 0; i < n; i++, k++, code++) {
                int sym = vals[k];
                if (is_dc && sym > 15) return HP_EDATA;
                /* A length-l code must fit in l bits (C.2 assigns codes in increasing
                 * order): checked before the code indexes the lookahead table, which an
                 * overflowing code of length <= HP_LOOKAHEAD would write past. */
                if (code >= (1 << l)) return HP_EDATA;
                if (l <= HP_LOOKAHEAD) {
                    int shift = HP_LOOKAHEAD - l, base = code << shift;
                    for (j = 0; j < (1 << shift); j++)
                        t->fast[base + j] = (uint16_t)((l << 8) | sym);
                }
            }
            t->maxcode[l] = code - 1;
        } else {
            t->maxcode[l] = -1;
        }
        code <<= 1;
    }
    t->maxcode[17] = 0x7FFFFFFF;  /* never reached: l stops at 16 */
    if (!is_dc) {
        for (j = 0; j < (1 << HP_LOOKAHEAD); j++) {
            int e = t->fast[j], len = e >> 8, sym = e & 0xFF, run = sym >> 4, s = sym & 15;
            if (!len) continue;
            if (sym == 0) {
                t->acfast[j] = (0xFF << 8) | len;
            } else if (s == 0) {
                /* ZRL (0xF0) and the undefined 0x10..0xE0, which libjpeg-turbo treats
                 * as ZRL-free zero-length runs ending the block: leave to the slow path. */
                continue;
            } else if (len + s <= HP_LOOKAHEAD) {
                int raw = (j >> (HP_LOOKAHEAD - len - s)) & ((1 << s) - 1);
                int v = hp_extend(raw, s);
                t->acfast[j] = (int32_t)((uint32_t)v << 16) | ((run + 1) << 8) | (len + s);
            }
        }
    }
    t->defined = 1;
    return HP_OK;
}

/* Marker segments up to and including the first SOS (B.2.1-B.2.4). Only what decoding the
 * scan needs is kept; APPn/COM and unknown segments are skipped by their length. */
static int hp_read_header(hp_header* h, const uint8_t* data, size_t size) {
    size_t pos = 2;
    int sof = 0, i, j;
    memset(h, 0, sizeof(*h));
    if (size < 4 || data[0] != 0xFF || data[1] != 0xD8) return HP_EDATA;
    for (;;) {
        int marker, len;
        const uint8_t* seg;
        if (pos < size && data[pos] != 0xFF) h->junk = 1;
        while (pos < size && data[pos] != 0xFF) pos++;   /* junk before a marker */
        while (pos < size && data[pos] == 0xFF) pos++;   /* fill bytes */
        if (pos >= size) return HP_EDATA;
        marker = data[pos++];
        if (marker == 0xD8 || marker == 0xD9 || marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7))
            return HP_EDATA;   /* SOI again, EOI or RSTn before the scan */
        if (size - pos < 2) return HP_EDATA;
        len = hp_be16(data + pos);
        if (len < 2 || (size_t)len > size - pos) return HP_EDATA;
        seg = data + pos + 2;
        len -= 2;
        pos += 2 + (size_t)len;
        switch (marker) {
        case 0xC0: case 0xC1: {             /* baseline / extended sequential, Huffman */
            int p, y, x;
            if (sof) return HP_UNSUPPORTED;
            sof = 1;
            if (len < 6) return HP_EDATA;
            p = seg[0]; y = hp_be16(seg + 1); x = hp_be16(seg + 3); h->ncomp = seg[5];
            if (p != 8) return HP_UNSUPPORTED;
            if (y == 0) return HP_UNSUPPORTED;      /* height in a DNL segment */
            if (x == 0 || h->ncomp < 1) return HP_EDATA;
            if (h->ncomp > HP_MAX_COMPS || (h->ncomp != 1 && h->ncomp != 3)) return HP_UNSUPPORTED;
            if (len < 6 + 3 * h->ncomp) return HP_EDATA;
            h->width = x; h->height = y;
            for (i = 0; i < h->ncomp; i++) {
                hp_comp* c = &h->comp[i];
                c->id = seg[6 + 3 * i];
                c->h = seg[7 + 3 * i] >> 4;
                c->v = seg[7 + 3 * i] & 15;
                c->tq = seg[8 + 3 * i];
                if (c->h < 1 || c->h > 4 || c->v < 1 || c->v > 4 || c->tq > 3) return HP_EDATA;
                for (j = 0; j < i; j++) if (h->comp[j].id == c->id) return HP_EDATA;
                if (c->h > h->hmax) h->hmax = c->h;
                if (c->v > h->vmax) h->vmax = c->v;
            }
            break;
        }
        case 0xC2: case 0xC3: case 0xC5: case 0xC6: case 0xC7: case 0xC9: case 0xCA:
        case 0xCB: case 0xCD: case 0xCE: case 0xCF: case 0xDC: case 0xF7:
            return HP_UNSUPPORTED;          /* progressive, lossless, arithmetic, DNL, JPEG-LS */
        case 0xC4: {                        /* DHT */
            int off = 0;
            while (off < len) {
                int tc, th, n = 0, status;
                if (len - off < 17) return HP_EDATA;
                tc = seg[off] >> 4; th = seg[off] & 15;
                if (tc > 1 || th > 3) return HP_EDATA;
                for (i = 0; i < 16; i++) n += seg[off + 1 + i];
                if (n > 256 || len - off - 17 < n) return HP_EDATA;
                status = hp_build_table(tc ? &h->ac[th] : &h->dc[th], seg + off + 1,
                                        seg + off + 17, n, !tc);
                if (status != HP_OK) return status;
                off += 17 + n;
            }
            break;
        }
        case 0xDB: {                        /* DQT */
            int off = 0;
            while (off < len) {
                int pq = seg[off] >> 4, tq = seg[off] & 15;
                if (pq > 1 || tq > 3 || len - off - 1 < 64 * (pq + 1)) return HP_EDATA;
                for (i = 0; i < 64; i++)
                    h->qt[tq][hp_natural[i]] = (uint16_t)(pq ? hp_be16(seg + off + 1 + 2 * i)
                                                             : seg[off + 1 + i]);
                h->qt_defined[tq] = 1;
                off += 1 + 64 * (pq + 1);
            }
            break;
        }
        case 0xDD:                          /* DRI */
            if (len < 2) return HP_EDATA;
            h->restart_interval = hp_be16(seg);
            break;
        case 0xDA: {                        /* SOS: the header ends here */
            int ns, used = 0;
            if (!sof) return HP_UNSUPPORTED;
            if (len < 1) return HP_EDATA;
            ns = seg[0];
            if (ns != h->ncomp) return HP_UNSUPPORTED;   /* one scan per component */
            if (len < 1 + 2 * ns + 3) return HP_EDATA;
            for (i = 0; i < ns; i++) {
                int cid = seg[1 + 2 * i], k;
                for (k = 0; k < h->ncomp && h->comp[k].id != cid; k++) {}
                if (k == h->ncomp || (used >> k) & 1) return HP_EDATA;
                /* Scan order equal to frame order: the MCU layout below assumes it. */
                if (k != i) return HP_UNSUPPORTED;
                used |= 1 << k;
                h->comp[k].td = seg[2 + 2 * i] >> 4;
                h->comp[k].ta = seg[2 + 2 * i] & 15;
                if (h->comp[k].td > 3 || h->comp[k].ta > 3) return HP_EDATA;
                if (!h->dc[h->comp[k].td].defined || !h->ac[h->comp[k].ta].defined)
                    return HP_UNSUPPORTED;   /* libjpeg-turbo substitutes default tables */
            }
            if (seg[1 + 2 * ns] != 0 || seg[2 + 2 * ns] != 63 || seg[3 + 2 * ns] != 0)
                return HP_UNSUPPORTED;       /* spectral selection in a sequential scan */
            h->scan_start = pos;
            goto header_done;
        }
        case 0xE0:                          /* APP0: JFIF when at least 14 bytes long */
            if (len >= 14 && !memcmp(seg, "JFIF", 5)) h->saw_jfif = 1;
            break;
        case 0xEE:                          /* APP14: Adobe when at least 12 bytes long */
            if (len >= 12 && !memcmp(seg, "Adobe", 5)) {
                h->saw_adobe = 1;
                h->adobe_transform = seg[11];
            }
            break;
        default:
            break;
        }
    }
header_done:
    h->interleaved = h->ncomp > 1;
    if (h->interleaved) {
        h->mcux = (int)(((int64_t)h->width + 8 * h->hmax - 1) / (8 * h->hmax));
        h->mcuy = (int)(((int64_t)h->height + 8 * h->vmax - 1) / (8 * h->vmax));
        h->blocks_in_mcu = 0;
        for (i = 0; i < h->ncomp; i++) {
            h->comp[i].bw = h->mcux * h->comp[i].h;
            h->comp[i].bh = h->mcuy * h->comp[i].v;
            h->blocks_in_mcu += h->comp[i].h * h->comp[i].v;
        }
        if (h->blocks_in_mcu > HP_MAX_BLOCKS_IN_MCU) return HP_EDATA;
    } else {
        /* A single-component scan codes the component's own blocks, one per MCU (A.2.2). */
        int64_t cw = ((int64_t)h->width * h->comp[0].h + h->hmax - 1) / h->hmax;
        int64_t ch = ((int64_t)h->height * h->comp[0].v + h->vmax - 1) / h->vmax;
        h->mcux = (int)((cw + 7) / 8);
        h->mcuy = (int)((ch + 7) / 8);
        h->comp[0].bw = h->mcux;
        h->comp[0].bh = h->mcuy;
        h->blocks_in_mcu = 1;
    }
    h->n_mcu = (int64_t)h->mcux * h->mcuy;
    h->n_int = h->restart_interval ? (h->n_mcu + h->restart_interval - 1) / h->restart_interval
                                   : 1;
    return HP_OK;
}

enum { HP_GREY = 1, HP_YCC = 2, HP_RGB = 3 };

/* The colour space libjpeg-turbo decodes the frame as (its default_decompress_parms): grey for
 * one component; for three, YCbCr when a JFIF marker is present, else as an Adobe marker's
 * transform says (0 RGB, 1 YCbCr), else RGB only for component ids 'R','G','B'. An Adobe
 * transform libjpeg-turbo warns about is HP_UNSUPPORTED. */
static int hp_colour_space(const hp_header* h) {
    if (h->ncomp == 1) return HP_GREY;
    if (h->ncomp != 3) return HP_UNSUPPORTED;
    if (h->saw_jfif) return HP_YCC;
    if (h->saw_adobe) {
        if (h->adobe_transform == 0) return HP_RGB;
        return h->adobe_transform == 1 ? HP_YCC : HP_UNSUPPORTED;
    }
    if (h->comp[0].id == 'R' && h->comp[1].id == 'G' && h->comp[2].id == 'B') return HP_RGB;
    return HP_YCC;
}

/* Offset of the next marker (its first 0xFF, fill bytes included) at or after pos in
 * entropy-coded data, its code in *code; -1 when the data ends first. */
static int64_t hp_next_marker(const uint8_t* p, size_t pos, size_t n, int* code) {
    while (pos < n) {
        const uint8_t* f = (const uint8_t*)memchr(p + pos, 0xFF, n - pos);
        size_t m, j;
        if (!f) return -1;
        m = (size_t)(f - p);
        j = m + 1;
        while (j < n && p[j] == 0xFF) j++;
        if (j >= n) return -1;
        if (p[j] == 0) { pos = j + 1; continue; }
        *code = p[j];
        return (int64_t)m;
    }
    return -1;
}

/* [starts[k], ends[k]) of the entropy-coded bytes of restart interval k, for the first
 * n (<= h->n_int) intervals, by a bounded scan from the scan start. Every interval but the
 * last found must end in the RSTn T.81 assigns it (n mod 8); the last one ends at whatever
 * marker follows. HP_EDATA when the markers are missing or out of sequence. */
static int hp_find_intervals(const hp_header* h, const uint8_t* data, size_t size,
                             int64_t n, size_t* starts, size_t* ends) {
    size_t pos = h->scan_start;
    int64_t k;
    int code = 0;
    for (k = 0; k < n; k++) {
        int64_t m = hp_next_marker(data, pos, size, &code);
        starts[k] = pos;
        if (m < 0) {
            if (k + 1 < h->n_int) return HP_EDATA;
            ends[k] = size;       /* no EOI: the bit reader pads, and detects overrun */
            return HP_OK;
        }
        ends[k] = (size_t)m;
        if (k + 1 < h->n_int) {
            if (code != 0xD0 + (int)(k & 7)) return HP_EDATA;
            pos = (size_t)m;
            while (data[pos] == 0xFF) pos++;
            pos++;
        }
    }
    return HP_OK;
}

/* Restart intervals from a packed dataset's index instead of a marker scan. The index entry
 * (idx, len bytes; untrusted) is n_int + 1 unsigned LEB128 varints: the record offset of
 * interval 0's first entropy-coded byte, each following interval's start minus the previous
 * start, and the end of the last interval (the offset of the marker after it) minus its start.
 * Fills starts/ends of the first n (<= h->n_int) intervals as hp_find_intervals would for a
 * stream whose restart markers carry no fill bytes (ends[k] = starts[k + 1] - 2). Checks,
 * before any offset is used: the entry holds exactly n_int + 1 values of at most 32 bits;
 * interval 0 starts where the header's scan does; every start k >= 1 lies past the previous
 * one by at least its 2-byte marker, inside the record, right after the RSTn T.81 assigns
 * interval k - 1 (checked where it ends one of the n intervals used); the last end lies inside the record. HP_EDATA when any fails (the caller
 * falls back to a scan or to libjpeg-turbo). O(len) over the index, 2 bytes read per interval
 * used. */
static int hp_index_intervals(const hp_header* h, const uint8_t* data, size_t size,
                              const uint8_t* idx, size_t len, int64_t n, size_t* starts,
                              size_t* ends) {
    size_t i = 0, pos = 0;
    int64_t k = 0;
    if (!h->restart_interval || n < 1 || n > h->n_int) return HP_EDATA;
    while (i < len) {
        uint64_t v = 0;
        int shift = 0;
        for (;;) {
            uint8_t c;
            if (i >= len || shift > 28) return HP_EDATA;
            c = idx[i++];
            v |= (uint64_t)(c & 0x7F) << shift;
            if (!(c & 0x80)) break;
            shift += 7;
        }
        if (v > UINT32_MAX) return HP_EDATA;
        if (k > h->n_int) return HP_EDATA;          /* more values than intervals + 1 */
        if (k == 0) {
            if (v != h->scan_start) return HP_EDATA;
            pos = (size_t)v;
        } else {
            /* pos + v <= size, written without a sum that could wrap; a start lies at
             * least its marker's 2 bytes past the previous start. */
            if (v > size || pos > size - (size_t)v || (k < h->n_int && v < 2))
                return HP_EDATA;
            pos += (size_t)v;
            if (k < h->n_int) {                      /* pos: start of interval k */
                if (k <= n) {                        /* it ends interval k - 1 */
                    if (data[pos - 2] != 0xFF || data[pos - 1] != 0xD0 + (int)((k - 1) & 7))
                        return HP_EDATA;
                    ends[k - 1] = pos - 2;
                }
            } else if (k - 1 < n) {                  /* pos: end of the last interval */
                ends[k - 1] = pos;
            }
        }
        if (k < n) starts[k] = pos;
        k++;
    }
    return k == h->n_int + 1 ? HP_OK : HP_EDATA;
}

/* --- bit reader over one interval: F.2.2.4 (NEXTBIT) with B.1.1.5 byte stuffing ------------
 * The next unread bit is bit 63 of acc; nbits of acc are valid. Past the interval's end zero
 * bytes are shifted in and counted, so reading beyond the data is detected when the interval
 * is done rather than tested per bit. */
typedef struct {
    uint64_t acc;
    int nbits;
    const uint8_t* p;
    const uint8_t* end;
    int64_t pad_bits;
    int bad;                /* a code no table holds */
} hp_bits;

static inline void hp_bits_init(hp_bits* b, const uint8_t* start, const uint8_t* end) {
    b->acc = 0; b->nbits = 0; b->p = start; b->end = end; b->pad_bits = 0; b->bad = 0;
}

static inline uint64_t hp_load_be64(const uint8_t* p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

static void hp_refill_slow(hp_bits* b) {
    while (b->nbits <= 56) {
        unsigned int c = 0;
        if (b->p < b->end) {
            c = *b->p++;
            if (c == 0xFF) {
                /* Inside an interval a 0xFF is always stuffed (followed by 0x00): the
                 * interval ends at its first marker. */
                if (b->p < b->end && *b->p == 0) b->p++;
                else { b->p = b->end; c = 0; b->pad_bits += 8; }
            }
        } else {
            b->pad_bits += 8;
        }
        b->acc |= (uint64_t)c << (56 - b->nbits);
        b->nbits += 8;
    }
}

/* At least 57 valid bits afterwards. Eight bytes at a time when none is 0xFF; the bits of a
 * partly taken byte are OR-ed in again identically by the next load. */
static inline void hp_refill(hp_bits* b) {
    if (b->end - b->p >= 8) {
        uint64_t w = hp_load_be64(b->p), nw = ~w;
        if (!((nw - 0x0101010101010101ULL) & ~nw & 0x8080808080808080ULL)) {
            b->acc |= w >> b->nbits;
            b->p += (63 - b->nbits) >> 3;
            b->nbits |= 56;
            return;
        }
    }
    hp_refill_slow(b);
}

static inline void hp_consume(hp_bits* b, int n) { b->acc <<= n; b->nbits -= n; }

/* F.2.2.3 DECODE for a code longer than HP_LOOKAHEAD bits (or any code, slowly). Needs 16
 * valid bits. A code no table holds sets b->bad and yields symbol 0. */
static int hp_decode_slow(hp_bits* b, const hp_table* t) {
    int l;
    for (l = HP_LOOKAHEAD + 1; l <= 16; l++) {
        int32_t code = (int32_t)(b->acc >> (64 - l));
        if (code <= t->maxcode[l]) {
            hp_consume(b, l);
            return t->vals[(code + t->valoffset[l]) & 0xFF];
        }
    }
    b->bad = 1;
    hp_consume(b, 16);
    return 0;
}

static inline int hp_decode(hp_bits* b, const hp_table* t) {
    int e = t->fast[b->acc >> (64 - HP_LOOKAHEAD)];
    if (e) { hp_consume(b, e >> 8); return e & 0xFF; }
    return hp_decode_slow(b, t);
}

static inline int hp_receive_extend(hp_bits* b, int s) {
    int v;
    if (!s) return 0;
    v = (int)(b->acc >> (64 - s));
    hp_consume(b, s);
    return hp_extend(v, s);
}

/* One block (F.2.2.1 DC, F.2.2.2 AC) into blk (64 coefficients, zeroed by the caller). */
static inline void hp_decode_block(hp_bits* b, const hp_table* dc, const hp_table* ac,
                                   int32_t* pred, int16_t* blk) {
    int s, k;
    hp_refill(b);
    s = hp_decode(b, dc);
    *pred = (int32_t)((uint32_t)*pred + (uint32_t)hp_receive_extend(b, s));
    blk[0] = (int16_t)*pred;
    for (k = 1; k < 64; ) {
        int32_t e;
        if (b->nbits < 32) hp_refill(b);
        e = ac->acfast[b->acc >> (64 - HP_LOOKAHEAD)];
        if (e) {
            int run = (e >> 8) & 0xFF;
            hp_consume(b, e & 0xFF);
            if (run == 0xFF) break;             /* EOB */
            k += run - 1;
            blk[hp_natural[k]] = (int16_t)(e >> 16);
            k++;
        } else {
            int rs = hp_decode(b, ac), r = rs >> 4;
            s = rs & 15;
            if (s) {
                k += r;
                blk[hp_natural[k]] = (int16_t)hp_receive_extend(b, s);
                k++;
            } else if (r == 15) {
                k += 16;                         /* ZRL */
            } else {
                break;                           /* EOB (and 0x10..0xE0 as libjpeg reads them) */
            }
        }
    }
}

/* --- several bit streams interleaved in one thread ------------------------------------------
 * Decoding one stream is a serial chain: where a code ends decides where the next one starts.
 * Independent streams (the restart intervals of a rectangle, or the scans of several images)
 * have independent chains, so the decoder keeps up to HP_MAX_LANES bit readers ("lanes") and
 * advances them round-robin one block at a time, so that an out-of-order core can overlap one
 * lane's block with the next lane's. (One symbol at a time was measured too: keeping every
 * lane's state in memory and a state machine per symbol cost more than the overlap gained,
 * docs/design/entropy.md.) Each lane decodes one work item, an interval (or a
 * marker-less scan) from its first MCU up to its last MCU in the rectangle, exactly as a single
 * reader would; when it is done the lane takes the next item. Results do not depend on the
 * number of lanes: each item writes only its own MCUs' blocks. */

#define HP_MAX_LANES 8
/* Lanes hp_decode_rect uses. 1, 2, 3, 4, 6 and 8 measured alike on x86-64 (within 2 %,
 * bench/bench_entropy.py --lanes): the decoder is bound by its instruction count, not by the
 * latency of one stream's chain, so 1 (the least state). Cortex-A72: 1 as well until measured
 * there (docs/design/entropy.md, "Interleaving"). */
#ifndef HP_LANES
#define HP_LANES 1
#endif

/* One rectangle of one image to decode: the MCU rows [r0, r1) x columns [c0, c1) into out
 * (out[c]: component c's blocks of the rectangle, row-major, (r1 - r0) * v rows of
 * (c1 - c0) * h blocks, one block per MCU for a single component, zeroed by the caller).
 * starts/ends locate every interval up to the one holding the rectangle's last MCU
 * (hp_find_intervals, or a packed index); without restart markers starts[0]/ends[0] is the
 * scan. status is the job's result after hp_decode_jobs. The remaining fields are the
 * decoder's. */
typedef struct {
    const hp_header* h;
    const uint8_t* data;
    const size_t* starts;
    const size_t* ends;
    int r0, r1, c0, c1;
    int16_t* const* out;
    int status;
    int row;                /* next MCU row whose intervals are issued */
    int64_t k, z, prev;     /* next interval of that row, its last, the last issued */
    int done;
} hp_job;

typedef struct {
    hp_bits b;
    hp_job* job;
    int16_t* blk;           /* block being decoded */
    const hp_table* dc;
    const hp_table* ac;
    int bi;                 /* block of the MCU */
    int ci;                 /* its component */
    int keep;               /* the MCU lies in the rectangle */
    int64_t m, last;        /* MCU being decoded, last one to decode */
    int to_end;             /* last is the interval's own last MCU */
    int16_t* base[HP_MAX_COMPS];   /* the MCU's first block of each component in out */
    int32_t pred[HP_MAX_COMPS];
    int16_t scratch[64];    /* blocks of MCUs outside the rectangle */
} hp_lane;

/* The next work item of job j: interval *k from MCU *first to *last. 0 when none is left. */
static int hp_job_next(hp_job* j, int64_t* k, int64_t* first, int64_t* last, int* to_end) {
    const hp_header* h = j->h;
    const int64_t R = h->restart_interval, mcux = h->mcux;
    int64_t own_last, row_last;
    if (j->done) return 0;
    if (!R) {
        j->done = 1;
        *k = 0; *first = 0;
        *last = (int64_t)(j->r1 - 1) * mcux + j->c1 - 1;
        *to_end = *last == h->n_mcu - 1;
        return 1;
    }
    while (j->k > j->z) {
        int64_t a;
        if (j->row >= j->r1) { j->done = 1; return 0; }
        a = (j->row * mcux + j->c0) / R;
        j->z = (j->row * mcux + j->c1 - 1) / R;
        j->k = a > j->prev ? a : j->prev + 1;
        j->row++;
    }
    *k = j->k;
    *first = j->k * R;
    own_last = *first + R - 1;
    if (own_last >= h->n_mcu) own_last = h->n_mcu - 1;
    *last = own_last;
    /* Stop inside the interval at the rectangle's last MCU it holds. */
    row_last = (own_last / mcux) * mcux + j->c1 - 1;
    if (own_last / mcux >= j->r1) row_last = (int64_t)(j->r1 - 1) * mcux + j->c1 - 1;
    if (row_last < own_last && row_last >= *first) *last = row_last;
    *to_end = *last == own_last;
    j->prev = j->k++;
    return 1;
}

static int hp_job_start(hp_job* j) {
    const hp_header* h = j->h;
    if (j->r0 < 0 || j->c0 < 0 || j->r1 > h->mcuy || j->c1 > h->mcux || j->r0 >= j->r1
        || j->c0 >= j->c1)
        return HP_ESIZE;
    j->status = HP_OK;
    j->row = j->r0;
    j->k = 1; j->z = 0; j->prev = -1;
    j->done = 0;
    return HP_OK;
}

/* Position lane L on block bi of MCU L->m (bi 0: the MCU's output addresses first). */
static inline void hp_lane_block(hp_lane* L, int bi) {
    const hp_header* h = L->job->h;
    int ci, y, x, n = 0, hh = 1, vv = 1;
    if (bi == 0) {
        const hp_job* j = L->job;
        int row = (int)(L->m / h->mcux), col = (int)(L->m % h->mcux);
        L->keep = row >= j->r0 && row < j->r1 && col >= j->c0 && col < j->c1;
        if (L->keep)
            for (ci = 0; ci < h->ncomp; ci++) {
                hh = h->interleaved ? h->comp[ci].h : 1;
                vv = h->interleaved ? h->comp[ci].v : 1;
                L->base[ci] = j->out[ci] + 64 * ((size_t)(row - j->r0) * vv
                                                 * (size_t)(j->c1 - j->c0) * hh
                                                 + (size_t)(col - j->c0) * hh);
            }
    }
    /* Block bi is block (y, x) of component ci in the MCU (A.2.3: components in scan order,
     * each one's blocks row by row). */
    for (ci = 0; ci < h->ncomp; ci++) {
        hh = h->interleaved ? h->comp[ci].h : 1;
        vv = h->interleaved ? h->comp[ci].v : 1;
        if (bi < n + hh * vv) break;
        n += hh * vv;
    }
    y = (bi - n) / hh; x = (bi - n) % hh;
    L->bi = bi;
    L->ci = ci;
    L->dc = &h->dc[h->comp[ci].td];
    L->ac = &h->ac[h->comp[ci].ta];
    if (L->keep) {
        L->blk = L->base[ci] + 64 * ((size_t)y * (size_t)(L->job->c1 - L->job->c0) * hh + x);
    } else {
        memset(L->scratch, 0, sizeof(L->scratch));
        L->blk = L->scratch;
    }
}

/* Give lane L the next work item of jobs[*next..n): 1, or 0 when every job is exhausted.
 * Items of a job already failed are skipped. */
static int hp_lane_take(hp_lane* L, hp_job* jobs, int n, int* next) {
    int64_t k, first, last;
    int to_end;
    while (*next < n) {
        hp_job* j = &jobs[*next];
        if (j->status == HP_OK && hp_job_next(j, &k, &first, &last, &to_end)) {
            L->job = j;
            hp_bits_init(&L->b, j->data + j->starts[k], j->data + j->ends[k]);
            L->m = first;
            L->last = last;
            L->to_end = to_end;
            L->pred[0] = L->pred[1] = L->pred[2] = L->pred[3] = 0;
            hp_lane_block(L, 0);
            return 1;
        }
        ++*next;
    }
    return 0;
}

/* The lane finished its block: the next block, the next MCU, or the item's end (checked as
 * a single reader checks it). Returns 0 when the item is done. */
static inline int hp_lane_advance(hp_lane* L) {
    const hp_header* h = L->job->h;
    hp_bits* b = &L->b;
    if (L->bi + 1 < h->blocks_in_mcu) {
        hp_lane_block(L, L->bi + 1);
        return 1;
    }
    if (b->bad) { L->job->status = HP_EDATA; return 0; }
    if (L->m < L->last) {
        L->m++;
        hp_lane_block(L, 0);
        return 1;
    }
    /* Bits taken from the zero padding past the interval's data: it was truncated. */
    if (b->pad_bits > b->nbits) { L->job->status = HP_EDATA; return 0; }
    /* Whole bytes left over after the interval's last MCU: damaged data that libjpeg-turbo
     * reports ("extraneous bytes before marker"); its path decides what that means. */
    if (L->to_end && ((b->nbits - b->pad_bits) >= 8 || b->p < b->end))
        L->job->status = HP_EDATA;
    return 0;
}

/* One block of lane L (F.2.2.1 DC, F.2.2.2 AC); 0 when its item is done. */
static inline int hp_lane_step(hp_lane* L) {
    hp_decode_block(&L->b, L->dc, L->ac, &L->pred[L->ci], L->blk);
    return hp_lane_advance(L);
}

/* Decode jobs[0..n) (see hp_job; each one's rectangle checked, its status set) with `lanes`
 * (1..HP_MAX_LANES) bit streams in flight. Returns HP_OK when every job decoded, else the
 * first failing job's status; each job's own result is in its status. Memory: the lanes,
 * about 300 bytes each, on the stack. */
static int hp_decode_jobs(hp_job* jobs, int n, int lanes) {
    hp_lane L[HP_MAX_LANES];
    int i, active = 0, next = 0, rc = HP_OK;
    if (lanes < 1 || lanes > HP_MAX_LANES) return HP_ESIZE;
    for (i = 0; i < n; i++) {
        int s = hp_job_start(&jobs[i]);
        if (s != HP_OK) { jobs[i].status = s; jobs[i].done = 1; }
    }
    while (active < lanes && hp_lane_take(&L[active], jobs, n, &next)) active++;
    while (active) {
        for (i = 0; i < active; i++) {
            if (hp_lane_step(&L[i])) continue;
            /* Item done: the lane takes the next one, or the last lane moves into its place. */
            if (!hp_lane_take(&L[i], jobs, n, &next)) {
                active--;
                if (i < active) {
                    L[i] = L[active];
                    if (L[i].blk == L[active].scratch) L[i].blk = L[i].scratch;
                }
                i--;
            }
        }
    }
    for (i = 0; i < n; i++)
        if (jobs[i].status != HP_OK) { rc = jobs[i].status; break; }
    return rc;
}

/* Decode the MCUs of rows [r0, r1) x columns [c0, c1) into out (see hp_job) with `lanes`
 * intervals interleaved. With restart markers only the intervals overlapping the rectangle
 * are read, each up to its last MCU inside it; without, the scan is read from its start up
 * to the rectangle's last MCU. */
static int hp_decode_rect_lanes(const hp_header* h, const uint8_t* data, const size_t* starts,
                                const size_t* ends, int r0, int r1, int c0, int c1,
                                int16_t* const* out, int lanes) {
    hp_job j;
    j.h = h; j.data = data; j.starts = starts; j.ends = ends;
    j.r0 = r0; j.r1 = r1; j.c0 = c0; j.c1 = c1; j.out = out;
    return hp_decode_jobs(&j, 1, lanes);
}

static int hp_decode_rect(const hp_header* h, const uint8_t* data, const size_t* starts,
                          const size_t* ends, int r0, int r1, int c0, int c1,
                          int16_t* const* out) {
    return hp_decode_rect_lanes(h, data, starts, ends, r0, r1, c0, c1, out, HP_LANES);
}

#endif
