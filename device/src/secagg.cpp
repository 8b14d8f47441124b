#include "secagg.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "failure.h"
#include "numpy_random.h"

namespace orchard {

namespace {

constexpr uint8_t kVersion = 1;
constexpr size_t kSessionIdBytes = 16, kGraphSeedBytes = 32, kTagBytes = 16;
constexpr uint64_t kPrime = (1ull << 31) - 1;
enum Tag : uint8_t {
  kSessionSetup = 1, kAdvertiseKeys = 2, kKeysBroadcast = 3, kShareKeys = 4,
  kSharesBroadcast = 5, kMaskedInput = 6, kUnmaskRequest = 7, kUnmaskShares = 8
};
const char* kTagNames[] = {"?", "SessionSetup", "AdvertiseKeys", "KeysBroadcast", "ShareKeys",
                           "SharesBroadcast", "MaskedInput", "UnmaskRequest", "UnmaskShares"};

[[noreturn]] void refuse(const char* kind, const std::string& what) {
  throw Failure(ORCHARD_ERR_SECAGG, std::string(kind) + ": " + what);
}

bool valid_utf8(const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n;) {
    const uint8_t c = s[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > n) return false;
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (s[i + k] & 0x3f);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8 (Python refuses them).
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10ffff ||
        (cp >= 0xd800 && cp <= 0xdfff))
      return false;
    i += len;
  }
  return true;
}

class Reader {
 public:
  explicit Reader(const Bytes& b) : buf_(b) {}
  void need(size_t n) const {
    if (n > buf_.size() - pos_)
      refuse("MalformedMessage", "message truncated: needed " + std::to_string(n) + " bytes at offset " +
                                     std::to_string(pos_) + ", " + std::to_string(buf_.size() - pos_) + " left");
  }
  uint64_t uint(size_t n) {
    need(n);
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v = (v << 8) | buf_[pos_ + i];
    pos_ += n;
    return v;
  }
  Bytes fixed(size_t n) {
    need(n);
    Bytes out(buf_.begin() + static_cast<long>(pos_), buf_.begin() + static_cast<long>(pos_ + n));
    pos_ += n;
    return out;
  }
  std::string string() {
    const size_t n = uint(2);
    need(n);
    if (!valid_utf8(buf_.data() + pos_, n)) refuse("MalformedMessage", "a node id is not valid UTF-8");
    std::string s(reinterpret_cast<const char*>(buf_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  size_t count(size_t min_item_bytes) {
    const uint64_t n = uint(4);
    if (n * min_item_bytes > buf_.size() - pos_)
      refuse("MalformedMessage", "list of " + std::to_string(n) + " items cannot fit in the remaining bytes");
    return static_cast<size_t>(n);
  }
  std::vector<std::string> strings() {
    std::vector<std::string> out(count(2));
    for (auto& s : out) s = string();
    return out;
  }
  std::vector<std::pair<std::string, Bytes>> pairs() {
    std::vector<std::pair<std::string, Bytes>> out(count(6));
    for (auto& p : out) {
      p.first = string();
      p.second = fixed(uint(4));
    }
    return out;
  }
  void end() const {
    if (pos_ != buf_.size())
      refuse("MalformedMessage", std::to_string(buf_.size() - pos_) + " trailing bytes after the message");
  }

 private:
  const Bytes& buf_;
  size_t pos_ = 0;
};

class Writer {
 public:
  Bytes out;
  void raw(const Bytes& b) { out.insert(out.end(), b.begin(), b.end()); }
  void uint(uint64_t v, size_t n) {
    for (size_t i = n; i-- > 0;) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void string(const std::string& s) {
    if (s.size() > 0xffff) refuse("MalformedMessage", "node id too long");
    uint(s.size(), 2);
    out.insert(out.end(), s.begin(), s.end());
  }
  void pairs(const std::vector<std::pair<std::string, Bytes>>& ps) {
    uint(ps.size(), 4);
    for (auto& p : ps) {
      string(p.first);
      uint(p.second.size(), 4);
      raw(p.second);
    }
  }
};

Writer header(uint8_t tag, const SessionConfig& c, const std::string& node) {
  Writer w;
  w.raw({'O', 'S', 'A'});
  w.uint(kVersion, 1);
  w.uint(tag, 1);
  w.raw(c.session_id);
  w.uint(c.round_number, 8);
  w.string(node);
  return w;
}

Bytes field(const Bytes& b) {
  Bytes out{static_cast<uint8_t>(b.size() >> 8), static_cast<uint8_t>(b.size())};
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

Bytes str_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

// crypto._context: what a derived key or the associated data is bound to.
Bytes context(const char* kind, const Bytes& session_id, uint64_t round, const std::string& a, const std::string& b) {
  Bytes out = field(str_bytes(kind));
  Bytes sid = field(session_id);
  out.insert(out.end(), sid.begin(), sid.end());
  for (int i = 7; i >= 0; --i) out.push_back(static_cast<uint8_t>(round >> (8 * i)));
  for (const std::string* s : {&a, &b}) {
    Bytes f = field(str_bytes(*s));
    out.insert(out.end(), f.begin(), f.end());
  }
  return out;
}

Bytes channel_key(const Bytes& shared, const SessionConfig& c, const std::string& sender, const std::string& to) {
  return hkdf(shared, context("channel", c.session_id, c.round_number, sender, to), 32);
}

Bytes pairwise_seed(const Bytes& s_sk, const Bytes& peer_pk, const SessionConfig& c, const std::string& a,
                    const std::string& b) {
  const std::string& lo = std::min(a, b);
  const std::string& hi = std::max(a, b);
  return hkdf(x25519_agree(s_sk, peer_pk), context("mask", c.session_id, c.round_number, lo, hi), kSeedBytes);
}

size_t share_size(size_t secret_len) { return 4 * ((secret_len + 1) / 2); }

size_t ciphertext_size(const std::string& sender, const std::string& recipient) {
  return 4 + sender.size() + recipient.size() + share_size(kKeyBytes) + share_size(kSeedBytes) + kTagBytes;
}

}  // namespace

// A parsed broadcast (server -> client).
struct Broadcast {
  uint8_t tag = 0;
  Bytes session_id;
  uint64_t round = 0;
  std::string node;  // the recipient
  SessionConfig config;                                   // SessionSetup
  std::vector<std::pair<std::string, std::pair<Bytes, Bytes>>> keys;  // KeysBroadcast
  std::vector<std::pair<std::string, Bytes>> ciphertexts;  // SharesBroadcast
  std::vector<std::string> survivors, dropped;             // UnmaskRequest
};

namespace {

SecAggStage stage_of_tag(uint8_t tag) {
  switch (tag) {
    case kSessionSetup: case kAdvertiseKeys: return SecAggStage::advertise_keys;
    case kKeysBroadcast: case kShareKeys: return SecAggStage::share_keys;
    case kSharesBroadcast: case kMaskedInput: return SecAggStage::masked_input;
    default: return SecAggStage::unmasking;
  }
}

Broadcast parse(const Bytes& data) {
  Reader r(data);
  Broadcast b;
  if (data.size() >= 3 && !(data[0] == 'O' && data[1] == 'S' && data[2] == 'A'))
    refuse("MalformedMessage", "not a secure-aggregation message (bad magic)");
  const Bytes magic = r.fixed(3);
  (void)magic;
  const uint64_t version = r.uint(1);
  if (version != kVersion)
    refuse("MalformedMessage", "message version " + std::to_string(version) + ", this code speaks 1");
  b.tag = static_cast<uint8_t>(r.uint(1));
  if (b.tag < 1 || b.tag > 8) refuse("MalformedMessage", "unknown message tag " + std::to_string(b.tag));
  b.session_id = r.fixed(kSessionIdBytes);
  b.round = r.uint(8);
  b.node = r.string();
  switch (b.tag) {
    case kSessionSetup: {
      SessionConfig& c = b.config;
      c.session_id = b.session_id;
      c.round_number = b.round;
      c.participants = r.strings();
      c.neighbours = static_cast<uint32_t>(r.uint(4));
      c.threshold = static_cast<uint32_t>(r.uint(4));
      c.graph_seed = r.fixed(kGraphSeedBytes);
      c.vector_length = r.uint(8);
      c.modulus_bits = static_cast<uint8_t>(r.uint(1));
      std::vector<std::string> problems;
      const size_t n = c.participants.size();
      std::vector<std::string> sorted = c.participants;
      std::sort(sorted.begin(), sorted.end());
      sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
      if (sorted != c.participants) problems.push_back("participants must be sorted and distinct");
      if (n < 2) {
        problems.push_back("need at least 2 participants, got " + std::to_string(n));
      } else if (c.neighbours < 1 || c.neighbours > n - 1) {
        problems.push_back("neighbours must be in 1.." + std::to_string(n - 1) + ", got " + std::to_string(c.neighbours));
      } else if (!(c.neighbours / 2 < c.threshold && c.threshold <= c.neighbours)) {
        problems.push_back("threshold must be a strict majority of the neighbours, got " + std::to_string(c.threshold));
      }
      if (c.modulus_bits < 1 || c.modulus_bits > 64)
        problems.push_back("modulus_bits must be in 1..64, got " + std::to_string(c.modulus_bits));
      if (!problems.empty()) {
        std::string all;
        for (auto& p : problems) all += (all.empty() ? "" : "; ") + p;
        refuse("MalformedMessage", "session setup is invalid: " + all);
      }
      break;
    }
    case kKeysBroadcast: {
      b.keys.resize(r.count(2 + 2 * kKeyBytes));
      for (auto& k : b.keys) {
        k.first = r.string();
        k.second.first = r.fixed(kKeyBytes);
        k.second.second = r.fixed(kKeyBytes);
      }
      break;
    }
    case kSharesBroadcast: b.ciphertexts = r.pairs(); break;
    case kUnmaskRequest:
      b.survivors = r.strings();
      b.dropped = r.strings();
      break;
    default:
      // A client's message where a broadcast belongs: the stage machine refuses it below.
      return b;
  }
  r.end();
  return b;
}

const char* stage_name(SecAggStage s) {
  switch (s) {
    case SecAggStage::advertise_keys: return "advertise_keys";
    case SecAggStage::share_keys: return "share_keys";
    case SecAggStage::masked_input: return "masked_input";
    case SecAggStage::unmasking: return "unmasking";
    case SecAggStage::done: return "done";
    case SecAggStage::aborted: return "aborted";
  }
  return "?";
}

std::string hex(const Bytes& b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t c : b) {
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}

uint64_t pow_mod(uint64_t base, uint64_t e) {
  uint64_t r = 1;
  base %= kPrime;
  while (e) {
    if (e & 1) r = r * base % kPrime;
    base = base * base % kPrime;
    e >>= 1;
  }
  return r;
}

}  // namespace

SecAggStage broadcast_stage(const Bytes& broadcast) { return stage_of_tag(parse(broadcast).tag); }

std::set<size_t> neighbours_of(size_t n, size_t k, const Bytes& seed, size_t node) {
  if (n < 2) refuse("SecAggConfigError", "secure aggregation needs at least 2 participants");
  if (k < 1 || k > n - 1) refuse("SecAggConfigError", "neighbours k must be in 1.." + std::to_string(n - 1));
  if (k < n - 1 && k % 2) refuse("SecAggConfigError", "neighbours k=" + std::to_string(k) + " is odd");
  if (seed.size() != kGraphSeedBytes) refuse("SecAggConfigError", "the graph seed is 32 bytes");
  std::set<size_t> out;
  if (k == n - 1) {
    for (size_t i = 0; i < n; ++i)
      if (i != node) out.insert(i);
    return out;
  }
  ByteStream stream(seed);
  const Bytes raw = stream.read(8 * n);
  std::vector<uint64_t> keys(n);
  for (size_t i = 0; i < n; ++i)
    for (int b = 7; b >= 0; --b) keys[i] = (keys[i] << 8) | raw[8 * i + static_cast<size_t>(b)];
  std::vector<size_t> ring(n);  // ring position -> node: a stable argsort of the keys
  std::iota(ring.begin(), ring.end(), 0);
  std::stable_sort(ring.begin(), ring.end(), [&](size_t a, size_t b) { return keys[a] < keys[b]; });
  std::vector<size_t> pos(n);
  for (size_t i = 0; i < n; ++i) pos[ring[i]] = i;
  const size_t half = k / 2;
  for (size_t o = 1; o <= half; ++o) {
    out.insert(ring[(pos[node] + o) % n]);
    out.insert(ring[(pos[node] + n - o) % n]);
  }
  return out;
}

std::vector<Bytes> shamir_share(const Bytes& secret, size_t t, const std::vector<uint32_t>& xs, ByteStream& rand) {
  if (xs.empty()) throw Failure(ORCHARD_ERR_INTERNAL, "need at least one evaluation point");
  if (t < 1 || t > xs.size()) throw Failure(ORCHARD_ERR_INTERNAL, "threshold out of range");
  const size_t limbs = (secret.size() + 1) / 2;
  std::vector<uint64_t> s(limbs, 0);
  for (size_t i = 0; i < secret.size(); ++i) s[i / 2] |= static_cast<uint64_t>(secret[i]) << (8 * (i % 2));
  // Coefficients (t - 1, limbs), exactly uniform in the field: 2^31 - 1 is redrawn.
  const size_t count = (t - 1) * limbs;
  std::vector<uint64_t> coeffs(count);
  auto draw = [&](size_t n) {
    Bytes raw = rand.read(4 * n);
    std::vector<uint64_t> v(n);
    for (size_t i = 0; i < n; ++i)
      v[i] = (raw[4 * i] | (raw[4 * i + 1] << 8) | (raw[4 * i + 2] << 16) |
              (static_cast<uint64_t>(raw[4 * i + 3]) << 24)) & 0x7fffffffu;
    return v;
  };
  coeffs = draw(count);
  std::vector<size_t> bad;
  for (size_t i = 0; i < count; ++i)
    if (coeffs[i] == kPrime) bad.push_back(i);
  while (!bad.empty()) {
    std::vector<uint64_t> redo = draw(bad.size());
    std::vector<size_t> still;
    for (size_t j = 0; j < bad.size(); ++j) {
      coeffs[bad[j]] = redo[j];
      if (redo[j] == kPrime) still.push_back(bad[j]);
    }
    bad = still;
  }
  std::vector<Bytes> out;
  for (uint32_t x : xs) {
    if (x == 0 || x >= kPrime) throw Failure(ORCHARD_ERR_INTERNAL, "evaluation points lie in 1..p-1");
    Bytes row;
    for (size_t l = 0; l < limbs; ++l) {
      uint64_t acc = 0;
      for (size_t j = t - 1; j-- > 0;) acc = (acc * x + coeffs[j * limbs + l]) % kPrime;
      const uint64_t v = (acc * x + s[l]) % kPrime;
      for (int b = 0; b < 4; ++b) row.push_back(static_cast<uint8_t>(v >> (8 * b)));
    }
    out.push_back(std::move(row));
  }
  return out;
}

Bytes shamir_reconstruct(const std::map<uint32_t, Bytes>& shares, size_t t, size_t secret_len) {
  if (shares.size() < t) refuse("NotEnoughShares", "reconstruction needs " + std::to_string(t) + " shares");
  std::vector<uint64_t> xs;
  std::vector<const Bytes*> rows;
  for (auto& [x, row] : shares) {
    if (xs.size() == t) break;
    if (row.size() != share_size(secret_len)) refuse("MalformedMessage", "a share has the wrong size");
    xs.push_back(x);
    rows.push_back(&row);
  }
  const size_t limbs = (secret_len + 1) / 2;
  Bytes out;
  for (size_t l = 0; l < limbs; ++l) {
    uint64_t acc = 0;
    for (size_t j = 0; j < t; ++j) {
      uint64_t num = 1, den = 1;
      for (size_t a = 0; a < t; ++a) {
        if (a == j) continue;
        num = num * xs[a] % kPrime;
        den = den * ((xs[a] + kPrime - xs[j]) % kPrime) % kPrime;
      }
      const Bytes& r = *rows[j];
      const uint64_t y = r[4 * l] | (r[4 * l + 1] << 8) | (r[4 * l + 2] << 16) | (static_cast<uint64_t>(r[4 * l + 3]) << 24);
      if (y >= kPrime) refuse("MalformedMessage", "a share holds a value outside the field");
      acc = (acc + y * (num * pow_mod(den, kPrime - 2) % kPrime)) % kPrime;
    }
    if (acc >= (1u << 16)) refuse("MalformedMessage", "shares are inconsistent");
    out.push_back(static_cast<uint8_t>(acc));
    out.push_back(static_cast<uint8_t>(acc >> 8));
  }
  out.resize(secret_len);
  return out;
}

std::vector<uint32_t> secure_quantize(const std::vector<double>& x, double clip, int bits, uint64_t seed) {
  if (!(clip > 0) || !std::isfinite(clip) || bits < 1 || bits > 32)
    refuse("SecAggConfigError", "clip must be a positive finite number and bits in 1..32");
  std::vector<uint32_t> entropy = int_words(seed);
  entropy.push_back(0x5EC);
  Pcg64 rng(entropy);
  const double levels = static_cast<double>((1ull << bits) - 1);
  const double scale = levels / (2.0 * clip);
  std::vector<uint32_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    // np.clip passes NaN through; a NaN update never reaches here (the codec refused it).
    const double c = std::min(std::max(x[i], -clip), clip);
    const double v = (c + clip) * scale;
    const double fl = std::floor(v);
    const double up = rng.next_double() < (v - fl) ? 1.0 : 0.0;
    out[i] = static_cast<uint32_t>(std::min(fl + up, levels));
  }
  return out;
}

SecAggClient::SecAggClient(std::string node_id, const Bytes& entropy)
    : node_id_(std::move(node_id)),
      rand_([&] {
        if (entropy.size() < 32) throw Failure(ORCHARD_ERR_ARGUMENT, "entropy must be at least 32 bytes");
        Bytes info = str_bytes("client:");
        info.insert(info.end(), node_id_.begin(), node_id_.end());
        return hkdf(entropy, info, 32);
      }()) {}

SecAggClient::~SecAggClient() = default;

Bytes SecAggClient::respond(const Bytes& broadcast, const std::vector<uint32_t>* vector) {
  if (!last_broadcast_.empty() && broadcast == last_broadcast_) return last_reply_;
  if (stage_ == SecAggStage::done || stage_ == SecAggStage::aborted)
    refuse("WrongStage", "client '" + node_id_ + "' has finished its session (" + stage_name(stage_) + ")");
  const Broadcast b = parse(broadcast);
  const bool is_broadcast = b.tag == kSessionSetup || b.tag == kKeysBroadcast || b.tag == kSharesBroadcast ||
                            b.tag == kUnmaskRequest;
  if (stage_of_tag(b.tag) != stage_ || !is_broadcast)
    refuse("WrongStage", "client '" + node_id_ + "' waits for the " + stage_name(stage_) + " broadcast, got a " +
                             kTagNames[b.tag]);
  if (b.node != node_id_) refuse("UnknownPeer", "broadcast addressed to '" + b.node + "', this is '" + node_id_ + "'");
  if (config_ && (b.session_id != config_->session_id || b.round != config_->round_number))
    refuse("WrongSession", "message for session " + hex(b.session_id) + " round " + std::to_string(b.round) +
                               ", this client is in session " + hex(config_->session_id) + " round " +
                               std::to_string(config_->round_number) + ": replayed or misrouted");
  Bytes reply;
  try {
    switch (b.tag) {
      case kSessionSetup: reply = advertise(b); break;
      case kKeysBroadcast: reply = share(b); break;
      case kSharesBroadcast: reply = mask(b, vector); break;
      default: reply = unmask(b); break;
    }
  } catch (const Failure& f) {
    if (std::string(f.what()).rfind("SecAggAbort", 0) == 0) stage_ = SecAggStage::aborted;
    throw;
  }
  last_broadcast_ = broadcast;
  last_reply_ = reply;
  return reply;
}

Bytes SecAggClient::advertise(const Broadcast& b) {
  const SessionConfig& c = b.config;
  auto me = std::find(c.participants.begin(), c.participants.end(), node_id_);
  if (me == c.participants.end()) refuse("UnknownPeer", "'" + node_id_ + "' is not among the session's participants");
  if (c.modulus_bits > 32)
    refuse("SecAggConfigError", "modulus_bits " + std::to_string(c.modulus_bits) +
                                    " needs 64-bit words; this client masks in 32-bit words (modulus_bits <= 32)");
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < c.participants.size(); ++i) index[c.participants[i]] = i;
  std::set<std::string> neighbours;
  for (size_t j : neighbours_of(c.participants.size(), c.neighbours, c.graph_seed, index[node_id_]))
    neighbours.insert(c.participants[j]);
  // Everything is decided before the stream is drawn from, so a refusal leaves no trace.
  c_sk_ = rand_.read(kKeyBytes);
  s_sk_ = rand_.read(kKeyBytes);
  seed_ = rand_.read(kSeedBytes);
  index_ = std::move(index);
  neighbours_ = std::move(neighbours);
  config_ = c;
  stage_ = SecAggStage::share_keys;
  Writer w = header(kAdvertiseKeys, c, node_id_);
  w.raw(x25519_public(c_sk_));
  w.raw(x25519_public(s_sk_));
  return w.out;
}

Bytes SecAggClient::share(const Broadcast& b) {
  const SessionConfig& c = *config_;
  std::set<Bytes> seen{x25519_public(c_sk_), x25519_public(s_sk_)};
  std::map<std::string, Peer> peers;
  for (auto& [node, keys] : b.keys) {
    if (!neighbours_.count(node)) refuse("UnknownPeer", "keys for '" + node + "', which is not a neighbour of '" + node_id_ + "'");
    if (peers.count(node)) refuse("DuplicateMessage", "keys for '" + node + "' listed twice");
    if (seen.count(keys.first) || seen.count(keys.second) || keys.first == keys.second)
      refuse("MalformedMessage", "keys of '" + node + "' repeat a key already seen");
    seen.insert(keys.first);
    seen.insert(keys.second);
    peers[node] = {keys.first, keys.second};
  }
  if (peers.size() < c.threshold)
    refuse("SecAggAbort", "only " + std::to_string(peers.size()) + " neighbours of '" + node_id_ +
                              "' advertised keys, threshold is " + std::to_string(c.threshold) +
                              ": its secrets could not be recovered");
  std::vector<std::string> holders;
  for (auto& p : peers) holders.push_back(p.first);
  std::sort(holders.begin(), holders.end(), [&](const std::string& a, const std::string& z) { return index_[a] < index_[z]; });
  // Agree on every channel first: a low-order key refuses the message before the
  // stream is drawn from for the shares.
  std::map<std::string, Bytes> channel;
  for (auto& h : holders) channel[h] = x25519_agree(c_sk_, peers[h].channel_pk);
  std::vector<uint32_t> xs;
  for (auto& h : holders) xs.push_back(static_cast<uint32_t>(index_[h] + 1));
  const std::vector<Bytes> key_shares = shamir_share(s_sk_, c.threshold, xs, rand_);
  const std::vector<Bytes> seed_shares = shamir_share(seed_, c.threshold, xs, rand_);
  std::vector<std::pair<std::string, Bytes>> out;
  for (size_t i = 0; i < holders.size(); ++i) {
    const std::string& h = holders[i];
    Writer plain;
    plain.string(node_id_);
    plain.string(h);
    plain.raw(key_shares[i]);
    plain.raw(seed_shares[i]);
    const Bytes ad = context("shares", c.session_id, c.round_number, node_id_, h);
    out.emplace_back(h, gcm_seal(channel_key(channel[h], c, node_id_, h), plain.out, ad));
  }
  peers_ = std::move(peers);
  channel_ = std::move(channel);
  stage_ = SecAggStage::masked_input;
  Writer w = header(kShareKeys, c, node_id_);
  w.pairs(out);
  return w.out;
}

Bytes SecAggClient::mask(const Broadcast& b, const std::vector<uint32_t>* vector) {
  const SessionConfig& c = *config_;
  std::vector<std::pair<std::string, Held>> held;
  std::set<std::string> from;
  for (auto& [sender, ct] : b.ciphertexts) {
    if (!peers_.count(sender))
      refuse("UnknownPeer", "shares from '" + sender + "', which did not advertise keys as a neighbour of '" + node_id_ + "'");
    if (from.count(sender)) refuse("DuplicateMessage", "shares from '" + sender + "' delivered twice");
    if (ct.size() != ciphertext_size(sender, node_id_))
      refuse("MalformedMessage", "ciphertext from '" + sender + "' has the wrong length " + std::to_string(ct.size()));
    const Bytes key = channel_key(channel_[sender], c, sender, node_id_);
    const Bytes ad = context("shares", c.session_id, c.round_number, sender, node_id_);
    Bytes plain;
    if (!gcm_open(key, ct, ad, &plain))
      refuse("TamperedCiphertext", "the encrypted shares from '" + sender +
                                       "' failed authentication: the ciphertext was modified, addressed to another "
                                       "node, or replayed from another session/round");
    Reader r(plain);
    const std::string u = r.string(), v = r.string();
    const Bytes ks = r.fixed(share_size(kKeyBytes)), ss = r.fixed(share_size(kSeedBytes));
    r.end();
    if (u != sender || v != node_id_)
      refuse("MalformedMessage", "shares from '" + sender + "' name '" + u + "' -> '" + v + "' inside");
    from.insert(sender);
    held.push_back({sender, {ks, ss}});
  }
  if (held.size() < c.threshold)
    refuse("SecAggAbort", "only " + std::to_string(held.size()) + " neighbours of '" + node_id_ +
                              "' shared keys, threshold is " + std::to_string(c.threshold));
  if (vector == nullptr) refuse("UpdateSchemaError", "the masked-input stage needs the quantised vector");
  if (vector->size() != c.vector_length)
    refuse("UpdateSchemaError", "expected " + std::to_string(c.vector_length) + " unsigned integers, got " +
                                    std::to_string(vector->size()));
  const uint64_t modulus_mask = c.modulus_bits >= 32 ? 0xffffffffull : (1ull << c.modulus_bits) - 1;
  for (uint32_t x : *vector)
    if (x > modulus_mask) refuse("UpdateSchemaError", "input values must be < 2^" + std::to_string(c.modulus_bits) + "; quantise first");
  std::vector<uint32_t> y = *vector;
  add_mask(y, seed_, 1);
  const size_t me = index_[node_id_];
  for (auto& [peer, h] : held) {
    (void)h;
    // The lower-indexed node of a pair adds the mask, the higher one subtracts it.
    add_mask(y, pairwise_seed(s_sk_, peers_[peer].mask_pk, c, node_id_, peer), me < index_[peer] ? 1 : -1);
  }
  for (auto& w : y) w &= static_cast<uint32_t>(modulus_mask);
  held_ = std::move(held);
  channel_.clear();
  stage_ = SecAggStage::unmasking;
  Writer w = header(kMaskedInput, c, node_id_);
  w.uint(4, 1);
  w.uint(y.size(), 8);
  for (uint32_t v : y)
    for (int i = 0; i < 4; ++i) w.out.push_back(static_cast<uint8_t>(v >> (8 * i)));
  return w.out;
}

Bytes SecAggClient::unmask(const Broadcast& b) {
  const SessionConfig& c = *config_;
  std::set<std::string> survivors(b.survivors.begin(), b.survivors.end()), dropped(b.dropped.begin(), b.dropped.end());
  if (survivors.size() != b.survivors.size() || dropped.size() != b.dropped.size())
    refuse("DuplicateMessage", "the unmask request lists a node twice");
  for (auto& s : survivors)
    if (dropped.count(s))
      refuse("MalformedMessage", "the server asks for both shares of '" + s + "': that would unmask their inputs; refusing");
  std::map<std::string, const Held*> held;
  for (auto& [node, h] : held_) held[node] = &h;
  for (const auto* group : {&survivors, &dropped})
    for (auto& s : *group)
      if (!held.count(s)) refuse("UnknownPeer", "unmask request names '" + s + "', whose shares '" + node_id_ + "' does not hold");
  if (survivors.size() < c.threshold)
    refuse("SecAggAbort", "only " + std::to_string(survivors.size()) + " neighbours of '" + node_id_ +
                              "' survived, threshold is " + std::to_string(c.threshold));
  std::vector<std::pair<std::string, Bytes>> seed_shares, key_shares;
  for (auto& u : b.survivors) seed_shares.emplace_back(u, held[u]->seed_share);
  for (auto& u : b.dropped) key_shares.emplace_back(u, held[u]->key_share);
  stage_ = SecAggStage::done;
  Writer w = header(kUnmaskShares, c, node_id_);
  w.pairs(seed_shares);
  w.pairs(key_shares);
  return w.out;
}

}  // namespace orchard
