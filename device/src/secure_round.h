// A device's side of one task's SecAgg+ session over Fleet.SecAgg (client/secure.py,
// secure_session and masked_input): the key stages run before training (each long
// poll keeps the node alive at the tier), the masked input goes with the upload's
// header once the update is encoded, then the client answers until the tier has the
// cohort's sum. Only the masked form of the update leaves the device.
//
// The session is held to the device's own policy (secagg.h ClientPolicy): once enrolled
// (a certificate and the root's key kept by NodeIdentity) every neighbour's keys must be
// certified by that root and semi-honest sessions are refused; the device signs its
// keys and survivor view with its identity key.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dp_encoding.h"
#include "link.h"
#include "secagg.h"

namespace orchard {

// The run's [secure_aggregation] settings a client needs, from the task's config JSON.
struct SecureSettings {
  double clip = 1.0;
  int bits = 16;
  double weight_scale = 1000.0;
  int modulus_bits = 32;
  std::optional<PrivacySettings> privacy;  // set when the run adds DP (privacy.mode != "off")
  // Failure(ORCHARD_ERR_PROTOCOL) for settings that are not numbers or out of range.
  static SecureSettings from_config(const nlohmann::json& cfg);
};

// client/secure.masked_vector: the update's values as the codec carries them (its own
// payload decoded). Without DP: scaled by min(w, S) / S, clipped and rounded
// stochastically to `bits` bits with a generator seeded by `entropy` (unpredictable to
// everyone else). With DP: the encoding of session_params for the session's
// `participants` (dp_encoding.h), its rounding and noise drawn from `noise`.
std::vector<uint64_t> masked_vector(const SecureSettings& s, const std::vector<std::vector<float>>& values,
                                    double weight, size_t participants, const std::vector<uint32_t>& entropy,
                                    const WordSource& noise);

class SecureRound {
 public:
  // The session is given up on (ORCHARD_ERR_UNAVAILABLE) a minute past the task's
  // deadline, read on `wall` (unix seconds).
  SecureRound(Link& link, const Task& task, std::function<double()> wall);

  // Answer the key stages until the masked input is asked for. False (and why) when the
  // session ended first (aborted, or finished without this client).
  bool keys(std::string* why);
  // Post the masked input with its header, then answer until the session ends. False
  // (and why) when it aborted or this client's input was left out of the sum.
  bool finish(const UploadHeader& header, const std::vector<uint64_t>& vector, std::string* why);
  // The session's participants (known once it is set up): the DP encodings' n.
  size_t participants() const;

 private:
  bool answer(const std::vector<uint64_t>* vector, const UploadHeader* header, std::string* why);

  Link& link_;
  Task task_;
  std::function<double()> wall_;
  std::unique_ptr<SecAggClient> client_;
  SecAggReply reply_;
  bool polled_ = false;
  std::set<int> answered_;
  bool sent_input_ = false;
};

}  // namespace orchard
