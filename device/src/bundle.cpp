#include "bundle.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "failure.h"
#include "safetensors.h"
#include "sha256.h"

namespace orchard {

namespace {

constexpr const char* kConfigFile = "client.json";
constexpr const char* kRecreate = "re-create the bundle";

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

nlohmann::json parse_object(const std::string& text, const std::string& path, orchard_status code) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw Failure(code, path + " is not a JSON object; " + kRecreate);
  return j;
}

// A string field `key` of object `j` (from file `path`).
std::string str(const nlohmann::json& j, const char* key, const std::string& path, orchard_status code) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string())
    throw Failure(code, path + ": " + key + " is missing or not a string; " + kRecreate);
  return it->get<std::string>();
}

int integer(const nlohmann::json& j, const char* key, const std::string& path, orchard_status code, int min,
            int fallback = -1) {
  auto it = j.find(key);
  if (it == j.end() && fallback >= 0) return fallback;
  if (it == j.end() || !it->is_number_integer() || it->get<int64_t>() < min || it->get<int64_t>() > (1 << 30))
    throw Failure(code, path + ": " + key + " is missing or not an int >= " + std::to_string(min) + "; " + kRecreate);
  return it->get<int>();
}

// A named file {"name", "sha256"}: present, inside the bundle, with that digest.
std::string checked_file(const std::string& dir, const nlohmann::json& named, const std::string& named_in,
                         orchard_status mismatch, const std::string& advice) {
  if (!named.is_object()) throw Failure(ORCHARD_ERR_BUNDLE, named_in + " names a file without {name, sha256}");
  const std::string name = str(named, "name", named_in, ORCHARD_ERR_BUNDLE);
  const std::string want = str(named, "sha256", named_in, ORCHARD_ERR_BUNDLE);
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
    throw Failure(ORCHARD_ERR_BUNDLE, named_in + " names '" + name + "', which is not a file of the bundle");
  const std::string path = dir + "/" + name;
  if (!is_file(path)) throw Failure(ORCHARD_ERR_BUNDLE, path + " is named in " + named_in + " but missing");
  const std::string got = file_sha256_hex(path);
  if (got != want)
    throw Failure(mismatch, path + " has sha256 " + got + ", " + named_in + " expects " + want + ": " + advice);
  return path;
}

std::vector<TensorDecl> decls(const nlohmann::json& m, const char* key, const std::string& path) {
  auto it = m.find(key);
  if (it == m.end() || !it->is_array())
    throw Failure(ORCHARD_ERR_PROGRAM, path + ": " + key + " is missing or not a list; " + kRecreate);
  std::vector<TensorDecl> out;
  for (auto& d : *it) {
    if (!d.is_object() || !d.contains("shape") || !d["shape"].is_array())
      throw Failure(ORCHARD_ERR_PROGRAM, path + ": an entry of " + key + " is not {name, dtype, shape}");
    TensorDecl t{str(d, "name", path, ORCHARD_ERR_PROGRAM), str(d, "dtype", path, ORCHARD_ERR_PROGRAM), {}};
    for (auto& s : d["shape"]) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0)
        throw Failure(ORCHARD_ERR_PROGRAM, path + ": " + t.name + " has a bad shape " + d["shape"].dump());
      t.shape.push_back(s.get<uint64_t>());
    }
    out.push_back(std::move(t));
  }
  return out;
}

std::string shape_text(const std::vector<uint64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Manifest read_manifest(const std::string& dir, const std::string& path, const std::string& adapter_path) {
  Manifest m;
  m.raw = parse_object(read_file(path, ORCHARD_ERR_PROGRAM, " cannot be read"), path, ORCHARD_ERR_PROGRAM);
  const auto v = m.raw.find("format_version");
  if (v == m.raw.end() || *v != kManifestFormatVersion)
    throw Failure(ORCHARD_ERR_PROGRAM, path + " has format_version " + (v == m.raw.end() ? "(none)" : v->dump()) +
                                           "; this client reads " + std::to_string(kManifestFormatVersion) + ": " +
                                           kRecreate);
  // A manifest without a kind predates kinds: a next-token program, the one kind this
  // client's trainer (train.cpp) feeds. Another kind is refused before it is misread.
  const auto kind = m.raw.find("kind");
  if (kind != m.raw.end() && *kind != "next_token")
    throw Failure(ORCHARD_ERR_REFUSED, path + " holds a training program of kind " + kind->dump() +
                                           "; this client trains \"next_token\" programs only: train this task "
                                           "with orchard client start --runtime executorch, or with torch");
  const std::string file = path.substr(path.rfind('/') + 1);
  m.program_path = checked_file(dir, m.raw.value("program", nlohmann::json()), file, ORCHARD_ERR_PROGRAM,
                                "the program was swapped or truncated; re-create the bundle");
  m.method = m.raw.contains("method") ? str(m.raw, "method", path, ORCHARD_ERR_PROGRAM) : "forward";
  m.task = str(m.raw, "task", path, ORCHARD_ERR_PROGRAM);
  m.micro_batch = integer(m.raw, "micro_batch", path, ORCHARD_ERR_PROGRAM, 1);
  m.seq_len = integer(m.raw, "seq_len", path, ORCHARD_ERR_PROGRAM, 1);
  m.vocab_size = integer(m.raw, "vocab_size", path, ORCHARD_ERR_PROGRAM, 1);
  m.loss_output = integer(m.raw, "loss_output", path, ORCHARD_ERR_PROGRAM, 0, 0);
  m.correct_output = integer(m.raw, "correct_output", path, ORCHARD_ERR_PROGRAM, 0, 1);
  m.gradients_start = integer(m.raw, "gradients_start", path, ORCHARD_ERR_PROGRAM, 0);
  m.parameters_start = integer(m.raw, "parameters_start", path, ORCHARD_ERR_PROGRAM, 0);
  m.inputs = decls(m.raw, "inputs", path);
  m.parameters = decls(m.raw, "parameters", path);
  std::vector<std::string> names;
  for (auto& d : m.inputs) names.push_back(d.name);
  if (names != std::vector<std::string>{"idx", "targets", "row_weight"})
    throw Failure(ORCHARD_ERR_PROGRAM, path + " declares inputs " + nlohmann::json(names).dump() +
                                           ", expected [\"idx\", \"targets\", \"row_weight\"]");
  if (m.parameters_start - m.gradients_start != static_cast<int>(m.parameters.size()))
    throw Failure(ORCHARD_ERR_PROGRAM, path + " puts gradients at output " + std::to_string(m.gradients_start) +
                                           " and parameters at " + std::to_string(m.parameters_start) + " for " +
                                           std::to_string(m.parameters.size()) + " trained tensors");
  // The program must train exactly tensors of the bundle's adapter, by state-dict key.
  const std::string bytes = read_file(adapter_path, ORCHARD_ERR_BUNDLE, " cannot be read");
  const auto shapes = safetensors_shapes(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), adapter_path,
                                         ORCHARD_ERR_BUNDLE);
  for (const TensorDecl& p : m.parameters) {
    const std::string key = peft_state_key(p.name);
    auto it = shapes.find(key);
    if (it == shapes.end())
      throw Failure(ORCHARD_ERR_PROGRAM, path + " trains '" + p.name +
                                             "', which the bundle's adapter does not hold (expected key '" + key +
                                             "'): the program was exported for another model");
    if (it->second != p.shape)
      throw Failure(ORCHARD_ERR_PROGRAM, path + " trains '" + p.name + "' with shape " + shape_text(p.shape) +
                                             ", the bundle's adapter has " + shape_text(it->second) +
                                             ": the program was exported for another adapter shape (LoRA rank); "
                                             "re-create the bundle");
    if (p.dtype != "float32")
      throw Failure(ORCHARD_ERR_PROGRAM, path + " trains '" + p.name + "' as " + p.dtype + ", expected float32");
  }
  return m;
}

}  // namespace

std::string peft_state_key(const std::string& name) {
  std::string out = name;
  const std::string from = ".default.";
  for (size_t at = out.find(from); at != std::string::npos; at = out.find(from, at + 1)) out.replace(at, from.size(), ".");
  return out;
}

std::string read_file(const std::string& path, int code, const std::string& why) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Failure(static_cast<orchard_status>(code), path + why);
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) throw Failure(ORCHARD_ERR_IO, path + ": read failed");
  return out.str();
}

Bundle read_bundle(const std::string& dir) {
  const std::string path = dir + "/" + kConfigFile;
  if (!is_file(path))
    throw Failure(ORCHARD_ERR_BUNDLE, dir + " is not a client bundle (no " + kConfigFile +
                                          "); write one with `orchard client bundle`");
  Bundle b;
  b.dir = dir;
  b.config = parse_object(read_file(path, ORCHARD_ERR_BUNDLE, " cannot be read"), path, ORCHARD_ERR_BUNDLE);
  const auto v = b.config.find("format_version");
  if (v == b.config.end() || !v->is_number_integer() || v->get<int>() != kBundleFormatVersion)
    throw Failure(ORCHARD_ERR_BUNDLE, path + " has format_version " + (v == b.config.end() ? "(none)" : v->dump()) +
                                          "; this client reads " + std::to_string(kBundleFormatVersion));
  b.server_address = str(b.config, "server_address", path, ORCHARD_ERR_BUNDLE);
  // Every digest client.json names (edge_runtime.bundle.read_bundle(verify=True)).
  std::string adapter_path;
  for (const char* key : {"model", "adapter_onnx", "adapter_safetensors", "training_program"}) {
    auto it = b.config.find(key);
    if (it == b.config.end() || it->is_null()) {
      if (std::string(key) == "training_program")
        throw Failure(ORCHARD_ERR_PROGRAM, path + " names no training program: this bundle has none; re-create it "
                                               "with `orchard client bundle` (executorch installed)");
      throw Failure(ORCHARD_ERR_BUNDLE, path + ": " + key + " is missing; " + kRecreate);
    }
    const std::string p = checked_file(dir, *it, kConfigFile, ORCHARD_ERR_INTEGRITY, kRecreate);
    if (std::string(key) == "adapter_safetensors") adapter_path = p;
    if (std::string(key) == "training_program") b.manifest = read_manifest(dir, p, adapter_path);
  }
  if (b.config.contains("ca_cert") && !b.config["ca_cert"].is_null()) {
    const std::string ca = dir + "/" + str(b.config, "ca_cert", path, ORCHARD_ERR_BUNDLE);
    b.ca_pem = read_file(ca, ORCHARD_ERR_BUNDLE, std::string(" is named in ") + kConfigFile + " but missing");
    if (b.ca_pem.find("-----BEGIN CERTIFICATE-----") == std::string::npos)
      throw Failure(ORCHARD_ERR_BUNDLE, ca + " is not a PEM certificate (no BEGIN CERTIFICATE line)");
  }
  if (b.config.contains("enrollment_token") && !b.config["enrollment_token"].is_null()) {
    const std::string tp = dir + "/" + str(b.config, "enrollment_token", path, ORCHARD_ERR_BUNDLE);
    struct stat st {};
    if (::stat(tp.c_str(), &st) != 0)
      throw Failure(ORCHARD_ERR_BUNDLE, tp + " is named in " + kConfigFile + " but missing");
    // Like ssh with its keys: a credential others can read is refused.
    if (st.st_mode & (S_IRWXG | S_IRWXO)) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%o", static_cast<unsigned>(st.st_mode & 07777));
      throw Failure(ORCHARD_ERR_AUTH,
                    tp + " is accessible by group or others (mode " + mode + "): run chmod 600 " + tp);
    }
    std::string token = read_file(tp, ORCHARD_ERR_BUNDLE, " cannot be read");
    const auto first = token.find_first_not_of(" \t\r\n"), last = token.find_last_not_of(" \t\r\n");
    b.token = first == std::string::npos ? "" : token.substr(first, last - first + 1);
    if (b.token.empty()) throw Failure(ORCHARD_ERR_AUTH, tp + " is empty");
  }
  if (b.config.contains("root_public_key") && !b.config["root_public_key"].is_null()) {
    // The root's Ed25519 certificate key, hex: a Join answered with another is refused.
    const std::string hex = str(b.config, "root_public_key", path, ORCHARD_ERR_BUNDLE);
    const auto nibble = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
    bool ok = hex.size() == 64;
    for (size_t i = 0; ok && i < hex.size(); i += 2) {
      const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
      ok = hi >= 0 && lo >= 0;
      if (ok) b.root_public_key.push_back(static_cast<uint8_t>(hi * 16 + lo));
    }
    if (!ok)
      throw Failure(ORCHARD_ERR_BUNDLE, path + ": root_public_key must be 64 lowercase hex digits (32 bytes), got '" +
                                            hex + "'; " + kRecreate);
  }
  return b;
}

}  // namespace orchard
