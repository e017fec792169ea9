// C++ test of the threads behind parallel_for_each_item (csrc/cpu/item_pool.h): every item runs exactly once,
// under concurrent callers, nested calls and in a forked child, a call does not wait for a helper that cannot run, and
// a call says whether a helper ran items on its caller's core.
// Usage: torchclip_item_pool_test
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpu/item_pool.h"

namespace {

using torchclip::cpu::ItemPool;

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "PASS " : "FAIL ") << what << "\n";
  failures += ok ? 0 : 1;
}

// Work that takes a while and cannot be optimised away.
void busy_work(int steps) {
  volatile unsigned sink = 0;  // (unsigned, so that the sum wraps: an int's overflows within 200,000 steps)
  for (int i = 0; i < steps; ++i) {
    sink = sink + static_cast<unsigned>(i);
  }
}

// Runs `calls` calls of random sizes and taker counts on the pool (or alone, when another caller holds it) and
// returns whether every item of every call ran exactly once.
bool every_item_once(int calls, unsigned seed) {
  std::mt19937 random(seed);
  bool ok = true;
  for (int call = 0; call < calls; ++call) {
    const int64_t count = 2 + static_cast<int64_t>(random() % 300);
    const int takers = 2 + static_cast<int>(random() % 3);
    std::vector<std::atomic<int>> runs(count);
    auto work = [&](int64_t item) {
      runs[item].fetch_add(1, std::memory_order_relaxed);
      busy_work(static_cast<int>(item % 7) * 50);
    };
    if (ItemPool* pool = ItemPool::acquire()) {
      pool->run(count, takers, work);
      pool->release();
    } else {
      for (int64_t i = 0; i < count; ++i) {
        work(i);
      }
    }
    for (const auto& r : runs) {
      ok &= r.load() == 1;
    }
  }
  return ok;
}

// A helper's thread, found by the items it takes (this thread's own when none took any in 1,000 calls).
pthread_t a_helper() {
  const pthread_t caller = pthread_self();
  std::atomic<pthread_t> helper{caller};
  for (int attempt = 0; attempt < 1000 && pthread_equal(helper.load(), caller); ++attempt) {
    ItemPool* pool = ItemPool::acquire();
    pool->run(64, 2, [&](int64_t) {
      if (!pthread_equal(pthread_self(), caller)) {
        helper.store(pthread_self());
      }
      busy_work(20000);
    });
    pool->release();
  }
  return helper.load();
}

// Runs calls, in a forked child whose threads are pinned (the caller and its helpers to one core, or the caller to
// one and its helper to another), until a helper has run items in 20 of them; exits 0 when every such call said it
// was crowded (one core) or none did (two), 1 when not, 2 when the pinning or the helper could not be had.
int crowding_child(bool one_core) {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || CPU_COUNT(&allowed) < (one_core ? 1 : 2)) {
    return 2;
  }
  int cores[2] = {-1, -1};
  for (int cpu = 0, found = 0; cpu < CPU_SETSIZE && found < 2; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) {
      cores[found++] = cpu;
    }
  }
  const auto pin = [](pthread_t thread, int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(thread, sizeof set, &set) == 0;
  };
  const pthread_t helper = a_helper();  // (the child's pool: its helpers start here)
  if (pthread_equal(helper, pthread_self()) || !pin(pthread_self(), cores[0]) ||
      !pin(helper, one_core ? cores[0] : cores[1])) {
    return 2;
  }
  int shared = 0;
  for (int call = 0; call < 2000 && shared < 20; ++call) {
    ItemPool* pool = ItemPool::acquire();
    const ItemPool::Ran ran = pool->run(16, 2, [](int64_t) { busy_work(200000); });
    pool->release();
    if (ran.own < 16) {
      ++shared;
      if (ran.crowded != one_core) {
        return 1;
      }
    }
  }
  return shared == 20 ? 0 : 2;
}

bool crowding_seen(bool one_core) {
  const pid_t child = fork();
  if (child == 0) {
    _exit(crowding_child(one_core));
  }
  int status = 0;
  waitpid(child, &status, 0);
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
  if (code == 2) {
    std::cout << "SKIP crowding on " << (one_core ? "one core" : "two cores") << ": no such pinning here\n";
  }
  return code != 1;
}

// A helper held in a signal handler, as a thread is held off its core by another process.
std::atomic<bool> helper_held{false};
std::atomic<bool> let_helper_go{false};
void hold_this_thread(int) {
  helper_held.store(true);
  while (!let_helper_go.load()) {
  }
}

}  // namespace

int main() {
  expect(every_item_once(2000, 1), "every item runs once, one caller, 2-4 takers");

  std::vector<std::thread> callers;
  std::atomic<int> callers_ok{0};
  for (unsigned t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] { callers_ok += every_item_once(300, 10 + t) ? 1 : 0; });
  }
  for (auto& caller : callers) {
    caller.join();
  }
  expect(callers_ok.load() == 4, "every item runs once, four callers at once");

  {
    // A child made by fork() has none of its parent's helpers: it starts a pool of its own.
    const pid_t child = fork();
    if (child == 0) {
      _exit(every_item_once(300, 7) && !pthread_equal(a_helper(), pthread_self()) ? 0 : 1);
    }
    int status = 0;
    waitpid(child, &status, 0);
    expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "a forked child's helpers take items, each once");
  }

  {
    // An item that makes a call of its own runs it alone, on its thread.
    std::atomic<int> inner_runs{0}, outer_runs{0};
    std::atomic<bool> held_inside{true};
    ItemPool* pool = ItemPool::acquire();
    pool->run(8, 2, [&](int64_t) {
      ++outer_runs;
      if (ItemPool::acquire() != nullptr || !ItemPool::in_item()) {
        held_inside = false;
      }
      for (int i = 0; i < 5; ++i) {
        ++inner_runs;
      }
    });
    pool->release();
    expect(held_inside.load(), "a call inside an item finds the pool held");
    expect(outer_runs.load() == 8 && inner_runs.load() == 40, "nested calls: every item once");
  }

  {
    // Find the helper's thread, hold it in a signal handler (between calls: it holds no item), then make calls with
    // two takers: each must finish on the caller alone. (OpenMP's parallel region would wait for that thread.)
    const pthread_t helper = a_helper();
    const bool found = !pthread_equal(helper, pthread_self());
    expect(found, "a helper takes items");
    if (found) {
      struct sigaction action = {};
      action.sa_handler = hold_this_thread;
      sigaction(SIGUSR1, &action, nullptr);
      pthread_kill(helper, SIGUSR1);
      while (!helper_held.load()) {
      }
      bool alone = true;
      for (int call = 0; call < 50; ++call) {
        std::atomic<int> ran{0};
        ItemPool* pool = ItemPool::acquire();
        const int64_t own = pool->run(100, 2, [&](int64_t) { ++ran; }).own;
        pool->release();
        alone &= own == 100 && ran.load() == 100;
      }
      expect(alone, "a call finishes on its caller while its helper cannot run");
      let_helper_go.store(true);
      expect(every_item_once(200, 99), "every item runs once after the helper is back");
    }
  }

  expect(crowding_seen(true), "a call whose helper ran items on the caller's core says it was crowded");
  expect(crowding_seen(false), "a call whose helper ran items on another core says it was not");

  std::cout << (failures == 0 ? "all passed" : std::to_string(failures) + " failed") << "\n";
  return failures == 0 ? 0 : 1;
}
