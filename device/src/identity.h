// Device identity (orchard/identity.py): the device's long-term Ed25519 key, the
// root's certificate binding it to a node id, and the credential enrollment returns,
// kept where the Python client keeps them so either client can resume the other's node:
//
//   DIR/device.key        the 32-byte raw private key (written before it is ever used)
//   DIR/credential.json   {"node_id", "credential", "certificate" (base64), "root_public_key" (base64)}
//
// DIR has mode 0700 and each file mode 0600, written whole (temp file, fsync, rename).
// The private key never leaves the device: only its public half and signatures do.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "crypto.h"

namespace orchard {

constexpr size_t kEd25519PublicBytes = 32;
constexpr size_t kEd25519SignatureBytes = 64;

struct Enrolled {
  std::string node_id;
  std::string credential;  // the node's own bearer secret from now on
  Bytes certificate;       // the root's certificate of this device's key (may be empty)
  Bytes root_public_key;   // the root's Ed25519 key that signed it
};

// What a verified certificate binds: this node id holds this device key since `issued`.
struct Certificate {
  std::string node_id;
  Bytes public_key;
  uint64_t issued = 0;
};

// The certificate's node id and key if the root holding `root_public_key` signed it (and,
// given `node_id`, if it names that node). Failure(ORCHARD_ERR_AUTH) says why not.
Certificate verify_certificate(const Bytes& cert, const Bytes& root_public_key, const std::string* node_id = nullptr);

// What a node signs with its key when it enrolls (orchard.identity.enrollment_message):
// the role and node id it asks for and the sha256 hex of the token it presents.
Bytes enrollment_message(const std::string& role, const std::string& node_id, const std::string& token);

bool ed25519_verify(const Bytes& public_key, const Bytes& message, const Bytes& signature);
// The public half of a raw 32-byte Ed25519 private key, and that key's signature of
// `message` (Ed25519 is deterministic: the same key and message give the same bytes).
Bytes ed25519_public(const Bytes& private_key);
Bytes ed25519_sign(const Bytes& private_key, const Bytes& message);

class NodeIdentity {
 public:
  // Keep the key and enrollment in `directory` (created 0700 on first write); "" keeps
  // them in memory, for this handle only (a restarted app then needs a new token).
  // Failure(ORCHARD_ERR_IO) when the directory cannot be read or written,
  // ORCHARD_ERR_AUTH when what it holds is malformed.
  explicit NodeIdentity(std::string directory);

  const Bytes& public_key() const { return public_key_; }
  Bytes sign(const Bytes& message) const;
  const std::optional<Enrolled>& enrolled() const { return enrolled_; }
  const std::string& directory() const { return dir_; }

  // Keep what enrollment returned, after checking the certificate names this device's key.
  void save(const Enrolled& e);
  // A later Join's certificate and root key (the credential stays).
  void refresh(const Bytes& certificate, const Bytes& root_public_key);

 private:
  void write(const std::string& name, const std::string& data) const;

  std::string dir_;
  Bytes private_key_, public_key_;
  std::optional<Enrolled> enrolled_;
};

}  // namespace orchard
