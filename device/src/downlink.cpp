#include "downlink.h"

#include <nlohmann/json.hpp>

#include "codec.h"
#include "failure.h"
#include "safetensors.h"

namespace orchard {

Bytes apply_downlink_delta(const Bytes& base_blob, const Bytes& delta_blob, const std::string& encoding) {
  const nlohmann::json j = nlohmann::json::parse(encoding, nullptr, false);
  if (j.is_discarded()) throw Failure(ORCHARD_ERR_PROTOCOL, "model delta: its encoding is not JSON: " + encoding);
  CodecSpec spec;
  try {
    spec = CodecSpec::from_json(j);
  } catch (const Failure& f) {
    throw Failure(ORCHARD_ERR_PROTOCOL, std::string("model delta: ") + f.what());
  }
  std::map<std::string, Tensor> model =
      parse_safetensors(base_blob.data(), base_blob.size(), "the model held", ORCHARD_ERR_PROTOCOL);
  const auto payloads = parse_safetensors_u8(delta_blob.data(), delta_blob.size(), "the model delta", ORCHARD_ERR_PROTOCOL);
  if (payloads.size() != model.size())
    throw Failure(ORCHARD_ERR_PROTOCOL, "model delta: " + std::to_string(payloads.size()) + " tensors for a model of " +
                                            std::to_string(model.size()));
  for (auto& [name, t] : model) {
    auto it = payloads.find(name);
    if (it == payloads.end()) throw Failure(ORCHARD_ERR_PROTOCOL, "model delta: no payload for tensor '" + name + "'");
    const std::vector<float> d = decode_payload(spec, it->second.data(), it->second.size(), t.shape, name);
    for (size_t i = 0; i < d.size(); ++i) t.values[i] += d[i];  // float32, as numpy adds
  }
  return safetensors_blob(model);
}

}  // namespace orchard
