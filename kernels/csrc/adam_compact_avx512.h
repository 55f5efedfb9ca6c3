// Included by adam_compact.cpp inside its anonymous namespace, after the AVX2
// body (not a standalone header: it uses the generic body's helpers and Code<>).

// ---------------------------------------------------------------------------
// The AVX-512 body: the block functions in 16-lane intrinsics, for whole blocks.
// The operations and their order are the generic body's, so the results are the
// same bits (the tests compare every body with the torch reference). Beyond the
// width, three things are new against the AVX2 body:
//
// - Mask registers take the selects: a masked convert or multiply writes only
//   the lanes that need it, where AVX2 computed both sides and blended.
// - int8 codes decode by the CPU's fp16 conversion. Shifted into the bits of
//   an fp16, a code's value is that half's value times 2**(kField - 112): its
//   exponent bits land in the low bits of the fp16 exponent field, and the
//   codes below the smallest normal become fp16 subnormals with the same
//   mantissa, which vcvtph2ps widens exactly to normal fp32 numbers. One
//   multiply by 2**(kField - 112) * scale is then the decode and the scale:
//   three or four operations where the AVX2 body takes nine or ten. (Shifting the codes into fp32
//   instead takes one operation less but makes the small codes fp32
//   subnormals, and multiplying those made the step 1.4x slower on Zen 4.)
//   The conversion ignores MXCSR.DAZ (torch.set_flush_denormal(True)), which
//   an fp32 multiply would not: a test compares this body with the AVX2 one with
//   it set, on whichever AVX-512 CPU runs the tests (so far Zen 4).
// - The sixteen random bits of the shared hashes (compact.random_bits16_shared)
//   are picked from the hash vector by one word permute per sixteen elements.

#if INFINITY_X86

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c"))), \
                             apply_to = function)
#endif

namespace avx512 {

using V = __m512;   // 16 fp32
using I = __m512i;  // 16 uint32 (or 32 uint16)
using M = __mmask16;

inline I splat(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline V splat(float x) { return _mm512_set1_ps(x); }
inline I bits(V x) { return _mm512_castps_si512(x); }
inline V floats(I x) { return _mm512_castsi512_ps(x); }
inline V abs(V x) { return floats(_mm512_and_si512(bits(x), splat(0x7FFFFFFFu))); }

// Sixteen bf16 (their bits) widened to fp32, exactly.
inline V widen_bf16(__m256i h) { return floats(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline V load_bf16(const uint16_t* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline V load(const float* g) { return _mm512_loadu_ps(g); }
inline V load(const BF16* g) { return load_bf16(reinterpret_cast<const uint16_t*>(g)); }
inline V load(const F16* g) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g))); }
inline void store(void* p, I x) { _mm512_storeu_si512(p, x); }

// Thirty-two elements as two vectors: the even ones (0, 2, .., 30) and the odd
// ones, as the AVX2 body's Pair: sixteen bf16 widen in one op per vector.
struct Pair {
  V even, odd;
};
inline Pair split32(const uint16_t* p) {
  const I w = _mm512_loadu_si512(p);
  return {floats(_mm512_slli_epi32(w, 16)), floats(_mm512_and_si512(w, splat(0xFFFF0000u)))};
}
inline Pair split32(V a, V b) {  // a: elements 0-15, b: 16-31
  const I even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const I odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return {_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b)};
}
inline Pair split32(const BF16* g) { return split32(reinterpret_cast<const uint16_t*>(g)); }
inline Pair split32(const float* g) { return split32(load(g), load(g + 16)); }
inline Pair split32(const F16* g) { return split32(load(g), load(g + 16)); }

// Thirty-two bf16 in order from the high halves of `even` and `odd`.
inline I join_high32(I even, I odd) {
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(even, 16), odd);
}
// Thirty-two bf16 in order from the high halves of a (elements 0-15) and b (16-31).
inline I pack_high32(I a, I b) {
  const I high_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(a, high_words, b);
}

// write_out for thirty-two elements, from their bf16 bits in order.
inline V widen_low16(I packed) { return widen_bf16(_mm512_castsi512_si256(packed)); }
inline V widen_high16(I packed) { return widen_bf16(_mm512_extracti64x4_epi64(packed, 1)); }
inline void write_out32(NoOut*, I) {}
inline void write_out32(BF16* out, I packed) { store(out, packed); }
inline void write_out32(float* out, I packed) {
  _mm512_storeu_ps(out, widen_low16(packed));
  _mm512_storeu_ps(out + 16, widen_high16(packed));
}
inline void write_out32(F16* out, I packed) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(widen_low16(packed), kRound));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm512_cvtps_ph(widen_high16(packed), kRound));
}

// Consts, broadcast.
struct Splats {
  V decay, l2, coeff, beta2, beta2_complement, neg_step_root, eps_root;
  M base_is_avg;
  explicit Splats(const Consts& c)
      : decay(splat(c.decay)), l2(splat(c.l2)), coeff(splat(c.coeff)), beta2(splat(c.beta2)),
        beta2_complement(splat(c.beta2_complement)), neg_step_root(splat(c.neg_step_root)),
        eps_root(splat(c.eps_root)), base_is_avg(c.base_is_avg ? 0xFFFF : 0) {}
};

// adam_fp32 on sixteen elements; mul and add stay separate (no FMA), as there.
template <Decay D>
inline V adam_fp32(const Splats& k, V param, V grad, V& avg, V& sq, V& root) {
  if constexpr (D == Decay::kDecoupled) param = _mm512_mul_ps(param, k.decay);
  if constexpr (D == Decay::kL2) grad = _mm512_add_ps(grad, _mm512_mul_ps(param, k.l2));
  const V base = _mm512_mask_blend_ps(k.base_is_avg, grad, avg);
  avg = _mm512_add_ps(base, _mm512_mul_ps(k.coeff, _mm512_sub_ps(grad, avg)));
  sq = _mm512_add_ps(_mm512_mul_ps(sq, k.beta2), _mm512_mul_ps(_mm512_mul_ps(k.beta2_complement, grad), grad));
  root = _mm512_sqrt_ps(sq);
  return _mm512_add_ps(param, _mm512_div_ps(_mm512_mul_ps(k.neg_step_root, avg), _mm512_add_ps(root, k.eps_root)));
}

// mix32 on sixteen lanes.
inline I mix32(I x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, splat(0x7FEB352Du));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, splat(0x846CA68Bu));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// The roundings to bf16 leave the result in each lane's high 16 bits, as in the
// AVX2 body (whose comment says why OR-ing NaN lanes with all ones is bf16_sr).
template <bool kMayBeNaN = true>
inline I bf16_sr_high(V x, I r16) {
  const I rounded = _mm512_add_epi32(bits(x), r16);
  if constexpr (kMayBeNaN) return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), splat(~0u));
  return rounded;
}
template <bool kMayBeNaN = true>
inline I bf16_rne_high(V x) {
  const I u = bits(x);
  const I lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), splat(1u));
  const I rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, splat(0x7FFFu)));
  if constexpr (kMayBeNaN) return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), splat(~0u));
  return rounded;
}

// block_bf16's second loop, as the AVX2 body's round_bf16_states, thirty-two
// elements at a time.
template <bool kMayBeNaN, class O>
void round_bf16_states(const Consts& c, int64_t base, const float* pbuf, const float* mbuf, const float* vbuf,
                       uint16_t* __restrict__ p, uint16_t* __restrict__ m, uint16_t* __restrict__ v,
                       O* __restrict__ out) {
  const I hk = splat(high_key(c, base));
  I even_index = _mm512_add_epi32(splat(static_cast<uint32_t>(base) + c.k0),
                                  _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
  for (int64_t j = 0; j < kBlock; j += 32) {
    I p_high[2], m_high[2], v_high[2];
    for (int odd = 0; odd < 2; ++odd) {
      const int64_t e = j + 16 * odd;
      // compact.random_bits of elements j + 2l + odd
      const I h = mix32(_mm512_xor_si512(odd ? _mm512_add_epi32(even_index, splat(1u)) : even_index, hk));
      p_high[odd] = bf16_sr_high<kMayBeNaN>(_mm512_load_ps(pbuf + e), _mm512_srli_epi32(h, 16));
      m_high[odd] = bf16_rne_high<kMayBeNaN>(_mm512_load_ps(mbuf + e));
      v_high[odd] = bf16_sr_high<kMayBeNaN>(_mm512_load_ps(vbuf + e), _mm512_and_si512(h, splat(0xFFFFu)));
    }
    even_index = _mm512_add_epi32(even_index, splat(32u));
    const I p32 = join_high32(p_high[0], p_high[1]);
    store(p + j, p32);
    store(m + j, join_high32(m_high[0], m_high[1]));
    store(v + j, join_high32(v_high[0], v_high[1]));
    if constexpr (!std::is_same_v<O, NoOut>) write_out32(out + j, p32);
  }
}

// block_bf16 on a whole block, as the AVX2 body's: the fp32 step into L1 buffers
// (even/odd order per thirty-two elements), noting whether anything may be NaN,
// then the roundings.
template <Decay D, class G, class O>
void block_bf16(const Consts& c, int64_t base, uint16_t* __restrict__ p, const G* __restrict__ g,
                uint16_t* __restrict__ m, uint16_t* __restrict__ v, O* __restrict__ out) {
  alignas(64) float pbuf[kBlock];
  alignas(64) float mbuf[kBlock];
  alignas(64) float vbuf[kBlock];
  const Splats k(c);
  M unordered = 0;
  for (int64_t j = 0; j < kBlock; j += 32) {
    const Pair param = split32(p + j), grad = split32(g + j);
    Pair avg = split32(m + j), sq = split32(v + j);
    V root;
    const V p_even = adam_fp32<D>(k, param.even, grad.even, avg.even, sq.even, root);
    const V p_odd = adam_fp32<D>(k, param.odd, grad.odd, avg.odd, sq.odd, root);
    unordered |= _mm512_cmp_ps_mask(_mm512_add_ps(p_even, avg.even), sq.even, _CMP_UNORD_Q);
    unordered |= _mm512_cmp_ps_mask(_mm512_add_ps(p_odd, avg.odd), sq.odd, _CMP_UNORD_Q);
    _mm512_store_ps(pbuf + j, p_even);
    _mm512_store_ps(pbuf + j + 16, p_odd);
    _mm512_store_ps(mbuf + j, avg.even);
    _mm512_store_ps(mbuf + j + 16, avg.odd);
    _mm512_store_ps(vbuf + j, sq.even);
    _mm512_store_ps(vbuf + j + 16, sq.odd);
  }
  if (unordered != 0) {
    round_bf16_states<true>(c, base, pbuf, mbuf, vbuf, p, m, v, out);
  } else {
    round_bf16_states<false>(c, base, pbuf, mbuf, vbuf, p, m, v, out);
  }
}

// 2**e as a float, for 0 <= e < 128.
constexpr float pow2(int e) { return e == 0 ? 1.0f : 2.0f * pow2(e - 1); }

// A code shifted into fp16 bits (see the top of this file): its value is that
// half's value times kFromHalf<C> = 2**(kField - 127 + 15). That holds while the
// code's exponent field lands inside fp16's (which the shift puts at bit 10)
// and its mantissa fits fp16's 10 bits.
template <class C>
constexpr int kHalfShift = 10 - C::kMantissaBits;
template <class C>
constexpr float kFromHalf = pow2(static_cast<int>(C::kField) - 112);
static_assert(AvgCode::kField >= 112 && SqrtCode::kField >= 112, "kFromHalf must be a power of two >= 1");
static_assert(AvgCode::kMantissaBits <= 10 && SqrtCode::kMantissaBits <= 10, "the mantissa must fit fp16's");
static_assert((127u + AvgCode::kField - 112u) < 255u && (127u + SqrtCode::kField - 112u) < 255u, "kFromHalf finite");
static_assert(kHalfShift<AvgCode> + AvgCode::kMantissaBits + 3 <= 15,
              "exp_avg's 7-bit magnitude must stay below fp16's sign bit");
static_assert(kHalfShift<SqrtCode> + 8 <= 15, "exp_avg_sq's 8-bit code must stay below fp16's sign bit");

// Code<E, MB>::encode on sixteen lanes (y in [0, 1], never NaN), as the AVX2
// body's; the subnormal codes overwrite only the lanes below the smallest
// normal, rounded to nearest even whatever the MXCSR says.
template <class C>
inline I encode(V y) {
  constexpr int kDrop = 23 - C::kMantissaBits;
  const I u = bits(y);
  const I odd = _mm512_and_si512(_mm512_srli_epi32(u, kDrop), splat(1u));
  const I r = _mm512_add_epi32(_mm512_add_epi32(u, splat((1u << (kDrop - 1)) - 1u - (C::kField << 23))), odd);
  const I normal = _mm512_srli_epi32(r, kDrop);
  const M below = _mm512_cmp_ps_mask(y, splat(C::kMinNormal), _CMP_LT_OQ);
  return _mm512_mask_cvt_roundps_epi32(normal, below, _mm512_mul_ps(y, splat(C::kSubScale)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// One int8 block between block_int8's two loops: the first loop's fp32 results.
struct Int8Buffers {
  alignas(64) float pbuf[kBlock];
  alignas(64) float mbuf[kBlock];
  alignas(64) float rbuf[kBlock];
};

// The largest |m| and sqrt(v) of a block.
struct Maxima {
  float avg, root;
};

// block_int8's first loop: decode, the fp32 step, the block's maxima. The
// decode multipliers are kFromHalf * scale when kFolded (the caller checked that
// they are exact), else kFromHalf, and the scales follow in a second multiply:
// either way the one rounding of the same product.
template <bool kFolded, Decay D, class G>
Maxima step_int8_codes(const Splats& k, V m_mult, V m_scale, V v_mult, V v_scale, const uint16_t* __restrict__ p,
                       const G* __restrict__ g, const uint8_t* __restrict__ m, const uint8_t* __restrict__ v,
                       Int8Buffers& buf) {
  auto decode = [](__m256i halves, V mult, V scale) {
    const V x = _mm512_mul_ps(_mm512_cvtph_ps(halves), mult);
    return kFolded ? x : _mm512_mul_ps(x, scale);
  };
  // The sign-extended code shifted: its sign bit is the half's (bit 15) and its
  // 7-bit magnitude sits below the sign's copies, which the mask clears.
  constexpr uint32_t kMagnitude = (1u << (AvgCode::kMantissaBits + 3)) - 1u;  // compact.EXP_AVG_CODE: 3 + 4 bits
  const __m256i avg_bits = _mm256_set1_epi16(static_cast<short>(0x8000u | (kMagnitude << kHalfShift<AvgCode>)));
  V m_max = _mm512_setzero_ps(), r_max = _mm512_setzero_ps();
  for (int64_t j = 0; j < kBlock; j += 16) {
    const __m128i mc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m + j));
    const __m128i vc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + j));
    const __m256i m_half = _mm256_slli_epi16(_mm256_cvtepi8_epi16(mc), kHalfShift<AvgCode>);
    V avg = decode(_mm256_and_si256(m_half, avg_bits), m_mult, m_scale);
    const V r_old = decode(_mm256_slli_epi16(_mm256_cvtepu8_epi16(vc), kHalfShift<SqrtCode>), v_mult, v_scale);
    V sq = _mm512_mul_ps(r_old, r_old), root;
    _mm512_store_ps(buf.pbuf + j, adam_fp32<D>(k, load_bf16(p + j), load(g + j), avg, sq, root));
    _mm512_store_ps(buf.mbuf + j, avg);
    _mm512_store_ps(buf.rbuf + j, root);
    // max_ps(x, acc) returns acc when x is NaN, and when both are zeros: NaN
    // counts as 0. A square root is never below zero, and a -0 root loses to
    // the +0 accumulator, so the root needs no abs.
    m_max = _mm512_max_ps(abs(avg), m_max);
    r_max = _mm512_max_ps(root, r_max);
  }
  return {_mm512_reduce_max_ps(m_max), _mm512_reduce_max_ps(r_max)};
}

// block_int8's second loop for one block: the new scales, then the roundings
// and codes thirty-two elements at a time (one vector of shared hashes).
class Int8Codes {
 public:
  Int8Codes(const Consts& c, int64_t base, Maxima max)
      : m_new_(max.avg), r_new_(max.root), m_inv_(splat(inverse_scale(m_new_))),
        r_inv_(splat(inverse_scale(r_new_))), hk_(splat(high_key(c, base / 2))),
        index_(_mm512_add_epi32(splat(static_cast<uint32_t>(base / 2) + c.k0),
                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))) {}

  // Elements [j, j + 32), from the block's buffers to memory (block pointers).
  template <class O>
  void encode32(const Int8Buffers& s, int64_t j, uint16_t* __restrict__ p, uint8_t* __restrict__ m,
                uint8_t* __restrict__ v, O* __restrict__ out) {
    // compact.random_bits16_shared: hash lanes 0-7 serve elements 0-7 (high
    // halves) and 8-15 (low halves), lanes 8-15 elements 16-31 likewise. Each
    // permute puts a half-word into the low half of a lane and zeroes the high one.
    const I first_half = _mm512_set_epi16(0, 14, 0, 12, 0, 10, 0, 8, 0, 6, 0, 4, 0, 2, 0, 0,
                                          0, 15, 0, 13, 0, 11, 0, 9, 0, 7, 0, 5, 0, 3, 0, 1);
    const I second_half = _mm512_add_epi16(first_half, _mm512_set1_epi16(16));
    constexpr __mmask32 kLowWords = 0x55555555u;
    const V one = splat(1.0f), zero = _mm512_setzero_ps();
    const I h = mix32(_mm512_xor_si512(index_, hk_));
    index_ = _mm512_add_epi32(index_, splat(16u));
    I p_high[2];
    for (int half = 0; half < 2; ++half) {
      const int64_t e = j + 16 * half;
      const I r16 = _mm512_maskz_permutexvar_epi16(kLowWords, half ? second_half : first_half, h);
      p_high[half] = bf16_sr_high(_mm512_load_ps(s.pbuf + e), r16);
      // min_ps(y, 1) is `y < 1 ? y : 1`, as there (1 for NaN).
      const V avg = _mm512_load_ps(s.mbuf + e), root = _mm512_load_ps(s.rbuf + e);
      const I mag = encode<AvgCode>(_mm512_min_ps(_mm512_mul_ps(abs(avg), m_inv_), one));
      // (sign byte & 128) | mag in one ternary op: A & C | B is 0xEC.
      const I m_code = _mm512_ternarylogic_epi32(_mm512_srli_epi32(bits(avg), 24), mag, splat(128u), 0xEC);
      I v_code = encode<SqrtCode>(_mm512_min_ps(_mm512_mul_ps(root, r_inv_), one));
      // A positive root (root > 0, false for NaN) never gets code 0.
      v_code = _mm512_mask_max_epu32(v_code, _mm512_cmp_ps_mask(root, zero, _CMP_GT_OQ), v_code, splat(1u));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(m + e), _mm512_cvtepi32_epi8(m_code));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(v + e), _mm512_cvtepi32_epi8(v_code));
    }
    const I p32 = pack_high32(p_high[0], p_high[1]);
    store(p + j, p32);
    if constexpr (!std::is_same_v<O, NoOut>) write_out32(out + j, p32);
  }

  float m_new() const { return m_new_; }
  float r_new() const { return r_new_; }

 private:
  float m_new_, r_new_;
  V m_inv_, r_inv_;
  I hk_, index_;
};

// block_int8 on a whole block: the first loop, then the second.
template <Decay D, class G, class O>
void block_int8(const Consts& c, int64_t base, uint16_t* __restrict__ p, const G* __restrict__ g,
                uint8_t* __restrict__ m, uint8_t* __restrict__ v, float* __restrict__ m_scale,
                float* __restrict__ v_scale, O* __restrict__ out) {
  const Splats k(c);
  Int8Buffers buf;
  const float ms = *m_scale, vs = *v_scale;
  const float m_folded = kFromHalf<AvgCode> * ms, v_folded = kFromHalf<SqrtCode> * vs;
  // A folded multiplier is exact unless a finite scale overflows it (exp_avg's above 2**120).
  const bool folded =
      (std::isfinite(m_folded) || !std::isfinite(ms)) && (std::isfinite(v_folded) || !std::isfinite(vs));
  const Maxima max = folded ? step_int8_codes<true, D>(k, splat(m_folded), splat(ms), splat(v_folded), splat(vs), p,
                                                       g, m, v, buf)
                            : step_int8_codes<false, D>(k, splat(kFromHalf<AvgCode>), splat(ms),
                                                        splat(kFromHalf<SqrtCode>), splat(vs), p, g, m, v, buf);
  Int8Codes codes(c, base, max);
  for (int64_t j = 0; j < kBlock; j += 32) codes.encode32(buf, j, p, m, v, out);
  *m_scale = codes.m_new();
  *v_scale = codes.r_new();
}

}  // namespace avx512

#ifdef __clang__
#pragma clang attribute pop
#endif
#pragma GCC pop_options

#endif  // INFINITY_X86
