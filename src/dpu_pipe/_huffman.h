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

#define HP_LOOKAHEAD 9
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

/* Decode restart interval k (or the whole scan when there are no restart markers) up to and
 * including MCU `last` (an absolute MCU index inside the interval), storing the MCUs that fall
 * in the rectangle rows [r0, r1) x columns [c0, c1) of MCUs. out[c] holds component c's blocks
 * of the rectangle, row-major, (r1 - r0) * v rows of (c1 - c0) * h blocks (one block per MCU
 * for a single component), zeroed by the caller. `to_end`: `last` is the interval's own last
 * MCU, so its data must end there too. */
static int hp_decode_interval(const hp_header* h, const uint8_t* start, const uint8_t* end,
                              int64_t first, int64_t last, int to_end, int r0, int r1, int c0,
                              int c1, int16_t* const* out) {
    hp_bits b;
    int32_t pred[HP_MAX_COMPS] = {0, 0, 0, 0};
    int16_t scratch[64];
    int64_t m;
    int ci, y, x;
    const int ncomp = h->ncomp, mcux = h->mcux;
    const int rw = c1 - c0;
    hp_bits_init(&b, start, end);
    for (m = first; m <= last; m++) {
        int row = (int)(m / mcux), col = (int)(m % mcux);
        int keep = row >= r0 && row < r1 && col >= c0 && col < c1;
        for (ci = 0; ci < ncomp; ci++) {
            const hp_comp* c = &h->comp[ci];
            const hp_table* dc = &h->dc[c->td];
            const hp_table* ac = &h->ac[c->ta];
            int hh = h->interleaved ? c->h : 1, vv = h->interleaved ? c->v : 1;
            size_t stride = (size_t)rw * hh;     /* blocks per row of the rectangle */
            for (y = 0; y < vv; y++) {
                for (x = 0; x < hh; x++) {
                    int16_t* blk;
                    if (keep) {
                        blk = out[ci] + 64 * (((size_t)(row - r0) * vv + y) * stride
                                              + (size_t)(col - c0) * hh + x);
                    } else {
                        memset(scratch, 0, sizeof(scratch));
                        blk = scratch;
                    }
                    hp_decode_block(&b, dc, ac, &pred[ci], blk);
                }
            }
        }
        if (b.bad) return HP_EDATA;
    }
    /* Bits taken from the zero padding past the interval's data: it was truncated. */
    if (b.pad_bits > b.nbits) return HP_EDATA;
    /* Whole bytes left over after the interval's last MCU: damaged data that libjpeg-turbo
     * reports ("extraneous bytes before marker"); its path decides what that means. */
    if (to_end && ((b.nbits - b.pad_bits) >= 8 || b.p < b.end)) return HP_EDATA;
    return HP_OK;
}

/* Decode the MCUs of rows [r0, r1) x columns [c0, c1) into out (see hp_decode_interval).
 * With restart markers, starts/ends locate every interval up to the one holding the last
 * MCU needed (hp_find_intervals) and only intervals overlapping the rectangle are read, each
 * up to its last MCU inside it; without, the scan is read from its start up to the
 * rectangle's last MCU (starts[0]/ends[0]). */
static int hp_decode_rect(const hp_header* h, const uint8_t* data, const size_t* starts,
                          const size_t* ends, int r0, int r1, int c0, int c1,
                          int16_t* const* out) {
    const int64_t R = h->restart_interval, mcux = h->mcux;
    int64_t prev = -1;
    int r, status;
    if (r0 < 0 || c0 < 0 || r1 > h->mcuy || c1 > h->mcux || r0 >= r1 || c0 >= c1)
        return HP_ESIZE;
    if (!R) {
        int64_t last = (int64_t)(r1 - 1) * mcux + c1 - 1;
        return hp_decode_interval(h, data + starts[0], data + ends[0], 0, last,
                                  last == h->n_mcu - 1, r0, r1, c0, c1, out);
    }
    for (r = r0; r < r1; r++) {
        int64_t a = (r * mcux + c0) / R, z = (r * mcux + c1 - 1) / R, k;
        for (k = a > prev ? a : prev + 1; k <= z; k++) {
            int64_t first = k * R, last = first + R - 1, own_last, row_last;
            if (last >= h->n_mcu) last = h->n_mcu - 1;
            own_last = last;
            /* Stop inside the interval at the rectangle's last MCU it holds. */
            row_last = (last / mcux) * mcux + c1 - 1;
            if (last / mcux >= r1) row_last = (int64_t)(r1 - 1) * mcux + c1 - 1;
            if (row_last < last && row_last >= first) last = row_last;
            status = hp_decode_interval(h, data + starts[k], data + ends[k], first, last,
                                        last == own_last, r0, r1, c0, c1, out);
            if (status != HP_OK) return status;
            prev = k;
        }
    }
    return HP_OK;
}

#endif
