// The safetensors format (a little-endian u64 header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the data): the bundle's adapter and the
// model blobs PullModel streams. Only float32 tensors are read; everything is bounds
// checked, so a damaged file is refused with a message, never read past.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace orchard {

struct Tensor {
  std::vector<uint32_t> shape;
  std::vector<float> values;
};

// Name -> tensor, sorted by name. `what` names the source in messages. Throws Failure
// with `code` for anything malformed.
std::map<std::string, Tensor> parse_safetensors(const uint8_t* data, size_t n, const std::string& what, int code);

// Name -> bytes of every tensor of dtype U8 (a model delta's payloads, wire.payloads_to_blob).
std::map<std::string, std::vector<uint8_t>> parse_safetensors_u8(const uint8_t* data, size_t n, const std::string& what,
                                                                 int code);

// float32 tensors as the bytes safetensors' own writer makes (wire.arrays_to_blob): the
// header's tensors and their data in name order, the header padded with spaces to a
// multiple of 8 bytes. Equal tensors give equal bytes, hence equal sha256.
std::vector<uint8_t> safetensors_blob(const std::map<std::string, Tensor>& tensors);

// Only names and shapes (any dtype), without reading the data.
std::map<std::string, std::vector<uint64_t>> safetensors_shapes(const uint8_t* data, size_t n, const std::string& what,
                                                                int code);

}  // namespace orchard
