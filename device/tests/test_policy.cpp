// Device policy against the Python policy and governor (device_vectors.py: policy.json):
// the same eligibility for single states, and for whole governed runs over scripted
// device states the same before_step answers, at the same clock times, after the same
// readings, and the same report.
#include <cmath>
#include <cstdlib>

#include "check.h"
#include "failure.h"
#include "policy.h"
#include "vectors.h"

using namespace orchard;

static std::optional<double> opt_num(const nlohmann::json& j) {
  return j.is_null() ? std::nullopt : std::optional<double>(j.get<double>());
}
static std::optional<bool> opt_bool(const nlohmann::json& j) {
  return j.is_null() ? std::nullopt : std::optional<bool>(j.get<bool>());
}
static DeviceState state_of(const nlohmann::json& j) {
  return {opt_num(j["battery_percent"]), opt_bool(j["charging"]), opt_num(j["temperature_c"]),
          opt_bool(j["unmetered_network"]), opt_bool(j["idle"]), opt_num(j["energy_j"])};
}
static bool same(std::optional<double> a, const nlohmann::json& b) {
  if (b.is_null()) return !a;
  return a && *a == b.get<double>();
}

TEST(eligibility) {
  auto v = vectors::load("policy.json");
  CHECK(v["eligibility"].size() >= 100);
  for (auto& c : v["eligibility"]) {
    DevicePolicy p = DevicePolicy::from_json(c["policy"]);
    Eligibility e = evaluate(state_of(c["state"]), p, c["wall"].get<double>());
    std::vector<std::string> codes;
    for (auto& r : e.reasons) codes.push_back(r.code);
    CHECK_MSG(e.eligible == c["eligible"].get<bool>() && codes == c["codes"].get<std::vector<std::string>>(),
              c.dump());
  }
}

TEST(governed_runs) {
  auto v = vectors::load("policy.json");
  CHECK(v["runs"].size() >= 100);
  int index = 0;
  for (auto& c : v["runs"]) {
    const std::string where = "run " + std::to_string(index++);
    std::vector<DeviceState> states;
    for (auto& s : c["states"]) states.push_back(state_of(s));
    size_t reads = 0;
    double t = 0.0;
    const double wall0 = c["wall_origin"];
    DeviceIO io{[&] { return states[std::min(reads++, states.size() - 1)]; }, [&] { return t; },
                [&] { return wall0 + t; }, [&](double s) { t += s; }};
    Governor gov(io, DevicePolicy::from_json(c["policy"]));
    const double step_s = c["step_s"], units = c["units"];
    size_t i = 0;
    bool agree = true;
    for (int loop = 0; loop < c["max_loops"].get<int>() && agree; ++loop) {
      const bool ok = gov.before_step();
      if (i >= c["events"].size()) {
        agree = false;
        break;
      }
      auto& e = c["events"][i++];
      agree = ok == e["run"].get<bool>() && t == e["t"].get<double>() && reads == e["reads"].get<size_t>();
      CHECK_MSG(agree, where + " event " + std::to_string(i - 1) + ": got run=" + std::to_string(ok) +
                           " t=" + std::to_string(t) + " reads=" + std::to_string(reads) + ", want " + e.dump());
      if (!ok) break;
      t += step_s;
      gov.after_step(units);
    }
    CHECK_MSG(i == c["events"].size(), where + ": " + std::to_string(i) + " events, want " +
                                           std::to_string(c["events"].size()));
    GovernorReport r = gov.report();
    auto& w = c["report"];
    CHECK_MSG(r.steps_done == w["steps_done"].get<int64_t>(), where);
    CHECK_MSG(stop_reason_name(r.stop_reason) == w["stop_reason"].get<std::string>(),
              where + ": " + stop_reason_name(r.stop_reason) + " (" + r.detail + ") vs " + w["stop_reason"].dump());
    CHECK_MSG(r.elapsed_s == w["elapsed_s"].get<double>() && r.active_s == w["active_s"].get<double>() &&
                  r.paused_s == w["paused_s"].get<double>() && r.duty() == w["duty"].get<double>() &&
                  r.work_units == w["work_units"].get<double>(),
              where + " times: " + w.dump());
    CHECK_MSG(same(r.energy_j, w["energy_j"]) && same(r.max_temperature_c, w["max_temperature_c"]) &&
                  same(r.min_battery_percent, w["min_battery_percent"]),
              where + " extremes: " + w.dump());
  }
}

// Daily windows in IANA zones: the same answers as Python's zoneinfo from the same files.
TEST(windows_in_iana_zones) {
  auto v = vectors::load("policy.json");
  CHECK(v["windows"].size() >= 500);
  // The zone files Python read (its TZPATH, or the tzdata package where the host has none).
  ::setenv("ORCHARD_ZONEINFO", v["zoneinfo_dir"].get<std::string>().c_str(), 1);
  for (auto& c : v["windows"]) {
    DevicePolicy p = DevicePolicy::from_json({{"window", c["window"]}});
    const double wall = c["wall"].get<double>();
    CHECK_MSG(p.window->contains(wall) == c["contains"].get<bool>(), c.dump());
    CHECK_MSG(p.window->next_start(wall) == c["next_start"].get<double>(),
              c.dump() + " got " + std::to_string(p.window->next_start(wall)));
  }
}

// POSIX TZ rules past a zone's table, and the ones this client refuses.
TEST(posix_tz_rules) {
  TimeZone::Rule r;
  CHECK(parse_posix_tz("CET-1CEST,M3.5.0,M10.5.0/3", &r) && r.std_offset == 3600 && r.dst_offset == 7200 &&
        r.end.time_s == 3 * 3600);
  CHECK(parse_posix_tz("<+0530>-5:30", &r) && r.std_offset == 19800 && !r.has_dst);
  CHECK(parse_posix_tz("IST-2IDT,M3.4.4/26,M10.5.0", &r) && r.start.time_s == 26 * 3600);
  CHECK(parse_posix_tz("<-03>3<-02>,M3.5.0/-2,M10.5.0/-1", &r) && r.start.time_s == -7200);
  CHECK(parse_posix_tz("EST5EDT", &r) && r.has_dst && r.start.month == 3);
  CHECK(parse_posix_tz("XXX3YYY,J60/2,300", &r) && r.start.kind == 'J' && r.end.kind == 'D');
  CHECK(!parse_posix_tz("CET-1CEST,M13.5.0,M10.5.0", &r));
  CHECK(!parse_posix_tz("C-1", &r));
  CHECK(!parse_posix_tz("CET-1CEST,M3.5.0", &r));
  CHECK(!parse_posix_tz("", &r));
}

TEST(policy_refusals) {
  auto refused = [](const char* text) {
    try {
      DevicePolicy::from_json(nlohmann::json::parse(text));
      return false;
    } catch (const Failure& f) {
      return f.code() == ORCHARD_ERR_BUNDLE;
    }
  };
  CHECK(refused(R"({"eligibility": {"min_battery_percent": 120}})"));
  CHECK(refused(R"({"pacing": {"min_duty": 0}})"));
  CHECK(refused(R"({"budget": {"max_steps": 0}})"));
  CHECK(refused(R"({"window": {"start": "25:00"}})"));
  CHECK(refused(R"({"window": {"start": "01:00", "end": "02:00", "tz": "Europe/Nowhere"}})"));
  CHECK(refused(R"({"window": {"start": "01:00", "end": "02:00", "tz": "../../etc/passwd"}})"));
  CHECK(!refused(R"({"window": {"start": "01:00", "end": "02:00", "tz": "Europe/Paris"}})"));
  CHECK(refused(R"({"surprise": 1})"));
  CHECK(refused(R"({"eligibility": {"require_idle": "yes"}})"));
  CHECK(!refused(R"({"window": {"start": "23:00", "end": "06:00", "tz": "+05:30"}})"));
}

CHECK_MAIN()
