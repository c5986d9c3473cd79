// The products of the work items (tile pairs x rows, through linear_kernels.h's micro-kernels; quantized weights
// expanded a group at a time, all at once, or read from their expanded codes) and the work split between threads.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "common.h"
#include "linear.h"
#include "linear_impl.h"
#include "linear_kernels.h"
#include "linear_kernels_codes.h"

namespace lmrpc::linear_detail {

namespace {

// How many rows share a register block: as many as fit beside their sums (quantized products keep a running
// total per group besides the group's sum).
// AVX2: every block, its rows two at a time per tile (block_avx2), so a block of kMaxRows reads each expanded
// group from L1 once per two rows.
template <typename T>
constexpr int block_rows(bool quantized) {
  if constexpr (LMRPC_AVX2 != 0) return kMaxRows;
  if constexpr (sizeof(T) == 2) return quantized ? 2 : 4;
  return 2;
}

template <typename T, int P, bool Q, typename Source>
void run_block(int rows, const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  if constexpr (sizeof(T) == 2) {  // (one quantized row on AVX512 never comes here: pair_products' one-row kernels)
    switch (rows) {
      case 1: block_bf16<1, P, Q>(src, groups, gkp, rb); break;
      case 2: block_bf16<2, P, Q>(src, groups, gkp, rb); break;
      case 3: block_bf16<3, P, Q>(src, groups, gkp, rb); break;
#if LMRPC_AVX2
      case 4: block_bf16<4, P, Q>(src, groups, gkp, rb); break;
      case 5: block_bf16<5, P, Q>(src, groups, gkp, rb); break;
      default: block_bf16<6, P, Q>(src, groups, gkp, rb); break;
#else
      default: block_bf16<4, P, Q>(src, groups, gkp, rb); break;
#endif
    }
  } else {
    switch (rows) {
      case 1: block_f32<1, P, Q>(src, groups, gkp, rb); break;
#if LMRPC_AVX2
      case 2: block_f32<2, P, Q>(src, groups, gkp, rb); break;
      case 3: block_f32<3, P, Q>(src, groups, gkp, rb); break;
      case 4: block_f32<4, P, Q>(src, groups, gkp, rb); break;
      case 5: block_f32<5, P, Q>(src, groups, gkp, rb); break;
      default: block_f32<6, P, Q>(src, groups, gkp, rb); break;
#else
      default: block_f32<2, P, Q>(src, groups, gkp, rb); break;
#endif
    }
  }
}

// ---- the product ------------------------------------------------------------------------------------------------

#if LMRPC_AVX512 || LMRPC_AVX2
// Every row of tile pair p in blocks of up to kRows rows of xq (the inputs as the products read them, bf16 or
// float32): block(rows, rb) computes a block's results into rb.out, and the epilogue writes them. The blocks are as
// even as their count allows (64 rows: 9 of 6 and 2 of 5, not 10 of 6 and one of 4; 8 rows: 4 and 4, not 6 and 2):
// a block of one or two rows keeps too few running sums to hide a dot product's latency. Which rows share a block
// never changes a row's bits.
template <int kRows = kMaxRows, typename T, typename Block>
void pair_in_row_blocks(const PackedWeight& w, const T* xq, const Inputs& in, const LinearArgs& a, RowRange rr,
                        int64_t p, Block&& block) {
  static_assert(kRows <= kMaxRows);
  const int64_t groups = w.k_pad / w.group;
  const int64_t m = rr.size(), blocks = (m + kRows - 1) / kRows;
  alignas(64) float out[kMaxRows][32 * kMaxPairs];
  for (int64_t b = 0, r0 = rr.begin; b < blocks; ++b) {
    const int64_t r1 = rr.begin + m * (b + 1) / blocks;  // blocks of kRows or one fewer rows
    const int rows = static_cast<int>(r1 - r0);
    RowBlock rb{};
    for (int r = 0; r < rows; ++r) {
      rb.x[r] = xq + (r0 + r) * w.k_pad;
      rb.sums[r] = w.has_offsets() ? in.sums.data() + (r0 + r) * groups : nullptr;
      rb.out[r] = out[r];
    }
    block(rows, rb);
    epilogue(w, a, r0, rows, p, 1, out);
    r0 = r1;
  }
}
#endif

#if LMRPC_AVX512

// Q4 weights, bf16 products, many rows: one tile pair at a time, blocks of up to kMaxRows rows over the 4-bit
// blocks, each group's codes expanded in registers once per row block (block_q4). Against reading the codes
// expanded to bf16 in memory (as Q8 weights do below), it reads a quarter of the bytes: interleaved step by step at
// 32 streams (SmolLM2, engine alone), decode steps 6-10% faster in each of 7 rounds, 512-token prefill steps the same.
void many_rows_q4(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p,
                  const Q4Table& table) {
  const int64_t groups = w.k_pad / w.group;
  pair_in_row_blocks(w, in.bf16.data(), in, a, rr, p, [&](int rows, const RowBlock& rb) {
    switch (rows) {
      case 1: block_q4<1>(w, p, table, groups, rb); break;
      case 2: block_q4<2>(w, p, table, groups, rb); break;
      case 3: block_q4<3>(w, p, table, groups, rb); break;
      case 4: block_q4<4>(w, p, table, groups, rb); break;
      case 5: block_q4<5>(w, p, table, groups, rb); break;
      default: block_q4<6>(w, p, table, groups, rb); break;
    }
  });
}

// Rows from which products read a weight's bf16 copy of its 8-bit codes (PackedWeight::codes) rather than the codes:
// below it, twice the bytes cost more than making the codes bf16 in registers. The bundled model's Q8_0 head (49152 x
// 576, three copies so that none stays in L3; two threads, AMD EPYC Zen 4): 2.20 / 2.30 / 2.37 / 2.62 ms from the
// copy at 2 / 3 / 4 / 6 rows against 1.57 / 1.77 / 2.00 / 2.33 from the codes, level at 8 (2.52 / 2.61), the copy
// ahead from 16 (3.74 / 3.85; 32 rows: 6.99 / 7.72).
constexpr int64_t kCodesCopyRows = 8;

// Q8 (and Q6) weights with expanded codes, bf16 products, many rows: one tile pair at a time, blocks of up to
// kMaxRows rows with their running sums in registers across the groups (block_bf16<R, 1, true>: 2R group sums and
// 2R totals fit beside the weights), so no group's sums leave the registers and six rows share each weight load.
// (Measured here against two pairs of three or four rows: one pair of six or four is faster.)
void many_rows_codes(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p) {
  const int64_t kp = w.k_pad / 2, groups = w.k_pad / w.group, gkp = w.group / 2;
  const CodesSource src[1] = {{PairIndex{&w, p, groups, gkp, kp}}};
  pair_in_row_blocks(w, in.bf16.data(), in, a, rr, p, [&](int rows, const RowBlock& rb) {
    switch (rows) {
      case 1: block_bf16<1, 1, true>(src, groups, gkp, rb); break;
      case 2: block_bf16<2, 1, true>(src, groups, gkp, rb); break;
      case 3: block_bf16<3, 1, true>(src, groups, gkp, rb); break;
      case 4: block_bf16<4, 1, true>(src, groups, gkp, rb); break;
      case 5: block_bf16<5, 1, true>(src, groups, gkp, rb); break;
      default: block_bf16<6, 1, true>(src, groups, gkp, rb); break;
    }
  });
}

// Q8, Q6, Q5 and Q3 weights without expanded codes, bf16 products, many rows: as many_rows_codes, each unit of four
// kpair vectors made bf16 in registers once per block of rows (block_codes).
template <typename Units>
void codes_in_registers(int rows, const PackedWeight& w, int64_t p, int64_t groups, const RowBlock& rb,
                        const Q4Table& table) {
  switch (rows) {
    case 1: block_codes<1, Units>(w, p, groups, rb, table); break;
    case 2: block_codes<2, Units>(w, p, groups, rb, table); break;
    case 3: block_codes<3, Units>(w, p, groups, rb, table); break;
    case 4: block_codes<4, Units>(w, p, groups, rb, table); break;
    case 5: block_codes<5, Units>(w, p, groups, rb, table); break;
    default: block_codes<6, Units>(w, p, groups, rb, table); break;
  }
}

void many_rows_codes_in_registers(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr,
                                  int64_t p, const Q4Table& table) {
  const int64_t groups = w.k_pad / w.group;
  pair_in_row_blocks(w, in.bf16.data(), in, a, rr, p, [&](int rows, const RowBlock& rb) {
    switch (w.format) {
      case WeightFormat::Q6: codes_in_registers<Q6Units>(rows, w, p, groups, rb, table); break;
      case WeightFormat::Q3: codes_in_registers<Q3Units>(rows, w, p, groups, rb, table); break;
      case WeightFormat::Q5: codes_in_registers<Q5Units>(rows, w, p, groups, rb, table); break;
      default: codes_in_registers<Q8Units>(rows, w, p, groups, rb, table); break;
    }
  });
}
#endif

#if LMRPC_AVX2
// Q4 weights, float32 products, many rows: one tile pair at a time, blocks of 4 rows over the 4-bit blocks, the
// codes made floats in registers once per block (block_q4_f32), rather than every group expanded to 4 bytes a
// weight in a buffer that a large weight's row blocks read from L3.
void many_rows_q4_f32(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p) {
  pair_in_row_blocks<4>(w, in.f32.data(), in, a, rr, p, [&](int rows, const RowBlock& rb) {
    if (w.q4_signed) {
      switch (rows) {
        case 1: block_q4_f32<1, true>(w, p, rb); break;
        case 2: block_q4_f32<2, true>(w, p, rb); break;
        case 3: block_q4_f32<3, true>(w, p, rb); break;
        default: block_q4_f32<4, true>(w, p, rb); break;
      }
    } else {
      switch (rows) {
        case 1: block_q4_f32<1, false>(w, p, rb); break;
        case 2: block_q4_f32<2, false>(w, p, rb); break;
        case 3: block_q4_f32<3, false>(w, p, rb); break;
        default: block_q4_f32<4, false>(w, p, rb); break;
      }
    }
  });
}

// Q8 and Q6 weights, float32 products, many rows: as many_rows_q4_f32, over their 8-bit codes (block_q8_f32); a Q6
// pair's codes decoded once into Q8 vectors for all its row blocks (a 2048 x 8192 pair: 256 KiB, in L2).
void many_rows_q8_f32(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p) {
  const int64_t kp = w.k_pad / 2;
  const int8_t* codes = static_cast<const int8_t*>(w.data) + p * kp * 64;
  if (w.format == WeightFormat::Q6) {
    thread_local AlignedBuffer<int8_t> decoded;  // each thread's own; kept between calls
    if (decoded.size() < static_cast<size_t>(kp * 64)) decoded.resize(kp * 64);
    decode_q6(q6_group(w, p * kp * 2), kp / 2, decoded.data());
    codes = decoded.data();
  }
  pair_in_row_blocks<4>(w, in.f32.data(), in, a, rr, p, [&](int rows, const RowBlock& rb) {
    switch (rows) {
      case 1: block_q8_f32<1>(w, p, codes, rb); break;
      case 2: block_q8_f32<2>(w, p, codes, rb); break;
      case 3: block_q8_f32<3>(w, p, codes, rb); break;
      default: block_q8_f32<4>(w, p, codes, rb); break;
    }
  });
}
#endif

// The rows of `pairs` (1 or kMaxPairs) tile pairs from pair p.
template <typename T, int P>
void pair_products(const PackedWeight& w, const Inputs& in, const LinearArgs& a, RowRange rr, int64_t p,
                   const Q4Table& table, AlignedBuffer<T>& buffer) {
  const int64_t kp = w.k_pad / 2, groups = w.k_pad / w.group, gkp = w.group / 2;
  const bool quantized = w.quantized();
  const int rows_per_block = block_rows<T>(quantized);
  const bool one_block = rr.size() <= rows_per_block;
  const T* xq;
  if constexpr (sizeof(T) == 2) xq = in.bf16.data(); else xq = in.f32.data();
#if LMRPC_VNNI
  if constexpr (sizeof(T) == 2) {
    if (in.int8) {
      for (int q = 0; q < P; ++q) vnni_pair(w, in, a, rr, p + q);
      return;
    }
  }
#endif
#if LMRPC_AVX512
  if constexpr (sizeof(T) == 2) {
    // Two rows take the many-row kernels too (codes made bf16 in registers once for both rows): expanded a group at a
    // time into a buffer (one_block's path) they took up to twice as long (two threads, AMD EPYC Zen 4: Q5_K 8192 x
    // 2048 0.77 ms at two rows against 0.40 at three, Q4_K 0.49 against 0.45; the bundled model's Q4_1 3072 x 576
    // 53-58 us against 35-43 in registers).
    const bool two_rows = rr.size() == 2;
    if (quantized && (!one_block || two_rows)) {
      if (w.format == WeightFormat::Q4) {
        for (int q = 0; q < P; ++q) many_rows_q4(w, in, a, rr, p + q, table);
      } else if (w.codes != nullptr && rr.size() >= kCodesCopyRows) {
        for (int q = 0; q < P; ++q) many_rows_codes(w, in, a, rr, p + q);
      } else {  // Q8, Q6, Q5 or Q3 without a copy
        for (int q = 0; q < P; ++q) many_rows_codes_in_registers(w, in, a, rr, p + q, table);
      }
      return;
    }
    if (quantized && rr.size() == 1) {  // one row: codes read as stored, made bf16 in registers
      alignas(64) float row[32 * kMaxPairs];
      const uint16_t* x = in.bf16.data() + rr.begin * w.k_pad;
      const float* sums = w.has_offsets() ? in.sums.data() + rr.begin * groups : nullptr;
      switch (w.format) {
        case WeightFormat::Q4: one_row_q4_bf16<P>(w, p, table, x, sums, row); break;
        case WeightFormat::Q6: one_row_units_bf16<P, Q6Units>(w, p, table, x, sums, row); break;
        case WeightFormat::Q3: one_row_units_bf16<P, Q3Units>(w, p, table, x, sums, row); break;
        case WeightFormat::Q5: one_row_units_bf16<P, Q5Units>(w, p, table, x, sums, row); break;
        default: one_row_q8_bf16<P>(w, p, x, sums, row); break;
      }
      epilogue(w, a, rr.begin, 1, p, P, reinterpret_cast<const float (*)[32 * kMaxPairs]>(row));
      return;
    }
  }
#endif
#if LMRPC_AVX2
  if constexpr (sizeof(T) == 4) {
    if (in.int8) {
      for (int q = 0; q < P; ++q) int8_pair_avx2(w, in, a, rr, p + q);
      return;
    }
    if (in.int16) {
      for (int q = 0; q < P; ++q) int16_pair_avx2(w, in, a, rr, p + q);
      return;
    }
    if (w.format == WeightFormat::Q4 && !one_block) {
      for (int q = 0; q < P; ++q) many_rows_q4_f32(w, in, a, rr, p + q);
      return;
    }
    if ((w.format == WeightFormat::Q8 || w.format == WeightFormat::Q6) && !one_block) {
      for (int q = 0; q < P; ++q) many_rows_q8_f32(w, in, a, rr, p + q);
      return;
    }
    if (quantized && rr.size() == 1) {  // one row (a decode step of one sequence): codes read as stored
      alignas(64) float row[32 * kMaxPairs];
      const float* x = in.f32.data() + rr.begin * w.k_pad;
      const float* sums = w.has_offsets() ? in.sums.data() + rr.begin * groups : nullptr;
      for (int q = 0; q < P; ++q) {
        if (w.q4_signed && w.format == WeightFormat::Q4) one_row_codes_f32<true>(w, p + q, x, sums, row + 32 * q);
        else one_row_codes_f32<false>(w, p + q, x, sums, row + 32 * q);
      }
      epilogue(w, a, rr.begin, 1, p, P, reinterpret_cast<const float (*)[32 * kMaxPairs]>(row));
      return;
    }
  }
#endif
  alignas(64) float out[kMaxRows][32 * kMaxPairs];
  const int64_t per_pair = (one_block ? 2 * gkp : kp) * 64;  // expanded values per pair (two group slots)
  if (quantized && buffer.size() < static_cast<size_t>(P * per_pair)) buffer.resize(P * per_pair);
  for (int64_t r0 = rr.begin; r0 < rr.end; r0 += rows_per_block) {
    const int rows = static_cast<int>(std::min<int64_t>(rows_per_block, rr.end - r0));
    RowBlock rb{};
    for (int r = 0; r < rows; ++r) {
      rb.x[r] = xq + (r0 + r) * w.k_pad;
      rb.sums[r] = w.has_offsets() ? in.sums.data() + (r0 + r) * groups : nullptr;
      rb.out[r] = out[r];
    }
    if (!quantized) {
      DenseSource<T> src[P];
      for (int q = 0; q < P; ++q) src[q] = DenseSource<T>{PairIndex{&w, p + q, groups, gkp, kp}};
      run_block<T, P, false>(rows, src, groups, gkp, rb);
    } else if (one_block) {
      ExpandSource<T> src[P];
      for (int q = 0; q < P; ++q) src[q] = {PairIndex{&w, p + q, groups, gkp, kp}, &table, buffer.data() + q * per_pair};
      run_block<T, P, true>(rows, src, groups, gkp, rb);
    } else {
      ExpandedSource<T> src[P];
      for (int q = 0; q < P; ++q) {
        if (r0 == rr.begin) {
          ExpandSource<T>{PairIndex{&w, p + q, groups, gkp, kp}, &table, buffer.data() + q * per_pair}.expand_all();
        }
        src[q] = {PairIndex{&w, p + q, groups, gkp, kp}, buffer.data() + q * per_pair};
      }
      run_block<T, P, true>(rows, src, groups, gkp, rb);
    }
    epilogue(w, a, r0, rows, p, P, out);
  }
}

constexpr int64_t kSerialWork = int64_t{1} << 18;  // multiply-adds (rows x padded outputs x padded inputs)
constexpr int64_t kItemsPerThread = 8;  // work items a job should offer each thread, so the last ones even out

// A job's work items: its blocks of kMaxPairs tile pairs, each over `row_chunk` of its rows. A job with few blocks
// (576 outputs: 9 blocks for 2 threads) splits its rows too, so no thread waits a whole block for the other; the two
// halves of a block come one after the other, so both threads read its weights while they are in cache. Which rows
// share an item never changes a row's bits.
struct JobItems {
  int64_t blocks;     // blocks of tile pairs
  int64_t splits;     // row chunks per block
  int64_t row_chunk;  // rows per chunk (the last may have fewer)
};

JobItems job_items(const LinearJob& job, int threads) {
  const int64_t blocks = (job.w->n_pad / 32 + kMaxPairs - 1) / kMaxPairs, m = job.args.m;
  int64_t splits = 1;
  if (threads > 1 && blocks < kItemsPerThread * threads) {
    const int64_t wanted = (kItemsPerThread * threads + blocks - 1) / blocks;
    splits = std::max<int64_t>(1, std::min<int64_t>(wanted, m / kMaxRows));  // chunks of at least kMaxRows rows
  }
  const int64_t row_chunk = (m + splits - 1) / splits;
  return {blocks, (m + row_chunk - 1) / row_chunk, row_chunk};  // no chunk left empty by the rounding up
}

}  // namespace

// The work items of every job, handed out as the threads ask: a vCPU slowed by its host does less of the work.
// Products of one row (a decode step of one sequence) hand them out in shrinking runs (guided: half of what is left
// between the threads, down to single items): such a product takes tens of microseconds to a millisecond, and with
// runs of a sixteenth of the items one thread often waited most of a run for the other at its end. Engine alone
// (bench/phases.py, AMD EPYC Zen 4, old and new kernels alternating): bundled one-stream decode forward 0.84-0.98x
// of the fixed runs in 8 of 8 rounds (median ~0.90x), 1.7B Q4_K_M 0.82-1.04x in 7 (median 0.96x). Products of many
// rows keep runs of a sixteenth: a 32-stream prefill ran 1.03-1.07x longer with shrinking runs. Which thread
// computes an item never changes its bits. T: uint16_t (bf16 products) or float (float32).
template <typename T>
void products(const LinearJob* jobs, const Inputs* in, int64_t count) {
  thread_local std::vector<int64_t> starts;  // kept between calls (the calling thread's; the team reads `first`)
  thread_local std::vector<JobItems> items;
  starts.assign(count + 1, 0);
  items.resize(count);
  int64_t pairs = 0, work = 0;
  bool one_row = true;
  for (int64_t j = 0; j < count; ++j) {
    const PackedWeight& w = *jobs[j].w;
    pairs += w.n_pad / 32;
    work += jobs[j].args.m * w.n_pad * w.k_pad;
    one_row = one_row && jobs[j].args.m == 1;
  }
  static const Q4Table linear[2] = {Q4Table(false), Q4Table(true)};  // codes standing for q, q - 8
  // Weights whose codes index values of their own (IQ4, grid formats) get their table here, per call; other calls
  // (most, and every one of the usual formats' decode steps) build and allocate nothing.
  std::vector<Q4Table> own;
  if (std::any_of(jobs, jobs + count, [](const LinearJob& job) { return job.w->code_table; })) {
    own.reserve(count);
    for (int64_t j = 0; j < count; ++j) own.emplace_back(*jobs[j].w);
  }
  // Work smaller than a thread hand-off costs (a decode step's LoRA products: a few rows of rank-16 matrices) stays
  // on the calling thread. Which thread computes a block never changes its bits.
  const int threads =
      work < kSerialWork ? 1 : static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), pairs)));
  int64_t* first = starts.data();  // job j's items are [first[j], first[j + 1])
  for (int64_t j = 0; j < count; ++j) {
    items[j] = job_items(jobs[j], threads);
    first[j + 1] = first[j] + items[j].blocks * items[j].splits;
  }
  const JobItems* job_items_of = items.data();  // (the team reads the calling thread's items through this)
  const int64_t total = first[count];
  const int64_t grab = std::max<int64_t>(1, total / (8 * threads));
  auto item = [&](int64_t b, AlignedBuffer<T>& buffer) {
    const int64_t j = std::upper_bound(first, first + count + 1, b) - first - 1;
    const PackedWeight& w = *jobs[j].w;
    const JobItems& it = job_items_of[j];
    const Q4Table& table = w.code_table ? own[j] : linear[w.q4_signed ? 1 : 0];
    const int64_t at = b - first[j], block = at / it.splits, chunk = at % it.splits;
    const RowRange rr{chunk * it.row_chunk, std::min<int64_t>(jobs[j].args.m, (chunk + 1) * it.row_chunk)};
    const int64_t job_pairs = w.n_pad / 32, p = block * kMaxPairs;
    if (p + kMaxPairs <= job_pairs) {
      pair_products<T, kMaxPairs>(w, in[j], jobs[j].args, rr, p, table, buffer);
    } else {
      for (int64_t q = p; q < job_pairs; ++q) pair_products<T, 1>(w, in[j], jobs[j].args, rr, q, table, buffer);
    }
  };
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    thread_local AlignedBuffer<T> buffer;  // expanded weights, each thread's own; kept between calls
    if (one_row) {
#pragma omp for schedule(guided)
      for (int64_t b = 0; b < total; ++b) item(b, buffer);
    } else {
#pragma omp for schedule(dynamic, grab)
      for (int64_t b = 0; b < total; ++b) item(b, buffer);
    }
#if LMRPC_AVX512
    _mm_sfence();  // streamed outputs (epilogue) reach memory before other threads read them
#endif
  }
}

template void products<uint16_t>(const LinearJob* jobs, const Inputs* in, int64_t count);
template void products<float>(const LinearJob* jobs, const Inputs* in, int64_t count);

}  // namespace lmrpc::linear_detail
