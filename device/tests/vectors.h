// Reading the vectors tests/device/device_vectors.py writes.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "check.h"

namespace vectors {

inline nlohmann::json load(const std::string& name) {
  std::ifstream in(check::vectors_dir() + "/" + name);
  if (!in) {
    std::fprintf(stderr, "cannot read vector file %s/%s\n", check::vectors_dir().c_str(), name.c_str());
    std::exit(2);
  }
  std::stringstream s;
  s << in.rdbuf();
  return nlohmann::json::parse(s.str());
}

inline std::vector<uint8_t> unhex(const std::string& h) {
  std::vector<uint8_t> out(h.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(std::stoul(h.substr(2 * i, 2), nullptr, 16));
  return out;
}

inline std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += d[p[i] >> 4];
    s += d[p[i] & 15];
  }
  return s;
}

inline std::string hex(const std::vector<uint8_t>& v) { return hex(v.data(), v.size()); }

inline std::vector<float> floats(const std::string& h) {
  std::vector<uint8_t> b = unhex(h);
  std::vector<float> out(b.size() / 4);
  if (!out.empty()) std::memcpy(out.data(), b.data(), b.size());
  return out;
}

// The first byte where a and b differ, as "at N: got X, want Y", or "" when equal.
inline std::string first_difference(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got == want) return "";
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  std::ostringstream s;
  s << "sizes " << got.size() << " vs " << want.size() << ", first difference at byte " << i;
  if (i < got.size() && i < want.size()) s << ": got " << int(got[i]) << ", want " << int(want[i]);
  return s.str();
}

}  // namespace vectors
