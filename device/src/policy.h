// Device policy: when a device may train, and the governor that paces a round inside
// its thermal, battery, energy and time budget. A port of edge_runtime/policy.py and
// edge_runtime/governor.py with the same decisions: device_vectors.py runs the Python
// governor over scripted device states and test_policy replays them here.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "timezone.h"

namespace orchard {

// orchard.typing.DeviceState; energy_j is extra["energy_j"], a cumulative counter.
struct DeviceState {
  std::optional<double> battery_percent;
  std::optional<bool> charging;
  std::optional<double> temperature_c;
  std::optional<bool> unmetered_network;
  std::optional<bool> idle;
  std::optional<double> energy_j;
};

struct EligibilityConfig {
  double min_battery_percent = 20.0;
  bool allow_on_battery = true;
  double max_temperature_c = 45.0;
  bool require_unmetered = false;
  bool require_idle = false;
};

// A daily window [start, end) in minutes after midnight; tz: "" for the host's local
// zone, a fixed offset in minutes east of UTC ("UTC", "+05:30"), or an IANA zone
// ("Europe/Paris", read from the system's zoneinfo: timezone.h).
struct DailyWindow {
  int start_min = 0;
  int end_min = 0;
  bool local = true;
  int offset_min = 0;
  std::shared_ptr<const TimeZone> zone;  // set for an IANA zone
  std::string start, end;
  bool contains(double wall_s) const;
  double next_start(double wall_s) const;
};

struct RoundBudget {
  std::optional<double> energy_j;
  std::optional<double> time_s;
  std::optional<int64_t> max_steps;
};

struct PacingConfig {
  std::optional<double> hard_ceiling_c;
  double throttle_band_c = 5.0;
  double min_duty = 0.1;
  double cooldown_quantum_s = 1.0;
  double max_cooldown_s = 300.0;
  double prior_rise_c = 1.0;
  double prior_drop_percent = 1.0;
  double safety_factor = 1.25;
  int history = 16;
  std::optional<double> joules_per_unit;
};

struct DevicePolicy {
  EligibilityConfig eligibility;
  std::optional<DailyWindow> window;
  RoundBudget budget;
  PacingConfig pacing;
  double hard_ceiling_c() const { return pacing.hard_ceiling_c.value_or(eligibility.max_temperature_c); }
  double battery_floor_percent() const { return eligibility.min_battery_percent; }
  // client.json's "policy" (edge_runtime.policy.DevicePolicy). Throws Failure
  // (ORCHARD_ERR_BUNDLE) naming the field for anything out of range or unknown.
  static DevicePolicy from_json(const nlohmann::json& j);
};

struct Reason {
  std::string code;  // power, battery, thermal, network, idle, window
  std::string message;
};

struct Eligibility {
  bool eligible = true;
  std::vector<Reason> reasons;
};

Eligibility check_eligibility(const DeviceState& s, const EligibilityConfig& e, double wall_s,
                              const std::optional<DailyWindow>& window);
Eligibility evaluate(const DeviceState& s, const DevicePolicy& p, double wall_s);
// When the device may next train if the clock alone decides (the window); nullopt
// when it waits on the device itself.
std::optional<double> next_eligible_time(const DeviceState& s, const DevicePolicy& p, double wall_s);

enum class StopReason { none, completed, time_budget, energy_budget, thermal_ceiling, battery_floor, ineligible };
const char* stop_reason_name(StopReason r);  // governor.StopReason's values

enum class Action { run, cool, stop };

struct Decision {
  Action action = Action::run;
  StopReason reason = StopReason::none;
  std::string detail;
};

struct StepSample {
  double units, seconds;
  std::optional<double> rise_c, drop_percent, energy_j;
};

struct StepEstimate {
  double rise_c, drop_percent, energy_j, seconds;
  double drain_percent_per_s = 0.0, energy_j_per_s = 0.0;
};

double duty_cycle(std::optional<double> temperature_c, double hard_ceiling_c, double band_c, double min_duty);
StepEstimate estimate_next_step(const std::deque<StepSample>& history, double next_units, const PacingConfig& pacing,
                                std::optional<bool> charging, const std::deque<StepSample>& rests);
Decision decide(const DeviceState& s, const DevicePolicy& p, const StepEstimate& est, double wall_s, double elapsed_s,
                double energy_used_j, int64_t steps_done);
Decision check_rest(const DeviceState& s, const DevicePolicy& p, const StepEstimate& est, double rest_s,
                    double elapsed_s, double energy_used_j);

// What the governor reads and sleeps on: the app's sensors and the clock (a virtual
// one in tests). read() may fail by throwing Failure; sleep() may be cut short by a
// cancel (it then throws Failure(ORCHARD_ERR_CANCELLED)).
struct DeviceIO {
  std::function<DeviceState()> read;
  std::function<double()> monotonic;
  std::function<double()> wall;
  std::function<void(double)> sleep;
};

struct GovernorReport {
  int64_t steps_done = 0;
  double work_units = 0;
  StopReason stop_reason = StopReason::none;
  std::string detail;
  double elapsed_s = 0, active_s = 0, paused_s = 0;
  std::optional<double> energy_j, max_temperature_c, min_battery_percent;
  double duty() const {
    const double total = active_s + paused_s;
    return total > 0 ? active_s / total : 1.0;
  }
  bool stopped_early() const { return stop_reason != StopReason::none && stop_reason != StopReason::completed; }
};

// orchard.trainer.StepGate: asked before every local step, told after it.
struct StepGate {
  virtual ~StepGate() = default;
  virtual bool before_step() = 0;
  virtual void after_step(double work_units) = 0;
};

// governor.Governor: before_step() may pause (duty cycle, cooling) and says whether
// the next step may run; after_step(units) records it.
class Governor : public StepGate {
 public:
  Governor(DeviceIO io, DevicePolicy policy);
  bool before_step() override;
  void after_step(double work_units = 1.0) override;
  bool stopped() const { return stop_.has_value(); }
  GovernorReport report() const;

 private:
  DeviceState read_state();
  DeviceState current();
  StepEstimate estimate(const DeviceState& s) const;
  std::optional<Decision> rest(DeviceState& s, double seconds);  // a stop decision, or s moved on
  double elapsed() const;
  bool halt(Decision d);

  DeviceIO io_;
  DevicePolicy policy_;
  std::deque<StepSample> history_, rests_;
  int64_t steps_ = 0;
  double units_ = 0, active_ = 0, paused_ = 0, energy_ = 0;
  bool energy_known_ = true;
  std::optional<double> max_t_, min_b_, counter_, t0_;
  std::optional<Decision> stop_;
  std::optional<std::pair<double, DeviceState>> before_;
  double last_units_ = 1.0;
  std::optional<DeviceState> last_state_;
  std::optional<double> last_read_at_;
};

}  // namespace orchard
