/* The pixel kernels' levels (px_kern of src/dpu_pipe/_idct.h) side by side on random
 * coefficient blocks (extreme values included) and random rows, built natively and for
 * aarch64 by tests/test_pixel_kernels.py: exits nonzero when a level differs from the
 * scalar reference, and prints hashes of the reference's outputs, which must be the same on
 * every architecture. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <stddef.h>
#include "_idct.h"
static uint64_t st = 88172645463325252ull;
static uint32_t rnd(void) { st ^= st << 13; st ^= st >> 7; st ^= st << 17; return (uint32_t)(st >> 11); }
static uint64_t fnv(uint64_t h, const uint8_t* p, size_t n) { while (n--) { h ^= *p++; h *= 1099511628211ull; } return h; }
int main(void) {
    int lv, b, k, fast, mism = 0;
    px_init_tables();
    for (fast = 0; fast < 4; fast++) {     /* islow, ifast, 4x4, 2x2 */
        int size = fast < 2 ? 8 : fast == 2 ? 4 : 2;
        uint64_t hash[3] = {1469598103934665603ull, 1469598103934665603ull, 1469598103934665603ull};
        int nfb = 0;
        for (b = 0; b < 60000; b++) {
            int16_t in[64]; uint16_t q[64]; int32_t mq[64]; uint8_t out[3][64]; int rc[3];
            int amp = 1 << (rnd() % 14);
            for (k = 0; k < 64; k++) {
                int u = k >> 3, v = k & 7;
                in[k] = (int16_t)(((int)(rnd() % (2 * amp + 1)) - amp) / (1 + u + v) * (rnd() % 3 == 0));
                q[k] = (uint16_t)(1 + rnd() % (b % 7 == 0 ? 255 : 16));
            }
            if (b % 97 == 0) for (k = 0; k < 64; k++) in[k] = (int16_t)((rnd() & 1) ? 32767 : -32768) * (rnd() % 4 == 0);
            if (fast == 1 && px_ifast_multipliers(q, mq)) continue;
            for (lv = 0; lv <= px_simd_max; lv++) {
                memset(out[lv], 0, 64);
                rc[lv] = px_idct_block(lv, size, in, q, fast == 1 ? mq : NULL, out[lv], 8);
                if (!rc[lv]) hash[lv] = fnv(hash[lv], out[lv], 64);
                hash[lv] = fnv(hash[lv], (const uint8_t*)&rc[lv], 1);
                if (lv && (rc[lv] != rc[0] || (!rc[0] && memcmp(out[0], out[lv], 64)))) mism++;
            }
            nfb += rc[0] != 0;
        }
        for (lv = 0; lv <= px_simd_max; lv++) printf("idct kind=%d level %d hash %016llx fallbacks %d\n", fast, lv, (unsigned long long)hash[lv], nfb);
    }
    {
        uint8_t y[1000], cb[1000], cr[1000], o[3][3000]; const uint8_t* c[3] = {y, cb, cr};
        uint64_t h = 1469598103934665603ull; int n, col;
        for (n = 1; n < 1000; n += 7) {
            for (k = 0; k < n; k++) { y[k] = rnd(); cb[k] = rnd(); cr[k] = rnd(); }
            for (col = 0; col < 3; col++) {
                int cs = col == 0 ? HP_GREY : col == 1 ? HP_RGB : HP_YCC;
                px_kern[0].rgb_row(cs, c, o[0], n);
                for (lv = 1; lv <= px_simd_max; lv++) { px_kern[lv].rgb_row(cs, c, o[lv], n); if (memcmp(o[0], o[lv], 3 * n)) mism++; }
                h = fnv(h, o[0], 3 * n);
            }
        }
        printf("rgb rows hash %016llx\n", (unsigned long long)h);
    }
    printf("mismatches between levels: %d (levels 0..%d)\n", mism, px_simd_max);
    return mism != 0;
}
