#include "participate.h"

#include <cmath>

#include <openssl/rand.h>

#include "codec.h"
#include "failure.h"
#include "safetensors.h"
#include "secure_round.h"
#include "sha256.h"

namespace orchard {

namespace {

// The governor, with a heartbeat before a step whenever half the heartbeat interval
// has passed; a server that no longer wants the task stops the training.
class HeartbeatGate : public StepGate {
 public:
  HeartbeatGate(Governor& gov, Link& link, const std::string& task_id, DeviceIO& io, int64_t planned)
      : gov_(gov), link_(link), task_id_(task_id), io_(io), planned_(planned), last_(io.monotonic()) {}
  bool before_step() override {
    if (io_.monotonic() - last_ >= link_.heartbeat_s() / 2) {
      last_ = io_.monotonic();
      if (!link_.heartbeat(task_id_, io_.read(), planned_ > 0 ? static_cast<double>(done_) / planned_ : 0.0)) {
        unwanted_ = true;
        return false;
      }
    }
    return gov_.before_step();
  }
  void after_step(double units) override {
    ++done_;
    gov_.after_step(units);
  }
  bool unwanted() const { return unwanted_; }

 private:
  Governor& gov_;
  Link& link_;
  std::string task_id_;
  DeviceIO& io_;
  int64_t planned_, done_ = 0;
  double last_;
  bool unwanted_ = false;
};

std::string shape_text(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string weighting_of(const nlohmann::json& cfg) {
  const nlohmann::json cohort = cfg.value("cohort", nlohmann::json::object());
  return cohort.is_object() ? cohort.value("weighting", std::string("examples")) : "examples";
}

}  // namespace

RoundReport participate(Participant& p, double max_wait_s) {
  const double until = p.io.monotonic() + max_wait_s;
  Poll got;
  std::string waiting;
  while (true) {
    const double left = until - p.io.monotonic();
    if (left <= 0)
      throw Failure(ORCHARD_ERR_NO_TASK, "no task within " + std::to_string(max_wait_s) + " s" +
                                             (waiting.empty() ? "" : " (" + waiting + ")"));
    const DeviceState state = p.io.read();
    Eligibility e = evaluate(state, p.policy, p.io.wall());
    if (!e.eligible) {
      waiting.clear();
      for (auto& r : e.reasons) waiting += (waiting.empty() ? "" : "; ") + r.code + ": " + r.message;
      p.io.sleep(std::min(left, 5.0));
      continue;
    }
    got = p.link.poll(state, left);
    if (got.has_task) break;
    waiting = "server idle: " + got.reason;
    if (got.retry_after_s > 0) p.io.sleep(std::min(got.retry_after_s, std::max(0.0, until - p.io.monotonic())));
  }
  const Task& t = got.task;
  RoundReport report;
  report.round = t.round;
  const nlohmann::json cfg = nlohmann::json::parse(t.config_json, nullptr, false);
  if (cfg.is_discarded() || !cfg.is_object()) throw Failure(ORCHARD_ERR_PROTOCOL, "the task's config_json is not JSON");
  const nlohmann::json sa = cfg.value("secure_aggregation", nlohmann::json::object());
  std::optional<SecureSettings> secure;
  if (sa.is_object() && sa.value("enabled", false)) secure = SecureSettings::from_config(cfg);
  const std::string weighting = weighting_of(cfg);
  if (weighting == "fednova")
    throw Failure(ORCHARD_ERR_REFUSED, "cohort.weighting = fednova is not supported by the native client");
  if (cfg.value("task", std::string()) != p.bundle.manifest.task)
    throw Failure(ORCHARD_ERR_REFUSED, "the run trains task '" + cfg.value("task", std::string()) +
                                           "', the bundle's training program is for '" + p.bundle.manifest.task + "'");
  const CodecSpec codec = CodecSpec::from_json(cfg.value("codec", nlohmann::json::object()));
  // Under secure aggregation the key stages run first (client/secure.py runs them while
  // training; here the long polls of the stages keep the node alive meanwhile).
  std::unique_ptr<SecureRound> session;
  if (secure) {
    session = std::make_unique<SecureRound>(p.link, t, [&p] { return p.io.wall(); });
    std::string why;
    if (!session->keys(&why)) {
      report.reason = why;
      return report;
    }
  }
  // The global model (or its reconstruction from a downlink delta, from which the
  // update is then taken: client/update.delta_of), kept as the next pull's base.
  HeldModel pulled = p.link.pull_model(t.model_hash, p.held);
  if (p.held != nullptr) *p.held = std::move(pulled);
  const HeldModel& model = p.held != nullptr ? *p.held : pulled;
  const auto tensors = parse_safetensors(model.blob.data(), model.blob.size(), "the model blob", ORCHARD_ERR_PROTOCOL);
  // The schema must describe the model the server sent and the tensors the program
  // trains, shape for shape: the update is laid out by it.
  std::map<std::string, std::vector<uint64_t>> trained;
  for (const TensorDecl& d : p.program.manifest().parameters) trained[d.name] = d.shape;
  std::map<std::string, std::vector<float>> global;
  for (const TensorSpec& s : t.schema) {
    auto it = tensors.find(s.name);
    if (it == tensors.end())
      throw Failure(ORCHARD_ERR_PROTOCOL, "the task's schema names '" + s.name + "', which the model blob lacks");
    const std::vector<uint64_t> want(s.shape.begin(), s.shape.end());
    const std::vector<uint64_t> held(it->second.shape.begin(), it->second.shape.end());
    if (want != held)
      throw Failure(ORCHARD_ERR_PROTOCOL, "the task's schema gives tensor '" + s.name + "' shape " + shape_text(want) +
                                              ", the model blob holds " + shape_text(held));
    auto p_it = trained.find(s.name);
    if (p_it == trained.end())
      throw Failure(ORCHARD_ERR_REFUSED, "the task's schema names tensor '" + s.name + "', which the bundle's "
                                         "training program does not train: the run is of another model; re-create "
                                         "the bundle for this run");
    if (p_it->second != want)
      throw Failure(ORCHARD_ERR_REFUSED, "the task's schema gives tensor '" + s.name + "' shape " + shape_text(want) +
                                             ", the bundle's training program trains " + shape_text(p_it->second) +
                                             ": re-create the bundle for this run");
    global[s.name] = it->second.values;
  }
  TrainConfig train_cfg = TrainConfig::from_json(cfg);
  // client/update.train_seed: per (run seed, round, partition), in [0, 2**31 - 1).
  const uint64_t run_seed = cfg.value("seed", static_cast<uint64_t>(0));
  const uint64_t seed = derive_seed({run_seed, static_cast<uint64_t>(t.round), static_cast<uint64_t>(p.partition_id)}, 31) %
                        ((1ull << 31) - 1);
  train_cfg.seed = seed;
  Governor gov(p.io, p.policy);
  const int64_t steps_per_epoch = static_cast<int64_t>((p.data.rows + static_cast<size_t>(train_cfg.batch_size) - 1) /
                                                       static_cast<size_t>(std::max<int64_t>(train_cfg.batch_size, 1)));
  HeartbeatGate gate(gov, p.link, t.task_id, p.io, train_cfg.steps ? *train_cfg.steps : train_cfg.epochs * steps_per_epoch);
  TrainResult r = train(p.program, p.data, global, train_cfg, p.trainer_seed, &gate);
  GovernorReport g = gov.report();
  report.stop = g.stop_reason;
  report.num_steps = r.num_steps;
  if (gate.unwanted()) {
    report.reason = "the server no longer wants this task (the round closed)";
    return report;
  }
  if (r.num_steps == 0) {
    report.reason = std::string("no step done (") + stop_reason_name(g.stop_reason) + ": " + g.detail + ")";
    return report;
  }
  // The delta local - global of every schema tensor, encoded with the run's codec.
  std::vector<std::vector<float>> deltas;
  std::vector<TensorRef> refs;
  for (const TensorSpec& s : t.schema) {
    const std::vector<float>& local = r.arrays.at(s.name);
    const std::vector<float>& base = global.at(s.name);
    std::vector<float> d(local.size());
    for (size_t k = 0; k < d.size(); ++k) d[k] = local[k] - base[k];
    deltas.push_back(std::move(d));
    std::vector<uint32_t> shape;
    for (int64_t x : s.shape) shape.push_back(static_cast<uint32_t>(x));
    refs.push_back({s.name, shape, deltas.back().data()});
  }
  const EncodedUpdate enc = encode_update(codec, refs, seed);
  UploadHeader h;
  h.node_id = p.link.node_id();
  h.run_id = t.run_id;
  h.round = t.round;
  h.attempt = t.attempt;
  h.task_id = t.task_id;
  h.schema = t.schema;
  for (uint64_t s : enc.sizes) h.payload_sizes.push_back(static_cast<int64_t>(s));
  h.codec = cfg.value("codec", nlohmann::json::object()).value("name", std::string("float32"));
  h.payload_sha256 = sha256_hex(enc.payload.data(), enc.payload.size());
  h.weight = weighting == "steps" ? static_cast<double>(r.num_steps) : weighting == "uniform" ? 1.0 : r.weight;
  h.num_examples = r.num_examples;
  h.num_steps = r.num_steps;
  // Metrics as sums weighted by examples (client/update.upload_header), finite ones only.
  const double m = static_cast<double>(std::max<int64_t>(r.num_examples, 1));
  std::map<std::string, double> metrics{{"train_loss", r.train_loss}, {"train_accuracy", r.train_accuracy},
                                        {"governor_steps", static_cast<double>(g.steps_done)},
                                        {"governor_elapsed_s", g.elapsed_s}, {"governor_paused_s", g.paused_s},
                                        {"governor_duty", g.duty()},
                                        {"governor_stopped_early", g.stopped_early() ? 1.0 : 0.0}};
  if (g.energy_j) metrics["governor_energy_j"] = *g.energy_j;
  if (g.max_temperature_c) metrics["governor_max_temperature_c"] = *g.max_temperature_c;
  for (auto& [k, v] : metrics) {
    if (!std::isfinite(v)) continue;
    h.metric_sums[k] = v * m;
    h.metric_weights[k] = m;
  }
  if (session) {
    // Only the masked form leaves the device: the values the codec carries (its own
    // payload decoded, as the tier would), weighted and quantised (client/secure.py).
    std::vector<std::vector<float>> values;
    size_t at = 0;
    for (size_t i = 0; i < refs.size(); ++i) {
      values.push_back(decode_payload(codec, enc.payload.data() + at, enc.sizes[i], refs[i].shape, refs[i].name));
      at += enc.sizes[i];
    }
    std::vector<uint32_t> entropy(4);
    if (RAND_bytes(reinterpret_cast<unsigned char*>(entropy.data()), 16) != 1)
      throw Failure(ORCHARD_ERR_INTERNAL, "OpenSSL: RAND_bytes failed");
    std::string why;
    if (!session->finish(h, masked_vector(*secure, values, h.weight, session->participants(), entropy, os_words()),
                         &why)) {
      report.reason = why;
      return report;
    }
  } else {
    p.link.push_update(h, Bytes(enc.payload.begin(), enc.payload.end()));
  }
  report.uploaded = true;
  report.num_examples = r.num_examples;
  report.weight = h.weight;
  report.train_loss = r.train_loss;
  return report;
}

}  // namespace orchard
