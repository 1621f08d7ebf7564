// CPU paged attention: every new token of a flat batch attends to its sequence's keys,
// read in place from the paged cache through the block table (no gathered copy).
//
// Work is split into items (sequence, tile of up to kQueryTile new tokens), taken by
// torch's intra-op threads from a shared counter, so a long chunk's tiles and many short
// decodes spread evenly; a tile that attends to many keys becomes one item per KV head. An
// item walks its keys in chunks of KEYS tokens and, for each chunk, each of its KV heads in
// turn: a chunk's slots are contiguous in the cache, so each cache line is read from memory
// once. Each head's keys and values are converted to fp32 once per
// chunk and serve every query row of the head (the GQA group times the tile's tokens), RB
// rows at a time so that one vector load feeds RB rows' FMAs. Softmax is online (flash
// style) in fp32, in base 2 (the query is scaled by scale * log2(e)). The inner loops run
// over a chunk's keys or over head_dim, both compile-time sizes, so the compiler vectorizes
// them for the ISA it is given (AVX-512 with -march=native here, AVX2 with x86-64-v3).
// Built for a CPU with AVX512_BF16, bf16 tiles of 16 rows or more take attend_rows_bf16
// instead: intrinsics on vdpbf16ps with rows in the vector lanes (see there).
//
// Ops (namespace tidegate_cpu):
//   paged_attention(out, query, k_cache, v_cache, query_start_loc, seq_lens, block_table,
//                   scale, sliding_window, max_query_len)
//     Sequences with more than max_query_len new tokens (when > 0) are skipped: their rows
//     of `out` are left for the caller.
//   reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TIDEGATE_BF16_TILES 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
  int64_t kc_blk, kc_slot, kc_head, vc_blk, vc_slot, vc_head;  // cache strides
  int64_t bt_row, max_blocks, block_size;
  float scale_log2;  // softmax scale * log2(e)
  int64_t window;    // 0: none
};


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

// Floats of scratch one row block needs, for the largest head size.
constexpr int64_t bf16_scratch_floats(int64_t head) {
  return head / 2 * kTileRows      // packed query: [head / 2][rows] bf16 pairs
         + head * kTileRows        // accumulators: [head][rows]
         + KEYS * kTileRows        // scores and probabilities: [KEYS][rows]
         + KEYS / 2 * kTileRows    // probabilities packed in pairs of keys: [KEYS / 2][rows]
         + KEYS / 2 * head         // values packed in pairs of keys: [KEYS / 2][head]
         + 4 * kTileRows;          // row max, row sum, position, alpha
}

template <int HEAD, int RV>
void attend_rows_bf16(const Problem& p, const Item& item, int h, int row_lo, int nrows,
                      const c10::BFloat16* query, const c10::BFloat16* k_cache,
                      const c10::BFloat16* v_cache, c10::BFloat16* out,
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
  uint32_t* __restrict__ vp = pp + KEYS / 2 * R;                    // [KEYS/2][HEAD]
  float* __restrict__ row_max = reinterpret_cast<float*>(vp + KEYS / 2 * HEAD);
  float* __restrict__ row_sum = row_max + R;
  float* __restrict__ pos = row_sum + R;  // each row's position, as a float (exact < 2^24)
  float* __restrict__ alpha = pos + R;

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
  const float scale = p.scale_log2;
  alignas(64) static thread_local c10::BFloat16 zero_row[HEAD] = {};
  // vpermw indices that interleave two 16-element halves: (a0, b0, a1, b1, ...).
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);

  for (int64_t chunk = key_begin / KEYS; chunk * KEYS < key_end; ++chunk) {
    const int64_t block_start = chunk * KEYS;
    const int n = static_cast<int>(std::min<int64_t>(KEYS, key_end - block_start));
    const int64_t block = table[block_start / p.block_size];
    const int64_t slot = block_start % p.block_size;
    const bool all_visible = n == KEYS && block_start + KEYS - 1 <= block_first_pos &&
                             (p.window == 0 || block_start > last_pos - p.window);
    const c10::BFloat16* kb = k_cache + block * p.kc_blk + slot * p.kc_slot + h * p.kc_head;
    const c10::BFloat16* vb = v_cache + block * p.vc_blk + slot * p.vc_slot + h * p.vc_head;
    // Keys past the sequence's end (stale data, even NaN) read as zeros.
    const c10::BFloat16* krows[KEYS];
    const c10::BFloat16* vrows[KEYS];
    for (int t = 0; t < KEYS; ++t) {
      krows[t] = t < n ? kb + t * p.kc_slot : zero_row;
      vrows[t] = t < n ? vb + t * p.vc_slot : zero_row;
    }

    // Scores: s[t][r] = q_r . k_t, kKeyGroup keys by RV row vectors in registers.
    for (int t0 = 0; t0 < KEYS; t0 += kKeyGroup) {
      __m512 sc[kKeyGroup][RV];
#pragma GCC unroll 16
      for (int j = 0; j < kKeyGroup; ++j)
#pragma GCC unroll 4
        for (int v = 0; v < RV; ++v) sc[j][v] = _mm512_setzero_ps();
      const uint32_t* kw[kKeyGroup];
      for (int j = 0; j < kKeyGroup; ++j) kw[j] = reinterpret_cast<const uint32_t*>(krows[t0 + j]);
      for (int w = 0; w < W; ++w) {
        __m512i qv[RV];
#pragma GCC unroll 4
        for (int v = 0; v < RV; ++v) qv[v] = _mm512_loadu_si512(qp + w * R + v * kLanes);
#pragma GCC unroll 16
        for (int j = 0; j < kKeyGroup; ++j) {
          const __m512i kv = _mm512_set1_epi32(static_cast<int>(kw[j][w]));
#pragma GCC unroll 4
          for (int v = 0; v < RV; ++v) sc[j][v] = _mm512_dpbf16_ps(sc[j][v], as_bh(qv[v]), as_bh(kv));
        }
      }
      for (int j = 0; j < kKeyGroup; ++j)
        for (int v = 0; v < RV; ++v)
          _mm512_storeu_ps(s + (t0 + j) * R + v * kLanes, _mm512_mul_ps(sc[j][v], _mm512_set1_ps(scale)));
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
    // Values in pairs of keys: word (v[2u][d], v[2u+1][d]).
    for (int u = 0; u < KEYS / 2; ++u) {
      const c10::BFloat16* even = vrows[2 * u];
      const c10::BFloat16* odd = vrows[2 * u + 1];
#pragma GCC unroll 16
      for (int d = 0; d < HEAD; d += 16) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + d));
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_storeu_si512(vp + u * HEAD + d, _mm512_permutexvar_epi16(interleave, ab));
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
template <int HEAD>
void attend_item_bf16(const Problem& p, const Item& item, int rows, const c10::BFloat16* query,
                      const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                      c10::BFloat16* out, const int32_t* qsl, const int32_t* sl,
                      const int32_t* bt, float* scratch) {
  for (int h = item.head_lo; h < item.head_hi; ++h) {
    for (int lo = 0; lo < rows; lo += kTileRows) {
      const int n = std::min(kTileRows, rows - lo);
      const int vectors = (n + kLanes - 1) / kLanes;
#define TIDEGATE_RV(V)                                                                   \
  case V:                                                                               \
    attend_rows_bf16<HEAD, V>(p, item, h, lo, n, query, k_cache, v_cache, out, qsl, sl, \
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

// Transposes 16 rows of 16 32-bit words in registers: row k of the result is column k.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// Floats of scratch a few-row tile needs: `rows` rows over all the KV heads it computes.
constexpr int64_t bf16_few_rows_scratch_floats(int64_t head, int64_t rows) {
  return rows * head / 2       // query rows as bf16 pairs: [rows][head / 2]
         + rows * head         // accumulators: [rows][head]
         + head / 2 * KEYS     // one head's keys transposed, bf16 pairs: [head / 2][KEYS]
         + KEYS / 2 * head     // one head's values in pairs of keys: [KEYS / 2][head]
         + rows * KEYS / 2     // probabilities in pairs of keys: [rows][KEYS / 2]
         + 3 * rows;           // row max, row sum, alpha
}

// Query rows of one KV head that one pass over a chunk's keys serves (registers: R x 2
// score accumulators, then R x 4 output accumulators).
constexpr int kFewRowBlock = 4;

// One chunk of KEYS keys for R rows of one KV head, whose keys are already transposed into
// `kt` ([head / 2][KEYS] bf16-pair words) and values packed in pairs of keys into `vp`
// ([KEYS / 2][head]): each vector of K or V is loaded once and serves all R rows, whose
// query words and probabilities are broadcast from memory into vdpbf16ps.
template <int HEAD, int R>
inline void few_rows_chunk(const Problem& p, int first_row, int first_row_in_head, int group,
                           int64_t first_pos, bool all_visible, __m512 keys,
                           const uint32_t* __restrict__ qp, float* __restrict__ acc,
                           const uint32_t* __restrict__ kt, const uint32_t* __restrict__ vp,
                           uint32_t* __restrict__ pw, float* __restrict__ row_max,
                           float* __restrict__ row_sum, float* __restrict__ alpha) {
  constexpr int W = HEAD / 2;
  const __m512 scale = _mm512_set1_ps(p.scale_log2);
  // Scores: two dependency chains per row (even and odd words).
  __m512 s0[R], s1[R];
  for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
  const uint32_t* q = qp + first_row * W;
#pragma GCC unroll 4
  for (int w = 0; w < W; w += 2) {
    const __m512bh k0 = as_bh(_mm512_loadu_si512(kt + w * KEYS));
    const __m512bh k1 = as_bh(_mm512_loadu_si512(kt + (w + 1) * KEYS));
    for (int r = 0; r < R; ++r) {
      s0[r] = _mm512_dpbf16_ps(s0[r], k0, as_bh(_mm512_set1_epi32(static_cast<int>(q[r * W + w]))));
      s1[r] = _mm512_dpbf16_ps(s1[r], k1,
                               as_bh(_mm512_set1_epi32(static_cast<int>(q[r * W + w + 1]))));
    }
  }
  for (int r = 0; r < R; ++r) {
    const int row = first_row + r;
    __m512 sv = _mm512_mul_ps(_mm512_add_ps(s0[r], s1[r]), scale);
    if (!all_visible) {  // keys past the chunk's end are past every row's position
      const float pos = static_cast<float>(first_pos + (first_row_in_head + r) / group);
      __mmask16 hidden = _mm512_cmp_ps_mask(keys, _mm512_set1_ps(pos), _CMP_GT_OQ);
      if (p.window > 0) {
        const __m512 lo = _mm512_set1_ps(pos - static_cast<float>(p.window));
        hidden |= _mm512_cmp_ps_mask(keys, lo, _CMP_LE_OQ);
      }
      sv = _mm512_mask_mov_ps(sv, hidden, _mm512_set1_ps(kNegInf));
    }
    const float chunk_max = _mm512_reduce_max_ps(sv);
    if (chunk_max == kNegInf) {  // nothing of this chunk is visible to the row
      alpha[row] = 1.f;
      std::memset(pw + row * (KEYS / 2), 0, KEYS / 2 * sizeof(uint32_t));
      continue;
    }
    const float new_max = std::max(row_max[row], chunk_max);
    alpha[row] = exp2_nonpositive(row_max[row] - new_max);  // 0 the first time
    const __m512 e = exp2_nonpositive_v(_mm512_sub_ps(sv, _mm512_set1_ps(new_max)));
    row_sum[row] = row_sum[row] * alpha[row] + _mm512_reduce_add_ps(e);
    row_max[row] = new_max;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + row * (KEYS / 2)),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  // P*V, up to 4 vectors of head_dim at a time: R x 4 accumulators in registers.
  constexpr int DG = HEAD / 16 < 4 ? HEAD / 16 : 4;
  for (int d0 = 0; d0 < HEAD; d0 += 16 * DG) {
    __m512 x[R][DG];
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[first_row + r]);
      for (int g = 0; g < DG; ++g) {
        x[r][g] = _mm512_mul_ps(_mm512_loadu_ps(acc + (first_row + r) * HEAD + d0 + 16 * g), a);
      }
    }
#pragma GCC unroll 8
    for (int u = 0; u < KEYS / 2; ++u) {
      for (int g = 0; g < DG; ++g) {
        const __m512bh v = as_bh(_mm512_loadu_si512(vp + u * HEAD + d0 + 16 * g));
        for (int r = 0; r < R; ++r) {
          const uint32_t pr = pw[(first_row + r) * (KEYS / 2) + u];
          x[r][g] = _mm512_dpbf16_ps(x[r][g], v, as_bh(_mm512_set1_epi32(static_cast<int>(pr))));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < DG; ++g) {
        _mm512_storeu_ps(acc + (first_row + r) * HEAD + d0 + 16 * g, x[r][g]);
      }
    }
  }
}

// bf16 tiles of fewer than 16 rows per KV head (decodes: the GQA group) on AVX512_BF16: keys
// in the lanes. For each chunk of 16 keys and each KV head in turn (the chunk's slots are
// contiguous, so each cache line is fetched once for all heads), the keys are transposed
// into bf16-pair words ([head / 2][16]) that every row of the head multiplies against its
// own broadcast query words, 16 scores at a time; values are packed in pairs of keys for
// P*V, with the row's bf16 probabilities broadcast in pairs. No key or value is converted
// to fp32. Rows go kFewRowBlock at a time through few_rows_chunk, so each vector of K or V
// is loaded once for all of them. The next chunk's keys and values are prefetched while
// this one computes, as its block is anywhere in the cache: on a Xeon with AVX512_BF16 and
// a cold cache, 1.19x faster on 32 decodes of 630 tokens and 1.39x on 8 (an AVX-512 EPYC
// had measured no gain from prefetching).
template <int HEAD>
void attend_few_rows_bf16(const Problem& p, const Item& item, int rows,
                          const c10::BFloat16* query, const c10::BFloat16* k_cache,
                          const c10::BFloat16* v_cache, c10::BFloat16* out,
                          const int32_t* query_start_loc, const int32_t* seq_lens,
                          const int32_t* block_table, float* scratch) {
  constexpr int W = HEAD / 2;
  static_assert(W % kLanes == 0, "keys are transposed 16 words at a time");
  const int64_t start = query_start_loc[item.seq];
  const int64_t query_len = query_start_loc[item.seq + 1] - start;
  const int64_t context_len = seq_lens[item.seq] - query_len;
  const int tile = static_cast<int>(std::min<int64_t>(kQueryTile, query_len - item.first));
  const int group = static_cast<int>(p.group);
  const int heads = item.head_hi - item.head_lo;
  const int all_rows = rows * heads;  // row h * rows + r: head item.head_lo + h, row r

  uint32_t* __restrict__ qp = reinterpret_cast<uint32_t*>(scratch);  // [all_rows][W]
  float* __restrict__ acc = scratch + all_rows * W;                   // [all_rows][HEAD]
  uint32_t* __restrict__ kt = reinterpret_cast<uint32_t*>(acc + all_rows * HEAD);
  uint32_t* __restrict__ vp = kt + W * KEYS;                          // [KEYS/2][HEAD]
  uint32_t* __restrict__ pw = vp + KEYS / 2 * HEAD;                   // [all_rows][KEYS/2]
  float* __restrict__ row_max = reinterpret_cast<float*>(pw + all_rows * KEYS / 2);
  float* __restrict__ row_sum = row_max + all_rows;
  float* __restrict__ alpha = row_sum + all_rows;

  for (int h = 0; h < heads; ++h) {
    for (int r = 0; r < rows; ++r) {
      const int row = h * rows + r;
      const int64_t token = start + item.first + r / group;
      const int64_t head = (item.head_lo + h) * p.group + r % group;
      std::memcpy(qp + row * W, query + token * p.q_tok + head * p.q_head, W * sizeof(uint32_t));
      row_max[row] = kNegInf;
      row_sum[row] = 0.f;
    }
  }
  for (int i = 0; i < all_rows * HEAD; ++i) acc[i] = 0.f;

  const int64_t first_pos = context_len + item.first;
  const int64_t last_pos = first_pos + tile - 1;
  const int64_t key_end = last_pos + 1;
  const int64_t key_begin = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  const int32_t* table = block_table + item.seq * p.bt_row;
  // Where the keys and values of the chunk starting at key `start` begin for a KV head.
  const auto k_at = [&](int64_t start, int kv_head) {
    return k_cache + table[start / p.block_size] * p.kc_blk + start % p.block_size * p.kc_slot +
           kv_head * p.kc_head;
  };
  const auto v_at = [&](int64_t start, int kv_head) {
    return v_cache + table[start / p.block_size] * p.vc_blk + start % p.block_size * p.vc_slot +
           kv_head * p.vc_head;
  };
  const __m512 lane_offsets = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  alignas(64) static thread_local c10::BFloat16 zero_row[HEAD] = {};
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);

  for (int64_t chunk = key_begin / KEYS; chunk * KEYS < key_end; ++chunk) {
    const int64_t block_start = chunk * KEYS;
    const int n = static_cast<int>(std::min<int64_t>(KEYS, key_end - block_start));
    const bool all_visible = n == KEYS && block_start + KEYS - 1 <= first_pos &&
                             (p.window == 0 || block_start > last_pos - p.window);
    const __m512 keys =
        _mm512_add_ps(_mm512_set1_ps(static_cast<float>(block_start)), lane_offsets);
    if (const int64_t next = block_start + KEYS; next < key_end) {
      // The next chunk's keys and values, while this one computes: its block is anywhere
      // in the cache, so the hardware prefetcher cannot guess it.
      const int n_next = static_cast<int>(std::min<int64_t>(KEYS, key_end - next));
      for (int kv_head = item.head_lo; kv_head < item.head_hi; ++kv_head) {
        const c10::BFloat16* kn = k_at(next, kv_head);
        const c10::BFloat16* vn = v_at(next, kv_head);
        for (int t = 0; t < n_next; ++t) {
          for (int e = 0; e < HEAD; e += 64 / sizeof(c10::BFloat16)) {  // a cache line
            _mm_prefetch(reinterpret_cast<const char*>(kn + t * p.kc_slot + e), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vn + t * p.vc_slot + e), _MM_HINT_T0);
          }
        }
      }
    }
    for (int h = 0; h < heads; ++h) {
      const int kv_head = item.head_lo + h;
      const c10::BFloat16* kb = k_at(block_start, kv_head);
      const c10::BFloat16* vb = v_at(block_start, kv_head);
      // Keys past the sequence's end (stale data, even NaN) read as zeros.
      for (int wb = 0; wb < W; wb += kLanes) {
        __m512i k[KEYS];
        for (int t = 0; t < KEYS; ++t) {
          const c10::BFloat16* row = t < n ? kb + t * p.kc_slot : zero_row;
          k[t] = _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(row) + wb);
        }
        transpose16x16(k);
        for (int j = 0; j < kLanes; ++j) _mm512_storeu_si512(kt + (wb + j) * KEYS, k[j]);
      }
      for (int u = 0; u < KEYS / 2; ++u) {
        const c10::BFloat16* even = 2 * u < n ? vb + 2 * u * p.vc_slot : zero_row;
        const c10::BFloat16* odd = 2 * u + 1 < n ? vb + (2 * u + 1) * p.vc_slot : zero_row;
        for (int d = 0; d < HEAD; d += 16) {
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d));
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + d));
          const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
          _mm512_storeu_si512(vp + u * HEAD + d, _mm512_permutexvar_epi16(interleave, ab));
        }
      }
      for (int lo = 0; lo < rows; lo += kFewRowBlock) {
        const int first_row = h * rows + lo;
        switch (std::min(kFewRowBlock, rows - lo)) {
#define TIDEGATE_FEW(R)                                                                    \
  case R:                                                                                 \
    few_rows_chunk<HEAD, R>(p, first_row, lo, group, first_pos, all_visible, keys, qp,  \
                            acc, kt, vp, pw, row_max, row_sum, alpha);                    \
    break;
          TIDEGATE_FEW(1)
          TIDEGATE_FEW(2)
          TIDEGATE_FEW(3)
          TIDEGATE_FEW(4)
#undef TIDEGATE_FEW
        }
      }
    }
  }

  for (int h = 0; h < heads; ++h) {
    for (int r = 0; r < rows; ++r) {
      const int row = h * rows + r;
      const int64_t token = start + item.first + r / group;
      const int64_t head = (item.head_lo + h) * p.group + r % group;
      c10::BFloat16* dst = out + token * p.o_tok + head * p.o_head;
      const float inv = 1.f / row_sum[row];  // every row sees at least its own key
      for (int d = 0; d < HEAD; ++d) dst[d] = from_float<c10::BFloat16>(acc[row * HEAD + d] * inv);
    }
  }
}
#endif  // TIDEGATE_BF16_TILES

template <typename T, int HEAD>
void attend_item(const Problem& p, const Item& item, const T* query, const T* k_cache,
                 const T* v_cache, T* out, const int32_t* query_start_loc,
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
  if constexpr (std::is_same_v<T, c10::BFloat16> && HEAD % 16 == 0) {
    if (rows >= kBf16MinRows) {
      return attend_item_bf16<HEAD>(p, item, rows, query, k_cache, v_cache, out,
                                    query_start_loc, seq_lens, block_table, scratch);
    }
    if constexpr (HEAD % (2 * kLanes) == 0) {
      return attend_few_rows_bf16<HEAD>(p, item, rows, query, k_cache, v_cache, out,
                                        query_start_loc, seq_lens, block_table, scratch);
    }
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

  // Keys go by chunks of KEYS tokens (a cache block holds a whole number of chunks), all KV
  // heads of a chunk in turn: the chunk's slots are contiguous in the cache, so each cache
  // line is fetched once and used at once.
  for (int64_t chunk = key_begin / KEYS; chunk * KEYS < key_end; ++chunk) {
    const int64_t block_start = chunk * KEYS;  // position of the chunk's first key
    const int n = static_cast<int>(std::min<int64_t>(KEYS, key_end - block_start));
    const int64_t block = table[block_start / p.block_size];
    const int64_t slot = block_start % p.block_size;
    // Every key of the chunk visible to every row of the tile: no mask needed.
    const bool all_visible = n == KEYS && block_start + KEYS - 1 <= first_pos &&
                             (p.window == 0 || block_start > last_pos - p.window);
    for (int h = item.head_lo; h < item.head_hi; ++h) {
      const T* kb = k_cache + block * p.kc_blk + slot * p.kc_slot + h * p.kc_head;
      const T* vsrc = v_cache + block * p.vc_blk + slot * p.vc_slot + h * p.vc_head;
      for (int t = 0; t < n; ++t) {
        const T* krow = kb + t * p.kc_slot;
        const T* vrow = vsrc + t * p.vc_slot;
#pragma omp simd
        for (int d = 0; d < HEAD; ++d) kf[t * HEAD + d] = to_float(krow[d]);
#pragma omp simd
        for (int d = 0; d < HEAD; ++d) vb[t * HEAD + d] = to_float(vrow[d]);
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

template <typename T, int HEAD>
void run(const Problem& p, const std::vector<Item>& items, const at::Tensor& query,
         const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
         const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
         const at::Tensor& block_table) {
  const T* q = query.const_data_ptr<T>();
  const T* k = k_cache.const_data_ptr<T>();
  const T* v = v_cache.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const int32_t* qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* sl = seq_lens.const_data_ptr<int32_t>();
  const int32_t* bt = block_table.const_data_ptr<int32_t>();
  const int64_t max_rows = kQueryTile * p.num_heads;  // all heads of a full tile
  int64_t scratch_floats =
      2 * max_rows * HEAD + 3 * HEAD * KEYS + max_rows * KEYS + 2 * max_rows;
#ifdef TIDEGATE_BF16_TILES
  scratch_floats = std::max({scratch_floats, bf16_scratch_floats(HEAD),
                             bf16_few_rows_scratch_floats(HEAD, max_rows)});
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
        attend_item<T, HEAD>(p, items[i], q, k, v, o, qsl, sl, bt, scratch.data());
      }
    }
  });
}

template <typename T>
void dispatch_head(int64_t head_dim, const Problem& p,
                   const std::vector<Item>& items, const at::Tensor& query,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                   const at::Tensor& qsl, const at::Tensor& sl, const at::Tensor& bt) {
#define TIDEGATE_HEAD(H) \
  case H: return run<T, H>(p, items, query, k_cache, v_cache, out, qsl, sl, bt);
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

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, const at::Tensor& block_table, double scale,
                     int64_t sliding_window, int64_t max_query_len) {
  TORCH_CHECK(query.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "paged_attention: query and out must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: caches must be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "paged_attention: query, caches and out must share one dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "paged_attention: head_dim must be contiguous");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_table}) {
    TORCH_CHECK(t->scalar_type() == at::kInt, "paged_attention: metadata must be int32");
  }
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  block_table.stride(1) == 1,
              "paged_attention: metadata rows must be contiguous");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "paged_attention: cache head_dim differs");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_attention: ", num_heads,
              " query heads are not a multiple of ", num_kv_heads, " KV heads");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(k_cache.size(1) % KEYS == 0, "paged_attention: block size ", k_cache.size(1),
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
  p.kc_blk = k_cache.stride(0);
  p.kc_slot = k_cache.stride(1);
  p.kc_head = k_cache.stride(2);
  p.vc_blk = v_cache.stride(0);
  p.vc_slot = v_cache.stride(1);
  p.vc_head = v_cache.stride(2);
  p.bt_row = block_table.stride(0);
  p.max_blocks = block_table.size(1);
  p.block_size = k_cache.size(1);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.window = sliding_window;

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
      return dispatch_head<float>(head_dim, p, items, query, k_cache, v_cache, out,
                                  query_start_loc, seq_lens, block_table);
    case at::kBFloat16:
      return dispatch_head<c10::BFloat16>(head_dim, p, items, query, k_cache,
                                          v_cache, out, query_start_loc, seq_lens, block_table);
    case at::kHalf:
      return dispatch_head<c10::Half>(head_dim, p, items, query, k_cache, v_cache,
                                      out, query_start_loc, seq_lens, block_table);
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
                       at::Tensor v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "reshape_and_cache: int64 slots");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "reshape_and_cache: key and value must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == key.scalar_type() &&
                  v_cache.scalar_type() == key.scalar_type(),
              "reshape_and_cache: caches and keys must share one dtype");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
              "reshape_and_cache: key rows do not fit the cache");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "reshape_and_cache: contiguous rows only");
  const int64_t num_tokens = std::min<int64_t>(slot_mapping.size(0), key.size(0));
  const int64_t heads = key.size(1), dim = key.size(2);
  const int64_t row_bytes = dim * key.element_size();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const char* k = static_cast<const char*>(key.const_data_ptr());
  const char* v = static_cast<const char*>(value.const_data_ptr());
  char* kc = static_cast<char*>(k_cache.mutable_data_ptr());
  char* vc = static_cast<char*>(v_cache.mutable_data_ptr());
  const int64_t es = key.element_size();
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;  // padding: no slot
    TORCH_CHECK(slot < num_slots, "reshape_and_cache: slot ", slot, " is past the cache");
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kc + (slot * heads + h) * row_bytes, k + (i * key.stride(0) + h * key.stride(1)) * es,
                  row_bytes);
      std::memcpy(vc + (slot * heads + h) * row_bytes,
                  v + (i * value.stride(0) + h * value.stride(1)) * es, row_bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY(tidegate_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor block_table, float scale, "
      "int sliding_window, int max_query_len) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tidegate_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
