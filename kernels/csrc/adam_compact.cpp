// Fused Adam/AdamW step over compact optimizer states, one pass over memory:
//
//   bf16: master, exp_avg, exp_avg_sq in bf16; master and exp_avg_sq stored back with
//         stochastic rounding, exp_avg rounded to nearest;
//   int8: master in bf16 (stochastic rounding), exp_avg and exp_avg_sq as one byte per
//         element plus one fp32 scale per block of 256 elements (codes in compact.py).
//
// The fp32 arithmetic is that of adam.cpp, in the same order, without FMA
// (-ffp-contract=off); the forms, the random bits and the codes are defined in
// infinity/kernels/compact.py, and reference_compact.py computes the same bits
// in torch ops. Every element's random bits are a hash of (step keys, index),
// so results depend neither on threads nor on chunking.
//
// The work goes block by block (256 elements), prefetching two blocks ahead:
// the gradient block is widened to fp32 in L1; a first loop reads the states and
// does the fp32 step into L1 buffers (int8: while it takes the block's maxima);
// a second loop hashes, rounds and writes master and moments (int8: codes and
// scales); then the parameter copy. Two bodies do this: the generic one, plain
// C++ loops with no branches and restrict pointers, which GCC and clang
// vectorize for whatever -march=native allows (AVX2, AVX-512, NEON; they need
// -fno-trapping-math), and on x86 CPUs with AVX2 the AVX2 body, the same steps
// in intrinsics for whole blocks, 1.4x (bf16) and 1.9x (int8) faster in cache.
// The body is chosen at run time (isa.h); a tensor's last, partial block always
// takes the generic one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "isa.h"

namespace infinity_kernels {
namespace {

using BF16 = c10::BFloat16;
using F16 = c10::Half;

constexpr int64_t kBlock = 256;  // compact.BLOCK_NUMEL
constexpr int64_t kMinChunk = 1 << 12;
constexpr int64_t kMaxChunk = 1 << 16;
constexpr int64_t kChunksPerThread = 8;
constexpr int64_t kGrainElems = 1 << 15;

struct NoOut {};
enum class Decay { kNone, kDecoupled, kL2 };

struct Consts {
  float decay, l2, coeff, beta2, beta2_complement, bc2_sqrt, neg_step, eps;
  bool base_is_avg;
  uint32_t avg_mask;  // all ones when base_is_avg, else 0
  uint32_t k0, k1;  // the step's keys (compact.step_keys)
};

inline uint32_t f2u(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline float u2f(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// compact._mix32: "lowbias32", a bijective 32-bit hash.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// compact.bf16_stochastic_round: add 16 random bits below the cut, truncate.
inline uint16_t bf16_sr(float x, uint32_t r16) {
  const uint32_t u = f2u(x);
  const uint32_t rounded = (u + r16) >> 16;
  const uint32_t special = (x != x) ? 0xFFFFu : (u >> 16);  // NaN -> 0xFFFF, inf stays
  return static_cast<uint16_t>(((u & 0x7F800000u) == 0x7F800000u) ? special : rounded);
}

// Round to nearest even (NaN -> 0xFFFF, as torch's vectorized cast).
inline uint16_t bf16_rne(float x) {
  const uint32_t u = f2u(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((x != x) ? 0xFFFFu : rounded);
}

inline float bf16_to_f(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

// compact.encode_unit: y in [0, 1] as E exponent and MB mantissa bits, nearest even.
// The code's exponent 0 is the fp32 exponent field kField; below 2**kMinExp, codes
// are evenly spaced (subnormal).
template <int E, int MB>
struct Code {
  static constexpr int kMantissaBits = MB;
  static constexpr uint32_t kField = 127u - ((1u << E) - 1u);
  static constexpr int kMinExp = 2 - (1 << E);
  static constexpr float kSubScale = static_cast<float>(1 << (MB - kMinExp));  // 2**(MB - kMinExp)
  static constexpr float kMinNormal = 1.0f / static_cast<float>(1 << -kMinExp);

  static uint32_t encode(float y) {
    constexpr int kDrop = 23 - MB;
    const uint32_t u = f2u(y);
    const uint32_t r = u + ((1u << (kDrop - 1)) - 1u) + ((u >> kDrop) & 1u);
    const uint32_t normal = (r >> kDrop) - (kField << MB);
    // Below 2**kMinExp: the integer nearest y * kSubScale (<= 2**MB): adding 2**23
    // rounds it to an integer (halves to even, in the default rounding mode),
    // which then sits in the low mantissa bits.
    const uint32_t sub = f2u(y * kSubScale + 8388608.0f) - 0x4B000000u;
    // A bit select, not `?:`, so the compiler computes both and does not branch.
    const uint32_t below = 0u - static_cast<uint32_t>(y < kMinNormal);
    return (sub & below) | (normal & ~below);
  }

  static float decode(uint32_t c) {
    const float normal = u2f((c + (kField << MB)) << (23 - MB));
    // c < 2**MB as a float (exactly): 2**23 + c, less 2**23.
    const float sub = (u2f(0x4B000000u | c) - 8388608.0f) * (1.0f / kSubScale);
    const uint32_t below = 0u - static_cast<uint32_t>(c < (1u << MB));  // a bit select, as above
    return u2f((f2u(sub) & below) | (f2u(normal) & ~below));
  }
};

using AvgCode = Code<3, 4>;    // compact.EXP_AVG_CODE, after the sign bit
using SqrtCode = Code<2, 6>;   // compact.EXP_AVG_SQ_CODE

// A block of gradients widened to fp32 (exact).
inline void widen(const float* __restrict__ g, float* __restrict__ out, int64_t len) {
  for (int64_t j = 0; j < len; ++j) out[j] = g[j];
}
inline void widen(const BF16* __restrict__ g, float* __restrict__ out, int64_t len) {
  const uint16_t* __restrict__ h = reinterpret_cast<const uint16_t*>(g);
  for (int64_t j = 0; j < len; ++j) out[j] = bf16_to_f(h[j]);
}
inline void widen(const F16* __restrict__ g, float* __restrict__ out, int64_t len) {
  int64_t j = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; j + 8 <= len; j += 8) {
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + j))));
  }
  for (; j < len; ++j) {
    uint16_t h;
    std::memcpy(&h, g + j, sizeof(h));
    out[j] = _cvtsh_ss(h);
  }
#else
  for (; j < len; ++j) out[j] = static_cast<float>(g[j]);
#endif
}

// The parameter copy from the new master's bf16 bits: equal to master.to(dtype).
inline void write_out(NoOut*, const uint16_t*, int64_t) {}
inline void write_out(BF16* __restrict__ out, const uint16_t* __restrict__ bits, int64_t len) {
  std::memcpy(out, bits, len * sizeof(uint16_t));
}
inline void write_out(float* __restrict__ out, const uint16_t* __restrict__ bits, int64_t len) {
  for (int64_t j = 0; j < len; ++j) out[j] = bf16_to_f(bits[j]);
}
inline void write_out(F16* __restrict__ out, const uint16_t* __restrict__ bits, int64_t len) {
  int64_t j = 0;
#if defined(__F16C__) && defined(__AVX2__)
  for (; j + 8 <= len; j += 8) {
    const __m256i u = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + j))), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm256_cvtps_ph(_mm256_castsi256_ps(u), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; j < len; ++j) {
    const uint16_t h = _cvtss_sh(bf16_to_f(bits[j]), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    std::memcpy(out + j, &h, sizeof(h));
  }
#else
  for (; j < len; ++j) out[j] = F16(bf16_to_f(bits[j]));
#endif
}

// The fp32 step of one element (adam.cpp's order); returns the new master, sets m, v.
template <Decay D>
inline float adam_fp32(const Consts& c, float param, float grad, float& avg, float& sq, float& root) {
  if constexpr (D == Decay::kDecoupled) param = param * c.decay;
  if constexpr (D == Decay::kL2) grad = grad + param * c.l2;
  // base_is_avg ? avg : grad, as a bit select (a scalar condition would stop vectorization)
  const float base = u2f((f2u(avg) & c.avg_mask) | (f2u(grad) & ~c.avg_mask));
  avg = base + c.coeff * (grad - avg);
  sq = sq * c.beta2 + (c.beta2_complement * grad) * grad;
  root = std::sqrt(sq);
  const float denom = root / c.bc2_sqrt + c.eps;
  return param + (c.neg_step * avg) / denom;
}

// Each block runs in two loops over L1 buffers: the fp32 step, then hashing,
// rounding and stores (one loop with both measured the same; two keep each simple).

// Elements [base, base + len) of one block, bf16 states.
template <Decay D, class G, class O>
void block_bf16(const Consts& c, int64_t base, int64_t len, uint16_t* __restrict__ p,
                const G* __restrict__ g, uint16_t* __restrict__ m, uint16_t* __restrict__ v,
                O* __restrict__ out) {
  alignas(64) float gbuf[kBlock];
  alignas(64) float pbuf[kBlock];
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  widen(g, gbuf, len);
  for (int64_t j = 0; j < len; ++j) {
    float avg = bf16_to_f(m[j]), sq = bf16_to_f(v[j]), root;
    pbuf[j] = adam_fp32<D>(c, bf16_to_f(p[j]), gbuf[j], avg, sq, root);
    mbuf[j] = avg;
    vbuf[j] = sq;
  }
  const uint32_t lo = static_cast<uint32_t>(base) + c.k0;
  const uint32_t hk = mix32(static_cast<uint32_t>(static_cast<uint64_t>(base) >> 32) + c.k1);
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t h = mix32((lo + static_cast<uint32_t>(j)) ^ hk);  // compact.random_bits
    p[j] = bf16_sr(pbuf[j], h >> 16);
    m[j] = bf16_rne(mbuf[j]);
    v[j] = bf16_sr(vbuf[j], h & 0xFFFFu);
  }
  write_out(out, p, len);
}

// Elements [base, base + len) of one block, int8 moments with one scale each.
template <Decay D, class G, class O>
void block_int8(const Consts& c, int64_t base, int64_t len, uint16_t* __restrict__ p,
                const G* __restrict__ g, uint8_t* __restrict__ m, uint8_t* __restrict__ v,
                float* __restrict__ m_scale, float* __restrict__ v_scale, O* __restrict__ out) {
  alignas(64) float gbuf[kBlock];
  alignas(64) float pbuf[kBlock];
  alignas(64) float mbuf[kBlock];
  alignas(64) float rbuf[kBlock];
  widen(g, gbuf, len);
  const float ms = *m_scale, vs = *v_scale;
  // The block's largest |m| and sqrt(v) as bit patterns (ordered like the
  // non-negative floats they are); NaN counts as 0.
  uint32_t m_max = 0, r_max = 0;
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t mc = m[j];
    // The sign bit of the code onto the decoded magnitude (= -mag when set).
    float avg = u2f(f2u(AvgCode::decode(mc & 127u)) | ((mc & 128u) << 24)) * ms;
    const float r_old = SqrtCode::decode(v[j]) * vs;
    float sq = r_old * r_old, root;
    pbuf[j] = adam_fp32<D>(c, bf16_to_f(p[j]), gbuf[j], avg, sq, root);
    mbuf[j] = avg;
    rbuf[j] = root;
    const float am = std::fabs(avg), ar = std::fabs(root);
    const uint32_t bm = f2u(am) & (0u - static_cast<uint32_t>(am == am));
    const uint32_t br = f2u(ar) & (0u - static_cast<uint32_t>(ar == ar));
    m_max = std::max(m_max, bm);
    r_max = std::max(r_max, br);
  }
  const float m_new = u2f(m_max), r_new = u2f(r_max);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float m_inv = (m_new > 0.0f && m_new < kInf) ? 1.0f / m_new : 0.0f;
  const float r_inv = (r_new > 0.0f && r_new < kInf) ? 1.0f / r_new : 0.0f;
  // compact.random_bits16_shared: elements j and j + 8 of each group of 16
  // share hash number base / 2 + (j >> 4) * 8 + (j & 7) (base is a multiple of
  // 256, so the hashes' high index half is that of base / 2 for the whole block).
  const uint64_t hash_base = static_cast<uint64_t>(base) / 2;
  const uint32_t lo = static_cast<uint32_t>(hash_base) + c.k0;
  const uint32_t hk = mix32(static_cast<uint32_t>(hash_base >> 32) + c.k1);
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t jj = static_cast<uint32_t>(j);
    const uint32_t h = mix32((lo + (((jj >> 4) << 3) | (jj & 7u))) ^ hk);
    p[j] = bf16_sr(pbuf[j], (h >> ((~jj & 8u) << 1)) & 0xFFFFu);  // high half, or low for j & 8
    const float avg = mbuf[j], root = rbuf[j];
    float ym = std::fabs(avg) * m_inv;
    ym = ym < 1.0f ? ym : 1.0f;
    const uint32_t mag = AvgCode::encode(ym);
    m[j] = static_cast<uint8_t>(((f2u(avg) >> 24) & 128u) | mag);  // the sign bit
    float yr = root * r_inv;
    yr = yr < 1.0f ? yr : 1.0f;
    uint32_t code = SqrtCode::encode(yr);
    // root > 0 (not NaN) on its bits; an integer test keeps the loop in one lane width
    const uint32_t positive = static_cast<uint32_t>(f2u(root) - 1u < 0x7F800000u);
    code = code | ((code == 0u) & positive);
    v[j] = static_cast<uint8_t>(code);
  }
  *m_scale = m_new;
  *v_scale = r_new;
  write_out(out, p, len);
}

// ---------------------------------------------------------------------------
// The AVX2 body: the block functions above in explicit intrinsics, for whole
// blocks (a tensor's last, partial block takes the generic body). Compiled in a
// target region, so one build serves every x86 CPU; picked at run time.
//
// Why explicit: the auto-vectorized loops ran at 3x (bf16) and 6x (int8) the
// fp32 step's time per element in cache. GCC widened the 16- and 8-bit states
// and the hash's index lane by lane, through the 64-bit induction variable, and
// chose blends and packs of its own. The operations and their order are the
// ones above, so the results are the same bits (the tests compare both bodies
// with the torch reference); where an intrinsic replaces a scalar idiom, the
// comment says why the result is the same.

#if INFINITY_X86

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#endif

namespace avx2 {

using V = __m256;   // 8 fp32
using I = __m256i;  // 8 uint32 (or 16 uint16, 32 uint8 once packed)

inline I splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline V splat(float x) { return _mm256_set1_ps(x); }
inline I bits(V x) { return _mm256_castps_si256(x); }
inline V floats(I x) { return _mm256_castsi256_ps(x); }
inline V abs(V x) { return floats(_mm256_and_si256(bits(x), splat(0x7FFFFFFFu))); }

// Eight bf16 (their bits) widened to fp32, exactly.
inline V load_bf16(const uint16_t* p) {
  const I u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return floats(_mm256_slli_epi32(u, 16));
}
inline V load(const float* g) { return _mm256_loadu_ps(g); }
inline V load(const BF16* g) { return load_bf16(reinterpret_cast<const uint16_t*>(g)); }
inline V load(const F16* g) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g))); }

// Consts, broadcast.
struct Splats {
  V decay, l2, coeff, beta2, beta2_complement, bc2_sqrt, neg_step, eps, avg_mask;
  explicit Splats(const Consts& c)
      : decay(splat(c.decay)), l2(splat(c.l2)), coeff(splat(c.coeff)), beta2(splat(c.beta2)),
        beta2_complement(splat(c.beta2_complement)), bc2_sqrt(splat(c.bc2_sqrt)),
        neg_step(splat(c.neg_step)), eps(splat(c.eps)), avg_mask(floats(splat(c.avg_mask))) {}
};

// adam_fp32 on eight elements; mul and add stay separate (no FMA), as there.
template <Decay D>
inline V adam_fp32(const Splats& k, V param, V grad, V& avg, V& sq, V& root) {
  if constexpr (D == Decay::kDecoupled) param = _mm256_mul_ps(param, k.decay);
  if constexpr (D == Decay::kL2) grad = _mm256_add_ps(grad, _mm256_mul_ps(param, k.l2));
  const V base = _mm256_blendv_ps(grad, avg, k.avg_mask);
  avg = _mm256_add_ps(base, _mm256_mul_ps(k.coeff, _mm256_sub_ps(grad, avg)));
  sq = _mm256_add_ps(_mm256_mul_ps(sq, k.beta2), _mm256_mul_ps(_mm256_mul_ps(k.beta2_complement, grad), grad));
  root = _mm256_sqrt_ps(sq);
  const V denom = _mm256_add_ps(_mm256_div_ps(root, k.bc2_sqrt), k.eps);
  return _mm256_add_ps(param, _mm256_div_ps(_mm256_mul_ps(k.neg_step, avg), denom));
}

// mix32 on eight lanes.
inline I mix32(I x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, splat(0x7FEB352Du));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, splat(0x846CA68Bu));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// The roundings to bf16 leave the result in each lane's high 16 bits (the low
// bits are junk until pack_high16 drops them). bf16_sr's special case needs no
// select here: an infinity plus r16 < 2**16 truncates back to itself, so only
// NaN differs from `rounded`, and OR-ing it with all ones gives 0xFFFF.
inline I nan_mask(V x) { return bits(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
inline I bf16_sr_high(V x, I r16) { return _mm256_or_si256(_mm256_add_epi32(bits(x), r16), nan_mask(x)); }
inline I bf16_rne_high(V x) {
  const I u = bits(x);
  const I lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), splat(1u));
  return _mm256_or_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, splat(0x7FFFu))), nan_mask(x));
}

// Sixteen bf16 in order from the high halves of a (elements 0-7) and b (8-15):
// packus works per 128-bit half, so the quarters come out as a0-3 b0-3 a4-7 b4-7.
inline I pack_high16(I a, I b) {
  const I packed = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));
  return _mm256_permute4x64_epi64(packed, 0xD8);
}

// Thirty-two bytes in order from the low bytes of q[0] (elements 0-7) .. q[3]:
// the packs leave the 4-byte groups as q0 q1 q2 q3 (low halves) q0 q1 q2 q3 (high).
inline I pack_bytes(const I q[4]) {
  const I words = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
  return _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline void store(void* p, I x) { _mm256_storeu_si256(static_cast<__m256i*>(p), x); }

// write_out for sixteen elements: `packed` is pack_high16(a, b).
inline void write_out16(NoOut*, I, I, I) {}
inline void write_out16(BF16* out, I packed, I, I) { store(out, packed); }
inline void write_out16(float* out, I, I a, I b) {
  const I high = splat(0xFFFF0000u);
  _mm256_storeu_ps(out, floats(_mm256_and_si256(a, high)));
  _mm256_storeu_ps(out + 8, floats(_mm256_and_si256(b, high)));
}
inline void write_out16(F16* out, I, I a, I b) {
  const I high = splat(0xFFFF0000u);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(floats(_mm256_and_si256(a, high)), kRound));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), _mm256_cvtps_ph(floats(_mm256_and_si256(b, high)), kRound));
}

// Code<E, MB>::encode on eight lanes (y in [0, 1], never NaN). The subnormal
// codes: cvtps rounds y * kSubScale to the nearest integer, halves to even (the
// default MXCSR mode), as adding 2**23 does in the scalar code.
// The normal codes subtract the exponent offset before the shift (one constant
// with the rounding's): for y >= kMinNormal, u is above kField << 23, and below
// it the subnormal code is taken.
template <class C>
inline I encode(V y) {
  constexpr int kDrop = 23 - C::kMantissaBits;
  const I u = bits(y);
  const I odd = _mm256_and_si256(_mm256_srli_epi32(u, kDrop), splat(1u));
  const I r = _mm256_add_epi32(_mm256_add_epi32(u, splat((1u << (kDrop - 1)) - 1u - (C::kField << 23))), odd);
  const I normal = _mm256_srli_epi32(r, kDrop);
  const I sub = _mm256_cvtps_epi32(_mm256_mul_ps(y, splat(C::kSubScale)));
  const V below = _mm256_cmp_ps(y, splat(C::kMinNormal), _CMP_LT_OQ);
  return _mm256_blendv_epi8(normal, sub, bits(below));
}

// Code<E, MB>::decode on eight lanes of codes c < 2**(E + MB). The subnormal
// values: c converted exactly, times the power of two 1 / kSubScale.
template <class C>
inline V decode(I c) {
  constexpr int kMB = C::kMantissaBits;
  const V normal = floats(_mm256_slli_epi32(_mm256_add_epi32(c, splat(C::kField << kMB)), 23 - kMB));
  const V sub = _mm256_mul_ps(_mm256_cvtepi32_ps(c), splat(1.0f / C::kSubScale));
  const I below = _mm256_cmpgt_epi32(splat(1u << kMB), c);
  return _mm256_blendv_ps(normal, sub, floats(below));
}

inline I load_codes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// The largest lane of x (no NaN lanes).
inline float max_lane(V x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The random-bit indices from `base`: lane l of the first vector is base + l.
inline I first_index(const Consts& c, int64_t base) {
  return _mm256_add_epi32(splat(static_cast<uint32_t>(base) + c.k0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline I high_key(const Consts& c, int64_t base) {
  return splat(infinity_kernels::mix32(static_cast<uint32_t>(static_cast<uint64_t>(base) >> 32) + c.k1));
}

// block_bf16 on a whole block, in two loops as there: the fp32 step into L1
// buffers, then the hashes, roundings and stores in loops of sixteen elements
// (one store per state). One loop with both ran 1.2x slower: the roundings wait
// on the divisions and fill the out-of-order window.
template <Decay D, class G, class O>
void block_bf16(const Consts& c, int64_t base, uint16_t* __restrict__ p, const G* __restrict__ g,
                uint16_t* __restrict__ m, uint16_t* __restrict__ v, O* __restrict__ out) {
  alignas(32) float pbuf[kBlock];
  alignas(32) float mbuf[kBlock];
  alignas(32) float vbuf[kBlock];
  const Splats k(c);
  for (int64_t j = 0; j < kBlock; j += 8) {
    V avg = load_bf16(m + j), sq = load_bf16(v + j), root;
    _mm256_store_ps(pbuf + j, adam_fp32<D>(k, load_bf16(p + j), load(g + j), avg, sq, root));
    _mm256_store_ps(mbuf + j, avg);
    _mm256_store_ps(vbuf + j, sq);
  }
  const I hk = high_key(c, base);
  I index = first_index(c, base);
  for (int64_t j = 0; j < kBlock; j += 16) {
    I p_high[2], m_high[2], v_high[2];
    for (int half = 0; half < 2; ++half) {
      const int64_t e = j + 8 * half;
      const I h = mix32(_mm256_xor_si256(index, hk));  // compact.random_bits
      index = _mm256_add_epi32(index, splat(8u));
      p_high[half] = bf16_sr_high(_mm256_load_ps(pbuf + e), _mm256_srli_epi32(h, 16));
      m_high[half] = bf16_rne_high(_mm256_load_ps(mbuf + e));
      v_high[half] = bf16_sr_high(_mm256_load_ps(vbuf + e), _mm256_and_si256(h, splat(0xFFFFu)));
    }
    const I p16 = pack_high16(p_high[0], p_high[1]);
    store(p + j, p16);
    store(m + j, pack_high16(m_high[0], m_high[1]));
    store(v + j, pack_high16(v_high[0], v_high[1]));
    if constexpr (!std::is_same_v<O, NoOut>) write_out16(out + j, p16, p_high[0], p_high[1]);
  }
}

// block_int8 on a whole block: the fp32 step and the block's maxima, then the
// roundings and codes in loops of thirty-two elements (one store of codes each).
template <Decay D, class G, class O>
void block_int8(const Consts& c, int64_t base, uint16_t* __restrict__ p, const G* __restrict__ g,
                uint8_t* __restrict__ m, uint8_t* __restrict__ v, float* __restrict__ m_scale,
                float* __restrict__ v_scale, O* __restrict__ out) {
  alignas(32) float pbuf[kBlock];
  alignas(32) float mbuf[kBlock];
  alignas(32) float rbuf[kBlock];
  const Splats k(c);
  const V ms = splat(*m_scale), vs = splat(*v_scale);
  // max_ps(x, acc) returns acc when x is NaN: NaN counts as 0, as there.
  V m_max = _mm256_setzero_ps(), r_max = _mm256_setzero_ps();
  for (int64_t j = 0; j < kBlock; j += 8) {
    const I mc = load_codes(m + j);
    const I sign = _mm256_slli_epi32(_mm256_and_si256(mc, splat(128u)), 24);
    const V mag = decode<AvgCode>(_mm256_and_si256(mc, splat(127u)));
    V avg = _mm256_mul_ps(floats(_mm256_or_si256(bits(mag), sign)), ms);
    const V r_old = _mm256_mul_ps(decode<SqrtCode>(load_codes(v + j)), vs);
    V sq = _mm256_mul_ps(r_old, r_old), root;
    _mm256_store_ps(pbuf + j, adam_fp32<D>(k, load_bf16(p + j), load(g + j), avg, sq, root));
    _mm256_store_ps(mbuf + j, avg);
    _mm256_store_ps(rbuf + j, root);
    m_max = _mm256_max_ps(abs(avg), m_max);
    r_max = _mm256_max_ps(abs(root), r_max);
  }
  const float m_new = max_lane(m_max), r_new = max_lane(r_max);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const V m_inv = splat((m_new > 0.0f && m_new < kInf) ? 1.0f / m_new : 0.0f);
  const V r_inv = splat((r_new > 0.0f && r_new < kInf) ? 1.0f / r_new : 0.0f);
  const V one = splat(1.0f), zero = _mm256_setzero_ps();
  // compact.random_bits16_shared: each vector of eight hashes serves sixteen
  // elements, the first eight with its high halves, the next with its low.
  const I hk = high_key(c, base / 2);
  I index = first_index(c, base / 2);
  for (int64_t j = 0; j < kBlock; j += 32) {
    I p_high[4], m_code[4], v_code[4];
    I h;
    for (int q = 0; q < 4; ++q) {
      const int64_t e = j + 8 * q;
      if (q % 2 == 0) {
        h = mix32(_mm256_xor_si256(index, hk));
        index = _mm256_add_epi32(index, splat(8u));
      }
      const I r16 = q % 2 == 0 ? _mm256_srli_epi32(h, 16) : _mm256_and_si256(h, splat(0xFFFFu));
      p_high[q] = bf16_sr_high(_mm256_load_ps(pbuf + e), r16);
      // min_ps(y, 1) is `y < 1 ? y : 1`, as there (1 for NaN).
      const V avg = _mm256_load_ps(mbuf + e), root = _mm256_load_ps(rbuf + e);
      const I mag = encode<AvgCode>(_mm256_min_ps(_mm256_mul_ps(abs(avg), m_inv), one));
      const I sign = _mm256_and_si256(_mm256_srli_epi32(bits(avg), 24), splat(128u));
      m_code[q] = _mm256_or_si256(sign, mag);
      const I code = encode<SqrtCode>(_mm256_min_ps(_mm256_mul_ps(root, r_inv), one));
      // A positive root (root > 0, false for NaN) never gets code 0: the max
      // with 1 changes only code 0.
      const I positive = bits(_mm256_cmp_ps(root, zero, _CMP_GT_OQ));
      v_code[q] = _mm256_max_epu32(code, _mm256_and_si256(positive, splat(1u)));
    }
    const I p16_lo = pack_high16(p_high[0], p_high[1]), p16_hi = pack_high16(p_high[2], p_high[3]);
    store(p + j, p16_lo);
    store(p + j + 16, p16_hi);
    store(m + j, pack_bytes(m_code));
    store(v + j, pack_bytes(v_code));
    if constexpr (!std::is_same_v<O, NoOut>) {
      write_out16(out + j, p16_lo, p_high[0], p_high[1]);
      write_out16(out + j + 16, p16_hi, p_high[2], p_high[3]);
    }
  }
  *m_scale = m_new;
  *v_scale = r_new;
}

}  // namespace avx2

#ifdef __clang__
#pragma clang attribute pop
#endif
#pragma GCC pop_options

#endif  // INFINITY_X86

// The floor for benchmarks: the same loads and stores as a step, no Adam arithmetic.
// `zero` is 0 at run time; the compiler cannot know it, so every byte is read and written.
template <bool kInt8, class G, class O>
void block_touch(uint32_t zero, int64_t len, uint16_t* __restrict__ p, const G* __restrict__ g,
                 void* m_ptr, void* v_ptr, float* __restrict__ m_scale, float* __restrict__ v_scale,
                 O* __restrict__ out) {
  alignas(64) float gbuf[kBlock];
  widen(g, gbuf, len);
  using S = std::conditional_t<kInt8, uint8_t, uint16_t>;
  S* __restrict__ m = static_cast<S*>(m_ptr);
  S* __restrict__ v = static_cast<S*>(v_ptr);
  for (int64_t j = 0; j < len; ++j) {
    p[j] = static_cast<uint16_t>(p[j] ^ (f2u(gbuf[j]) & zero));
    m[j] = static_cast<S>(m[j] ^ zero);
    v[j] = static_cast<S>(v[j] ^ zero);
  }
  if constexpr (kInt8) {
    *m_scale = u2f(f2u(*m_scale) ^ zero);
    *v_scale = u2f(f2u(*v_scale) ^ zero);
  }
  write_out(out, p, len);
}

enum class Op { kBf16, kInt8, kTouchBf16, kTouchInt8 };

struct Buffers {
  uint16_t* p;
  void* m;
  void* v;
  float* m_scale;  // int8 only
  float* v_scale;
};

// Blocks ahead that run_span prefetches. The block loops compute long enough
// between loads that the hardware prefetchers fall behind: out of cache, the int8
// step took twice its in-cache time without this, and 1.1x with it.
constexpr int64_t kPrefetchBlocks = 2;

inline void prefetch_span(const void* p, int64_t bytes, bool write) {
  const char* c = static_cast<const char*>(p);
  for (int64_t k = 0; k < bytes; k += 64) {
    if (write) {
      __builtin_prefetch(c + k, 1);
    } else {
      __builtin_prefetch(c + k, 0);
    }
  }
}

// The AVX2 body takes whole blocks only; the generic one the rest.
template <Op K, Decay D, class G, class O>
void step_block(Isa isa, const Consts& c, const Buffers& b, const G* g, O* o, int64_t i, int64_t len) {
  const int64_t blk = i / kBlock;
  [[maybe_unused]] const bool avx2_body = INFINITY_X86 && isa == Isa::kAvx2 && len == kBlock;
  if constexpr (K == Op::kBf16) {
    uint16_t* m = static_cast<uint16_t*>(b.m) + i;
    uint16_t* v = static_cast<uint16_t*>(b.v) + i;
#if INFINITY_X86
    if (avx2_body) return avx2::block_bf16<D>(c, i, b.p + i, g + i, m, v, o);
#endif
    block_bf16<D>(c, i, len, b.p + i, g + i, m, v, o);
  } else {
    uint8_t* m = static_cast<uint8_t*>(b.m) + i;
    uint8_t* v = static_cast<uint8_t*>(b.v) + i;
#if INFINITY_X86
    if (avx2_body) return avx2::block_int8<D>(c, i, b.p + i, g + i, m, v, b.m_scale + blk, b.v_scale + blk, o);
#endif
    block_int8<D>(c, i, len, b.p + i, g + i, m, v, b.m_scale + blk, b.v_scale + blk, o);
  }
}

template <Op K, Decay D, class G, class O>
void run_span(Isa isa, const Consts& c, const Buffers& b, const G* g, O* out, int64_t begin, int64_t end) {
  constexpr bool kInt8 = K == Op::kInt8 || K == Op::kTouchInt8;
  constexpr int64_t kStateBytes = kInt8 ? 1 : 2;
  // begin is a multiple of kBlock; blocks never straddle spans.
  for (int64_t i = begin; i < end; i += kBlock) {
    const int64_t len = std::min(kBlock, end - i);
    const int64_t ahead = i + kPrefetchBlocks * kBlock;
    if (ahead < end) {
      const int64_t n = std::min(kBlock, end - ahead);
      prefetch_span(b.p + ahead, n * 2, true);
      prefetch_span(g + ahead, n * static_cast<int64_t>(sizeof(G)), false);
      prefetch_span(static_cast<char*>(b.m) + ahead * kStateBytes, n * kStateBytes, true);
      prefetch_span(static_cast<char*>(b.v) + ahead * kStateBytes, n * kStateBytes, true);
      if constexpr (!std::is_same_v<O, NoOut>) prefetch_span(out + ahead, n * static_cast<int64_t>(sizeof(O)), true);
    }
    O* o = nullptr;
    if constexpr (!std::is_same_v<O, NoOut>) o = out + i;
    if constexpr (K == Op::kBf16 || K == Op::kInt8) {
      step_block<K, D>(isa, c, b, g, o, i, len);
    } else {
      const int64_t blk = i / kBlock;
      constexpr bool kInt8 = K == Op::kTouchInt8;
      const size_t width = kInt8 ? 1 : 2;
      block_touch<kInt8>(c.k0, len, b.p + i, g + i, static_cast<char*>(b.m) + i * width,
                         static_cast<char*>(b.v) + i * width, kInt8 ? b.m_scale + blk : nullptr,
                         kInt8 ? b.v_scale + blk : nullptr, o);
    }
  }
}

template <Op K, Decay D, class G, class O>
void run_parallel(Isa isa, const Consts& c, const Buffers& b, const G* g, O* out, int64_t n) {
  auto span = [&](int64_t begin, int64_t end) { run_span<K, D>(isa, c, b, g, out, begin, end); };
  const int64_t threads = at::get_num_threads();
  if (n < kGrainElems || threads <= 1 || at::in_parallel_region()) {
    span(0, n);
    return;
  }
  int64_t chunk = (n + threads * kChunksPerThread - 1) / (threads * kChunksPerThread);
  chunk = std::clamp((chunk + kBlock - 1) / kBlock * kBlock, kMinChunk, kMaxChunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  // One task per thread; each claims chunks until none are left (see adam.cpp).
  at::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < chunks;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      span(k * chunk, std::min((k + 1) * chunk, n));
    }
  });
}

template <Op K, Decay D, class G>
void with_out(Isa isa, const Consts& c, const Buffers& b, const G* g, const c10::optional<at::Tensor>& out,
              int64_t n) {
  if (!out.has_value()) {
    NoOut* none = nullptr;
    return run_parallel<K, D>(isa, c, b, g, none, n);
  }
  switch (out->scalar_type()) {
    case at::kFloat: return run_parallel<K, D>(isa, c, b, g, out->data_ptr<float>(), n);
    case at::kBFloat16: return run_parallel<K, D>(isa, c, b, g, out->data_ptr<BF16>(), n);
    case at::kHalf: return run_parallel<K, D>(isa, c, b, g, out->data_ptr<F16>(), n);
    default: TORCH_CHECK(false, "param_out must be float32, bfloat16 or float16");
  }
}

template <Op K, Decay D>
void with_grad(Isa isa, const Consts& c, const Buffers& b, const at::Tensor& grad,
               const c10::optional<at::Tensor>& out, int64_t n) {
  switch (grad.scalar_type()) {
    case at::kFloat: return with_out<K, D>(isa, c, b, grad.data_ptr<float>(), out, n);
    case at::kBFloat16: return with_out<K, D>(isa, c, b, grad.data_ptr<BF16>(), out, n);
    case at::kHalf: return with_out<K, D>(isa, c, b, grad.data_ptr<F16>(), out, n);
    default: TORCH_CHECK(false, "grad must be float32, bfloat16 or float16");
  }
}

void check(const at::Tensor& t, const char* name, int64_t n, at::ScalarType dtype) {
  // Python validates first with ValueError; these guard direct op calls.
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, expected ", n);
  TORCH_CHECK(t.scalar_type() == dtype, name, " has the wrong dtype");
}

template <Op K>
void run_op(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
            const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& exp_avg_scale,
            const c10::optional<at::Tensor>& exp_avg_sq_scale,
            const c10::optional<at::Tensor>& param_out, const Consts& c, Decay decay, Isa isa) {
  constexpr bool kInt8 = K == Op::kInt8 || K == Op::kTouchInt8;
  const int64_t n = master.numel();
  check(master, "master", n, at::kBFloat16);
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == n, "bad grad");
  const auto state = kInt8 ? at::kByte : at::kBFloat16;
  check(exp_avg, "exp_avg", n, state);
  check(exp_avg_sq, "exp_avg_sq", n, state);
  Buffers b{reinterpret_cast<uint16_t*>(master.data_ptr()), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
            nullptr, nullptr};
  if constexpr (kInt8) {
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    TORCH_CHECK(exp_avg_scale.has_value() && exp_avg_sq_scale.has_value(), "int8 states need scales");
    check(*exp_avg_scale, "exp_avg_scale", blocks, at::kFloat);
    check(*exp_avg_sq_scale, "exp_avg_sq_scale", blocks, at::kFloat);
    b.m_scale = exp_avg_scale->data_ptr<float>();
    b.v_scale = exp_avg_sq_scale->data_ptr<float>();
  }
  if (param_out.has_value()) {
    TORCH_CHECK(param_out->is_contiguous() && param_out->numel() == n, "bad param_out");
  }
  if (n == 0) return;
  switch (decay) {
    case Decay::kL2: return with_grad<K, Decay::kL2>(isa, c, b, grad, param_out, n);
    case Decay::kDecoupled: return with_grad<K, Decay::kDecoupled>(isa, c, b, grad, param_out, n);
    default: return with_grad<K, Decay::kNone>(isa, c, b, grad, param_out, n);
  }
}

void adam_step_compact(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& exp_avg_scale,
                       const c10::optional<at::Tensor>& exp_avg_sq_scale,
                       const c10::optional<at::Tensor>& param_out, bool int8, bool decoupled,
                       double decay, double l2, double lerp_weight, double beta2,
                       double beta2_complement, double bias_correction2_sqrt, double neg_step_size,
                       double eps, int64_t k0, int64_t k1, int64_t isa_code) {
  Consts c;
  const float w = static_cast<float>(lerp_weight);
  c.base_is_avg = std::fabs(w) < 0.5f;
  c.avg_mask = c.base_is_avg ? 0xFFFFFFFFu : 0u;
  c.decay = static_cast<float>(decay);
  c.l2 = static_cast<float>(l2);
  c.coeff = c.base_is_avg ? w : w - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.beta2_complement = static_cast<float>(beta2_complement);
  c.bc2_sqrt = static_cast<float>(bias_correction2_sqrt);
  c.neg_step = static_cast<float>(neg_step_size);
  c.eps = static_cast<float>(eps);
  TORCH_CHECK(k0 >= 0 && k0 <= 0xFFFFFFFFLL && k1 >= 0 && k1 <= 0xFFFFFFFFLL, "keys must be uint32");
  c.k0 = static_cast<uint32_t>(k0);
  c.k1 = static_cast<uint32_t>(k1);
  // The same decay modes as adam.cpp's run_op.
  const Decay d = (l2 != 0.0 && !decoupled) ? Decay::kL2
                  : (decay != 1.0 && decoupled) ? Decay::kDecoupled
                                                : Decay::kNone;
  const Isa isa = resolve_isa(isa_code, Isa::kAvx2, "compact-state Adam");
  if (int8) {
    run_op<Op::kInt8>(master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out, c, d, isa);
  } else {
    run_op<Op::kBf16>(master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out, c, d, isa);
  }
}

void touch_compact(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& exp_avg_scale,
                   const c10::optional<at::Tensor>& exp_avg_sq_scale,
                   const c10::optional<at::Tensor>& param_out, bool int8, int64_t zero) {
  Consts c{};
  c.k0 = static_cast<uint32_t>(zero);
  if (int8) {
    run_op<Op::kTouchInt8>(master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out, c,
                           Decay::kNone, Isa::kGeneric);
  } else {
    run_op<Op::kTouchBf16>(master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out, c,
                           Decay::kNone, Isa::kGeneric);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infinity_kernels, m) {
  m.def(
      "adam_step_compact(Tensor(a!) master, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? exp_avg_scale, Tensor(e!)? exp_avg_sq_scale, Tensor(f!)? param_out, bool int8, "
      "bool decoupled, float decay, float l2, float lerp_weight, float beta2, float beta2_complement, "
      "float bias_correction2_sqrt, float neg_step_size, float eps, int k0, int k1, int isa=0) -> ()",
      &adam_step_compact);
  m.def(
      "touch_compact(Tensor(a!) master, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? exp_avg_scale, Tensor(e!)? exp_avg_sq_scale, Tensor(f!)? param_out, bool int8, "
      "int zero) -> ()",
      &touch_compact);
}

}  // namespace infinity_kernels
