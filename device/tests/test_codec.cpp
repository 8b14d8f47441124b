// Codec bytes against the Python encoder (device_vectors.py: numpy_random.json, codec.json).
#include <cmath>
#include <cstring>

#include "check.h"
#include "codec.h"
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

CHECK_MAIN()
