// The threads behind parallel_for_each_item: a call waits only for the items a thread has taken, never for a
// thread that has not started.
//
// Why threads of our own beside torch's intra-op threads (multi_tensor.h's ThreadsLosing chooses, call by call):
// OpenMP's parallel region ends only when every thread has arrived, and a thread whose core another process holds
// (a data loader's worker beside training) arrives a timeslice late, however little is left for it. Beside one
// spinning process on 2 cores, rows of torchclip-bench took up to 4.6x as long on 2 threads as on 1 on torch's
// threads, and at most 1.4x on these (docs/performance.md, "A busy neighbour"). Here the calling thread takes items
// from the same counter as its helpers, and once none is left it waits only for those a helper is still running; a
// helper that wakes later finds the call closed and goes back to sleep.
//
// A helper that starts its items on the caller's core (crowded) took that core from it: beside a busy neighbour
// the scheduler had no other core to give, and the caller sat in the run queue while the helper ran every item (10,000
// x 100's get_total_norm beside a spinning process: in 371 of 600 calls the caller ran none). The call says so
// (Ran::crowded), so that the pool's next turns run alone where most calls are (multi_tensor.h's ThreadsLosing), and
// the helper sleeps at once instead of spinning for the next call on the core its caller waits for (in the runs where
// the helper took the caller's core, the pool's calls took 1.10-1.23x the caller's alone; sleeping at
// once, 1.03-1.05x).
//
// How a call is shared. `claim_` packs the call's number (high 32 bits) and its next item (low 32 bits). A thread
// takes item i of call c by moving claim_ from (c, i) to (c, i + 1) while i < count; success means call c is still
// open (the caller closes it only after every taken item is done), so the call's fields may be read until the
// taker counts its item done. The caller closes a call by setting its next item to kClosed, so that a helper
// holding a stale (c, i) fails its exchange. (A helper would have to sleep between its load and its exchange
// through 2^32 calls for the numbers to meet again.)
#pragma once

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <list>
#include <system_error>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace torchclip::cpu {

class ItemPool {
 public:
  // The process's pool, or nullptr while another thread's call holds it (that call then runs alone: two
  // callers at once would each take threads the other counted on). Release it with release().
  static ItemPool* acquire() {
    ItemPool& pool = source().load(std::memory_order_acquire)();
    bool idle = false;
    return pool.busy_.compare_exchange_strong(idle, true, std::memory_order_acquire) ? &pool : nullptr;
  }
  // Where acquire() finds the pool: this library's own (of_this_library) unless pointed elsewhere. The op
  // library points each CPU kernel library at its own when loading it (kernel_loader.cpp), so that the parameter
  // walk and the kernels share one set of helpers: helpers of two pools would spin on the same cores.
  using Source = ItemPool& (*)();
  static void use(Source pool_source) { source().store(pool_source, std::memory_order_release); }
  static ItemPool& of_this_library() {
    // A child made by fork() has none of the parent's helpers, and its pool may have been mid-call; it starts a
    // pool of its own. The old ones stay listed, so that they are not leaks. Never destroyed: helpers wait on
    // their members until the process ends.
    static std::list<ItemPool>* const pools = [] {
      pthread_atfork(nullptr, nullptr, [] { forked().store(true, std::memory_order_relaxed); });
      return new std::list<ItemPool>(1);
    }();
    if (forked().load(std::memory_order_relaxed) && forked().exchange(false)) {
      pools->emplace_back();
    }
    return pools->back();
  }
  void release() { busy_.store(false, std::memory_order_release); }

  // What a call's run saw: how many items the calling thread ran, and whether a helper ran one on its core.
  struct Ran {
    int64_t own;
    bool crowded;
  };

  // Calls work(i) once for each i in [0, count) on this thread and up to takers - 1 helpers, and returns when every
  // item is done. count < 2^32 - 1.
  template <typename Work>
  Ran run(int64_t count, int takers, const Work& work) {
    ensure_helpers(takers - 1);
    // (instantiated in the calling library, so that taker() and in_item() read what this sets: each library has
    // its own copies of those thread-locals)
    work_ = [](const void* context, int64_t item, int taker) {
      const Taker scope(taker);
      (*static_cast<const Work*>(context))(item);
    };
    context_ = &work;
    count_.store(count, std::memory_order_relaxed);
    takers_.store(takers, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    crowded_.store(false, std::memory_order_relaxed);
    caller_core_.store(current_core(), std::memory_order_relaxed);
    const uint32_t call = call_number_.load(std::memory_order_relaxed) + 1;
    claim_.store(static_cast<uint64_t>(call) << 32, std::memory_order_release);
    // (seq_cst, as is the sleepers' count: either a helper about to sleep sees this call, or this sees it asleep)
    call_number_.store(call, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      wake_all(call_number_);
    }
    const int64_t own = take_items(call, 0);
    for (int spins = 0; done_.load(std::memory_order_acquire) < count; ++spins) {
      if (spins < kCallerSpins) {
        pause();
      } else {
        std::this_thread::yield();  // (a helper preempted in its item may be waiting for this core)
      }
    }
    claim_.store(static_cast<uint64_t>(call) << 32 | kClosed, std::memory_order_release);
    return {own, crowded_.load(std::memory_order_relaxed)};  // (stored before its item was counted done: acquired)
  }

  // The index of the thread running the current item: 0 for the caller (and outside a call), 1.. for helpers.
  // Per-thread partial results are kept by this (where at::parallel_for's users ask at::get_thread_num()).
  static int taker() { return taker_index(); }

  // Whether this thread is running an item for a call (which then runs any call it makes alone).
  static bool in_item() { return in_item_flag(); }

  // While it lives, this thread runs items as taker number `taker` (for work run on other threads than the pool's).
  struct Taker {
    explicit Taker(int taker) : index(taker_index()), flag(in_item_flag()) {
      taker_index() = taker;
      in_item_flag() = true;
    }
    ~Taker() {
      taker_index() = index;
      in_item_flag() = flag;
    }
    Taker(const Taker&) = delete;
    Taker& operator=(const Taker&) = delete;
    int index;
    bool flag;
  };

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr uint32_t kClosed = 0xffffffffu;
  // A helper looks for the next call this long before sleeping (unless its items ran on their caller's core): a
  // clip's calls come in runs (norm, then scale), and waking a sleeping thread costs tens of microseconds.
  static constexpr auto kHelperSpin = std::chrono::microseconds(50);
  static constexpr int kCallerSpins = 1 << 12;

  static std::atomic<Source>& source() {
    static std::atomic<Source> value{&of_this_library};
    return value;
  }
  static std::atomic<bool>& forked() {
    static std::atomic<bool> value{false};
    return value;
  }
  static int& taker_index() {
    thread_local int index = 0;
    return index;
  }
  static bool& in_item_flag() {
    thread_local bool flag = false;
    return flag;
  }

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  // The core this thread runs on, or -1 where that cannot be asked.
  static int current_core() {
#if defined(__linux__)
    return sched_getcpu();
#else
    return -1;
#endif
  }

  // Takes and runs items of call `call` as taker number `taker` until none is left; returns how many it ran. A
  // helper (which passes `crowding`) learns at its first item whether it runs on the caller's core, and says so in
  // crowded_ before any of its items is counted done.
  int64_t take_items(uint32_t call, int taker, bool* crowding = nullptr) {
    int64_t ran = 0;
    uint64_t claim = claim_.load(std::memory_order_acquire);
    while (static_cast<uint32_t>(claim >> 32) == call) {
      const uint32_t item = static_cast<uint32_t>(claim);
      // (a count of a later call is read only once this call is closed, and then the exchange fails)
      if (item == kClosed || item >= count_.load(std::memory_order_relaxed) ||
          taker >= takers_.load(std::memory_order_relaxed)) {
        break;
      }
      if (!claim_.compare_exchange_weak(claim, claim + 1, std::memory_order_acquire)) {
        continue;
      }
      if (ran == 0 && crowding != nullptr) {
        const int core = current_core();
        *crowding = core >= 0 && core == caller_core_.load(std::memory_order_relaxed);
        if (*crowding) {
          crowded_.store(true, std::memory_order_relaxed);
        }
      }
      work_(context_, item, taker);
      done_.fetch_add(1, std::memory_order_release);
      ++ran;
      claim = claim_.load(std::memory_order_acquire);
    }
    return ran;
  }

  void ensure_helpers(int wanted) {
    while (helpers_ < wanted) {
      const int index = helpers_ + 1;
      try {
        std::thread([this, index] { helper_loop(index); }).detach();
      } catch (const std::system_error&) {
        return;  // (no thread to be had: the caller takes what no helper does)
      }
      helpers_ = index;
    }
  }

  void helper_loop(int index) {
    uint32_t seen = 0;
    bool crowding = false;  // (whether this helper's last items ran on their caller's core)
    for (;;) {
      const auto spin_until = crowding ? Clock::now() : Clock::now() + kHelperSpin;
      for (int spins = 0; call_number_.load(std::memory_order_acquire) == seen; ++spins) {
        if (spins % 64 == 63 && Clock::now() > spin_until) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          sleep_while(call_number_, seen);
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
        } else {
          pause();
        }
      }
      seen = call_number_.load(std::memory_order_acquire);
      crowding = false;
      take_items(seen, index, &crowding);
    }
  }

  // Sleeps while `word` holds `value` (or until woken; callers check again). A waker must never wait for a
  // sleeper: glibc's condition variable makes notify_all wait for a thread woken earlier that has not yet run,
  // which is the wait this pool exists to avoid.
  static void sleep_while(std::atomic<uint32_t>& word, uint32_t value) {
#if defined(__linux__)
    if (word.load(std::memory_order_seq_cst) == value) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
    }
#else
    if (word.load(std::memory_order_seq_cst) == value) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
#endif
  }
  static void wake_all(std::atomic<uint32_t>& word) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
    (void)word;
#endif
  }

  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> count_{0};  // (read before an item is taken: atomic)
  std::atomic<int> takers_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> caller_core_{-1};  // (where the latest call's caller was when it started it)
  std::atomic<bool> crowded_{false};
  // The call's work, read only by a thread that has taken one of its items.
  void (*work_)(const void*, int64_t, int) = nullptr;
  const void* context_ = nullptr;
  // The latest call's number, which sleeping helpers wait on (a futex word: 32 bits).
  std::atomic<uint32_t> call_number_{0};
  int helpers_ = 0;  // (the caller's: changed only while the pool is held)
};

}  // namespace torchclip::cpu
