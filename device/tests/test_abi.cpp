// The C ABI's conventions: handles, status codes, messages, NULL arguments.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "check.h"
#include "orchard_device.h"

namespace fs = std::filesystem;

static fs::path scratch(const char* name) {
  fs::path p = fs::temp_directory_path() / (std::string("orchard-device-test-") + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

TEST(status_names) {
  CHECK(std::strcmp(orchard_status_name(ORCHARD_OK), "ORCHARD_OK") == 0);
  CHECK(std::strcmp(orchard_status_name(ORCHARD_ERR_BUNDLE), "ORCHARD_ERR_BUNDLE") == 0);
  CHECK(std::strcmp(orchard_status_name(12345), "unknown status") == 0);
  CHECK(std::strlen(orchard_version()) > 0);
}

TEST(null_arguments) {
  CHECK(orchard_device_open("x", nullptr) == ORCHARD_ERR_ARGUMENT);
  orchard_device* dev = nullptr;
  CHECK(orchard_device_open(nullptr, &dev) == ORCHARD_ERR_ARGUMENT);
  CHECK(dev != nullptr);
  CHECK(std::strstr(orchard_device_errmsg(dev), "NULL") != nullptr);
  orchard_device_close(dev);
  orchard_device_close(nullptr);
  CHECK(std::strlen(orchard_device_errmsg(nullptr)) > 0);
  CHECK(orchard_device_errcode(nullptr) == ORCHARD_ERR_ARGUMENT);
}

TEST(not_a_bundle) {
  fs::path dir = scratch("empty");
  orchard_device* dev = nullptr;
  CHECK(orchard_device_open(dir.c_str(), &dev) == ORCHARD_ERR_BUNDLE);
  CHECK(orchard_device_errcode(dev) == ORCHARD_ERR_BUNDLE);
  CHECK_MSG(std::strstr(orchard_device_errmsg(dev), "client.json") != nullptr, orchard_device_errmsg(dev));
  orchard_device_close(dev);
  fs::remove_all(dir);
}

TEST(malformed_client_json) {
  fs::path dir = scratch("malformed");
  const char* bodies[] = {"{not json", "[1, 2]", "{\"format_version\": 2}", "{}"};
  for (const char* body : bodies) {
    std::ofstream(dir / "client.json") << body;
    orchard_device* dev = nullptr;
    CHECK_MSG(orchard_device_open(dir.c_str(), &dev) == ORCHARD_ERR_BUNDLE, body);
    CHECK_MSG(std::strstr(orchard_device_errmsg(dev), "client.json") != nullptr, orchard_device_errmsg(dev));
    orchard_device_close(dev);
  }
  fs::remove_all(dir);
}

CHECK_MAIN()
