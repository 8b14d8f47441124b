#include "policy.h"

#include <cmath>
#include <cstdio>
#include <ctime>
#include <set>

#include "failure.h"

namespace orchard {

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// ---- client.json's policy, validated as DevicePolicy's pydantic model does

struct Reader {
  const nlohmann::json& j;
  std::string where;
  std::set<std::string> known;

  Reader(const nlohmann::json& obj, std::string w) : j(obj), where(std::move(w)) {
    if (!j.is_object()) throw Failure(ORCHARD_ERR_BUNDLE, where + " must be an object");
  }
  const nlohmann::json* get(const char* k) {
    known.insert(k);
    auto it = j.find(k);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  [[noreturn]] void bad(const char* k, const char* want) {
    throw Failure(ORCHARD_ERR_BUNDLE, where + "." + k + " must be " + want + ", got " + j[k].dump());
  }
  // A number with an optional lower bound (strict or not) and upper bound.
  void num(const char* k, double& out, double lo = -INFINITY, bool strict = false, double hi = INFINITY) {
    if (auto v = get(k)) {
      if (!v->is_number()) bad(k, "a number");
      double x = v->get<double>();
      if (strict ? !(x > lo) : !(x >= lo)) bad(k, strict ? "> its lower bound" : ">= its lower bound");
      if (!(x <= hi)) bad(k, "<= its upper bound");
      out = x;
    }
  }
  void opt_num(const char* k, std::optional<double>& out, double lo = -INFINITY, bool strict = false) {
    known.insert(k);
    if (j.contains(k) && !j[k].is_null()) {
      double x = 0;
      num(k, x, lo, strict);
      out = x;
    }
  }
  void boolean(const char* k, bool& out) {
    if (auto v = get(k)) {
      if (!v->is_boolean()) bad(k, "true or false");
      out = v->get<bool>();
    }
  }
  void done() {
    for (auto it = j.begin(); it != j.end(); ++it)
      if (!known.count(it.key())) throw Failure(ORCHARD_ERR_BUNDLE, where + " has an unknown field '" + it.key() + "'");
  }
};

int parse_hhmm(const std::string& text, const std::string& where) {
  unsigned h = 0, m = 0;
  char extra = 0;
  if (text.size() < 3 || std::sscanf(text.c_str(), "%u:%u%c", &h, &m, &extra) != 2 || h > 23 || m > 59 ||
      text.find(':') == std::string::npos)
    throw Failure(ORCHARD_ERR_BUNDLE, where + ": expected HH:MM with HH in 00..23 and MM in 00..59, got '" + text + "'");
  return static_cast<int>(60 * h + m);
}

double local_offset_s(double wall_s) {
  std::time_t t = static_cast<std::time_t>(std::floor(wall_s));
  std::tm tm{};
  localtime_r(&t, &tm);
  return static_cast<double>(tm.tm_gmtoff);
}

}  // namespace

DevicePolicy DevicePolicy::from_json(const nlohmann::json& j) {
  DevicePolicy p;
  if (j.is_null()) return p;
  Reader r(j, "client.json policy");
  if (auto e = r.get("eligibility")) {
    Reader q(*e, r.where + ".eligibility");
    q.num("min_battery_percent", p.eligibility.min_battery_percent, 0.0, false, 100.0);
    q.boolean("allow_on_battery", p.eligibility.allow_on_battery);
    q.num("max_temperature_c", p.eligibility.max_temperature_c);
    q.boolean("require_unmetered", p.eligibility.require_unmetered);
    q.boolean("require_idle", p.eligibility.require_idle);
    q.done();
  }
  if (auto w = r.get("window")) {
    Reader q(*w, r.where + ".window");
    DailyWindow win;
    auto s = q.get("start"), e = q.get("end"), tz = q.get("tz");
    win.start = s ? s->get<std::string>() : "00:00";
    win.end = e ? e->get<std::string>() : "00:00";
    win.start_min = parse_hhmm(win.start, q.where + ".start");
    win.end_min = parse_hhmm(win.end, q.where + ".end");
    if (tz) {
      const std::string name = tz->is_string() ? tz->get<std::string>() : "";
      win.local = false;
      if (name == "UTC" || name == "utc") {
        win.offset_min = 0;
      } else if (!name.empty() && (name[0] == '+' || name[0] == '-')) {
        win.offset_min = (name[0] == '-' ? -1 : 1) * parse_hhmm(name.substr(1), q.where + ".tz");
      } else {
        try {
          win.zone = TimeZone::load(name);
        } catch (const Failure& f) {
          throw Failure(ORCHARD_ERR_BUNDLE, q.where + ".tz: " + f.what());
        }
      }
    }
    q.done();
    p.window = win;
  }
  if (auto b = r.get("budget")) {
    Reader q(*b, r.where + ".budget");
    q.opt_num("energy_j", p.budget.energy_j, 0.0, true);
    q.opt_num("time_s", p.budget.time_s, 0.0, true);
    if (auto m = q.get("max_steps")) {
      if (!m->is_number_integer() || m->get<int64_t>() < 1) q.bad("max_steps", "an int >= 1");
      p.budget.max_steps = m->get<int64_t>();
    }
    q.done();
  }
  if (auto c = r.get("pacing")) {
    Reader q(*c, r.where + ".pacing");
    PacingConfig& pc = p.pacing;
    q.opt_num("hard_ceiling_c", pc.hard_ceiling_c);
    q.num("throttle_band_c", pc.throttle_band_c, 0.0, true);
    q.num("min_duty", pc.min_duty, 0.0, true, 1.0);
    q.num("cooldown_quantum_s", pc.cooldown_quantum_s, 0.0, true);
    q.num("max_cooldown_s", pc.max_cooldown_s, 0.0);
    q.num("prior_rise_c", pc.prior_rise_c, 0.0);
    q.num("prior_drop_percent", pc.prior_drop_percent, 0.0);
    q.num("safety_factor", pc.safety_factor, 1.0);
    if (auto h = q.get("history")) {
      if (!h->is_number_integer() || h->get<int64_t>() < 1 || h->get<int64_t>() > 1 << 20)
        q.bad("history", "an int >= 1");
      pc.history = h->get<int>();
    }
    q.opt_num("joules_per_unit", pc.joules_per_unit, 0.0, true);
    // PacingConfig.sensor_lag_s / sensor_noise_c: the margin for a lagging or noisy
    // temperature sensor (edge_runtime/pacing.py, sensor_margin) is not ported yet, so a
    // policy that states one is refused rather than run without it.
    for (const char* k : {"sensor_lag_s", "sensor_noise_c"}) {
      double x = 0.0;
      q.num(k, x, 0.0);
      if (x != 0.0)
        throw Failure(ORCHARD_ERR_BUNDLE, r.where + ".pacing." + k + " is " + std::to_string(x) +
                                              ": this native client keeps no margin for a lagging or noisy "
                                              "sensor yet; set it to 0 or run the Python client");
    }
    q.done();
  }
  // DevicePolicy.replay (a continual run's replay buffer): null, the default, is no buffer.
  if (r.get("replay"))
    throw Failure(ORCHARD_ERR_BUNDLE, r.where + ".replay sets a replay buffer, which this native client does not "
                                                "keep (continual training is not native): remove it from the policy");
  r.done();
  return p;
}

bool DailyWindow::contains(double wall_s) const {
  if (start_min == end_min) return true;
  const double offset = zone   ? static_cast<double>(zone->utc_offset(static_cast<int64_t>(std::floor(wall_s))))
                        : local ? local_offset_s(wall_s)
                                : 60.0 * offset_min;
  const double day_s = std::fmod(std::floor(wall_s + offset), 86400.0);
  const int minute = static_cast<int>((day_s < 0 ? day_s + 86400.0 : day_s) / 60.0);
  if (start_min < end_min) return start_min <= minute && minute < end_min;
  return minute >= start_min || minute < end_min;
}

double DailyWindow::next_start(double wall_s) const {
  if (contains(wall_s)) return wall_s;
  if (zone) {
    // As Python's aware datetimes do: today's start as a wall-clock time in the zone,
    // else tomorrow's, each resolved to UTC with the offset in force then.
    const int64_t t = static_cast<int64_t>(std::floor(wall_s));
    const int64_t local_s = t + zone->utc_offset(t);
    const int64_t midnight = (local_s >= 0 ? local_s / 86400 : (local_s - 86399) / 86400) * 86400;
    int64_t candidate = zone->to_utc(midnight + 60 * static_cast<int64_t>(start_min));
    if (static_cast<double>(candidate) <= wall_s) candidate = zone->to_utc(midnight + 86400 + 60 * static_cast<int64_t>(start_min));
    return static_cast<double>(candidate);
  }
  // As the Python window does: the offset in force at wall_s, kept for the next day.
  const double offset = local ? local_offset_s(wall_s) : 60.0 * offset_min;
  const double local_s = wall_s + offset;
  const double midnight = std::floor(local_s / 86400.0) * 86400.0;
  double candidate = midnight + 60.0 * start_min - offset;
  if (candidate <= wall_s) candidate += 86400.0;
  return candidate;
}

Eligibility check_eligibility(const DeviceState& s, const EligibilityConfig& e, double wall_s,
                              const std::optional<DailyWindow>& window) {
  Eligibility out;
  const bool on_power = s.charging.value_or(false);
  if (s.battery_percent && !on_power) {
    if (!e.allow_on_battery) {
      out.reasons.push_back({"power", "not on external power and allow_on_battery is false"});
    } else if (*s.battery_percent < e.min_battery_percent) {
      out.reasons.push_back({"battery", "battery " + fmt("%.1f", *s.battery_percent) + "% is below the floor " +
                                            fmt("%.1f", e.min_battery_percent) + "% and the device is not charging"});
    }
  }
  if (s.temperature_c && *s.temperature_c >= e.max_temperature_c)
    out.reasons.push_back({"thermal", "temperature " + fmt("%.1f", *s.temperature_c) +
                                          " °C is at or above the ceiling " + fmt("%.1f", e.max_temperature_c) + " °C"});
  if (e.require_unmetered && s.unmetered_network != std::optional<bool>(true))
    out.reasons.push_back({"network", std::string("network is ") + (s.unmetered_network ? "metered" : "unknown") +
                                          " and an unmetered one is required"});
  if (e.require_idle && s.idle != std::optional<bool>(true))
    out.reasons.push_back(
        {"idle", std::string("device is ") + (s.idle ? "in use" : "unknown") + " and idleness is required"});
  if (window && !window->contains(wall_s))
    out.reasons.push_back({"window", "outside the daily window " + window->start + "-" + window->end});
  out.eligible = out.reasons.empty();
  return out;
}

Eligibility evaluate(const DeviceState& s, const DevicePolicy& p, double wall_s) {
  return check_eligibility(s, p.eligibility, wall_s, p.window);
}

std::optional<double> next_eligible_time(const DeviceState& s, const DevicePolicy& p, double wall_s) {
  Eligibility d = evaluate(s, p, wall_s);
  if (d.eligible) return wall_s;
  bool only_window = p.window.has_value();
  for (auto& r : d.reasons) only_window = only_window && r.code == "window";
  if (only_window) return p.window->next_start(wall_s);
  return std::nullopt;
}

const char* stop_reason_name(StopReason r) {
  switch (r) {
    case StopReason::completed: return "completed";
    case StopReason::time_budget: return "time_budget";
    case StopReason::energy_budget: return "energy_budget";
    case StopReason::thermal_ceiling: return "thermal_ceiling";
    case StopReason::battery_floor: return "battery_floor";
    case StopReason::ineligible: return "ineligible";
    case StopReason::none: break;
  }
  return "";
}

double duty_cycle(std::optional<double> t, double hard, double band, double min_duty) {
  if (!t) return 1.0;
  const double soft = hard - band;
  if (*t <= soft) return 1.0;
  const double frac = std::min((*t - soft) / band, 1.0);
  return 1.0 - (1.0 - min_duty) * frac;
}

StepEstimate estimate_next_step(const std::deque<StepSample>& history, double next_units, const PacingConfig& pacing,
                                std::optional<bool> charging, const std::deque<StepSample>& rests) {
  const double k = pacing.safety_factor;
  const size_t n = static_cast<size_t>(pacing.history);
  const size_t h0 = history.size() > n ? history.size() - n : 0, r0 = rests.size() > n ? rests.size() - n : 0;
  std::optional<double> rise, drop, energy, seconds, drain, power;
  // Maxima keep the first of equal values, as the Python one-pass loops do.
  auto up = [](std::optional<double>& m, double r) {
    if (!m || r > *m) m = r;
  };
  if (history.size() > h0 || rests.size() > r0) {
    for (size_t i = h0; i < history.size(); ++i) {
      const StepSample& s = history[i];
      if (s.units <= 0) continue;
      up(seconds, s.seconds / s.units);
      if (s.rise_c) up(rise, *s.rise_c / s.units);
      if (s.drop_percent) up(drop, *s.drop_percent / s.units);
      if (s.energy_j) up(energy, *s.energy_j / s.units);
    }
    auto per_second = [&](const std::deque<StepSample>& group, size_t from) {
      for (size_t i = from; i < group.size(); ++i) {
        const StepSample& s = group[i];
        if (s.seconds <= 0) continue;
        if (s.drop_percent) up(drain, *s.drop_percent / s.seconds);
        if (s.energy_j) up(power, *s.energy_j / s.seconds);
      }
    };
    per_second(history, h0);
    per_second(rests, r0);
  }
  if (!energy && pacing.joules_per_unit) energy = pacing.joules_per_unit;
  const double prior_drop = charging.value_or(false) ? 0.0 : pacing.prior_drop_percent;
  if (!drain) drain = prior_drop / pacing.cooldown_quantum_s;
  if (rise && *rise < 0.0) rise = 0.0;
  if (drop && *drop < 0.0) drop = 0.0;
  if (energy && *energy < 0.0) energy = 0.0;
  if (*drain < 0.0) drain = 0.0;
  if (!power || *power == 0.0 || *power < 0.0) power = 0.0;
  StepEstimate e;
  e.rise_c = rise ? k * *rise * next_units : pacing.prior_rise_c;
  e.drop_percent = drop ? k * *drop * next_units : prior_drop;
  e.energy_j = energy ? k * *energy * next_units : 0.0;
  e.seconds = seconds ? k * *seconds * next_units : 0.0;
  e.drain_percent_per_s = k * *drain;
  e.energy_j_per_s = k * *power;
  return e;
}

Decision decide(const DeviceState& s, const DevicePolicy& p, const StepEstimate& est, double wall_s, double elapsed_s,
                double energy_used_j, int64_t steps_done) {
  const RoundBudget& budget = p.budget;
  if (budget.max_steps && steps_done >= *budget.max_steps)
    return {Action::stop, StopReason::completed, "max_steps=" + std::to_string(*budget.max_steps) + " done"};
  // Rules other than battery and temperature (those two are predicted below).
  Eligibility elig = evaluate(s, p, wall_s);
  if (!elig.eligible) {
    std::string others;
    for (auto& r : elig.reasons)
      if (r.code != "battery" && r.code != "thermal") others += (others.empty() ? "" : "; ") + r.code + ": " + r.message;
    if (!others.empty()) return {Action::stop, StopReason::ineligible, others};
  }
  const double drop = est.drop_percent;
  const bool charging_up = s.charging.value_or(false) && drop <= 0.0;
  if (s.battery_percent && !charging_up) {
    const double floor = p.battery_floor_percent();
    if (*s.battery_percent - drop < floor)
      return {Action::stop, StopReason::battery_floor,
              "battery " + fmt("%.2f", *s.battery_percent) + "% minus the next step's predicted " + fmt("%.2f", drop) +
                  "% would pass the floor " + fmt("%.1f", floor) + "%"};
  }
  if (budget.time_s && elapsed_s + est.seconds > *budget.time_s)
    return {Action::stop, StopReason::time_budget,
            fmt("%.1f", elapsed_s) + " s used, next step ~" + fmt("%.2f", est.seconds) + " s, budget " +
                fmt("%.1f", *budget.time_s) + " s"};
  if (budget.energy_j && energy_used_j + est.energy_j > *budget.energy_j)
    return {Action::stop, StopReason::energy_budget,
            fmt("%.1f", energy_used_j) + " J used, next step ~" + fmt("%.2f", est.energy_j) + " J, budget " +
                fmt("%.1f", *budget.energy_j) + " J"};
  if (s.temperature_c) {
    const double t = *s.temperature_c, hard = p.hard_ceiling_c();
    if (t >= hard)
      return {Action::stop, StopReason::thermal_ceiling,
              "temperature " + fmt("%.2f", t) + " °C reached the ceiling " + fmt("%.1f", hard) + " °C"};
    if (t + est.rise_c > hard)
      return {Action::cool, StopReason::none,
              fmt("%.2f", t) + " °C + predicted rise " + fmt("%.2f", est.rise_c) + " °C would pass " +
                  fmt("%.1f", hard) + " °C"};
  }
  return {};
}

Decision check_rest(const DeviceState& s, const DevicePolicy& p, const StepEstimate& est, double rest_s,
                    double elapsed_s, double energy_used_j) {
  const double floor = p.battery_floor_percent();
  const double drain = est.drain_percent_per_s * rest_s + est.drop_percent;
  const bool charging_up = s.charging.value_or(false) && drain <= 0.0;
  if (s.battery_percent && !charging_up && *s.battery_percent - drain < floor)
    return {Action::stop, StopReason::battery_floor,
            "battery " + fmt("%.2f", *s.battery_percent) + "% cannot afford a " + fmt("%.1f", rest_s) +
                " s pause and a step (~" + fmt("%.2f", drain) + "%) above the floor " + fmt("%.1f", floor) + "%"};
  const double e_next = energy_used_j + est.energy_j_per_s * rest_s + est.energy_j;
  if (p.budget.energy_j && e_next > *p.budget.energy_j)
    return {Action::stop, StopReason::energy_budget,
            fmt("%.1f", energy_used_j) + " J used; a " + fmt("%.1f", rest_s) + " s pause and a step would pass " +
                fmt("%.1f", *p.budget.energy_j) + " J"};
  if (p.budget.time_s && elapsed_s + rest_s + est.seconds > *p.budget.time_s)
    return {Action::stop, StopReason::time_budget,
            fmt("%.1f", elapsed_s) + " s used; a " + fmt("%.1f", rest_s) + " s pause and a step would pass " +
                fmt("%.1f", *p.budget.time_s) + " s"};
  return {};
}

// ---------------------------------------------------------------- the governor

namespace {
std::optional<double> diff(std::optional<double> a, std::optional<double> b) {
  if (!a || !b) return std::nullopt;
  return *a - *b;
}
}  // namespace

Governor::Governor(DeviceIO io, DevicePolicy policy) : io_(std::move(io)), policy_(std::move(policy)) {}

DeviceState Governor::read_state() {
  DeviceState s = io_.read();
  if (s.energy_j) {
    // A cumulative counter may wrap: a negative difference is dropped, not trusted.
    if (counter_ && *s.energy_j >= *counter_) energy_ += *s.energy_j - *counter_;
    counter_ = s.energy_j;
  }
  if (s.temperature_c && (!max_t_ || *s.temperature_c > *max_t_)) max_t_ = s.temperature_c;
  if (s.battery_percent && (!min_b_ || *s.battery_percent < *min_b_)) min_b_ = s.battery_percent;
  last_state_ = s;
  last_read_at_ = io_.monotonic();
  return s;
}

DeviceState Governor::current() {
  if (last_state_ && last_read_at_ && *last_read_at_ == io_.monotonic()) return *last_state_;
  return read_state();
}

StepEstimate Governor::estimate(const DeviceState& s) const {
  return estimate_next_step(history_, last_units_, policy_.pacing, s.charging, rests_);
}

double Governor::elapsed() const { return t0_ ? io_.monotonic() - *t0_ : 0.0; }

bool Governor::halt(Decision d) {
  stop_ = std::move(d);
  return false;
}

std::optional<Decision> Governor::rest(DeviceState& s, double seconds) {
  Decision d = check_rest(s, policy_, estimate(s), seconds, elapsed(), energy_);
  if (d.action == Action::stop) return d;
  const double e0 = energy_;
  io_.sleep(seconds);
  paused_ += seconds;
  DeviceState s1 = read_state();
  rests_.push_back({0.0, seconds, diff(s1.temperature_c, s.temperature_c), diff(s.battery_percent, s1.battery_percent),
                    s1.energy_j ? std::optional<double>(energy_ - e0) : std::nullopt});
  while (rests_.size() > static_cast<size_t>(policy_.pacing.history)) rests_.pop_front();
  s = s1;
  return std::nullopt;
}

bool Governor::before_step() {
  if (stop_) return false;
  if (before_) throw Failure(ORCHARD_ERR_INTERNAL, "before_step called twice without after_step in between");
  const auto& max_steps = policy_.budget.max_steps;
  if (max_steps && steps_ >= *max_steps)
    return halt({Action::stop, StopReason::completed, "max_steps=" + std::to_string(*max_steps) + " done"});
  const PacingConfig& pacing = policy_.pacing;
  DeviceState state;
  if (!t0_) {
    t0_ = io_.monotonic();
    state = read_state();
    if (policy_.budget.energy_j && !state.energy_j && !pacing.joules_per_unit)
      throw Failure(ORCHARD_ERR_BUNDLE,
                    "an energy budget is set but this device reports no energy counter: set pacing.joules_per_unit "
                    "to estimate energy from work, or drop budget.energy_j");
  } else {
    state = current();
  }
  if (!history_.empty()) {
    const double duty = duty_cycle(state.temperature_c, policy_.hard_ceiling_c(), pacing.throttle_band_c,
                                   pacing.min_duty);
    if (duty < 1.0) {
      const double step_s = history_.back().seconds;
      if (auto stop = rest(state, step_s * (1.0 - duty) / duty)) return halt(*stop);
    }
  }
  double cooled = 0.0;
  while (true) {
    Decision d = decide(state, policy_, estimate(state), io_.wall(), elapsed(), energy_, steps_);
    if (d.action == Action::run) {
      before_ = std::make_pair(io_.monotonic(), state);
      return true;
    }
    if (d.action == Action::stop) return halt(d);
    const double q = pacing.cooldown_quantum_s;
    if (cooled + q > pacing.max_cooldown_s)
      return halt({Action::stop, StopReason::thermal_ceiling,
                   d.detail + "; cooling for " + fmt("%.0f", cooled) + " s did not make room for a step"});
    if (auto stop = rest(state, q)) return halt(*stop);
    cooled += q;
  }
}

void Governor::after_step(double work_units) {
  if (!before_) throw Failure(ORCHARD_ERR_INTERNAL, "after_step called without a before_step that returned True");
  if (work_units < 0) throw Failure(ORCHARD_ERR_ARGUMENT, "work_units must be >= 0");
  const double t_before = before_->first;
  const DeviceState s0 = before_->second;
  before_.reset();
  const double counter_before = energy_;
  DeviceState s1 = read_state();
  double seconds = io_.monotonic() - t_before;
  if (seconds < 0.0) seconds = 0.0;
  std::optional<double> energy;
  if (s1.energy_j) {
    energy = energy_ - counter_before;
  } else if (policy_.pacing.joules_per_unit) {
    energy = work_units * *policy_.pacing.joules_per_unit;
    energy_ += *energy;
  } else {
    energy_known_ = false;
  }
  history_.push_back(
      {work_units, seconds, diff(s1.temperature_c, s0.temperature_c), diff(s0.battery_percent, s1.battery_percent), energy});
  while (history_.size() > static_cast<size_t>(policy_.pacing.history)) history_.pop_front();
  ++steps_;
  units_ += work_units;
  active_ += seconds;
  if (work_units > 0) last_units_ = work_units;
}

GovernorReport Governor::report() const {
  GovernorReport r;
  r.steps_done = steps_;
  r.work_units = units_;
  if (stop_) {
    r.stop_reason = stop_->reason;
    r.detail = stop_->detail;
  }
  r.elapsed_s = elapsed();
  r.active_s = active_;
  r.paused_s = paused_;
  if (energy_known_) r.energy_j = energy_;
  r.max_temperature_c = max_t_;
  r.min_battery_percent = min_b_;
  return r;
}

}  // namespace orchard
