// The client side of SecAgg+ (secure_agg/client.py), byte-compatible with
// orchard.secure_agg: the same messages (secure_agg/messages.py), neighbour graph
// (graph.py), Shamir shares over GF(2^31 - 1) (shamir.py), key derivation and share
// encryption (crypto.py), and masks (prg.py). Given the same entropy and the same
// broadcasts, a SecAggClient here answers with the Python client's bytes.
//
// Refusals throw Failure(ORCHARD_ERR_SECAGG) whose message starts with the Python
// error's class name (MalformedMessage, WrongStage, WrongSession, UnknownPeer,
// DuplicateMessage, TamperedCiphertext, SecAggAbort). A refused broadcast changes no
// state, except an abort, after which the client is finished.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "crypto.h"

namespace orchard {

enum class SecAggStage { advertise_keys, share_keys, masked_input, unmasking, done, aborted };

struct SessionConfig {
  Bytes session_id;  // 16 bytes
  uint64_t round_number = 0;
  std::vector<std::string> participants;  // sorted, distinct
  uint32_t neighbours = 0;
  uint32_t threshold = 0;
  Bytes graph_seed;  // 32 bytes
  uint64_t vector_length = 0;
  uint8_t modulus_bits = 32;
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

// Which stage a broadcast belongs to, and its session (for a transport that must match
// it to a task), without acting on it. Failure for a malformed message.
SecAggStage broadcast_stage(const Bytes& broadcast);

class SecAggClient {
 public:
  // `entropy`: at least 32 unpredictable bytes; every secret of the session derives
  // from it (never reuse it).
  SecAggClient(std::string node_id, const Bytes& entropy);
  ~SecAggClient();

  // The reply to the server's broadcast for the current stage; `vector` (vector_length
  // values < 2^modulus_bits) is needed with the masked-input stage's broadcast. The
  // same broadcast again gets the same reply (the first was lost in transit).
  Bytes respond(const Bytes& broadcast, const std::vector<uint32_t>* vector = nullptr);

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
  Bytes mask(const struct Broadcast& b, const std::vector<uint32_t>* vector);
  Bytes unmask(const struct Broadcast& b);

  std::string node_id_;
  ByteStream rand_;
  SecAggStage stage_ = SecAggStage::advertise_keys;
  std::optional<SessionConfig> config_;
  std::set<std::string> neighbours_;
  std::map<std::string, size_t> index_;
  Bytes c_sk_, s_sk_, seed_;
  std::map<std::string, Peer> peers_;
  std::vector<std::pair<std::string, Held>> held_;  // in the order the shares arrived
  std::map<std::string, Bytes> channel_;
  Bytes last_broadcast_, last_reply_;
};

}  // namespace orchard
