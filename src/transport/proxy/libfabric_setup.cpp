// The libfabric engine's setup: rails, endpoints, the address exchange, regions, teardown.
#include "transport/proxy/libfabric_engine_impl.hpp"

namespace epx::proxy::fabric {

void LibfabricEngine::open() {
  prov_name_ = opt_.provider;
  auto card = std::make_unique<Card>();  // value-initialized: zeroed
  std::optional<Error> local;
  try {
    open_local(*card);
  } catch (const Error& e) {
    local = e;
    card->failed = 1;
    card->code = static_cast<int32_t>(e.code());
    std::snprintf(card->message, sizeof card->message, "%s", e.what());
  }
  std::vector<uint8_t> all;
  try {
    all = ex_->allgather(card.get(), sizeof(Card));
  } catch (const Error& e) {
    if (local) throw *local;  // this rank's own failure says more
    throw Error(e.code(), where() + ": exchanging endpoint addresses: " + e.what());
  }
  if (local) throw *local;
  if (all.size() != sizeof(Card) * num_ranks_)
    throw Error(ErrorCode::kInternal, where() + ": the exchange returned " +
                                          std::to_string(all.size()) + " bytes, expected " +
                                          std::to_string(sizeof(Card) * num_ranks_));
  std::vector<std::unique_ptr<Card>> cards;
  for (int r = 0; r < num_ranks_; ++r) {
    cards.push_back(std::make_unique<Card>());
    std::memcpy(cards.back().get(), all.data() + sizeof(Card) * r, sizeof(Card));
    cards.back()->domains[sizeof Card::domains - 1] = 0;
    cards.back()->message[sizeof Card::message - 1] = 0;
  }
  for (int r = 0; r < num_ranks_; ++r)
    if (cards[r]->failed)
      throw Error(static_cast<ErrorCode>(cards[r]->code),
                  where() + ": rank " + std::to_string(r) +
                      " could not set up its libfabric engine: " + cards[r]->message);
  // Channel c talks to channel c of every peer, on the peer's domain c % n:
  // the keys it uses are those of that index, so n must agree.
  std::string counts;
  bool differ = false;
  for (int r = 0; r < num_ranks_; ++r) {
    differ = differ || cards[r]->num_rails != rails_.size();
    counts += std::string(r ? ", " : "") + "rank " + std::to_string(r) + " uses " +
              std::to_string(cards[r]->num_rails) + " (" + cards[r]->domains + ")";
  }
  if (differ)
    throw Error(ErrorCode::kInvalidArgument,
                where() +
                    ": every rank must use the same number of libfabric domains (channel c "
                    "uses domain c % n on every rank; BufferOptions::fabric_domains or "
                    "EPX_FABRIC_DOMAINS): " +
                    counts);
  const std::size_t nr = rails_.size();
  control_remote_.resize(static_cast<std::size_t>(num_ranks_) * nr);
  for (int r = 0; r < num_ranks_; ++r) {
    const Card& theirs = *cards[r];
    for (std::size_t d = 0; d < nr; ++d) control_remote_[r * nr + d] = theirs.control[d];
    if (theirs.control[0].bytes != layout_.bytes)
      throw Error(ErrorCode::kInvalidArgument,
                  where() + ": rank " + std::to_string(r) +
                      " uses another channel count or window (control region of " +
                      std::to_string(theirs.control[0].bytes) + " bytes, this rank's " +
                      std::to_string(layout_.bytes) + ")");
    for (int c = 0; c < num_channels_; ++c) {
      Channel& ch = channels_[c];
      ch.addr.resize(static_cast<std::size_t>(num_ranks_), FI_ADDR_NOTAVAIL);
      const int n = fi_av_insert(ch.av, theirs.names[c], 1, &ch.addr[r], 0, nullptr);
      if (n != 1)
        throw Error(ErrorCode::kBootstrap, where(c) + ": fi_av_insert of rank " +
                                               std::to_string(r) +
                                               "'s address failed: " + fi_text(n));
    }
  }
  progress_ = std::thread([this] { progress_loop(); });
  barrier("setup");
}

void LibfabricEngine::open_local(Card& card) {
  const std::vector<std::string> names = parse_domains(opt_.domains);
  const std::size_t nr = names.empty() ? 1 : names.size();
  if (nr > static_cast<std::size_t>(kMaxRails) || nr > static_cast<std::size_t>(num_channels_))
    throw Error(ErrorCode::kInvalidArgument,
                where() + ": " + std::to_string(nr) + " fabric domains (" + opt_.domains +
                    ") for " + std::to_string(num_channels_) +
                    " channels: channel c uses domain c % n, so at most one domain per "
                    "channel (num_qps_per_rank, EPX_PROXY_CHANNELS) and at most " +
                    std::to_string(kMaxRails));
  rails_.resize(nr);
  for (std::size_t d = 0; d < nr; ++d) {
    Rail& r = rails_[d];
    r.info = get_info(names.empty() ? std::string() : names[d], r.delivery_complete);
    const fi_info* info = r.info;
    prov_name_ = info->fabric_attr->prov_name ? info->fabric_attr->prov_name : opt_.provider;
    r.name = info->domain_attr->name ? info->domain_attr->name : "";
    r.virt_addr = (info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0;
    r.prov_key = (info->domain_attr->mr_mode & FI_MR_PROV_KEY) != 0;
    r.mr_endpoint = (info->domain_attr->mr_mode & FI_MR_ENDPOINT) != 0;
    r.max_msg = std::max<uint64_t>(info->ep_attr->max_msg_size, 4096);
    check(fi_fabric(info->fabric_attr, &r.fabric, nullptr), "fi_fabric");
    check(fi_domain(r.fabric, r.info, &r.domain, nullptr), "fi_domain");
  }
  channels_ = std::make_unique<Channel[]>(static_cast<std::size_t>(num_channels_));
  for (int c = 0; c < num_channels_; ++c) {
    Channel& ch = channels_[c];
    ch.rail = c % static_cast<int>(nr);
    const Rail& rail = rails_[ch.rail];
    ch.peers.assign(static_cast<std::size_t>(num_ranks_), Peer{});
    ch.slots = std::make_unique<Slot[]>(opt_.max_inflight);
    ch.sources.resize(static_cast<std::size_t>(num_ranks_));
    for (Source& s : ch.sources) {
      s.arrivals.assign(opt_.window, 0);
      s.have.assign(opt_.window, 0);
      s.entry.assign(opt_.window, MailboxEntry{});
    }
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = 0;
    check(fi_cq_open(rail.domain, &cq_attr, &ch.cq, nullptr), "fi_cq_open");
    fi_av_attr av_attr{};
    av_attr.type = rail.info->domain_attr->av_type;
    av_attr.count = static_cast<std::size_t>(num_ranks_);
    check(fi_av_open(rail.domain, &av_attr, &ch.av, nullptr), "fi_av_open");
    check(fi_endpoint(rail.domain, rail.info, &ch.ep, nullptr), "fi_endpoint");
    check(fi_ep_bind(ch.ep, &ch.cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind (cq)");
    check(fi_ep_bind(ch.ep, &ch.av->fid, 0), "fi_ep_bind (av)");
    if (const int rc = fi_enable(ch.ep); rc == -FI_EBUSY && prov_name_ == "shm")
      throw Error(ErrorCode::kUnsupported,
                  where() + ": fi_enable failed: " + fi_text(rc) +
                      ": the shm provider names an endpoint's shared memory /dev/shm/" +
                      std::to_string(::getpid()) +
                      ":..., and a file of that name is left by an earlier process of this "
                      "pid that was killed; remove /dev/shm/" +
                      std::to_string(::getpid()) + ":*");
    else
      check(rc, "fi_enable");
    std::size_t len = kNameBytes;
    check(fi_getname(&ch.ep->fid, card.names[c], &len), "fi_getname");
    card.name_len[c] = static_cast<uint32_t>(len);
    char text[256] = {};
    std::size_t text_len = sizeof text;
    if (fi_av_straddr(ch.av, card.names[c], text, &text_len)) ch.address = text;
  }
  // The control region: mailboxes and credits, registered in every domain.
  layout_ = ControlLayout(num_ranks_, num_channels_, opt_.window);
  control_ = static_cast<char*>(std::aligned_alloc(4096, layout_.bytes));
  if (!control_)
    throw Error(ErrorCode::kInternal, where() + ": cannot allocate the control region");
  std::memset(control_, 0, layout_.bytes);
  for (std::size_t d = 0; d < nr; ++d) {
    Rail& r = rails_[d];
    r.control_mr = register_memory(static_cast<int>(d), control_, layout_.bytes, kMaxRegions + 1,
                                   "control region");
    r.control_desc = fi_mr_desc(r.control_mr);
    card.control[d] = {fi_mr_key(r.control_mr),
                       r.virt_addr ? reinterpret_cast<uint64_t>(control_) : 0, layout_.bytes};
  }
  card.num_rails = static_cast<uint32_t>(nr);
  std::snprintf(card.domains, sizeof card.domains, "%s", domain_names().c_str());
}

std::string LibfabricEngine::domain_names() const {
  std::vector<std::string> v;
  for (const Rail& r : rails_) v.push_back(r.name);
  return join(v);
}

fi_info* LibfabricEngine::get_info(const std::string& domain, bool& delivery_complete) {
  InfoPtr any;
  {
    fi_info* h = make_hints(opt_.provider, "", false, false);
    const int rc = fi_getinfo(kFiVersion, nullptr, nullptr, 0, h, &any.p);
    fi_freeinfo(h);
    if (rc != 0 || !any.p)
      throw Error(ErrorCode::kInvalidArgument,
                  "libfabric engine: provider '" + opt_.provider +
                      "' is unknown or not available on this host (fi_getinfo: " + fi_text(rc) +
                      "; `fi_info -l` lists the providers)");
  }
  InfoPtr info;
  fi_info* chosen = nullptr;
  std::string layered;
  for (bool delivery : {true, false}) {
    fi_info* h = make_hints(opt_.provider, domain, true, delivery);
    const int rc = fi_getinfo(kFiVersion, nullptr, nullptr, 0, h, &info.p);
    fi_freeinfo(h);
    if (rc == 0 && info.p) {
      for (fi_info* i = info.p; i && !chosen; i = i->next)
        if (is_exact(i, opt_.provider, domain)) chosen = i;
      if (chosen) {
        delivery_complete = delivery;
        break;
      }
      if (layered.empty() && info.p->fabric_attr->prov_name)
        layered = info.p->fabric_attr->prov_name;
    }
    if (info.p) fi_freeinfo(info.p);
    info.p = nullptr;
  }
  if (!chosen && !domain.empty()) {
    const std::vector<std::string> have = domains_of(opt_.provider);
    if (std::find(have.begin(), have.end(), domain) == have.end()) {
      const char* iface = std::getenv("FI_TCP_IFACE");
      throw Error(
          ErrorCode::kInvalidArgument,
          "libfabric engine: provider '" + opt_.provider + "' has no domain '" + domain +
              "' (its domains: " + (have.empty() ? std::string("none") : join(have, ", ")) +
              "; `fi_info -p '" + opt_.provider +
              "'` lists them; BufferOptions::fabric_domains or EPX_FABRIC_DOMAINS)" +
              (iface && *iface && opt_.provider.find("tcp") != std::string::npos
                   ? std::string("; FI_TCP_IFACE=") + iface + " limits tcp to that interface"
                   : std::string()));
    }
  }
  if (!chosen) {
    bool rma = false, rdm = false;
    for (fi_info* i = any.p; i; i = i->next) {
      if (!is_exact(i, opt_.provider, "")) continue;
      rma = rma || (i->caps & FI_RMA) != 0;
      rdm = rdm || i->ep_attr->type == FI_EP_RDM;
    }
    std::string missing;
    if (!rma) missing = "FI_RMA";
    if (!rdm) missing += std::string(missing.empty() ? "" : " and ") + "FI_EP_RDM endpoints";
    if (missing.empty())
      missing = "FI_EP_RDM + FI_RMA with the memory registration modes and FI_THREAD_SAFE";
    throw Error(ErrorCode::kUnsupported,
                "libfabric engine: provider '" + opt_.provider + "' lacks " + missing +
                    (domain.empty() ? "" : " on domain '" + domain + "'") +
                    " (the engine needs RMA writes on RDM endpoints)" +
                    (layered.empty() ? ""
                                     : "; libfabric offers them layered over it as '" + layered +
                                           "': ask for that"));
  }
  if (chosen->domain_attr->cq_data_size < 4)
    throw Error(ErrorCode::kUnsupported,
                "libfabric engine: provider '" + opt_.provider +
                    "' lacks FI_REMOTE_CQ_DATA (cq_data_size " +
                    std::to_string(chosen->domain_attr->cq_data_size) +
                    "; the engine needs 4 bytes of immediate data per write)");
  // Only the first match is used: a copy of it alone.
  fi_info* first = fi_dupinfo(chosen);
  if (!first) throw Error(ErrorCode::kInternal, where() + ": fi_dupinfo failed");
  return first;
}

fid_mr* LibfabricEngine::register_memory(int d, void* base, std::size_t bytes, uint64_t key,
                                         const std::string& what) {
  const Rail& rail = rails_[d];
  fid_mr* mr = nullptr;
  const uint64_t access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
  // Keys the engine picks differ between domains (a region's key plus the
  // rail times the keys one rail uses), so a key sent on the wrong domain
  // is refused there rather than landing in another region.
  const uint64_t requested = rail.prov_key ? 0 : key + static_cast<uint64_t>(d) * (kMaxRegions + 2);
  int rc = fi_mr_reg(rail.domain, base, bytes, access, 0, requested, 0, &mr, nullptr);
  if (rc == 0 && rail.mr_endpoint) {
    for (int c = 0; c < num_channels_ && rc == 0; ++c)
      if (channels_[c].rail == d) rc = fi_mr_bind(mr, &channels_[c].ep->fid, 0);
    if (rc == 0) rc = fi_mr_enable(mr);
  }
  if (rc != 0) {
    if (mr) fi_close(&mr->fid);
    throw Error(ErrorCode::kUnsupported, where() + ": provider " + prov_name_ +
                                             " cannot register " + what + " (" +
                                             std::to_string(bytes) + " bytes of host memory at " +
                                             std::to_string(reinterpret_cast<uintptr_t>(base)) +
                                             ") in domain " + rail.name + ": " + fi_text(rc));
  }
  return mr;
}

void LibfabricEngine::close_mrs(Local& l) {
  for (fid_mr* mr : l.mr)
    if (mr) close_fid(&mr->fid);
  l = Local{};
}

std::vector<RemoteRegion> LibfabricEngine::gather(const std::vector<RemoteRegion>& mine,
                                                  const std::string& what) {
  const std::size_t bytes = mine.size() * sizeof(RemoteRegion);
  std::vector<uint8_t> all;
  try {
    all = ex_->allgather(mine.data(), bytes);
  } catch (const Error& e) {
    throw Error(e.code(), where() + ": " + what + ": " + e.what());
  }
  std::vector<RemoteRegion> out(mine.size() * static_cast<std::size_t>(num_ranks_));
  if (all.size() != bytes * num_ranks_)
    throw Error(ErrorCode::kInternal, where() + ": " + what + ": the exchange returned " +
                                          std::to_string(all.size()) + " bytes");
  std::memcpy(out.data(), all.data(), all.size());
  return out;
}

const RemoteRegion& LibfabricEngine::remote(int region, int peer, int rail) const {
  return remote_[region][static_cast<std::size_t>(peer) * rails_.size() + rail];
}

const RemoteRegion& LibfabricEngine::control_remote(int peer, int rail) const {
  return control_remote_[static_cast<std::size_t>(peer) * rails_.size() + rail];
}

void LibfabricEngine::barrier(const char* what) {
  try {
    ex_->barrier();
  } catch (const Error& e) {
    throw Error(e.code(), where() + ": " + what + ": " + e.what());
  }
}

void LibfabricEngine::check(int rc, const char* call) {
  if (rc != 0)
    throw Error(ErrorCode::kUnsupported, where() + ": " + call + " failed: " + fi_text(rc));
}

void LibfabricEngine::close_fid(fid* f) {
  if (f) fi_close(f);
}

void LibfabricEngine::close_all() {
  stop_.store(true, std::memory_order_relaxed);
  if (progress_.joinable()) progress_.join();
  for (auto& l : regions_) close_mrs(l);
  for (Rail& r : rails_) {
    if (r.control_mr) close_fid(&r.control_mr->fid);
    r.control_mr = nullptr;
  }
  if (channels_)
    for (int c = 0; c < num_channels_; ++c) {
      Channel& ch = channels_[c];
      if (ch.ep) close_fid(&ch.ep->fid);
      if (ch.av) close_fid(&ch.av->fid);
      if (ch.cq) close_fid(&ch.cq->fid);
      ch.ep = nullptr;
      ch.av = nullptr;
      ch.cq = nullptr;
    }
  for (Rail& r : rails_) {
    if (r.domain) close_fid(&r.domain->fid);
    if (r.fabric) close_fid(&r.fabric->fid);
    if (r.info) fi_freeinfo(r.info);
    r.domain = nullptr;
    r.fabric = nullptr;
    r.info = nullptr;
  }
  std::free(control_);
  control_ = nullptr;
}

}  // namespace epx::proxy::fabric
