#include "sha256.h"

#include <cstdio>
#include <memory>
#include <vector>

#include <openssl/evp.h>

#include "failure.h"

namespace orchard {

namespace {

struct MdCtx {
  EVP_MD_CTX* p = EVP_MD_CTX_new();
  ~MdCtx() { EVP_MD_CTX_free(p); }
};

std::string hex(const unsigned char* d, unsigned n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (unsigned i = 0; i < n; ++i) {
    s += digits[d[i] >> 4];
    s += digits[d[i] & 15];
  }
  return s;
}

void check(int ok) {
  if (ok != 1) throw Failure(ORCHARD_ERR_INTERNAL, "OpenSSL SHA-256 failed");
}

}  // namespace

std::vector<uint8_t> sha256_bytes(const uint8_t* data, size_t n) {
  MdCtx ctx;
  if (ctx.p == nullptr) throw std::bad_alloc();
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned len = 0;
  check(EVP_DigestInit_ex(ctx.p, EVP_sha256(), nullptr));
  check(EVP_DigestUpdate(ctx.p, data, n));
  check(EVP_DigestFinal_ex(ctx.p, md, &len));
  return std::vector<uint8_t>(md, md + len);
}

std::string sha256_hex(const uint8_t* data, size_t n) {
  const std::vector<uint8_t> md = sha256_bytes(data, n);
  return hex(md.data(), static_cast<unsigned>(md.size()));
}

std::string file_sha256_hex(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) throw Failure(ORCHARD_ERR_IO, path + ": cannot be opened");
  MdCtx ctx;
  if (ctx.p == nullptr) throw std::bad_alloc();
  check(EVP_DigestInit_ex(ctx.p, EVP_sha256(), nullptr));
  std::vector<unsigned char> block(1 << 20);
  size_t got;
  while ((got = std::fread(block.data(), 1, block.size(), f.get())) > 0) check(EVP_DigestUpdate(ctx.p, block.data(), got));
  if (std::ferror(f.get())) throw Failure(ORCHARD_ERR_IO, path + ": read failed");
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned len = 0;
  check(EVP_DigestFinal_ex(ctx.p, md, &len));
  return hex(md, len);
}

}  // namespace orchard
