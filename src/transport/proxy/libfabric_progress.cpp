// The libfabric engine's channel threads (posting writes, credits, failures) and its progress
// thread (completions, immediate data, signals applied).
#include "transport/proxy/libfabric_engine_impl.hpp"

namespace epx::proxy::fabric {

LibfabricEngine::Channel& LibfabricEngine::channel_of(int c) {
  require(c >= 0 && c < num_channels_, "channel",
          "must be in [0, " + std::to_string(num_channels_) + "), got " + std::to_string(c));
  return channels_[c];
}

const RemoteRegion& LibfabricEngine::target(int peer, int region, const char* what) const {
  if (peer < 0 || peer >= num_ranks_)
    throw Error(ErrorCode::kInvalidArgument,
                where() + ": " + what + ": peer " + std::to_string(peer) +
                    " is not a rank (num_ranks " + std::to_string(num_ranks_) + ")");
  if (region < 0 || region >= kMaxRegions || !regions_[region].registered())
    throw Error(ErrorCode::kInvalidArgument, where() + ": " + what + " to rank " +
                                                 std::to_string(peer) + ": region " +
                                                 std::to_string(region) + " is not registered");
  return remote(region, peer, 0);  // the size, the same in every domain
}

void LibfabricEngine::throw_if_failed(const Channel& ch) const {
  if (!ch.failed.load(std::memory_order_acquire)) return;
  std::lock_guard lock(ch.err_m);
  throw Error(ch.code, ch.error);
}

void LibfabricEngine::fail(Channel& ch, ErrorCode code, const std::string& message) {
  std::lock_guard lock(ch.err_m);
  if (ch.failed.load(std::memory_order_relaxed)) return;
  ch.error = message;
  ch.code = code;
  ch.failed.store(true, std::memory_order_release);
}

void LibfabricEngine::check_age(Channel& ch, int channel, uint64_t done) {
  const Slot& s = ch.slots[done & (opt_.max_inflight - 1)];
  const uint64_t t = s.t_ns.load(std::memory_order_relaxed);
  const uint64_t now = now_ns();
  if (t == 0 || now < t || now - t < timeout_ns_) return;
  const int peer = s.peer.load(std::memory_order_relaxed);
  fail(ch, ErrorCode::kTimeout,
       where(channel) + ": write " + std::to_string(done) + " to rank " + std::to_string(peer) +
           " on channel " + std::to_string(channel) + " has no completion after " +
           std::to_string(opt_.timeout_s) + " s (" + std::to_string(ch.posted - done) +
           " writes in flight; rank " + std::to_string(peer) +
           " stopped answering: did it die or stop progressing?" +
           (rails_[ch.rail].delivery_complete ? ")" : "; writes are transmit-complete only)"));
  throw_if_failed(ch);
}

void LibfabricEngine::wait_credit(Channel& ch, int channel, int peer, const char* what) {
  const Peer& p = ch.peers[peer];
  auto* credit =
      reinterpret_cast<uint64_t*>(control_ + layout_.credit_in +
                                  (static_cast<std::size_t>(peer) * num_channels_ + channel) * 8);
  auto ok = [&] {
    return p.epoch - std::atomic_ref<uint64_t>(*credit).load(std::memory_order_acquire) <
           opt_.window;
  };
  if (ok()) return;
  const uint64_t t0 = now_ns();
  while (!ok()) {
    throw_if_failed(ch);
    if (now_ns() - t0 > timeout_ns_)
      fail(ch, ErrorCode::kTimeout,
           where(channel) + ": " + what + " to rank " + std::to_string(peer) + " on channel " +
               std::to_string(channel) + ": no credit from rank " + std::to_string(peer) +
               " after " + std::to_string(opt_.timeout_s) + " s (epoch " + std::to_string(p.epoch) +
               ", rank " + std::to_string(peer) + " applied " +
               std::to_string(std::atomic_ref<uint64_t>(*credit).load()) +
               "; it stopped answering or its progress thread is stuck)");
    std::this_thread::yield();
  }
}

void LibfabricEngine::post(Channel& ch, int channel, int peer, void* src, uint64_t bytes,
                           void* desc, uint64_t raddr, uint64_t key, uint32_t imm, bool with_data,
                           const char* what) {
  const uint64_t seq = ch.posted;
  // A free slot in the completion window.
  if (seq - ch.done.load(std::memory_order_acquire) >= opt_.max_inflight) {
    const uint64_t t0 = now_ns();
    while (seq - ch.done.load(std::memory_order_acquire) >= opt_.max_inflight) {
      throw_if_failed(ch);
      check_age(ch, channel, ch.done.load(std::memory_order_acquire));
      if (now_ns() - t0 > timeout_ns_)  // (check_age throws first unless clocks misbehave)
        fail(ch, ErrorCode::kTimeout,
             where(channel) + ": " + what + " to rank " + std::to_string(peer) +
                 ": no free transmit slot");
      std::this_thread::yield();
    }
  }
  Slot& s = ch.slots[seq & (opt_.max_inflight - 1)];
  s.done.store(0, std::memory_order_relaxed);
  s.peer.store(peer, std::memory_order_relaxed);
  s.t_ns.store(now_ns(), std::memory_order_relaxed);
  iovec iov{src, bytes};
  fi_rma_iov rma{raddr, bytes, key};
  fi_msg_rma msg{};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = ch.addr[peer];
  msg.rma_iov = &rma;
  msg.rma_iov_count = 1;
  msg.context = reinterpret_cast<void*>(seq);
  msg.data = imm;
  const uint64_t flags = FI_COMPLETION | (with_data ? FI_REMOTE_CQ_DATA : 0) |
                         (rails_[ch.rail].delivery_complete ? FI_DELIVERY_COMPLETE : 0);
  // Count it before posting: its completion may come before fi_writemsg returns.
  ch.posted = seq + 1;
  const uint64_t t0 = now_ns();
  for (;;) {
    const ssize_t rc = fi_writemsg(ch.ep, &msg, flags);
    if (rc == 0) return;
    if (rc != -FI_EAGAIN) {
      fail(ch, ErrorCode::kTimeout,
           where(channel) + ": " + what + " to rank " + std::to_string(peer) + " on channel " +
               std::to_string(channel) + ": fi_writemsg of " + std::to_string(bytes) +
               " bytes failed: " + fi_text(static_cast<int>(rc)));
      throw_if_failed(ch);
    }
    throw_if_failed(ch);
    if (now_ns() - t0 > timeout_ns_)
      fail(ch, ErrorCode::kTimeout,
           where(channel) + ": " + what + " to rank " + std::to_string(peer) + " on channel " +
               std::to_string(channel) + ": the transmit queue stayed full for " +
               std::to_string(opt_.timeout_s) + " s (rank " + std::to_string(peer) +
               " stopped answering?)");
    std::this_thread::yield();  // the progress thread drains the queue
  }
}

void LibfabricEngine::progress_loop() {
  std::array<fi_cq_data_entry, 64> e;
  std::vector<Held> held;
  std::mt19937 rng(static_cast<uint32_t>(rank_ * 7919 + 1));
  int idle = 0;
  while (!stop_.load(std::memory_order_relaxed)) {
    bool any = false;
    for (int c = 0; c < num_channels_; ++c) {
      Channel& ch = channels_[c];
      const ssize_t n = fi_cq_read(ch.cq, e.data(), e.size());
      if (n > 0) {
        any = true;
        for (ssize_t i = 0; i < n; ++i) {
          if (e[i].flags & FI_REMOTE_CQ_DATA) {
            ch.received.fetch_add(1, std::memory_order_relaxed);
            const uint32_t imm = static_cast<uint32_t>(e[i].data);
            if (opt_.test_reorder_window)
              held.push_back({c, imm});
            else
              on_remote(c, imm);
          } else if (e[i].flags & FI_REMOTE_WRITE) {
            // A write without data into our region (a credit): nothing to do.
          } else {
            on_local(c, reinterpret_cast<uint64_t>(e[i].op_context));
          }
        }
      } else if (n == -FI_EAVAIL) {
        any = true;
        on_error(c);
      } else if (n != -FI_EAGAIN && n < 0) {
        fail(ch, ErrorCode::kInternal,
             where(c) + ": fi_cq_read failed: " + fi_text(static_cast<int>(n)));
      }
      send_credits(c);
      if (ch.incoming_error_ns != 0 && now_ns() - ch.incoming_error_ns > incoming_grace_ns()) {
        fail(ch, ErrorCode::kTimeout, ch.incoming_error);
        ch.incoming_error_ns = 0;
      }
    }
    // The reorder hook: handle held completions in a random order, all of
    // them once a poll round brought nothing new.
    while (!held.empty() && (held.size() >= opt_.test_reorder_window || !any)) {
      const std::size_t k = rng() % held.size();
      const Held h = held[k];
      held[k] = held.back();
      held.pop_back();
      on_remote(h.channel, h.imm);
    }
    if (any) {
      idle = 0;
    } else if (++idle > 256) {
      std::this_thread::sleep_for(std::chrono::microseconds(idle > 20000 ? 50 : 2));
    }
  }
}

void LibfabricEngine::on_local(int c, uint64_t context) {
  Channel& ch = channels_[c];
  if (context & kCreditTag) {
    const int src = static_cast<int>(context & 0xffffffu);
    if (src >= 0 && src < num_ranks_) ch.sources[src].credit_inflight = false;
    return;
  }
  ch.slots[context & (opt_.max_inflight - 1)].done.store(1, std::memory_order_relaxed);
  uint64_t d = ch.done.load(std::memory_order_relaxed);
  while (ch.slots[d & (opt_.max_inflight - 1)].done.load(std::memory_order_relaxed) == 1) {
    ch.slots[d & (opt_.max_inflight - 1)].done.store(2, std::memory_order_relaxed);
    ++d;
  }
  ch.done.store(d, std::memory_order_release);
}

void LibfabricEngine::on_error(int c) {
  Channel& ch = channels_[c];
  fi_cq_err_entry err{};
  const ssize_t rc = fi_cq_readerr(ch.cq, &err, 0);
  if (rc < 0) return;
  char buf[256] = {};
  const char* prov = fi_cq_strerror(ch.cq, err.prov_errno, err.err_data, buf, sizeof buf);
  const uint64_t context = reinterpret_cast<uint64_t>(err.op_context);
  std::string who;
  const bool incoming = (err.flags & FI_REMOTE_CQ_DATA) != 0;
  if (incoming) {
    who = "an incoming write from rank " +
          std::to_string(fabric_imm::src_of(static_cast<uint32_t>(err.data)));
  } else if (context & kCreditTag) {
    who = "a credit write to rank " + std::to_string(context & 0xffffffu);
  } else {
    const int peer = ch.slots[context & (opt_.max_inflight - 1)].peer.load();
    who = "write " + std::to_string(context) + " to rank " + std::to_string(peer);
  }
  const std::string message =
      where(c) + ": " + who + " on channel " + std::to_string(c) + " failed: " + fi_text(err.err) +
      ", provider: " + (prov ? prov : "?") + " (the peer died or its connection broke)";
  if (!incoming) {
    fail(ch, ErrorCode::kTimeout, message);
  } else if (ch.incoming_error_ns == 0) {  // held: see Channel::incoming_error
    ch.incoming_error = message;
    ch.incoming_error_ns = std::max<uint64_t>(1, now_ns());
  }
}

void LibfabricEngine::on_remote(int c, uint32_t imm) {
  Channel& ch = channels_[c];
  using fabric_imm::Kind;
  const Kind kind = fabric_imm::kind_of(imm);
  const int src = fabric_imm::src_of(imm);
  if ((kind != Kind::kPut && kind != Kind::kMailbox) || src >= num_ranks_) {
    fail(ch, ErrorCode::kInternal,
         where(c) + ": malformed immediate data " + std::to_string(imm) + " on channel " +
             std::to_string(c));
    return;
  }
  Source& s = ch.sources[src];
  uint64_t epoch = 0;
  if (!fabric_imm::full_epoch(imm, s.applied, opt_.window, epoch)) {
    fail(ch, ErrorCode::kInternal,
         where(c) + ": write from rank " + std::to_string(src) + " on channel " +
             std::to_string(c) + " for epoch bits " + std::to_string(fabric_imm::epoch_of(imm)) +
             " outside the window [" + std::to_string(s.applied) + ", +" +
             std::to_string(opt_.window) + ")");
    return;
  }
  const uint32_t slot = static_cast<uint32_t>(epoch & (opt_.window - 1));
  if (kind == Kind::kPut) {
    st_puts_.fetch_add(1, std::memory_order_relaxed);
    ++s.arrivals[slot];
  } else {
    st_signals_.fetch_add(1, std::memory_order_relaxed);
    const auto* box = reinterpret_cast<const MailboxEntry*>(
        control_ + layout_.mailbox +
        ((static_cast<std::size_t>(src) * num_channels_ + c) * opt_.window + slot) *
            sizeof(MailboxEntry));
    MailboxEntry m;
    std::memcpy(&m, box, sizeof m);
    if (m.epoch != epoch) {
      fail(ch, ErrorCode::kInternal,
           where(c) + ": mailbox entry " + std::to_string(slot) + " from rank " +
               std::to_string(src) + " says epoch " + std::to_string(m.epoch) +
               ", its immediate data " + std::to_string(epoch));
      return;
    }
    s.entry[slot] = m;
    s.have[slot] = 1;
    if (s.arrivals[slot] < m.puts) st_waited_.fetch_add(1, std::memory_order_relaxed);
  }
  apply(c, src);
}

void LibfabricEngine::apply(int c, int src) {
  Channel& ch = channels_[c];
  Source& s = ch.sources[src];
  for (;;) {
    const uint32_t slot = static_cast<uint32_t>(s.applied & (opt_.window - 1));
    if (!s.have[slot]) return;
    const MailboxEntry& m = s.entry[slot];
    if (s.arrivals[slot] < m.puts) return;
    if (s.arrivals[slot] > m.puts) {
      fail(ch, ErrorCode::kInternal,
           where(c) + ": rank " + std::to_string(src) + "'s epoch " + std::to_string(m.epoch) +
               " on channel " + std::to_string(c) + " brought " + std::to_string(s.arrivals[slot]) +
               " puts, its signal says " + std::to_string(m.puts));
      return;
    }
    {
      std::lock_guard lock(region_m_);
      const Local& l = regions_[m.region < kMaxRegions ? m.region : 0];
      if (m.region >= kMaxRegions || !l.registered() || m.sig_off % 8 != 0 ||
          m.sig_off + 8 > l.bytes) {
        fail(ch, ErrorCode::kInternal,
             where(c) + ": signal from rank " + std::to_string(src) + " on channel " +
                 std::to_string(c) + " names region " + std::to_string(m.region) + " offset " +
                 std::to_string(m.sig_off) + ", not a word of a registered region");
        return;
      }
      auto* word = reinterpret_cast<uint64_t*>(l.base + m.sig_off);
      // Release: whoever reads the new value (acquire) sees the puts' bytes.
      std::atomic_ref<uint64_t>(*word).fetch_add(m.add, std::memory_order_release);
    }
    st_applied_.fetch_add(1, std::memory_order_relaxed);
    s.arrivals[slot] = 0;
    s.have[slot] = 0;
    ++s.applied;
  }
}

void LibfabricEngine::send_credits(int c) {
  Channel& ch = channels_[c];
  const uint64_t every = std::max<uint32_t>(1, opt_.window / 4);
  for (int src = 0; src < num_ranks_; ++src) {
    Source& s = ch.sources[src];
    if (s.credit_inflight || s.applied - s.credit_sent < every) continue;
    auto* value = reinterpret_cast<uint64_t*>(
        control_ + layout_.credit_out + (static_cast<std::size_t>(src) * num_channels_ + c) * 8);
    *value = s.applied;
    const RemoteRegion& ctl = control_remote(src, ch.rail);
    const uint64_t raddr =
        ctl.base + layout_.credit_in + (static_cast<uint64_t>(rank_) * num_channels_ + c) * 8;
    void* desc = rails_[ch.rail].control_desc;
    const ssize_t rc = fi_write(ch.ep, value, 8, desc, ch.addr[src], raddr, ctl.key,
                                reinterpret_cast<void*>(kCreditTag | static_cast<uint64_t>(src)));
    if (rc == -FI_EAGAIN) continue;  // next round
    if (rc != 0) {
      fail(ch, ErrorCode::kTimeout,
           where(c) + ": credit write to rank " + std::to_string(src) + " on channel " +
               std::to_string(c) + " failed: " + fi_text(static_cast<int>(rc)));
      continue;
    }
    s.credit_inflight = true;
    s.credit_sent = s.applied;
    st_credits_.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace epx::proxy::fabric
