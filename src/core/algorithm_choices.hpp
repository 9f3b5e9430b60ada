// core/algorithm_choices.hpp - a Buffer's algorithm choices, resolved once
// when it is made: each BufferOptions field when set, else its environment
// variable (read only then, so a field set by the caller is never overridden
// nor refused because of the variable), else the built-in default.
#pragma once

#include <optional>

#include "common/env.hpp"
#include "epx/buffer.hpp"

namespace epx {

struct AlgorithmChoices {
  int ht_rings = -1;                     ///< BufferOptions::ht_rings (-1: auto)
  std::optional<bool> net_split_puts;    ///< unset: the backend decides at each op
  bool ll_arrival_order = false;         ///< BufferOptions::ll_arrival_order
  bool ll_context_ranges = false;        ///< BufferOptions::ll_context_ranges
  std::optional<int> ll_sms;             ///< unset: every SM the rank may use
  std::optional<int> max_ops_in_flight;  ///< unset: the backend's default
};

/// `options` must have passed validate(); the variables are checked as read
/// (a malformed one is epx::Error naming it). proxy_cumem is resolved by the
/// proxy backend (proxy::cumem_regions), the only one that reads it.
inline AlgorithmChoices resolve_algorithm_choices(const BufferOptions& options) {
  AlgorithmChoices c;
  c.ht_rings = options.ht_rings ? *options.ht_rings : env::ht_rings();
  c.net_split_puts = options.net_split_puts ? options.net_split_puts : env::net_split_puts();
  c.ll_arrival_order =
      options.ll_arrival_order ? *options.ll_arrival_order : env::ll_arrival_order();
  c.ll_context_ranges =
      options.ll_context_ranges ? *options.ll_context_ranges : env::ll_context_ranges();
  c.ll_sms = options.ll_sms ? options.ll_sms : env::ll_sms();
  c.max_ops_in_flight =
      options.max_ops_in_flight ? options.max_ops_in_flight : env::max_ops_in_flight();
  return c;
}

}  // namespace epx
