// The dial-out side of Fleet (orchard/link.py): Join, Poll (long poll), PullModel
// (chunked, resumed after breaks, sha256-checked), Heartbeat, PushUpdate (chunked) and
// SecAgg, over TLS verified against the bundle's CA. Blocking calls; cancel() from any
// thread ends the call in flight with ORCHARD_ERR_CANCELLED.
//
// Enrollment (docs/operating.md, "Device credentials"), as orchard/link.py does it: the
// first Join sends the device's Ed25519 public key and its proof (the signature of
// enrollment_message) with the enrollment token as `authorization: Bearer`; the reply's
// credential is kept (NodeIdentity, on disk before it is used) and is the bearer secret
// of every call from then on. A later Join with a kept credential resumes that node. A
// kept credential the server refuses, while the bundle's token differs from it, enrolls
// the device again with the token.
//
// gRPC statuses become ABI statuses: UNAUTHENTICATED and PERMISSION_DENIED ->
// ORCHARD_ERR_AUTH; UNAVAILABLE and DEADLINE_EXCEEDED -> ORCHARD_ERR_UNAVAILABLE, or
// ORCHARD_ERR_TLS when the handshake failed; anything else the server says ->
// ORCHARD_ERR_REFUSED with its details. Transient failures are retried `attempts` times
// with capped exponential backoff, as the Python link does.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "crypto.h"
#include "identity.h"
#include "policy.h"

namespace orchard {

struct LinkOptions {
  std::string target;     // HOST:PORT
  std::string ca_pem;     // empty: plaintext (loopback development only; `insecure` must say so)
  bool insecure = false;
  std::string token;      // the enrollment token; empty: none
  NodeIdentity* identity = nullptr;  // the device's key and enrollment (not owned); required
  Bytes root_public_key;  // the root's key the bundle names (empty: none): another is refused
  std::string node_id;    // empty: the server assigns one
  std::string task;       // capabilities["task"]
  int attempts = 4;       // tries of a call that fails transiently
  double max_backoff_s = 2.0;
  double call_timeout_s = 30.0;  // every call but the long poll
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;
};

struct Task {
  std::string run_id, task_id, model_hash, config_json;
  int64_t round = 0, model_bytes = 0;
  int32_t attempt = 0;
  std::vector<TensorSpec> schema;
  double deadline_unix = 0;
  uint64_t shared_seed = 0;
};

struct Poll {
  bool has_task = false;
  Task task;
  double retry_after_s = 0;
  std::string reason;
};

struct UploadHeader {
  std::string node_id, run_id, task_id, codec, payload_sha256;
  int64_t round = 0;
  int32_t attempt = 0;
  std::vector<TensorSpec> schema;
  std::vector<int64_t> payload_sizes;
  double weight = 0;
  int64_t num_examples = 0, num_steps = 0;
  std::map<std::string, double> metric_sums, metric_weights;
};

struct SecAggReply {
  int stage = 0;
  Bytes broadcast;
  bool done = false;
  std::string aborted;
};

// A model blob a node holds: the global model `model_hash` names, exact (sha256 ==
// model_hash) or rebuilt from a downlink delta (sha256: the reconstruction's, which is
// what the node offers as its base next time).
struct HeldModel {
  std::string model_hash;
  Bytes blob;
  std::string sha256;
};

class Link {
 public:
  explicit Link(LinkOptions options);
  ~Link();

  void join(const DeviceState& device);
  Poll poll(const DeviceState& device, double wait_s);
  bool heartbeat(const std::string& task_id, const DeviceState& device, double progress);
  // The model for `model_hash`: `held` itself when it is that model; else, when a model
  // is held, a downlink delta from it if the server sends one (checked against the
  // hashes the server states; a delta that fails any check is dropped and the full
  // model pulled); else the full model. Streams resume at the byte they broke at.
  HeldModel pull_model(const std::string& model_hash, const HeldModel* held);
  void push_update(const UploadHeader& header, const Bytes& payload);
  SecAggReply secagg(const Task& t, int stage, const Bytes& message, const UploadHeader* header, double wait_s);

  void cancel();  // thread-safe
  bool cancelled() const { return cancelled_.load(); }

  const std::string& node_id() const { return node_id_; }
  const NodeIdentity* identity() const { return options_.identity; }
  double heartbeat_s() const { return heartbeat_s_; }
  double long_poll_s() const { return long_poll_s_; }
  int64_t max_chunk_bytes() const { return max_chunk_bytes_; }
  int64_t bytes_down() const { return bytes_down_; }
  int64_t bytes_up() const { return bytes_up_; }
  // Why the last downlink delta was dropped for the full model ("" if none was).
  const std::string& last_delta_refusal() const { return last_delta_refusal_; }

 private:
  void join_once(const DeviceState& device, bool enrolling);
  struct Stream;
  Stream stream_model(const std::string& model_hash, const std::string& have_hash);

  struct Impl;
  std::unique_ptr<Impl> impl_;
  LinkOptions options_;
  std::string node_id_;
  std::string last_delta_refusal_;
  std::string secret_;  // the bearer secret: the credential once enrolled, else the token
  double heartbeat_s_ = 10.0, long_poll_s_ = 20.0;
  int64_t max_chunk_bytes_ = 4 << 20;
  int64_t bytes_down_ = 0, bytes_up_ = 0;
  std::atomic<bool> cancelled_{false};
};

}  // namespace orchard
