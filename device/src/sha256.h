// SHA-256 (OpenSSL's EVP) of bytes and of files, as lowercase hex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace orchard {

std::string sha256_hex(const uint8_t* data, size_t n);
// The 32-byte digest itself.
std::vector<uint8_t> sha256_bytes(const uint8_t* data, size_t n);
// Throws Failure (ORCHARD_ERR_IO) when the file cannot be read.
std::string file_sha256_hex(const std::string& path);

}  // namespace orchard
