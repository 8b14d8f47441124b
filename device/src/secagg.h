// The client side of SecAgg+ (secure_agg/client.py), byte-compatible with
// orchard.secure_agg: the same messages (secure_agg/messages.py, consistency.py) in
// both versions, neighbour graph (graph.py), Shamir shares over GF(2^31 - 1)
// (shamir.py), key derivation and share encryption (crypto.py), and masks (prg.py).
// Given the same entropy, identity key and broadcasts, a SecAggClient here answers with
// the Python client's bytes.
//
// Version 1 is the semi-honest protocol. Version 2 (a session set up as active,
// secure_agg/active.py): the client signs its keys and H(b_u) with its device identity
// key and sends the root's certificate of it; it uses a neighbour's keys only when that
// neighbour's certificate verifies against the root's key (its policy's) and its
// signature over its keys does, else the neighbour is absent; it signs the survivor view
// of the consistency stage if it fits what it saw, and reveals shares only under that
// view once t of its neighbours signed it, which shares following from the view itself.
//
// Refusals throw Failure(ORCHARD_ERR_SECAGG) whose message starts with the Python
// error's class name (MalformedMessage, WrongStage, WrongSession, UnknownPeer,
// DuplicateMessage, TamperedCiphertext, SecAggAbort, SecAggConfigError). A refused
// broadcast changes no state, except an abort, after which the client is finished.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "crypto.h"

namespace orchard {

// The order of secure_agg/stages.py STAGE_ORDER: the stage numbers Fleet.SecAgg carries.
enum class SecAggStage { advertise_keys, share_keys, masked_input, unmasking, done, aborted, consistency };

struct SessionConfig {
  Bytes session_id;  // 16 bytes
  uint64_t round_number = 0;
  std::vector<std::string> participants;  // sorted, distinct
  uint32_t neighbours = 0;
  uint32_t threshold = 0;
  Bytes graph_seed;  // 32 bytes
  uint64_t vector_length = 0;
  uint8_t modulus_bits = 32;
  bool active = false;  // version 2: signed keys, the consistency stage, the signed view
};

// What the client signs its session keys and survivor view with (active sessions).
struct SecAggIdentity {
  std::function<Bytes(const Bytes&)> sign;  // the device key's Ed25519 signature of a message
  Bytes credential;  // the root's certificate of that key; else the raw 32-byte public key
};

// active.ClientPolicy: what the client holds any session to, from its own configuration
// (never the server's). With a root key, every neighbour's keys must carry a certificate
// from that root, and semi-honest sessions are refused.
struct ClientPolicy {
  Bytes root_public_key;  // empty: a neighbour's credential is taken on its word
  uint32_t min_participants = 3;
  uint32_t min_neighbours = 2;
  double corrupt_fraction = 0.05;  // 2t - k >= max(1, ceil(corrupt_fraction * k))
  std::optional<bool> require_active;  // unset: exactly when root_public_key is set
  // Failure "SecAggConfigError: session refused: ..." naming every floor the config misses.
  void check(const SessionConfig& c) const;
};

// graph.NeighbourGraph: a Harary graph H(n, k) relabelled by a permutation drawn from
// the graph seed; node indices are positions in the sorted participant list.
std::set<size_t> neighbours_of(size_t num_nodes, size_t degree, const Bytes& seed, size_t node);

// shamir.share_bytes: one serialised share per evaluation point (16-bit limbs, each
// shared with its own polynomial of degree t - 1, coefficients drawn from `rand`).
std::vector<Bytes> shamir_share(const Bytes& secret, size_t threshold, const std::vector<uint32_t>& xs,
                                ByteStream& rand);
// shamir.reconstruct_bytes from the `threshold` lowest points (for tests and checks).
Bytes shamir_reconstruct(const std::map<uint32_t, Bytes>& shares, size_t threshold, size_t secret_len);

// secure_agg.quantize with np.random.default_rng([seed, 0x5EC]) (client/secure.py
// masked_input): clip to [-clip, clip], map onto [0, 2^bits - 1], round stochastically.
std::vector<uint32_t> secure_quantize(const std::vector<double>& x, double clip, int bits, uint64_t seed);
// The same rounding with np.random.default_rng(entropy words): a client's own rounding,
// seeded from the OS so that nobody can replay it (client/secure.os_generator).
std::vector<uint32_t> secure_quantize(const std::vector<double>& x, double clip, int bits,
                                      const std::vector<uint32_t>& entropy);

// Which stage a broadcast belongs to, and its session (for a transport that must match
// it to a task), without acting on it. Failure for a malformed message.
SecAggStage broadcast_stage(const Bytes& broadcast);

class SecAggClient {
 public:
  // `entropy`: at least 32 unpredictable bytes; every secret of the session derives
  // from it (never reuse it). `identity`: the device's key and the root's certificate
  // of it (none: an uncertified key derived from the entropy, as the Python client's
  // SessionIdentity.ephemeral).
  SecAggClient(std::string node_id, const Bytes& entropy, std::optional<SecAggIdentity> identity = std::nullopt,
               ClientPolicy policy = ClientPolicy());
  ~SecAggClient();

  // The reply to the server's broadcast for the current stage; `vector` (vector_length
  // values < 2^modulus_bits) is needed with the masked-input stage's broadcast. It is
  // masked in 32-bit words for modulus_bits <= 32, else in 64-bit words (prg.word_dtype).
  // The same broadcast again gets the same reply (the first was lost in transit).
  Bytes respond(const Bytes& broadcast, const std::vector<uint64_t>* vector = nullptr);

  SecAggStage stage() const { return stage_; }
  const std::optional<SessionConfig>& config() const { return config_; }

 private:
  struct Peer {
    Bytes channel_pk, mask_pk;
  };
  struct Held {
    Bytes key_share, seed_share;
  };
  Bytes advertise(const struct Broadcast& b);
  Bytes share(const struct Broadcast& b);
  Bytes mask(const struct Broadcast& b, const std::vector<uint64_t>* vector);
  Bytes unmask(const struct Broadcast& b);
  Bytes sign_view(const struct Broadcast& b);
  Bytes unmask_active(const struct Broadcast& b);
  std::optional<Bytes> verified(const std::string& node, const Bytes& c_pk, const Bytes& s_pk,
                                const Bytes& commitment, const Bytes& credential, const Bytes& signature) const;
  void forget();

  std::string node_id_;
  SecAggIdentity identity_;
  ClientPolicy policy_;
  ByteStream rand_;
  SecAggStage stage_ = SecAggStage::advertise_keys;
  std::optional<SessionConfig> config_;
  std::set<std::string> neighbours_;
  std::map<std::string, size_t> index_;
  Bytes c_sk_, s_sk_, seed_;
  std::map<std::string, Peer> peers_;
  std::vector<std::pair<std::string, Held>> held_;  // in the order the shares arrived
  std::map<std::string, Bytes> channel_;
  std::map<std::string, Bytes> ids_;  // neighbours whose signed keys verified -> identity key
  std::set<std::string> masked_;      // the neighbours whose masks went into y_u
  Bytes digest_;                      // SessionConfig.digest (active sessions)
  Bytes view_;                        // the survivor view this client signed
  Bytes last_broadcast_, last_reply_;
};

}  // namespace orchard
