#include "safetensors.h"

#include <cstring>

#include <nlohmann/json.hpp>

#include "failure.h"

namespace orchard {

namespace {

constexpr uint64_t kMaxHeader = 100u << 20;  // safetensors' own limit

nlohmann::json header_of(const uint8_t* data, size_t n, const std::string& what, orchard_status code,
                         size_t* data_start) {
  if (n < 8) throw Failure(code, what + " is not safetensors: " + std::to_string(n) + " bytes, no header");
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | data[i];
  if (len > kMaxHeader || len > n - 8)
    throw Failure(code, what + " is not safetensors: a header of " + std::to_string(len) + " bytes in " +
                            std::to_string(n) + " bytes");
  nlohmann::json h = nlohmann::json::parse(data + 8, data + 8 + len, nullptr, false);
  if (h.is_discarded() || !h.is_object()) throw Failure(code, what + " is not safetensors: its header is not JSON");
  *data_start = 8 + static_cast<size_t>(len);
  return h;
}

std::vector<uint64_t> shape_of(const nlohmann::json& entry, const std::string& where, orchard_status code) {
  if (!entry.is_object() || !entry.contains("shape") || !entry["shape"].is_array())
    throw Failure(code, where + " has no shape");
  std::vector<uint64_t> shape;
  for (auto& d : entry["shape"]) {
    if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0))
      throw Failure(code, where + " has a bad shape " + entry["shape"].dump());
    shape.push_back(d.get<uint64_t>());
  }
  return shape;
}

// An entry's byte range, checked against the data section and the byte count its
// shape and element size call for.
std::pair<uint64_t, uint64_t> range_of(const nlohmann::json& e, const std::string& where, orchard_status status,
                                       uint64_t count, uint64_t item, size_t data_bytes) {
  const auto& off = e.value("data_offsets", nlohmann::json());
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    throw Failure(status, where + " has no data_offsets");
  const uint64_t b = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  if (b > end || end > data_bytes || end - b != count * item)
    throw Failure(status, where + " has data_offsets [" + std::to_string(b) + ", " + std::to_string(end) +
                              ") that do not hold " + std::to_string(count) + " values of " + std::to_string(item) +
                              " bytes in " + std::to_string(data_bytes) + " data bytes");
  return {b, end};
}

uint64_t count_of(const std::vector<uint64_t>& shape, const std::string& where, orchard_status status) {
  uint64_t count = 1;
  for (uint64_t d : shape) {
    if (d > 0xffffffffull || (d != 0 && count > (1ull << 40) / d)) throw Failure(status, where + " is too large");
    count *= d;
  }
  return count;
}

}  // namespace

std::map<std::string, std::vector<uint8_t>> parse_safetensors_u8(const uint8_t* data, size_t n, const std::string& what,
                                                                 int code) {
  size_t start = 0;
  const auto status = static_cast<orchard_status>(code);
  nlohmann::json h = header_of(data, n, what, status, &start);
  std::map<std::string, std::vector<uint8_t>> out;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string where = what + " tensor '" + it.key() + "'";
    const nlohmann::json& e = it.value();
    const uint64_t count = count_of(shape_of(e, where, status), where, status);
    if (!e.contains("dtype") || e["dtype"] != "U8")
      throw Failure(status, where + " is " + (e.contains("dtype") ? e["dtype"].dump() : "untyped") + ", expected U8");
    const auto [b, end] = range_of(e, where, status, count, 1, n - start);
    out.emplace(it.key(), std::vector<uint8_t>(data + start + b, data + start + end));
  }
  return out;
}

std::vector<uint8_t> safetensors_blob(const std::map<std::string, Tensor>& tensors) {
  std::string header = "{";
  uint64_t at = 0;
  for (const auto& [name, t] : tensors) {
    if (header.size() > 1) header += ',';
    header += nlohmann::json(name).dump() + ":{\"dtype\":\"F32\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) header += (i ? "," : "") + std::to_string(t.shape[i]);
    const uint64_t end = at + 4 * static_cast<uint64_t>(t.values.size());
    header += "],\"data_offsets\":[" + std::to_string(at) + "," + std::to_string(end) + "]}";
    at = end;
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');
  std::vector<uint8_t> out;
  out.reserve(8 + header.size() + at);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  for (const auto& [name, t] : tensors) {
    const auto* p = reinterpret_cast<const uint8_t*>(t.values.data());
    out.insert(out.end(), p, p + 4 * t.values.size());  // little-endian hosts (every phone ABI)
  }
  return out;
}

std::map<std::string, std::vector<uint64_t>> safetensors_shapes(const uint8_t* data, size_t n, const std::string& what,
                                                                int code) {
  size_t start = 0;
  const auto status = static_cast<orchard_status>(code);
  nlohmann::json h = header_of(data, n, what, status, &start);
  std::map<std::string, std::vector<uint64_t>> out;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    out[it.key()] = shape_of(it.value(), what + " tensor '" + it.key() + "'", status);
  }
  return out;
}

std::map<std::string, Tensor> parse_safetensors(const uint8_t* data, size_t n, const std::string& what, int code) {
  size_t start = 0;
  const auto status = static_cast<orchard_status>(code);
  nlohmann::json h = header_of(data, n, what, status, &start);
  std::map<std::string, Tensor> out;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string where = what + " tensor '" + it.key() + "'";
    const nlohmann::json& e = it.value();
    std::vector<uint64_t> shape = shape_of(e, where, status);
    if (!e.contains("dtype") || e["dtype"] != "F32")
      throw Failure(status, where + " is " + (e.contains("dtype") ? e["dtype"].dump() : "untyped") + ", expected F32");
    const auto& off = e.value("data_offsets", nlohmann::json());
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      throw Failure(status, where + " has no data_offsets");
    const uint64_t b = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    uint64_t count = 1;
    Tensor t;
    for (uint64_t d : shape) {
      if (d > 0xffffffffull || (d != 0 && count > (1ull << 40) / d)) throw Failure(status, where + " is too large");
      count *= d;
      t.shape.push_back(static_cast<uint32_t>(d));
    }
    if (b > end || end > n - start || end - b != count * 4)
      throw Failure(status, where + " has data_offsets [" + std::to_string(b) + ", " + std::to_string(end) +
                                ") that do not hold " + std::to_string(count) + " float32 values in " +
                                std::to_string(n - start) + " data bytes");
    t.values.resize(count);
    if (count) std::memcpy(t.values.data(), data + start + b, count * 4);
    out.emplace(it.key(), std::move(t));
  }
  return out;
}

}  // namespace orchard
