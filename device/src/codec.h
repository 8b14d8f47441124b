// Update codecs a device sends with (compression/casts.py, compression/quantize.py),
// in the self-describing payload of compression/wire.py. The bytes equal the Python
// encoder's for the same input and seed: float32 and float16 casts, and qsgd (the
// stochastic quantiser, 1/2/4/8 bits, per tensor, per block or with a fixed scale),
// whose rounding draws from numpy's Generator (numpy_random.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace orchard {

struct CodecSpec {
  std::string name = "float32";
  int bits = 8;               // qsgd
  uint64_t block = 0;         // qsgd: elements per scale; 0 = one scale per tensor
  bool fixed = false;         // qsgd: a fixed scale shared by every client
  float scale = 0.0f;

  // orchard.config.CodecSpec as JSON ({"name": ..., "params": {...}}). Throws Failure
  // (ORCHARD_ERR_CODEC) for a codec this library does not send, or bad params.
  static CodecSpec from_json(const nlohmann::json& j);
};

struct TensorRef {
  std::string name;
  std::vector<uint32_t> shape;
  const float* values = nullptr;  // numel(shape) elements, row-major
};

struct EncodedUpdate {
  std::vector<uint8_t> payload;    // every tensor's payload, joined in the given order
  std::vector<uint64_t> sizes;     // each tensor's payload size
};

uint64_t numel(const std::vector<uint32_t>& shape);

// compression.encode_packed(codec, arrays, names, upload_rng(seed)): one payload per
// tensor, in order, one random stream across them. Throws Failure (ORCHARD_ERR_CODEC)
// for a value the codec cannot carry (non-finite, beyond float16's range).
EncodedUpdate encode_update(const CodecSpec& spec, const std::vector<TensorRef>& tensors, uint64_t seed);

// compression.decode_update for one payload of the codecs above (one summand): the
// tensor's float32 values, in numpy's arithmetic (qsgd's dequantize computes in float64
// and rounds once). Throws Failure(ORCHARD_ERR_PROTOCOL) for a payload that is malformed,
// of another codec or params, or of another shape.
std::vector<float> decode_payload(const CodecSpec& spec, const uint8_t* data, size_t n,
                                  const std::vector<uint32_t>& shape, const std::string& name);

// IEEE binary16 bits of `f`, rounded to nearest even (numpy's float32 -> float16 cast).
uint16_t float_to_half(float f);

}  // namespace orchard
