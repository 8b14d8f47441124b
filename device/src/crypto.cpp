#include "crypto.h"

#include <algorithm>
#include <cstring>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "failure.h"

namespace orchard {

namespace {

const char kLabel[] = "orchard-secagg/v1";

void ok(int rc, const char* what) {
  if (rc != 1) throw Failure(ORCHARD_ERR_INTERNAL, std::string("OpenSSL: ") + what + " failed");
}

Bytes hmac_sha256(const Bytes& key, const Bytes& data) {
  Bytes out(32);
  unsigned len = 32;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), data.data(), data.size(), out.data(), &len) ==
      nullptr)
    throw Failure(ORCHARD_ERR_INTERNAL, "OpenSSL: HMAC-SHA256 failed");
  return out;
}

struct PKey {
  EVP_PKEY* p = nullptr;
  ~PKey() { EVP_PKEY_free(p); }
};

struct PKeyCtx {
  EVP_PKEY_CTX* p = nullptr;
  ~PKeyCtx() { EVP_PKEY_CTX_free(p); }
};

struct CipherCtx {
  EVP_CIPHER_CTX* p = EVP_CIPHER_CTX_new();
  ~CipherCtx() { EVP_CIPHER_CTX_free(p); }
};

void check_len(const Bytes& b, size_t n, const char* what) {
  if (b.size() != n)
    throw Failure(ORCHARD_ERR_SECAGG, std::string(what) + " is " + std::to_string(n) + " bytes, got " +
                                          std::to_string(b.size()));
}

const unsigned char kZeroNonce[12] = {0};
const unsigned char kZeroIv[16] = {0};

}  // namespace

Bytes hkdf(const Bytes& ikm, const Bytes& info_tail, size_t length) {
  if (length == 0 || length > 255 * 32) throw Failure(ORCHARD_ERR_INTERNAL, "HKDF length out of range");
  const Bytes prk = hmac_sha256(Bytes(32, 0), ikm);
  Bytes info(kLabel, kLabel + sizeof kLabel - 1);
  info.insert(info.end(), info_tail.begin(), info_tail.end());
  Bytes out, block;
  for (uint8_t i = 1; out.size() < length; ++i) {
    Bytes msg = block;
    msg.insert(msg.end(), info.begin(), info.end());
    msg.push_back(i);
    block = hmac_sha256(prk, msg);
    out.insert(out.end(), block.begin(), block.end());
  }
  out.resize(length);
  return out;
}

Bytes x25519_public(const Bytes& private_key) {
  check_len(private_key, kKeyBytes, "an X25519 private key");
  PKey k;
  k.p = EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, private_key.data(), private_key.size());
  if (k.p == nullptr) throw Failure(ORCHARD_ERR_INTERNAL, "OpenSSL: X25519 key load failed");
  Bytes out(kKeyBytes);
  size_t len = out.size();
  ok(EVP_PKEY_get_raw_public_key(k.p, out.data(), &len), "X25519 public key");
  return out;
}

Bytes x25519_agree(const Bytes& private_key, const Bytes& peer_public) {
  check_len(private_key, kKeyBytes, "an X25519 private key");
  check_len(peer_public, kKeyBytes, "an X25519 public key");
  PKey mine, peer;
  mine.p = EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr, private_key.data(), private_key.size());
  peer.p = EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr, peer_public.data(), peer_public.size());
  if (mine.p == nullptr || peer.p == nullptr) throw Failure(ORCHARD_ERR_SECAGG, "an X25519 key does not load");
  PKeyCtx ctx;
  ctx.p = EVP_PKEY_CTX_new(mine.p, nullptr);
  if (ctx.p == nullptr) throw std::bad_alloc();
  ok(EVP_PKEY_derive_init(ctx.p), "X25519 derive init");
  if (EVP_PKEY_derive_set_peer(ctx.p, peer.p) != 1)
    throw Failure(ORCHARD_ERR_SECAGG, "public key rejected by X25519");
  Bytes out(kKeyBytes);
  size_t len = out.size();
  // OpenSSL refuses an all-zero shared secret (a low-order peer key), as cryptography does.
  if (EVP_PKEY_derive(ctx.p, out.data(), &len) != 1 || len != kKeyBytes)
    throw Failure(ORCHARD_ERR_SECAGG, "public key rejected by X25519 (a low-order point)");
  return out;
}

Bytes gcm_seal(const Bytes& key, const Bytes& plaintext, const Bytes& ad) {
  check_len(key, 32, "an AES-256-GCM key");
  CipherCtx c;
  if (c.p == nullptr) throw std::bad_alloc();
  ok(EVP_EncryptInit_ex(c.p, EVP_aes_256_gcm(), nullptr, key.data(), kZeroNonce), "GCM init");
  int len = 0;
  if (!ad.empty()) ok(EVP_EncryptUpdate(c.p, nullptr, &len, ad.data(), static_cast<int>(ad.size())), "GCM ad");
  Bytes out(plaintext.size() + 16);
  if (!plaintext.empty())
    ok(EVP_EncryptUpdate(c.p, out.data(), &len, plaintext.data(), static_cast<int>(plaintext.size())), "GCM update");
  ok(EVP_EncryptFinal_ex(c.p, out.data() + plaintext.size(), &len), "GCM final");
  ok(EVP_CIPHER_CTX_ctrl(c.p, EVP_CTRL_GCM_GET_TAG, 16, out.data() + plaintext.size()), "GCM tag");
  return out;
}

bool gcm_open(const Bytes& key, const Bytes& sealed, const Bytes& ad, Bytes* plaintext) {
  check_len(key, 32, "an AES-256-GCM key");
  if (sealed.size() < 16) return false;
  CipherCtx c;
  if (c.p == nullptr) throw std::bad_alloc();
  ok(EVP_DecryptInit_ex(c.p, EVP_aes_256_gcm(), nullptr, key.data(), kZeroNonce), "GCM init");
  int len = 0;
  if (!ad.empty()) ok(EVP_DecryptUpdate(c.p, nullptr, &len, ad.data(), static_cast<int>(ad.size())), "GCM ad");
  const size_t n = sealed.size() - 16;
  plaintext->assign(n, 0);
  if (n) ok(EVP_DecryptUpdate(c.p, plaintext->data(), &len, sealed.data(), static_cast<int>(n)), "GCM update");
  Bytes tag(sealed.end() - 16, sealed.end());
  ok(EVP_CIPHER_CTX_ctrl(c.p, EVP_CTRL_GCM_SET_TAG, 16, tag.data()), "GCM tag");
  return EVP_DecryptFinal_ex(c.p, plaintext->data() + n, &len) == 1;
}

struct ByteStream::Impl {
  CipherCtx c;
};

ByteStream::ByteStream(const Bytes& key) : impl_(new Impl) {
  if (impl_->c.p == nullptr) throw std::bad_alloc();
  const EVP_CIPHER* cipher = key.size() == 32 ? EVP_aes_256_ctr() : key.size() == 16 ? EVP_aes_128_ctr() : nullptr;
  if (cipher == nullptr) throw Failure(ORCHARD_ERR_INTERNAL, "an AES-CTR key is 16 or 32 bytes");
  ok(EVP_EncryptInit_ex(impl_->c.p, cipher, nullptr, key.data(), kZeroIv), "CTR init");
}

ByteStream::~ByteStream() = default;

void ByteStream::read_into(uint8_t* out, size_t n) {
  if (n == 0) return;  // an empty vector's data() may be NULL, which memset must not get
  std::memset(out, 0, n);
  // The keystream is the encryption of zeros, in chunks an int can count.
  for (size_t at = 0; at < n;) {
    const int step = static_cast<int>(std::min<size_t>(n - at, 1 << 30));
    int len = 0;
    ok(EVP_EncryptUpdate(impl_->c.p, out + at, &len, out + at, step), "CTR update");
    at += static_cast<size_t>(step);
  }
}

Bytes ByteStream::read(size_t n) {
  Bytes out(n);
  read_into(out.data(), n);
  return out;
}

namespace {

template <typename Word>
void add_mask_words(std::vector<Word>& acc, const Bytes& seed, int sign) {
  check_len(seed, kSeedBytes, "a mask seed");
  ByteStream prg(seed);
  std::vector<uint8_t> chunk(1 << 16);
  for (size_t at = 0; at < acc.size();) {
    const size_t words = std::min(acc.size() - at, chunk.size() / sizeof(Word));
    prg.read_into(chunk.data(), words * sizeof(Word));
    for (size_t i = 0; i < words; ++i) {
      const uint8_t* b = chunk.data() + sizeof(Word) * i;
      Word w = 0;
      for (size_t k = 0; k < sizeof(Word); ++k) w |= static_cast<Word>(b[k]) << (8 * k);
      acc[at + i] = sign >= 0 ? static_cast<Word>(acc[at + i] + w) : static_cast<Word>(acc[at + i] - w);
    }
    at += words;
  }
}

}  // namespace

void add_mask(std::vector<uint32_t>& acc, const Bytes& seed, int sign) { add_mask_words(acc, seed, sign); }
void add_mask(std::vector<uint64_t>& acc, const Bytes& seed, int sign) { add_mask_words(acc, seed, sign); }

}  // namespace orchard
