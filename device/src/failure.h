// Failures inside the library: one exception type carrying the ABI status it maps to.
// Code below the ABI throws Failure; every ABI function catches it (and bad_alloc, and
// anything else, as ORCHARD_ERR_INTERNAL) so nothing propagates into C callers.
#pragma once

#include <stdexcept>
#include <string>

#include "orchard_device.h"

namespace orchard {

class Failure : public std::runtime_error {
 public:
  Failure(orchard_status code, const std::string& message) : std::runtime_error(message), code_(code) {}
  orchard_status code() const noexcept { return code_; }

 private:
  orchard_status code_;
};

}  // namespace orchard
