// CPU paged attention: every new token of a flat batch attends to its sequence's keys,
// read in place from the paged cache through the block table (no gathered copy).
//
// The cache layout is this backend's own ("cpu-packed"): each layer's k_cache and v_cache
// are [blocks, kv_heads, block_size, head_dim], and each (block, KV head) holds tiles of
// KEYS keys, K as [head_dim / 2][KEYS][2] and V as [KEYS / 2][head_dim][2]. A key tile is
// what a dot product over head_dim takes with the keys in the lanes (16 keys' bf16 pairs per
// 512-bit vector, as vdpbf16ps or an AMX B tile of Q*K^T takes them), and a value tile what
// P*V takes (pairs of keys in each 32-bit word), so decodes need no transposing or packing
// per step.
// reshape_and_cache writes new tokens so; KV transfer converts to the standard layout.
//
// Work is split into items (sequence, tile of up to kQueryTile new tokens), taken by
// torch's intra-op threads from a shared counter, so a long chunk's tiles and many short
// decodes spread evenly; a tile that attends to many keys becomes one item per KV head.
// Softmax is online (flash style) in fp32, in base 2 (scores are scaled by
// scale * log2(e)). A soft cap C (Gemma 2's attn_logit_softcapping) replaces each scaled
// score s by C * tanh(s / C) first; in base 2 that is C' * tanh(s' / C') with C' = C * log2(e).
// The cache holds the query's dtype, or FP8 (float8_e4m3fn, --kv-cache-dtype fp8): keys and
// values are widened to fp32 as a chunk is read, through a 256-entry table. Three paths:
// - attend_item, any dtype and ISA: keys in chunks of KEYS, converted to fp32 once per chunk
//   and head, serving every query row of the head (the GQA group times the tile's tokens);
//   plain loops the compiler vectorizes for the ISA it is given (AVX-512 with
//   -march=native, AVX2 with x86-64-v3).
// - bf16 on AVX512_BF16, tiles of 16 rows or more: attend_rows_bf16, vdpbf16ps with rows
//   in the lanes.
// - bf16 on AVX512_BF16, fewer rows (decodes): attend_few_rows_bf16, vdpbf16ps with keys
//   in the lanes.
//   Both bf16 paths cap scores with soft_cap_v, the vector form of attend_item's soft_cap,
//   and read an FP8 cache widened to bf16 (widen32): the decode path in registers as it
//   loads (a pair's last, partial tiles through scratch), the rows path tile by tile into
//   scratch (tile_words).
//
// Ops (namespace tidegate_cpu):
//   paged_attention(out, query, k_cache, v_cache, query_start_loc, seq_lens, block_table,
//                   scale, sliding_window, logits_soft_cap, max_query_len)
//     Sequences with more than max_query_len new tokens (when > 0) are skipped: their rows
//     of `out` are left for the caller.
//   reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
//     Into an FP8 cache, keys and values are clipped to +-448 and rounded first.
//   gather_kv(k_cache, v_cache, block_ids, seq_len) -> (keys, values), [kv_heads, seq_len,
//     head_dim] each: a sequence's context in the standard order, for SDPA
//   begin_step(k_caches, v_caches, query_start_loc, seq_lens, block_table, slot_mapping,
//              max_query_len), end_step()
//   attend(query, k_cache, v_cache, query_start_loc, seq_lens, block_table, num_tokens,
//          scale, sliding_window, logits_soft_cap, max_query_len) -> out
//     The kernel for sequences of up to max_query_len new tokens; longer ones (where the CPU
//     has AMX) as flash attention on oneDNN's brgemm in bf16, else SDPA over their context
//     gathered from the tiles (widened from FP8). Those paths have no window and no cap:
//     with either, the kernel takes every sequence, whatever max_query_len says.
//   layer_attention(query, key, value, layer, scale, sliding_window, logits_soft_cap) -> out
//     One layer's whole attention within a step: reshape_and_cache, then attend. The step's
//     caches and metadata are set once by begin_step, so a compiled graph calls this op
//     directly, with no Python in between (the Python path cost about 40 us a layer). The
//     window and the cap are the layer's own (layers of one model differ).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TIDEGATE_BF16_TILES 1
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int KEYS = 16;       // keys per chunk: one AVX-512 vector of fp32 scores
constexpr int kQueryTile = 16;  // new tokens per work item of a prefill chunk
constexpr int kTransposeRows = 8;  // from this many query rows, scores use K transposed
// From this many (new token, key) pairs a tile is split into one work item per KV head.
constexpr int64_t kSplitPairs = 8192;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the top half of an fp32: a shift the compiler vectorizes (static_cast may not).
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// An FP8 (e4m3fn) cache element: its byte, widened through a table (a load the compiler
// can vectorize as a gather, where c10's conversion branches per element).
struct Fp8 {
  uint8_t bits;
};
const std::array<float, 256> kFp8Values = [] {
  std::array<float, 256> values{};
  for (int i = 0; i < 256; ++i) {
    values[i] = static_cast<float>(
        c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
  return values;
}();
inline float to_float(Fp8 x) { return kFp8Values[x.bits]; }

// 2^x for x <= 0, within ~1e-7 relative; 0 below -126 (and for -inf). Plain arithmetic the
// compiler vectorizes, unlike std::exp2: 2^x = 2^n * 2^f, n = round(x), f in [-0.5, 0.5],
// 2^f by its Taylor series to degree 7 (truncation error < 1e-8).
inline float exp2_nonpositive(float x) {
  const float xc = std::max(x, -126.f);
  const float n = std::floor(xc + 0.5f);
  const float f = xc - n;
  float p = 1.5252734e-5f;
  p = p * f + 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -126.f ? 0.f : p * two_n;
}

// C * tanh(s / C) for a cap C > 0: tanh(y) = (1 - e) / (1 + e), e = exp(-2|y|), with the
// sign of s; below |y| = 1/16, where 1 - e cancels, its series to y^7 (truncation < 1e-12).
// Plain arithmetic, so the loops over a chunk's scores vectorize. NaN stays NaN.
inline float soft_cap(float s, float cap) {
  const float y = std::fabs(s) / cap;
  const float e = exp2_nonpositive(-2.f * kLog2e * y);
  const float y2 = y * y;
  const float series = y * (1.f + y2 * (-1.f / 3 + y2 * (2.f / 15 + y2 * (-17.f / 315))));
  const float t = y < 0.0625f ? series : (1.f - e) / (1.f + e);
  return std::copysign(cap * t, s);
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);  // round to nearest even for Half and BFloat16
}

struct Item {
  int32_t seq;
  int32_t first;  // first new token of the tile, as an offset into the sequence's chunk
  int32_t head_lo, head_hi;  // the KV heads it computes: all, or one of a long tile's
};

// Sizes and strides shared by every item of one call.
struct Problem {
  int64_t num_heads, num_kv_heads, group, head_dim;
  int64_t q_tok, q_head, o_tok, o_head;               // query/out strides
  int64_t cache_blk, cache_head, tile_elems;  // elements per block, block-head, tile
  int64_t bt_row, max_blocks, block_size;
  float scale_log2;  // softmax scale * log2(e)
  int64_t window;    // 0: none
  float cap_log2;    // the soft cap times log2(e), in the scores' base-2 units; 0: none
};

// The caches' layout (see the top of the file): the KEYS-key tile of a sequence's keys or
// values that holds position `start` (a multiple of KEYS), for KV head h.
template <typename T>
inline const T* cache_tile(const Problem& p, const T* cache, const int32_t* table, int64_t start,
                           int64_t h) {
  return cache + table[start / p.block_size] * p.cache_blk + h * p.cache_head +
         start % p.block_size / KEYS * p.tile_elems;
}
// Offsets of key t, element d within a tile: K as [head / 2][KEYS][2], V as
// [KEYS / 2][head][2].
inline int64_t k_offset(int t, int d) { return (d >> 1) * (2 * KEYS) + 2 * t + (d & 1); }
inline int64_t v_offset(int t, int d, int64_t head) { return (t >> 1) * 2 * head + 2 * d + (t & 1); }

#ifdef TIDEGATE_BF16_TILES
// bf16 tiles on AVX512_BF16 (vdpbf16ps: 32 bf16 products summed pairwise into 16 fp32 lanes
// per instruction, twice the fp32 FMA rate): one KV head's rows of a prefill tile, 16 rows
// to a vector, up to kTileVectors vectors at a time. Rows sit in the lanes, so a key's
// scores for 16 rows come out of one accumulator and the softmax over keys is lane-wise:
// no horizontal sums and no transposed copy of K, whose bf16 words (pairs of head_dim
// elements) are broadcast straight from the cache against the query packed once per tile.
// Probabilities are rounded to bf16 for P*V (as flash attention does on GPUs); scores,
// softmax statistics and accumulators stay fp32.
constexpr int kLanes = 16;
constexpr int kTileVectors = 4;  // row vectors of one block: at most 64 rows
constexpr int kTileRows = kLanes * kTileVectors;
constexpr int kKeyGroup = 4;     // keys whose scores accumulate together in registers
// Rows from which a tile takes the bf16 path: a full vector.
constexpr int kBf16MinRows = kLanes;

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// A tile of values whose keys from n on are past the sequence's end (stale data, even NaN),
// copied with those keys' halves of each word zeroed: 0 * NaN would poison P*V.
template <int HEAD>
inline const uint32_t* partial_values(const uint32_t* tile, int n, uint32_t* copy) {
  for (int u = 0; u < KEYS / 2; ++u) {
    const uint32_t keep = 2 * u + 1 < n ? 0xffffffffu : (2 * u < n ? 0x0000ffffu : 0u);
    for (int d = 0; d < HEAD; ++d) copy[u * HEAD + d] = tile[u * HEAD + d] & keep;
  }
  return copy;
}

// A tile as bf16 words: a bf16 cache's own (nothing copied), an FP8 cache's widened into
// `out` (KEYS * HEAD elements, in the tile's order). e4m3fn's bits, placed as an fp16's
// (sign, exponent, mantissa: the fp16 of 2^-8 times the value, subnormals included), are
// widened to fp32 and multiplied by 256: exact, as is the rounding to bf16 that follows
// (3 mantissa bits fit in 7). The one NaN code stays NaN. 32 elements per step.
template <int HEAD>
inline const uint32_t* tile_words(const c10::BFloat16* tile, uint32_t* /*out*/) {
  return reinterpret_cast<const uint32_t*>(tile);
}
inline __m512i widen32(const uint8_t* src) {
  const __m512i low7 = _mm512_set1_epi16(0x7f);
  const __m512 k256 = _mm512_set1_ps(256.f);
  const __m512i b =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i magnitude = _mm512_and_si512(b, low7);
  const __m512i half = _mm512_or_si512(
      _mm512_slli_epi16(_mm512_andnot_si512(low7, b), 8), _mm512_slli_epi16(magnitude, 7));
  const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(half)), k256);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)), k256);
  const __m512i words = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  return _mm512_mask_mov_epi16(words, _mm512_cmpeq_epi16_mask(magnitude, low7),
                               _mm512_set1_epi16(0x7fc0));
}
inline void widen_fp8(const uint8_t* src, int64_t count, uint32_t* out) {
  for (int64_t i = 0; i < count; i += 32) _mm512_storeu_si512(out + i / 2, widen32(src + i));
}
template <int HEAD>
inline const uint32_t* tile_words(const Fp8* tile, uint32_t* out) {
  widen_fp8(reinterpret_cast<const uint8_t*>(tile), KEYS * HEAD, out);
  return out;
}

// exp2_nonpositive on 16 lanes: the same split and polynomial.
inline __m512 exp2_nonpositive_v(__m512 x) {
  // vmaxps answers its second operand when one is NaN: a NaN score stays NaN.
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-126.f), x);
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 p = _mm512_set1_ps(1.5252734e-5f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-4f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 r = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_LT_OQ),
                            _mm512_setzero_ps());
}

// soft_cap on 16 lanes (cap > 0, in the scores' units): the same split at |y| = 1/16.
inline __m512 soft_cap_v(__m512 s, float cap) {
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512 y = _mm512_div_ps(_mm512_abs_ps(s), _mm512_set1_ps(cap));
  const __m512 e = exp2_nonpositive_v(_mm512_mul_ps(y, _mm512_set1_ps(-2.f * kLog2e)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 ratio = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 y2 = _mm512_mul_ps(y, y);
  __m512 series = _mm512_fmadd_ps(y2, _mm512_set1_ps(-17.f / 315), _mm512_set1_ps(2.f / 15));
  series = _mm512_fmadd_ps(y2, series, _mm512_set1_ps(-1.f / 3));
  series = _mm512_fmadd_ps(y2, series, one);
  series = _mm512_mul_ps(y, series);
  const __m512 t = _mm512_mask_blend_ps(
      _mm512_cmp_ps_mask(y, _mm512_set1_ps(0.0625f), _CMP_LT_OQ), ratio, series);
  const __m512 capped = _mm512_mul_ps(t, _mm512_set1_ps(cap));  // |s| capped, NaN kept
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(s), sign_bit);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(capped), sign));
}

// Scores of 16 lanes as the softmax takes them: scaled (to base 2), then capped if the
// layer caps them.
inline __m512 scaled_scores(const Problem& p, __m512 dots) {
  const __m512 scores = _mm512_mul_ps(dots, _mm512_set1_ps(p.scale_log2));
  return p.cap_log2 > 0.f ? soft_cap_v(scores, p.cap_log2) : scores;
}

// Floats of scratch one row block needs, for the largest head size.
constexpr int64_t bf16_scratch_floats(int64_t head) {
  return head / 2 * kTileRows      // packed query: [head / 2][rows] bf16 pairs
         + head * kTileRows        // accumulators: [head][rows]
         + KEYS * kTileRows        // scores and probabilities: [KEYS][rows]
         + KEYS / 2 * kTileRows    // probabilities packed in pairs of keys: [KEYS / 2][rows]
         + KEYS / 2 * head         // values packed in pairs of keys: [KEYS / 2][head]
         + 4 * kTileRows           // row max, row sum, position, alpha
         + KEYS * head;            // an FP8 cache's key and value tiles, widened
}

template <int HEAD, int RV, typename C>
void attend_rows_bf16(const Problem& p, const Item& item, int h, int row_lo, int nrows,
                      const c10::BFloat16* query, const C* k_cache,
                      const C* v_cache, c10::BFloat16* out,
                      const int32_t* query_start_loc, const int32_t* seq_lens,
                      const int32_t* block_table, float* scratch) {
  constexpr int W = HEAD / 2;  // 32-bit words (pairs of bf16) of a head's row
  constexpr int R = RV * kLanes;
  static_assert(HEAD % 16 == 0, "values are packed 16 head_dim elements at a time");
  const int64_t start = query_start_loc[item.seq];
  const int64_t query_len = query_start_loc[item.seq + 1] - start;
  const int64_t context_len = seq_lens[item.seq] - query_len;
  const int tile = static_cast<int>(std::min<int64_t>(kQueryTile, query_len - item.first));
  const int group = static_cast<int>(p.group);

  uint32_t* __restrict__ qp = reinterpret_cast<uint32_t*>(scratch);  // [W][R]
  float* __restrict__ acc = scratch + W * R;                        // [HEAD][R]
  float* __restrict__ s = acc + HEAD * R;                           // [KEYS][R]
  uint32_t* __restrict__ pp = reinterpret_cast<uint32_t*>(s + KEYS * R);  // [KEYS/2][R]
  uint32_t* __restrict__ vz = pp + KEYS / 2 * R;                    // [KEYS/2][HEAD]
  float* __restrict__ row_max = reinterpret_cast<float*>(vz + KEYS / 2 * HEAD);
  float* __restrict__ row_sum = row_max + R;
  float* __restrict__ pos = row_sum + R;  // each row's position, as a float (exact < 2^24)
  float* __restrict__ alpha = pos + R;
  uint32_t* __restrict__ kwide = reinterpret_cast<uint32_t*>(alpha + R);  // [W][KEYS]
  uint32_t* __restrict__ vwide = kwide + W * KEYS;                        // [KEYS/2][HEAD]

  // Row r of the block is row row_lo + r of the head: token (row_lo + r) / group, query
  // head h * group + (row_lo + r) % group. Lanes past nrows get a zero query.
  const int64_t first_pos = context_len + item.first;
  for (int r = 0; r < R; ++r) {
    const int row = row_lo + std::min(r, nrows - 1);
    const int64_t token = start + item.first + row / group;
    const int64_t head = h * p.group + row % group;
    const uint32_t* src = reinterpret_cast<const uint32_t*>(query + token * p.q_tok + head * p.q_head);
    for (int w = 0; w < W; ++w) qp[w * R + r] = r < nrows ? src[w] : 0u;
    pos[r] = static_cast<float>(first_pos + row / group);
    row_max[r] = kNegInf;
    row_sum[r] = 0.f;
  }
  for (int i = 0; i < HEAD * R; ++i) acc[i] = 0.f;

  const int64_t last_pos = first_pos + (row_lo + nrows - 1) / group;
  const int64_t block_first_pos = first_pos + row_lo / group;
  const int64_t key_end = last_pos + 1;
  const int64_t key_begin =
      p.window > 0 ? std::max<int64_t>(0, block_first_pos - p.window + 1) : 0;
  const int32_t* table = block_table + item.seq * p.bt_row;
  // vpermw indices that interleave two 16-element halves: (a0, b0, a1, b1, ...).
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);

  for (int64_t chunk = key_begin / KEYS; chunk * KEYS < key_end; ++chunk) {
    const int64_t block_start = chunk * KEYS;
    const int n = static_cast<int>(std::min<int64_t>(KEYS, key_end - block_start));
    const bool all_visible = n == KEYS && block_start + KEYS - 1 <= block_first_pos &&
                             (p.window == 0 || block_start > last_pos - p.window);
    // Keys past the sequence's end (stale data, even NaN) are masked; their values read as
    // zeros (partial_values).
    const uint32_t* kw = tile_words<HEAD>(cache_tile(p, k_cache, table, block_start, h), kwide);
    const uint32_t* vp = tile_words<HEAD>(cache_tile(p, v_cache, table, block_start, h), vwide);
    if (n < KEYS) vp = partial_values<HEAD>(vp, n, vz);

    // Scores: s[t][r] = q_r . k_t, kKeyGroup keys by RV row vectors in registers.
    for (int t0 = 0; t0 < KEYS; t0 += kKeyGroup) {
      __m512 sc[kKeyGroup][RV];
#pragma GCC unroll 16
      for (int j = 0; j < kKeyGroup; ++j)
#pragma GCC unroll 4
        for (int v = 0; v < RV; ++v) sc[j][v] = _mm512_setzero_ps();
      for (int w = 0; w < W; ++w) {
        __m512i qv[RV];
#pragma GCC unroll 4
        for (int v = 0; v < RV; ++v) qv[v] = _mm512_loadu_si512(qp + w * R + v * kLanes);
#pragma GCC unroll 16
        for (int j = 0; j < kKeyGroup; ++j) {
          const __m512i kv = _mm512_set1_epi32(static_cast<int>(kw[w * KEYS + t0 + j]));
#pragma GCC unroll 4
          for (int v = 0; v < RV; ++v) sc[j][v] = _mm512_dpbf16_ps(sc[j][v], as_bh(qv[v]), as_bh(kv));
        }
      }
      for (int j = 0; j < kKeyGroup; ++j)
        for (int v = 0; v < RV; ++v)
          _mm512_storeu_ps(s + (t0 + j) * R + v * kLanes, scaled_scores(p, sc[j][v]));
    }
    // Online softmax, lane-wise: each row's max over the chunk (keys it may not see are
    // -inf), the rescale of what it had, and the chunk's probabilities in place of scores.
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) {
      const __m512 row_pos = _mm512_loadu_ps(pos + v * kLanes);
      __m512 m = _mm512_loadu_ps(row_max + v * kLanes);
      __m512 sv[KEYS];
#pragma GCC unroll 16
      for (int t = 0; t < KEYS; ++t) {
        sv[t] = _mm512_loadu_ps(s + t * R + v * kLanes);
        if (!all_visible) {
          const __m512 key = _mm512_set1_ps(static_cast<float>(block_start + t));
          // Keys past the chunk's end (t >= n) are past every row's position too.
          __mmask16 hidden = _mm512_cmp_ps_mask(key, row_pos, _CMP_GT_OQ);
          if (p.window > 0) {
            const __m512 lo = _mm512_sub_ps(row_pos, _mm512_set1_ps(static_cast<float>(p.window)));
            hidden |= _mm512_cmp_ps_mask(key, lo, _CMP_LE_OQ);
          }
          sv[t] = _mm512_mask_mov_ps(sv[t], hidden, _mm512_set1_ps(kNegInf));
        }
        m = _mm512_max_ps(m, sv[t]);
      }
      // A row that has seen nothing yet stays empty: shift by 0, not by -inf.
      const __m512 shift = _mm512_mask_mov_ps(
          m, _mm512_cmp_ps_mask(m, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ), _mm512_setzero_ps());
      const __m512 old_max = _mm512_loadu_ps(row_max + v * kLanes);
      const __m512 a = exp2_nonpositive_v(_mm512_sub_ps(old_max, shift));
      __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int t = 0; t < KEYS; ++t) {
        const __m512 e = exp2_nonpositive_v(_mm512_sub_ps(sv[t], shift));
        _mm512_storeu_ps(s + t * R + v * kLanes, e);
        sum = _mm512_add_ps(sum, e);
      }
      _mm512_storeu_ps(alpha + v * kLanes, a);
      _mm512_storeu_ps(row_max + v * kLanes, m);
      _mm512_storeu_ps(row_sum + v * kLanes,
                       _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + v * kLanes), a, sum));
    }
    // Probabilities to bf16, keys in pairs: word (p[2u][r], p[2u+1][r]) per lane.
    for (int u = 0; u < KEYS / 2; ++u) {
#pragma GCC unroll 4
      for (int v = 0; v < RV; ++v) {
        const __m512 even = _mm512_loadu_ps(s + (2 * u) * R + v * kLanes);
        const __m512 odd = _mm512_loadu_ps(s + (2 * u + 1) * R + v * kLanes);
        // Low half from the second operand: [even 0..15 | odd 0..15], then interleaved.
        const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
        _mm512_storeu_si512(pp + u * R + v * kLanes, _mm512_permutexvar_epi16(interleave, halves));
      }
    }
    // acc[d][r] = acc[d][r] * alpha[r] + sum over keys of p[t][r] * v[t][d].
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) {
      __m512i pv[KEYS / 2];
#pragma GCC unroll 8
      for (int u = 0; u < KEYS / 2; ++u) pv[u] = _mm512_loadu_si512(pp + u * R + v * kLanes);
      const __m512 av = _mm512_loadu_ps(alpha + v * kLanes);
      for (int d = 0; d < HEAD; ++d) {
        float* a = acc + d * R + v * kLanes;
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(a), av);
#pragma GCC unroll 8
        for (int u = 0; u < KEYS / 2; ++u) {
          x = _mm512_dpbf16_ps(x, as_bh(pv[u]), as_bh(_mm512_set1_epi32(static_cast<int>(vp[u * HEAD + d]))));
        }
        _mm512_storeu_ps(a, x);
      }
    }
  }

  for (int r = 0; r < nrows; ++r) {
    const int row = row_lo + r;
    const int64_t token = start + item.first + row / group;
    const int64_t head = h * p.group + row % group;
    c10::BFloat16* dst = out + token * p.o_tok + head * p.o_head;
    const float inv = 1.f / row_sum[r];  // every row sees at least its own key
    for (int d = 0; d < HEAD; ++d) dst[d] = from_float<c10::BFloat16>(acc[d * R + r] * inv);
  }
  (void)tile;
}

// A bf16 tile's rows, one KV head and up to kTileRows rows at a time.
template <int HEAD, typename C>
void attend_item_bf16(const Problem& p, const Item& item, int rows, const c10::BFloat16* query,
                      const C* k_cache, const C* v_cache,
                      c10::BFloat16* out, const int32_t* qsl, const int32_t* sl,
                      const int32_t* bt, float* scratch) {
  for (int h = item.head_lo; h < item.head_hi; ++h) {
    for (int lo = 0; lo < rows; lo += kTileRows) {
      const int n = std::min(kTileRows, rows - lo);
      const int vectors = (n + kLanes - 1) / kLanes;
#define TIDEGATE_RV(V)                                                                   \
  case V:                                                                               \
    attend_rows_bf16<HEAD, V, C>(p, item, h, lo, n, query, k_cache, v_cache, out, qsl, sl, \
                              bt, scratch);                                             \
    break;
      switch (vectors) {
        TIDEGATE_RV(1)
        TIDEGATE_RV(2)
        TIDEGATE_RV(3)
        TIDEGATE_RV(4)
      }
#undef TIDEGATE_RV
    }
  }
}

constexpr int kSegmentPairs = 16;  // 512 keys; their scores take 8 KB of stack for 4 rows

// Decodes: tiles of fewer than kBf16MinRows rows per KV head (the GQA group times the
// tile's tokens). Each KV head's keys and values are read straight from the cache, whose
// layout is what vdpbf16ps takes: keys as bf16-pair words with 16 keys in a vector, against
// a row's broadcast query words; values in pairs of keys, against a row's broadcast pair of
// probabilities. Nothing is transposed or packed per step. The online softmax steps over
// two tiles (2 * KEYS keys) at a time, in segments of kSegmentPairs pairs: a segment's
// scores first (its keys only), then its softmax steps and values; while a pair's keys are
// read, a line of each of the next pair's key tiles and of its own value tiles is
// prefetched per step. Decodes of 16 sequences of 600 tokens over 12 layers' caches (bound
// by DRAM, as the engine's are) took 0.59 ms a layer against 0.70 with one pair's keys,
// softmax and values in turn and the next pair prefetched at once (cpu_attention.py).
struct FewRows {
  int64_t h;                          // KV head
  int64_t key_begin, key_end;         // keys [key_begin, key_end) of the sequence
  int64_t first_pos, last_pos;        // positions of the tile's first and last rows
  const int32_t* table;               // the sequence's block table row
  const c10::BFloat16* q[kLanes];     // each row's query
  c10::BFloat16* o[kLanes];           // each row's output
  float pos[kLanes];                  // each row's position
};

// Floats of scratch a few-row tile needs: a partial tile's values, [KEYS / 2][head] words,
// and for an FP8 cache a segment's tiles widened to bf16 (four per pair).
constexpr int64_t bf16_few_rows_scratch_floats(int64_t head, bool fp8) {
  return KEYS / 2 * head + (fp8 ? kSegmentPairs * 2 * KEYS * head : 0);
}

const __m512 kLaneOffsets =
    _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);

// A row's scores of the 2 * KEYS keys from `base` (a: the first KEYS, b: the rest) with the
// keys it may not see (after its position, or outside the window) at -inf.
inline void mask_pair(const Problem& p, __m512& a, __m512& b, int64_t base, float pos) {
  const __m512 ka = _mm512_add_ps(_mm512_set1_ps(static_cast<float>(base)), kLaneOffsets);
  const __m512 kb = _mm512_add_ps(ka, _mm512_set1_ps(static_cast<float>(KEYS)));
  const __m512 last = _mm512_set1_ps(pos);
  __mmask16 ha = _mm512_cmp_ps_mask(ka, last, _CMP_GT_OQ);
  __mmask16 hb = _mm512_cmp_ps_mask(kb, last, _CMP_GT_OQ);
  if (p.window > 0) {
    const __m512 lo = _mm512_set1_ps(pos - static_cast<float>(p.window));
    ha |= _mm512_cmp_ps_mask(ka, lo, _CMP_LE_OQ);
    hb |= _mm512_cmp_ps_mask(kb, lo, _CMP_LE_OQ);
  }
  a = _mm512_mask_mov_ps(a, ha, _mm512_set1_ps(kNegInf));
  b = _mm512_mask_mov_ps(b, hb, _mm512_set1_ps(kNegInf));
}

// One online-softmax step of a row over 2 * KEYS scores (scaled, masked): updates its max
// and sum, writes its probabilities as bf16 (word u: keys 2u and 2u + 1) and answers the
// factor its accumulators take.
inline float softmax_pair(__m512 a, __m512 b, float& row_max, float& row_sum, uint32_t* pw) {
  const float new_max = std::max(row_max, _mm512_reduce_max_ps(_mm512_max_ps(a, b)));
  if (new_max == kNegInf) {  // nothing visible to the row yet
    std::memset(pw, 0, KEYS * sizeof(uint32_t));
    return 1.f;
  }
  const __m512 m = _mm512_set1_ps(new_max);
  const __m512 ea = exp2_nonpositive_v(_mm512_sub_ps(a, m));
  const __m512 eb = exp2_nonpositive_v(_mm512_sub_ps(b, m));
  const float alpha = exp2_nonpositive(row_max - new_max);  // 0 the first time
  row_sum = row_sum * alpha + _mm512_reduce_add_ps(_mm512_add_ps(ea, eb));
  row_max = new_max;
  _mm512_storeu_si512(pw, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(eb, ea)));
  return alpha;
}

// The tiles of keys and values from `base` for the pair step: the second tile may be past
// the sequence (then the first stands in; its scores are masked), a partial tile's values
// are copied with the stale keys zeroed.
struct PairTiles {
  const uint32_t *k0, *k1, *v0, *v1;
  const char *nk0, *nk1;  // the next pair's key tiles, to prefetch
  bool second;
  // An FP8 pair with no partial tile: its tiles' bytes, widened in registers as they are
  // loaded (words_at) instead of into scratch (k0..v1 unset).
  bool raw;
  const uint8_t *rk0, *rk1, *rv0, *rv1;
};

// 16 words (32 bf16) of a pair's tile from word `word`: loaded, or widened from FP8 bytes.
template <typename C>
inline __m512bh words_at(const PairTiles& t, const uint32_t* words, const uint8_t* raw,
                         int64_t word) {
  if constexpr (std::is_same_v<C, Fp8>) {
    if (t.raw) return as_bh(widen32(raw + 2 * word));
  }
  return as_bh(_mm512_loadu_si512(words + word));
}
// `wide`: for an FP8 cache, room for four tiles widened to bf16 (the pair's keys, then its
// values).
template <int HEAD, typename C>
inline PairTiles pair_tiles(const Problem& p, const FewRows& f, const C* k_cache,
                            const C* v_cache, int64_t base, uint32_t* vz, uint32_t* wide) {
  constexpr int kTileWords = KEYS * HEAD / 2;
  PairTiles t{};
  t.second = base + KEYS < f.key_end;
  const int64_t n = f.key_end - base;
  // The next pair's key tiles (this pair's when it is the last): prefetched while this
  // pair computes.
  const int64_t next = base + 2 * KEYS < f.key_end ? base + 2 * KEYS : base;
  t.nk0 = reinterpret_cast<const char*>(cache_tile(p, k_cache, f.table, next, f.h));
  t.nk1 = next + KEYS < f.key_end
              ? reinterpret_cast<const char*>(cache_tile(p, k_cache, f.table, next + KEYS, f.h))
              : t.nk0;
  if constexpr (std::is_same_v<C, Fp8>) {
    if (n >= KEYS && !(t.second && n < 2 * KEYS)) {  // no stale keys to zero
      const auto bytes = [](const Fp8* x) { return reinterpret_cast<const uint8_t*>(x); };
      t.raw = true;
      t.rk0 = bytes(cache_tile(p, k_cache, f.table, base, f.h));
      t.rv0 = bytes(cache_tile(p, v_cache, f.table, base, f.h));
      t.rk1 = t.second ? bytes(cache_tile(p, k_cache, f.table, base + KEYS, f.h)) : t.rk0;
      t.rv1 = t.second ? bytes(cache_tile(p, v_cache, f.table, base + KEYS, f.h)) : t.rv0;
      return t;
    }
  }
  t.k0 = tile_words<HEAD>(cache_tile(p, k_cache, f.table, base, f.h), wide);
  t.v0 = tile_words<HEAD>(cache_tile(p, v_cache, f.table, base, f.h), wide + 2 * kTileWords);
  t.k1 = t.second
             ? tile_words<HEAD>(cache_tile(p, k_cache, f.table, base + KEYS, f.h), wide + kTileWords)
             : t.k0;
  t.v1 = t.second ? tile_words<HEAD>(cache_tile(p, v_cache, f.table, base + KEYS, f.h),
                                     wide + 3 * kTileWords)
                  : t.v0;
  if (n < KEYS) t.v1 = t.v0 = partial_values<HEAD>(t.v0, static_cast<int>(n), vz);
  else if (t.second && n < 2 * KEYS) t.v1 = partial_values<HEAD>(t.v1, static_cast<int>(n - KEYS), vz);
  return t;
}

inline bool pair_all_visible(const Problem& p, const FewRows& f, int64_t base) {
  return base + 2 * KEYS - 1 <= f.first_pos && (p.window == 0 || base > f.last_pos - p.window);
}

// Rows r0..r0+R of a few-row tile on vdpbf16ps: keys in the lanes (16 scores per vector),
// each vector of K or V loaded once for the R rows, accumulators in registers throughout.
// `wide` (an FP8 cache only): room for a segment's tiles widened to bf16, four per pair.
template <int HEAD, int R, typename C>
void few_rows_vector(const Problem& p, const FewRows& f, int r0, const C* k_cache,
                     const C* v_cache, uint32_t* vz, uint32_t* wide) {
  constexpr int W = HEAD / 2;
  constexpr int DV = HEAD / kLanes;
  const uint32_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = reinterpret_cast<const uint32_t*>(f.q[r0 + r]);
  __m512 acc[R][DV];
  float row_max[R], row_sum[R];
  alignas(64) uint32_t pw[R][KEYS];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < DV; ++g) acc[r][g] = _mm512_setzero_ps();
    row_max[r] = kNegInf;
    row_sum[r] = 0.f;
  }
  const int64_t first = f.key_begin / KEYS * KEYS;
  for (int64_t seg = first; seg < f.key_end; seg += 2 * KEYS * kSegmentPairs) {
    PairTiles t[kSegmentPairs];
    __m512 s0[kSegmentPairs][R], s1[kSegmentPairs][R];
    int pairs = 0;
    for (int64_t base = seg; pairs < kSegmentPairs && base < f.key_end;
         base += 2 * KEYS, ++pairs) {
      uint32_t* pair_wide = wide + (std::is_same_v<C, Fp8> ? pairs * 2 * KEYS * HEAD : 0);
      const PairTiles& tp = t[pairs] =
          pair_tiles<HEAD, C>(p, f, k_cache, v_cache, base, vz, pair_wide);
      __m512 a0[R], a1[R];
      for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
      const char* vp0 = tp.raw ? reinterpret_cast<const char*>(tp.rv0)
                               : reinterpret_cast<const char*>(tp.v0);
      const char* vp1 = tp.raw ? reinterpret_cast<const char*>(tp.rv1)
                               : reinterpret_cast<const char*>(tp.v1);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) {
        // A line of each of the next pair's key tiles and of this pair's value tiles per
        // step: the blocks are anywhere in the cache, so the hardware prefetcher cannot
        // guess them, and one line per step keeps the loads in flight spread out.
        _mm_prefetch(tp.nk0 + 64 * w, _MM_HINT_T0);
        _mm_prefetch(tp.nk1 + 64 * w, _MM_HINT_T0);
        _mm_prefetch(vp0 + 64 * w, _MM_HINT_T1);
        _mm_prefetch(vp1 + 64 * w, _MM_HINT_T1);
        const __m512bh a = words_at<C>(tp, tp.k0, tp.rk0, w * KEYS);
        const __m512bh b = words_at<C>(tp, tp.k1, tp.rk1, w * KEYS);
        for (int r = 0; r < R; ++r) {
          const __m512bh qw = as_bh(_mm512_set1_epi32(static_cast<int>(q[r][w])));
          a0[r] = _mm512_dpbf16_ps(a0[r], a, qw);
          a1[r] = _mm512_dpbf16_ps(a1[r], b, qw);
        }
      }
      const bool all_visible = pair_all_visible(p, f, base);
      for (int r = 0; r < R; ++r) {
        s0[pairs][r] = scaled_scores(p, a0[r]);
        s1[pairs][r] = scaled_scores(p, a1[r]);
        if (!all_visible) mask_pair(p, s0[pairs][r], s1[pairs][r], base, f.pos[r0 + r]);
      }
    }
    for (int i = 0; i < pairs; ++i) {
      const PairTiles& tp = t[i];
      for (int r = 0; r < R; ++r) {
        const __m512 alpha =
            _mm512_set1_ps(softmax_pair(s0[i][r], s1[i][r], row_max[r], row_sum[r], pw[r]));
        for (int g = 0; g < DV; ++g) acc[r][g] = _mm512_mul_ps(acc[r][g], alpha);
      }
#pragma GCC unroll 4
      for (int u = 0; u < KEYS; ++u) {
        const bool first = u < KEYS / 2;
        const int64_t row = (first ? u : u - KEYS / 2) * HEAD;
        for (int g = 0; g < DV; ++g) {
          const __m512bh v = first ? words_at<C>(tp, tp.v0, tp.rv0, row + kLanes * g)
                                   : words_at<C>(tp, tp.v1, tp.rv1, row + kLanes * g);
          for (int r = 0; r < R; ++r) {
            acc[r][g] = _mm512_dpbf16_ps(acc[r][g], v,
                                         as_bh(_mm512_set1_epi32(static_cast<int>(pw[r][u]))));
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);  // every row sees its own key
    for (int g = 0; g < DV; ++g) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(f.o[r0 + r] + kLanes * g),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][g], inv))));
    }
  }
}

template <int HEAD, typename C>
void attend_few_rows_bf16(const Problem& p, const Item& item, int rows,
                          const c10::BFloat16* query, const C* k_cache,
                          const C* v_cache, c10::BFloat16* out,
                          const int32_t* query_start_loc, const int32_t* seq_lens,
                          const int32_t* block_table, float* scratch) {
  const int64_t start = query_start_loc[item.seq];
  const int64_t query_len = query_start_loc[item.seq + 1] - start;
  const int64_t context_len = seq_lens[item.seq] - query_len;
  const int tile = static_cast<int>(std::min<int64_t>(kQueryTile, query_len - item.first));
  const int group = static_cast<int>(p.group);
  FewRows f{};
  f.first_pos = context_len + item.first;
  f.last_pos = f.first_pos + tile - 1;
  f.key_end = f.last_pos + 1;
  f.key_begin = p.window > 0 ? std::max<int64_t>(0, f.first_pos - p.window + 1) : 0;
  f.table = block_table + item.seq * p.bt_row;
  for (int h = item.head_lo; h < item.head_hi; ++h) {
    f.h = h;
    for (int r = 0; r < rows; ++r) {  // row r: token r / group, query head h * group + r % group
      const int64_t token = start + item.first + r / group;
      const int64_t head = h * p.group + r % group;
      f.q[r] = query + token * p.q_tok + head * p.q_head;
      f.o[r] = out + token * p.o_tok + head * p.o_head;
      f.pos[r] = static_cast<float>(f.first_pos + r / group);
    }
    uint32_t* vz = reinterpret_cast<uint32_t*>(scratch);
    uint32_t* wide = vz + KEYS / 2 * HEAD;
    for (int r0 = 0; r0 < rows; r0 += 4) {
      switch (std::min(4, rows - r0)) {
        case 1: few_rows_vector<HEAD, 1, C>(p, f, r0, k_cache, v_cache, vz, wide); break;
        case 2: few_rows_vector<HEAD, 2, C>(p, f, r0, k_cache, v_cache, vz, wide); break;
        case 3: few_rows_vector<HEAD, 3, C>(p, f, r0, k_cache, v_cache, vz, wide); break;
        default: few_rows_vector<HEAD, 4, C>(p, f, r0, k_cache, v_cache, vz, wide); break;
      }
    }
  }
}
#endif  // TIDEGATE_BF16_TILES

// T: the query's and output's dtype; C: the cache's (T, or Fp8).
template <typename T, typename C, int HEAD>
void attend_item(const Problem& p, const Item& item, const T* query, const C* k_cache,
                 const C* v_cache, T* out, const int32_t* query_start_loc,
                 const int32_t* seq_lens, const int32_t* block_table, float* scratch) {
  const int64_t start = query_start_loc[item.seq];
  const int64_t query_len = query_start_loc[item.seq + 1] - start;
  const int64_t seq_len = seq_lens[item.seq];
  const int64_t context_len = seq_len - query_len;
  const int tile = static_cast<int>(std::min<int64_t>(kQueryTile, query_len - item.first));
  const int group = static_cast<int>(p.group);
  const int kv_heads = static_cast<int>(p.num_kv_heads);
  // Rows of one KV head: row r is token r / group, query head kv_head * group + r % group.
  const int rows = tile * group;
  const int all_rows = rows * kv_heads;
#ifdef TIDEGATE_BF16_TILES
  if constexpr (std::is_same_v<T, c10::BFloat16> &&
                (std::is_same_v<C, T> || std::is_same_v<C, Fp8>) && HEAD % 16 == 0) {
    if (rows >= kBf16MinRows) {
      return attend_item_bf16<HEAD, C>(p, item, rows, query, k_cache, v_cache, out,
                                       query_start_loc, seq_lens, block_table, scratch);
    }
    return attend_few_rows_bf16<HEAD, C>(p, item, rows, query, k_cache, v_cache, out,
                                         query_start_loc, seq_lens, block_table, scratch);
  }
#endif

  float* __restrict__ q = scratch;          // [all_rows][HEAD], scaled
  float* __restrict__ acc = q + all_rows * HEAD;   // [all_rows][HEAD]
  float* __restrict__ kf = acc + all_rows * HEAD;  // [KEYS][HEAD], one head's keys
  float* __restrict__ kt = kf + KEYS * HEAD;       // [HEAD][KEYS], transposed (many rows)
  float* __restrict__ vb = kt + HEAD * KEYS;       // [KEYS][HEAD]
  float* __restrict__ s = vb + KEYS * HEAD;        // [rows][KEYS]
  float* __restrict__ row_max = s + rows * KEYS;   // [all_rows]
  float* __restrict__ row_sum = row_max + all_rows;  // [all_rows]

  for (int h = item.head_lo; h < item.head_hi; ++h) {
    for (int r = 0; r < rows; ++r) {
      const int row = h * rows + r;
      const int64_t token = start + item.first + r / group;
      const int64_t head = h * p.group + r % group;
      const T* src = query + token * p.q_tok + head * p.q_head;
#pragma omp simd
      for (int d = 0; d < HEAD; ++d) q[row * HEAD + d] = to_float(src[d]) * p.scale_log2;
#pragma omp simd
      for (int d = 0; d < HEAD; ++d) acc[row * HEAD + d] = 0.f;
      row_max[row] = kNegInf;
      row_sum[row] = 0.f;
    }
  }

  // Query token at offset j (in the chunk) sits at position context_len + j and sees keys
  // (lo, context_len + j], with lo = position - window when there is a window.
  const int64_t first_pos = context_len + item.first;
  const int64_t last_pos = first_pos + tile - 1;
  const int64_t key_end = last_pos + 1;  // exclusive
  const int64_t key_begin = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  const int32_t* table = block_table + item.seq * p.bt_row;
  // Many rows (a prefill tile): transpose K once so that each row's scores are FMAs over the
  // chunk's keys with no horizontal sums. Few rows (decodes): dot products win.
  const bool transposed = rows >= kTransposeRows;

  // Keys go by chunks of KEYS tokens (one tile of the cache per KV head), all KV heads of a
  // chunk in turn.
  for (int64_t chunk = key_begin / KEYS; chunk * KEYS < key_end; ++chunk) {
    const int64_t block_start = chunk * KEYS;  // position of the chunk's first key
    const int n = static_cast<int>(std::min<int64_t>(KEYS, key_end - block_start));
    // Every key of the chunk visible to every row of the tile: no mask needed.
    const bool all_visible = n == KEYS && block_start + KEYS - 1 <= first_pos &&
                             (p.window == 0 || block_start > last_pos - p.window);
    for (int h = item.head_lo; h < item.head_hi; ++h) {
      const C* ktile = cache_tile(p, k_cache, table, block_start, h);
      const C* vtile = cache_tile(p, v_cache, table, block_start, h);
      for (int t = 0; t < n; ++t) {
        for (int d = 0; d < HEAD; ++d) kf[t * HEAD + d] = to_float(ktile[k_offset(t, d)]);
        for (int d = 0; d < HEAD; ++d) vb[t * HEAD + d] = to_float(vtile[v_offset(t, d, HEAD)]);
      }
      // Slots past the sequence's end hold stale or garbage data (even NaN): zero them so
      // that 0 * garbage never reaches the accumulators; their scores are masked below.
      for (int t = n; t < KEYS; ++t) {
#pragma omp simd
        for (int d = 0; d < HEAD; ++d) kf[t * HEAD + d] = 0.f;
#pragma omp simd
        for (int d = 0; d < HEAD; ++d) vb[t * HEAD + d] = 0.f;
      }
      if (transposed) {
        for (int t = 0; t < KEYS; ++t) {
          for (int d = 0; d < HEAD; ++d) kt[d * KEYS + t] = kf[t * HEAD + d];
        }
      }
      // Rows go RB at a time: each key vector loaded serves RB rows' FMAs, and the RB
      // accumulators stay in registers through the chunk.
      constexpr int RB = HEAD <= 64 ? 4 : (HEAD <= 128 ? 2 : 1);
      for (int r0 = 0; r0 < rows; r0 += RB) {
        const int nr = std::min(RB, rows - r0);
        float sc[RB][KEYS];
        if (transposed) {
          for (int i = 0; i < RB; ++i) {
#pragma omp simd
            for (int t = 0; t < KEYS; ++t) sc[i][t] = 0.f;
          }
          for (int d = 0; d < HEAD; ++d) {
            const float* kd = kt + d * KEYS;
            for (int i = 0; i < RB; ++i) {
              const float qd = q[(h * rows + std::min(r0 + i, rows - 1)) * HEAD + d];
#pragma omp simd
              for (int t = 0; t < KEYS; ++t) sc[i][t] += qd * kd[t];
            }
          }
        } else {
          for (int i = 0; i < nr; ++i) {
            const float* __restrict__ qr = q + (h * rows + r0 + i) * HEAD;
            for (int t = 0; t < KEYS; ++t) {
              const float* kr = kf + t * HEAD;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int d = 0; d < HEAD; ++d) dot += qr[d] * kr[d];
              sc[i][t] = dot;
            }
          }
        }
        float alpha[RB];
        bool any = false;
        for (int i = 0; i < nr; ++i) {
          const int r = r0 + i;
          const int row = h * rows + r;
          float* sr = sc[i];
          if (p.cap_log2 > 0.f) {
            const float cap = p.cap_log2;
#pragma omp simd
            for (int t = 0; t < KEYS; ++t) sr[t] = soft_cap(sr[t], cap);
          }
          if (!all_visible) {
            const int64_t pos = first_pos + r / group;
            const int64_t lo = p.window > 0 ? pos - p.window : -1;  // keys must be > lo
            for (int t = 0; t < KEYS; ++t) {
              const int64_t key = block_start + t;
              if (t >= n || key > pos || key <= lo) sr[t] = kNegInf;
            }
          }
          float block_max = kNegInf;
#pragma omp simd reduction(max : block_max)
          for (int t = 0; t < KEYS; ++t) block_max = std::max(block_max, sr[t]);
          if (block_max == kNegInf) {  // nothing of this chunk is visible to the row
            alpha[i] = 1.f;
#pragma omp simd
            for (int t = 0; t < KEYS; ++t) sr[t] = 0.f;
            continue;
          }
          any = true;
          const float new_max = std::max(row_max[row], block_max);
          alpha[i] = exp2_nonpositive(row_max[row] - new_max);  // 0 the first time
          float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
          for (int t = 0; t < KEYS; ++t) {
            sr[t] = exp2_nonpositive(sr[t] - new_max);
            block_sum += sr[t];
          }
          row_max[row] = new_max;
          row_sum[row] = row_sum[row] * alpha[i] + block_sum;
        }
        if (!any) continue;
        // The rows' accumulators in registers for the chunk.
        float a[RB][HEAD];
        for (int i = 0; i < nr; ++i) {
#pragma omp simd
          for (int d = 0; d < HEAD; ++d) a[i][d] = acc[(h * rows + r0 + i) * HEAD + d] * alpha[i];
        }
        for (int t = 0; t < KEYS; ++t) {
          const float* vt = vb + t * HEAD;
          for (int i = 0; i < RB; ++i) {
            if (i >= nr) break;
            const float pt = sc[i][t];
#pragma omp simd
            for (int d = 0; d < HEAD; ++d) a[i][d] += pt * vt[d];
          }
        }
        for (int i = 0; i < nr; ++i) {
#pragma omp simd
          for (int d = 0; d < HEAD; ++d) acc[(h * rows + r0 + i) * HEAD + d] = a[i][d];
        }
      }
    }
  }

  for (int h = item.head_lo; h < item.head_hi; ++h) {
    for (int r = 0; r < rows; ++r) {
      const int row = h * rows + r;
      const int64_t token = start + item.first + r / group;
      const int64_t head = h * p.group + r % group;
      T* dst = out + token * p.o_tok + head * p.o_head;
      // Every row sees at least its own key, so row_sum > 0.
      const float inv = 1.f / row_sum[row];
#pragma omp simd
      for (int d = 0; d < HEAD; ++d) dst[d] = from_float<T>(acc[row * HEAD + d] * inv);
    }
  }
}

template <typename T, typename C, int HEAD>
void run(const Problem& p, const std::vector<Item>& items, const at::Tensor& query,
         const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
         const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
         const at::Tensor& block_table) {
  const T* q = query.const_data_ptr<T>();
  const C* k = static_cast<const C*>(k_cache.const_data_ptr());
  const C* v = static_cast<const C*>(v_cache.const_data_ptr());
  T* o = out.mutable_data_ptr<T>();
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* sl = seq_lens.const_data_ptr<int32_t>();
  const int32_t* bt = block_table.const_data_ptr<int32_t>();
  const int64_t max_rows = kQueryTile * p.num_heads;  // all heads of a full tile
  int64_t scratch_floats =
      2 * max_rows * HEAD + 3 * HEAD * KEYS + max_rows * KEYS + 2 * max_rows;
#ifdef TIDEGATE_BF16_TILES
  scratch_floats = std::max({scratch_floats, bf16_scratch_floats(HEAD),
                             bf16_few_rows_scratch_floats(HEAD, std::is_same_v<C, Fp8>)});
#endif
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  // Items differ in cost (a causal tile near the end of a prompt reads more keys): threads
  // take the next item from a shared counter rather than a fixed range.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(scratch_floats);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        attend_item<T, C, HEAD>(p, items[i], q, k, v, o, qsl, sl, bt, scratch.data());
      }
    }
  });
}

template <typename T, typename C>
void dispatch_head(int64_t head_dim, const Problem& p,
                   const std::vector<Item>& items, const at::Tensor& query,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                   const at::Tensor& qsl, const at::Tensor& sl, const at::Tensor& bt) {
#define TIDEGATE_HEAD(H) \
  case H: return run<T, C, H>(p, items, query, k_cache, v_cache, out, qsl, sl, bt);
  switch (head_dim) {
    TIDEGATE_HEAD(32)
    TIDEGATE_HEAD(64)
    TIDEGATE_HEAD(80)
    TIDEGATE_HEAD(96)
    TIDEGATE_HEAD(128)
    TIDEGATE_HEAD(256)
    default: TORCH_CHECK(false, "paged_attention: unsupported head size ", head_dim,
                         " (supported: 32, 64, 80, 96, 128, 256)");
  }
#undef TIDEGATE_HEAD
}

// Rows of a call, by the query's dtype and whether the cache is FP8.
template <typename T>
void dispatch_cache(bool fp8_cache, int64_t head_dim, const Problem& p,
                    const std::vector<Item>& items, const at::Tensor& query,
                    const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                    const at::Tensor& qsl, const at::Tensor& sl, const at::Tensor& bt) {
  if (fp8_cache) return dispatch_head<T, Fp8>(head_dim, p, items, query, k_cache, v_cache, out, qsl, sl, bt);
  dispatch_head<T, T>(head_dim, p, items, query, k_cache, v_cache, out, qsl, sl, bt);
}

inline bool is_fp8_cache(const at::Tensor& cache) {
  return cache.scalar_type() == at::kFloat8_e4m3fn;
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& block_table, double scale,
                     int64_t sliding_window, double logits_soft_cap, int64_t max_query_len) {
  TORCH_CHECK(query.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "paged_attention: query and out must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: caches must be contiguous [blocks, kv_heads, block_size, "
              "head_dim] (the packed layout)");
  const bool fp8_cache = is_fp8_cache(k_cache);
  TORCH_CHECK((k_cache.scalar_type() == query.scalar_type() || fp8_cache) &&
                  v_cache.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "paged_attention: query and out must share one dtype, and the caches that one "
              "or float8_e4m3fn");
  TORCH_CHECK(logits_soft_cap >= 0, "paged_attention: a negative soft cap");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1,
              "paged_attention: head_dim must be contiguous");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_table}) {
    TORCH_CHECK(t->scalar_type() == at::kInt, "paged_attention: metadata must be int32");
  }
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  block_table.stride(1) == 1,
              "paged_attention: metadata rows must be contiguous");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == head_dim, "paged_attention: cache head_dim differs");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_attention: ", num_heads,
              " query heads are not a multiple of ", num_kv_heads, " KV heads");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(k_cache.size(2) % KEYS == 0, "paged_attention: block size ", k_cache.size(2),
              " is not a multiple of ", KEYS);
  TORCH_CHECK(query_start_loc.size(0) >= num_seqs + 1,
              "paged_attention: query_start_loc needs num_seqs + 1 entries");

  Problem p{};
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_heads / num_kv_heads;
  p.head_dim = head_dim;
  p.q_tok = query.stride(0);
  p.q_head = query.stride(1);
  p.o_tok = out.stride(0);
  p.o_head = out.stride(1);
  p.cache_blk = k_cache.stride(0);
  p.cache_head = k_cache.stride(1);
  p.tile_elems = KEYS * head_dim;
  p.bt_row = block_table.stride(0);
  p.max_blocks = block_table.size(1);
  p.block_size = k_cache.size(2);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.window = sliding_window;
  p.cap_log2 = static_cast<float>(logits_soft_cap) * kLog2e;

  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* sl = seq_lens.const_data_ptr<int32_t>();
  std::vector<Item> items;
  items.reserve(num_seqs);
  // A tile that attends to many keys (a chunk deep into a long prompt, a decode of a long
  // context) is split into one item per KV head, so that its work spreads over the threads
  // instead of one thread carrying it while the others wait; short ones stay whole, each
  // cache line read once for all heads.
  const bool split_heads = at::get_num_threads() > 1 && num_kv_heads > 1;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t query_len = qsl[i + 1] - qsl[i];
    const int64_t num_blocks = (sl[i] + p.block_size - 1) / p.block_size;
    TORCH_CHECK(query_len >= 0 && qsl[i + 1] <= query.size(0) && sl[i] >= query_len &&
                    num_blocks <= p.max_blocks,
                "paged_attention: sequence ", i, " has inconsistent metadata");
    if (max_query_len > 0 && query_len > max_query_len) continue;  // the caller's to do
    // Every block the kernel will read must be in the cache: a stale or -1 entry within the
    // sequence's length is a bug upstream, refused here rather than read out of bounds.
    const int32_t* row = block_table.const_data_ptr<int32_t>() + i * p.bt_row;
    for (int64_t b = 0; b < num_blocks; ++b) {
      TORCH_CHECK(row[b] >= 0 && row[b] < k_cache.size(0), "paged_attention: sequence ", i,
                  " names block ", row[b], " of a ", k_cache.size(0), "-block cache");
    }
    const int64_t context_len = sl[i] - query_len;
    for (int64_t first = 0; first < query_len; first += kQueryTile) {
      const int64_t tile = std::min<int64_t>(kQueryTile, query_len - first);
      const auto seq = static_cast<int32_t>(i), off = static_cast<int32_t>(first);
      if (split_heads && tile * (context_len + first + tile) >= kSplitPairs) {
        for (int32_t h = 0; h < num_kv_heads; ++h) items.push_back({seq, off, h, h + 1});
      } else {
        items.push_back({seq, off, 0, static_cast<int32_t>(num_kv_heads)});
      }
    }
  }
  // Items that see the most keys first: the threads finish together more often.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    const int64_t ka = sl[a.seq] - (qsl[a.seq + 1] - qsl[a.seq]) + a.first;
    const int64_t kb = sl[b.seq] - (qsl[b.seq + 1] - qsl[b.seq]) + b.first;
    return ka > kb;
  });
  if (items.empty()) return;

  switch (query.scalar_type()) {
    case at::kFloat:
      return dispatch_cache<float>(fp8_cache, head_dim, p, items, query, k_cache, v_cache, out,
                                   query_start_loc, seq_lens, block_table);
    case at::kBFloat16:
      return dispatch_cache<c10::BFloat16>(fp8_cache, head_dim, p, items, query, k_cache,
                                           v_cache, out, query_start_loc, seq_lens, block_table);
    case at::kHalf:
      return dispatch_cache<c10::Half>(fp8_cache, head_dim, p, items, query, k_cache, v_cache,
                                       out, query_start_loc, seq_lens, block_table);
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

// Where, in a contiguous packed cache [blocks, heads, block_size, dim], the KEYS-key tile of KV
// head h that holds in-block position `offset` starts (in elements).
inline int64_t packed_tile(int64_t block, int64_t h, int64_t heads, int64_t block_size,
                           int64_t offset, int64_t dim) {
  return ((block * heads + h) * block_size + offset / KEYS * KEYS) * dim;
}

// Stores token rows into the packed tiles, E an unsigned integer of the element's size (the
// bytes move as they are): one element at a time for V, a pair for K.
template <typename E>
void store_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                at::Tensor& v_cache, const int64_t* slots, int64_t num_tokens) {
  const int64_t heads = key.size(1), dim = key.size(2), block_size = k_cache.size(2);
  const int64_t num_slots = k_cache.size(0) * block_size;
  const E* k = static_cast<const E*>(key.const_data_ptr());
  const E* v = static_cast<const E*>(value.const_data_ptr());
  E* kc = static_cast<E*>(k_cache.mutable_data_ptr());
  E* vc = static_cast<E*>(v_cache.mutable_data_ptr());
  for (int64_t i = 0; i < num_tokens; ++i) {
    TORCH_CHECK(slots[i] < num_slots, "reshape_and_cache: slot ", slots[i], " is past the cache");
  }
  // A prompt's tokens spread over the threads (each writes its own slots); a decode step's
  // few tokens are not worth waking them.
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;  // padding: no slot
      const int64_t block = slot / block_size, offset = slot % block_size;
      const int t = static_cast<int>(offset % KEYS);
      for (int64_t h = 0; h < heads; ++h) {
        // The token's tile for this head: K as [dim / 2][KEYS][2], V as [KEYS / 2][dim][2].
        const int64_t tile = packed_tile(block, h, heads, block_size, offset, dim);
        const E* ks = k + i * key.stride(0) + h * key.stride(1);
        const E* vs = v + i * value.stride(0) + h * value.stride(1);
        E* kt = kc + tile + 2 * t;  // the pair of element 2w is at kt + w * 2 * KEYS
        for (int64_t w = 0; w < dim / 2; ++w) {
          kt[w * 2 * KEYS] = ks[2 * w];
          kt[w * 2 * KEYS + 1] = ks[2 * w + 1];
        }
        E* vt = vc + tile + (t >> 1) * 2 * dim + (t & 1);  // element d at vt + 2d
        for (int64_t d = 0; d < dim; ++d) vt[2 * d] = vs[d];
      }
    }
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
                       at::Tensor v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "reshape_and_cache: int64 slots");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "reshape_and_cache: key and value must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == key.scalar_type() || is_fp8_cache(k_cache)) &&
                  value.scalar_type() == key.scalar_type(),
              "reshape_and_cache: caches must hold the keys' dtype or float8_e4m3fn");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  key.size(1) == k_cache.size(1) && key.size(2) == k_cache.size(3),
              "reshape_and_cache: key rows do not fit the [blocks, kv_heads, block_size, "
              "head_dim] caches");
  TORCH_CHECK(k_cache.size(2) % KEYS == 0 && key.size(2) % 2 == 0,
              "reshape_and_cache: block size must be a multiple of ", KEYS,
              " and head_dim even");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "reshape_and_cache: contiguous rows only");
  const int64_t num_tokens = std::min<int64_t>(slot_mapping.size(0), key.size(0));
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  if (is_fp8_cache(k_cache) && !is_fp8_cache(key)) {
    // As every backend stores FP8 (backend.to_cache_dtype): clipped to the largest finite
    // value (the e4m3fn cast turns what overflows into NaN), then rounded to nearest even.
    const auto as_cache = [&](const at::Tensor& x) {
      return x.narrow(0, 0, num_tokens).clamp(-448, 448).to(at::kFloat8_e4m3fn);
    };
    return store_rows<uint8_t>(as_cache(key), as_cache(value), k_cache, v_cache, slots,
                               num_tokens);
  }
  switch (key.element_size()) {
    case 1: return store_rows<uint8_t>(key, value, k_cache, v_cache, slots, num_tokens);
    case 2: return store_rows<uint16_t>(key, value, k_cache, v_cache, slots, num_tokens);
    case 4: return store_rows<uint32_t>(key, value, k_cache, v_cache, slots, num_tokens);
    default: TORCH_CHECK(false, "reshape_and_cache: unsupported dtype ", key.scalar_type());
  }
}

// Copies a sequence's first seq_len keys and values out of the packed tiles into the
// standard order, heads first ([kv_heads, seq_len, head_dim] each, as SDPA takes them), in
// one pass over tiles spread across the threads. E is an unsigned integer of the element's
// size and P of a pair's: the bytes move as they are.
template <typename E, typename P>
void gather_tiles(const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* blocks,
                  int64_t seq_len, at::Tensor& keys, at::Tensor& values) {
  const int64_t heads = k_cache.size(1), block_size = k_cache.size(2), dim = k_cache.size(3);
  const int64_t tiles = (seq_len + KEYS - 1) / KEYS, words = dim / 2;
  const E* kc = static_cast<const E*>(k_cache.const_data_ptr());
  const E* vc = static_cast<const E*>(v_cache.const_data_ptr());
  E* ko = static_cast<E*>(keys.mutable_data_ptr());
  E* vo = static_cast<E*>(values.mutable_data_ptr());
  at::parallel_for(0, heads * tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, start = item % tiles * KEYS;
      const int n = static_cast<int>(std::min<int64_t>(KEYS, seq_len - start));
      const int64_t tile =
          packed_tile(blocks[start / block_size], h, heads, block_size, start % block_size, dim);
      const P* kt = reinterpret_cast<const P*>(kc + tile);  // [words][KEYS] pairs
      P* kd = reinterpret_cast<P*>(ko + (h * seq_len + start) * dim);
      for (int t = 0; t < n; ++t) {
        for (int64_t w = 0; w < words; ++w) kd[t * words + w] = kt[w * KEYS + t];
      }
      const E* vt = vc + tile;  // [KEYS / 2][dim][2]
      E* vd = vo + (h * seq_len + start) * dim;
      for (int t = 0; t < n; ++t) {
        const E* src = vt + (t >> 1) * 2 * dim + (t & 1);
        for (int64_t d = 0; d < dim; ++d) vd[t * dim + d] = src[2 * d];
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> gather_kv(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             const at::Tensor& block_ids, int64_t seq_len) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "gather_kv: caches must be contiguous [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(),
              "gather_kv: int64 block ids");
  const int64_t block_size = k_cache.size(2);
  TORCH_CHECK(seq_len >= 0 && seq_len <= block_ids.size(0) * block_size,
              "gather_kv: ", seq_len, " tokens do not fit ", block_ids.size(0), " blocks");
  const int64_t* blocks = block_ids.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b) {
    TORCH_CHECK(blocks[b] >= 0 && blocks[b] < k_cache.size(0), "gather_kv: block ", blocks[b],
                " of a ", k_cache.size(0), "-block cache");
  }
  at::Tensor keys = at::empty({k_cache.size(1), seq_len, k_cache.size(3)}, k_cache.options());
  at::Tensor values = at::empty_like(keys);
  switch (k_cache.element_size()) {
    case 1: gather_tiles<uint8_t, uint16_t>(k_cache, v_cache, blocks, seq_len, keys, values); break;
    case 2: gather_tiles<uint16_t, uint32_t>(k_cache, v_cache, blocks, seq_len, keys, values); break;
    case 4: gather_tiles<uint32_t, uint64_t>(k_cache, v_cache, blocks, seq_len, keys, values); break;
    default: TORCH_CHECK(false, "gather_kv: unsupported dtype ", k_cache.scalar_type());
  }
  return {keys, values};
}

// -- One step at a time: the state layer_attention reads --------------------------------
// Set by begin_step and dropped by end_step (the backend's attention context), as the Python
// context of custom_op.py: one forward at a time per process.
struct StepState {
  bool active = false;
  std::vector<at::Tensor> k_caches, v_caches;
  at::Tensor query_start_loc, seq_lens, block_table, slot_mapping;
  int64_t max_query_len = 0;
};

StepState& step_state() {
  static StepState state;
  return state;
}

void begin_step(std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor block_table,
                at::Tensor slot_mapping, int64_t max_query_len) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), "begin_step: ", k_caches.size(),
              " key caches but ", v_caches.size(), " value caches");
  TORCH_CHECK(seq_lens.dim() == 1 && query_start_loc.size(0) == seq_lens.size(0) + 1 &&
                  block_table.size(0) == seq_lens.size(0),
              "begin_step: query_start_loc, seq_lens and block_table disagree on the number "
              "of sequences");
  StepState& state = step_state();
  state.k_caches = std::move(k_caches);
  state.v_caches = std::move(v_caches);
  state.query_start_loc = std::move(query_start_loc);
  state.seq_lens = std::move(seq_lens);
  state.block_table = std::move(block_table);
  state.slot_mapping = std::move(slot_mapping);
  state.max_query_len = max_query_len;
  state.active = true;
}

void end_step() { step_state() = StepState{}; }  // no reference to the caches outlives a step

#ifdef TIDEGATE_BF16_TILES
// -- Long bf16 chunks on AMX: flash attention through oneDNN's brgemm -------------------
// torch's cpublas::brgemm runs oneDNN's AMX micro-kernels and keeps the tile configuration
// consistent with oneDNN's own matmuls (an AMX kernel of our own, configuring the tiles
// itself, made the linears around it several times slower). Its B operands are in the VNNI
// order, pairs along the reduced dimension, which is the packed tiles' own: the context's
// key tiles are copied side by side into Q*K^T's B ([dim / 2][keys][2]) and its value tiles,
// whole, into P*V's ([keys / 2][dim][2]). Per (head, block of kFlashRows tokens): scores for
// kFlashKeys keys at a time, the online softmax in fp32 with AVX-512, probabilities in bf16.
// On 2 Sapphire Rapids cores, a fresh 512-token prompt of 12 heads of 64: 0.79 ms against
// SDPA's 1.12 (over keys already gathered); the scores' stores bound Q*K^T at this head size.
constexpr int64_t kFlashRows = 128;  // query tokens of one work item (one head)
constexpr int64_t kFlashKeys = 512;  // keys per softmax step

// 2^x for the probabilities of P*V (stored as bf16): a degree-4 polynomial on the fraction
// (relative error below 5e-5) and vscalefps for the power of two, which also takes the
// underflow of very negative x to 0.
inline __m512 exp2_fast(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

void flash_chunk_bf16(const at::Tensor& query, at::Tensor& out, int64_t start,
                      int64_t query_len, int64_t seq_len, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const int32_t* table, double scale) {
  using bf16 = c10::BFloat16;
  const int64_t heads = query.size(1), kv_heads = k_cache.size(1), dim = query.size(2);
  const int64_t group = heads / kv_heads, block_size = k_cache.size(2);
  const int64_t tiles = (seq_len + KEYS - 1) / KEYS, padded = tiles * KEYS, words = dim / 2;
  const int64_t context_len = seq_len - query_len;
  // Keys as Q*K^T's B operand, [kv_heads][dim / 2][padded][2], and values as P*V's,
  // [kv_heads][padded / 2][dim][2] (both bf16 pairs in 32-bit words).
  at::Tensor kbuf = at::empty({kv_heads, words, padded}, at::kInt);
  at::Tensor vbuf = at::empty({kv_heads, padded / 2, dim}, at::kInt);
  // An FP8 cache's tiles are widened to bf16 (widen_fp8) on their way into the buffers.
  const bool fp8 = is_fp8_cache(k_cache);
  const uint32_t* kc = reinterpret_cast<const uint32_t*>(k_cache.const_data_ptr());
  const uint32_t* vc = reinterpret_cast<const uint32_t*>(v_cache.const_data_ptr());
  const uint8_t* kc8 = static_cast<const uint8_t*>(k_cache.const_data_ptr());
  const uint8_t* vc8 = static_cast<const uint8_t*>(v_cache.const_data_ptr());
  uint32_t* kb = reinterpret_cast<uint32_t*>(kbuf.mutable_data_ptr());
  uint32_t* vb = reinterpret_cast<uint32_t*>(vbuf.mutable_data_ptr());
  at::parallel_for(0, kv_heads * tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> wide(fp8 ? KEYS * dim : 0);  // a key tile's words, then a value's
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, t = item % tiles, pos = t * KEYS;
      const int64_t element =
          packed_tile(table[pos / block_size], h, kv_heads, block_size, pos % block_size, dim);
      const uint32_t* ktile = kc + element / 2;  // in 32-bit words, a bf16 pair each
      const uint32_t* vtile = vc + element / 2;
      if (fp8) {
        widen_fp8(kc8 + element, KEYS * dim, wide.data());
        widen_fp8(vc8 + element, KEYS * dim, wide.data() + KEYS * dim / 2);
        ktile = wide.data();
        vtile = wide.data() + KEYS * dim / 2;
      }
      for (int64_t w = 0; w < words; ++w) {
        std::memcpy(kb + (h * words + w) * padded + pos, ktile + w * KEYS, KEYS * 4);
      }
      uint32_t* vd = vb + (h * padded / 2 + pos / 2) * dim;
      std::memcpy(vd, vtile, KEYS / 2 * dim * 4);
      const int n = static_cast<int>(std::min<int64_t>(KEYS, seq_len - pos));
      if (n < KEYS) {  // keys past the end: stale, even NaN, and 0 * NaN poisons P*V
        for (int u = 0; u < KEYS / 2; ++u) {
          const uint32_t keep = 2 * u + 1 < n ? 0xffffffffu : (2 * u < n ? 0x0000ffffu : 0u);
          for (int64_t d = 0; d < dim; ++d) vd[u * dim + d] &= keep;
        }
      }
    }
  });
  const int64_t row_blocks = (query_len + kFlashRows - 1) / kFlashRows;
  const float scale_log2 = static_cast<float>(scale) * kLog2e;
  const bf16* q = query.const_data_ptr<bf16>();
  bf16* o = out.mutable_data_ptr<bf16>();
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  at::parallel_for(0, heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kFlashRows * kFlashKeys), acc(kFlashRows * dim);
    std::vector<float> row_max(kFlashRows), row_sum(kFlashRows);
    std::vector<bf16> probs(kFlashRows * kFlashKeys);
    for (int64_t item = begin; item < end; ++item) {
      // The last row blocks see the most keys: they go first.
      const int64_t h = item % heads, rb = row_blocks - 1 - item / heads;
      const int64_t r0 = rb * kFlashRows, rows = std::min(kFlashRows, query_len - r0);
      const int64_t hk = h / group;
      const bf16* qa = q + (start + r0) * q_tok + h * q_head;
      const bf16* kh = reinterpret_cast<const bf16*>(kb + hk * words * padded);
      const bf16* vh = reinterpret_cast<const bf16*>(vb + hk * padded / 2 * dim);
      const int64_t visible = context_len + r0 + rows;  // keys the last row sees
      for (int64_t r = 0; r < rows; ++r) row_max[r] = kNegInf, row_sum[r] = 0.f;
      for (int64_t k0 = 0; k0 < visible; k0 += kFlashKeys) {
        const int64_t nk = std::min(kFlashKeys, visible - k0);
        const int64_t nk_pad = (nk + KEYS - 1) / KEYS * KEYS;
        // Scores of this block of keys: Q [rows, dim] times K^T [dim, nk_pad].
        at::native::cpublas::brgemm(rows, nk_pad, dim, q_tok, padded, kFlashKeys, false, qa,
                                    kh + 2 * k0, scores.data(), true);
        for (int64_t r = 0; r < rows; ++r) {
          float* s = scores.data() + r * kFlashKeys;
          bf16* pr = probs.data() + r * kFlashKeys;
          const int64_t see = std::clamp<int64_t>(context_len + r0 + r + 1 - k0, 0, nk_pad);
          const int64_t lim = std::min(see, nk);
          __m512 mx = _mm512_set1_ps(kNegInf);
          int64_t j = 0;
          for (; j + 16 <= lim; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
          if (j < lim) {
            const __mmask16 m = (1u << (lim - j)) - 1;
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), m, s + j));
          }
          const float block_max = _mm512_reduce_max_ps(mx) * scale_log2;
          float* a = acc.data() + r * dim;
          if (lim == 0) {  // nothing visible in this block for this row
            std::memset(pr, 0, nk_pad * sizeof(bf16));
            if (k0 == 0) std::memset(a, 0, dim * sizeof(float));
            continue;
          }
          const float m_new = std::max(row_max[r], block_max);
          const float alpha = k0 == 0 ? 0.f : std::exp2(row_max[r] - m_new);
          row_max[r] = m_new;
          const __m512 sc = _mm512_set1_ps(scale_log2), mn = _mm512_set1_ps(m_new);
          __m512 sum = _mm512_setzero_ps();
          for (j = 0; j < nk_pad; j += 16) {
            const int64_t left = lim - j;
            const __mmask16 m = left >= 16 ? 0xffff : (left <= 0 ? 0 : (1u << left) - 1);
            const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), sc, mn);
            const __m512 p = _mm512_maskz_mov_ps(m, exp2_fast(x));
            sum = _mm512_add_ps(sum, p);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j),
                                reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
          }
          row_sum[r] = row_sum[r] * alpha + _mm512_reduce_add_ps(sum);
          if (k0 > 0) {
            const __m512 al = _mm512_set1_ps(alpha);
            int64_t d = 0;
            for (; d + 16 <= dim; d += 16) {
              _mm512_storeu_ps(a + d, _mm512_mul_ps(al, _mm512_loadu_ps(a + d)));
            }
            for (; d < dim; ++d) a[d] *= alpha;
          }
        }
        // acc (rescaled above) += P [rows, nk_pad] times V [nk_pad, dim].
        at::native::cpublas::brgemm(rows, dim, nk_pad, kFlashKeys, dim, dim, k0 > 0,
                                    probs.data(), vh + k0 * dim, acc.data(), true);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = row_sum[r] > 0 ? 1.f / row_sum[r] : 0.f;
        const float* a = acc.data() + r * dim;
        bf16* dst = o + (start + r0 + r) * o_tok + h * o_head;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<bf16>(a[d] * inv);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

#endif  // TIDEGATE_BF16_TILES

// Each sequence of more than max_query_len new tokens: flash_chunk_bf16 for bf16 queries (on a
// bf16 or FP8 cache) where oneDNN's brgemm runs (AMX), else SDPA over its context gathered from the tiles into the
// standard order (heads first).
void attend_long_chunks(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                        const at::Tensor& seq_lens, const at::Tensor& block_table, double scale,
                        int64_t max_query_len) {
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* sl = seq_lens.const_data_ptr<int32_t>();
  const int64_t block_size = k_cache.size(2);
  for (int64_t i = 0; i < seq_lens.size(0); ++i) {
    const int64_t start = qsl[i], query_len = qsl[i + 1] - qsl[i], seq_len = sl[i];
    if (query_len <= max_query_len) continue;
#ifdef TIDEGATE_BF16_TILES
    static const bool brgemm_bf16 = at::native::cpublas::could_pack(at::kBFloat16);
    if (brgemm_bf16 && query.scalar_type() == at::kBFloat16 &&
        (k_cache.scalar_type() == at::kBFloat16 || is_fp8_cache(k_cache)) &&
        query.size(2) % 2 == 0) {
      flash_chunk_bf16(query, out, start, query_len, seq_len, k_cache, v_cache,
                       block_table.const_data_ptr<int32_t>() + i * block_table.stride(0),
                       scale);
      continue;
    }
#endif
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    const at::Tensor blocks = block_table[i].narrow(0, 0, num_blocks).to(at::kLong);
    auto [gathered_keys, gathered_values] = gather_kv(k_cache, v_cache, blocks, seq_len);
    // An FP8 cache's context widened to the query's dtype (a no-op otherwise).
    const at::Tensor keys = gathered_keys.to(query.scalar_type());
    const at::Tensor values = gathered_values.to(query.scalar_type());
    // [1, heads, tokens, head_dim]: SDPA's fused CPU kernel takes only 4-D inputs.
    const at::Tensor q = query.narrow(0, start, query_len).transpose(0, 1).unsqueeze(0);
    const int64_t context_len = seq_len - query_len;
    at::Tensor o;
    if (context_len == 0) {
      o = at::scaled_dot_product_attention(q, keys.unsqueeze(0), values.unsqueeze(0),
                                           std::nullopt, 0.0, /*is_causal=*/true, scale,
                                           /*enable_gqa=*/true);
    } else {
      // SDPA's is_causal aligns to the top left; the chunk sits at the bottom right.
      const auto positions = at::TensorOptions().dtype(at::kLong);
      const at::Tensor key_pos = at::arange(seq_len, positions);
      const at::Tensor query_pos = at::arange(context_len, seq_len, positions);
      const at::Tensor mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1);
      o = at::scaled_dot_product_attention(q, keys.unsqueeze(0), values.unsqueeze(0), mask,
                                           0.0, /*is_causal=*/false, scale,
                                           /*enable_gqa=*/true);
    }
    out.narrow(0, start, query_len).copy_(o.squeeze(0).transpose(0, 1));
  }
}

// The backend's attend: every row of the first num_tokens, the kernel for chunks of up to
// max_query_len tokens (every chunk when it is 0) and attend_long_chunks for longer ones;
// padding rows past num_tokens are zeros.
at::Tensor attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                  const at::Tensor& block_table, int64_t num_tokens, double scale,
                  int64_t sliding_window, double logits_soft_cap, int64_t max_query_len) {
  // attend_long_chunks has no window and no cap: such a layer's chunks all go to the kernel.
  if (sliding_window > 0 || logits_soft_cap > 0) max_query_len = 0;
  at::Tensor out = at::empty_like(query);
  num_tokens = std::clamp<int64_t>(num_tokens, 0, out.size(0));
  if (out.size(0) > num_tokens) out.narrow(0, num_tokens, out.size(0) - num_tokens).zero_();
  paged_attention(out, query, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale,
                  sliding_window, logits_soft_cap, max_query_len);
  if (max_query_len > 0) {
    attend_long_chunks(out, query, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                       scale, max_query_len);
  }
  return out;
}

at::Tensor layer_attention(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, int64_t layer, double scale,
                           int64_t sliding_window, double logits_soft_cap) {
  const StepState& state = step_state();
  TORCH_CHECK(state.active, "layer_attention: called outside a step (begin_step)");
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(state.k_caches.size()),
              "layer_attention: layer ", layer, " of ", state.k_caches.size());
  const at::Tensor& k_cache = state.k_caches[layer];
  const at::Tensor& v_cache = state.v_caches[layer];
  reshape_and_cache(key, value, k_cache, v_cache, state.slot_mapping);
  return attend(query, k_cache, v_cache, state.query_start_loc, state.seq_lens,
                state.block_table, state.slot_mapping.size(0), scale, sliding_window,
                logits_soft_cap, state.max_query_len);
}

}  // namespace

TORCH_LIBRARY(tidegate_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor block_table, float scale, "
      "int sliding_window, float logits_soft_cap, int max_query_len) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def("gather_kv(Tensor k_cache, Tensor v_cache, Tensor block_ids, int seq_len) -> (Tensor, Tensor)");
  m.def(
      "begin_step(Tensor[] k_caches, Tensor[] v_caches, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_table, Tensor slot_mapping, int max_query_len) -> ()");
  m.def("end_step() -> ()");
  m.def(
      "attend(Tensor query, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_table, int num_tokens, float scale, int sliding_window, "
      "float logits_soft_cap, int max_query_len) -> Tensor");
  m.def(
      "layer_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, "
      "int sliding_window, float logits_soft_cap=0.0) -> Tensor");
  // No tensor arguments to dispatch on: plain functions.
  m.impl("end_step", &end_step);
}

TORCH_LIBRARY_IMPL(tidegate_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("gather_kv", &gather_kv);
  m.impl("begin_step", &begin_step);
  m.impl("attend", &attend);
  m.impl("layer_attention", &layer_attention);
}
