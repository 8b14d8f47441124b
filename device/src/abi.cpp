// The C ABI (include/orchard_device.h): handles, status codes and messages around the
// C++ below it. Every entry point catches everything; nothing unwinds into C.
#include <new>
#include <string>

#include "bundle.h"
#include "failure.h"
#include "orchard_device.h"

struct orchard_device {
  orchard_status code = ORCHARD_OK;
  std::string message;
  orchard::Bundle bundle;
  bool opened = false;
};

namespace {

// Run `body` on `dev`, recording its outcome as the handle's last status and message.
template <typename F>
orchard_status guarded(orchard_device* dev, F&& body) noexcept {
  orchard_status code = ORCHARD_OK;
  std::string message;
  try {
    body();
  } catch (const orchard::Failure& f) {
    code = f.code();
    message = f.what();
  } catch (const std::bad_alloc&) {
    code = ORCHARD_ERR_NOMEM;
    message = "out of memory";
  } catch (const std::exception& e) {
    code = ORCHARD_ERR_INTERNAL;
    message = std::string("internal error: ") + e.what();
  } catch (...) {
    code = ORCHARD_ERR_INTERNAL;
    message = "internal error: unknown exception";
  }
  dev->code = code;
  try {
    dev->message = std::move(message);
  } catch (...) {
    dev->message.clear();  // cannot hold the message: the code still says what failed
  }
  return code;
}

}  // namespace

extern "C" {

const char* orchard_status_name(int status) {
  switch (status) {
    case ORCHARD_OK: return "ORCHARD_OK";
    case ORCHARD_ERR_ARGUMENT: return "ORCHARD_ERR_ARGUMENT";
    case ORCHARD_ERR_NOMEM: return "ORCHARD_ERR_NOMEM";
    case ORCHARD_ERR_IO: return "ORCHARD_ERR_IO";
    case ORCHARD_ERR_BUNDLE: return "ORCHARD_ERR_BUNDLE";
    case ORCHARD_ERR_INTEGRITY: return "ORCHARD_ERR_INTEGRITY";
    case ORCHARD_ERR_PROGRAM: return "ORCHARD_ERR_PROGRAM";
    case ORCHARD_ERR_CODEC: return "ORCHARD_ERR_CODEC";
    case ORCHARD_ERR_AUTH: return "ORCHARD_ERR_AUTH";
    case ORCHARD_ERR_INTERNAL: return "ORCHARD_ERR_INTERNAL";
    default: return "unknown status";
  }
}

const char* orchard_version(void) { return ORCHARD_DEVICE_VERSION; }

orchard_status orchard_device_open(const char* bundle_dir, orchard_device** out) {
  if (out == nullptr) return ORCHARD_ERR_ARGUMENT;
  *out = nullptr;
  orchard_device* dev = new (std::nothrow) orchard_device();
  if (dev == nullptr) return ORCHARD_ERR_NOMEM;
  *out = dev;
  return guarded(dev, [&] {
    if (bundle_dir == nullptr) throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "bundle_dir is NULL");
    dev->bundle = orchard::read_bundle(bundle_dir);
    dev->opened = true;
  });
}

void orchard_device_close(orchard_device* dev) { delete dev; }

const char* orchard_device_errmsg(const orchard_device* dev) {
  if (dev == nullptr) return "the orchard_device handle is NULL (orchard_device_open ran out of memory?)";
  return dev->message.c_str();
}

orchard_status orchard_device_errcode(const orchard_device* dev) {
  return dev == nullptr ? ORCHARD_ERR_ARGUMENT : dev->code;
}

}  // extern "C"
