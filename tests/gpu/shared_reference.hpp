// gpu/shared_reference.hpp - reference data made once for all in-process ranks.
#pragma once

#include <chrono>
#include <exception>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace epx::test {

/// Reference data that in-process ranks compute alike (the same case and
/// seed, named by `key`) is made once: the first rank to ask makes it, the
/// others wait for it and share it while any of them holds it (one that asks
/// after every holder let go makes its own). 16 in-process ranks each holding
/// every rank's reference outputs need more host memory than 128 GiB.
/// A make that throws reaches the ranks waiting for it; a later ask makes anew.
template <class T, class F>
std::shared_ptr<const T> shared_reference(const std::string& key, F&& make);

/// What has been made, per key (per T only, not per caller's lambda type).
template <class T>
struct SharedReferences {
  static inline std::mutex mu;
  static inline std::map<std::string, std::shared_future<std::weak_ptr<const T>>> made;
};

template <class T, class F>
std::shared_ptr<const T> shared_reference(const std::string& key, F&& make) {
  auto& mu = SharedReferences<T>::mu;
  auto& made = SharedReferences<T>::made;
  std::promise<std::weak_ptr<const T>> promise;
  std::shared_future<std::weak_ptr<const T>> other;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = made.find(key);
    // Being made: wait for it. Made and still held: share it. Let go or failed: make anew.
    auto usable = [](const std::shared_future<std::weak_ptr<const T>>& f) {
      if (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return true;
      try {
        return !f.get().expired();
      } catch (...) {
        return false;
      }
    };
    if (it != made.end() && usable(it->second))
      other = it->second;
    else
      made[key] = promise.get_future().share();
  }
  if (other.valid()) {
    if (auto p = other.get().lock()) return p;
    return std::make_shared<const T>(make());
  }
  std::shared_ptr<const T> p;
  try {
    p = std::make_shared<const T>(make());
  } catch (...) {
    promise.set_exception(std::current_exception());
    throw;
  }
  promise.set_value(p);
  return p;
}

}  // namespace epx::test
