#include "secure_round.h"

#include <algorithm>
#include <cmath>

#include <openssl/rand.h>

#include "failure.h"
#include "identity.h"

namespace orchard {

namespace {

// secure_agg/stages.py STAGE_ORDER.
constexpr int kMaskedInputStage = static_cast<int>(SecAggStage::masked_input);

Bytes os_bytes(size_t n) {
  Bytes out(n);
  if (RAND_bytes(out.data(), static_cast<int>(n)) != 1) throw Failure(ORCHARD_ERR_INTERNAL, "OpenSSL: RAND_bytes failed");
  return out;
}

}  // namespace

SecureSettings SecureSettings::from_config(const nlohmann::json& cfg) {
  const nlohmann::json sa = cfg.value("secure_aggregation", nlohmann::json::object());
  const nlohmann::json privacy = cfg.value("privacy", nlohmann::json::object());
  const nlohmann::json robust = cfg.value("robust", nlohmann::json::object());
  SecureSettings s;
  try {
    s.clip = sa.value("clip", 1.0);
    s.bits = sa.value("bits", 16);
    s.weight_scale = sa.value("weight_scale", 1000.0);
    s.modulus_bits = sa.value("modulus_bits", 32);
    const std::string mode = privacy.is_object() ? privacy.value("mode", std::string("off")) : std::string("off");
    if (mode != "off") {
      if (mode != "central" && mode != "dpftrl" && mode != "distributed")
        throw Failure(ORCHARD_ERR_PROTOCOL, "the task's privacy.mode '" + mode +
                                                "' is none of off, central, dpftrl, distributed");
      // RunConfig.clip_norm: the tighter of DP's clip norm and robust.norm_bound.
      PrivacySettings p;
      p.noised_at_root = mode != "distributed";
      p.clip_norm = privacy.value("clip_norm", 1.0);
      if (robust.is_object() && robust.contains("norm_bound") && !robust["norm_bound"].is_null())
        p.clip_norm = std::min(p.clip_norm, robust["norm_bound"].get<double>());
      if (privacy.contains("noise_multiplier") && !privacy["noise_multiplier"].is_null())
        p.noise_multiplier = privacy["noise_multiplier"].get<double>();
      p.dropout_rate = sa.value("dropout_rate", 0.1);
      p.modulus_bits = s.modulus_bits;
      if (!(p.clip_norm > 0) || !std::isfinite(p.clip_norm) || (p.noise_multiplier && !(*p.noise_multiplier > 0)) ||
          !(p.dropout_rate >= 0 && p.dropout_rate < 1))
        throw Failure(ORCHARD_ERR_PROTOCOL, "the task's privacy clip_norm, noise_multiplier or dropout_rate is out of range");
      s.privacy = p;
    }
  } catch (const nlohmann::json::exception&) {
    throw Failure(ORCHARD_ERR_PROTOCOL, "the task's secure_aggregation or privacy settings are not numbers");
  }
  if (!(s.clip > 0) || !std::isfinite(s.clip) || s.bits < 1 || s.bits > 32 || !(s.weight_scale > 0))
    throw Failure(ORCHARD_ERR_PROTOCOL, "the task's secure_aggregation clip, bits or weight_scale is out of range");
  // config.SecureAggregationConfig allows 16..62; words are 64 bits wide at most.
  if (s.modulus_bits < 1 || s.modulus_bits > 63)
    throw Failure(ORCHARD_ERR_PROTOCOL, "the task's secure_aggregation.modulus_bits " + std::to_string(s.modulus_bits) +
                                            " is outside 1..63");
  return s;
}

std::vector<uint64_t> masked_vector(const SecureSettings& s, const std::vector<std::vector<float>>& values,
                                    double weight, size_t participants, const std::vector<uint32_t>& entropy,
                                    const WordSource& noise) {
  std::vector<double> flat;
  if (s.privacy) {
    // DP: the decoded values themselves (no weighting), clipped and rounded so that what
    // the tier sums is bounded by the clip; with distributed DP, plus this client's
    // share of the noise, drawn from `noise` (the OS's CSPRNG: nobody may replay it).
    for (auto& v : values)
      for (float x : v) flat.push_back(static_cast<double>(x));
    const DdgParams p = session_params(*s.privacy, static_cast<int>(participants), static_cast<int64_t>(flat.size()));
    return ddg_encode(flat, p, noise);
  }
  // aggregation.prescale_factor: min(w, S) / S.
  const double factor = std::min(weight, s.weight_scale) / s.weight_scale;
  for (auto& v : values)
    for (float x : v) flat.push_back(static_cast<double>(x) * factor);
  const std::vector<uint32_t> q = secure_quantize(flat, s.clip, s.bits, entropy);
  return std::vector<uint64_t>(q.begin(), q.end());
}

SecureRound::SecureRound(Link& link, const Task& task, std::function<double()> wall)
    : link_(link), task_(task), wall_(std::move(wall)) {
  // client/secure.DeviceTrust.of: the device key, and once enrolled the root's
  // certificate of it and the root's key (then peers must be certified by that root).
  const NodeIdentity* id = link.identity();
  if (id == nullptr) throw Failure(ORCHARD_ERR_INTERNAL, "secure aggregation needs the device's identity");
  SecAggIdentity identity;
  identity.sign = [id](const Bytes& m) { return id->sign(m); };
  identity.credential = id->public_key();
  ClientPolicy policy;
  const auto& e = id->enrolled();
  if (e && !e->certificate.empty() && !e->root_public_key.empty()) {
    identity.credential = e->certificate;
    policy.root_public_key = e->root_public_key;
  }
  client_ = std::make_unique<SecAggClient>(link.node_id(), os_bytes(32), identity, policy);
}

size_t SecureRound::participants() const {
  return client_->config() ? client_->config()->participants.size() : 0;
}

bool SecureRound::answer(const std::vector<uint64_t>* vector, const UploadHeader* header, std::string* why) {
  const double give_up = task_.deadline_unix + 60;
  if (!polled_) {
    reply_ = link_.secagg(task_, 0, {}, nullptr, link_.long_poll_s());
    polled_ = true;
  }
  while (true) {
    if (!reply_.aborted.empty()) {
      *why = "the cohort's secure aggregation aborted: " + reply_.aborted;
      return false;
    }
    if (reply_.done) {
      if (sent_input_) return true;
      *why = "the cohort's sum was formed without this client's update (dropped from the session)";
      return false;
    }
    if (wall_() > give_up)
      throw Failure(ORCHARD_ERR_UNAVAILABLE, "the secure aggregation session of round " + std::to_string(task_.round) +
                                                 " did not end by a minute past the task's deadline");
    const int stage = reply_.stage;
    if (reply_.broadcast.empty() || answered_.count(stage)) {
      reply_ = link_.secagg(task_, 0, {}, nullptr, link_.long_poll_s());
      continue;
    }
    if (stage == kMaskedInputStage) {
      if (vector == nullptr) return true;  // the update must be ready first
      const Bytes message = client_->respond(reply_.broadcast, vector);
      answered_.insert(stage);
      sent_input_ = true;
      reply_ = link_.secagg(task_, stage, message, header, link_.long_poll_s());
      continue;
    }
    const Bytes message = client_->respond(reply_.broadcast);
    answered_.insert(stage);
    reply_ = link_.secagg(task_, stage, message, nullptr, link_.long_poll_s());
  }
}

bool SecureRound::keys(std::string* why) { return answer(nullptr, nullptr, why); }

bool SecureRound::finish(const UploadHeader& header, const std::vector<uint64_t>& vector, std::string* why) {
  return answer(&vector, &header, why);
}

}  // namespace orchard
