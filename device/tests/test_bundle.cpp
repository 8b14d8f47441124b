// Bundle checks through the C ABI, against the Python client's verdicts on the same
// bundles (device_vectors.py: bundle.json): same status, and the message names the
// same file.
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

CHECK_MAIN()
