/* HDF5's shuffle of a chunk's rows (byte k of every row together), for the writer's busy tables
 * (collector/writer.py DirectChunks): the same bytes as H5Z's shuffle filter, which readers undo.
 *
 * Why here: numpy's transpose of the (rows, row bytes) matrix copies one byte at a time with a
 * stride of a row: 27 ns of CPU a row of the calls table (79 bytes; GROMACS makes 15 000 calls a
 * second on 2 ranks), against 15 here (bench_collector.py's writer_shuffle line). Blocks of 16 rows
 * by 16 bytes are transposed in SSE2 registers (x86-64's baseline): 16 loads, 64 unpacks, 16
 * stores. A row size that is not a multiple of 16 takes its last block overlapping the one before
 * (the bytes written twice are the same); the rows after the last whole 16, and any build without
 * SSE2, take the byte loop.
 */
#include <stddef.h>
#include <stdint.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define EXPORT __attribute__((visibility("default")))

#ifdef __SSE2__
/* One round of the transpose: registers 2i and 2i+1 interleaved in units of the round's width,
 * low halves to i, high halves to i + 8. */
#define GP_INTERLEAVE(from, to, lo, hi)                       \
    for (int i = 0; i < 8; i++) {                             \
        (to)[i] = lo((from)[2 * i], (from)[2 * i + 1]);       \
        (to)[i + 8] = hi((from)[2 * i], (from)[2 * i + 1]);   \
    }

/* Four rounds: the 16 rows' bytes end up one column a register, column c in r[bit-reversed c]
 * (each round moves one bit of the column index into the register index). */
static inline void transpose16(__m128i r[16])
{
    __m128i t[16];
    GP_INTERLEAVE(r, t, _mm_unpacklo_epi8, _mm_unpackhi_epi8)
    GP_INTERLEAVE(t, r, _mm_unpacklo_epi16, _mm_unpackhi_epi16)
    GP_INTERLEAVE(r, t, _mm_unpacklo_epi32, _mm_unpackhi_epi32)
    GP_INTERLEAVE(t, r, _mm_unpacklo_epi64, _mm_unpackhi_epi64)
}

static const uint8_t BIT_REVERSED[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#endif

/* dst[k * rows + i] = src[i * size + k] for every row i < rows and byte k < size. */
EXPORT void gp_shuffle(const uint8_t *src, uint8_t *dst, size_t rows, size_t size)
{
    size_t first = 0; /* the first row left to the byte loop */
#ifdef __SSE2__
    if (size >= 16) {
        for (; first + 16 <= rows; first += 16) {
            const uint8_t *block = src + first * size;
            for (size_t k = 0; k < size; k += 16) {
                size_t at = k + 16 <= size ? k : size - 16;
                __m128i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = _mm_loadu_si128((const __m128i *)(block + i * size + at));
                transpose16(r);
                for (int c = 0; c < 16; c++)
                    _mm_storeu_si128((__m128i *)(dst + (at + c) * rows + first), r[BIT_REVERSED[c]]);
            }
        }
    }
#endif
    for (size_t k = 0; k < size; k++)
        for (size_t i = first; i < rows; i++)
            dst[k * rows + i] = src[i * size + k];
}
