#include "secagg.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "failure.h"
#include "identity.h"
#include "numpy_random.h"
#include "sha256.h"

namespace orchard {

namespace {

constexpr uint8_t kVersion = 1;        // the semi-honest protocol's messages
constexpr uint8_t kActiveVersion = 2;  // the messages that differ in an active session
constexpr size_t kSessionIdBytes = 16, kGraphSeedBytes = 32, kTagBytes = 16;
constexpr size_t kCommitmentBytes = 32, kSignatureBytes = 64;
constexpr uint64_t kPrime = (1ull << 31) - 1;
enum Tag : uint8_t {
  kSessionSetup = 1, kAdvertiseKeys = 2, kKeysBroadcast = 3, kShareKeys = 4,
  kSharesBroadcast = 5, kMaskedInput = 6, kUnmaskRequest = 7, kUnmaskShares = 8,
  kConsistencyRequest = 9, kConsistencySignature = 10
};
const char* kTagNames[] = {"?", "SessionSetup", "AdvertiseKeys", "KeysBroadcast", "ShareKeys",
                           "SharesBroadcast", "MaskedInput", "UnmaskRequest", "UnmaskShares",
                           "ConsistencyRequest", "ConsistencySignature"};
// The header versions each message has a form in (messages.py, consistency.py VERSIONS).
bool has_form(uint8_t tag, uint64_t version) {
  switch (tag) {
    case kSessionSetup: case kAdvertiseKeys: case kKeysBroadcast: case kUnmaskRequest:
      return version == kVersion || version == kActiveVersion;
    case kConsistencyRequest: case kConsistencySignature: return version == kActiveVersion;
    default: return version == kVersion;
  }
}
// Domain tags (secure_agg/active.py, consistency.py), each followed by a NUL byte.
const char kAdvertiseDomain[] = "orchard-secagg/advertise/v2";
const char kSeedDomain[] = "orchard-secagg/self-mask/v2";
const char kConsistencyDomain[] = "orchard-secagg/consistency/v2";

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

Writer header(uint8_t tag, const SessionConfig& c, const std::string& node, uint8_t version = kVersion) {
  Writer w;
  w.raw({'O', 'S', 'A'});
  w.uint(version, 1);
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

Bytes with_domain(const char* tag) {
  Bytes b(tag, tag + std::char_traits<char>::length(tag));
  b.push_back(0);
  return b;
}

void append(Bytes& out, const Bytes& more) { out.insert(out.end(), more.begin(), more.end()); }

Bytes encoded_id(const std::string& node) {
  Writer w;
  w.string(node);
  return w.out;
}

// SessionConfig.digest: SHA-256 of the session setup addressed to "" without its magic,
// what a client signs its keys and its survivor view under.
Bytes config_digest(const SessionConfig& c) {
  Writer w = header(kSessionSetup, c, "", c.active ? kActiveVersion : kVersion);
  w.uint(c.participants.size(), 4);
  for (auto& p : c.participants) w.string(p);
  w.uint(c.neighbours, 4);
  w.uint(c.threshold, 4);
  w.raw(c.graph_seed);
  w.uint(c.vector_length, 8);
  w.uint(c.modulus_bits, 1);
  return sha256_bytes(w.out.data() + 3, w.out.size() - 3);
}

// X25519 public keys of small order and their non-canonical encodings (active.py
// _LOW_ORDER, libsodium's list), compared with the top bit cleared.
bool is_low_order(const Bytes& key) {
  static const char* kLow[] = {
      "0000000000000000000000000000000000000000000000000000000000000000",
      "0100000000000000000000000000000000000000000000000000000000000000",
      "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
      "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
      "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
      "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
      "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"};
  if (key.size() != 32) return false;
  Bytes k = key;
  k[31] &= 0x7f;
  for (const char* h : kLow) {
    Bytes low(32);
    for (size_t i = 0; i < 32; ++i) low[i] = static_cast<uint8_t>(std::stoul(std::string(h + 2 * i, 2), nullptr, 16));
    if (k == low) return true;
  }
  return false;
}

// consistency.View: U2 and U3 as bit sets over the participants (bit i of byte i / 8).
struct View {
  std::set<size_t> u2, u3;
};

View parse_view(const Bytes& raw, size_t n) {
  const size_t width = (n + 7) / 8;
  if (raw.size() != 2 * width)
    refuse("MalformedMessage", "a survivor view of " + std::to_string(n) + " nodes is " + std::to_string(2 * width) +
                                   " bytes, got " + std::to_string(raw.size()));
  View v;
  for (int part = 0; part < 2; ++part) {
    std::set<size_t>& into = part == 0 ? v.u2 : v.u3;
    for (size_t i = 0; i < 8 * width; ++i) {
      if (!((raw[part * width + i / 8] >> (i % 8)) & 1)) continue;
      if (i >= n) refuse("MalformedMessage", "a survivor view names nodes beyond the participant list");
      into.insert(i);
    }
  }
  for (size_t i : v.u3)
    if (!v.u2.count(i)) refuse("MalformedMessage", "a survivor view puts a node in U3 that is not in U2");
  return v;
}

size_t share_size(size_t secret_len) { return 4 * ((secret_len + 1) / 2); }

size_t ciphertext_size(const std::string& sender, const std::string& recipient) {
  return 4 + sender.size() + recipient.size() + share_size(kKeyBytes) + share_size(kSeedBytes) + kTagBytes;
}

}  // namespace

// A neighbour's keys as a keys broadcast carries them (signed, in version 2).
struct PeerEntry {
  std::string node;
  Bytes channel_pk, mask_pk, commitment, credential, signature;
};

// A parsed broadcast (server -> client).
struct Broadcast {
  uint8_t tag = 0;
  uint8_t version = kVersion;
  Bytes session_id;
  uint64_t round = 0;
  std::string node;  // the recipient
  SessionConfig config;                                   // SessionSetup
  std::vector<PeerEntry> keys;                              // KeysBroadcast
  std::vector<std::pair<std::string, Bytes>> ciphertexts;  // SharesBroadcast
  std::vector<std::string> survivors, dropped;             // UnmaskRequest, version 1
  Bytes view;                                              // ConsistencyRequest; UnmaskRequest, version 2
  std::vector<std::pair<std::string, Bytes>> signatures;   // UnmaskRequest, version 2
};

namespace {

SecAggStage stage_of_tag(uint8_t tag) {
  switch (tag) {
    case kSessionSetup: case kAdvertiseKeys: return SecAggStage::advertise_keys;
    case kKeysBroadcast: case kShareKeys: return SecAggStage::share_keys;
    case kSharesBroadcast: case kMaskedInput: return SecAggStage::masked_input;
    case kConsistencyRequest: case kConsistencySignature: return SecAggStage::consistency;
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
  if (version != kVersion && version != kActiveVersion)
    refuse("MalformedMessage", "message version " + std::to_string(version) + ", this code speaks 1 and 2");
  b.version = static_cast<uint8_t>(version);
  b.tag = static_cast<uint8_t>(r.uint(1));
  if (b.tag < 1 || b.tag > 10) refuse("MalformedMessage", "unknown message tag " + std::to_string(b.tag));
  if (!has_form(b.tag, version))
    refuse("MalformedMessage", std::string("a ") + kTagNames[b.tag] + " has no version " + std::to_string(version) + " form");
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
      c.active = b.version == kActiveVersion;
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
        k.node = r.string();
        k.channel_pk = r.fixed(kKeyBytes);
        k.mask_pk = r.fixed(kKeyBytes);
        if (b.version == kActiveVersion) {
          k.commitment = r.fixed(kCommitmentBytes);
          k.credential = r.fixed(r.uint(2));
          k.signature = r.fixed(kSignatureBytes);
          if (k.credential.empty())
            refuse("MalformedMessage", "signed keys carry their owner's credential (certificate or key)");
        }
      }
      break;
    }
    case kSharesBroadcast: b.ciphertexts = r.pairs(); break;
    case kUnmaskRequest:
      if (b.version == kActiveVersion) {
        b.view = r.fixed(r.count(1));
        if (b.view.empty()) refuse("MalformedMessage", "an active unmask request carries the survivor view");
        b.signatures = r.pairs();
        break;
      }
      b.survivors = r.strings();
      b.dropped = r.strings();
      break;
    case kConsistencyRequest: b.view = r.fixed(r.count(1)); break;
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
    case SecAggStage::consistency: return "consistency";
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
  std::vector<uint32_t> entropy = int_words(seed);
  entropy.push_back(0x5EC);
  return secure_quantize(x, clip, bits, entropy);
}

std::vector<uint32_t> secure_quantize(const std::vector<double>& x, double clip, int bits,
                                      const std::vector<uint32_t>& entropy) {
  if (!(clip > 0) || !std::isfinite(clip) || bits < 1 || bits > 32)
    refuse("SecAggConfigError", "clip must be a positive finite number and bits in 1..32");
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

void ClientPolicy::check(const SessionConfig& c) const {
  const size_t n = c.participants.size(), k = c.neighbours, t = c.threshold;
  std::vector<std::string> problems;
  if (n < min_participants)
    problems.push_back(std::to_string(n) + " participants, this client takes part only with >= " +
                       std::to_string(min_participants));
  if (k < min_neighbours)
    problems.push_back(std::to_string(k) + " neighbours, this client needs >= " + std::to_string(min_neighbours));
  const long margin = std::max(1L, static_cast<long>(std::ceil(corrupt_fraction * static_cast<double>(k))));
  const long slack = 2 * static_cast<long>(t) - static_cast<long>(k);
  if (slack < margin)
    problems.push_back("threshold t=" + std::to_string(t) + " of k=" + std::to_string(k) + ": 2t - k = " +
                       std::to_string(slack) + " < " + std::to_string(margin) +
                       ", too few shares would expose a client (this client needs t >= " +
                       std::to_string((static_cast<long>(k) + margin + 1) / 2) + ")");
  const bool active_needed = require_active ? *require_active : !root_public_key.empty();
  if (active_needed && !c.active)
    problems.push_back("a semi-honest session: this client takes part only in sessions with signed keys and the "
                       "consistency round");
  if (problems.empty()) return;
  std::string all;
  for (auto& p : problems) all += (all.empty() ? "" : "; ") + std::string("session refused: ") + p;
  refuse("SecAggConfigError", all);
}

SecAggClient::SecAggClient(std::string node_id, const Bytes& entropy, std::optional<SecAggIdentity> identity,
                           ClientPolicy policy)
    : node_id_(std::move(node_id)),
      policy_(std::move(policy)),
      rand_([&] {
        if (entropy.size() < 32) throw Failure(ORCHARD_ERR_ARGUMENT, "entropy must be at least 32 bytes");
        Bytes info = str_bytes("client:");
        info.insert(info.end(), node_id_.begin(), node_id_.end());
        return hkdf(entropy, info, 32);
      }()) {
  if (identity) {
    if (!identity->sign || identity->credential.empty() || identity->credential.size() > 0xffff)
      throw Failure(ORCHARD_ERR_ARGUMENT, "a SecAgg identity needs a signer and a credential of 1 to 65535 bytes");
    identity_ = std::move(*identity);
  } else {
    // SessionIdentity.ephemeral: an uncertified key derived from the entropy.
    const Bytes key = hkdf(entropy, str_bytes("identity"), 32);
    identity_.credential = ed25519_public(key);
    identity_.sign = [key](const Bytes& m) { return ed25519_sign(key, m); };
  }
}

SecAggClient::~SecAggClient() { forget(); }

void SecAggClient::forget() {
  for (Bytes* secret : {&c_sk_, &s_sk_, &seed_}) std::fill(secret->begin(), secret->end(), 0), secret->clear();
  held_.clear();
  channel_.clear();
}

Bytes SecAggClient::respond(const Bytes& broadcast, const std::vector<uint64_t>* vector) {
  if (!last_broadcast_.empty() && broadcast == last_broadcast_) return last_reply_;
  if (stage_ == SecAggStage::done || stage_ == SecAggStage::aborted)
    refuse("WrongStage", "client '" + node_id_ + "' has finished its session (" + stage_name(stage_) + ")");
  const Broadcast b = parse(broadcast);
  const bool is_broadcast = b.tag == kSessionSetup || b.tag == kKeysBroadcast || b.tag == kSharesBroadcast ||
                            b.tag == kConsistencyRequest || b.tag == kUnmaskRequest;
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
      case kConsistencyRequest: reply = sign_view(b); break;
      default: reply = config_->active ? unmask_active(b) : unmask(b); break;
    }
  } catch (const Failure& f) {
    if (std::string(f.what()).rfind("SecAggAbort", 0) == 0) {
      stage_ = SecAggStage::aborted;
      forget();
    }
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
  policy_.check(c);
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
  const Bytes c_pk = x25519_public(c_sk_), s_pk = x25519_public(s_sk_);
  if (!c.active) {
    Writer w = header(kAdvertiseKeys, c, node_id_);
    w.raw(c_pk);
    w.raw(s_pk);
    return w.out;
  }
  // Active (active.py): H(b_u) commits to the self-mask seed; the signature binds both
  // keys and the commitment to this node and this session's config.
  digest_ = config_digest(c);
  Bytes committed = with_domain(kSeedDomain);
  append(committed, digest_);
  append(committed, encoded_id(node_id_));
  append(committed, seed_);
  const Bytes commitment = sha256_bytes(committed.data(), committed.size());
  Bytes signed_part = with_domain(kAdvertiseDomain);
  append(signed_part, digest_);
  append(signed_part, encoded_id(node_id_));
  append(signed_part, c_pk);
  append(signed_part, s_pk);
  append(signed_part, commitment);
  const Bytes signature = identity_.sign(signed_part);
  Writer w = header(kAdvertiseKeys, c, node_id_, kActiveVersion);
  w.raw(c_pk);
  w.raw(s_pk);
  w.raw(commitment);
  w.uint(identity_.credential.size(), 2);
  w.raw(identity_.credential);
  w.raw(signature);
  return w.out;
}

// active.identity_key and SecAggClient._verified: the identity key of a neighbour whose
// keys are not of small order and carry a valid credential and signature; none otherwise.
std::optional<Bytes> SecAggClient::verified(const std::string& node, const Bytes& c_pk, const Bytes& s_pk,
                                            const Bytes& commitment, const Bytes& credential,
                                            const Bytes& signature) const {
  if (is_low_order(c_pk) || is_low_order(s_pk)) return std::nullopt;
  Bytes key;
  if (!policy_.root_public_key.empty()) {
    try {
      key = verify_certificate(credential, policy_.root_public_key, &node).public_key;
    } catch (const Failure&) {
      return std::nullopt;
    }
  } else if (credential.size() == kEd25519PublicBytes) {
    key = credential;  // no root to check against: the key is taken on its word
  } else {
    if (credential.size() < 3) return std::nullopt;
    const size_t n = (static_cast<size_t>(credential[1]) << 8) | credential[2];
    if (credential.size() != 3 + n + kEd25519PublicBytes + 8 + kEd25519SignatureBytes ||
        std::string(credential.begin() + 3, credential.begin() + 3 + static_cast<long>(n)) != node)
      return std::nullopt;
    key.assign(credential.begin() + 3 + static_cast<long>(n),
               credential.begin() + 3 + static_cast<long>(n + kEd25519PublicBytes));
  }
  Bytes signed_part = with_domain(kAdvertiseDomain);
  append(signed_part, digest_);
  append(signed_part, encoded_id(node));
  append(signed_part, c_pk);
  append(signed_part, s_pk);
  append(signed_part, commitment);
  if (!ed25519_verify(key, signed_part, signature)) return std::nullopt;
  return key;
}

Bytes SecAggClient::share(const Broadcast& b) {
  const SessionConfig& c = *config_;
  std::set<Bytes> seen{x25519_public(c_sk_), x25519_public(s_sk_)};
  std::map<std::string, Peer> peers;
  std::map<std::string, Bytes> ids;
  for (const PeerEntry& k : b.keys) {
    const std::string& node = k.node;
    if (!neighbours_.count(node)) refuse("UnknownPeer", "keys for '" + node + "', which is not a neighbour of '" + node_id_ + "'");
    if (peers.count(node)) refuse("DuplicateMessage", "keys for '" + node + "' listed twice");
    if (seen.count(k.channel_pk) || seen.count(k.mask_pk) || k.channel_pk == k.mask_pk)
      refuse("MalformedMessage", "keys of '" + node + "' repeat a key already seen");
    seen.insert(k.channel_pk);
    seen.insert(k.mask_pk);
    if (c.active) {
      // Unsigned, substituted or uncertified keys: the neighbour is treated as absent
      // (no shares to it, no mask with it), as by the Python client.
      std::optional<Bytes> key;
      if (b.version == kActiveVersion) key = verified(node, k.channel_pk, k.mask_pk, k.commitment, k.credential, k.signature);
      if (!key) continue;
      ids[node] = *key;
    }
    peers[node] = {k.channel_pk, k.mask_pk};
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
  ids_ = std::move(ids);
  stage_ = SecAggStage::masked_input;
  Writer w = header(kShareKeys, c, node_id_);
  w.pairs(out);
  return w.out;
}

Bytes SecAggClient::mask(const Broadcast& b, const std::vector<uint64_t>* vector) {
  const SessionConfig& c = *config_;
  std::vector<std::pair<std::string, Held>> held;
  std::set<std::string> from;  // every sender whose ciphertext was routed here: masked with
  for (auto& [sender, ct] : b.ciphertexts) {
    if (!peers_.count(sender))
      refuse("UnknownPeer", "shares from '" + sender + "', which did not advertise keys as a neighbour of '" + node_id_ + "'");
    if (from.count(sender)) refuse("DuplicateMessage", "shares from '" + sender + "' delivered twice");
    from.insert(sender);
    try {
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
      held.push_back({sender, {ks, ss}});
    } catch (const Failure&) {
      // Active: a ciphertext that fails costs its sender this holder (its secrets have
      // k - 1 others); the pair's masks still cancel, since both ends mask once the
      // ciphertext was routed.
      if (!c.active) throw;
    }
  }
  if (from.size() < c.threshold)
    refuse("SecAggAbort", "only " + std::to_string(from.size()) + " neighbours of '" + node_id_ +
                              "' shared keys, threshold is " + std::to_string(c.threshold));
  if (vector == nullptr) refuse("UpdateSchemaError", "the masked-input stage needs the quantised vector");
  if (vector->size() != c.vector_length)
    refuse("UpdateSchemaError", "expected " + std::to_string(c.vector_length) + " unsigned integers, got " +
                                    std::to_string(vector->size()));
  const uint64_t modulus_mask = c.modulus_bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << c.modulus_bits) - 1;
  for (uint64_t x : *vector)
    if (x > modulus_mask) refuse("UpdateSchemaError", "input values must be < 2^" + std::to_string(c.modulus_bits) + "; quantise first");
  const size_t me = index_[node_id_];
  // prg.word_dtype: the field's words are 32 bits wide up to 2^32, else 64.
  const bool wide = c.modulus_bits > 32;
  std::vector<uint32_t> narrow;
  std::vector<uint64_t> y;
  if (wide) {
    y = *vector;
  } else {
    narrow.assign(vector->begin(), vector->end());
  }
  auto fold = [&](const Bytes& seed, int sign) { wide ? add_mask(y, seed, sign) : add_mask(narrow, seed, sign); };
  fold(seed_, 1);
  for (auto& peer : from) {
    // The lower-indexed node of a pair adds the mask, the higher one subtracts it.
    fold(pairwise_seed(s_sk_, peers_[peer].mask_pk, c, node_id_, peer), me < index_[peer] ? 1 : -1);
  }
  if (!wide) y.assign(narrow.begin(), narrow.end());
  for (auto& w : y) w &= modulus_mask;
  held_ = std::move(held);
  masked_ = std::move(from);
  channel_.clear();
  stage_ = c.active ? SecAggStage::consistency : SecAggStage::unmasking;
  Writer w = header(kMaskedInput, c, node_id_);
  const size_t width = wide ? 8 : 4;
  w.uint(width, 1);
  w.uint(y.size(), 8);
  for (uint64_t v : y)
    for (size_t i = 0; i < width; ++i) w.out.push_back(static_cast<uint8_t>(v >> (8 * i)));
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
  forget();
  Writer w = header(kUnmaskShares, c, node_id_);
  w.pairs(seed_shares);
  w.pairs(key_shares);
  return w.out;
}

// Active sessions, between masking and unmasking (consistency.py): sign the view (U2,
// U3) if it fits what this client saw.
Bytes SecAggClient::sign_view(const Broadcast& b) {
  const SessionConfig& c = *config_;
  const View view = parse_view(b.view, c.participants.size());
  const auto& ids = c.participants;
  if (!view.u3.count(index_[node_id_]))
    refuse("SecAggAbort", "the survivor view leaves out '" + node_id_ +
                              "', whose masked input was sent: the server lies about who survived");
  std::set<std::string> in_u2, unknown;
  for (size_t j : view.u2)
    if (neighbours_.count(ids[j])) in_u2.insert(ids[j]);
  for (auto& u : in_u2)
    if (!peers_.count(u)) unknown.insert(u);
  auto names = [](const std::set<std::string>& s) {
    std::string out;
    for (auto& x : s) out += (out.empty() ? "'" : ", '") + x + "'";
    return "[" + out + "]";
  };
  if (!unknown.empty())
    refuse("SecAggAbort", "the survivor view puts " + names(unknown) + " in U2, which advertised no keys to '" +
                              node_id_ + "'");
  std::set<std::string> verified_u2;
  for (auto& u : in_u2)
    if (ids_.count(u)) verified_u2.insert(u);
  if (verified_u2 != masked_) {
    std::set<std::string> short_of, extra;
    for (auto& u : verified_u2)
      if (!masked_.count(u)) short_of.insert(u);
    for (auto& u : masked_)
      if (!in_u2.count(u)) extra.insert(u);
    refuse("SecAggAbort", "the shares broadcast to '" + node_id_ + "' lacked " + names(short_of) + " (in U2) or named " +
                              names(extra) + " (not in U2): the server showed another view");
  }
  view_ = b.view;
  stage_ = SecAggStage::unmasking;
  Bytes signed_part = with_domain(kConsistencyDomain);
  append(signed_part, digest_);
  append(signed_part, view_);
  Writer w = header(kConsistencySignature, c, node_id_, kActiveVersion);
  w.raw(identity_.sign(signed_part));
  return w.out;
}

// Active sessions: reveal only under the view this client signed, once t neighbours
// signed it too; which share of whom follows from the view, not from the server's say.
Bytes SecAggClient::unmask_active(const Broadcast& b) {
  const SessionConfig& c = *config_;
  if (b.version != kActiveVersion || b.view != view_)
    refuse("SecAggAbort", "the unmask request to '" + node_id_ +
                              "' carries another survivor view than the one it signed: the server shows different views");
  Bytes signed_part = with_domain(kConsistencyDomain);
  append(signed_part, digest_);
  append(signed_part, view_);
  std::set<std::string> good;
  for (auto& [signer, sig] : b.signatures) {  // t valid signatures are enough: stop there
    if (good.size() >= c.threshold) break;
    auto id = ids_.find(signer);
    if (id != ids_.end() && !good.count(signer) && ed25519_verify(id->second, signed_part, sig)) good.insert(signer);
  }
  if (good.size() < c.threshold)
    refuse("SecAggAbort", "only " + std::to_string(good.size()) + " neighbours of '" + node_id_ +
                              "' signed its survivor view, threshold is " + std::to_string(c.threshold) +
                              ": it reveals nothing");
  const View view = parse_view(view_, c.participants.size());
  std::set<std::string> u3;
  for (size_t j : view.u3) u3.insert(c.participants[j]);
  size_t survived = 0;
  for (auto& u : masked_) survived += u3.count(u);
  if (survived < c.threshold)
    refuse("SecAggAbort", "only " + std::to_string(survived) + " neighbours of '" + node_id_ +
                              "' survived, threshold is " + std::to_string(c.threshold));
  std::vector<std::pair<std::string, Held>> order = held_;
  std::sort(order.begin(), order.end(), [&](const auto& a, const auto& z) { return index_[a.first] < index_[z.first]; });
  std::vector<std::pair<std::string, Bytes>> seed_shares, key_shares;
  for (auto& [u, h] : order) {
    if (u3.count(u))
      seed_shares.emplace_back(u, h.seed_share);
    else
      key_shares.emplace_back(u, h.key_share);
  }
  stage_ = SecAggStage::done;
  forget();
  Writer w = header(kUnmaskShares, c, node_id_);
  w.pairs(seed_shares);
  w.pairs(key_shares);
  return w.out;
}

}  // namespace orchard
