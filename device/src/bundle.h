// The client bundle on disk (edge_runtime/bundle.py writes it): client.json read and
// every file it names checked before use.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace orchard {

// The client.json format this library reads (edge_runtime.bundle.FORMAT_VERSION).
constexpr int kBundleFormatVersion = 1;

struct Bundle {
  std::string dir;
  nlohmann::json config;  // client.json as read
};

// Read `dir`/client.json. Throws Failure (ORCHARD_ERR_BUNDLE) for a directory that
// is no bundle, a file that is not JSON, or another format version.
Bundle read_bundle(const std::string& dir);

}  // namespace orchard
