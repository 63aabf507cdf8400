// SPDX-License-Identifier: Apache-2.0
// A small reusable fork-join pool for the host attention paths: workers sleep between
// calls, so a decode step pays no thread creation, only one wake-up.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "tierkv/core/config.hpp"

namespace tierkv {

/// A fork-join pool for the host attention passes; the calling thread is one of the workers.
class thread_pool {
 public:
  /// `threads` workers in total, the calling thread included; 0 = hardware concurrency.
  explicit thread_pool(unsigned threads = 0) {
    if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
    workers_.reserve(threads - 1);
    for (unsigned w = 1; w < threads; ++w) workers_.emplace_back([this, w] { worker_loop(w); });
  }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;
  ~thread_pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  /// Number of workers, the caller included; worker ids passed to tasks are < size().
  unsigned size() const { return unsigned(workers_.size()) + 1; }

  /// Runs fn(task, worker) for task in [0, tasks), tasks handed out dynamically, and
  /// returns when all have finished. fn must not throw. Not reentrant: one call at a
  /// time per pool.
  template <class Fn>
  void parallel_for(int tasks, Fn&& fn) {
    if (tasks <= 0) return;
    if (workers_.empty() || tasks == 1) {
      for (int t = 0; t < tasks; ++t) fn(t, 0u);
      return;
    }
    job_ = [&fn](int t, unsigned w) { fn(t, w); };
    next_.store(0, std::memory_order_relaxed);
    tasks_ = tasks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = unsigned(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    drain(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return busy_ == 0; });
    job_ = nullptr;
  }

 private:
  void drain(unsigned w) {
    for (int t = next_.fetch_add(1, std::memory_order_relaxed); t < tasks_;
         t = next_.fetch_add(1, std::memory_order_relaxed))
      job_(t, w);
  }

  void worker_loop(unsigned w) {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain(w);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::function<void(int, unsigned)> job_;
  std::atomic<int> next_{0};
  int tasks_ = 0;
  unsigned busy_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace tierkv
