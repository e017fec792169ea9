// The multi-tensor walk shared by every CPU kernel: many tensors, cut into pieces and chunks of about
// equal element counts (not tensor counts), handed to threads one chunk at a time (parallel_for_each_item), so
// 10,000 tiny tensors and one huge tensor both keep every core busy, and a core another process shares
// takes fewer chunks.
//
// Determinism: piece and chunk boundaries depend only on the tensor sizes, never on the thread count,
// and each piece's partial result lands in its own slot; reductions then combine the slots in piece
// order. The same inputs give bit-identical norms whatever torch.set_num_threads() says, and whichever
// thread happened to take which chunk.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <thread>
#include <vector>

#include "item_pool.h"
#include "kernel_table.h"

namespace torchclip::cpu {

// Below this many elements a second thread costs more to wake than it saves (measured on the 2,000 x
// 64x64 workload: the crossover is near 20k fp32 elements).
constexpr int64_t kMinElementsPerThread = 32768;
// Chunks are at least this long (a multiple of every vector width), so a chunk's fixed cost (a partial
// slot, a loop entry) is amortised over >= 256 KiB of fp32 data.
constexpr int64_t kMinChunkElements = 1 << 16;
// A longer tensor is cut into pieces of about a kPiecesPerTensor-th of it, from kMinChunkElements to
// kMaxPieceElements long (piece_elements): each piece's reads start new streams from memory, which the prefetchers
// take a while to run ahead on, so longer pieces read faster, while a tensor still gives several threads work (a
// core a neighbour shares takes fewer pieces). On 2 AMD EPYC cores (Zen 4), 2 threads, against pieces of 64K
// elements (a scratch build switching per call, 40-100 alternated calls): get_total_norm took 0.93x the time on
// GPT-2 float32, 0.95x bfloat16, ResNet-50 0.975x and 0.85x; exact norms 0.84x, 0.93x, 0.92x and 0.91x. A 16th of
// a tensor gained about half as much.
constexpr int64_t kPiecesPerTensor = 4;
constexpr int64_t kMaxPieceElements = 1 << 20;
// A tensor is cut into at most about this many pieces, however big, so the partial slots stay O(number of
// tensors), not O(elements).
constexpr int64_t kMaxBigChunks = 1 << 14;

// The length of a tensor's pieces: its own size's alone, never the list's or the threads', so that a tensor's norm
// has the same bits in any list (Determinism, above).
inline int64_t piece_elements(int64_t numel) {
  int64_t piece = std::clamp(numel / kPiecesPerTensor, kMinChunkElements, kMaxPieceElements);
  piece = std::max(piece, (numel + kMaxBigChunks - 1) / kMaxBigChunks);
  return (piece + 63) / 64 * 64;
}

// The unit of work a kernel sees: elements [begin, end) of one tensor, numbered in list order. A
// tensor of at most kMinChunkElements is one piece; a longer one is cut into pieces of piece_elements.
// Empty tensors have none.
struct Piece {
  int64_t index;   // 0, 1, ... over all pieces, in list order
  int64_t tensor;  // index into the span list
  int64_t begin;
  int64_t end;
};

// What a thread is handed: one piece of a big tensor, or a run of whole small tensors of about
// kMinChunkElements together. Grouping small tensors keeps the plan O(chunks), not O(tensors): for
// 10,000 tensors of 100 elements a plan with an entry per tensor cost ~85 us to build (as much as
// clamping them); this one has 16 entries.
struct Chunk {
  int64_t first_tensor;  // tensors [first_tensor, end_tensor)
  int64_t end_tensor;
  int64_t begin;  // with one tensor: its element range (a piece of a big tensor, or all of it)
  int64_t end;
  int64_t first_piece;
};

struct ChunkPlan {
  std::vector<Chunk> chunks;
  int64_t total_elements = 0;
  int64_t pieces = 0;
};

inline ChunkPlan plan_chunks(const TensorSpan* spans, int64_t count) {
  ChunkPlan plan;
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    total += spans[i].numel;
  }
  // The run of whole small tensors being gathered into one chunk of about kMinChunkElements.
  int64_t run_start = -1, run_elements = 0, run_first_piece = 0;
  auto close_run = [&](int64_t end_tensor) {
    if (run_start >= 0) {
      const bool single = end_tensor - run_start == 1;
      plan.chunks.push_back({run_start, end_tensor, 0, single ? spans[run_start].numel : 0, run_first_piece});
      run_start = -1;
    }
  };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = spans[i].numel;
    if (n > kMinChunkElements) {
      close_run(i);
      const int64_t piece = piece_elements(n);
      for (int64_t b = 0; b < n; b += piece) {
        plan.chunks.push_back({i, i + 1, b, std::min(n, b + piece), plan.pieces++});
      }
    } else if (n > 0) {
      if (run_start < 0) {
        run_start = i;
        run_elements = 0;
        run_first_piece = plan.pieces;
      }
      run_elements += n;
      ++plan.pieces;
      if (run_elements >= kMinChunkElements) {
        close_run(i + 1);
      }
    }
  }
  close_run(count);
  plan.total_elements = total;
  return plan;
}

// Calls f(piece) for each piece of chunk c, in order.
template <typename F>
inline void for_each_piece_of_chunk(const ChunkPlan& plan, const TensorSpan* spans, int64_t c, F&& f) {
  const Chunk& chunk = plan.chunks[c];
  if (chunk.end_tensor - chunk.first_tensor == 1) {
    f(Piece{chunk.first_piece, chunk.first_tensor, chunk.begin, chunk.end});
    return;
  }
  int64_t index = chunk.first_piece;
  for (int64_t t = chunk.first_tensor; t < chunk.end_tensor; ++t) {
    if (spans[t].numel > 0) {
      f(Piece{index++, t, 0, spans[t].numel});
    }
  }
}

// Calls f(piece) for every piece, in order, on this thread.
template <typename F>
inline void for_each_piece(const ChunkPlan& plan, const TensorSpan* spans, F&& f) {
  for (int64_t c = 0; c < static_cast<int64_t>(plan.chunks.size()); ++c) {
    for_each_piece_of_chunk(plan, spans, c, f);
  }
}

// Whose threads a call runs on. torch's intra-op threads (OpenMP) are the fast choice while the cores are free:
// after torch's own parallel ops (backward's, before a clip) they are still spinning, ready, for a millisecond or so,
// and a thread of our own woken beside them waits for a core (the item pool alone took 10,000 x 100's
// get_total_norm from 1.00 to 1.46 ms, 1.16x on ResNet-50, until OMP_WAIT_POLICY=passive stopped the spinning).
// But OpenMP's parallel region ends only when every thread has arrived, and a thread whose core a busy neighbour (a
// data loader's worker) holds arrives a timeslice late, however little is left for it: 2-6x as long on 2 threads as
// on 1. So a call runs on torch's threads until one that they made slower than its calling thread alone would have
// been (its own rate over every item) by more than kLostBy; then the next 2, 4, 8 and up to kMaxPoolCalls calls run
// on the item pool (item_pool.h), which never waits for a thread that has not started, before torch's threads are
// tried again, and kWinsToForget calls they win in a row reset that. Beside a neighbour torch's threads win most
// calls and lose about one in ten by a timeslice (a trace of 10,000 x 100's calls on 2 AMD EPYC cores: 0.15 ms won,
// 4-8 ms lost), so one won call resetting the backoff, as it did, sent each loss's next 2 calls alone to the pool.
// With this rule, `torchclip-bench --busy --threads 1,2` (ten runs of each rule, 80 rows) had 6 rows over 1.5x
// their time on 1 thread against 13, the worst 2.28x against 13.65x. On the pool, a call whose helper ran items on
// the caller's core (crowded: item_pool.h) was one thread's work with a switch of threads added, up to 1.23x the
// caller alone on 10,000 x 100. Where the neighbour shares the caller's core instead, the helper has a core of its
// own and the pool beats the caller alone, though a quarter of its calls are crowded too (the scheduler moving
// threads). So kCrowdedToGoAlone more crowded calls than calls a helper shared from another core send the pool's next
// 8, 16 ... kMaxPoolCalls turns alone, and as many shared calls more reset that. Process-wide, per library: one
// neighbour slows every call alike.
// TORCHCLIP_THREADS=openmp or =pool keeps every call on one of the two (the tests choose, so that each path is
// covered however busy the machine is).
class ThreadsLosing {
 public:
  // How a call with threads to share runs: on torch's threads, on the item pool, or on its calling thread alone, which
  // takes the pool's turns while its helper crowds the caller (turns counted down as taken).
  enum class Way { TorchThreads, Pool, Alone };
  static Way way_now() {
    if (mode() != Mode::Adaptive) {
      return mode() == Mode::Pool ? Way::Pool : Way::TorchThreads;
    }
    if (!count_down(pool_left())) {
      return Way::TorchThreads;
    }
    return count_down(alone_left()) ? Way::Alone : Way::Pool;
  }

  // A call on torch's threads: it took `total` seconds, `takers` threads took its `count` items, and the calling
  // thread ran `own` of them and was done with them `own_done` seconds in. A calling thread that ran none of at
  // least two items a thread was held off its core while torch's other threads ran them all: beside a busy
  // neighbour, for a timeslice or two. Such a call is lost, and sends the next kMaxPoolCalls calls to the pool at
  // once. (With fewer items a late start can leave the caller none, and the call counts neither way.) Counted as
  // won, these calls had reset the backoff after most lost calls; counted as neither, they went unseen and torch's
  // threads stayed: of 400 calls of 10,000 x 100's get_total_norm beside a spinning process, 45-72 took over 2 ms,
  // 6-8 now (docs/performance.md, "A caller that ran no item"). With no neighbour, none of 798 calls left the caller
  // no item.
  static void record(double total, double own_done, int64_t own, int64_t count, int64_t takers) {
    if (mode() != Mode::Adaptive || (own == 0 && count < 2 * takers)) {
      return;
    }
    if (own == 0 || total * static_cast<double>(own) > kLostBy * own_done * static_cast<double>(count)) {
      const int doubled = std::min(2 * std::max(backoff().load(std::memory_order_relaxed), 1), kMaxPoolCalls);
      const int next = own == 0 ? kMaxPoolCalls : doubled;
      backoff().store(next, std::memory_order_relaxed);
      pool_left().store(next, std::memory_order_relaxed);
      wins().store(0, std::memory_order_relaxed);
    } else if (const int won = wins().load(std::memory_order_relaxed); won < kWinsToForget) {
      wins().store(won + 1, std::memory_order_relaxed);  // (counted up to kWinsToForget: no overflow)
      if (won + 1 == kWinsToForget) {
        backoff().store(0, std::memory_order_relaxed);
      }
    }
  }

  // A call on the item pool: `crowded` when a helper ran items on the caller's core, `shared` when one ran items on
  // another.
  static void record_pool(bool crowded, bool shared) {
    if (mode() != Mode::Adaptive) {
      return;
    }
    const int before = crowding().load(std::memory_order_relaxed);
    if (crowded && before + 1 == kCrowdedToGoAlone) {
      const int next = std::clamp(2 * alone_backoff().load(std::memory_order_relaxed), kFirstAloneCalls, kMaxPoolCalls);
      alone_backoff().store(next, std::memory_order_relaxed);
      alone_left().store(next, std::memory_order_relaxed);
      crowding().store(before, std::memory_order_relaxed);  // (one more crowded call after these sends the next)
    } else if (crowded) {
      crowding().store(before + 1, std::memory_order_relaxed);
    } else if (shared && before > 0) {
      crowding().store(before - 1, std::memory_order_relaxed);
      if (before == 1) {
        alone_backoff().store(0, std::memory_order_relaxed);
      }
    }
  }

 private:
  static constexpr double kLostBy = 2.0;  // (a call a little slower on threads is not worth leaving them for)
  static constexpr int kMaxPoolCalls = 256;
  static constexpr int kWinsToForget = 32;
  static constexpr int kFirstAloneCalls = 8;
  static constexpr int kCrowdedToGoAlone = 3;
  enum class Mode { Adaptive, OpenMP, Pool };
  static Mode mode() {
    static const Mode chosen = [] {
      const char* setting = std::getenv("TORCHCLIP_THREADS");
      const std::string_view name = setting == nullptr ? "" : setting;
      return name == "openmp" ? Mode::OpenMP : name == "pool" ? Mode::Pool : Mode::Adaptive;
    }();
    return chosen;
  }
  static bool count_down(std::atomic<int>& left) {
    int now = left.load(std::memory_order_relaxed);
    while (now > 0 && !left.compare_exchange_weak(now, now - 1, std::memory_order_relaxed)) {
    }
    return now > 0;
  }
  static std::atomic<int>& pool_left() {
    static std::atomic<int> value{0};
    return value;
  }
  static std::atomic<int>& alone_left() {
    static std::atomic<int> value{0};
    return value;
  }
  static std::atomic<int>& crowding() {  // crowded pool calls less shared ones, from 0 to kCrowdedToGoAlone - 1
    static std::atomic<int> value{0};
    return value;
  }
  static std::atomic<int>& alone_backoff() {
    static std::atomic<int> value{0};
    return value;
  }
  static std::atomic<int>& backoff() {
    static std::atomic<int> value{0};
    return value;
  }
  static std::atomic<int>& wins() {  // calls won since the last one lost
    static std::atomic<int> value{0};
    return value;
  }
};

// Which items each of torch's threads takes: its own share first, [t * count / takers, (t + 1) * count / takers) for
// the thread given t, then what the others have left of theirs, one item at a time from the front (a thread whose
// core a neighbour shares takes fewer, as from one shared counter). The threads read far apart: with one counter
// they took neighbouring pieces all along, and where memory read fastest (2 AMD EPYC cores, Zen 4, AVX-512) the SGD
// step over 24 x 1M float32 took 1.01-1.11x torch's fused step (median 1.09), which splits each tensor in halves; in
// shares 0.96-1.01x (median 0.99), and every order the same in slower hours (docs/optimizer.md). The item pool
// (item_pool.h), where calls go beside a busy neighbour, keeps its one counter.
class ItemShares {
 public:
  ItemShares(int64_t count, int64_t takers) : count_(count), takers_(takers), next_(static_cast<size_t>(takers)) {
    for (int64_t t = 0; t < takers; ++t) {
      next_[t].item.store(share_start(t), std::memory_order_relaxed);
    }
  }

  // Runs work(i) for items left, from share `home` on, until none is left in any; returns how many it ran.
  template <typename Work>
  int64_t take(int64_t home, const Work& work) {
    int64_t ran = 0;
    for (int64_t k = 0; k < takers_; ++k) {
      const int64_t share = (home + k) % takers_;
      std::atomic<int64_t>& next = next_[share].item;
      const int64_t end = share_start(share + 1);
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < end;
          i = next.fetch_add(1, std::memory_order_relaxed)) {
        work(i);
        ++ran;
      }
    }
    return ran;
  }

 private:
  int64_t share_start(int64_t share) const {
    return static_cast<int64_t>(static_cast<__int128>(share) * count_ / takers_);
  }

  struct alignas(64) Cursor {  // (a line each: the shares' owners advance them apart)
    std::atomic<int64_t> item{0};
  };
  int64_t count_, takers_;
  std::vector<Cursor> next_;
};

// Calls work(i) once for each i in [0, count): on this thread alone when threads <= 1 (or inside another call's
// item or torch's parallel region, or as ThreadsLosing says), else on this thread and threads - 1 others, torch's
// (ItemShares) or the item pool's as ThreadsLosing says, each taking a next i when it has finished one (a static
// split made every call wait for its slowest thread, and a thread is slow whenever another process shares its core).
// Nothing may depend on which thread ran an item: each item's result has its own slot, combined in item order (or,
// for exact sums, in any order), or its thread's (ItemPool::taker()).
template <typename Work>
inline void parallel_for_each_item(int64_t count, int64_t threads, const Work& work) {
  using Way = ThreadsLosing::Way;
  const bool alone = threads <= 1 || count <= 1 || ItemPool::in_item() || at::in_parallel_region();
  const Way way = alone ? Way::Alone : count < (int64_t{1} << 31) ? ThreadsLosing::way_now() : Way::TorchThreads;
  ItemPool* pool = way == Way::Pool ? ItemPool::acquire() : nullptr;  // (null while another thread's call holds it)
  if (way == Way::Alone || (way == Way::Pool && pool == nullptr)) {
    for (int64_t i = 0; i < count; ++i) {
      work(i);
    }
    return;
  }
  const int takers = static_cast<int>(std::min(threads, count));
  if (pool != nullptr) {
    const ItemPool::Ran ran = pool->run(count, takers, work);
    pool->release();
    ThreadsLosing::record_pool(ran.crowded, !ran.crowded && ran.own < count);
    return;
  }
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto caller = std::this_thread::get_id();
  ItemShares shares(count, takers);
  int64_t own = 0;
  Clock::time_point own_done = start;
  at::parallel_for(0, takers, 1, [&](int64_t home, int64_t) {
    const ItemPool::Taker taker(static_cast<int>(at::get_thread_num()));
    const int64_t taken = shares.take(home, work);
    if (std::this_thread::get_id() == caller) {
      own = taken;
      own_done = Clock::now();
    }
  });
  const std::chrono::duration<double> total = Clock::now() - start, own_time = own_done - start;
  ThreadsLosing::record(total.count(), own_time.count(), own, count, takers);
}

struct NoChunkScope {};

// Calls visit(piece) exactly once per piece, from torch's intra-op thread pool, chunk by chunk
// (parallel_for_each_item): threads when there are at least kMinElementsPerThread elements for each. A ChunkScope
// lives around each chunk's pieces (the exact norms' floating-point state: one write of it a chunk, not a piece).
template <typename ChunkScope = NoChunkScope, typename Visit>
inline void parallel_for_pieces(const ChunkPlan& plan, const TensorSpan* spans, const Visit& visit) {
  const int64_t num_chunks = static_cast<int64_t>(plan.chunks.size());
  const int64_t threads =
      std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, plan.total_elements / kMinElementsPerThread));
  parallel_for_each_item(num_chunks, threads, [&](int64_t c) {
    [[maybe_unused]] const ChunkScope scope;
    for_each_piece_of_chunk(plan, spans, c, visit);
  });
}

// Typed dispatch over the four storage types; `f` is called with a null pointer of the element type.
template <typename F>
inline void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float16:
      return f(static_cast<c10::Half*>(nullptr));
    case DType::BFloat16:
      return f(static_cast<c10::BFloat16*>(nullptr));
    case DType::Float32:
      return f(static_cast<float*>(nullptr));
    case DType::Float64:
      return f(static_cast<double*>(nullptr));
  }
}

}  // namespace torchclip::cpu
