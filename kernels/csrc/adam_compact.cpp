// Fused Adam/AdamW step over compact optimizer states, one pass over memory:
//
//   bf16: master, exp_avg, exp_avg_sq in bf16; master and exp_avg_sq stored back with
//         stochastic rounding, exp_avg rounded to nearest;
//   int8: master in bf16 (stochastic rounding), exp_avg and exp_avg_sq as one byte per
//         element plus one fp32 scale per block of 256 elements (codes in compact.py).
//
// The fp32 arithmetic is that of adam.cpp, in the same order, without FMA
// (-ffp-contract=off), except the last line: with sqrt(bias_correction2) folded
// into the two constants it takes one division instead of two (8-10 % of the int8
// step on 2 and on 16 cores; the stored forms round far coarser than that one
// rounding step); the forms, the random bits and the codes are defined in
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
// -fno-trapping-math), and on x86 CPUs the AVX2 and AVX-512 bodies, the same
// steps in intrinsics for whole blocks. The AVX2 body is 1.4x (bf16) and 1.9x
// (int8) faster than the generic one in cache on Zen 3; on Zen 4 the AVX-512
// body is 1.3x faster than the AVX2 one for int8 (100M elements, 2 threads)
// and as fast for bf16, which is near the memory floor there. The body is
// chosen at run time (isa.h); a tensor's last, partial block always takes the
// generic one.

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

#include "chunks.h"
#include "isa.h"
#include "sq_norm.h"

namespace infinity_kernels {
namespace {

using BF16 = c10::BFloat16;
using F16 = c10::Half;

constexpr int64_t kBlock = 256;  // compact.BLOCK_NUMEL
// Chunks (chunks.h) are whole blocks: each block's scale and random bits are its own.
constexpr ChunkShape kChunks{/*unit=*/kBlock, /*min_chunk=*/1 << 12, /*max_chunk=*/1 << 16, /*grain=*/1 << 15};

struct NoOut {};
enum class Decay { kNone, kDecoupled, kL2 };

struct Consts {
  float decay, l2, coeff, beta2, beta2_complement;
  // -step_size and eps times sqrt(bias_correction2): one division an element (reference_compact.py)
  float neg_step_root, eps_root;
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

// compact.random_bits' key of an index's high 32 bits: one value for a whole
// block, whose indices share them.
inline uint32_t high_key(const Consts& c, uint64_t index) { return mix32(static_cast<uint32_t>(index >> 32) + c.k1); }

// What a block's values are multiplied by to encode them against its new scale
// (its largest value): the inverse, or 0 for a scale of 0, inf or NaN.
inline float inverse_scale(float scale) {
  return (scale > 0.0f && scale < std::numeric_limits<float>::infinity()) ? 1.0f / scale : 0.0f;
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

// The fp32 step of one element (adam.cpp's order, one division); returns the new master, sets m, v.
template <Decay D>
inline float adam_fp32(const Consts& c, float param, float grad, float& avg, float& sq, float& root) {
  if constexpr (D == Decay::kDecoupled) param = param * c.decay;
  if constexpr (D == Decay::kL2) grad = grad + param * c.l2;
  // base_is_avg ? avg : grad, as a bit select (a scalar condition would stop vectorization)
  const float base = u2f((f2u(avg) & c.avg_mask) | (f2u(grad) & ~c.avg_mask));
  avg = base + c.coeff * (grad - avg);
  sq = sq * c.beta2 + (c.beta2_complement * grad) * grad;
  root = std::sqrt(sq);
  return param + (c.neg_step_root * avg) / (root + c.eps_root);
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
  const uint32_t hk = high_key(c, static_cast<uint64_t>(base));
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
  const float m_inv = inverse_scale(m_new), r_inv = inverse_scale(r_new);
  // compact.random_bits16_shared: elements j and j + 8 of each group of 16
  // share hash number base / 2 + (j >> 4) * 8 + (j & 7) (base is a multiple of
  // 256, so the hashes' high index half is that of base / 2 for the whole block).
  const uint64_t hash_base = static_cast<uint64_t>(base) / 2;
  const uint32_t lo = static_cast<uint32_t>(hash_base) + c.k0;
  const uint32_t hk = high_key(c, hash_base);
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

#include "adam_compact_avx2.h"  // the AVX2 body of the block functions above
#include "adam_compact_avx512.h"  // the AVX-512 body

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

// The vector bodies take whole blocks only; the generic one the rest.
template <Op K, Decay D, class G, class O>
void step_block(Isa isa, const Consts& c, const Buffers& b, const G* g, O* o, int64_t i, int64_t len) {
  const int64_t blk = i / kBlock;
  [[maybe_unused]] const bool whole = INFINITY_X86 && len == kBlock;
  if constexpr (K == Op::kBf16) {
    uint16_t* m = static_cast<uint16_t*>(b.m) + i;
    uint16_t* v = static_cast<uint16_t*>(b.v) + i;
#if INFINITY_X86
    if (whole && isa == Isa::kAvx512) return avx512::block_bf16<D>(c, i, b.p + i, g + i, m, v, o);
    if (whole && isa == Isa::kAvx2) return avx2::block_bf16<D>(c, i, b.p + i, g + i, m, v, o);
#endif
    block_bf16<D>(c, i, len, b.p + i, g + i, m, v, o);
  } else {
    uint8_t* m = static_cast<uint8_t*>(b.m) + i;
    uint8_t* v = static_cast<uint8_t*>(b.v) + i;
    float* ms = b.m_scale + blk;
    float* vs = b.v_scale + blk;
#if INFINITY_X86
    if (whole && isa == Isa::kAvx512) return avx512::block_int8<D>(c, i, b.p + i, g + i, m, v, ms, vs, o);
    if (whole && isa == Isa::kAvx2) return avx2::block_int8<D>(c, i, b.p + i, g + i, m, v, ms, vs, o);
#endif
    block_int8<D>(c, i, len, b.p + i, g + i, m, v, ms, vs, o);
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
void run_parallel(Isa isa, const Consts& c, const Buffers& b, const G* g, O* out, int64_t n,
                  int64_t threads, double* grad_sq_norm) {
  auto span = [&](int64_t begin, int64_t end) { run_span<K, D>(isa, c, b, g, out, begin, end); };
  if (grad_sq_norm != nullptr) {
    // each norm block summed just before the update reads it: one pass over the gradients, not two
    *grad_sq_norm = sq_sum_beside(g, n, threads, span);
    return;
  }
  run_in_chunks(n, threads, kChunks, span);
}

template <Op K, Decay D, class G>
void with_out(Isa isa, const Consts& c, const Buffers& b, const G* g, const c10::optional<at::Tensor>& out,
              int64_t n, int64_t threads, double* sq) {
  if (!out.has_value()) {
    NoOut* none = nullptr;
    return run_parallel<K, D>(isa, c, b, g, none, n, threads, sq);
  }
  switch (out->scalar_type()) {
    case at::kFloat: return run_parallel<K, D>(isa, c, b, g, out->data_ptr<float>(), n, threads, sq);
    case at::kBFloat16: return run_parallel<K, D>(isa, c, b, g, out->data_ptr<BF16>(), n, threads, sq);
    case at::kHalf: return run_parallel<K, D>(isa, c, b, g, out->data_ptr<F16>(), n, threads, sq);
    default: TORCH_CHECK(false, "param_out must be float32, bfloat16 or float16");
  }
}

template <Op K, Decay D>
void with_grad(Isa isa, const Consts& c, const Buffers& b, const at::Tensor& grad,
               const c10::optional<at::Tensor>& out, int64_t n, int64_t threads, double* sq) {
  switch (grad.scalar_type()) {
    case at::kFloat: return with_out<K, D>(isa, c, b, grad.data_ptr<float>(), out, n, threads, sq);
    case at::kBFloat16: return with_out<K, D>(isa, c, b, grad.data_ptr<BF16>(), out, n, threads, sq);
    case at::kHalf: return with_out<K, D>(isa, c, b, grad.data_ptr<F16>(), out, n, threads, sq);
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
            const c10::optional<at::Tensor>& param_out, const Consts& c, Decay decay, Isa isa,
            int64_t threads, const c10::optional<at::Tensor>& grad_sq_norm) {
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
  double* sq = sq_norm_out(grad_sq_norm);
  if (n == 0) return;
  switch (decay) {
    case Decay::kL2: return with_grad<K, Decay::kL2>(isa, c, b, grad, param_out, n, threads, sq);
    case Decay::kDecoupled: return with_grad<K, Decay::kDecoupled>(isa, c, b, grad, param_out, n, threads, sq);
    default: return with_grad<K, Decay::kNone>(isa, c, b, grad, param_out, n, threads, sq);
  }
}

void adam_step_compact(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& exp_avg_scale,
                       const c10::optional<at::Tensor>& exp_avg_sq_scale,
                       const c10::optional<at::Tensor>& param_out, bool int8, bool decoupled,
                       double decay, double l2, double lerp_weight, double beta2,
                       double beta2_complement, double bias_correction2_sqrt, double neg_step_size,
                       double eps, int64_t k0, int64_t k1, int64_t isa_code, int64_t threads,
                       const c10::optional<at::Tensor>& grad_sq_norm) {
  Consts c;
  const float w = static_cast<float>(lerp_weight);
  c.base_is_avg = std::fabs(w) < 0.5f;
  c.avg_mask = c.base_is_avg ? 0xFFFFFFFFu : 0u;
  c.decay = static_cast<float>(decay);
  c.l2 = static_cast<float>(l2);
  c.coeff = c.base_is_avg ? w : w - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.beta2_complement = static_cast<float>(beta2_complement);
  // products in double, then rounded once: what the reference's Python floats give
  c.neg_step_root = static_cast<float>(neg_step_size * bias_correction2_sqrt);
  c.eps_root = static_cast<float>(eps * bias_correction2_sqrt);
  TORCH_CHECK(k0 >= 0 && k0 <= 0xFFFFFFFFLL && k1 >= 0 && k1 <= 0xFFFFFFFFLL, "keys must be uint32");
  c.k0 = static_cast<uint32_t>(k0);
  c.k1 = static_cast<uint32_t>(k1);
  // The same decay modes as adam.cpp's run_op.
  const Decay d = (l2 != 0.0 && !decoupled) ? Decay::kL2
                  : (decay != 1.0 && decoupled) ? Decay::kDecoupled
                                                : Decay::kNone;
  const Isa isa = resolve_isa(isa_code, Isa::kAvx512, "compact-state Adam");
  if (int8) {
    run_op<Op::kInt8>(master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out, c, d, isa,
                      threads, grad_sq_norm);
  } else {
    run_op<Op::kBf16>(master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out, c, d, isa,
                      threads, grad_sq_norm);
  }
}

void touch_compact(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& exp_avg_scale,
                   const c10::optional<at::Tensor>& exp_avg_sq_scale,
                   const c10::optional<at::Tensor>& param_out, bool int8, int64_t zero, int64_t threads) {
  Consts c{};
  c.k0 = static_cast<uint32_t>(zero);
  if (int8) {
    run_op<Op::kTouchInt8>(master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out, c,
                           Decay::kNone, Isa::kGeneric, threads, c10::nullopt);
  } else {
    run_op<Op::kTouchBf16>(master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out, c,
                           Decay::kNone, Isa::kGeneric, threads, c10::nullopt);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infinity_kernels, m) {
  m.def(
      "adam_step_compact(Tensor(a!) master, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? exp_avg_scale, Tensor(e!)? exp_avg_sq_scale, Tensor(f!)? param_out, bool int8, "
      "bool decoupled, float decay, float l2, float lerp_weight, float beta2, float beta2_complement, "
      "float bias_correction2_sqrt, float neg_step_size, float eps, int k0, int k1, int isa=0, int threads=0, "
      "Tensor(g!)? grad_sq_norm=None) -> ()",
      &adam_step_compact);
  m.def(
      "touch_compact(Tensor(a!) master, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? exp_avg_scale, Tensor(e!)? exp_avg_sq_scale, Tensor(f!)? param_out, bool int8, "
      "int zero, int threads=0) -> ()",
      &touch_compact);
}

}  // namespace infinity_kernels
