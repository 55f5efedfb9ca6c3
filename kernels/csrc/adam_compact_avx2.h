// Included by adam_compact.cpp inside its anonymous namespace, after the generic
// block functions it mirrors (not a standalone header: it uses their helpers).
// Kept apart so each file reads as one body of the kernel.

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
inline V widen_bf16(__m128i h) { return floats(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V load_bf16(const uint16_t* p) { return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline V load(const float* g) { return _mm256_loadu_ps(g); }
inline V load(const BF16* g) { return load_bf16(reinterpret_cast<const uint16_t*>(g)); }
inline V load(const F16* g) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g))); }

// Sixteen elements as two vectors: the even ones (0, 2, .., 14) and the odd
// ones. Adam is elementwise, so a block may run in any lane order that every
// operand shares; this one widens sixteen bf16 in two ops (a shift, a mask)
// where the in-order widening takes four (two vpmovzxwd, two shifts), and
// join_high16 packs them back in two instead of four.
struct Pair {
  V even, odd;
};
inline Pair split16(const uint16_t* p) {
  const I w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {floats(_mm256_slli_epi32(w, 16)), floats(_mm256_and_si256(w, splat(0xFFFF0000u)))};
}
// Sixteen fp32 in order (a: 0-7, b: 8-15) into the even/odd order. shuffle_ps
// works per 128-bit half (0 2 8 10 | 4 6 12 14); the permute puts the quarters in order.
inline Pair split16(V a, V b) {
  const V even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
  const V odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
  return {floats(_mm256_permute4x64_epi64(bits(even), 0xD8)), floats(_mm256_permute4x64_epi64(bits(odd), 0xD8))};
}
inline Pair split16(const BF16* g) { return split16(reinterpret_cast<const uint16_t*>(g)); }
inline Pair split16(const float* g) { return split16(load(g), load(g + 8)); }
inline Pair split16(const F16* g) { return split16(load(g), load(g + 8)); }

// Sixteen bf16 in order from the high halves of `even` and `odd` (split16's
// order): each 32-bit word of the result is (even lane, odd lane).
inline I join_high16(I even, I odd) { return _mm256_blend_epi16(_mm256_srli_epi32(even, 16), odd, 0xAA); }

// Consts, broadcast.
struct Splats {
  V decay, l2, coeff, beta2, beta2_complement, neg_step_root, eps_root, avg_mask;
  explicit Splats(const Consts& c)
      : decay(splat(c.decay)), l2(splat(c.l2)), coeff(splat(c.coeff)), beta2(splat(c.beta2)),
        beta2_complement(splat(c.beta2_complement)), neg_step_root(splat(c.neg_step_root)),
        eps_root(splat(c.eps_root)), avg_mask(floats(splat(c.avg_mask))) {}
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
  return _mm256_add_ps(param, _mm256_div_ps(_mm256_mul_ps(k.neg_step_root, avg), _mm256_add_ps(root, k.eps_root)));
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
// bits are junk until pack_high16 or join_high16 drops them). bf16_sr's special
// case needs no select here: an infinity plus r16 < 2**16 truncates back to
// itself, so only NaN differs from `rounded`, and OR-ing it with all ones gives
// 0xFFFF. kMayBeNaN false leaves that OR out, for blocks known to hold no NaN.
inline I nan_mask(V x) { return bits(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
template <bool kMayBeNaN = true>
inline I bf16_sr_high(V x, I r16) {
  const I rounded = _mm256_add_epi32(bits(x), r16);
  if constexpr (kMayBeNaN) return _mm256_or_si256(rounded, nan_mask(x));
  return rounded;
}
template <bool kMayBeNaN = true>
inline I bf16_rne_high(V x) {
  const I u = bits(x);
  const I lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), splat(1u));
  const I rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, splat(0x7FFFu)));
  if constexpr (kMayBeNaN) return _mm256_or_si256(rounded, nan_mask(x));
  return rounded;
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

// write_out for sixteen elements: `packed` is the sixteen bf16 in order; fp32
// and fp16 copies widen them back from it, whatever lane order the block kept.
inline V widen_low8(I packed) { return widen_bf16(_mm256_castsi256_si128(packed)); }
inline V widen_high8(I packed) { return widen_bf16(_mm256_extracti128_si256(packed, 1)); }
inline void write_out16(NoOut*, I) {}
inline void write_out16(BF16* out, I packed) { store(out, packed); }
inline void write_out16(float* out, I packed) {
  _mm256_storeu_ps(out, widen_low8(packed));
  _mm256_storeu_ps(out + 8, widen_high8(packed));
}
inline void write_out16(F16* out, I packed) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(widen_low8(packed), kRound));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), _mm256_cvtps_ph(widen_high8(packed), kRound));
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
// The even elements' random-bit indices from `base`: lane l is base + 2l.
inline I first_even_index(const Consts& c, int64_t base) {
  return _mm256_add_epi32(splat(static_cast<uint32_t>(base) + c.k0), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
}

// block_bf16's second loop: the new master, moments and compute copy of one
// block from the buffers (even/odd order) to memory (in order).
template <bool kMayBeNaN, class O>
void round_bf16_states(const Consts& c, int64_t base, const float* pbuf, const float* mbuf, const float* vbuf,
                       uint16_t* __restrict__ p, uint16_t* __restrict__ m, uint16_t* __restrict__ v,
                       O* __restrict__ out) {
  const I hk = splat(high_key(c, base));
  I even_index = first_even_index(c, base);
  for (int64_t j = 0; j < kBlock; j += 16) {
    I p_high[2], m_high[2], v_high[2];
    for (int odd = 0; odd < 2; ++odd) {
      const int64_t e = j + 8 * odd;
      // compact.random_bits of elements j + 2l + odd
      const I h = mix32(_mm256_xor_si256(odd ? _mm256_add_epi32(even_index, splat(1u)) : even_index, hk));
      p_high[odd] = bf16_sr_high<kMayBeNaN>(_mm256_load_ps(pbuf + e), _mm256_srli_epi32(h, 16));
      m_high[odd] = bf16_rne_high<kMayBeNaN>(_mm256_load_ps(mbuf + e));
      v_high[odd] = bf16_sr_high<kMayBeNaN>(_mm256_load_ps(vbuf + e), _mm256_and_si256(h, splat(0xFFFFu)));
    }
    even_index = _mm256_add_epi32(even_index, splat(16u));
    const I p16 = join_high16(p_high[0], p_high[1]);
    store(p + j, p16);
    store(m + j, join_high16(m_high[0], m_high[1]));
    store(v + j, join_high16(v_high[0], v_high[1]));
    if constexpr (!std::is_same_v<O, NoOut>) write_out16(out + j, p16);
  }
}

// block_bf16 on a whole block, in two loops as there: the fp32 step into L1
// buffers, then the hashes, roundings and stores in loops of sixteen elements
// (one store per state). One loop with both ran 1.2x slower: the roundings wait
// on the divisions and fill the out-of-order window.
//
// Both loops hold sixteen elements as their even and odd halves (split16,
// join_high16); the buffers keep that order (the even eight, then the odd
// eight). The hashes follow: the even vector's lane l is element 2l.
//
// The first loop also notes whether any new master, moment or square is NaN
// (or whether master + moment is: inf - inf gives a false alarm, which only
// takes the slower, equally exact path). Without one, the roundings need no
// NaN lanes: 6 compares and 6 ORs less per sixteen elements.
template <Decay D, class G, class O>
void block_bf16(const Consts& c, int64_t base, uint16_t* __restrict__ p, const G* __restrict__ g,
                uint16_t* __restrict__ m, uint16_t* __restrict__ v, O* __restrict__ out) {
  alignas(32) float pbuf[kBlock];
  alignas(32) float mbuf[kBlock];
  alignas(32) float vbuf[kBlock];
  const Splats k(c);
  V unordered = _mm256_setzero_ps();
  for (int64_t j = 0; j < kBlock; j += 16) {
    const Pair param = split16(p + j), grad = split16(g + j);
    Pair avg = split16(m + j), sq = split16(v + j);
    V root;
    const V p_even = adam_fp32<D>(k, param.even, grad.even, avg.even, sq.even, root);
    const V p_odd = adam_fp32<D>(k, param.odd, grad.odd, avg.odd, sq.odd, root);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(_mm256_add_ps(p_even, avg.even), sq.even, _CMP_UNORD_Q));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(_mm256_add_ps(p_odd, avg.odd), sq.odd, _CMP_UNORD_Q));
    _mm256_store_ps(pbuf + j, p_even);
    _mm256_store_ps(pbuf + j + 8, p_odd);
    _mm256_store_ps(mbuf + j, avg.even);
    _mm256_store_ps(mbuf + j + 8, avg.odd);
    _mm256_store_ps(vbuf + j, sq.even);
    _mm256_store_ps(vbuf + j + 8, sq.odd);
  }
  if (_mm256_movemask_ps(unordered) != 0) {
    round_bf16_states<true>(c, base, pbuf, mbuf, vbuf, p, m, v, out);
  } else {
    round_bf16_states<false>(c, base, pbuf, mbuf, vbuf, p, m, v, out);
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
  const V m_inv = splat(inverse_scale(m_new)), r_inv = splat(inverse_scale(r_new));
  const V one = splat(1.0f), zero = _mm256_setzero_ps();
  // compact.random_bits16_shared: each vector of eight hashes serves sixteen
  // elements, the first eight with its high halves, the next with its low.
  const I hk = splat(high_key(c, base / 2));
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
      write_out16(out + j, p16_lo);
      write_out16(out + j + 16, p16_hi);
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
