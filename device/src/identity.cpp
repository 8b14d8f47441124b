#include "identity.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include "failure.h"
#include "sha256.h"

namespace orchard {

namespace {

constexpr uint8_t kCertVersion = 1;
const char kCertDomain[] = "orchard/device-certificate/v1";  // followed by a NUL byte, as in identity.py
const char kEnrollDomain[] = "orchard/enroll/v1";
const char kKeyFile[] = "device.key";
const char kEnrolledFile[] = "credential.json";

struct PKey {
  EVP_PKEY* p = nullptr;
  ~PKey() { EVP_PKEY_free(p); }
};

struct MdCtx {
  EVP_MD_CTX* p = EVP_MD_CTX_new();
  ~MdCtx() { EVP_MD_CTX_free(p); }
};

Bytes domain(const char* tag) {
  Bytes b(tag, tag + std::strlen(tag));
  b.push_back(0);
  return b;
}

std::string b64encode(const Bytes& b) {
  std::string out(4 * ((b.size() + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(&out[0]), b.data(), static_cast<int>(b.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

Bytes b64decode(const std::string& s, const std::string& what) {
  if (s.size() % 4 != 0) throw Failure(ORCHARD_ERR_AUTH, what + " is not base64");
  Bytes out(s.size() / 4 * 3 + 1);
  const int n = EVP_DecodeBlock(out.data(), reinterpret_cast<const unsigned char*>(s.data()), static_cast<int>(s.size()));
  if (n < 0) throw Failure(ORCHARD_ERR_AUTH, what + " is not base64");
  size_t len = static_cast<size_t>(n);
  // EVP_DecodeBlock counts the padding as zero bytes.
  for (size_t i = s.size(); i > 0 && s[i - 1] == '='; --i) --len;
  out.resize(len);
  return out;
}

bool read_whole(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::stringstream s;
  s << in.rdbuf();
  *out = s.str();
  return true;
}

}  // namespace

bool ed25519_verify(const Bytes& public_key, const Bytes& message, const Bytes& signature) {
  if (public_key.size() != kEd25519PublicBytes || signature.size() != kEd25519SignatureBytes) return false;
  PKey key;
  key.p = EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, nullptr, public_key.data(), public_key.size());
  MdCtx ctx;
  if (key.p == nullptr || ctx.p == nullptr) return false;
  if (EVP_DigestVerifyInit(ctx.p, nullptr, nullptr, nullptr, key.p) != 1) return false;
  return EVP_DigestVerify(ctx.p, signature.data(), signature.size(), message.data(), message.size()) == 1;
}

Bytes ed25519_public(const Bytes& private_key) {
  PKey key;
  key.p = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, private_key.data(), private_key.size());
  Bytes out(kEd25519PublicBytes);
  size_t len = out.size();
  if (key.p == nullptr || EVP_PKEY_get_raw_public_key(key.p, out.data(), &len) != 1 || len != kEd25519PublicBytes)
    throw Failure(ORCHARD_ERR_INTERNAL, "OpenSSL: cannot derive the Ed25519 public key");
  return out;
}

Bytes ed25519_sign(const Bytes& private_key, const Bytes& message) {
  PKey key;
  key.p = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, private_key.data(), private_key.size());
  MdCtx ctx;
  Bytes sig(kEd25519SignatureBytes);
  size_t len = sig.size();
  if (key.p == nullptr || ctx.p == nullptr || EVP_DigestSignInit(ctx.p, nullptr, nullptr, nullptr, key.p) != 1 ||
      EVP_DigestSign(ctx.p, sig.data(), &len, message.data(), message.size()) != 1 || len != sig.size())
    throw Failure(ORCHARD_ERR_INTERNAL, "OpenSSL: Ed25519 signing failed");
  return sig;
}

Certificate verify_certificate(const Bytes& cert, const Bytes& root_public_key, const std::string* node_id) {
  const size_t fixed = 3 + kEd25519PublicBytes + 8 + kEd25519SignatureBytes;
  if (cert.size() < fixed || cert[0] != kCertVersion)
    throw Failure(ORCHARD_ERR_AUTH, "the server's certificate is not an Orchard device certificate (version 1)");
  const size_t n = (static_cast<size_t>(cert[1]) << 8) | cert[2];
  if (cert.size() != fixed + n) throw Failure(ORCHARD_ERR_AUTH, "the server's device certificate has the wrong length");
  const Bytes body(cert.begin(), cert.end() - kEd25519SignatureBytes);
  const Bytes sig(cert.end() - kEd25519SignatureBytes, cert.end());
  Bytes signed_part = domain(kCertDomain);
  signed_part.insert(signed_part.end(), body.begin(), body.end());
  if (!ed25519_verify(root_public_key, signed_part, sig))
    throw Failure(ORCHARD_ERR_AUTH, "the device certificate is not signed by the root key the server named");
  Certificate c;
  c.node_id.assign(body.begin() + 3, body.begin() + 3 + static_cast<std::ptrdiff_t>(n));
  c.public_key.assign(body.begin() + 3 + static_cast<std::ptrdiff_t>(n),
                      body.begin() + 3 + static_cast<std::ptrdiff_t>(n + kEd25519PublicBytes));
  for (size_t i = 3 + n + kEd25519PublicBytes; i < body.size(); ++i) c.issued = (c.issued << 8) | body[i];
  if (node_id != nullptr && c.node_id != *node_id)
    throw Failure(ORCHARD_ERR_AUTH, "the device certificate is node '" + c.node_id + "''s, not '" + *node_id + "''s");
  return c;
}

Bytes enrollment_message(const std::string& role, const std::string& node_id, const std::string& token) {
  Bytes m = domain(kEnrollDomain);
  m.insert(m.end(), role.begin(), role.end());
  m.push_back(0);
  m.insert(m.end(), node_id.begin(), node_id.end());
  m.push_back(0);
  const std::string h = sha256_hex(reinterpret_cast<const uint8_t*>(token.data()), token.size());
  m.insert(m.end(), h.begin(), h.end());
  return m;
}

NodeIdentity::NodeIdentity(std::string directory) : dir_(std::move(directory)) {
  std::string raw;
  const bool held = !dir_.empty() && read_whole(dir_ + "/" + kKeyFile, &raw);
  if (held) {
    if (raw.size() != 32)
      throw Failure(ORCHARD_ERR_AUTH, dir_ + "/" + kKeyFile + " holds " + std::to_string(raw.size()) +
                                          " bytes, not a 32-byte Ed25519 key: restore it, or use a new data dir "
                                          "(and a new enrollment token)");
    private_key_.assign(raw.begin(), raw.end());
  } else {
    private_key_.resize(32);
    if (RAND_bytes(private_key_.data(), 32) != 1) throw Failure(ORCHARD_ERR_INTERNAL, "OpenSSL: RAND_bytes failed");
    // The key is on disk before it is ever sent: an enrollment is never made for a key
    // the device could lose by stopping before it saved it.
    if (!dir_.empty()) write(kKeyFile, std::string(private_key_.begin(), private_key_.end()));
  }
  public_key_ = ed25519_public(private_key_);
  if (!dir_.empty() && read_whole(dir_ + "/" + kEnrolledFile, &raw)) {
    const std::string what = dir_ + "/" + kEnrolledFile;
    const nlohmann::json j = nlohmann::json::parse(raw, nullptr, false);
    if (j.is_discarded() || !j.is_object()) throw Failure(ORCHARD_ERR_AUTH, what + " is not JSON");
    Enrolled e;
    try {
      e.node_id = j.at("node_id").get<std::string>();
      e.credential = j.at("credential").get<std::string>();
      e.certificate = b64decode(j.at("certificate").get<std::string>(), what + " certificate");
      e.root_public_key = b64decode(j.at("root_public_key").get<std::string>(), what + " root_public_key");
    } catch (const nlohmann::json::exception&) {
      throw Failure(ORCHARD_ERR_AUTH, what + " lacks node_id, credential, certificate or root_public_key (strings)");
    }
    enrolled_ = std::move(e);
  }
}

Bytes NodeIdentity::sign(const Bytes& message) const { return ed25519_sign(private_key_, message); }

void NodeIdentity::save(const Enrolled& e) {
  if (!e.certificate.empty() && !e.root_public_key.empty()) {
    const Certificate c = verify_certificate(e.certificate, e.root_public_key, &e.node_id);
    if (c.public_key != public_key_)
      throw Failure(ORCHARD_ERR_AUTH, "the root certified another key than this device's");
  }
  if (!dir_.empty()) {
    const nlohmann::json j = {{"node_id", e.node_id},
                              {"credential", e.credential},
                              {"certificate", b64encode(e.certificate)},
                              {"root_public_key", b64encode(e.root_public_key)}};
    write(kEnrolledFile, j.dump());
  }
  enrolled_ = e;
}

void NodeIdentity::refresh(const Bytes& certificate, const Bytes& root_public_key) {
  if (!enrolled_ || certificate.empty()) return;
  if (certificate == enrolled_->certificate && root_public_key == enrolled_->root_public_key) return;
  Enrolled e = *enrolled_;
  e.certificate = certificate;
  e.root_public_key = root_public_key;
  save(e);
}

void NodeIdentity::write(const std::string& name, const std::string& data) const {
  const auto io = [&](const std::string& what) {
    return Failure(ORCHARD_ERR_IO, "cannot " + what + " in " + dir_ + ": " + std::strerror(errno) +
                                       " (the device's data dir must be writable by the app alone)");
  };
  // The directory and its parents; then owner-only, whatever existed before.
  for (size_t at = 1; at <= dir_.size(); ++at) {
    if (at != dir_.size() && dir_[at] != '/') continue;
    const std::string part = dir_.substr(0, at);
    if (::mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) throw io("create the directory");
  }
  if (::chmod(dir_.c_str(), 0700) != 0) throw io("make the directory owner-only");
  const std::string tmp = dir_ + "/." + name + "." + std::to_string(::getpid()) + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw io("write " + name);
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      ::close(fd);
      throw io("write " + name);
    }
    done += static_cast<size_t>(w);
  }
  if (::fchmod(fd, 0600) != 0 || ::fsync(fd) != 0) {
    ::close(fd);
    throw io("write " + name);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), (dir_ + "/" + name).c_str()) != 0) throw io("replace " + name);
}

}  // namespace orchard
