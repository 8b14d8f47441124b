// The C ABI (include/orchard_device.h): handles, status codes and messages around the
// C++ below it. Every entry point catches everything; nothing unwinds into C.
#include <chrono>
#include <thread>
#include <cstdlib>
#include <cmath>
#include <new>
#include <optional>
#include <string>

#include <atomic>
#include <memory>
#include <mutex>

#include "bundle.h"
#include "failure.h"
#include "et_program.h"
#include "identity.h"
#include "link.h"
#include "participate.h"
#include "train.h"
#include "orchard_device.h"
#include "policy.h"
#include "safetensors.h"

struct orchard_device {
  orchard_status code = ORCHARD_OK;
  std::string message;
  orchard::Bundle bundle;
  orchard::DevicePolicy policy;
  bool opened = false;
  orchard_state_fn state_fn = nullptr;
  void* state_user = nullptr;
  orchard::LinkOptions link_options;
  std::string data_dir;  // empty: the identity lives in memory, for this handle
  std::unique_ptr<orchard::NodeIdentity> identity;  // made on first connection
  int64_t bytes_up = 0, bytes_down = 0;  // of the connections closed so far
  std::mutex link_mu;  // guards `link` against orchard_device_cancel from another thread
  std::unique_ptr<orchard::Link> link;
  std::atomic<bool> cancelled{false};
  std::string node_id;
  std::unique_ptr<orchard::TrainingProgram> program;  // loaded on first participation
  orchard::DeviceData data;
  orchard::HeldModel held;  // the last model pulled: the base a downlink delta applies to
  bool joined = false;
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

void require_open(const orchard_device* dev) {
  if (!dev->opened)
    throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "the bundle did not open: this handle only holds that error");
}

std::optional<bool> flag(int v) { return v < 0 ? std::nullopt : std::optional<bool>(v != 0); }
std::optional<double> number(double v) { return std::isnan(v) ? std::nullopt : std::optional<double>(v); }

// The app's reading as the policy's DeviceState. A device that reports only the OS's
// thermal status gets a temperature standing for it (the header says which).
orchard::DeviceState read_state(orchard_device* dev) {
  orchard::DeviceState s;
  if (dev->state_fn == nullptr) {
    s.charging = true;
    s.unmetered_network = true;
    s.idle = true;
    return s;
  }
  orchard_device_state raw{NAN, -1, NAN, ORCHARD_THERMAL_UNKNOWN, -1, -1, NAN};
  const int rc = dev->state_fn(dev->state_user, &raw);
  if (rc != 0)
    throw orchard::Failure(ORCHARD_ERR_DEVICE, "the device-state callback failed (returned " + std::to_string(rc) + ")");
  s.battery_percent = number(raw.battery_percent);
  s.charging = flag(raw.charging);
  s.temperature_c = number(raw.temperature_c);
  s.unmetered_network = flag(raw.unmetered_network);
  s.idle = flag(raw.idle);
  s.energy_j = number(raw.energy_j);
  if (!s.temperature_c && raw.thermal_status >= ORCHARD_THERMAL_MODERATE) {
    const double hard = dev->policy.hard_ceiling_c();
    s.temperature_c = raw.thermal_status >= ORCHARD_THERMAL_SEVERE
                          ? std::max(hard, dev->policy.eligibility.max_temperature_c)
                          : hard - dev->policy.pacing.throttle_band_c / 2;
  }
  return s;
}

bool loopback(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address.rfind("localhost:", 0) == 0 || address.rfind("[::1]:", 0) == 0;
}

// The link to the server, made on first use from the bundle and the options.
orchard::Link& link_of(orchard_device* dev) {
  if (dev->cancelled.load()) throw orchard::Failure(ORCHARD_ERR_CANCELLED, "cancelled");
  if (!dev->link) {
    orchard::LinkOptions o = dev->link_options;
    if (o.target.empty()) o.target = dev->bundle.server_address;
    if (o.insecure && !loopback(o.target))
      throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "insecure (plaintext) is for loopback development only, not " + o.target);
    if (!o.insecure) o.ca_pem = dev->bundle.ca_pem;
    o.token = dev->bundle.token;
    o.task = dev->bundle.manifest.task;
    o.root_public_key = dev->bundle.root_public_key;
    if (!dev->identity)
      dev->identity = std::make_unique<orchard::NodeIdentity>(dev->data_dir.empty() ? "" : dev->data_dir + "/identity");
    o.identity = dev->identity.get();
    auto link = std::make_unique<orchard::Link>(o);
    std::lock_guard<std::mutex> g(dev->link_mu);
    dev->link = std::move(link);
  }
  return *dev->link;
}

// Close the connection (a new one is made on next use), keeping its traffic counts.
void drop_link(orchard_device* dev) {
  std::lock_guard<std::mutex> g(dev->link_mu);
  if (dev->link) {
    dev->bytes_up += dev->link->bytes_up();
    dev->bytes_down += dev->link->bytes_down();
  }
  dev->link.reset();
}

double wall_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
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
    case ORCHARD_ERR_DEVICE: return "ORCHARD_ERR_DEVICE";
    case ORCHARD_ERR_SECAGG: return "ORCHARD_ERR_SECAGG";
    case ORCHARD_ERR_UNAVAILABLE: return "ORCHARD_ERR_UNAVAILABLE";
    case ORCHARD_ERR_TLS: return "ORCHARD_ERR_TLS";
    case ORCHARD_ERR_REFUSED: return "ORCHARD_ERR_REFUSED";
    case ORCHARD_ERR_PROTOCOL: return "ORCHARD_ERR_PROTOCOL";
    case ORCHARD_ERR_CANCELLED: return "ORCHARD_ERR_CANCELLED";
    case ORCHARD_ERR_NO_TASK: return "ORCHARD_ERR_NO_TASK";
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
    dev->policy = orchard::DevicePolicy::from_json(dev->bundle.config.value("policy", nlohmann::json()));
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

orchard_status orchard_device_set_state_source(orchard_device* dev, orchard_state_fn fn, void* user) {
  if (dev == nullptr) return ORCHARD_ERR_ARGUMENT;
  return guarded(dev, [&] {
    dev->state_fn = fn;
    dev->state_user = fn == nullptr ? nullptr : user;
  });
}

orchard_status orchard_device_check_eligibility(orchard_device* dev, int* reasons) {
  if (dev == nullptr) return ORCHARD_ERR_ARGUMENT;
  std::string words;
  orchard_status st = guarded(dev, [&] {
    if (reasons == nullptr) throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "reasons is NULL");
    require_open(dev);
    orchard::Eligibility e = orchard::evaluate(read_state(dev), dev->policy, wall_now());
    int bits = 0;
    for (const auto& r : e.reasons) {
      const std::string& c = r.code;
      bits |= c == "power" ? ORCHARD_INELIGIBLE_POWER : c == "battery" ? ORCHARD_INELIGIBLE_BATTERY
            : c == "thermal" ? ORCHARD_INELIGIBLE_THERMAL : c == "network" ? ORCHARD_INELIGIBLE_NETWORK
            : c == "idle" ? ORCHARD_INELIGIBLE_IDLE : ORCHARD_INELIGIBLE_WINDOW;
      words += (words.empty() ? "" : "; ") + c + ": " + r.message;
    }
    *reasons = bits;
  });
  if (st == ORCHARD_OK) dev->message = std::move(words);
  return st;
}

orchard_status orchard_device_set_option(orchard_device* dev, const char* name, const char* value) {
  if (dev == nullptr) return ORCHARD_ERR_ARGUMENT;
  return guarded(dev, [&] {
    if (name == nullptr || value == nullptr) throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "name or value is NULL");
    require_open(dev);
    const std::string n = name, v = value;
    orchard::LinkOptions& o = dev->link_options;
    if (n == "server_address") {
      o.target = v;
    } else if (n == "node_id") {
      o.node_id = v;
    } else if (n == "attempts") {
      char* end = nullptr;
      const long a = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || a < 1 || a > 1000)
        throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "attempts must be an integer in 1..1000, got '" + v + "'");
      o.attempts = static_cast<int>(a);
    } else if (n == "data_dir") {
      // A new identity store: the key and credential kept there (or a new key).
      dev->data_dir = v;
      dev->identity.reset();
      dev->joined = false;
    } else if (n == "insecure") {
      if (v != "0" && v != "1") throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "insecure is \"0\" or \"1\"");
      o.insecure = v == "1";
    } else {
      throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "unknown option '" + n +
                                                       "' (server_address, node_id, attempts, insecure, data_dir)");
    }
    // A new connection with the new options on next use.
    drop_link(dev);
  });
}

orchard_status orchard_device_join(orchard_device* dev) {
  if (dev == nullptr) return ORCHARD_ERR_ARGUMENT;
  return guarded(dev, [&] {
    require_open(dev);
    orchard::Link& link = link_of(dev);
    link.join(read_state(dev));
    dev->node_id = link.node_id();
    dev->joined = true;
  });
}

orchard_status orchard_device_set_text(orchard_device* dev, const char* text, size_t len) {
  if (dev == nullptr) return ORCHARD_ERR_ARGUMENT;
  return guarded(dev, [&] {
    if (text == nullptr && len > 0) throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "text is NULL");
    require_open(dev);
    const std::string path = dev->bundle.dir + "/tokenizer.json";
    const nlohmann::json tok = nlohmann::json::parse(orchard::read_file(path, ORCHARD_ERR_BUNDLE, " is missing: the "
                                                     "bundle is not a text task's"), nullptr, false);
    if (tok.is_discarded() || !tok.contains("chars") || !tok["chars"].is_array())
      throw orchard::Failure(ORCHARD_ERR_BUNDLE, path + " holds no character vocabulary (chars)");
    orchard::DeviceData d = orchard::text_windows(std::string(text == nullptr ? "" : text, len),
                                                  tok["chars"].get<std::vector<std::string>>(),
                                                  static_cast<size_t>(dev->bundle.manifest.seq_len));
    if (d.rows == 0)
      throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "the text is too short for one training window of " +
                                                       std::to_string(dev->bundle.manifest.seq_len) + " characters");
    dev->data = std::move(d);
  });
}

orchard_status orchard_device_participate(orchard_device* dev, double max_wait_s, orchard_round_report* report) {
  if (dev == nullptr) return ORCHARD_ERR_ARGUMENT;
  std::string reason;
  orchard_status st = guarded(dev, [&] {
    if (report == nullptr) throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "report is NULL");
    if (!(max_wait_s >= 0)) throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "max_wait_s must be >= 0");
    require_open(dev);
    *report = orchard_round_report{-1, 0, 0, 0, 0.0, NAN, 0};
    if (dev->data.rows == 0)
      throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "no training data: call orchard_device_set_text first");
    if (!dev->program) dev->program = std::make_unique<orchard::TrainingProgram>(dev->bundle.manifest);
    orchard::Link& link = link_of(dev);
    if (!dev->joined) {
      link.join(read_state(dev));
      dev->node_id = link.node_id();
      dev->joined = true;
    }
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    orchard::DeviceIO io{[dev] { return read_state(dev); },
                         [t0] { return std::chrono::duration<double>(clock::now() - t0).count(); }, wall_now,
                         [dev](double s) {
                           // Sleep in slices, so a cancel ends a wait at once.
                           const auto until = clock::now() + std::chrono::duration<double>(s);
                           while (clock::now() < until) {
                             if (dev->cancelled.load()) throw orchard::Failure(ORCHARD_ERR_CANCELLED, "cancelled");
                             const auto rest = std::chrono::duration_cast<std::chrono::milliseconds>(until - clock::now());
                             std::this_thread::sleep_for(std::min(rest, std::chrono::milliseconds(50)));
                           }
                         }};
    orchard::Participant p{link, dev->bundle, dev->policy, *dev->program, dev->data, io};
    p.held = &dev->held;
    orchard::RoundReport r = orchard::participate(p, max_wait_s);
    *report = orchard_round_report{r.round, r.uploaded ? 1 : 0, r.num_steps, r.num_examples, r.weight, r.train_loss,
                                   r.stop != orchard::StopReason::none && r.stop != orchard::StopReason::completed};
    reason = r.reason;
  });
  if (st == ORCHARD_OK) dev->message = reason;
  return st;
}

orchard_status orchard_device_train_local(orchard_device* dev, int64_t steps, int64_t batch_size, double learning_rate,
                                          orchard_round_report* report) {
  if (dev == nullptr) return ORCHARD_ERR_ARGUMENT;
  return guarded(dev, [&] {
    if (report == nullptr) throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "report is NULL");
    if (steps < 1 || batch_size < 1 || !(learning_rate > 0))
      throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "steps and batch_size must be >= 1 and learning_rate > 0");
    require_open(dev);
    *report = orchard_round_report{-1, 0, 0, 0, 0.0, NAN, 0};
    if (dev->data.rows == 0)
      throw orchard::Failure(ORCHARD_ERR_ARGUMENT, "no training data: call orchard_device_set_text first");
    if (!dev->program) dev->program = std::make_unique<orchard::TrainingProgram>(dev->bundle.manifest);
    // The bundle's adapter, by the program's parameter names (checked at open).
    const auto& named = dev->bundle.config.at("adapter_safetensors");
    const std::string path = dev->bundle.dir + "/" + named.at("name").get<std::string>();
    const std::string bytes = orchard::read_file(path, ORCHARD_ERR_BUNDLE, " cannot be read");
    const auto adapter = orchard::parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path,
                                                    ORCHARD_ERR_BUNDLE);
    std::map<std::string, std::vector<float>> start;
    for (const auto& p : dev->bundle.manifest.parameters)
      start[p.name] = adapter.at(orchard::peft_state_key(p.name)).values;
    orchard::TrainConfig cfg;
    cfg.steps = steps;
    cfg.batch_size = batch_size;
    cfg.learning_rate = learning_rate;
    orchard::TrainResult r = orchard::train(*dev->program, dev->data, start, cfg, 0, nullptr);
    *report = orchard_round_report{-1, 0, r.num_steps, r.num_examples, r.weight, r.train_loss, r.stopped ? 1 : 0};
  });
}

const char* orchard_device_node_id(const orchard_device* dev) { return dev == nullptr ? "" : dev->node_id.c_str(); }

orchard_status orchard_device_certificate(const orchard_device* dev, const uint8_t** data, size_t* len) {
  if (dev == nullptr || data == nullptr || len == nullptr) return ORCHARD_ERR_ARGUMENT;
  static const uint8_t kNone = 0;
  const orchard::Enrolled* held = dev->identity && dev->identity->enrolled() ? &*dev->identity->enrolled() : nullptr;
  *data = held != nullptr && !held->certificate.empty() ? held->certificate.data() : &kNone;
  *len = held != nullptr ? held->certificate.size() : 0;
  return ORCHARD_OK;
}

orchard_status orchard_device_traffic(const orchard_device* dev, int64_t* bytes_up, int64_t* bytes_down) {
  if (dev == nullptr || bytes_up == nullptr || bytes_down == nullptr) return ORCHARD_ERR_ARGUMENT;
  *bytes_up = dev->bytes_up + (dev->link ? dev->link->bytes_up() : 0);
  *bytes_down = dev->bytes_down + (dev->link ? dev->link->bytes_down() : 0);
  return ORCHARD_OK;
}

orchard_status orchard_device_cancel(orchard_device* dev) {
  if (dev == nullptr) return ORCHARD_ERR_ARGUMENT;
  // No errmsg here: another thread may be writing it.
  dev->cancelled.store(true);
  std::lock_guard<std::mutex> g(dev->link_mu);
  if (dev->link) dev->link->cancel();
  return ORCHARD_OK;
}

orchard_status orchard_device_reset_cancel(orchard_device* dev) {
  if (dev == nullptr) return ORCHARD_ERR_ARGUMENT;
  return guarded(dev, [&] {
    dev->cancelled.store(false);
    drop_link(dev);
  });
}

}  // extern "C"
