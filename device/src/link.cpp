#include "link.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "downlink.h"
#include "failure.h"
#include "orchard/v1/orchard.grpc.pb.h"
#include "sha256.h"

namespace pb = orchard::v1;

namespace orchard {

namespace {

constexpr const char* kJoinFirst = "call Join first";  // orchard.errors.JOIN_FIRST
constexpr int kMaxRejoins = 3;
constexpr int64_t kMaxChunk = 4 << 20;  // orchard.wire.MAX_CHUNK_BYTES

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool transient(grpc::StatusCode c) {
  // CANCELLED too, as the Python link has it: a server that stops cancels its calls.
  return c == grpc::UNAVAILABLE || c == grpc::DEADLINE_EXCEEDED || c == grpc::RESOURCE_EXHAUSTED ||
         c == grpc::INTERNAL || c == grpc::UNKNOWN || c == grpc::CANCELLED;
}

// The ABI status and message of a failed call.
[[noreturn]] void fail(const char* what, const grpc::Status& st, bool cancelled) {
  const std::string details = st.error_message();
  const std::string where = std::string(what) + ": ";
  if (cancelled) throw Failure(ORCHARD_ERR_CANCELLED, where + "cancelled");
  switch (st.error_code()) {
    case grpc::CANCELLED:  // not by the app (that is `cancelled`): the server ended the call
      throw Failure(ORCHARD_ERR_UNAVAILABLE, where + "the server is unreachable or stopped answering: it ended the "
                                                     "call (" + details + ")");
    case grpc::UNAUTHENTICATED:
    case grpc::PERMISSION_DENIED:
      throw Failure(ORCHARD_ERR_AUTH, where + "the server refused the credential: " + details +
                                          " (a revoked or unknown enrollment token? ask for a new bundle)");
    case grpc::UNAVAILABLE:
    case grpc::DEADLINE_EXCEEDED: {
      const std::string l = lower(details);
      if (l.find("ssl") != std::string::npos || l.find("handshake") != std::string::npos ||
          l.find("certificate") != std::string::npos || l.find("tls") != std::string::npos)
        throw Failure(ORCHARD_ERR_TLS, where + "the TLS handshake failed: " + details +
                                           " (the server's certificate is not signed by the bundle's ca.pem?)");
      throw Failure(ORCHARD_ERR_UNAVAILABLE, where + "the server is unreachable or stopped answering: " + details);
    }
    default:
      throw Failure(ORCHARD_ERR_REFUSED, where + "the server said " + std::to_string(st.error_code()) + ": " + details);
  }
}

void device_to_proto(const DeviceState& d, pb::DeviceState* m) {
  if (d.battery_percent) m->set_battery_percent(*d.battery_percent);
  if (d.charging) m->set_charging(*d.charging);
  if (d.temperature_c) m->set_temperature_c(*d.temperature_c);
  if (d.unmetered_network) m->set_unmetered_network(*d.unmetered_network);
  if (d.idle) m->set_idle(*d.idle);
  if (d.energy_j) (*m->mutable_extra())["energy_j"] = *d.energy_j;
}

void specs_to_proto(const std::vector<TensorSpec>& specs, google::protobuf::RepeatedPtrField<pb::TensorSpec>* out) {
  for (const TensorSpec& s : specs) {
    pb::TensorSpec* m = out->Add();
    m->set_name(s.name);
    for (int64_t d : s.shape) m->add_shape(d);
    m->set_dtype(s.dtype);
  }
}

void header_to_proto(const UploadHeader& h, pb::UploadHeader* m) {
  m->set_node_id(h.node_id);
  m->set_run_id(h.run_id);
  m->set_round(h.round);
  m->set_attempt(h.attempt);
  m->set_task_id(h.task_id);
  m->set_kind(pb::UploadHeader::CLIENT_UPDATE);
  specs_to_proto(h.schema, m->mutable_schema());
  for (int64_t s : h.payload_sizes) m->add_payload_sizes(s);
  m->set_codec(h.codec);
  m->set_payload_sha256(h.payload_sha256);
  m->set_weight(h.weight);
  m->set_count(1);
  m->set_num_examples(h.num_examples);
  m->set_num_steps(h.num_steps);
  for (auto& [k, v] : h.metric_sums) (*m->mutable_metric_sums())[k] = v;
  for (auto& [k, v] : h.metric_weights) (*m->mutable_metric_weights())[k] = v;
}

}  // namespace

struct Link::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Fleet::Stub> stub;
  std::mutex mu;                       // guards `current`
  grpc::ClientContext* current = nullptr;
  std::mt19937_64 jitter{std::random_device{}()};

  // A context for one call: credentials, deadline, registered for cancel().
  struct Call {
    Impl& impl;
    grpc::ClientContext ctx;
    Call(Impl& i, const std::string& secret, double timeout_s) : impl(i) {
      if (!secret.empty()) ctx.AddMetadata("authorization", "Bearer " + secret);
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
      std::lock_guard<std::mutex> g(impl.mu);
      impl.current = &ctx;
    }
    ~Call() {
      std::lock_guard<std::mutex> g(impl.mu);
      impl.current = nullptr;
    }
  };
};

Link::Link(LinkOptions options) : impl_(new Impl), options_(std::move(options)), node_id_(options_.node_id) {
  if (options_.identity == nullptr) throw Failure(ORCHARD_ERR_INTERNAL, "a link needs the device's identity");
  const auto& held = options_.identity->enrolled();
  if (held && !options_.node_id.empty() && options_.node_id != held->node_id)
    throw Failure(ORCHARD_ERR_ARGUMENT, options_.identity->directory() + " holds node '" + held->node_id +
                                            "''s identity, not '" + options_.node_id +
                                            "''s: drop the node_id option or use another data dir");
  if (held) node_id_ = held->node_id;
  secret_ = held ? held->credential : options_.token;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxChunk + (64 << 10)));
  args.SetMaxSendMessageSize(static_cast<int>(kMaxChunk + (64 << 10)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options_.ca_pem.empty()) {
    if (!options_.insecure)
      throw Failure(ORCHARD_ERR_BUNDLE, "TLS needs the bundle's CA certificate (ca.pem); the bundle names none");
    creds = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options_.ca_pem;
    creds = grpc::SslCredentials(ssl);
  }
  impl_->channel = grpc::CreateCustomChannel(options_.target, creds, args);
  impl_->stub = pb::Fleet::NewStub(impl_->channel);
}

Link::~Link() = default;

void Link::cancel() {
  cancelled_.store(true);
  std::lock_guard<std::mutex> g(impl_->mu);
  if (impl_->current != nullptr) impl_->current->TryCancel();
}

namespace {

// Call `fn` (which returns a Status) until it succeeds or fails for good.
template <typename F>
void retry(Link& link, const LinkOptions& o, std::mt19937_64& jitter, const char* what, F&& fn,
           const std::function<void()>& rejoin) {
  double delay = 0.2;
  int rejoins = 0;
  for (int n = 1;; ++n) {
    if (link.cancelled()) throw Failure(ORCHARD_ERR_CANCELLED, std::string(what) + ": cancelled");
    grpc::Status st = fn();
    if (st.ok()) return;
    if (st.error_code() == grpc::NOT_FOUND && rejoin &&
        st.error_message().size() >= std::strlen(kJoinFirst) &&
        st.error_message().compare(st.error_message().size() - std::strlen(kJoinFirst), std::string::npos,
                                   kJoinFirst) == 0) {
      if (++rejoins > kMaxRejoins) fail(what, st, false);
      rejoin();
      continue;
    }
    if (!transient(st.error_code()) || n >= o.attempts || link.cancelled()) fail(what, st, link.cancelled());
    // Backoff with jitter, in slices so a cancel is seen at once.
    const double wait = delay * (0.5 + std::uniform_real_distribution<double>(0, 1)(jitter));
    for (double slept = 0; slept < wait && !link.cancelled(); slept += 0.05)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    delay = std::min(delay * 2, o.max_backoff_s);
  }
}

}  // namespace

void Link::join(const DeviceState& device) {
  try {
    join_once(device, false);
  } catch (const Failure& f) {
    const auto held = options_.identity->enrolled();
    if (f.code() != ORCHARD_ERR_AUTH || !held || options_.token.empty() || options_.token == held->credential) throw;
    // The credential kept was refused (revoked): the bundle's token enrolls the device
    // again. The credential is kept until a new one replaces it.
    secret_ = options_.token;
    try {
      join_once(device, true);
    } catch (...) {
      secret_ = held->credential;
      throw;
    }
  }
}

void Link::join_once(const DeviceState& device, bool enrolling) {
  NodeIdentity& id = *options_.identity;
  pb::JoinRequest req;
  req.set_node_id(node_id_);
  req.set_role("client");
  device_to_proto(device, req.mutable_device());
  if (!options_.task.empty()) (*req.mutable_capabilities())["task"] = options_.task;
  (*req.mutable_capabilities())["trainer"] = "executorch-native";
  req.set_device_public_key(std::string(id.public_key().begin(), id.public_key().end()));
  if ((enrolling || !id.enrolled()) && !secret_.empty()) {
    const Bytes proof = id.sign(enrollment_message("client", node_id_, secret_));
    req.set_key_proof(std::string(proof.begin(), proof.end()));
  }
  pb::JoinReply reply;
  retry(*this, options_, impl_->jitter, "join", [&] {
    Impl::Call call(*impl_, secret_, options_.call_timeout_s);
    return impl_->stub->Join(&call.ctx, req, &reply);
  }, nullptr);
  const Bytes root_key(reply.root_public_key().begin(), reply.root_public_key().end());
  if (!options_.root_public_key.empty() && !root_key.empty() && root_key != options_.root_public_key)
    throw Failure(ORCHARD_ERR_AUTH, "join: the server answered with another root key than the bundle names: "
                                    "another federation, or an impostor");
  const Bytes cert(reply.certificate().begin(), reply.certificate().end());
  if (!reply.credential().empty()) {
    // Kept (on disk, with a data dir) before it is used: a device never holds a
    // credential it could lose by stopping.
    id.save(Enrolled{reply.node_id(), reply.credential(), cert, root_key});
    secret_ = reply.credential();
  } else if (!cert.empty()) {
    id.refresh(cert, root_key);
  }
  node_id_ = reply.node_id();
  if (reply.heartbeat_s() > 0) heartbeat_s_ = reply.heartbeat_s();
  if (reply.long_poll_s() > 0) long_poll_s_ = reply.long_poll_s();
  if (reply.max_chunk_bytes() > 0) max_chunk_bytes_ = std::min<int64_t>(reply.max_chunk_bytes(), kMaxChunk);
}

Poll Link::poll(const DeviceState& device, double wait_s) {
  const double wait = std::max(0.0, std::min(wait_s, long_poll_s_));
  pb::PollReply reply;
  retry(*this, options_, impl_->jitter, "poll", [&] {
    pb::PollRequest req;
    req.set_node_id(node_id_);
    device_to_proto(device, req.mutable_device());
    req.set_wait_s(wait);
    Impl::Call call(*impl_, secret_, wait + 15);
    return impl_->stub->Poll(&call.ctx, req, &reply);
  }, [&] { join(device); });
  Poll out;
  if (reply.has_task()) {
    const pb::TaskSpec& m = reply.task();
    out.has_task = true;
    Task& t = out.task;
    t.run_id = m.run_id();
    t.round = m.round();
    t.attempt = m.attempt();
    t.task_id = m.task_id();
    t.model_hash = m.model_hash();
    t.model_bytes = m.model_bytes();
    t.config_json = m.config_json();
    for (auto& s : m.schema()) t.schema.push_back({s.name(), {s.shape().begin(), s.shape().end()}, s.dtype()});
    t.deadline_unix = m.deadline_unix();
    t.shared_seed = m.shared_seed();
  } else {
    out.retry_after_s = reply.idle().retry_after_s();
    out.reason = reply.idle().reason();
  }
  return out;
}

bool Link::heartbeat(const std::string& task_id, const DeviceState& device, double progress) {
  pb::HeartbeatRequest req;
  req.set_node_id(node_id_);
  device_to_proto(device, req.mutable_device());
  req.set_task_id(task_id);
  req.set_progress(progress);
  pb::HeartbeatReply reply;
  Impl::Call call(*impl_, secret_, 10.0);
  grpc::Status st = impl_->stub->Heartbeat(&call.ctx, req, &reply);
  if (!st.ok()) {
    if (cancelled_.load()) throw Failure(ORCHARD_ERR_CANCELLED, "heartbeat: cancelled");
    if (st.error_code() == grpc::UNAUTHENTICATED) fail("heartbeat", st, false);
    return true;  // keep working; the upload will tell (as the Python link does)
  }
  return reply.task_still_wanted();
}

// One PullModel reply, resumed after breaks: its bytes and its first chunk's header.
struct Link::Stream {
  Bytes blob;
  std::string blob_sha, delta_from, target_hash, result_sha, encoding;
};

Link::Stream Link::stream_model(const std::string& model_hash, const std::string& have_hash) {
  Stream s;
  int64_t total = -1;
  bool head = false;
  retry(*this, options_, impl_->jitter, "pull model", [&] {
    pb::PullModelRequest req;
    req.set_node_id(node_id_);
    req.set_model_hash(model_hash);
    req.set_have_hash(have_hash);
    req.set_offset(static_cast<int64_t>(s.blob.size()));  // resume where the last try broke
    Impl::Call call(*impl_, secret_, options_.call_timeout_s * 4);
    auto reader = impl_->stub->PullModel(&call.ctx, req);
    pb::Chunk ch;
    while (reader->Read(&ch)) {
      if (ch.offset() != static_cast<int64_t>(s.blob.size()))
        throw Failure(ORCHARD_ERR_PROTOCOL, "pull model: a chunk at offset " + std::to_string(ch.offset()) +
                                                ", expected " + std::to_string(s.blob.size()));
      if (!head) {
        head = true;
        s.blob_sha = ch.blob_sha256();
        s.delta_from = ch.delta_from();
        s.target_hash = ch.target_hash();
        s.result_sha = ch.result_sha256();
        s.encoding = ch.encoding();
      } else if (ch.blob_sha256() != s.blob_sha) {
        // A resumed stream must continue the same blob (the server changed its answer).
        throw Failure(ORCHARD_ERR_PROTOCOL, "pull model: the stream changed blobs while resuming");
      }
      s.blob.insert(s.blob.end(), ch.data().begin(), ch.data().end());
      bytes_down_ += static_cast<int64_t>(ch.data().size());
      total = ch.total_bytes();
    }
    return reader->Finish();
  }, nullptr);
  if (total >= 0 && static_cast<int64_t>(s.blob.size()) != total)
    throw Failure(ORCHARD_ERR_PROTOCOL, "pull model: the stream ended after " + std::to_string(s.blob.size()) + " of " +
                                            std::to_string(total) + " bytes");
  return s;
}

HeldModel Link::pull_model(const std::string& model_hash, const HeldModel* held) {
  if (held != nullptr && held->model_hash == model_hash) return *held;
  if (held != nullptr && !held->blob.empty()) {
    try {
      Stream s = stream_model(model_hash, held->sha256);
      const std::string got = sha256_hex(s.blob.data(), s.blob.size());
      if (s.delta_from.empty()) {  // the server chose the full model
        if (got != model_hash)
          throw Failure(ORCHARD_ERR_PROTOCOL, "pull model: the model blob does not match its sha256");
        return {model_hash, std::move(s.blob), model_hash};
      }
      if (s.delta_from != held->sha256 || s.target_hash != model_hash)
        throw Failure(ORCHARD_ERR_PROTOCOL, "pull model: a delta from " + s.delta_from.substr(0, 12) + " to " +
                                                s.target_hash.substr(0, 12) + ", asked from " +
                                                held->sha256.substr(0, 12) + " to " + model_hash.substr(0, 12));
      if (got != s.blob_sha) throw Failure(ORCHARD_ERR_PROTOCOL, "pull model: the delta does not match its sha256");
      Bytes result = apply_downlink_delta(held->blob, s.blob, s.encoding);
      if (sha256_hex(result.data(), result.size()) != s.result_sha)
        throw Failure(ORCHARD_ERR_PROTOCOL, "pull model: the model rebuilt from the delta does not match the hash "
                                            "the server stated");
      return {model_hash, std::move(result), s.result_sha};
    } catch (const Failure& f) {
      // Only a delta that fails its checks falls back; a lost server or a cancel does not.
      if (f.code() != ORCHARD_ERR_PROTOCOL) throw;
      last_delta_refusal_ = f.what();
    }
  }
  Stream s = stream_model(model_hash, "");
  if (!s.delta_from.empty())
    throw Failure(ORCHARD_ERR_PROTOCOL, "pull model: the server sent a delta to a pull that offered no base");
  if (sha256_hex(s.blob.data(), s.blob.size()) != model_hash)
    throw Failure(ORCHARD_ERR_PROTOCOL, "pull model: the model blob does not match its sha256 " + model_hash +
                                            "; refusing it");
  return {model_hash, std::move(s.blob), model_hash};
}

void Link::push_update(const UploadHeader& header, const Bytes& payload) {
  retry(*this, options_, impl_->jitter, "push update", [&] {
    pb::UploadReply reply;
    Impl::Call call(*impl_, secret_, options_.call_timeout_s * 4);
    auto writer = impl_->stub->PushUpdate(&call.ctx, &reply);
    pb::UploadPart part;
    header_to_proto(header, part.mutable_header());
    bool ok = writer->Write(part);
    const size_t chunk = static_cast<size_t>(max_chunk_bytes_);
    for (size_t at = 0; ok && at < payload.size(); at += chunk) {
      pb::UploadPart data;
      data.set_data(reinterpret_cast<const char*>(payload.data()) + at, std::min(chunk, payload.size() - at));
      ok = writer->Write(data);
    }
    writer->WritesDone();
    grpc::Status st = writer->Finish();
    if (st.ok()) bytes_up_ += static_cast<int64_t>(payload.size());
    if (st.ok() && !reply.accepted())
      throw Failure(ORCHARD_ERR_REFUSED, "push update: the server refused the update: " + reply.reason());
    return st;
  }, nullptr);
}

SecAggReply Link::secagg(const Task& t, int stage, const Bytes& message, const UploadHeader* header, double wait_s) {
  pb::SecAggReply reply;
  retry(*this, options_, impl_->jitter, "secure aggregation", [&] {
    pb::SecAggRequest req;
    req.set_node_id(node_id_);
    req.set_run_id(t.run_id);
    req.set_round(t.round);
    req.set_attempt(t.attempt);
    req.set_task_id(t.task_id);
    req.set_stage(stage);
    req.set_message(std::string(message.begin(), message.end()));
    req.set_wait_s(wait_s);
    if (header != nullptr) header_to_proto(*header, req.mutable_header());
    Impl::Call call(*impl_, secret_, wait_s + 15);
    return impl_->stub->SecAgg(&call.ctx, req, &reply);
  }, nullptr);
  bytes_up_ += static_cast<int64_t>(message.size());
  bytes_down_ += static_cast<int64_t>(reply.broadcast().size());
  SecAggReply out;
  out.stage = reply.stage();
  out.broadcast.assign(reply.broadcast().begin(), reply.broadcast().end());
  out.done = reply.done();
  out.aborted = reply.aborted();
  return out;
}

}  // namespace orchard
