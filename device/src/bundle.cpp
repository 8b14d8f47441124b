#include "bundle.h"

#include <fstream>
#include <sstream>

#include "failure.h"

namespace orchard {

namespace {

std::string read_file(const std::string& path, orchard_status missing_code, const std::string& why_missing) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Failure(missing_code, path + why_missing);
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) throw Failure(ORCHARD_ERR_IO, path + ": read failed");
  return out.str();
}

}  // namespace

Bundle read_bundle(const std::string& dir) {
  const std::string path = dir + "/client.json";
  const std::string text = read_file(
      path, ORCHARD_ERR_BUNDLE,
      " does not exist: " + dir + " is not a client bundle; write one with `orchard client bundle`");
  Bundle b;
  b.dir = dir;
  b.config = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (b.config.is_discarded() || !b.config.is_object())
    throw Failure(ORCHARD_ERR_BUNDLE, path + " is not a JSON object");
  const auto v = b.config.find("format_version");
  if (v == b.config.end() || !v->is_number_integer() || v->get<int>() != kBundleFormatVersion)
    throw Failure(ORCHARD_ERR_BUNDLE, path + " has format_version " + (v == b.config.end() ? "(none)" : v->dump()) +
                                          "; this client reads " + std::to_string(kBundleFormatVersion));
  return b;
}

}  // namespace orchard
