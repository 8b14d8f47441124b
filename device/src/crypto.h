// The primitives of SecAgg+ (secure_agg/crypto.py, prg.py), on OpenSSL 3: HKDF-SHA256
// with Orchard's label, X25519, AES-256-GCM with the fixed nonce each one-message key
// allows, AES-128-CTR mask expansion and the AES-256-CTR byte stream a client draws
// its secrets from. Byte for byte the Python package's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace orchard {

using Bytes = std::vector<uint8_t>;

constexpr size_t kKeyBytes = 32;
constexpr size_t kSeedBytes = 16;

// HKDF-SHA256 (RFC 5869), no salt, info = "orchard-secagg/v1" + info.
Bytes hkdf(const Bytes& ikm, const Bytes& info, size_t length);

// X25519: the public key of a raw private key, and a raw shared secret (Failure with
// ORCHARD_ERR_SECAGG for a low-order peer key: an all-zero secret).
Bytes x25519_public(const Bytes& private_key);
Bytes x25519_agree(const Bytes& private_key, const Bytes& peer_public);

// AES-256-GCM with a zero nonce (every key encrypts exactly one message): ciphertext
// followed by the 16-byte tag. open() returns false when authentication fails.
Bytes gcm_seal(const Bytes& key, const Bytes& plaintext, const Bytes& ad);
bool gcm_open(const Bytes& key, const Bytes& sealed, const Bytes& ad, Bytes* plaintext);

// AES-CTR keystream from a zero counter block, keyed by a 16-byte (AES-128) or 32-byte
// (AES-256) key: ByteStream reads it in order; a mask is the first n words of it.
class ByteStream {
 public:
  explicit ByteStream(const Bytes& key);
  ~ByteStream();
  ByteStream(const ByteStream&) = delete;
  ByteStream& operator=(const ByteStream&) = delete;
  Bytes read(size_t n);
  void read_into(uint8_t* out, size_t n);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// acc += sign * PRG(seed) word by word (mod 2^32 or 2^64), PRG = AES-128-CTR(seed)
// keystream read as little-endian words of the accumulator's width (prg.MaskExpander:
// uint32 for modulus_bits <= 32, uint64 above).
void add_mask(std::vector<uint32_t>& acc, const Bytes& seed, int sign);
void add_mask(std::vector<uint64_t>& acc, const Bytes& seed, int sign);

}  // namespace orchard
