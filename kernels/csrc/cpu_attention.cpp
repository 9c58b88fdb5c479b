// Paged decode attention for CPU KV caches, reading K/V blocks in place (no gathered copy).
//
// One work item is (sequence, KV head, context split): it walks its share of the sequence's block table and
// serves the G query heads of that KV head with an online softmax (running max and sum in float32). Splits of
// one sequence are merged by their log-sum-exp. Work items are handed out dynamically, so ragged context
// lengths keep both cores busy. Each item prefetches the rows two blocks ahead (blocks sit anywhere in the
// KV cache, so the hardware prefetcher can't), into L2 rather than L1: a core keeps few L1 misses in flight and
// many L2 ones, so the L1 hint left the cores waiting on memory (the same reads with no compute: 20 GB/s with
// L1 hints, as with none; 29 GB/s with L2 hints; the bf16 kernel 1.61x faster at 32 x 512 x 30 layers on Zen 4).
//
// The cache element type is float32, bfloat16, float16, float8_e5m2 or float8_e4m3fn; sums are float32.
//
// bfloat16 and fp8 KV caches with head dim 64 or 128 on AVX512-BF16 + VBMI builds (attend_item_bf16) work on 16
// tokens at a time. Scores: VDPBF16PS of q (as bfloat16: one part, exact, for a bfloat16 model's q; three
// parts summing to a float32 q otherwise) with each token's bfloat16 K row, giving 16 vectors of partial sums
// that one transpose-and-add tree reduces to one vector of 16 scores (instead of 16 horizontal reductions).
// Softmax on that vector, with a running max that is only raised when a score passes it by more than 8, so
// most blocks need neither a max reduction nor a rescale. P.V in float32 FMAs, each V row widened once for up
// to 4 query heads. fp8 K rows become bfloat16 exactly (both fp8 formats fit bfloat16's exponent range,
// their subnormals as normal numbers) by two VPERMI2B table lookups (low and high byte of the bfloat16 bits
// of the 128 magnitudes) and the sign or-ed in; V rows are widened to float32 as on the other path. At 32
// sequences x 512 tokens x 30 layers of the default model (bench/decode_kernel_cpu.py) this is 1.45x (bf16)
// and 1.2-1.3x (fp8) faster than the per-token version, 1.7x and 1.3-1.5x with the KV cache cache-resident: from
// DRAM it is bound by the cache lines the two cores keep in flight, not by its instructions.
//
// Other KV caches and head dims (attend_item, attend_item_generic) convert each K/V row to float32 once and take
// one horizontal reduction per token and query head. An e5m2 byte is the top byte of a float16 (same
// sign/exponent layout, 2 of its 10 mantissa bits), so it widens exactly as (uint16)b << 8 reinterpreted as
// float16: no scale, and the AVX-512 path reuses the F16C conversion. An e4m3fn byte (bias 7, 3 mantissa
// bits) becomes exact float16 bits the same way: its 7 magnitude bits shifted left by 7 read as a float16 are
// the value times 2^-8, subnormals included (both formats' subnormals line up), so widen and multiply by 256.
// (e4m3fn's NaN, 0x7F, reads as 480 on every path: the KV cache never stores one, since torch's conversion
// saturates at +-448.) At one byte per element either halves the DRAM traffic that bounds decode attention.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// float -> bfloat16 bits, round to nearest even (c10::BFloat16's rounding; NaN becomes a quiet NaN).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7FC0) : rounded;
}
inline float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return bf16_float(x.x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }
// float -> a half-precision type, rounded to nearest even: bfloat16 through bf16_bits, float16 as c10::Half.
template <typename W>
inline W half_round(float f) {
  if constexpr (std::is_same_v<W, at::BFloat16>) return W(bf16_bits(f), W::from_bits());
  else return W(f);
}
inline float to_float(at::Float8_e5m2 x) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(x.x) << 8, c10::Half::from_bits()));
}
inline float to_float(at::Float8_e4m3fn x) {
  const uint16_t b = x.x;
  const float mag = 256.f * static_cast<float>(c10::Half(static_cast<uint16_t>((b & 0x7F) << 7), c10::Half::from_bits()));
  return (b & 0x80) ? -mag : mag;
}

template <typename T>
inline void row_to_float(const T* __restrict src, float* __restrict dst, int64_t d) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    uint32_t* o = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<uint32_t>(s[i]) << 16;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]);
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// Online softmax for one query head over one block of scores: the running max after the block (stored in
// *m) and the factor that rescales what was accumulated before it (0 for the first block).
inline float advance_max(const float* sg, int64_t n, float* m) {
  float mx = *m;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
  const float alpha = *m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(*m - mx);
  *m = mx;
  return alpha;
}

#if defined(__AVX512F__)
#include <immintrin.h>

// e^x for 16 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative error
// about 1e-7, a float32 ulp), times 2^n. Inputs below -87 (and -inf) give 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n);
}

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else if constexpr (std::is_same_v<T, at::Float8_e5m2>) {
    // 16 bytes -> 16 float16 (each byte as the high byte) -> 16 float32
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  } else if constexpr (std::is_same_v<T, at::Float8_e4m3fn>) {
    // 16 bytes -> float16 bits -> float32, times 2^8. Sign-extending puts the sign in bits 8-15, so after
    // the shift by 7 bit 15 is the sign and bit 14 a copy of it, which the mask clears.
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// One (sequence, KV head, split) item with head dim 16 * NV held in registers.
template <typename T, int NV>
void attend_item(const float* qs, const T* k_cache, const T* v_cache, const int32_t* table, int64_t ctx, int64_t j0,
                 int64_t j1, int64_t G, int64_t BS, int64_t row_stride, int64_t h, float* acc, float* m, float* l,
                 float* s) {
  constexpr int64_t D = 16 * NV;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t blk = table[j];
    const int64_t n = std::min(BS, ctx - j * BS);
    const T* kb = k_cache + blk * BS * row_stride + h * D;
    const T* vb = v_cache + blk * BS * row_stride + h * D;
    if (j + 2 < j1) {  // blocks sit anywhere in the KV cache: ask for the rows two blocks ahead while this one computes
      const int64_t nxt = table[j + 2] * BS * row_stride + h * D;
      constexpr int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
      for (int64_t t = 0; t < BS; ++t)
        for (int64_t c = 0; c < row_bytes; c += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + nxt + t * row_stride) + c, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(v_cache + nxt + t * row_stride) + c, _MM_HINT_T1);
        }
    }
    // scores s[g * BS + t]
    for (int64_t t = 0; t < n; ++t) {
      __m512 k[NV];
      for (int v = 0; v < NV; ++v) k[v] = load16(kb + t * row_stride + 16 * v);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs + g * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
        for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * v), k[v], a);
        s[g * BS + t] = _mm512_reduce_add_ps(a);
      }
    }
    // online softmax, 16 tokens at a time
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * BS;
      const float alpha = advance_max(sg, n, &m[g]);
      float sum = 0.f;
      const __m512 mxv = _mm512_set1_ps(m[g]);
      for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 mask = n - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
        const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sg + t), mxv));
        _mm512_mask_storeu_ps(sg + t, mask, p);
        sum += _mm512_mask_reduce_add_ps(mask, p);
      }
      l[g] = l[g] * alpha + sum;
      if (alpha != 1.f) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + g * D + 16 * v, _mm512_mul_ps(av, _mm512_loadu_ps(acc + g * D + 16 * v)));
      }
    }
    for (int64_t g0 = 0; g0 < G; g0 += 2) {  // two query heads' accumulators in registers per V pass
      const int64_t gn = std::min<int64_t>(2, G - g0);
      __m512 a0[NV], a1[NV];
      for (int v = 0; v < NV; ++v) {
        a0[v] = _mm512_loadu_ps(acc + g0 * D + 16 * v);
        a1[v] = gn > 1 ? _mm512_loadu_ps(acc + (g0 + 1) * D + 16 * v) : _mm512_setzero_ps();
      }
      for (int64_t t = 0; t < n; ++t) {
        const __m512 p0 = _mm512_set1_ps(s[g0 * BS + t]);
        const __m512 p1 = _mm512_set1_ps(gn > 1 ? s[(g0 + 1) * BS + t] : 0.f);
        for (int v = 0; v < NV; ++v) {
          const __m512 vv = load16(vb + t * row_stride + 16 * v);
          a0[v] = _mm512_fmadd_ps(p0, vv, a0[v]);
          a1[v] = _mm512_fmadd_ps(p1, vv, a1[v]);
        }
      }
      for (int v = 0; v < NV; ++v) {
        _mm512_storeu_ps(acc + g0 * D + 16 * v, a0[v]);
        if (gn > 1) _mm512_storeu_ps(acc + (g0 + 1) * D + 16 * v, a1[v]);
      }
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define PDSERVE_BF16_PATH 1

// Sums of 16 vectors, one per lane: lane t of the result is the sum of a[t]'s 16 lanes. A transpose-and-add
// tree (45 shuffles and adds for 16 sums, against about 16 x 8 for 16 separate horizontal reductions).
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] for x = a[2i], y = a[2i+1]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial sum of each of 4 tokens, in order
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: tokens 0-3 (two halves), 4-7 (two halves)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// fp8 -> bfloat16 by table lookup: both fp8 formats fit bfloat16 exactly (its 8 exponent bits cover their
// ranges, subnormals included, as normal numbers), so the 128 magnitudes' bfloat16 bits are two 128-entry
// byte tables (low and high byte), looked up 64 bytes at a time with VPERMI2B, and the sign bit is or-ed in.
struct Fp8Tables {
  __m512i lo0, lo1, hi0, hi1;  // low / high bytes of the bfloat16 bits for magnitudes 0-63 and 64-127
};

template <typename T>
const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables = [] {
    alignas(64) uint8_t lo[128], hi[128];
    for (int b = 0; b < 128; ++b) {
      const float f = to_float(T(static_cast<uint8_t>(b), T::from_bits()));
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof(bits));
      lo[b] = static_cast<uint8_t>(bits >> 16);
      hi[b] = static_cast<uint8_t>(bits >> 24);
    }
    return Fp8Tables{_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi), _mm512_load_si512(hi + 64)};
  }();
  return tables;
}

// 64 fp8 values -> 64 bfloat16 (two vectors, in order), exactly.
inline void fp8x64_to_bf16(const void* src, const Fp8Tables& tb, uint16_t* dst) {
  const __m512i x = _mm512_loadu_si512(src);
  const __m512i lo = _mm512_permutex2var_epi8(tb.lo0, x, tb.lo1);  // the index's bit 7 (the sign) is ignored
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(tb.hi0, x, tb.hi1), x, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  alignas(64) static constexpr uint8_t idx[2][64] = {
      {0,  64, 1,  65, 2,  66, 3,  67, 4,  68, 5,  69, 6,  70, 7,  71, 8,  72, 9,  73, 10, 74,
       11, 75, 12, 76, 13, 77, 14, 78, 15, 79, 16, 80, 17, 81, 18, 82, 19, 83, 20, 84, 21, 85,
       22, 86, 23, 87, 24, 88, 25, 89, 26, 90, 27, 91, 28, 92, 29, 93, 30, 94, 31, 95},
      {32, 96,  33, 97,  34, 98,  35, 99,  36, 100, 37, 101, 38, 102, 39, 103, 40, 104, 41, 105, 42, 106,
       43, 107, 44, 108, 45, 109, 46, 110, 47, 111, 48, 112, 49, 113, 50, 114, 51, 115, 52, 116, 53, 117,
       54, 118, 55, 119, 56, 120, 57, 121, 58, 122, 59, 123, 60, 124, 61, 125, 62, 126, 63, 127}};
  _mm512_storeu_si512(dst, _mm512_permutex2var_epi8(lo, _mm512_load_si512(idx[0]), hi));
  _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi8(lo, _mm512_load_si512(idx[1]), hi));
}

inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// Scores of 16 tokens for one query head: lane t is q . k[t] (unscaled), by VDPBF16PS over bfloat16 K rows
// (exact products, float32 sums). q is given as NQ bfloat16 parts whose sum it is: one part for a bfloat16
// model's q (exact), three for a float32 q (exact to 2^-26 relative, float32 rounding).
template <int NK, int NQ>
inline __m512 scores16(const uint16_t* qp, int64_t part_stride, const uint16_t* const* krow) {
  __m512bh qv[NQ][NK];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NK; ++c) qv[i][c] = load_bh(qp + i * part_stride + 32 * c);
  __m512 a[16];
  for (int t = 0; t < 16; ++t) {
    __m512 s = _mm512_setzero_ps();
    for (int i = NQ - 1; i >= 0; --i)  // smallest part first
      for (int c = 0; c < NK; ++c) s = _mm512_dpbf16_ps(s, qv[i][c], load_bh(krow[t] + 32 * c));
    a[t] = s;
  }
  return sum16(a);
}

// acc[g][d0 .. d0+63] += sum over t < n of p[g][t] * v[t][d0 .. d0+63] for GC query heads at once: each V
// row is widened once for all of them (GC * 4 accumulators + 4 rows in registers).
template <int GC, typename T>
inline void pv_pass(const T* const* vrow, int64_t n, int64_t d0, const float* p, float* acc, int64_t D,
                    const char* pf_k, const char* pf_v, int64_t pf_stride, int64_t pf_bytes) {
  __m512 a[GC][4];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + d0 + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    if (pf_k != nullptr)
      for (int64_t c = 0; c < pf_bytes; c += 64) {
        _mm_prefetch(pf_k + t * pf_stride + c, _MM_HINT_T1);
        _mm_prefetch(pf_v + t * pf_stride + c, _MM_HINT_T1);
      }
    __m512 v[4];
    for (int c = 0; c < 4; ++c) v[c] = load16(vrow[t] + d0 + 16 * c);
    for (int g = 0; g < GC; ++g) {
      const __m512 pb = _mm512_set1_ps(p[g * 16 + t]);
      for (int c = 0; c < 4; ++c) a[g][c] = _mm512_fmadd_ps(pb, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * D + d0 + 16 * c, a[g][c]);
}

// Per-thread working memory of attend_item_bf16.
struct Bf16Work {
  std::vector<uint16_t> qp;  // [3, G, D] q as bfloat16 parts, largest first
  std::vector<uint16_t> kbuf;  // [16, D] fp8 K rows widened to bfloat16
  std::vector<float> p, lv;  // [G, 16] probabilities of the current 16 tokens; running sums, per lane
  Bf16Work(int64_t G, int64_t D) : qp(3 * G * D), kbuf(16 * D), p(G * 16), lv(G * 16) {}
};

// Scores may exceed the running max by this much before it is raised (and what was accumulated rescaled):
// the max only keeps exp() in range (p <= e^8 here), so most blocks skip the reduction and the rescale.
constexpr float kMaxSlack = 8.f;

// One (sequence, KV head h, split) item over a bfloat16 or fp8 KV cache, head dim D = 64 or 128,
// 16 tokens at a time: scores by VDPBF16PS and one reduction tree per query head, the softmax on whole
// vectors, and one V pass serving up to 4 query heads. q ([NQ, G, D] in w.qp) is unscaled; the scale is
// applied to the scores.
template <typename T, int D, int NQ>
void attend_item_bf16_impl(float scale, const T* k_cache, const T* v_cache, const int32_t* table, int64_t ctx,
                           int64_t j0, int64_t j1, int64_t G, int64_t h, int64_t BS, int64_t row_stride,
                           float* acc, float* m, float* l, Bf16Work& w) {
  constexpr int NK = D / 32;
  constexpr bool kFp8 = !std::is_same_v<T, at::BFloat16>;
  const Fp8Tables* tb = nullptr;
  if constexpr (kFp8) tb = &fp8_tables<T>();
  std::fill(w.lv.begin(), w.lv.end(), 0.f);
  const __m512 scale_v = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const uint16_t* krow[16];
  const T* vrow[16];
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t blk = table[j];
    const int64_t n = std::min(BS, ctx - j * BS);
    // blocks sit anywhere in the KV cache, so the hardware prefetcher can't follow: the V pass asks for the rows
    // two blocks ahead (into L2) a few lines per token (a burst of a whole block's lines at once stalls the
    // core on its miss buffers and leaves memory idle while the block computes: 1.34x slower in bf16 at
    // 32 x 512 x 30 layers; one block ahead 1.19x slower, three 1.02x, four 1.05x)
    constexpr int64_t pfd = 2;
    const char* pf_k = nullptr;
    const char* pf_v = nullptr;
    if (j + pfd < j1) {
      const int64_t nxt = table[j + pfd] * BS * row_stride + h * D;
      pf_k = reinterpret_cast<const char*>(k_cache + nxt);
      pf_v = reinterpret_cast<const char*>(v_cache + nxt);
    }
    constexpr int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
    const int64_t stride_bytes = row_stride * static_cast<int64_t>(sizeof(T));
    const T* kb = k_cache + blk * BS * row_stride + h * D;
    const T* vb = v_cache + blk * BS * row_stride + h * D;
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
      const int64_t nn = std::min<int64_t>(16, n - c0);
      // lanes past the context read the last valid row (never an unowned slot) and are masked to -inf
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t r = c0 + std::min(t, nn - 1);
        if constexpr (kFp8) {
          if (t < nn)
            for (int c = 0; c < D; c += 64) fp8x64_to_bf16(kb + r * row_stride + c, *tb, w.kbuf.data() + t * D + c);
          krow[t] = w.kbuf.data() + std::min(t, nn - 1) * D;
        } else {
          krow[t] = reinterpret_cast<const uint16_t*>(kb + r * row_stride);
        }
        vrow[t] = vb + r * row_stride;  // widened to float32 in the V pass
      }
      const __mmask16 valid = static_cast<__mmask16>((1u << nn) - 1);
      for (int64_t g = 0; g < G; ++g) {
        __m512 s = _mm512_mul_ps(scores16<NK, NQ>(w.qp.data() + g * D, G * D, krow), scale_v);
        s = _mm512_mask_blend_ps(valid, ninf, s);
        if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(m[g] + kMaxSlack), _CMP_GT_OQ)) {
          const float mx = _mm512_reduce_max_ps(s);
          const float alpha = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[g] - mx);
          m[g] = mx;
          const __m512 av = _mm512_set1_ps(alpha);
          _mm512_storeu_ps(w.lv.data() + g * 16, _mm512_mul_ps(av, _mm512_loadu_ps(w.lv.data() + g * 16)));
          for (int c = 0; c < D; c += 16) _mm512_storeu_ps(acc + g * D + c, _mm512_mul_ps(av, _mm512_loadu_ps(acc + g * D + c)));
        }
        const __m512 p = exp16(_mm512_sub_ps(s, _mm512_set1_ps(m[g])));
        _mm512_storeu_ps(w.p.data() + g * 16, p);
        _mm512_storeu_ps(w.lv.data() + g * 16, _mm512_add_ps(p, _mm512_loadu_ps(w.lv.data() + g * 16)));
      }
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
          const float* p = w.p.data() + g0 * 16;
          float* a = acc + g0 * D;
          // the first pass also asks for block j + pfd's rows c0 .. c0 + nn - 1, spread over its tokens
          const bool pf = pf_k != nullptr && d0 == 0 && g0 == 0;
          const char* pk = pf ? pf_k + c0 * stride_bytes : nullptr;
          const char* pv = pf ? pf_v + c0 * stride_bytes : nullptr;
          switch (std::min<int64_t>(4, G - g0)) {
            case 1: pv_pass<1>(vrow, nn, d0, p, a, D, pk, pv, stride_bytes, row_bytes); break;
            case 2: pv_pass<2>(vrow, nn, d0, p, a, D, pk, pv, stride_bytes, row_bytes); break;
            case 3: pv_pass<3>(vrow, nn, d0, p, a, D, pk, pv, stride_bytes, row_bytes); break;
            default: pv_pass<4>(vrow, nn, d0, p, a, D, pk, pv, stride_bytes, row_bytes); break;
          }
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) l[g] = _mm512_reduce_add_ps(_mm512_loadu_ps(w.lv.data() + g * 16));
}

// Splits q ([G, D] float32) into three bfloat16 parts (hi + mid + lo; each the rounding of what the
// previous ones leave) and runs the item on the first part alone where the others are all zero.
template <typename T, int D>
void attend_item_bf16(const float* q, float scale, const T* k_cache, const T* v_cache, const int32_t* table,
                      int64_t ctx, int64_t j0, int64_t j1, int64_t G, int64_t h, int64_t BS,
                      int64_t row_stride, float* acc, float* m, float* l, Bf16Work& w) {
  const int64_t n = G * D;
  __mmask16 rest = 0;
  for (int64_t i = 0; i < n; i += 16) {
    __m512 x = _mm512_loadu_ps(q + i);
    for (int part = 0; part < 3; ++part) {
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.qp.data() + part * n + i), b);
      x = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      if (part > 0) rest |= _mm256_test_epi16_mask(b, _mm256_set1_epi16(0x7FFF));
    }
  }
  if (rest)
    attend_item_bf16_impl<T, D, 3>(scale, k_cache, v_cache, table, ctx, j0, j1, G, h, BS, row_stride, acc, m, l, w);
  else
    attend_item_bf16_impl<T, D, 1>(scale, k_cache, v_cache, table, ctx, j0, j1, G, h, BS, row_stride, acc, m, l, w);
}
#endif  // AVX512-BF16 and VBMI
#endif

// Portable path: any head dim, compiler-vectorized loops.
template <typename T>
void attend_item_generic(const float* qs, const T* k_cache, const T* v_cache, const int32_t* table, int64_t ctx,
                         int64_t j0, int64_t j1, int64_t G, int64_t D, int64_t BS, int64_t row_stride, int64_t h,
                         float* acc, float* m, float* l, float* s, float* kf) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t blk = table[j];
    const int64_t n = std::min(BS, ctx - j * BS);
    const T* kb = k_cache + blk * BS * row_stride + h * D;
    const T* vb = v_cache + blk * BS * row_stride + h * D;
    for (int64_t t = 0; t < n; ++t) {
      row_to_float(kb + t * row_stride, kf, D);
      for (int64_t g = 0; g < G; ++g) s[g * BS + t] = dot(qs + g * D, kf, D);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * BS;
      const float alpha = advance_max(sg, n, &m[g]);
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = std::exp(sg[t] - m[g]);
        sum += sg[t];
      }
      l[g] = l[g] * alpha + sum;
      float* a = acc + g * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] *= alpha;
    }
    for (int64_t t = 0; t < n; ++t) {
      row_to_float(vb + t * row_stride, kf, D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * BS + t];
        float* a = acc + g * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) a[i] += p * kf[i];
      }
    }
  }
}

template <typename T>
void decode_kernel(const float* q,          // [B, Hq, D]
                   const T* k_cache,        // [NB, BS, Hkv, D]
                   const T* v_cache,        // [NB, BS, Hkv, D]
                   const int32_t* tables,   // [B, MB]
                   const int32_t* ctx_lens, // [B]
                   float* out,              // [B, Hq, D]
                   float* part_out,         // [B, Hkv, S, G, D] partial outputs (S > 1 only)
                   float* part_lse,         // [B, Hkv, S, G]
                   int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t MB, int64_t splits,
                   int64_t blocks_per_split, float scale) {
  const int64_t G = Hq / Hkv;
  const int64_t row_stride = Hkv * D;  // between consecutive slots of one head
  const int64_t threads = at::get_num_threads();
#if defined(PDSERVE_BF16_PATH)
  constexpr bool kBf16Path = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Float8_e5m2> ||
                             std::is_same_v<T, at::Float8_e4m3fn>;
  const bool bf16_path = kBf16Path && (D == 64 || D == 128);
#else
  const bool bf16_path = false;
#endif
  // An item is one KV head: items covering all of a sequence's heads (reading its blocks' rows whole)
  // measured slower, the prefetches of whole blocks outrunning what the cores keep in flight.
  const int64_t items = B * Hkv * splits;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> kf(D), s(BS * G), m(G), l(G), acc(G * D), qs(G * D);
#if defined(PDSERVE_BF16_PATH)
    Bf16Work work(bf16_path ? G : 0, bf16_path ? D : 0);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / (Hkv * splits);
      const int64_t h = (item / splits) % Hkv;
      const int64_t split = item % splits;
      const int64_t ctx = ctx_lens[b];
      const int64_t nblocks = (ctx + BS - 1) / BS;
      const int64_t j0 = split * blocks_per_split;
      const int64_t j1 = std::min(nblocks, j0 + blocks_per_split);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      const int32_t* table = tables + b * MB;
      if (bf16_path) {
#if defined(PDSERVE_BF16_PATH)
        if constexpr (kBf16Path) {
          const float* qr = q + (b * Hq + h * G) * D;  // [G, D], unscaled
          if (D == 64)
            attend_item_bf16<T, 64>(qr, scale, k_cache, v_cache, table, ctx, j0, j1, G, h, BS, row_stride, acc.data(), m.data(), l.data(), work);
          else
            attend_item_bf16<T, 128>(qr, scale, k_cache, v_cache, table, ctx, j0, j1, G, h, BS, row_stride, acc.data(), m.data(), l.data(), work);
        }
#endif
      } else {
        for (int64_t g = 0; g < G; ++g) {  // the query rows of this KV head, pre-scaled
          const float* qr = q + (b * Hq + h * G + g) * D;
          for (int64_t i = 0; i < D; ++i) qs[g * D + i] = qr[i] * scale;
        }
#if defined(__AVX512F__)
        if (D == 64)
          attend_item<T, 4>(qs.data(), k_cache, v_cache, table, ctx, j0, j1, G, BS, row_stride, h, acc.data(), m.data(), l.data(), s.data());
        else if (D == 128)
          attend_item<T, 8>(qs.data(), k_cache, v_cache, table, ctx, j0, j1, G, BS, row_stride, h, acc.data(), m.data(), l.data(), s.data());
        else
#endif
          attend_item_generic<T>(qs.data(), k_cache, v_cache, table, ctx, j0, j1, G, D, BS, row_stride, h, acc.data(),
                                 m.data(), l.data(), s.data(), kf.data());
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* a = acc.data() + g * D;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        if (splits == 1) {
          float* o = out + (b * Hq + h * G + g) * D;
          for (int64_t i = 0; i < D; ++i) o[i] = a[i] * inv;
        } else {
          const int64_t p = ((b * Hkv + h) * splits + split) * G + g;
          float* o = part_out + p * D;
          for (int64_t i = 0; i < D; ++i) o[i] = a[i] * inv;
          part_lse[p] = l[g] > 0.f ? m[g] + std::log(l[g]) : -std::numeric_limits<float>::infinity();
        }
      }
    }
    if (splits > 1) {
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < B * Hkv; ++bh) {
        const int64_t b = bh / Hkv, h = bh % Hkv;
        for (int64_t g = 0; g < G; ++g) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, part_lse[(bh * splits + sp) * G + g]);
          float* o = out + (b * Hq + h * G + g) * D;
          std::fill(o, o + D, 0.f);
          float total = 0.f;
          for (int64_t sp = 0; sp < splits; ++sp) {
            const int64_t p = (bh * splits + sp) * G + g;
            if (part_lse[p] == -std::numeric_limits<float>::infinity()) continue;
            const float w = std::exp(part_lse[p] - mx);
            total += w;
            const float* po = part_out + p * D;
            for (int64_t i = 0; i < D; ++i) o[i] += w * po[i];
          }
          const float inv = total > 0.f ? 1.f / total : 0.f;
          for (int64_t i = 0; i < D; ++i) o[i] *= inv;
        }
      }
    }
  }
}

// Returns [B, Hq, D] in q's dtype. q may be float32, bfloat16 or float16, any strides: it is widened into a
// contiguous float32 buffer here and the float32 result rounded back to q's dtype at the end, the same
// conversions (and bits) as q.float() and out.to(q.dtype), done in plain loops: as torch ops they were 6 ops
// a layer, each costing more in dispatch and allocation than its 18k elements take.
torch::Tensor paged_decode(torch::Tensor q_in,          // [B, Hq, D]
                           torch::Tensor k_cache,       // [NB, BS, Hkv, D]
                           torch::Tensor v_cache,       // [NB, BS, Hkv, D]
                           torch::Tensor block_tables,  // [B, MB] int32
                           torch::Tensor context_lens,  // [B] int32
                           double scale, int64_t splits) {
  TORCH_CHECK(q_in.dim() == 3, "q must be [B, Hq, D]");
  const auto q_dtype = q_in.scalar_type();
  TORCH_CHECK(q_dtype == at::kFloat || q_dtype == at::kBFloat16 || q_dtype == at::kHalf,
              "q must be float32, bfloat16 or float16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous [NB, BS, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(), "k/v cache mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2, "block_tables must be contiguous int32 [B, MB]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens must be contiguous int32 [B]");
  const int64_t B = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), MB = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "head geometry mismatch");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "batch mismatch");
  TORCH_CHECK(splits >= 1, "splits must be >= 1");
  const bool float_q = q_dtype == at::kFloat && q_in.is_contiguous();
  std::vector<float> q_buf(float_q ? 0 : B * Hq * D), out_buf(q_dtype == at::kFloat ? 0 : B * Hq * D);
  if (!float_q) {  // widen (and make contiguous) q
    const int64_t s0 = q_in.stride(0), s1 = q_in.stride(1), s2 = q_in.stride(2);
    auto widen = [&](auto tag) {
      using S = decltype(tag);
      const S* src = q_in.data_ptr<S>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t d = 0; d < D; ++d) q_buf[(b * Hq + h) * D + d] = to_float(src[b * s0 + h * s1 + d * s2]);
    };
    if (q_dtype == at::kFloat) widen(float());
    else if (q_dtype == at::kBFloat16) widen(at::BFloat16());
    else widen(at::Half());
  }
  const float* q = float_q ? q_in.data_ptr<float>() : q_buf.data();
  auto result = torch::empty({B, Hq, D}, q_in.options().dtype(q_dtype));
  float* outp = q_dtype == at::kFloat ? result.data_ptr<float>() : out_buf.data();
  const auto f32 = q_in.options().dtype(at::kFloat);
  const int64_t blocks_per_split = std::max<int64_t>(1, (MB + splits - 1) / splits);
  splits = std::max<int64_t>(1, (MB + blocks_per_split - 1) / blocks_per_split);
  torch::Tensor part_out, part_lse;
  float *po = nullptr, *pl = nullptr;
  if (splits > 1) {
    part_out = torch::empty({B * Hkv * splits * (Hq / Hkv) * D}, f32);
    part_lse = torch::empty({B * Hkv * splits * (Hq / Hkv)}, f32);
    po = part_out.data_ptr<float>();
    pl = part_lse.data_ptr<float>();
  }
  const auto* tp = block_tables.data_ptr<int32_t>();
  const auto* cp = context_lens.data_ptr<int32_t>();
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      decode_kernel<float>(q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, cp,
                           outp, po, pl, B, Hq, Hkv, D, BS, MB, splits, blocks_per_split, scale);
      break;
    case at::kBFloat16:
      decode_kernel<at::BFloat16>(q, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                                  tp, cp, outp, po, pl, B, Hq, Hkv, D, BS, MB, splits, blocks_per_split, scale);
      break;
    case at::kHalf:
      decode_kernel<at::Half>(q, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), tp, cp,
                              outp, po, pl, B, Hq, Hkv, D, BS, MB, splits, blocks_per_split, scale);
      break;
    case at::kFloat8_e5m2:
      decode_kernel<at::Float8_e5m2>(q, k_cache.data_ptr<at::Float8_e5m2>(),
                                     v_cache.data_ptr<at::Float8_e5m2>(), tp, cp, outp, po, pl, B, Hq,
                                     Hkv, D, BS, MB, splits, blocks_per_split, scale);
      break;
    case at::kFloat8_e4m3fn:
      decode_kernel<at::Float8_e4m3fn>(q, k_cache.data_ptr<at::Float8_e4m3fn>(),
                                       v_cache.data_ptr<at::Float8_e4m3fn>(), tp, cp, outp, po, pl, B,
                                       Hq, Hkv, D, BS, MB, splits, blocks_per_split, scale);
      break;
    default:
      TORCH_CHECK(false, "unsupported cache dtype ", k_cache.scalar_type());
  }
  auto round_out = [&](auto tag) {
    using W = decltype(tag);
    W* o = result.data_ptr<W>();
    for (int64_t i = 0; i < B * Hq * D; ++i) o[i] = half_round<W>(out_buf[i]);
  };
  if (q_dtype == at::kBFloat16) round_out(at::BFloat16());
  else if (q_dtype == at::kHalf) round_out(at::Half());
  return result;
}

// This step's K and V rows into their cache slots, as raw bytes (the caller has rounded them to the KV cache's
// dtype): k_cache.view(NB * BS, Hkv * D)[slots[i]] = key[i], the same for V; slot -1 is skipped. One call
// per layer with a memcpy per row, where masking and two index_copy_ calls cost about 100 us a layer in
// operator dispatch at 32 decode tokens, for 24 KB of rows.
template <typename S>
void store_rows(const char* key, const char* value, int64_t key_stride, int64_t value_stride, char* k_cache,
                char* v_cache, const S* slots, int64_t n, int64_t num_slots, int64_t row_bytes) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = slots[i];
    if (s < 0) continue;
    TORCH_CHECK(s < num_slots, "slot ", s, " is outside the KV cache's ", num_slots, " slots");
    std::memcpy(k_cache + s * row_bytes, key + i * key_stride, row_bytes);
    std::memcpy(v_cache + s * row_bytes, value + i * value_stride, row_bytes);
  }
}

void store_kv(torch::Tensor key,           // [N, Hkv, D], the KV cache's dtype; rows of Hkv * D contiguous elements
              torch::Tensor value,         // [N, Hkv, D], likewise
              torch::Tensor k_cache,       // [NB, BS, Hkv, D]
              torch::Tensor v_cache,       // [NB, BS, Hkv, D]
              torch::Tensor slot_mapping)  // [N] int32 or int64; -1 = skip
{
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be a contiguous [NB, BS, Hkv, D] pair");
  const int64_t n = slot_mapping.size(0), h = k_cache.size(2), d = k_cache.size(3);
  for (const auto& t : {key, value}) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == n && t.size(1) == h && t.size(2) == d, "key/value must be [N, Hkv, D]");
    TORCH_CHECK(t.scalar_type() == k_cache.scalar_type(), "key/value must have the KV cache's dtype");
    TORCH_CHECK(n == 0 || (t.stride(2) == 1 && t.stride(1) == d), "key/value rows must be contiguous");
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous(), "slot_mapping must be contiguous [N]");
  const int64_t es = k_cache.element_size();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  auto* kp = static_cast<const char*>(key.data_ptr());
  auto* vp = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  if (slot_mapping.scalar_type() == at::kLong)
    store_rows(kp, vp, key.stride(0) * es, value.stride(0) * es, kc, vc, slot_mapping.data_ptr<int64_t>(), n,
               num_slots, h * d * es);
  else if (slot_mapping.scalar_type() == at::kInt)
    store_rows(kp, vp, key.stride(0) * es, value.stride(0) * es, kc, vc, slot_mapping.data_ptr<int32_t>(), n,
               num_slots, h * d * es);
  else
    TORCH_CHECK(false, "slot_mapping must be int32 or int64");
}

// ---------------------------------------------------------------------------------------------------
// Small per-step ops of the model and the sampler, each the same bits as the torch ops it replaces, in one
// call instead of several (at a decode step's 32 rows each torch op costs more in dispatch than in work).


// out[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin[i] for one row, every product and the sum rounded to the
// element type as torch's x * cos, cat(x2, x1) * sin and add_ round them (bfloat16: each op's float32 result
// rounded; float32: no fused multiply-add, which the attribute forbids here: g++ contracts a * b + c in C++
// by default, and a lambda would not inherit the attribute, hence a function per row).
template <typename T>
__attribute__((optimize("fp-contract=off"), noinline)) void rotary_row(const T* xr, const T* c, const T* s, T* o,
                                                                        int64_t D) {
  const int64_t half = D / 2;
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) {
      const float a = xr[i] * c[i];
      const float b = xr[i < half ? i + half : i - half] * s[i];
      o[i] = a + b;
    }
  } else {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(xr);
    const uint16_t* cb = reinterpret_cast<const uint16_t*>(c);
    const uint16_t* sb = reinterpret_cast<const uint16_t*>(s);
    uint16_t* ob = reinterpret_cast<uint16_t*>(o);
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) {
      const float a = bf16_float(bf16_bits(bf16_float(xb[i]) * bf16_float(cb[i])));
      const float b = bf16_float(bf16_bits(bf16_float(xb[i < half ? i + half : i - half]) * bf16_float(sb[i])));
      ob[i] = bf16_bits(a + b);
    }
  }
}

template <typename T>
void rotary_rows(const T* x, const T* cs, const T* sn, T* out, int64_t T_, int64_t H, int64_t D, int64_t xs_t,
                 int64_t xs_h, int64_t cs_t) {
  at::parallel_for(0, T_ * H, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t t = r / H, h = r % H;
      rotary_row<T>(x + t * xs_t + h * xs_h, cs + t * cs_t, sn + t * cs_t, out + r * D, D);
    }
  });
}

torch::Tensor rotary(torch::Tensor x,     // [T, H, D] float32 or bfloat16, unit last stride
                     torch::Tensor cos,   // [T, D] or [T, 1, D], x's dtype, unit last stride
                     torch::Tensor sin) { // the same
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, H, D] with unit last stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "head dim must be even");
  auto table = [&](const torch::Tensor& t, const char* name) {
    torch::Tensor v = t.dim() == 3 ? t.select(1, 0) : t;
    TORCH_CHECK(v.dim() == 2 && v.size(0) == T_ && v.size(1) == D && v.stride(1) == 1 &&
                    v.scalar_type() == x.scalar_type(), name, " must be [T, D] or [T, 1, D] in x's dtype");
    return v;
  };
  const torch::Tensor c = table(cos, "cos"), s = table(sin, "sin");
  TORCH_CHECK(c.stride(0) == s.stride(0), "cos and sin must have the same row stride");
  auto out = torch::empty({T_, H, D}, x.options());
  if (x.scalar_type() == at::kFloat)
    rotary_rows<float>(x.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), out.data_ptr<float>(), T_, H,
                       D, x.stride(0), x.stride(1), c.stride(0));
  else
    rotary_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(),
                              out.data_ptr<at::BFloat16>(), T_, H, D, x.stride(0), x.stride(1), c.stride(0));
  return out;
}

// Row scans of [V] float32 for the sampler's ops: the largest value and whether a NaN occurs; the first
// index at which `hit` holds. AVX-512: 16 lanes a step with masked tails; else compiler-vectorized loops.
inline float row_max(const float* row, int64_t V, bool* nan) {
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 unord = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = V - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (V - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, row + i);
    mx = _mm512_mask_max_ps(mx, m, mx, v);
    unord |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
  }
  *nan = unord != 0;
  return _mm512_reduce_max_ps(mx);
#else
  float mx = -std::numeric_limits<float>::infinity();
  int64_t nans = 0;
#pragma omp simd reduction(max : mx) reduction(+ : nans)
  for (int64_t i = 0; i < V; ++i) {
    mx = std::max(mx, row[i]);
    nans += row[i] != row[i];
  }
  *nan = nans != 0;
  return mx;
#endif
}

// First index of `target` in row (NaN target: of the first NaN); V if none.
inline int64_t row_find(const float* row, int64_t V, float target) {
  const bool nan = target != target;
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(target);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = V - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (V - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, row + i);
    const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q) : _mm512_mask_cmp_ps_mask(m, v, t, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return V;
#else
  for (int64_t i = 0; i < V; ++i)
    if (nan ? row[i] != row[i] : row[i] == target) return i;
  return V;
#endif
}

// Row-wise argmax of [N, V] float32: the first index of the largest value, or of the first NaN (torch's
// argmax rule), rows in parallel.
torch::Tensor argmax_rows(torch::Tensor x) {  // [N, V] float32, contiguous -> [N] int64
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "x must be contiguous float32 [N, V], V > 0");
  const int64_t N = x.size(0), V = x.size(1);
  auto out = torch::empty({N}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      bool nan = false;
      const float mx = row_max(xp + r * V, V, &nan);
      op[r] = row_find(xp + r * V, V, nan ? std::numeric_limits<float>::quiet_NaN() : mx);
    }
  });
  return out;
}

// The k largest values of each row of [N, V] float32 and their indices, in descending order of value; equal
// values in ascending order of index (so of two equal candidates for the last place, the lower index wins).
// Values that cannot enter (not above the current k-th) are skipped 16 at a time. Returns empty tensors when
// a row holds a NaN (the caller then uses torch.topk, which ranks NaN first).
std::vector<torch::Tensor> topk_rows(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [N, V]");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "k must be in [1, V]");
  auto values = torch::empty({N, k}, x.options());
  auto indices = torch::empty({N, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  std::atomic<bool> any_nan{false};
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = xp + r * V;
      float* bv = vp + r * k;
      int64_t* bi = ip + r * k;
      int64_t n = 0;  // entries held, sorted: value descending, index ascending among equals
      auto insert = [&](float v, int64_t i) {
        int64_t pos = n < k ? n : k - 1;  // full: the smallest leaves
        while (pos > 0 && bv[pos - 1] < v) {
          bv[pos] = bv[pos - 1];
          bi[pos] = bi[pos - 1];
          --pos;
        }
        bv[pos] = v;
        bi[pos] = i;
        n = std::min(n + 1, k);
      };
      bool nan = false;
      int64_t i = 0;
      for (; i < k; ++i) {
        nan = nan || row[i] != row[i];
        insert(row[i], i);
      }
#if defined(__AVX512F__)
      for (; i < V; i += 16) {
        const __mmask16 m = V - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (V - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(m, row + i);
        nan = nan || _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q) != 0;
        for (__mmask16 hit = _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(bv[k - 1]), _CMP_GT_OQ); hit;
             hit &= hit - 1) {
          const int64_t j = i + __builtin_ctz(hit);
          if (row[j] > bv[k - 1]) insert(row[j], j);  // the k-th may have risen within these 16
        }
      }
#else
      for (; i < V; ++i) {
        nan = nan || row[i] != row[i];
        if (row[i] > bv[k - 1]) insert(row[i], i);
      }
#endif
      if (nan) any_nan = true;
    }
  });
  if (any_nan) return {torch::empty({0}, x.options()), torch::empty({0}, x.options().dtype(at::kLong))};
  return {values, indices};
}

// The two elementwise stages of a decoder layer around its GEMMs, for half-precision weights, one call each
// instead of the 10-16 torch ops (and as many parallel regions) they take in eager mode. They round at the
// same points as the torch ops; rms_norm_half gives their bits, silu_mul's e^x differs (see each).

#if defined(__AVX512F__)
// 16 floats rounded to W's bits (bfloat16: bf16_bits' rounding, NaN to a quiet NaN; float16: F16C's round to
// nearest even, as c10::Half), and back.
template <typename W>
inline __m256i round16(__m512 f) {
  if constexpr (std::is_same_v<W, at::BFloat16>) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  } else {
    return _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}
template <typename W>
inline __m512 widen16(__m256i bits) {
  if constexpr (std::is_same_v<W, at::BFloat16>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  else
    return _mm512_cvtph_ps(bits);
}
#endif

// sum(x[i]^2) over a float32 row in the order torch's sum kernel adds a contiguous row (its cascade sum),
// so the norm's scale has torch's bits: the row read as vectors of L lanes (L: the width torch's reduction
// kernels use on this CPU, which CpuOps finds by comparing with torch when it starts); vector v goes to
// accumulator v % 4, the accumulators summed in levels of 2^p vectors (p = max(4, ceil(log2(n / 4L)) / 4)
// so that only sums of similar size meet; the four then added in order, the tail elements and the L lanes
// one by one. Rows shorter than L are the same with L = 1. No fused multiply-add: each square and each sum
// is rounded, as torch's pow(2) and sum round them.
template <int L>
__attribute__((optimize("fp-contract=off"), noinline)) float torch_order_sum_sq(const float* x, int64_t n) {
  constexpr int64_t kLevels = 4;
  const int64_t nv = n / L, rows = nv / 4;  // whole vectors; rows of 4 of them
  int64_t clog = 1;
  if (rows > 2) clog = 64 - __builtin_clzll(static_cast<uint64_t>(rows - 1));
  const int64_t lp = std::max<int64_t>(4, clog / kLevels), step = int64_t(1) << lp, mask = step - 1;
  float acc[kLevels][4][L] = {};
  auto add_row = [&](int64_t i) {
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < L; ++l) {
        const float v = x[(i * 4 + k) * L + l];
        const float sq = v * v;
        acc[0][k][l] = acc[0][k][l] + sq;
      }
  };
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int64_t lev = 1; lev < kLevels; ++lev) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < L; ++l) {
          acc[lev][k][l] = acc[lev][k][l] + acc[lev - 1][k][l];
          acc[lev - 1][k][l] = 0.f;
        }
      if ((i & (mask << (lev * lp))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int64_t lev = 1; lev < kLevels; ++lev)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] = acc[0][k][l] + acc[lev][k][l];
  for (int64_t v = rows * 4; v < nv; ++v)  // vectors past the rows of 4
    for (int l = 0; l < L; ++l) {
      const float sq = x[v * L + l] * x[v * L + l];
      acc[0][0][l] = acc[0][0][l] + sq;
    }
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < L; ++l) acc[0][0][l] = acc[0][0][l] + acc[0][k][l];
  float total = 0.f;
  for (int64_t e = nv * L; e < n; ++e) {
    const float sq = x[e] * x[e];
    total = total + sq;
  }
  for (int l = 0; l < L; ++l) total = total + acc[0][0][l];
  return total;
}

inline float torch_order_sum_sq(const float* x, int64_t n, int64_t lanes) {
  if (n < lanes) return torch_order_sum_sq<1>(x, n);
  return lanes == 16 ? torch_order_sum_sq<16>(x, n) : torch_order_sum_sq<8>(x, n);
}

// One row of rms_norm_half: x += add (float32, as torch's h.add_(a) rounds it), then
// out = round(round(x * r) * w) with r = 1 / sqrt(sum(x^2) / H + eps), each rounding to W as torch's
// .to(W).mul_(w) does.
template <typename W, typename A>
inline void rms_norm_row(float* __restrict x, const A* __restrict add, const W* __restrict w, W* __restrict out,
                         int64_t H, float eps, int64_t lanes) {
  if (add != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) x[i] = x[i] + to_float(add[i]);
  }
  const float mean = torch_order_sum_sq(x, H, lanes) / static_cast<float>(H);
  const float r = 1.f / std::sqrt(mean + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = half_round<W>(to_float(half_round<W>(x[i] * r)) * to_float(w[i]));
}

template <typename W, typename A>
void rms_norm_rows(float* x, int64_t xs, const A* add, int64_t as, const W* w, W* out, int64_t T_, int64_t H, float eps,
                   int64_t lanes) {
  at::parallel_for(0, T_, std::max<int64_t>(1, 8192 / std::max<int64_t>(H, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      rms_norm_row<W, A>(x + t * xs, add == nullptr ? nullptr : add + t * as, w, out + t * H, H, eps, lanes);
  });
}

// The float32 sums of squares of x's rows [T, H] in torch_order_sum_sq's order for `lanes` (8 or 16), for
// CpuOps to find the width at which they equal torch's x.pow(2).sum(-1).
torch::Tensor sum_sq_rows(torch::Tensor x, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous [T, H] float32");
  TORCH_CHECK(lanes == 8 || lanes == 16, "lanes must be 8 or 16");
  auto out = torch::empty({x.size(0)}, x.options());
  for (int64_t t = 0; t < x.size(0); ++t)
    out.data_ptr<float>()[t] = torch_order_sum_sq(x.data_ptr<float>() + t * x.size(1), x.size(1), lanes);
  return out;
}

torch::Tensor rms_norm_half(torch::Tensor x,                     // [T, H] float32, unit last stride; changed
                            c10::optional<torch::Tensor> add,    // [T, H] float32 or weight's dtype, or None
                            torch::Tensor weight,                // [H] float32, bfloat16 or float16, contiguous
                            double eps,
                            int64_t lanes) {                     // -> [T, H] in weight's dtype
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "x must be [T, H] float32 with unit last stride");
  const int64_t T_ = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf ||
                   weight.scalar_type() == at::kFloat),
              "weight must be [H] float32, bfloat16 or float16, contiguous");
  const bool has_add = add.has_value() && add->defined();
  if (has_add)
    TORCH_CHECK(add->dim() == 2 && add->size(0) == T_ && add->size(1) == H && add->stride(1) == 1 &&
                    (add->scalar_type() == at::kFloat || add->scalar_type() == weight.scalar_type()),
                "add must be [T, H] with unit last stride, float32 or the weight's dtype");
  auto out = torch::empty({T_, H}, weight.options());
  TORCH_CHECK(lanes == 8 || lanes == 16, "lanes must be 8 or 16");
  const float e = static_cast<float>(eps);
  auto run = [&](auto w_tag) {
    using W = decltype(w_tag);
    const W* w = weight.data_ptr<W>();
    W* o = out.data_ptr<W>();
    if (!has_add)
      rms_norm_rows<W, float>(x.data_ptr<float>(), x.stride(0), nullptr, 0, w, o, T_, H, e, lanes);
    else if (add->scalar_type() == at::kFloat)
      rms_norm_rows<W, float>(x.data_ptr<float>(), x.stride(0), add->data_ptr<float>(), add->stride(0), w, o, T_, H, e, lanes);
    else
      rms_norm_rows<W, W>(x.data_ptr<float>(), x.stride(0), add->data_ptr<W>(), add->stride(0), w, o, T_, H, e, lanes);
  };
  if (weight.scalar_type() == at::kBFloat16) run(at::BFloat16());
  else if (weight.scalar_type() == at::kHalf) run(at::Half());
  else run(float());  // half_round<float> is the identity: torch's (x * r) * w in float32
  return out;
}

// silu(gate) * up for the rows of a fused gate|up projection in a half-precision dtype: silu in float32 as
// x / (1 + e^-x) rounded to the dtype, then the product rounded, as torch's F.silu(g).mul_(u) rounds. e^-x is
// exp16's (about a float32 ulp from torch's), so a rounded silu differs by one ulp in rare elements.
template <typename W>
void silu_mul_rows(const W* g, int64_t gs, W* out, int64_t T_, int64_t I) {
  at::parallel_for(0, T_, std::max<int64_t>(1, 8192 / std::max<int64_t>(I, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const W* gate = g + t * gs;
      const W* up = gate + I;
      W* o = out + t * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= I; i += 16) {
        const __m512 x = load16(gate + i);
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        const __m512 p = _mm512_mul_ps(widen16<W>(round16<W>(s)), load16(up + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), round16<W>(p));
      }
#endif
      for (; i < I; ++i) {
        const float x = to_float(gate[i]);
        o[i] = half_round<W>(to_float(half_round<W>(x / (1.f + std::exp(-x)))) * to_float(up[i]));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {  // [T, 2I] bfloat16 or float16, unit last stride -> [T, I]
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0 &&
                  (gate_up.scalar_type() == at::kBFloat16 || gate_up.scalar_type() == at::kHalf),
              "gate_up must be [T, 2I] bfloat16 or float16 with unit last stride");
  const int64_t T_ = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T_, I}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16)
    silu_mul_rows<at::BFloat16>(gate_up.data_ptr<at::BFloat16>(), gate_up.stride(0), out.data_ptr<at::BFloat16>(), T_, I);
  else
    silu_mul_rows<at::Half>(gate_up.data_ptr<at::Half>(), gate_up.stride(0), out.data_ptr<at::Half>(), T_, I);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over a CPU KV cache, blocks read in place");
  m.def("store_kv", &store_kv, "this step's K/V rows into their CPU cache slots");
  m.def("rotary", &rotary, "rotate-half RoPE of [T, H, D] rows, the same bits as the torch ops");
  m.def("argmax_rows", &argmax_rows, "row-wise argmax of [N, V] float32, torch's ties and NaN rule");
  m.def("rms_norm_half", &rms_norm_half, "x += add, then RMSNorm of float32 rows times float32 or half-precision weights");
  m.def("sum_sq_rows", &sum_sq_rows, "row sums of squares in torch's cascade-sum order at a vector width");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of fused [T, 2I] half-precision rows");
  m.def("topk_rows", &topk_rows, "the k largest of each row of [N, V] float32, sorted; lower index wins ties");
}
