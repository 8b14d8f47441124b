// A minimal test harness: TEST(name) { CHECK(...); } and one main per test binary.
// Failures print file:line and the expression; the binary exits 1 if any check failed.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace check {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

inline int& failures() {
  static int n = 0;
  return n;
}

struct Register {
  Register(const char* name, std::function<void()> fn) { cases().push_back({name, std::move(fn)}); }
};

inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  ++failures();
}

// The directory of test vectors the Python package wrote ($ORCHARD_DEVICE_VECTORS).
inline std::string vectors_dir() {
  const char* d = std::getenv("ORCHARD_DEVICE_VECTORS");
  if (d == nullptr || *d == '\0') {
    std::fprintf(stderr, "ORCHARD_DEVICE_VECTORS is not set: run tests/device/device_vectors.py DIR and point it there\n");
    std::exit(2);
  }
  return d;
}

}  // namespace check

#define TEST(name)                                                  \
  static void test_##name();                                        \
  static check::Register register_##name(#name, test_##name);       \
  static void test_##name()

#define CHECK(cond)                                                  \
  do {                                                               \
    if (!(cond)) check::fail(__FILE__, __LINE__, #cond);             \
  } while (0)

#define CHECK_MSG(cond, msg)                                                   \
  do {                                                                         \
    if (!(cond)) check::fail(__FILE__, __LINE__, std::string(#cond) + ": " + (msg)); \
  } while (0)

#define CHECK_MAIN()                                                         \
  int main() {                                                               \
    for (auto& c : check::cases()) {                                         \
      int before = check::failures();                                        \
      try {                                                                  \
        c.fn();                                                              \
      } catch (const std::exception& e) {                                    \
        check::fail(__FILE__, __LINE__, std::string(c.name) + " threw " + e.what()); \
      }                                                                      \
      std::printf("%s %s\n", check::failures() == before ? "ok  " : "FAIL", c.name); \
    }                                                                        \
    return check::failures() == 0 ? 0 : 1;                                   \
  }
