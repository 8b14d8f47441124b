// Codec bytes against the Python encoder (device_vectors.py: numpy_random.json, codec.json).
#include <cmath>
#include <cstring>

#include "check.h"
#include "codec.h"
#include "downlink.h"
#include "sha256.h"
#include "failure.h"
#include "numpy_random.h"
#include "vectors.h"

using orchard::CodecSpec;
using orchard::TensorRef;

TEST(seed_sequence_and_pcg64) {
  auto v = vectors::load("numpy_random.json");
  for (auto& c : v["cases"]) {
    std::vector<uint32_t> words = c["entropy_words"].get<std::vector<uint32_t>>();
    CHECK(orchard::seed_sequence_state(words, {}, 8) == c["state_words"].get<std::vector<uint32_t>>());
    orchard::Pcg64 raw(words);
    for (auto& want : c["next64"]) CHECK(raw.next64() == want.get<uint64_t>());
    orchard::Pcg64 rng(words);
    std::vector<float> want = vectors::floats(c["floats"]);
    for (float w : want) {
      float got = rng.next_float();
      CHECK(std::memcmp(&got, &w, 4) == 0);
    }
  }
  auto s = v["spawn"];
  CHECK(orchard::seed_sequence_state(orchard::int_words(s["entropy"]), s["key"].get<std::vector<uint32_t>>(), 2) ==
        s["state_words"].get<std::vector<uint32_t>>());
}

TEST(payloads_equal_the_python_encoder) {
  auto cases = vectors::load("codec.json");
  CHECK(cases.size() >= 8);
  for (auto& c : cases) {
    CodecSpec spec = CodecSpec::from_json(c["spec"]);
    std::vector<std::vector<float>> values;
    std::vector<TensorRef> refs;
    for (auto& t : c["tensors"]) values.push_back(vectors::floats(t["values"]));
    size_t i = 0;
    for (auto& t : c["tensors"]) {
      refs.push_back({t["name"], t["shape"].get<std::vector<uint32_t>>(), values[i++].data()});
    }
    auto enc = orchard::encode_update(spec, refs, c["seed"].get<uint64_t>());
    std::vector<uint8_t> want = vectors::unhex(c["payload"]);
    CHECK_MSG(enc.payload == want, c["spec"].dump() + ": " + vectors::first_difference(enc.payload, want));
    CHECK_MSG(enc.sizes == c["sizes"].get<std::vector<uint64_t>>(), c["spec"].dump());
  }
}

static orchard_status encode_status(const char* spec_json, std::vector<float> x) {
  try {
    CodecSpec spec = CodecSpec::from_json(nlohmann::json::parse(spec_json));
    orchard::encode_update(spec, {{"t", {static_cast<uint32_t>(x.size())}, x.data()}}, 1);
    return ORCHARD_OK;
  } catch (const orchard::Failure& f) {
    return f.code();
  }
}

TEST(refusals) {
  CHECK(encode_status(R"({"name": "float16"})", {70000.0f}) == ORCHARD_ERR_CODEC);
  CHECK(encode_status(R"({"name": "float16"})", {65519.0f}) == ORCHARD_OK);
  CHECK(encode_status(R"({"name": "float32"})", {NAN}) == ORCHARD_ERR_CODEC);
  CHECK(encode_status(R"({"name": "qsgd"})", {INFINITY}) == ORCHARD_ERR_CODEC);
  CHECK(encode_status(R"({"name": "topk"})", {1.0f}) == ORCHARD_ERR_CODEC);
  CHECK(encode_status(R"({"name": "qsgd", "params": {"bits": 3}})", {1.0f}) == ORCHARD_ERR_CODEC);
  CHECK(encode_status(R"({"name": "qsgd", "params": {"scale": -1}})", {1.0f}) == ORCHARD_ERR_CODEC);
  CHECK(encode_status(R"({"name": "qsgd", "params": {"rank": 1}})", {1.0f}) == ORCHARD_ERR_CODEC);
  CHECK(encode_status(R"({"name": "float32", "params": {"x": 1}})", {1.0f}) == ORCHARD_ERR_CODEC);
  CHECK(encode_status(R"([1])", {1.0f}) == ORCHARD_ERR_CODEC);
}

TEST(float16_rounds_to_nearest_even) {
  CHECK(orchard::float_to_half(1.0f) == 0x3c00);
  CHECK(orchard::float_to_half(-2.0f) == 0xc000);
  CHECK(orchard::float_to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);        // a tie, to even
  CHECK(orchard::float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);    // a tie, to even
  CHECK(orchard::float_to_half(std::ldexp(1.0f, -24)) == 0x0001);              // the least subnormal
  CHECK(orchard::float_to_half(std::ldexp(1.0f, -25)) == 0x0000);              // a tie, to even (zero)
  CHECK(orchard::float_to_half(65520.0f) == 0x7c00);
}

TEST(float_payloads_decode_to_their_values) {
  for (auto& c : vectors::load("codec.json")) {
    CodecSpec spec = CodecSpec::from_json(c["spec"]);
    if (spec.name != "float32") continue;
    std::vector<uint8_t> payload = vectors::unhex(c["payload"]);
    size_t at = 0, i = 0;
    for (auto& t : c["tensors"]) {
      const uint64_t size = c["sizes"][i++].get<uint64_t>();
      std::vector<float> got = orchard::decode_payload(spec, payload.data() + at, size,
                                                       t["shape"].get<std::vector<uint32_t>>(), t["name"]);
      CHECK(got == vectors::floats(t["values"]));
      at += size;
    }
  }
}

// A downlink delta applied to its base rebuilds, byte for byte, the model the Python
// tier says the node will hold (server/downlink.py).
TEST(downlink_deltas_rebuild_the_servers_result) {
  auto cases = vectors::load("downlink.json");
  CHECK(cases.size() >= 2);
  for (auto& c : cases) {
    const std::vector<uint8_t> base = vectors::unhex(c["base"]), delta = vectors::unhex(c["delta"]);
    const std::vector<uint8_t> got = orchard::apply_downlink_delta(base, delta, c["encoding"]);
    const std::vector<uint8_t> want = vectors::unhex(c["result"]);
    CHECK_MSG(got == want, vectors::first_difference(got, want));
    CHECK(orchard::sha256_hex(got.data(), got.size()) == c["result_sha256"].get<std::string>());
    // Damaged deltas are refused with a status, never read past.
    std::vector<uint8_t> cut(delta.begin(), delta.end() - 9);
    bool refused = false;
    try {
      orchard::apply_downlink_delta(base, cut, c["encoding"]);
    } catch (const orchard::Failure& f) {
      refused = f.code() == ORCHARD_ERR_PROTOCOL;
    }
    CHECK(refused);
  }
  // A delta against another base: it decodes, and the stated hash then catches it.
  const std::vector<uint8_t> other =
      orchard::apply_downlink_delta(vectors::unhex(cases[0]["result"]), vectors::unhex(cases[0]["delta"]),
                                    cases[0]["encoding"]);
  CHECK(orchard::sha256_hex(other.data(), other.size()) != cases[0]["result_sha256"].get<std::string>());
}

CHECK_MAIN()
