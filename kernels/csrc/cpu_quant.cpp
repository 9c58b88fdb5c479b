// Matmuls and embedding lookups against GGUF block-quantized weights, read in place (pdserve.kernels.quant_ops).
//
// One binary serves every x86-64 CPU: it is compiled for the baseline ISA, and the AVX2 and AVX-512 VNNI
// functions carry their own target attributes; Python picks the path (quant_ops.choose_isa) and passes it
// in, and `isa_supported` refuses a path this CPU cannot run.
//
// Method. y[m, n] = sum_k x[m, k] * w[n, k]. Each call first quantizes the activation rows to int8 (one
// float scale d per span of 32 values, or 256 for the K types in the row kernels; the spans' int sums kept
// per 16 for the weight offsets and mins). Every served type reads as groups of 32 weights w = a * q + b, q
// an unsigned integer of 4 to 8 bits, with one (a, b) per group (per 16 for Q6_K); b is an integer offset
// times a for the symmetric types (Q8_0, Q4_0, Q5_0, Q6_K) and a float min for the others (Q4_1, Q4_K,
// Q5_K). So a group contributes
//   a * d * sum(q * xq) + b-term,  sum(q * xq) an exact integer dot product,
// with the offset folded into the integer sum (-offset * sum(xq)) and the min as b * d * sum(xq).
// The int8x2 activations (the default) add a second int8 term per value: r = x - d * xq, at most d / 2,
// rounded with its own scale (at most d / 254) as activation row M + m. The kernels take the 2M rows as
// any others (each weight row or panel still read and decoded once per call; twice the integer work) and
// output m is the sum of rows m and M + m: the activations' error falls 254-fold, to about 15 bits.
// Except at up to WIDE_ROW_MAX_M rows of a 32-value type, where int8x2 rounds each activation to int16 instead
// (one scale per 32, max |x| / 32767: the same ~15 bits in one term) and the row kernels take the widened
// weight quants against it with PMADDWD (rows32w_*).
//
// Two kernel shapes. The row kernels (1-2 activation rows, quant_ops.ROW_MAX_M) read each weight row once,
// decode its blocks in registers in their own order and dot them with every activation row there; the K
// types apply their sub-block scales in the integers (PMADDWD by the scale), floats only once per 256.
// The panel kernels (more rows) take weight rows in panels of one vector's lanes (16 rows AVX-512, 8 rows
// AVX2): each 4-byte lane of a decoded vector holds four consecutive quants of one row, so one VPDPBUSD
// (AVX2: PMADDUBSW + PMADDWD) against four broadcast activation bytes advances 16 (8) rows at once and
// every lane is a separate output; no horizontal sums. A panel is decoded from the GGUF bytes (16-byte
// loads of each row transposed to lanes by unpacks, nibbles and high bits split, scales widened) a chunk
// of groups at a time into an L1 buffer, and every activation row of a block of MB is dotted against it
// there, so each weight byte is read from memory once per call and decoded once per MB activation rows.
// Under int8x2 from FLOAT_MIN_M rows the portable and AVX2 paths take float panels instead: the decoded
// lanes become dequantize()'s float32 values and meet the float32 activations, unrounded, in FMAs (see
// run_avx2_float). OpenMP threads split the rows (panels).

#include <pybind11/pybind11.h>

#include <omp.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PDQ_X86 1
#else
#define PDQ_X86 0
#endif

namespace py = pybind11;

namespace {

// ------------------------------------------------------------------------------------------- the types

// The order of quant_format.QUANT_TYPES.
enum QType : int { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 3, Q4_K = 4, Q5_K = 5, Q6_K = 6, NUM_TYPES = 7 };
enum Isa : int { PORTABLE = 0, AVX2 = 1, AVX512_VNNI = 2 };
// How the activations are rounded (quant_ops.ACTIVATIONS): int8 per span, or int8x2: int8 and then the
// int8 rounding of what that lost (about 15 bits: the error shrinks 254-fold).
enum Activations : int { INT8 = 0, INT8X2 = 1 };

struct TypeInfo {
  int block_values;  // values per block
  int block_bytes;   // bytes per block
  bool asym;         // float min per group (else an integer offset)
  int offset;        // symmetric types: w = a * (q - offset), q unsigned
  int halves;        // scales per group of 32 (2: Q6_K's groups of 16)
};

constexpr TypeInfo TYPES[NUM_TYPES] = {
    {32, 34, false, 128, 1},   // Q8_0: d, qs[32] int8 (read as q + 128)
    {32, 18, false, 8, 1},     // Q4_0: d, qs[16] nibbles
    {32, 20, true, 0, 1},      // Q4_1: d, m, qs[16]
    {32, 22, false, 16, 1},    // Q5_0: d, qh[4], qs[16]
    {256, 144, true, 0, 1},    // Q4_K: d, dmin, scales[12], qs[128]
    {256, 176, true, 0, 1},    // Q5_K: d, dmin, scales[12], qh[32], qs[128]
    {256, 210, false, 32, 2},  // Q6_K: ql[128], qh[64], scales[16] int8, d
};

constexpr int KC = 32;   // groups of 32 per decoded chunk (a multiple of 8: whole K-type blocks)
constexpr int MB = 64;   // the most activation rows per block: one panel decode serves them all
constexpr int64_t BLOCK_ACT_BYTES = 16384;  // int8 activation bytes of a block of rows: L1-resident

// Activation rows per block for rows of k int8 values: as many as keep the block's activations in L1
// with the decoded chunk (at 64 rows of 576 they spilled to L2 and a panel took 2.3x as long).
inline int64_t rows_per_block(int64_t k) { return std::clamp<int64_t>(BLOCK_ACT_BYTES / k, 8, MB); }
constexpr int ROW_MAX_M = 4;  // the most activation rows the row kernels take (8 kernel rows with int8x2)
// The most activation rows the int16 row kernels take (int8x2, the 32-value types): each row's sums are
// the ones it gets alone, so a speculative step's 1 + d rows verify with a single row's arithmetic.
constexpr int WIDE_ROW_MAX_M = 8;
constexpr int64_t KEEP_SCRATCH_BYTES = 8 << 20;  // activation scratch a thread keeps between calls
constexpr int64_t MIN_THREAD_WORK = 1 << 16;  // row-group units below which another thread does not pay

inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t rd32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// fp16 bits -> float, exact (subnormals, inf, nan included), without F16C.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    float v = float(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K / Q5_K: the 6-bit scale and min of group j (0..7) from the 12 packed bytes.
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// ------------------------------------------------------------------ the float reference (embedding)

// One row's values, in the order and float32 roundings of gguf.quants.dequantize (the tests compare
// bit for bit). Needs -ffp-contract=off: no multiply-add may be fused.
void dequant_row(int type, const uint8_t* src, float* dst, int64_t k) {
  const TypeInfo& t = TYPES[type];
  const int64_t nb = k / t.block_values;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = src + b * t.block_bytes;
    float* y = dst + b * t.block_values;
    switch (type) {
      case Q8_0: {
        const float d = half_to_float(rd16(p));
        for (int i = 0; i < 32; ++i) y[i] = d * float(int8_t(p[2 + i]));
        break;
      }
      case Q4_0: {
        const float d = half_to_float(rd16(p));
        for (int i = 0; i < 16; ++i) {
          y[i] = d * float(int(p[2 + i] & 0xF) - 8);
          y[i + 16] = d * float(int(p[2 + i] >> 4) - 8);
        }
        break;
      }
      case Q4_1: {
        const float d = half_to_float(rd16(p)), m = half_to_float(rd16(p + 2));
        for (int i = 0; i < 16; ++i) {
          y[i] = d * float(p[4 + i] & 0xF) + m;
          y[i + 16] = d * float(p[4 + i] >> 4) + m;
        }
        break;
      }
      case Q5_0: {
        const float d = half_to_float(rd16(p));
        const uint32_t qh = rd32(p + 2);
        for (int i = 0; i < 16; ++i) {
          const int lo = (p[6 + i] & 0xF) | (((qh >> i) & 1) << 4);
          const int hi = (p[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
          y[i] = d * float(lo - 16);
          y[i + 16] = d * float(hi - 16);
        }
        break;
      }
      case Q4_K:
      case Q5_K: {
        const float d = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
        const uint8_t* sc = p + 4;
        const uint8_t* qh = p + 16;
        const uint8_t* qs = p + (type == Q4_K ? 16 : 48);
        for (int j = 0; j < 8; ++j) {
          int s, m;
          k_scale_min(sc, j, s, m);
          const float dl = d * float(s), ml = dmin * float(m);
          const uint8_t* q = qs + (j / 2) * 32;
          const int shift = (j % 2) * 4;
          for (int l = 0; l < 32; ++l) {
            int v = (q[l] >> shift) & 0xF;
            if (type == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
            y[j * 32 + l] = dl * float(v) - ml;
          }
        }
        break;
      }
      case Q6_K: {
        const uint8_t* ql = p;
        const uint8_t* qh = p + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        const float d = half_to_float(rd16(p + 208));
        for (int e = 0; e < 256; ++e) {
          const int h = e / 128, s = (e % 128) / 32, l = e % 32;
          const int lo = (ql[h * 64 + (s % 2) * 32 + l] >> (4 * (s / 2))) & 0xF;
          const int hi = (qh[h * 32 + l] >> (2 * s)) & 3;
          const float dl = d * float(sc[e / 16]);
          y[e] = dl * float((lo | (hi << 4)) - 32);
        }
        break;
      }
    }
  }
}

// --------------------------------------------------------------------------- activations to int8

// Per activation row and group of 32: the scale, d * sum(xq) (the min term), and -offset * sum(xq) over
// each half of 16 (o[0] covers the whole group when the type has one scale per group).
struct XGroup {
  float d;
  float s;
  int32_t o[2];
  float od;  // d * o[0]: the row kernels' offset term, per unit of weight scale
};

// Per activation row and block of 256 (the K types' row kernels): the block's scale and the sums of its
// int8 values per 16.
struct XBlock {
  float d;
  int16_t bsum[16];    // per 16
  int16_t bsum32[8];   // per 32
};

struct XQuant {
  std::vector<int8_t> q;     // [M, K]
  std::vector<int16_t> q16;  // [M, K]: int16 activations (the 32-value types' row kernels under int8x2)
  std::vector<XGroup> g;     // [M, K / 32]
  std::vector<XBlock> b;     // [M, K / 256] when quantized with span 256
  int64_t k = 0, groups = 0, blocks = 0;
};

// The scale d = max|v| / qmax of n values and id = 1 / d (0 for d = 0). Spans below 1e-28 (where 1 / d
// could overflow) count as zeros; a NaN makes d NaN, so it reaches the outputs as F.linear's would.
inline float span_scale(const float* v, int64_t n, float qmax, float& id) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    amax = std::max(amax, std::fabs(v[i]));
    nan |= v[i] != v[i];
  }
  const float d = amax >= 1e-28f ? amax / qmax : 0.f;
  id = d != 0.f ? 1.f / d : 0.f;
  return nan ? std::numeric_limits<float>::quiet_NaN() : d;
}

// Rows [m0, m1) of x to int8 (into rows m0 + into.. of xq): one scale d = max|x| / 127 per `span` values (32, or 256 for the K types'
// row kernels, whose integer sums run over a whole block), records per group of 32 (d, d * sum, and
// -offset * sum per group or per half) and, with span 256, per block.
void quantize_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, const TypeInfo& t, int offset,
                   int span, XQuant& xq, int64_t into) {
  const int64_t groups = k / 32;
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    int8_t* q = xq.q.data() + (m + into) * k;
    XGroup* g = xq.g.data() + (m + into) * groups;
    for (int64_t j0 = 0; j0 < k; j0 += span) {
      const float* v = xr + j0;
      float id;
      const float d = span_scale(v, span, 127.f, id);
      int16_t sum16[16] = {0};
      for (int i = 0; i < span; ++i) {
        const int qi = int(std::nearbyint(std::min(127.f, std::max(-127.f, v[i] * id))));
        q[j0 + i] = int8_t(qi);
        sum16[i / 16] = int16_t(sum16[i / 16] + qi);
      }
      for (int j = 0; j < span / 32; ++j) {
        XGroup& gr = g[j0 / 32 + j];
        const int lo = sum16[2 * j], hi = sum16[2 * j + 1];
        gr.d = d;
        gr.s = d * float(lo + hi);
        gr.o[0] = t.halves == 2 ? -offset * lo : -offset * (lo + hi);
        gr.o[1] = t.halves == 2 ? -offset * hi : 0;
        gr.od = d * float(gr.o[0]);
      }
      if (span == 256) {
        XBlock& b = xq.b[(m + into) * xq.blocks + j0 / 256];
        b.d = d;
        std::memcpy(b.bsum, sum16, sizeof(sum16));
        for (int j = 0; j < 8; ++j) b.bsum32[j] = int16_t(sum16[2 * j] + sum16[2 * j + 1]);
      }
    }
  }
}

// r[m - m0, :] = x[m, :] - d * xq[m, :] for rows [m0, m1): what the int8 rounding of each activation lost
// (at most d / 2 in magnitude), rounded to int8 in turn by the int8x2 activations. One scalar loop for
// every ISA path (no contractions: -ffp-contract=off), so the paths see the same residuals.
void residual_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, const XQuant& xq, float* r) {
  const int64_t groups = k / 32;
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    const int8_t* q = xq.q.data() + m * k;
    const XGroup* g = xq.g.data() + m * groups;
    float* rr = r + (m - m0) * k;
    for (int64_t j = 0; j < groups; ++j) {
      const float d = g[j].d;
      for (int i = 0; i < 32; ++i) rr[32 * j + i] = xr[32 * j + i] - d * float(q[32 * j + i]);
    }
  }
}

// Rows [m0, m1) of x to int16 (into xq.q16): one scale d = max|x| / 32767 per group of 32, recorded with
// d * sum(q) (the min term). About as close as int8x2's two int8 terms (an error of at most d / 2, d at
// most 1 / 258 of int8's), in one term: the 32-value types' row kernels take it with PMADDWD.
void quantize_rows16(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, XQuant& xq) {
  const int64_t groups = k / 32;
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    int16_t* q = xq.q16.data() + m * k;
    XGroup* g = xq.g.data() + m * groups;
    for (int64_t j = 0; j < groups; ++j) {
      const float* v = xr + 32 * j;
      float id;
      const float d = span_scale(v, 32, 32767.f, id);
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int qi = int(std::nearbyint(std::min(32767.f, std::max(-32767.f, v[i] * id))));
        q[32 * j + i] = int16_t(qi);
        sum += qi;
      }
      g[j].d = d;
      g[j].s = d * float(sum);
      g[j].o[0] = g[j].o[1] = 0;
      g[j].od = 0.f;
    }
  }
}

// Asks for [p, p + len): attention reads one KV head's slice of each token row, and the token rows of a
// sequence lie in blocks the block table scatters over the cache, a pattern no prefetcher follows.
inline void prefetch_span(const void* p, int64_t len) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < len; b += 64) __builtin_prefetch(c + b, 0, 3);
}

// The row kernels read their weight rows as one sequential stream; some CPUs' prefetchers follow it too
// slowly to keep memory busy (Intel Xeons read a cold weight at 2-4 GB/s that way, a fifth of their copy
// rate). Each row asks, as it starts, for the row's worth of bytes this far ahead (a hint: never faults).
constexpr int64_t ROW_PREFETCH_BYTES = 2048;
inline void prefetch_row_ahead(const uint8_t* row, int64_t row_bytes) {
  prefetch_span(row + ROW_PREFETCH_BYTES, row_bytes);
}

// Asks for the bytes [off, off + len) of each of `rows` rows ahead of their decode: a panel reads its rows
// as that many separate streams, more than the hardware prefetchers follow.
inline void prefetch_rows(const uint8_t* const* rp, int rows, int64_t off, int64_t len) {
  for (int r = 0; r < rows; ++r)
    for (int64_t b = 0; b < len; b += 64) __builtin_prefetch(rp[r] + off + b, 0, 3);
}

constexpr int PACK_ROWS = 6;  // activation rows per packed tile of the AVX2 float panels (6 x 2 accumulators)
// The fewest activation rows the float panels take under int8x2 (3-7 rows: the int8x2 panels).
constexpr int FLOAT_MIN_M = 8;

// What every kernel reads: the weight, the quantized activations, the output.
struct Problem {
  int type;
  const uint8_t* w;
  int64_t n, k, row_bytes;
  const XQuant* x;
  int64_t m;
  float* out;
  int64_t ldo;
  const float* bias;  // [N] or null
  const float* xf = nullptr;  // the float32 activations [M, ldx] (the portable float panels)
  int64_t ldx = 0;
  const float* xp = nullptr;  // the same packed by tiles of PACK_ROWS rows, [M / PACK_ROWS][K][PACK_ROWS] (AVX2)
};

// --------------------------------------------------------------------------------- portable path

// One row of canonical groups: q as signed values minus the offset (symmetric types) or unsigned
// (asymmetric), a per group (or half), b per group.
void decode_row_canonical(int type, const uint8_t* src, int64_t k, int16_t* q, float* a, float* b) {
  const TypeInfo& t = TYPES[type];
  const int64_t nb = k / t.block_values;
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* p = src + blk * t.block_bytes;
    const int64_t g0 = blk * (t.block_values / 32);
    int16_t* qq = q + blk * t.block_values;
    switch (type) {
      case Q8_0:
        a[g0] = half_to_float(rd16(p));
        for (int i = 0; i < 32; ++i) qq[i] = int8_t(p[2 + i]);
        break;
      case Q4_0:
        a[g0] = half_to_float(rd16(p));
        for (int i = 0; i < 16; ++i) {
          qq[i] = int16_t((p[2 + i] & 0xF) - 8);
          qq[i + 16] = int16_t((p[2 + i] >> 4) - 8);
        }
        break;
      case Q4_1:
        a[g0] = half_to_float(rd16(p));
        b[g0] = half_to_float(rd16(p + 2));
        for (int i = 0; i < 16; ++i) {
          qq[i] = int16_t(p[4 + i] & 0xF);
          qq[i + 16] = int16_t(p[4 + i] >> 4);
        }
        break;
      case Q5_0: {
        a[g0] = half_to_float(rd16(p));
        const uint32_t qh = rd32(p + 2);
        for (int i = 0; i < 16; ++i) {
          qq[i] = int16_t(((p[6 + i] & 0xF) | (((qh >> i) & 1) << 4)) - 16);
          qq[i + 16] = int16_t(((p[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
        }
        break;
      }
      case Q4_K:
      case Q5_K: {
        const float d = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
        const uint8_t* qh = p + 16;
        const uint8_t* qs = p + (type == Q4_K ? 16 : 48);
        for (int j = 0; j < 8; ++j) {
          int s, m;
          k_scale_min(p + 4, j, s, m);
          a[g0 + j] = d * float(s);
          b[g0 + j] = -(dmin * float(m));
          const uint8_t* src_q = qs + (j / 2) * 32;
          for (int l = 0; l < 32; ++l) {
            int v = (src_q[l] >> ((j % 2) * 4)) & 0xF;
            if (type == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
            qq[j * 32 + l] = int16_t(v);
          }
        }
        break;
      }
      case Q6_K: {
        const float d = half_to_float(rd16(p + 208));
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        for (int h16 = 0; h16 < 16; ++h16) a[2 * g0 + h16] = d * float(sc[h16]);
        for (int e = 0; e < 256; ++e) {
          const int h = e / 128, s = (e % 128) / 32, l = e % 32;
          const int lo = (p[h * 64 + (s % 2) * 32 + l] >> (4 * (s / 2))) & 0xF;
          const int hi = (p[128 + h * 32 + l] >> (2 * s)) & 3;
          qq[e] = int16_t((lo | (hi << 4)) - 32);
        }
        break;
      }
    }
  }
}

// The int16 row kernels' portable form: each weight row as canonical groups (q minus the offset, a, b),
// dotted in integers with every activation row's int16 values, then scaled per group.
void run_portable_wide(const Problem& pb, int64_t n0, int64_t n1) {
  const int64_t groups = pb.k / 32;
  std::vector<int16_t> q(pb.k);
  std::vector<float> a(2 * groups), bb(groups);  // a per group (decode_row_canonical's layout for these types)
  for (int64_t n = n0; n < n1; ++n) {
    decode_row_canonical(pb.type, pb.w + n * pb.row_bytes, pb.k, q.data(), a.data(), bb.data());
    for (int64_t m = 0; m < pb.m; ++m) {
      const int16_t* xq = pb.x->q16.data() + m * pb.k;
      const XGroup* xg = pb.x->g.data() + m * groups;
      float acc = 0.f;
      for (int64_t j = 0; j < groups; ++j) {
        int32_t dot = 0;  // at most 32 * 127 * 32767 in magnitude
        for (int i = 0; i < 32; ++i) dot += int32_t(q[32 * j + i]) * xq[32 * j + i];
        acc += float(dot) * (a[j] * xg[j].d);
        if (TYPES[pb.type].asym) acc += bb[j] * xg[j].s;
      }
      pb.out[m * pb.ldo + n] = acc + (pb.bias ? pb.bias[n] : 0.f);
    }
  }
}

void run_portable(const Problem& pb, int64_t n0, int64_t n1) {
  const TypeInfo& t = TYPES[pb.type];
  const int64_t groups = pb.k / 32;
  std::vector<int16_t> q(pb.k);
  std::vector<float> a(groups * 2), b(groups);
  for (int64_t n = n0; n < n1; ++n) {
    decode_row_canonical(pb.type, pb.w + n * pb.row_bytes, pb.k, q.data(), a.data(), b.data());
    for (int64_t m = 0; m < pb.m; ++m) {
      const int8_t* xq = pb.x->q.data() + m * pb.k;
      const XGroup* xg = pb.x->g.data() + m * groups;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int16_t* qg = q.data() + g * 32;
        const int8_t* xg8 = xq + g * 32;
        if (t.halves == 2) {
          for (int h = 0; h < 2; ++h) {
            int32_t s = 0;
            for (int i = 0; i < 16; ++i) s += int32_t(qg[h * 16 + i]) * xg8[h * 16 + i];
            acc += float(s) * (a[2 * g + h] * xg[g].d);
          }
        } else {
          int32_t s = 0;
          for (int i = 0; i < 32; ++i) s += int32_t(qg[i]) * xg8[i];
          acc += float(s) * (a[g] * xg[g].d);
          if (t.asym) acc += b[g] * xg[g].s;
        }
      }
      pb.out[m * pb.ldo + n] = acc + (pb.bias ? pb.bias[n] : 0.f);
    }
  }
}

// The float panels' portable form: each weight row as dequantize()'s float32 values (dequant_row), dotted
// with every float32 activation row.
void run_portable_float(const Problem& pb, int64_t n0, int64_t n1) {
  std::vector<float> w(pb.k);
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row(pb.type, pb.w + n * pb.row_bytes, w.data(), pb.k);
    for (int64_t m = 0; m < pb.m; ++m) {
      const float* x = pb.xf + m * pb.ldx;
      float acc = 0.f;
      for (int64_t e = 0; e < pb.k; ++e) acc += x[e] * w[e];
      pb.out[m * pb.ldo + n] = acc + (pb.bias ? pb.bias[n] : 0.f);
    }
  }
}

#if PDQ_X86

// ------------------------------------------------------------------------------------ AVX-512 VNNI

#define PDQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,f16c")))
#define PDQ_AVX2 __attribute__((target("avx2,fma,f16c")))

// A decoded chunk of one panel: groups g (local) x 8 lane vectors of four quants, a per group (per half),
// b per group. L lanes (rows) per vector.
template <int L>
struct Chunk {
  alignas(64) uint32_t q[KC][8][L];
  alignas(64) float a[KC * 2][L];
  alignas(64) float b[KC][L];
};

// A thread's decode buffer and accumulators (thread_local: OpenMP's threads live across calls).
template <int L>
struct Scratch {
  Chunk<L> chunk;
  alignas(64) float acc[MB * L];
};

// 16 rows x 16 bytes at `off` -> out[j] lane r = bytes off+4j..off+4j+3 of row r.
PDQ_AVX512 inline void load16x16(const uint8_t* const* rp, int64_t off, __m512i out[4]) {
  __m512i a[4];
  for (int i = 0; i < 4; ++i) {  // a[i]: 128-bit lane l holds row 4l + i
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[i] + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[4 + i] + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[8 + i] + off)), 2);
    a[i] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[12 + i] + off)), 3);
  }
  const __m512i u0 = _mm512_unpacklo_epi32(a[0], a[1]), u1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i u2 = _mm512_unpacklo_epi32(a[2], a[3]), u3 = _mm512_unpackhi_epi32(a[2], a[3]);
  out[0] = _mm512_unpacklo_epi64(u0, u2);
  out[1] = _mm512_unpackhi_epi64(u0, u2);
  out[2] = _mm512_unpacklo_epi64(u1, u3);
  out[3] = _mm512_unpackhi_epi64(u1, u3);
}

// The fp16 at `off` of each of 16 rows, widened.
PDQ_AVX512 inline __m512 load16_half(const uint8_t* const* rp, int64_t off) {
  alignas(32) uint16_t h[16];
  for (int r = 0; r < 16; ++r) h[r] = rd16(rp[r] + off);
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
}

PDQ_AVX512 inline void put(Chunk<16>& c, int g, int j, __m512i v) {
  _mm512_store_si512(reinterpret_cast<__m512i*>(c.q[g][j]), v);
}

// Decodes groups [g0, g0 + gn) of the 16 rows `rp` into `c` (g0, gn multiples of 8 for the K types).
PDQ_AVX512 void decode_avx512(int type, const uint8_t* const* rp, int64_t g0, int gn, Chunk<16>& c) {
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  const TypeInfo& t = TYPES[type];
  if (t.block_values == 32) {
    for (int g = 0; g < gn; ++g) {
      const int64_t off = (g0 + g) * t.block_bytes;
      __m512i v[4];
      switch (type) {
        case Q8_0: {
          const __m512i flip = _mm512_set1_epi8(char(0x80));
          load16x16(rp, off + 2, v);
          for (int j = 0; j < 4; ++j) put(c, g, j, _mm512_xor_si512(v[j], flip));
          load16x16(rp, off + 18, v);
          for (int j = 0; j < 4; ++j) put(c, g, 4 + j, _mm512_xor_si512(v[j], flip));
          _mm512_store_ps(c.a[g], load16_half(rp, off));
          break;
        }
        case Q4_0:
        case Q4_1: {
          const int qs = type == Q4_0 ? 2 : 4;
          load16x16(rp, off + qs, v);
          for (int j = 0; j < 4; ++j) {
            put(c, g, j, _mm512_and_si512(v[j], lo4));
            put(c, g, 4 + j, _mm512_and_si512(_mm512_srli_epi16(v[j], 4), lo4));
          }
          _mm512_store_ps(c.a[g], load16_half(rp, off));
          if (type == Q4_1) _mm512_store_ps(c.b[g], load16_half(rp, off + 2));
          break;
        }
        case Q5_0: {
          load16x16(rp, off + 6, v);
          alignas(64) uint32_t h[16];
          for (int r = 0; r < 16; ++r) h[r] = rd32(rp[r] + off + 2);
          const __m512i qh = _mm512_load_si512(h);
          // Quant 4j + i of the group (i = byte in lane) takes bit 4j + i of qh as its bit 4: spread the
          // four bits to the four bytes (bit i to byte i) by a shift per byte and a mask.
          for (int j = 0; j < 8; ++j) {
            const __m512i bits = _mm512_srli_epi32(qh, 4 * j);  // bits 4j.. at 0..
            const __m512i spread = _mm512_or_si512(
                _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(bits, 4), _mm512_set1_epi32(0x10)),
                                _mm512_and_si512(_mm512_slli_epi32(bits, 11), _mm512_set1_epi32(0x1000))),
                _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(bits, 18), _mm512_set1_epi32(0x100000)),
                                _mm512_and_si512(_mm512_slli_epi32(bits, 25), _mm512_set1_epi32(0x10000000))));
            const __m512i nib = j < 4 ? _mm512_and_si512(v[j], lo4)
                                      : _mm512_and_si512(_mm512_srli_epi16(v[j - 4], 4), lo4);
            put(c, g, j, _mm512_or_si512(nib, spread));
          }
          _mm512_store_ps(c.a[g], load16_half(rp, off));
          break;
        }
      }
    }
    return;
  }
  // K types: 8 groups per block.
  for (int gb = 0; gb < gn; gb += 8) {
    const int64_t off = ((g0 + gb) / 8) * t.block_bytes;
    if (type == Q6_K) {
      __m512i s[4];
      load16x16(rp, off + 192, s);
      const __m512 d = load16_half(rp, off + 208);
      for (int t16 = 0; t16 < 16; ++t16) {  // scale of 16-value group t16: int8 byte t16 % 4 of s[t16 / 4]
        const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(s[t16 / 4], 24 - 8 * (t16 % 4)), 24);
        _mm512_store_ps(c.a[2 * gb + t16], _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
      }
      const __m512i m30 = _mm512_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        __m512i ql[16], qh[8];
        for (int i = 0; i < 4; ++i) load16x16(rp, off + h * 64 + 16 * i, ql + 4 * i);
        load16x16(rp, off + 128 + h * 32, qh);
        load16x16(rp, off + 128 + h * 32 + 16, qh + 4);
        for (int s4 = 0; s4 < 4; ++s4) {
          const int g = gb + h * 4 + s4;
          for (int j = 0; j < 8; ++j) {
            const __m512i low = _mm512_and_si512(
                s4 >= 2 ? _mm512_srli_epi16(ql[(s4 % 2) * 8 + j], 4) : ql[(s4 % 2) * 8 + j], lo4);
            __m512i high;
            switch (s4) {
              case 0: high = _mm512_slli_epi16(qh[j], 4); break;
              case 1: high = _mm512_slli_epi16(qh[j], 2); break;
              case 2: high = qh[j]; break;
              default: high = _mm512_srli_epi16(qh[j], 2); break;
            }
            put(c, g, j, _mm512_or_si512(low, _mm512_and_si512(high, m30)));
          }
        }
      }
      continue;
    }
    // Q4_K, Q5_K: scales and mins of 6 bits packed in bytes 4..15.
    __m512i s[4];
    load16x16(rp, off, s);  // s[0]: d | dmin, s[1]: bytes 4-7, s[2]: 8-11, s[3]: 12-15
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(s[0]));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(s[0], 16)));
    const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15), m2 = _mm512_set1_epi32(3);
    for (int j = 0; j < 8; ++j) {
      __m512i sc, mn;
      if (j < 4) {
        sc = _mm512_and_si512(_mm512_srli_epi32(s[1], 8 * j), m6);
        mn = _mm512_and_si512(_mm512_srli_epi32(s[2], 8 * j), m6);
      } else {
        const int i = j - 4;
        sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s[3], 8 * i), m4),
                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s[1], 8 * i + 6), m2), 4));
        mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s[3], 8 * i + 4), m4),
                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s[2], 8 * i + 6), m2), 4));
      }
      _mm512_store_ps(c.a[gb + j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
      _mm512_store_ps(c.b[gb + j], _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn))));
    }
    __m512i qh[8];
    if (type == Q5_K) {
      load16x16(rp, off + 16, qh);
      load16x16(rp, off + 32, qh + 4);
    }
    const int64_t qs = off + (type == Q4_K ? 16 : 48);
    const __m512i b4 = _mm512_set1_epi8(0x10);
    for (int ch = 0; ch < 4; ++ch) {  // groups 2ch (low nibbles) and 2ch + 1 (high) share 32 bytes
      __m512i v[8];
      load16x16(rp, qs + 32 * ch, v);
      load16x16(rp, qs + 32 * ch + 16, v + 4);
      for (int j = 0; j < 8; ++j) {
        __m512i lo = _mm512_and_si512(v[j], lo4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v[j], 4), lo4);
        if (type == Q5_K) {  // bit 2ch (2ch + 1) of qh[l] is bit 4 of quant l of group 2ch (2ch + 1)
          const int e = 2 * ch;
          const __m512i h0 = e <= 4 ? _mm512_slli_epi16(qh[j], 4 - e) : _mm512_srli_epi16(qh[j], e - 4);
          const __m512i h1 = e + 1 <= 4 ? _mm512_slli_epi16(qh[j], 3 - e) : _mm512_srli_epi16(qh[j], e - 3);
          lo = _mm512_or_si512(lo, _mm512_and_si512(h0, b4));
          hi = _mm512_or_si512(hi, _mm512_and_si512(h1, b4));
        }
        put(c, gb + 2 * ch, j, lo);
        put(c, gb + 2 * ch + 1, j, hi);
      }
    }
  }
}

// acc[m] (16 rows' outputs of activation row m) += the chunk's groups [0, gn) against rows m0..m0+MT.
template <int MT, bool ASYM, int H>
PDQ_AVX512 void dot_avx512(const Chunk<16>& c, int gn, const XQuant& x, int64_t m0, int64_t g0, float* acc) {
  __m512 A[MT];
  for (int i = 0; i < MT; ++i) A[i] = _mm512_load_ps(acc + 16 * i);
  const int64_t k = x.k, groups = x.groups;
  for (int g = 0; g < gn; ++g) {
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_load_si512(c.q[g][j]);
    const int64_t gg = g0 + g;
    for (int i = 0; i < MT; ++i) {
      const int8_t* xq = x.q.data() + (m0 + i) * k + gg * 32;
      const XGroup& xg = x.g[(m0 + i) * groups + gg];
      const __m512 d = _mm512_set1_ps(xg.d);
      for (int h = 0; h < H; ++h) {
        __m512i s = ASYM ? _mm512_setzero_si512() : _mm512_set1_epi32(xg.o[h]);
        for (int j = h * (8 / H); j < (h + 1) * (8 / H); ++j) {
          int32_t xv;
          std::memcpy(&xv, xq + 4 * j, 4);
          s = _mm512_dpbusd_epi32(s, w[j], _mm512_set1_epi32(xv));
        }
        const __m512 a = _mm512_load_ps(c.a[H == 2 ? 2 * g + h : g]);
        A[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(a, d), A[i]);
      }
      if (ASYM) A[i] = _mm512_fmadd_ps(_mm512_load_ps(c.b[g]), _mm512_set1_ps(xg.s), A[i]);
    }
  }
  for (int i = 0; i < MT; ++i) _mm512_store_ps(acc + 16 * i, A[i]);
}

template <bool ASYM, int H>
PDQ_AVX512 void dot_rows_avx512(const Chunk<16>& c, int gn, const XQuant& x, int64_t m0, int64_t m1, int64_t g0,
                                float* acc) {
  constexpr int T = 8;
  int64_t m = m0;
  for (; m + T <= m1; m += T) dot_avx512<T, ASYM, H>(c, gn, x, m, g0, acc + 16 * (m - m0));
  float* a = acc + 16 * (m - m0);
  switch (m1 - m) {
    case 7: dot_avx512<7, ASYM, H>(c, gn, x, m, g0, a); break;
    case 6: dot_avx512<6, ASYM, H>(c, gn, x, m, g0, a); break;
    case 5: dot_avx512<5, ASYM, H>(c, gn, x, m, g0, a); break;
    case 4: dot_avx512<4, ASYM, H>(c, gn, x, m, g0, a); break;
    case 3: dot_avx512<3, ASYM, H>(c, gn, x, m, g0, a); break;
    case 2: dot_avx512<2, ASYM, H>(c, gn, x, m, g0, a); break;
    case 1: dot_avx512<1, ASYM, H>(c, gn, x, m, g0, a); break;
    default: break;
  }
}

PDQ_AVX512 void run_avx512(const Problem& pb, int64_t p0, int64_t p1) {
  const TypeInfo& t = TYPES[pb.type];
  const int64_t groups = pb.k / 32;
  static thread_local Scratch<16> scratch;
  Chunk<16>* c = &scratch.chunk;
  float* acc = scratch.acc;
  const uint8_t* rp[16];
  const int64_t rb = rows_per_block(pb.k);
  for (int64_t mb = 0; mb < pb.m; mb += rb) {
    const int64_t me = std::min(pb.m, mb + rb);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * 16;
      for (int r = 0; r < 16; ++r) rp[r] = pb.w + std::min(n0 + r, pb.n - 1) * pb.row_bytes;
      std::memset(acc, 0, sizeof(float) * 16 * (me - mb));
      const int64_t chunk_bytes = int64_t(KC) * 32 / t.block_values * t.block_bytes;
      for (int64_t g0 = 0; g0 < groups; g0 += KC) {
        const int gn = int(std::min<int64_t>(KC, groups - g0));
        if (g0 + KC < groups) prefetch_rows(rp, 16, (g0 + KC) * 32 / t.block_values * t.block_bytes, chunk_bytes);
        decode_avx512(pb.type, rp, g0, gn, *c);
        if (t.halves == 2) dot_rows_avx512<false, 2>(*c, gn, *pb.x, mb, me, g0, acc);
        else if (t.asym) dot_rows_avx512<true, 1>(*c, gn, *pb.x, mb, me, g0, acc);
        else dot_rows_avx512<false, 1>(*c, gn, *pb.x, mb, me, g0, acc);
      }
      const int64_t nv = std::min<int64_t>(16, pb.n - n0);
      const __mmask16 mask = __mmask16((1u << nv) - 1);
      const __m512 bias = pb.bias ? _mm512_maskz_loadu_ps(mask, pb.bias + n0) : _mm512_setzero_ps();
      for (int64_t m = mb; m < me; ++m)
        _mm512_mask_storeu_ps(pb.out + m * pb.ldo + n0, mask, _mm512_add_ps(_mm512_load_ps(acc + 16 * (m - mb)), bias));
    }
  }
}

// ---------------------------------------------------------------------------------------------- AVX2

// 8 rows x 16 bytes at `off` -> out[j] lane r = bytes off+4j..off+4j+3 of row r.
PDQ_AVX2 inline void load8x16(const uint8_t* const* rp, int64_t off, __m256i out[4]) {
  __m256i a[4];
  for (int i = 0; i < 4; ++i)  // a[i]: 128-bit lane l holds row 4l + i
    a[i] = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[i] + off))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[4 + i] + off)), 1);
  const __m256i u0 = _mm256_unpacklo_epi32(a[0], a[1]), u1 = _mm256_unpackhi_epi32(a[0], a[1]);
  const __m256i u2 = _mm256_unpacklo_epi32(a[2], a[3]), u3 = _mm256_unpackhi_epi32(a[2], a[3]);
  out[0] = _mm256_unpacklo_epi64(u0, u2);
  out[1] = _mm256_unpackhi_epi64(u0, u2);
  out[2] = _mm256_unpacklo_epi64(u1, u3);
  out[3] = _mm256_unpackhi_epi64(u1, u3);
}

PDQ_AVX2 inline __m256 load8_half(const uint8_t* const* rp, int64_t off) {
  alignas(16) uint16_t h[8];
  for (int r = 0; r < 8; ++r) h[r] = rd16(rp[r] + off);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

PDQ_AVX2 inline void put(Chunk<8>& c, int g, int j, __m256i v) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(c.q[g][j]), v);
}

// As decode_avx512 for 8 rows; Q8_0 keeps its signed quants (the dot takes their signs).
PDQ_AVX2 void decode_avx2(int type, const uint8_t* const* rp, int64_t g0, int gn, Chunk<8>& c) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  const TypeInfo& t = TYPES[type];
  if (t.block_values == 32) {
    for (int g = 0; g < gn; ++g) {
      const int64_t off = (g0 + g) * t.block_bytes;
      __m256i v[4];
      switch (type) {
        case Q8_0:
          load8x16(rp, off + 2, v);
          for (int j = 0; j < 4; ++j) put(c, g, j, v[j]);
          load8x16(rp, off + 18, v);
          for (int j = 0; j < 4; ++j) put(c, g, 4 + j, v[j]);
          _mm256_store_ps(c.a[g], load8_half(rp, off));
          break;
        case Q4_0:
        case Q4_1: {
          load8x16(rp, off + (type == Q4_0 ? 2 : 4), v);
          for (int j = 0; j < 4; ++j) {
            put(c, g, j, _mm256_and_si256(v[j], lo4));
            put(c, g, 4 + j, _mm256_and_si256(_mm256_srli_epi16(v[j], 4), lo4));
          }
          _mm256_store_ps(c.a[g], load8_half(rp, off));
          if (type == Q4_1) _mm256_store_ps(c.b[g], load8_half(rp, off + 2));
          break;
        }
        case Q5_0: {
          load8x16(rp, off + 6, v);
          alignas(32) uint32_t h[8];
          for (int r = 0; r < 8; ++r) h[r] = rd32(rp[r] + off + 2);
          const __m256i qh = _mm256_load_si256(reinterpret_cast<const __m256i*>(h));
          for (int j = 0; j < 8; ++j) {
            const __m256i bits = _mm256_srli_epi32(qh, 4 * j);
            const __m256i spread = _mm256_or_si256(
                _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(bits, 4), _mm256_set1_epi32(0x10)),
                                _mm256_and_si256(_mm256_slli_epi32(bits, 11), _mm256_set1_epi32(0x1000))),
                _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(bits, 18), _mm256_set1_epi32(0x100000)),
                                _mm256_and_si256(_mm256_slli_epi32(bits, 25), _mm256_set1_epi32(0x10000000))));
            const __m256i nib = j < 4 ? _mm256_and_si256(v[j], lo4)
                                      : _mm256_and_si256(_mm256_srli_epi16(v[j - 4], 4), lo4);
            put(c, g, j, _mm256_or_si256(nib, spread));
          }
          _mm256_store_ps(c.a[g], load8_half(rp, off));
          break;
        }
      }
    }
    return;
  }
  for (int gb = 0; gb < gn; gb += 8) {
    const int64_t off = ((g0 + gb) / 8) * t.block_bytes;
    if (type == Q6_K) {
      __m256i s[4];
      load8x16(rp, off + 192, s);
      const __m256 d = load8_half(rp, off + 208);
      for (int t16 = 0; t16 < 16; ++t16) {
        const __m256i sc = _mm256_srai_epi32(_mm256_slli_epi32(s[t16 / 4], 24 - 8 * (t16 % 4)), 24);
        _mm256_store_ps(c.a[2 * gb + t16], _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
      }
      const __m256i m30 = _mm256_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        __m256i ql[16], qh[8];
        for (int i = 0; i < 4; ++i) load8x16(rp, off + h * 64 + 16 * i, ql + 4 * i);
        load8x16(rp, off + 128 + h * 32, qh);
        load8x16(rp, off + 128 + h * 32 + 16, qh + 4);
        for (int s4 = 0; s4 < 4; ++s4) {
          const int g = gb + h * 4 + s4;
          for (int j = 0; j < 8; ++j) {
            const __m256i low = _mm256_and_si256(
                s4 >= 2 ? _mm256_srli_epi16(ql[(s4 % 2) * 8 + j], 4) : ql[(s4 % 2) * 8 + j], lo4);
            __m256i high;
            switch (s4) {
              case 0: high = _mm256_slli_epi16(qh[j], 4); break;
              case 1: high = _mm256_slli_epi16(qh[j], 2); break;
              case 2: high = qh[j]; break;
              default: high = _mm256_srli_epi16(qh[j], 2); break;
            }
            put(c, g, j, _mm256_or_si256(low, _mm256_and_si256(high, m30)));
          }
        }
      }
      continue;
    }
    __m256i s[4];
    load8x16(rp, off, s);
    const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permutevar8x32_epi32(
        _mm256_shuffle_epi8(s[0], _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4,
                                                   5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1)),
        _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7))));
    const __m256 dmin = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permutevar8x32_epi32(
        _mm256_shuffle_epi8(s[0], _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3,
                                                   6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)),
        _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7))));
    const __m256i m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(15), m2 = _mm256_set1_epi32(3);
    for (int j = 0; j < 8; ++j) {
      __m256i sc, mn;
      if (j < 4) {
        sc = _mm256_and_si256(_mm256_srli_epi32(s[1], 8 * j), m6);
        mn = _mm256_and_si256(_mm256_srli_epi32(s[2], 8 * j), m6);
      } else {
        const int i = j - 4;
        sc = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(s[3], 8 * i), m4),
                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(s[1], 8 * i + 6), m2), 4));
        mn = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(s[3], 8 * i + 4), m4),
                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(s[2], 8 * i + 6), m2), 4));
      }
      _mm256_store_ps(c.a[gb + j], _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
      _mm256_store_ps(c.b[gb + j], _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn))));
    }
    __m256i qh[8];
    if (type == Q5_K) {
      load8x16(rp, off + 16, qh);
      load8x16(rp, off + 32, qh + 4);
    }
    const int64_t qs = off + (type == Q4_K ? 16 : 48);
    const __m256i b4 = _mm256_set1_epi8(0x10);
    for (int ch = 0; ch < 4; ++ch) {
      __m256i v[8];
      load8x16(rp, qs + 32 * ch, v);
      load8x16(rp, qs + 32 * ch + 16, v + 4);
      for (int j = 0; j < 8; ++j) {
        __m256i lo = _mm256_and_si256(v[j], lo4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v[j], 4), lo4);
        if (type == Q5_K) {
          const int e = 2 * ch;
          const __m256i h0 = e <= 4 ? _mm256_slli_epi16(qh[j], 4 - e) : _mm256_srli_epi16(qh[j], e - 4);
          const __m256i h1 = e + 1 <= 4 ? _mm256_slli_epi16(qh[j], 3 - e) : _mm256_srli_epi16(qh[j], e - 3);
          lo = _mm256_or_si256(lo, _mm256_and_si256(h0, b4));
          hi = _mm256_or_si256(hi, _mm256_and_si256(h1, b4));
        }
        put(c, gb + 2 * ch, j, lo);
        put(c, gb + 2 * ch + 1, j, hi);
      }
    }
  }
}

// PMADDUBSW sums pairs of u8 * s8 into int16 with saturation; S products of a lane's pair sums are added
// in int16 before PMADDWD widens them: S = 8 for 4-bit quants (8 * 2 * 15 * 127 < 2^15), 4 for 5-bit,
// 2 for 6-bit; Q8_0 (SIGN) takes |w| * sign-adjusted x one at a time (2 * 128 * 127 < 2^15).
template <int MT, bool ASYM, int H, int S, bool SIGN>
PDQ_AVX2 void dot_avx2(const Chunk<8>& c, int gn, const XQuant& x, int64_t m0, int64_t g0, float* acc) {
  __m256 A[MT];
  for (int i = 0; i < MT; ++i) A[i] = _mm256_load_ps(acc + 8 * i);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t k = x.k, groups = x.groups;
  for (int g = 0; g < gn; ++g) {
    const int64_t gg = g0 + g;
    const int8_t* xq[MT];
    for (int i = 0; i < MT; ++i) xq[i] = x.q.data() + (m0 + i) * k + gg * 32;
    for (int h = 0; h < H; ++h) {
      __m256i s[MT];
      for (int i = 0; i < MT; ++i)
        s[i] = ASYM ? _mm256_setzero_si256() : _mm256_set1_epi32(x.g[(m0 + i) * groups + gg].o[h]);
      for (int j0 = h * (8 / H); j0 < (h + 1) * (8 / H); j0 += S) {
        __m256i p[MT];
        for (int j = j0; j < j0 + S; ++j) {
          const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(c.q[g][j]));
          const __m256i wa = SIGN ? _mm256_abs_epi8(w) : w;
          for (int i = 0; i < MT; ++i) {
            int32_t xv;
            std::memcpy(&xv, xq[i] + 4 * j, 4);
            __m256i xb = _mm256_set1_epi32(xv);
            if (SIGN) xb = _mm256_sign_epi8(xb, w);
            const __m256i prod = _mm256_maddubs_epi16(wa, xb);
            p[i] = j == j0 ? prod : _mm256_add_epi16(p[i], prod);
            // Keeps the sums a chain per row: re-associated into trees, their temporaries spill.
            __asm__("" : "+x"(p[i]));
          }
        }
        for (int i = 0; i < MT; ++i) s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p[i], ones));
      }
      const __m256 a = _mm256_load_ps(c.a[H == 2 ? 2 * g + h : g]);
      for (int i = 0; i < MT; ++i)
        A[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]),
                               _mm256_mul_ps(a, _mm256_set1_ps(x.g[(m0 + i) * groups + gg].d)), A[i]);
    }
    if (ASYM) {
      const __m256 b = _mm256_load_ps(c.b[g]);
      for (int i = 0; i < MT; ++i) A[i] = _mm256_fmadd_ps(b, _mm256_set1_ps(x.g[(m0 + i) * groups + gg].s), A[i]);
    }
  }
  for (int i = 0; i < MT; ++i) _mm256_store_ps(acc + 8 * i, A[i]);
}

template <bool ASYM, int H, int S, bool SIGN>
PDQ_AVX2 void dot_rows_avx2(const Chunk<8>& c, int gn, const XQuant& x, int64_t m0, int64_t m1, int64_t g0,
                            float* acc) {
  constexpr int T = (S == 8 || SIGN) ? 4 : 3;  // rows per tile that fit the 16 registers with their sums
  int64_t m = m0;
  for (; m + T <= m1; m += T) dot_avx2<T, ASYM, H, S, SIGN>(c, gn, x, m, g0, acc + 8 * (m - m0));
  float* a = acc + 8 * (m - m0);
  switch (m1 - m) {
    case 3: dot_avx2<3, ASYM, H, S, SIGN>(c, gn, x, m, g0, a); break;
    case 2: dot_avx2<2, ASYM, H, S, SIGN>(c, gn, x, m, g0, a); break;
    case 1: dot_avx2<1, ASYM, H, S, SIGN>(c, gn, x, m, g0, a); break;
    default: break;
  }
}

PDQ_AVX2 void run_avx2(const Problem& pb, int64_t p0, int64_t p1) {
  const TypeInfo& t = TYPES[pb.type];
  const int64_t groups = pb.k / 32;
  static thread_local Scratch<8> scratch;
  Chunk<8>* c = &scratch.chunk;
  float* acc = scratch.acc;
  const uint8_t* rp[8];
  const int64_t rb = rows_per_block(pb.k);
  for (int64_t mb = 0; mb < pb.m; mb += rb) {
    const int64_t me = std::min(pb.m, mb + rb);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * 8;
      for (int r = 0; r < 8; ++r) rp[r] = pb.w + std::min(n0 + r, pb.n - 1) * pb.row_bytes;
      std::memset(acc, 0, sizeof(float) * 8 * (me - mb));
      const int64_t chunk_bytes = int64_t(KC) * 32 / t.block_values * t.block_bytes;
      for (int64_t g0 = 0; g0 < groups; g0 += KC) {
        const int gn = int(std::min<int64_t>(KC, groups - g0));
        if (g0 + KC < groups) prefetch_rows(rp, 8, (g0 + KC) * 32 / t.block_values * t.block_bytes, chunk_bytes);
        decode_avx2(pb.type, rp, g0, gn, *c);
        switch (pb.type) {
          case Q8_0: dot_rows_avx2<false, 1, 1, true>(*c, gn, *pb.x, mb, me, g0, acc); break;
          case Q4_0: dot_rows_avx2<false, 1, 8, false>(*c, gn, *pb.x, mb, me, g0, acc); break;
          case Q5_0: dot_rows_avx2<false, 1, 4, false>(*c, gn, *pb.x, mb, me, g0, acc); break;
          case Q4_1:
          case Q4_K: dot_rows_avx2<true, 1, 8, false>(*c, gn, *pb.x, mb, me, g0, acc); break;
          case Q5_K: dot_rows_avx2<true, 1, 4, false>(*c, gn, *pb.x, mb, me, g0, acc); break;
          case Q6_K: dot_rows_avx2<false, 2, 2, false>(*c, gn, *pb.x, mb, me, g0, acc); break;
        }
      }
      const int64_t nv = std::min<int64_t>(8, pb.n - n0);
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(nv)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256 bias = pb.bias ? _mm256_maskload_ps(pb.bias + n0, mask) : _mm256_setzero_ps();
      for (int64_t m = mb; m < me; ++m)
        _mm256_maskstore_ps(pb.out + m * pb.ldo + n0, mask, _mm256_add_ps(_mm256_load_ps(acc + 8 * (m - mb)), bias));
    }
  }
}


// The float panels (int8x2 from FLOAT_MIN_M rows): the AVX2 panel decode, each chunk's lanes then turned
// into dequantize()'s float32 values, k by k (two vectors hold one k of the panel's 16 rows), and every
// float32 activation row (packed by tiles of PACK_ROWS, [k][row]) broadcast against them with FMA: no
// activation rounding and no horizontal sums. On AVX2 the two int8 terms cost two PMADDUBSW passes where
// FMA takes the floats at about the same rate, so the float panels are exact and, measured, 5-30% faster
// from 8 rows (bench/quant_kernels.py); the weights are still read and decoded once per block of FLOAT_MB
// activation rows.
constexpr int FKC = 8;        // groups per float tile: 256 values, whole K-type blocks, 8 KiB of floats
constexpr int FLOAT_MB = 10 * PACK_ROWS;  // activation rows per block (whole packed tiles; outputs in the accumulators)
static_assert(FLOAT_MB % PACK_ROWS == 0, "a block of activation rows is whole packed tiles");

constexpr int FLOAT_ROWS = 16;  // weight rows per float panel: two vectors, two AVX2 panel decodes

struct FloatTile {
  alignas(64) float w[FKC * 32][FLOAT_ROWS];  // [k][row]
};

// The decoded lanes of groups [0, gn) of `c` as float32 weights, as gguf's dequantize computes them.
// Into rows [half * 8, half * 8 + 8) of the tile.
template <int TYPE>
PDQ_AVX2 void float_tile_avx2(const Chunk<8>& c, int gn, FloatTile& t, int half) {
  constexpr TypeInfo ti = TYPES[TYPE];
  const __m256i off = _mm256_set1_epi32(TYPE == Q8_0 ? 0 : ti.offset);  // Q8_0's lanes are signed already
  const __m256i byte = _mm256_set1_epi32(0xFF);
  for (int g = 0; g < gn; ++g) {
    const __m256 b = ti.asym ? _mm256_load_ps(c.b[g]) : _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(c.q[g][j]));
      const __m256 a = _mm256_load_ps(c.a[ti.halves == 2 ? 2 * g + j / 4 : g]);
      __m256i q[4];
      if (TYPE == Q8_0) {
        q[0] = _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24);
        q[1] = _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24);
        q[2] = _mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24);
        q[3] = _mm256_srai_epi32(v, 24);
      } else {
        q[0] = _mm256_sub_epi32(_mm256_and_si256(v, byte), off);
        q[1] = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 8), byte), off);
        q[2] = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 16), byte), off);
        q[3] = _mm256_sub_epi32(_mm256_srli_epi32(v, 24), off);
      }
      for (int i = 0; i < 4; ++i) {
        const __m256 f = _mm256_mul_ps(a, _mm256_cvtepi32_ps(q[i]));
        _mm256_store_ps(t.w[32 * g + 4 * j + i] + 8 * half, ti.asym ? _mm256_add_ps(f, b) : f);
      }
    }
  }
}

PDQ_AVX2 void float_tile_any(int type, const Chunk<8>& c, int gn, FloatTile& t, int half) {
  switch (type) {
    case Q8_0: float_tile_avx2<Q8_0>(c, gn, t, half); break;
    case Q4_0: float_tile_avx2<Q4_0>(c, gn, t, half); break;
    case Q4_1: float_tile_avx2<Q4_1>(c, gn, t, half); break;
    case Q5_0: float_tile_avx2<Q5_0>(c, gn, t, half); break;
    case Q4_K: float_tile_avx2<Q4_K>(c, gn, t, half); break;
    case Q5_K: float_tile_avx2<Q5_K>(c, gn, t, half); break;
    case Q6_K: float_tile_avx2<Q6_K>(c, gn, t, half); break;
  }
}

// A thread's float panel buffers (thread_local: OpenMP's threads live across calls).
struct FloatScratch {
  Chunk<8> chunk;
  FloatTile tile;
  alignas(64) float acc[FLOAT_MB * FLOAT_ROWS];
};

// acc[i][0:16] += sum over kk < kn of xp[kk][i] * tile[kk] for R <= PACK_ROWS activation rows, xp one
// packed tile of activation rows ([k][PACK_ROWS]: one pointer, the rows at fixed offsets): per k two
// weight vectors and R broadcasts feed 2R multiply-adds.
template <int R>
PDQ_AVX2 void float_rows_avx2(const FloatTile& t, int kn, const float* xp, float* acc) {
  __m256 A[R][2];
  for (int i = 0; i < R; ++i) {
    A[i][0] = _mm256_load_ps(acc + FLOAT_ROWS * i);
    A[i][1] = _mm256_load_ps(acc + FLOAT_ROWS * i + 8);
  }
  for (int kk = 0; kk < kn; ++kk) {
    const __m256 w0 = _mm256_load_ps(t.w[kk]), w1 = _mm256_load_ps(t.w[kk] + 8);
    const float* xr = xp + PACK_ROWS * kk;
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_broadcast_ss(xr + i);
      A[i][0] = _mm256_fmadd_ps(xv, w0, A[i][0]);
      A[i][1] = _mm256_fmadd_ps(xv, w1, A[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_store_ps(acc + FLOAT_ROWS * i, A[i][0]);
    _mm256_store_ps(acc + FLOAT_ROWS * i + 8, A[i][1]);
  }
}

template <int... R>
PDQ_AVX2 void float_rows_any(int rows, const FloatTile& t, int kn, const float* xp, float* acc,
                             std::integer_sequence<int, R...>) {
  ((rows == R + 1 ? float_rows_avx2<R + 1>(t, kn, xp, acc) : void()), ...);
}

PDQ_AVX2 void run_avx2_float(const Problem& pb, int64_t p0, int64_t p1) {
  const TypeInfo& t = TYPES[pb.type];
  const int64_t groups = pb.k / 32;
  static thread_local FloatScratch scratch;
  FloatScratch* sc = &scratch;  // one TLS lookup a call
  Chunk<8>& chunk = sc->chunk;
  FloatTile& tile = sc->tile;
  float* acc = sc->acc;
  const uint8_t* rp[FLOAT_ROWS];
  const int64_t chunk_bytes = int64_t(FKC) * 32 / t.block_values * t.block_bytes;
  for (int64_t mb = 0; mb < pb.m; mb += FLOAT_MB) {
    const int64_t me = std::min(pb.m, mb + FLOAT_MB);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * FLOAT_ROWS;
      for (int r = 0; r < FLOAT_ROWS; ++r) rp[r] = pb.w + std::min(n0 + r, pb.n - 1) * pb.row_bytes;
      const int halves = pb.n - n0 > 8 ? 2 : 1;  // a last panel of at most 8 rows decodes one half
      std::memset(acc, 0, sizeof(float) * FLOAT_ROWS * (me - mb));
      for (int64_t g0 = 0; g0 < groups; g0 += FKC) {
        const int gn = int(std::min<int64_t>(FKC, groups - g0));
        if (g0 + FKC < groups)
          prefetch_rows(rp, 8 * halves, (g0 + FKC) * 32 / t.block_values * t.block_bytes, chunk_bytes);
        for (int h = 0; h < 2; ++h) {
          if (h < halves) {
            decode_avx2(pb.type, rp + 8 * h, g0, gn, chunk);
            float_tile_any(pb.type, chunk, gn, tile, h);
          } else {
            for (int kk = 0; kk < 32 * gn; ++kk) _mm256_store_ps(tile.w[kk] + 8, _mm256_setzero_ps());
          }
        }
        for (int64_t m = mb; m < me; m += PACK_ROWS) {
          const float* xp = pb.xp + (m / PACK_ROWS) * pb.k * PACK_ROWS + g0 * 32 * PACK_ROWS;
          float_rows_any(int(std::min<int64_t>(PACK_ROWS, me - m)), tile, 32 * gn, xp, acc + FLOAT_ROWS * (m - mb),
                         std::make_integer_sequence<int, PACK_ROWS>{});
        }
      }
      for (int h = 0; h < halves; ++h) {
        const int64_t c0 = n0 + 8 * h;
        const int64_t nv = std::min<int64_t>(8, pb.n - c0);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(nv)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 bias = pb.bias ? _mm256_maskload_ps(pb.bias + c0, mask) : _mm256_setzero_ps();
        for (int64_t m = mb; m < me; ++m)
          _mm256_maskstore_ps(pb.out + m * pb.ldo + c0, mask,
                              _mm256_add_ps(_mm256_load_ps(acc + FLOAT_ROWS * (m - mb) + 8 * h), bias));
      }
    }
  }
}

// ------------------------------------------------------------------------ row kernels (few activations)

// At 1-4 activation rows a call is one pass over the weight bytes: each row's blocks are decoded in
// registers in their own order (no transposition) and dotted with every activation row while there.
// The 32-value types scale each group's integer sum in float (8 lanes a group, summed at the row's end);
// the K types apply their 6-/8-bit sub-block scales in the integers (PMADDWD of the int16 pair sums by
// the scale), so floats appear once per block of 256 under the block's one activation scale, and their
// mins and offsets are the sub-block scales against the activations' sums per 16. AVX2 code: on AVX-512
// CPUs too (it is the weight bytes, not the lanes, that bound these calls).

PDQ_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

PDQ_AVX2 inline float f16(const uint8_t* p) { return _cvtsh_ss(rd16(p)); }

// 32 bits -> 32 bytes, byte i 0x10 where bit i is set (Q5_0's fifth bits).
PDQ_AVX2 inline __m256i bits_to_0x10(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i sel = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), _mm256_set1_epi8(0x10));
}

// The 32 quants of a 32-value block in their order, as unsigned bytes (Q8_0: signed, as stored).
template <int TYPE>
PDQ_AVX2 inline __m256i block_quants(const uint8_t* p) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  if (TYPE == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
  const int qs = TYPE == Q4_0 ? 2 : TYPE == Q4_1 ? 4 : 6;
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + qs));
  const __m256i w = _mm256_setr_m128i(_mm_and_si128(q, m4), _mm_and_si128(_mm_srli_epi16(q, 4), m4));
  if (TYPE == Q5_0) return _mm256_or_si256(w, bits_to_0x10(rd32(p + 2)));
  return w;
}

template <int MT, int TYPE>
PDQ_AVX2 void rows32_avx2(const Problem& pb, int64_t n0, int64_t n1) {
  const TypeInfo& t = TYPES[TYPE];
  const int64_t nb = pb.k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xq[MT];
  const XGroup* xg[MT];
  for (int i = 0; i < MT; ++i) {
    xq[i] = pb.x->q.data() + i * pb.k;
    xg[i] = pb.x->g.data() + i * pb.x->groups;
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = pb.w + n * pb.row_bytes;
    prefetch_row_ahead(row, pb.row_bytes);
    __m256 acc[MT];
    float accs[MT];  // the offsets' (mins') part
    for (int i = 0; i < MT; ++i) {
      acc[i] = _mm256_setzero_ps();
      accs[i] = 0.f;
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = row + b * t.block_bytes;
      const __m256i w = block_quants<TYPE>(p);
      const __m256i wa = TYPE == Q8_0 ? _mm256_abs_epi8(w) : w;
      const float d = f16(p);
      const float mn = TYPE == Q4_1 ? f16(p + 2) : 0.f;
      for (int i = 0; i < MT; ++i) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + 32 * b));
        if (TYPE == Q8_0) x = _mm256_sign_epi8(x, w);
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, x), ones);
        const XGroup& g = xg[i][b];
        const float dd = d * g.d;
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dd), acc[i]);
        accs[i] += TYPE == Q4_1 ? mn * g.s : d * g.od;
      }
    }
    const float bias = pb.bias ? pb.bias[n] : 0.f;
    for (int i = 0; i < MT; ++i) pb.out[i * pb.ldo + n] = hsum8(acc[i]) + accs[i] + bias;
  }
}

// Q4_K / Q5_K: the 8 scales and 8 mins of 6 bits from the 12 packed bytes, as bytes [sc0..7 | m0..7].
inline __m128i k_scales_mins(const uint8_t* p) {
  uint32_t a, b, c;
  std::memcpy(&a, p, 4);
  std::memcpy(&b, p + 4, 4);
  std::memcpy(&c, p + 8, 4);
  const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  const uint32_t sc_lo = a & m6, mn_lo = b & m6;
  const uint32_t sc_hi = (c & m4) | (((a >> 6) & m2) << 4), mn_hi = ((c >> 4) & m4) | (((b >> 6) & m2) << 4);
  return _mm_set_epi32(int(mn_hi), int(mn_lo), int(sc_hi), int(sc_lo));
}

template <int MT, int TYPE>
PDQ_AVX2 void rowsk_avx2(const Problem& pb, int64_t n0, int64_t n1) {
  const TypeInfo& t = TYPES[TYPE];
  const int64_t nsb = pb.k / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), b4 = _mm256_set1_epi8(0x10);
  const int8_t* xq[MT];
  const XBlock* xb[MT];
  for (int i = 0; i < MT; ++i) {
    xq[i] = pb.x->q.data() + i * pb.k;
    xb[i] = pb.x->b.data() + i * pb.x->blocks;
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = pb.w + n * pb.row_bytes;
    prefetch_row_ahead(row, pb.row_bytes);
    __m256 acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* p = row + sb * t.block_bytes;
      __m256i sumi[MT], offs[MT];  // the scaled quant sums; the sub-block scales (mins) against activation sums
      if (TYPE == Q6_K) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
        for (int i = 0; i < MT; ++i) {
          sumi[i] = _mm256_setzero_si256();
          offs[i] = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[i][sb].bsum)));
        }
        for (int h = 0; h < 2; ++h) {
          const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h));
          const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32));
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
          const __m256i q[4] = {
              _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)),
              _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                              _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30))};
          // Scales of this half's 8 sub-blocks of 16 (int16 lanes 0-7 of sc16's lane h) in both lanes.
          const __m256i half = h == 0 ? _mm256_permute2x128_si256(sc16, sc16, 0x00)
                                      : _mm256_permute2x128_si256(sc16, sc16, 0x11);
          for (int s4 = 0; s4 < 4; ++s4) {
            const int gi = 4 * h + s4;  // group of 32: sub-blocks 2gi (low lane), 2gi + 1 (high lane)
            const char lo = char(4 * s4), hi = char(4 * s4 + 2);
            const __m256i sv = _mm256_shuffle_epi8(
                half, _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo,
                                       lo + 1, lo, lo + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1,
                                       hi, hi + 1, hi, hi + 1, hi, hi + 1));
            for (int i = 0; i < MT; ++i) {
              const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + 256 * sb + 32 * gi));
              sumi[i] = _mm256_add_epi32(sumi[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q[s4], x), sv));
            }
          }
        }
        const float d = f16(p + 208);
        for (int i = 0; i < MT; ++i) {  // w = d * sc * (q - 32)
          const float dx = d * xb[i][sb].d;
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[i]), _mm256_set1_ps(dx), acc[i]);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offs[i]), _mm256_set1_ps(-32.f * dx), acc[i]);
        }
        continue;
      }
      const __m128i scm = k_scales_mins(p + 4);
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scm));  // 8 scales, both lanes
      const __m128i mn16 = _mm_cvtepu8_epi16(_mm_srli_si128(scm, 8));           // 8 mins
      for (int i = 0; i < MT; ++i) {
        sumi[i] = _mm256_setzero_si256();
        offs[i] = _mm256_castsi128_si256(
            _mm_madd_epi16(mn16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb[i][sb].bsum32))));
      }
      const uint8_t* qs = p + (TYPE == Q4_K ? 16 : 48);
      const __m256i qh = TYPE == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))
                                      : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {  // groups 2c (low nibbles) and 2c + 1 (high) of 32 bytes
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (TYPE == Q5_K) {  // bit j of qh[l]: the fifth bit of quant l of group j
          const int e = 2 * c;
          const __m256i h0 = e <= 4 ? _mm256_slli_epi16(qh, 4 - e) : _mm256_srli_epi16(qh, e - 4);
          const __m256i h1 = e + 1 <= 4 ? _mm256_slli_epi16(qh, 3 - e) : _mm256_srli_epi16(qh, e - 3);
          lo = _mm256_or_si256(lo, _mm256_and_si256(h0, b4));
          hi = _mm256_or_si256(hi, _mm256_and_si256(h1, b4));
        }
        const __m256i s_lo = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(int16_t(0x0100 + 0x0202 * (2 * c))));
        const __m256i s_hi = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(int16_t(0x0100 + 0x0202 * (2 * c + 1))));
        for (int i = 0; i < MT; ++i) {
          const int8_t* x = xq[i] + 256 * sb + 64 * c;
          const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
          const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
          sumi[i] = _mm256_add_epi32(sumi[i], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), s_lo),
                                                               _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), s_hi)));
        }
      }
      const float d = f16(p), dmin = f16(p + 2);
      for (int i = 0; i < MT; ++i) {  // w = d * sc * q - dmin * m
        const float xd = xb[i][sb].d;
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[i]), _mm256_set1_ps(d * xd), acc[i]);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offs[i]), _mm256_set1_ps(-dmin * xd), acc[i]);
      }
    }
    const float bias = pb.bias ? pb.bias[n] : 0.f;
    for (int i = 0; i < MT; ++i) pb.out[i * pb.ldo + n] = hsum8(acc[i]) + bias;
  }
}

template <int MT>
PDQ_AVX2 void rows_avx2(const Problem& pb, int64_t n0, int64_t n1) {
  switch (pb.type) {
    case Q8_0: rows32_avx2<MT, Q8_0>(pb, n0, n1); break;
    case Q4_0: rows32_avx2<MT, Q4_0>(pb, n0, n1); break;
    case Q4_1: rows32_avx2<MT, Q4_1>(pb, n0, n1); break;
    case Q5_0: rows32_avx2<MT, Q5_0>(pb, n0, n1); break;
    case Q4_K: rowsk_avx2<MT, Q4_K>(pb, n0, n1); break;
    case Q5_K: rowsk_avx2<MT, Q5_K>(pb, n0, n1); break;
    case Q6_K: rowsk_avx2<MT, Q6_K>(pb, n0, n1); break;
  }
}

// The int16 row kernels (int8x2 activations at up to ROW_MAX_M rows, the 32-value types): each block's 32
// quants widened to int16 (minus the offset: signed values) and multiplied with the activations' int16
// values by PMADDWD, two of them and one add giving 8 int32 sums, scaled once per block; the min term from
// the activations' sums. Half the vector work of decoding each weight to float32, at the same ~15 bits.
template <int MT, int TYPE>
PDQ_AVX2 void rows32w_avx2(const Problem& pb, int64_t n0, int64_t n1) {
  const TypeInfo& t = TYPES[TYPE];
  const int64_t nb = pb.k / 32;
  const int16_t* xq[MT];
  const XGroup* xg[MT];
  for (int i = 0; i < MT; ++i) {
    xq[i] = pb.x->q16.data() + i * pb.k;
    xg[i] = pb.x->g.data() + i * pb.x->groups;
  }
  const __m256i off = _mm256_set1_epi8(char(TYPE == Q8_0 ? 0 : t.offset));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = pb.w + n * pb.row_bytes;
    prefetch_row_ahead(row, pb.row_bytes);
    __m256 acc[MT];
    float accs[MT];  // Q4_1's mins
    for (int i = 0; i < MT; ++i) {
      acc[i] = _mm256_setzero_ps();
      accs[i] = 0.f;
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = row + b * t.block_bytes;
      __m256i w = block_quants<TYPE>(p);
      if (TYPE == Q4_0 || TYPE == Q5_0) w = _mm256_sub_epi8(w, off);
      const __m128i w0 = _mm256_castsi256_si128(w), w1 = _mm256_extracti128_si256(w, 1);
      const __m256i lo = TYPE == Q4_1 ? _mm256_cvtepu8_epi16(w0) : _mm256_cvtepi8_epi16(w0);
      const __m256i hi = TYPE == Q4_1 ? _mm256_cvtepu8_epi16(w1) : _mm256_cvtepi8_epi16(w1);
      const float d = f16(p);
      const float mn = TYPE == Q4_1 ? f16(p + 2) : 0.f;
      for (int i = 0; i < MT; ++i) {
        const __m256i* x = reinterpret_cast<const __m256i*>(xq[i] + 32 * b);
        const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(x)),
                                           _mm256_madd_epi16(hi, _mm256_loadu_si256(x + 1)));
        const XGroup& g = xg[i][b];
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * g.d), acc[i]);
        if (TYPE == Q4_1) accs[i] += mn * g.s;
      }
    }
    const float bias = pb.bias ? pb.bias[n] : 0.f;
    for (int i = 0; i < MT; ++i) pb.out[i * pb.ldo + n] = hsum8(acc[i]) + accs[i] + bias;
  }
}

template <int MT>
PDQ_AVX2 void rows_wide_avx2(const Problem& pb, int64_t n0, int64_t n1) {
  switch (pb.type) {
    case Q8_0: rows32w_avx2<MT, Q8_0>(pb, n0, n1); break;
    case Q4_0: rows32w_avx2<MT, Q4_0>(pb, n0, n1); break;
    case Q4_1: rows32w_avx2<MT, Q4_1>(pb, n0, n1); break;
    case Q5_0: rows32w_avx2<MT, Q5_0>(pb, n0, n1); break;
    default: throw std::logic_error("the int16 row kernels take the 32-value types");
  }
}

PDQ_AVX2 void run_rows_wide_avx2(const Problem& pb, int64_t n0, int64_t n1) {
  switch (pb.m) {
    case 1: rows_wide_avx2<1>(pb, n0, n1); break;
    case 2: rows_wide_avx2<2>(pb, n0, n1); break;
    case 3: rows_wide_avx2<3>(pb, n0, n1); break;
    case 4: rows_wide_avx2<4>(pb, n0, n1); break;
    case 5: rows_wide_avx2<5>(pb, n0, n1); break;
    case 6: rows_wide_avx2<6>(pb, n0, n1); break;
    case 7: rows_wide_avx2<7>(pb, n0, n1); break;
    default: rows_wide_avx2<8>(pb, n0, n1); break;
  }
}

// The scale d = max|v| / qmax of n values (a multiple of 8) and id = 1 / d, as the portable quantizers
// take them: spans below 1e-28 (where 1 / d could overflow) count as zeros, a NaN makes d NaN.
PDQ_AVX2 inline float span_scale_avx2(const float* v, int64_t n, float qmax, float& id) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 a = _mm256_loadu_ps(v + i);
    vmax = _mm256_max_ps(_mm256_and_ps(a, absmask), vmax);  // a NaN lane keeps vmax, as std::max does
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  float d = amax >= 1e-28f ? amax / qmax : 0.f;
  id = d != 0.f ? 1.f / d : 0.f;
  if (_mm256_movemask_ps(vnan)) d = std::numeric_limits<float>::quiet_NaN();
  return d;
}

// quantize_rows16 with AVX2: the same roundings (nearest even), so every path sees the same int16 values.
PDQ_AVX2 void quantize_rows16_avx2(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, XQuant& xq) {
  const int64_t groups = k / 32;
  const __m256 lim = _mm256_set1_ps(32767.f), nlim = _mm256_set1_ps(-32767.f);
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    int16_t* q = xq.q16.data() + m * k;
    XGroup* g = xq.g.data() + m * groups;
    for (int64_t j = 0; j < groups; ++j) {
      const float* v = xr + 32 * j;
      float id;
      const float d = span_scale_avx2(v, 32, 32767.f, id);
      const __m256 vid = _mm256_set1_ps(id);
      __m256i iv[4], sum = _mm256_setzero_si256();
      for (int u = 0; u < 4; ++u) {
        const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(v + 8 * u), vid);
        iv[u] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_min_ps(lim, _mm256_max_ps(nlim, sc)),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        sum = _mm256_add_epi32(sum, iv[u]);
      }
      // packs works per 128-bit lane: [0..3 of iv0, 0..3 of iv1 | 4..7 of iv0, 4..7 of iv1] -> reorder quads
      for (int u = 0; u < 2; ++u) {
        const __m256i pk = _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[2 * u], iv[2 * u + 1]), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * j + 16 * u), pk);
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
      g[j].d = d;
      g[j].s = d * float(_mm_cvtsi128_si32(s4));
      g[j].o[0] = g[j].o[1] = 0;
      g[j].od = 0.f;
    }
  }
}

PDQ_AVX2 void run_rows_avx2(const Problem& pb, int64_t n0, int64_t n1) {
  switch (pb.m) {
    case 1: rows_avx2<1>(pb, n0, n1); break;
    case 2: rows_avx2<2>(pb, n0, n1); break;
    case 3: rows_avx2<3>(pb, n0, n1); break;
    case 4: rows_avx2<4>(pb, n0, n1); break;
    case 6: rows_avx2<6>(pb, n0, n1); break;  // int8x2 at 3 and 4 activation rows
    default: rows_avx2<8>(pb, n0, n1); break;
  }
}


// quantize_rows with AVX2: the same roundings in the same order, so every path sees the same int8
// activations (the ISA paths' integer sums agree exactly).
PDQ_AVX2 void quantize_rows_avx2(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, const TypeInfo& t,
                                 int offset, int span, XQuant& xq, int64_t into) {
  const int64_t groups = k / 32;
  const __m256 lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * ldx;
    int8_t* q = xq.q.data() + (m + into) * k;
    XGroup* g = xq.g.data() + (m + into) * groups;
    for (int64_t j0 = 0; j0 < k; j0 += span) {
      const float* v = xr + j0;
      float id;
      const float d = span_scale_avx2(v, span, 127.f, id);
      const __m256 vid = _mm256_set1_ps(id);
      int16_t sum16[16];
      for (int i = 0; i < span; i += 32) {
        __m256i iv[4];
        for (int u = 0; u < 4; ++u) {
          const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * u), vid);
          iv[u] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_min_ps(lim, _mm256_max_ps(nlim, s)),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j0 + i), _mm256_permutevar8x32_epi32(p, order));
        for (int u = 0; u < 2; ++u) {
          const __m256i s8 = _mm256_add_epi32(iv[2 * u], iv[2 * u + 1]);
          __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
          s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
          s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
          sum16[i / 16 + u] = int16_t(_mm_cvtsi128_si32(s4));
        }
      }
      for (int j = 0; j < span / 32; ++j) {
        XGroup& gr = g[j0 / 32 + j];
        const int lo = sum16[2 * j], hi = sum16[2 * j + 1];
        gr.d = d;
        gr.s = d * float(lo + hi);
        gr.o[0] = t.halves == 2 ? -offset * lo : -offset * (lo + hi);
        gr.o[1] = t.halves == 2 ? -offset * hi : 0;
        gr.od = d * float(gr.o[0]);
      }
      if (span == 256) {
        XBlock& b = xq.b[(m + into) * xq.blocks + j0 / 256];
        b.d = d;
        std::memcpy(b.bsum, sum16, sizeof(sum16));
        for (int j = 0; j < 8; ++j) b.bsum32[j] = int16_t(sum16[2 * j] + sum16[2 * j + 1]);
      }
    }
  }
}

#endif  // PDQ_X86

// -------------------------------------------------------------------------------------- entry points

bool isa_supported(int isa) {
#if PDQ_X86
  __builtin_cpu_init();
  switch (isa) {
    case PORTABLE: return true;
    case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case AVX512_VNNI:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
    default: return false;
  }
#else
  return isa == PORTABLE;
#endif
}

void check_type(int type) {
  if (type < 0 || type >= NUM_TYPES) throw std::invalid_argument("unknown quant type index " + std::to_string(type));
}

// One matmul out[m, :n] = x[m, :k] @ w^T (+ bias), split into the phases a caller runs in order, each over
// a share of its range on any number of threads: `quantize_part` rounds activation rows (nothing to do
// for the float row kernels), `run_part` takes units of weight rows (panels, or rows for the row
// kernels), `combine_part` sums the int8x2 outputs' two halves. `matmul` runs them on OpenMP's threads;
// the fused decode step (decode_layers) inside its own parallel region.
struct MatmulScratch {
  XQuant xq;
  std::vector<float> res, two;  // int8x2: the residuals [M, K]; the 2M outputs [2M, N]
  std::vector<float> packed;    // the AVX2 float panels' packed activations
};

struct MatmulJob {
  int isa = 0;
  const TypeInfo* t = nullptr;
  const float* x = nullptr;
  int64_t m = 0, ldx = 0, n = 0, k = 0;
  float* out = nullptr;
  int64_t ldo = 0;
  const float* bias = nullptr;
  bool by_rows = false, wide_rows = false, float_panels = false, split = false;
  int span = 32, offset = 0;
  MatmulScratch* s = nullptr;
  Problem pb{};
  int64_t units = 0;  // weight panels (or rows) run_part splits
  int64_t work = 0;   // in (rows x groups) units: how many threads it pays to wake
};

// Checks the arguments and sizes the scratch; does no arithmetic. Up to row_max_m activation rows (at most
// ROW_MAX_M) take the row kernels, more the panels.
MatmulJob plan_matmul(int isa, int type, const float* x, int64_t m, int64_t ldx, const uint8_t* w, int64_t n,
                      int64_t k, const float* bias, float* out, int64_t ldo, int row_max_m, int activations,
                      MatmulScratch& s, int wide_row_max_m) {
  check_type(type);
  const TypeInfo& t = TYPES[type];
  if (k % t.block_values) throw std::invalid_argument("k is not a whole number of blocks");
  MatmulJob j;
  j.isa = isa, j.t = &t, j.x = x, j.m = m, j.ldx = ldx, j.n = n, j.k = k, j.out = out, j.ldo = ldo, j.bias = bias;
  j.s = &s;
  // int8x2: each activation row is also rounded a second time, its residual, as activation row m + M;
  // the kernels see 2M rows and the two outputs of each row are summed.
  // int8x2 at few rows of a 32-value type: the int16 row kernels (one int16 term of the same precision),
  // up to wide_row_max_m rows; the other row kernels up to row_max_m.
  const bool wide_type = activations == INT8X2 && t.block_values == 32;
  j.by_rows = wide_type ? m <= std::min(wide_row_max_m, WIDE_ROW_MAX_M) : m <= std::min(row_max_m, ROW_MAX_M);
  j.wide_rows = wide_type && j.by_rows;
  // int8x2 at more rows, in the portable and AVX2 panels: the float panels (float32 activations against
  // the dequantized weights); the AVX-512 panels keep the two int8 terms (VPDPBUSD takes 64 products at once).
  j.float_panels = activations == INT8X2 && !j.by_rows && m >= FLOAT_MIN_M && isa != AVX512_VNNI;
  j.split = activations == INT8X2 && !j.wide_rows && !j.float_panels;
  const int64_t rows = j.split ? 2 * m : m;
  XQuant& xq = s.xq;
  xq.k = k;
  xq.groups = k / 32;
  xq.blocks = k / 256;
  // Few activation rows take the row kernels (each weight row decoded in registers, in its own order);
  // there the K types' integer sums span whole blocks of 256 under one activation scale. Every ISA path
  // rounds the activations the same way for the same type and M, so the paths agree.
  j.span = j.by_rows && t.block_values == 256 ? 256 : 32;
  // The AVX2 code (the row kernels, the AVX2 panels) takes Q8_0's signed quants as they are (no offset);
  // the AVX-512 panels read them as q + 128.
  j.offset = (type == Q8_0 && (isa == AVX2 || j.by_rows)) ? 0 : t.offset;
  if (!j.wide_rows && !j.float_panels && int64_t(xq.q.size()) < rows * k) xq.q.resize(rows * k);
  if (j.wide_rows && int64_t(xq.q16.size()) < m * k) xq.q16.resize(m * k);
  if (int64_t(xq.g.size()) < rows * xq.groups) xq.g.resize(rows * xq.groups);
  if (j.span == 256 && int64_t(xq.b.size()) < rows * xq.blocks) xq.b.resize(rows * xq.blocks);
  if (j.split && int64_t(s.res.size()) < m * k) s.res.resize(m * k);
  const int64_t packed = (m + PACK_ROWS - 1) / PACK_ROWS * PACK_ROWS * k;
  if (j.float_panels && isa == AVX2 && int64_t(s.packed.size()) < packed) s.packed.resize(packed);
  if (j.split && int64_t(s.two.size()) < rows * n) s.two.resize(rows * n);
  const int64_t row_bytes = k / t.block_values * t.block_bytes;
  j.pb = Problem{type, w, n, k, row_bytes, &xq, rows,
                 j.split ? s.two.data() : out, j.split ? n : ldo, j.split ? nullptr : bias, x, ldx, s.packed.data()};
  const int64_t lanes = j.by_rows || isa == PORTABLE ? 1 : isa == AVX512_VNNI || j.float_panels ? 16 : 8;
  j.units = (n + lanes - 1) / lanes;
  j.work = n * xq.groups * (m + 4);
  return j;
}

// Activation rows [r0, r1) of x rounded to int8 (both passes under int8x2).
void quantize_part(const MatmulJob& j, int64_t r0, int64_t r1) {
  if (r0 >= r1) return;
  if (j.float_panels) {
    // AVX2: rows into their packed tiles, [k][PACK_ROWS] (the portable panels read x as it is).
    if (j.isa == PORTABLE) return;
    float* xp = j.s->packed.data();
    for (int64_t m = r0; m < r1; ++m) {
      const float* xr = j.x + m * j.ldx;
      float* dst = xp + (m / PACK_ROWS) * j.k * PACK_ROWS + m % PACK_ROWS;
      for (int64_t e = 0; e < j.k; ++e) dst[e * PACK_ROWS] = xr[e];
    }
    return;
  }
  XQuant& xq = j.s->xq;
  if (j.wide_rows) {
#if PDQ_X86
    if (j.isa != PORTABLE) quantize_rows16_avx2(j.x, j.ldx, r0, r1, j.k, xq);
    else
#endif
      quantize_rows16(j.x, j.ldx, r0, r1, j.k, xq);
    return;
  }
  for (int pass = 0; pass < (j.split ? 2 : 1); ++pass) {
    // Pass 1 rounds the residuals of these rows (res row i holds activation row i's) into rows M + i.
    float* res = j.s->res.data();
    const float* src = pass == 0 ? j.x : res;
    const int64_t lds = pass == 0 ? j.ldx : j.k;
    if (pass == 1) residual_rows(j.x, j.ldx, r0, r1, j.k, xq, res + r0 * j.k);
#if PDQ_X86
    if (j.isa != PORTABLE) quantize_rows_avx2(src, lds, r0, r1, j.k, *j.t, j.offset, j.span, xq, pass * j.m);
    else
#endif
      quantize_rows(src, lds, r0, r1, j.k, *j.t, j.offset, j.span, xq, pass * j.m);
  }
}

// Output columns of units [u0, u1) (weight panels, or rows for the row kernels).
void run_part(const MatmulJob& j, int64_t u0, int64_t u1) {
  if (u0 >= u1) return;
  const Problem& pb = j.pb;
  if (j.isa == PORTABLE) {
    if (j.wide_rows) run_portable_wide(pb, u0, u1);
    else if (j.float_panels) run_portable_float(pb, u0, u1);
    else run_portable(pb, u0, u1);
#if PDQ_X86
  } else if (j.wide_rows) {
    run_rows_wide_avx2(pb, u0, u1);
  } else if (j.float_panels) {
    run_avx2_float(pb, u0, u1);
  } else if (j.by_rows) {
    run_rows_avx2(pb, u0, u1);
  } else if (j.isa == AVX512_VNNI) {
    run_avx512(pb, u0, u1);
  } else {
    run_avx2(pb, u0, u1);
#endif
  }
}

// out rows [r0, r1) = (the rounded row's output + its residual's) + bias (int8x2 outside the float rows).
void combine_part(const MatmulJob& j, int64_t r0, int64_t r1) {
  if (!j.split) return;
  const float* y = j.s->two.data();
  const int64_t n = j.n;
  for (int64_t i = r0; i < r1; ++i) {
    float* o = j.out + i * j.ldo;
    const float* a = y + i * n;
    const float* b = y + (j.m + i) * n;
    if (j.bias) for (int64_t c = 0; c < n; ++c) o[c] = (a[c] + b[c]) + j.bias[c];
    else for (int64_t c = 0; c < n; ++c) o[c] = a[c] + b[c];
  }
}

// Threads it pays to wake for `work` (a thread's share must outweigh waking it: a few microseconds, far
// more when the cores are shared), at most `threads` and `units`.
int useful_threads(int threads, int64_t units, int64_t work) {
  return int(std::max<int64_t>(1, std::min<int64_t>({threads, units, work / MIN_THREAD_WORK})));
}

// out[m, :n] = x[m, :k] @ w^T (+ bias) for m < M. Pointers are addresses of float32 / uint8 buffers the
// caller checked: x [M, ldx], w [N, row_bytes], out [M, ldo], bias [N] or 0.
void matmul(int isa, int type, uintptr_t x_ptr, int64_t m, int64_t ldx, uintptr_t w_ptr, int64_t n, int64_t k,
            uintptr_t bias_ptr, uintptr_t out_ptr, int64_t ldo, int threads, int row_max_m, int activations,
            int wide_row_max_m) {
  if (!isa_supported(isa)) throw std::invalid_argument("this CPU cannot run quant ISA path " + std::to_string(isa));
  if (m <= 0 || n <= 0) {
    check_type(type);
    return;
  }
  threads = std::max(1, threads);
  // The calling thread's scratch, kept between calls (a decode step makes hundreds of small ones); a
  // long prompt's activations get their own, freed after the call.
  static thread_local MatmulScratch kept;
  MatmulScratch local;
  const int64_t rows = 2 * m;  // at most (int8x2)
  MatmulScratch& s = rows * k <= KEEP_SCRATCH_BYTES && rows * n <= KEEP_SCRATCH_BYTES ? kept : local;
  const MatmulJob j = plan_matmul(isa, type, reinterpret_cast<const float*>(x_ptr), m, ldx,
                                  reinterpret_cast<const uint8_t*>(w_ptr), n, k,
                                  reinterpret_cast<const float*>(bias_ptr), reinterpret_cast<float*>(out_ptr), ldo,
                                  row_max_m, activations, s, wide_row_max_m);
  {
    const int xthreads = int(std::min<int64_t>(threads, std::max<int64_t>(1, j.pb.m * k / 16384)));
#pragma omp parallel num_threads(xthreads)
    {
      const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
      quantize_part(j, m * tid / nt, m * (tid + 1) / nt);
    }
  }
  const int nthreads = useful_threads(threads, j.units, j.work);
  if (nthreads == 1) {
    run_part(j, 0, j.units);
  } else {
    // A few chunks per thread, taken in turn: a thread the OS wakes late (a busy core) finds its share
    // done by the others instead of holding up the call.
    const int64_t chunks = std::min<int64_t>(j.units, int64_t(nthreads) * 4);
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; ++c) run_part(j, j.units * c / chunks, j.units * (c + 1) / chunks);
  }
  if (!j.split) return;
  const int cthreads = int(std::min<int64_t>(threads, std::max<int64_t>(1, m * n / 65536)));
#pragma omp parallel num_threads(cthreads)
  {
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    combine_part(j, m * tid / nt, m * (tid + 1) / nt);
  }
}

// out[t, :k] = the float32 values of row ids[t] of w, exactly gguf.quants.dequantize's.
void embedding(int type, uintptr_t ids_ptr, int64_t count, uintptr_t w_ptr, int64_t n, int64_t k, uintptr_t out_ptr,
               int threads) {
  check_type(type);
  const TypeInfo& t = TYPES[type];
  const int64_t row_bytes = k / t.block_values * t.block_bytes;
  const int64_t* ids = reinterpret_cast<const int64_t*>(ids_ptr);
  for (int64_t i = 0; i < count; ++i)
    if (ids[i] < 0 || ids[i] >= n)
      throw std::out_of_range("embedding id " + std::to_string(ids[i]) + " outside the " + std::to_string(n) + " rows");
  const uint8_t* w = reinterpret_cast<const uint8_t*>(w_ptr);
  float* out = reinterpret_cast<float*>(out_ptr);
  const int nthreads = int(std::max<int64_t>(1, std::min<int64_t>(threads, count * k / 65536)));
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < count; ++i) dequant_row(type, w + ids[i] * row_bytes, out + i * k, k);
}

// ------------------------------------------------------------------------------- the fused decode step

// A decode-only step of a Llama-style decoder stack (quant_ops.DecodeStack) in one call: every layer's
// norms, projections, RoPE, K/V stores, attention over the paged cache and the gated MLP, with no Python
// and no op dispatch between them. At one stream the per-op cost of the unfused step (about a dozen
// dispatched ops a layer) was most of its time, not the weight bytes. The threads of one OpenMP region
// run the whole stack: each phase is split into units taken from a shared counter and ends at a spinning
// barrier (a phase lasts microseconds; waking a sleeping thread costs more than that).

#if PDQ_X86
inline void cpu_relax() { _mm_pause(); }
#else
inline void cpu_relax() {}
#endif

constexpr int SPIN_BEFORE_YIELD = 1 << 14;  // pauses (~40 ns each) before a waiter yields its core
constexpr int MAX_GROUPS = 8;               // row groups of one projection (runs of one block type)
constexpr int64_t MAX_GROUP_HEADS = 64;     // query heads per KV head
constexpr int MAX_GROUP_ROWS = 16;          // decode rows of one block table attended together
constexpr int64_t MAX_HEAD_DIM = 512;

class SpinBarrier {
 public:
  void reset(int n) { n_ = n; }
  void wait() {
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.fetch_add(1, std::memory_order_release);
      return;
    }
    // A waiter yields after a while: on cores shared with another process it must not hold the core
    // the last thread needs.
    for (int i = 0; phase_.load(std::memory_order_acquire) == phase; ++i) {
      if (i < SPIN_BEFORE_YIELD) cpu_relax();
      else sched_yield();
    }
  }

 private:
  int n_ = 1;
  std::atomic<int> arrived_{0};
  std::atomic<int> phase_{0};
};

// Phases hand out units from a ring of three counters: phase i takes counter i % 3 and resets the one
// phase i + 1 will take (last used by phase i - 2, two barriers ago).
struct Team {
  SpinBarrier bar;
  std::atomic<int64_t> next[3];
  int nt = 1;
};

// Runs fn(u0, u1) over `chunks` shares of [0, n) on every thread of the team, then waits for all.
template <class F>
void share(Team& team, int tid, int& phase, int64_t n, int64_t chunks, F&& fn) {
  std::atomic<int64_t>& c = team.next[phase % 3];
  if (tid == 0) team.next[(phase + 1) % 3].store(0, std::memory_order_relaxed);
  ++phase;
  chunks = std::max<int64_t>(1, std::min(chunks, n));
  for (int64_t i; (i = c.fetch_add(1, std::memory_order_relaxed)) < chunks;) fn(n * i / chunks, n * (i + 1) / chunks);
  team.bar.wait();
}

struct StackGroup {
  int type;
  const uint8_t* w;
  int64_t rows;
};

struct StackLinear {
  int ngroups = 0;
  const float* bias = nullptr;
  StackGroup g[MAX_GROUPS];
  int64_t n = 0;  // output features: the groups' rows summed
};

struct StackLayer {
  const float *norm_in, *norm_post, *q_norm, *k_norm;  // q_norm / k_norm: null without QK norms
  StackLinear qkv, o, gate_up, down;
};

// The plan's int64 words, per layer: norm_in, norm_post, q_norm, k_norm (addresses, 0 for none), then for
// qkv, o, gate_up, down each: ngroups, bias (0 for none), ngroups x (type, address, rows).
std::vector<StackLayer> parse_plan(const int64_t* p, int64_t len, int64_t layers) {
  std::vector<StackLayer> out(layers);
  int64_t i = 0;
  auto word = [&]() {
    if (i >= len) throw std::invalid_argument("the decode plan ends early");
    return p[i++];
  };
  auto ptr = [&]() { return reinterpret_cast<const float*>(word()); };
  for (StackLayer& l : out) {
    l.norm_in = ptr(), l.norm_post = ptr(), l.q_norm = ptr(), l.k_norm = ptr();
    for (StackLinear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      lin->ngroups = int(word());
      if (lin->ngroups < 1 || lin->ngroups > MAX_GROUPS) throw std::invalid_argument("a projection of the decode plan has no or too many row groups");
      lin->bias = ptr();
      for (int g = 0; g < lin->ngroups; ++g) {
        StackGroup& gr = lin->g[g];
        gr.type = int(word());
        check_type(gr.type);
        gr.w = reinterpret_cast<const uint8_t*>(word());
        gr.rows = word();
        lin->n += gr.rows;
      }
    }
  }
  if (i != len) throw std::invalid_argument("the decode plan has words left over");
  return out;
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN kept quiet (torch's float -> bfloat16).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float dot_portable(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x
void axpy_portable(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void exp_portable(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

#if PDQ_X86
PDQ_AVX2 float dot_avx2f(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum8(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

PDQ_AVX2 void axpy_avx2f(float a, const float* x, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// e^x in 8 lanes (Cephes' expf: range reduction by ln 2 in two parts, a degree-6 polynomial), within 2
// ulp of std::exp over [-87, 88]; arguments are clamped there (softmax and silu need no more).
PDQ_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

PDQ_AVX2 void exp_avx2(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

PDQ_AVX2 void silu_mul_avx2(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}
#endif

// The vector helpers of one ISA path.
struct VecOps {
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float, const float*, float*, int64_t);
  void (*exp)(float*, int64_t);
  bool avx2;
};

VecOps vec_ops(int isa) {
#if PDQ_X86
  if (isa != PORTABLE) return {dot_avx2f, axpy_avx2f, exp_avx2, true};
#endif
  return {dot_portable, axpy_portable, exp_portable, false};
}

void silu_mul_rows(const VecOps& v, const float* g, const float* u, float* out, int64_t n) {
#if PDQ_X86
  if (v.avx2) {
    silu_mul_avx2(g, u, out, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// out = x / rms(x) * w over n values (float32 throughout, as CausalLM's norms are for float32 weights).
void rms_norm_vec(const VecOps& v, const float* x, const float* w, float* out, int64_t n, float eps) {
  const float ss = v.dot(x, x, n);
  const float inv = 1.f / std::sqrt(ss / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

// Rotate-half RoPE of one head row in place: x * cos + cat(x2, x1) * sin (the sin row's first half
// negated, as CausalLM's tables are).
void rope_row(float* x, const float* cs, const float* sn, int64_t d) {
  float tmp[MAX_HEAD_DIM];
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) tmp[i] = x[i] * cs[i] + x[i < half ? i + half : i - half] * sn[i];
  std::memcpy(x, tmp, d * sizeof(float));
}

struct StackGeometry {
  int64_t layers, hidden, hq, hkv, d, inter;
  float eps, scale;
};

struct KvView {
  char* base;      // kv_cache [L, 2, NB, BS, Hkv, D]
  int es;          // element bytes: 4 float32, 2 bfloat16
  int64_t nb, bs;  // blocks, slots per block
  int64_t layer_elems() const { return 2 * half_elems(); }
  int64_t half_elems() const { return nb * bs * row_elems; }
  int64_t row_elems = 0;  // Hkv * D
};


#if PDQ_X86
// sc[g * ld + t0 + i] = scale * q_g . K row i for i < n (n <= 8 rows `kr`, d a multiple of 8, at most 64)
// and query heads g < G: the query's vectors stay in registers, each K row is read once per head from L1,
// and the 8 dot products of a head leave as one vector (a tree of horizontal adds, no per-token sums).
PDQ_AVX2 void qk8_avx2(const float* q, int64_t G, int64_t d, const float* const* kr, int n, float scale, float* sc,
                       int64_t ld, int64_t t0) {
  const int nv = int(d / 8);
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    __m256 qv[8];
    for (int j = 0; j < nv; ++j) qv[j] = _mm256_loadu_ps(q + g * d + 8 * j);
    __m256 a[8];
    for (int i = 0; i < 8; ++i) {
      a[i] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr[i]));
      for (int j = 1; j < nv; ++j) a[i] = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(kr[i] + 8 * j), a[i]);
    }
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                     _mm256_permute2f128_ps(s0123, s4567, 0x31));
    alignas(32) float out[8];
    _mm256_store_ps(out, _mm256_mul_ps(sum, s));
    for (int i = 0; i < n; ++i) sc[g * ld + t0 + i] = out[i];
  }
}

// out[g, :d] = inv[g] * sum over t < ctx of p[g, t] * V row t, for query heads g < G, float32 V rows of
// d <= MAX_HEAD_DIM values: three heads and 32 columns at a time (12 sums in registers), so each V row is
// read from memory once for the whole group.
PDQ_AVX2 void pv_group_avx2(const float* p, int64_t ld, const float* inv, int64_t G, const float* v_cache,
                            const int32_t* table, int64_t bs, int64_t row_elems, int64_t col, int64_t d, int64_t ctx,
                            float* out) {
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const int gn = int(std::min<int64_t>(3, G - g0));
    for (int64_t c0 = 0; c0 < d; c0 += 32) {
      const int nv = int(std::min<int64_t>(32, d - c0) / 8);
      __m256 acc[3][4];
      for (int g = 0; g < 3; ++g)
        for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
      for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
        const float* base = v_cache + int64_t(table[t0 / bs]) * bs * row_elems + col + c0;
        const int64_t n = std::min(bs, ctx - t0);
        if (t0 + bs < ctx) {  // the next block's rows, while this one's are summed
          const float* next = v_cache + int64_t(table[t0 / bs + 1]) * bs * row_elems + col + c0;
          for (int64_t o = 0, m = std::min(bs, ctx - t0 - bs); o < m; ++o) prefetch_span(next + o * row_elems, 4 * nv * 8);
        }
        for (int64_t o = 0; o < n; ++o) {
          const float* vr = base + o * row_elems;
          for (int g = 0; g < gn; ++g) {
            const __m256 pt = _mm256_set1_ps(p[(g0 + g) * ld + t0 + o]);
            for (int j = 0; j < nv; ++j) acc[g][j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 8 * j), acc[g][j]);
          }
        }
      }
      for (int g = 0; g < gn; ++g) {
        const __m256 s = _mm256_set1_ps(inv[g0 + g]);
        for (int j = 0; j < nv; ++j) _mm256_storeu_ps(out + (g0 + g) * d + c0 + 8 * j, _mm256_mul_ps(acc[g][j], s));
      }
    }
  }
}
#endif

#if PDQ_X86
// dst[0:n] = the bfloat16 values src[0:n] as float32 (exact: the bits shifted up), 8 at a time (n % 8 == 0).
PDQ_AVX2 void widen_bf16_avx2(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
}
#endif

// Attention of query heads [kvh * G, (kvh + 1) * G) of R rows sharing one block table (a drafting
// sequence's 1 + d rows; most often R = 1): row r reads its first ctx[r] cached tokens, its queries at
// q + r * q_ld and its output at out + r * out_ld. Scores into sc [R, G, S] (S the longest context), an
// exact softmax (max subtracted, sums in float32), then the V rows' weighted sum. Each K and V row is read
// (and widened from bfloat16) once for all R rows, and every row's values are computed by the operations,
// in the order, it would take alone: grouping rows never changes a result.
void attend_rows(const VecOps& v, const StackGeometry& gm, const KvView& kv, const char* kl, const char* vl,
                 const float* q, int64_t q_ld, const int32_t* table, const int32_t* ctx, int R, int64_t kvh,
                 float* out, int64_t out_ld, std::vector<float>& sc, std::vector<float>& row) {
  const int64_t g_heads = gm.hq / gm.hkv, d = gm.d;
  int64_t S = 0;
  for (int r = 0; r < R; ++r) S = std::max<int64_t>(S, ctx[r]);
  if (int64_t(sc.size()) < R * g_heads * S) sc.resize(R * g_heads * S);
  if (int64_t(row.size()) < d) row.resize(d);
  // bfloat16 rows on AVX2: the group's K and V rows widened once into float32 rows (exact), then the
  // float32 kernels below, as on a float32 cache holding the same values.
  static thread_local std::vector<float> wide;
  const bool widen = PDQ_X86 && v.avx2 && kv.es == 2 && d % 8 == 0 && d <= 64;
  const int32_t flat_table[1] = {0};  // the widened rows as one block of S rows
  if (widen) {
    if (int64_t(wide.size()) < 2 * S * d) wide.resize(2 * S * d);
#if PDQ_X86
    for (int64_t t = 0; t < S; ++t) {
      const int64_t off = (int64_t(table[t / kv.bs]) * kv.bs + t % kv.bs) * kv.row_elems + kvh * d;
      widen_bf16_avx2(reinterpret_cast<const uint16_t*>(kl) + off, wide.data() + t * d, d);
      widen_bf16_avx2(reinterpret_cast<const uint16_t*>(vl) + off, wide.data() + (S + t) * d, d);
    }
#endif
  }
  const int es = widen ? 4 : kv.es;
  auto kv_row = [&](const char* base, int64_t t) -> const float* {
    if (widen) return wide.data() + ((base == vl ? S : 0) + t) * d;
    const int64_t slot = int64_t(table[t / kv.bs]) * kv.bs + t % kv.bs;
    const char* p = base + (slot * kv.row_elems + kvh * d) * kv.es;
    if (kv.es == 4) return reinterpret_cast<const float*>(p);
    const uint16_t* b = reinterpret_cast<const uint16_t*>(p);
    for (int64_t i = 0; i < d; ++i) row[i] = bf16_to_float(b[i]);
    return row.data();
  };
  auto scores = [&](int r) { return sc.data() + r * g_heads * S; };
  // float32 rows on AVX2: one query group against 8 K rows at a time, the V rows once for the group.
  const bool f32_avx2 = PDQ_X86 && v.avx2 && es == 4 && d % 8 == 0 && d <= 64;
#if PDQ_X86
  if (f32_avx2) {
    const float* kr[8];
    const float* krr[8];
    for (int64_t t0 = 0; t0 < S; t0 += 8) {
      const int n = int(std::min<int64_t>(8, S - t0));
      for (int i = 0; i < 8; ++i) kr[i] = kv_row(kl, t0 + std::min(i, n - 1));
      for (int64_t t = t0 + 16; t < std::min(S, t0 + 24); ++t) prefetch_span(kv_row(kl, t), d * 4);
      for (int r = 0; r < R; ++r) {
        const int nr = int(std::min<int64_t>(8, ctx[r] - t0));
        if (nr <= 0) continue;
        for (int i = 0; i < 8; ++i) krr[i] = kr[std::min(i, nr - 1)];
        qk8_avx2(q + r * q_ld, g_heads, d, krr, nr, gm.scale, scores(r), S, t0);
      }
    }
  }
#endif
  if (!f32_avx2)
    for (int64_t t = 0; t < S; ++t) {
      const float* k = kv_row(kl, t);
      for (int r = 0; r < R; ++r)
        if (t < ctx[r])
          for (int64_t g = 0; g < g_heads; ++g) scores(r)[g * S + t] = v.dot(q + r * q_ld + g * d, k, d) * gm.scale;
    }
  float inv[MAX_GROUP_ROWS][MAX_GROUP_HEADS];
  for (int r = 0; r < R; ++r)
    for (int64_t g = 0; g < g_heads; ++g) {
      float* s = scores(r) + g * S;
      const int64_t n = ctx[r];
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
      for (int64_t t = 0; t < n; ++t) s[t] -= mx;
      v.exp(s, n);
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) sum += s[t];
      inv[r][g] = 1.f / sum;
      std::memset(out + r * out_ld + g * d, 0, d * sizeof(float));
    }
#if PDQ_X86
  if (widen) {  // the widened V rows: one block of S rows, d values each
    for (int r = 0; r < R; ++r)
      pv_group_avx2(scores(r), S, inv[r], g_heads, wide.data() + S * d, flat_table, S, d, 0, d, ctx[r],
                    out + r * out_ld);
    return;
  }
  if (v.avx2 && kv.es == 4 && d % 8 == 0) {  // float32 rows: the weighted sums in registers
    for (int r = 0; r < R; ++r)
      pv_group_avx2(scores(r), S, inv[r], g_heads, reinterpret_cast<const float*>(vl), table, kv.bs, kv.row_elems,
                    kvh * d, d, ctx[r], out + r * out_ld);
    return;
  }
#endif
  for (int64_t t = 0; t < S; ++t) {
    const float* vr = kv_row(vl, t);
    for (int r = 0; r < R; ++r)
      if (t < ctx[r])
        for (int64_t g = 0; g < g_heads; ++g)
          v.axpy(scores(r)[g * S + t] * inv[r][g], vr, out + r * out_ld + g * d, d);
  }
}

// Consecutive decode rows [start, start + rows) of a step that share one block table (a drafting
// sequence's rows, which the scheduler places together): attention reads their K/V once (attend_rows).
std::vector<std::pair<int64_t, int>> table_groups(const int32_t* tables, int64_t table_width, int64_t B) {
  std::vector<std::pair<int64_t, int>> groups;
  for (int64_t b = 0; b < B; ++b) {
    if (!groups.empty()) {
      auto& [start, rows] = groups.back();
      if (rows < MAX_GROUP_ROWS &&
          std::memcmp(tables + start * table_width, tables + b * table_width, table_width * sizeof(int32_t)) == 0) {
        ++rows;
        continue;
      }
    }
    groups.emplace_back(b, 1);
  }
  return groups;
}

// The step's buffers, kept by the calling thread between calls.
struct StepScratch {
  std::vector<float> x, qkv, q, att, tmp, gu, act;
  MatmulScratch mm;
  MatmulJob job;
};

// Runs the B decode tokens of one step through every layer. h [B, hidden] holds their embeddings and
// becomes the residual stream; out [B, hidden] gets the final norm of it (float32). Each token's K/V are
// stored at slots[b] before attention reads its context_lens[b] tokens through its block table row.
// Changes h, out and those KV cache slots only.
void decode_layers(int isa, int activations, int threads, uintptr_t plan_ptr, int64_t plan_len, int64_t layers,
                   int64_t hidden, int64_t hq, int64_t hkv, int64_t d, int64_t inter, double eps, double scale,
                   uintptr_t final_norm_ptr, uintptr_t h_ptr, uintptr_t out_ptr, int64_t b_count,
                   uintptr_t positions_ptr, uintptr_t slots_ptr, uintptr_t tables_ptr, int64_t table_width,
                   uintptr_t ctx_ptr, uintptr_t kv_ptr, int64_t kv_es, int64_t nb, int64_t bs, uintptr_t cos_ptr,
                   uintptr_t sin_ptr, int64_t table_len, int64_t row_max_m, int64_t wide_row_max_m) {
  if (!isa_supported(isa)) throw std::invalid_argument("this CPU cannot run quant ISA path " + std::to_string(isa));
  if (kv_es != 4 && kv_es != 2) throw std::invalid_argument("the fused decode step takes float32 or bfloat16 KV caches");
  if (hq % hkv || hq / hkv > MAX_GROUP_HEADS || d > MAX_HEAD_DIM || d % 2) throw std::invalid_argument("unsupported attention geometry for the fused decode step");
  const std::vector<StackLayer> plan = parse_plan(reinterpret_cast<const int64_t*>(plan_ptr), plan_len, layers);
  const int64_t B = b_count;
  if (B <= 0) return;
  const StackGeometry gm{layers, hidden, hq, hkv, d, inter, float(eps), float(scale)};
  const int64_t* pos = reinterpret_cast<const int64_t*>(positions_ptr);
  const int64_t* slots = reinterpret_cast<const int64_t*>(slots_ptr);
  const int32_t* tables = reinterpret_cast<const int32_t*>(tables_ptr);
  const int32_t* ctx = reinterpret_cast<const int32_t*>(ctx_ptr);
  for (int64_t b = 0; b < B; ++b) {
    if (pos[b] < 0 || pos[b] >= table_len) throw std::out_of_range("a position is outside the RoPE table");
    if (slots[b] < -1 || slots[b] >= nb * bs) throw std::out_of_range("a KV slot is outside the cache");
    if (ctx[b] < 1 || ctx[b] > table_width * bs) throw std::out_of_range("a context length exceeds its block table");
    for (int64_t j = 0; j < (ctx[b] + bs - 1) / bs; ++j)
      if (tables[b * table_width + j] < 0 || tables[b * table_width + j] >= nb)
        throw std::out_of_range("a block table entry is outside the cache");
  }
  const KvView kv{reinterpret_cast<char*>(kv_ptr), int(kv_es), nb, bs, hkv * d};
  const float* cos_t = reinterpret_cast<const float*>(cos_ptr);
  const float* sin_t = reinterpret_cast<const float*>(sin_ptr);
  const float* final_norm = reinterpret_cast<const float*>(final_norm_ptr);
  float* h = reinterpret_cast<float*>(h_ptr);
  float* out = reinterpret_cast<float*>(out_ptr);
  const VecOps v = vec_ops(isa);
  const int64_t nqkv = plan[0].qkv.n, g_heads = hq / hkv;
  const std::vector<std::pair<int64_t, int>> groups = table_groups(tables, table_width, B);
  const int64_t units = int64_t(groups.size()) * hkv;  // attention work units: a row group x a KV head
  for (const StackLayer& l : plan)
    if (l.qkv.n != (hq + 2 * hkv) * d || l.o.n != hidden || l.gate_up.n != 2 * inter || l.down.n != hidden)
      throw std::invalid_argument("the decode plan's projections do not match the geometry");

  // The calling thread's, named through a reference: inside the parallel region the thread_local's own
  // name would be each worker's copy.
  static thread_local StepScratch kept;
  StepScratch& st = kept;
  auto fit = [](std::vector<float>& b, int64_t n) {
    if (int64_t(b.size()) < n) b.resize(n);
  };
  fit(st.x, B * std::max(hidden, inter)), fit(st.qkv, B * nqkv), fit(st.q, B * hq * d), fit(st.att, B * hq * d);
  fit(st.tmp, B * hidden), fit(st.gu, B * 2 * inter), fit(st.act, B * inter);
  // Size the matmul scratch for the largest projection now: inside the region only thread 0 plans.
  {
    const int64_t kmax = std::max({hidden, inter, hq * d}), nmax = std::max({nqkv, hidden, 2 * inter});
    XQuant& xq = st.mm.xq;
    if (int64_t(xq.q.size()) < 2 * B * kmax) xq.q.resize(2 * B * kmax);
    if (int64_t(xq.q16.size()) < B * kmax) xq.q16.resize(B * kmax);
    if (int64_t(xq.g.size()) < 2 * B * kmax / 32) xq.g.resize(2 * B * kmax / 32);
    if (int64_t(xq.b.size()) < 2 * B * kmax / 256 + 1) xq.b.resize(2 * B * kmax / 256 + 1);
    fit(st.mm.res, B * kmax), fit(st.mm.two, 2 * B * nmax);
  }
  float *xs = st.x.data(), *qkv = st.qkv.data(), *qr = st.q.data(), *att = st.att.data(), *tmp = st.tmp.data();
  float *gu = st.gu.data(), *act = st.act.data();
  Team team;
  for (auto& c : team.next) c.store(0);
  threads = std::max(1, threads);
  std::exception_ptr failure;
  std::atomic<bool> failed{false};

#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    team.bar.reset(omp_get_num_threads());
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    int phase = 0;
    // This thread's share of [0, n) in a static split (B rows: usually few, so no counter).
    auto mine = [&](int64_t n, int64_t& lo, int64_t& hi) { lo = n * tid / nt, hi = n * (tid + 1) / nt; };
    std::vector<float> sc, row;
    // y [B, lin.n] (ldo) = x [B, k] (ldx) @ lin^T + bias, its row groups one after another.
    auto linear = [&](const StackLinear& lin, const float* x, int64_t ldx, int64_t k, float* y, int64_t ldo) {
      int64_t col = 0;
      for (int gi = 0; gi < lin.ngroups; ++gi) {
        const StackGroup& g = lin.g[gi];
        if (tid == 0) {
          try {
            st.job = plan_matmul(isa, g.type, x, B, ldx, g.w, g.rows, k, lin.bias ? lin.bias + col : nullptr, y + col,
                                 ldo, int(row_max_m), activations, st.mm, int(wide_row_max_m));
            quantize_part(st.job, 0, B);
          } catch (...) {
            if (!failed.exchange(true)) failure = std::current_exception();
          }
        }
        team.bar.wait();
        if (failed.load()) return;
        const MatmulJob j = st.job;  // a copy: thread 0 plans the next group while others may still read
        // The threads are awake already: every matmul is split, however small.
        share(team, tid, phase, j.units, int64_t(nt) * 4, [&](int64_t u0, int64_t u1) { run_part(j, u0, u1); });
        if (j.split) {
          int64_t lo, hi;
          mine(B, lo, hi);
          combine_part(j, lo, hi);
          team.bar.wait();
        }
        col += g.rows;
      }
    };
    for (int64_t li = 0; li < layers && !failed.load(); ++li) {
      const StackLayer& L = plan[li];
      const char* kl = kv.base + li * kv.layer_elems() * kv.es;
      const char* vl = kl + kv.half_elems() * kv.es;
      int64_t lo, hi;
      // h += the last layer's MLP output; x = input norm of h.
      mine(B, lo, hi);
      for (int64_t b = lo; b < hi; ++b) {
        float* hr = h + b * hidden;
        if (li > 0) for (int64_t i = 0; i < hidden; ++i) hr[i] += tmp[b * hidden + i];
        rms_norm_vec(v, hr, L.norm_in, xs + b * hidden, hidden, gm.eps);
      }
      team.bar.wait();
      linear(L.qkv, xs, hidden, hidden, qkv, nqkv);
      if (failed.load()) break;
      // Per (token, head): QK norm, RoPE; the K and V rows into their slots.
      share(team, tid, phase, B * (hq + hkv), B * (hq + hkv), [&](int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t b = u / (hq + hkv), hd = u % (hq + hkv);
          const float* cs = cos_t + pos[b] * d;
          const float* sn = sin_t + pos[b] * d;
          const float* src = qkv + b * nqkv + hd * d;
          float rowbuf[MAX_HEAD_DIM];
          float* r = hd < hq ? qr + (b * hq + hd) * d : rowbuf;
          const float* qk_w = hd < hq ? L.q_norm : L.k_norm;
          if (qk_w) rms_norm_vec(v, src, qk_w, r, d, gm.eps);
          else std::memcpy(r, src, d * sizeof(float));
          rope_row(r, cs, sn, d);
          if (hd < hq || slots[b] < 0) continue;  // slot -1: not stored (KernelOps.store_kv)
          const int64_t kvh = hd - hq;
          const float* vsrc = qkv + b * nqkv + (hq + hkv + kvh) * d;
          char* kd = const_cast<char*>(kl) + (slots[b] * kv.row_elems + kvh * d) * kv.es;
          char* vd = const_cast<char*>(vl) + (slots[b] * kv.row_elems + kvh * d) * kv.es;
          if (kv.es == 4) {
            std::memcpy(kd, r, d * 4);
            std::memcpy(vd, vsrc, d * 4);
          } else {
            uint16_t* kb = reinterpret_cast<uint16_t*>(kd);
            uint16_t* vb = reinterpret_cast<uint16_t*>(vd);
            for (int64_t i = 0; i < d; ++i) kb[i] = float_to_bf16(r[i]), vb[i] = float_to_bf16(vsrc[i]);
          }
        }
      });
      share(team, tid, phase, units, units, [&](int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; ++u) {
          const auto [b, rows] = groups[u / hkv];
          const int64_t kvh = u % hkv;
          attend_rows(v, gm, kv, kl, vl, qr + (b * hq + kvh * g_heads) * d, hq * d, tables + b * table_width, ctx + b,
                      rows, kvh, att + (b * hq + kvh * g_heads) * d, hq * d, sc, row);
        }
      });
      linear(L.o, att, hq * d, hq * d, tmp, hidden);
      if (failed.load()) break;
      mine(B, lo, hi);
      for (int64_t b = lo; b < hi; ++b) {
        float* hr = h + b * hidden;
        for (int64_t i = 0; i < hidden; ++i) hr[i] += tmp[b * hidden + i];
        rms_norm_vec(v, hr, L.norm_post, xs + b * hidden, hidden, gm.eps);
      }
      team.bar.wait();
      linear(L.gate_up, xs, hidden, hidden, gu, 2 * inter);
      if (failed.load()) break;
      const int64_t pieces = (inter + 255) / 256;
      share(team, tid, phase, B * pieces, B * pieces, [&](int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t b = u / pieces, c0 = (u % pieces) * 256, c1 = std::min(inter, c0 + 256);
          silu_mul_rows(v, gu + b * 2 * inter + c0, gu + b * 2 * inter + inter + c0, act + b * inter + c0, c1 - c0);
        }
      });
      linear(L.down, act, inter, inter, tmp, hidden);
    }
    if (!failed.load()) {
      int64_t lo, hi;
      mine(B, lo, hi);
      for (int64_t b = lo; b < hi; ++b) {
        float* hr = h + b * hidden;
        for (int64_t i = 0; i < hidden; ++i) hr[i] += tmp[b * hidden + i];
        rms_norm_vec(v, hr, final_norm, out + b * hidden, hidden, gm.eps);
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "GGUF block-quantized matmul and embedding kernels (pdserve.kernels.quant_ops)";
  m.attr("FLOAT_MIN_M") = FLOAT_MIN_M;
  m.def("isa_supported", &isa_supported, "whether this CPU can run ISA path i (0 portable, 1 avx2, 2 avx512_vnni)");
  m.def("matmul", &matmul, py::call_guard<py::gil_scoped_release>());
  m.def("embedding", &embedding, py::call_guard<py::gil_scoped_release>());
  m.def("decode_layers", &decode_layers, py::call_guard<py::gil_scoped_release>(),
        "one decode-only step of a decoder stack (quant_ops.DecodeStack)");
}
