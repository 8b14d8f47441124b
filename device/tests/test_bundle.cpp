// Bundle checks through the C ABI, against the Python client's verdicts on the same
// bundles (device_vectors.py: bundle.json): same status, and the message names the
// same file.
#include <cmath>
#include <cstring>
#include <string>

#include "check.h"
#include "orchard_device.h"
#include "vectors.h"

TEST(refusals_match_the_python_client) {
  auto cases = vectors::load("bundle.json");
  CHECK(cases.size() >= 10);
  for (auto& c : cases) {
    orchard_device* dev = nullptr;
    const std::string dir = c["dir"];
    orchard_status st = orchard_device_open(dir.c_str(), &dev);
    const std::string msg = orchard_device_errmsg(dev);
    const std::string want = c["status"];
    CHECK_MSG(want == orchard_status_name(st),
              c["case"].get<std::string>() + ": got " + orchard_status_name(st) + " (" + msg + "), want " + want +
                  " (" + c["python_message"].get<std::string>() + ")");
    const std::string file = c["names_file"];
    CHECK_MSG(msg.find(file) != std::string::npos, c["case"].get<std::string>() + ": " + msg);
    CHECK(orchard_device_errcode(dev) == st);
    orchard_device_close(dev);
  }
}

static std::string good_bundle() {
  for (auto& c : vectors::load("bundle.json"))
    if (c["case"] == "good") return c["dir"];
  return "";
}

struct Sensors {
  orchard_device_state state;
  int fail = 0;
  int calls = 0;
};

static int read_sensors(void* user, orchard_device_state* out) {
  auto* s = static_cast<Sensors*>(user);
  ++s->calls;
  if (s->fail) return s->fail;
  *out = s->state;
  return 0;
}

TEST(eligibility_through_the_abi) {
  orchard_device* dev = nullptr;
  CHECK(orchard_device_open(good_bundle().c_str(), &dev) == ORCHARD_OK);
  int reasons = -1;
  CHECK(orchard_device_check_eligibility(dev, &reasons) == ORCHARD_OK);  // no callback: mains, idle, unmetered
  CHECK(reasons == 0);
  CHECK(orchard_device_check_eligibility(dev, nullptr) == ORCHARD_ERR_ARGUMENT);
  // The bundle's policy is the default one: battery floor 20 %, ceiling 45 °C.
  Sensors s{{10.0, 0, 50.0, ORCHARD_THERMAL_UNKNOWN, 1, 1, NAN}};
  CHECK(orchard_device_set_state_source(dev, read_sensors, &s) == ORCHARD_OK);
  CHECK(orchard_device_check_eligibility(dev, &reasons) == ORCHARD_OK);
  CHECK(reasons == (ORCHARD_INELIGIBLE_BATTERY | ORCHARD_INELIGIBLE_THERMAL));
  CHECK_MSG(std::string(orchard_device_errmsg(dev)).find("battery 10.0% is below the floor 20.0%") != std::string::npos,
            orchard_device_errmsg(dev));
  s.state = {NAN, -1, NAN, ORCHARD_THERMAL_SEVERE, 1, 1, NAN};  // no temperature: the OS's verdict counts
  CHECK(orchard_device_check_eligibility(dev, &reasons) == ORCHARD_OK);
  CHECK(reasons == ORCHARD_INELIGIBLE_THERMAL);
  s.state.thermal_status = ORCHARD_THERMAL_MODERATE;  // throttled, not stopped
  CHECK(orchard_device_check_eligibility(dev, &reasons) == ORCHARD_OK);
  CHECK(reasons == 0);
  s.fail = 7;
  CHECK(orchard_device_check_eligibility(dev, &reasons) == ORCHARD_ERR_DEVICE);
  CHECK(std::string(orchard_device_errmsg(dev)).find("returned 7") != std::string::npos);
  CHECK(orchard_device_set_state_source(dev, nullptr, nullptr) == ORCHARD_OK);
  CHECK(orchard_device_check_eligibility(dev, &reasons) == ORCHARD_OK && reasons == 0);
  CHECK(s.calls == 4);
  orchard_device_close(dev);
  // A handle whose open failed refuses everything but errmsg and close.
  CHECK(orchard_device_open("/nonexistent", &dev) == ORCHARD_ERR_BUNDLE);
  CHECK(orchard_device_check_eligibility(dev, &reasons) == ORCHARD_ERR_ARGUMENT);
  orchard_device_close(dev);
}

CHECK_MAIN()
