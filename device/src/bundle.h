// The client bundle on disk (edge_runtime/bundle.py and et_program.py write it),
// checked before use as docs/mobile-contract.md section 1 asks: every sha256 that
// client.json names, the training program's manifest against the program's digest and
// the adapter's tensors, the CA certificate and the token file's mode. Each refusal
// names the file and what was expected, as the Python client's do.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace orchard {

// The client.json and train_program.json formats this library reads.
constexpr int kBundleFormatVersion = 1;
constexpr int kManifestFormatVersion = 1;

struct TensorDecl {
  std::string name;   // the program's name (peft's, with ".default.")
  std::string dtype;
  std::vector<uint64_t> shape;
};

struct Manifest {
  nlohmann::json raw;
  std::string program_path;   // train.pte, checked against its sha256
  std::string method;
  std::string task;
  int micro_batch = 0;
  int seq_len = 0;
  int vocab_size = 0;
  int loss_output = 0;
  int correct_output = 1;
  int gradients_start = 0;
  int parameters_start = 0;
  std::vector<TensorDecl> inputs;
  std::vector<TensorDecl> parameters;
};

struct Bundle {
  std::string dir;
  nlohmann::json config;      // client.json as read
  std::string server_address;
  std::string ca_pem;         // empty: no CA named (the system's roots)
  std::string token;          // empty: no token named
  std::vector<uint8_t> root_public_key;  // the root's Ed25519 key, when client.json names it
  Manifest manifest;
};

// Read and check the bundle in `dir`. Throws Failure: ORCHARD_ERR_BUNDLE (not a bundle,
// a file missing, malformed JSON, another format), ORCHARD_ERR_INTEGRITY (a digest
// differs), ORCHARD_ERR_PROGRAM (the manifest does not match the program or adapter),
// ORCHARD_ERR_REFUSED (the manifest's program is of a kind other than "next_token"),
// ORCHARD_ERR_AUTH (the token file is readable by others).
Bundle read_bundle(const std::string& dir);

// peft's parameter name as its state-dict key: "...lora_B.default.weight" ->
// "...lora_B.weight" (et_program.peft_state_key).
std::string peft_state_key(const std::string& name);

// A whole file's bytes; Failure(code) with `why` when it cannot be read.
std::string read_file(const std::string& path, int code, const std::string& why);

}  // namespace orchard
