/* orchard_device.h: the Orchard device client behind a small C ABI.
 *
 * A phone app (through JNI on Android, directly from Swift or Objective-C on iOS) or
 * any native program links liborchard_device and takes part in an Orchard federation
 * as docs/mobile-contract.md describes, without Python.
 *
 * Conventions (as SQLite's and libcurl's easy interfaces):
 *   - An orchard_device is an opaque handle made by orchard_device_open and released
 *     by orchard_device_close. Nothing else frees it.
 *   - Every call that can fail returns an orchard_status. ORCHARD_OK is 0; anything
 *     else is a failure whose message orchard_device_errmsg returns.
 *   - No C++ exception, type or allocation crosses this boundary. Strings the library
 *     returns are owned by the library: orchard_status_name's live forever, an
 *     errmsg lives until the next call on the same handle. Buffers a caller passes in
 *     stay the caller's; the library copies what it keeps.
 *
 * Threads: a handle is not thread-safe. Use each handle from one thread at a time
 * (calls on different handles may run at once). The one exception is
 * orchard_device_cancel, which any thread may call while another is inside a call on
 * the same handle. orchard_status_name and orchard_version may be called from any
 * thread at any time.
 */
#ifndef ORCHARD_DEVICE_H
#define ORCHARD_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define ORCHARD_API __declspec(dllexport)
#else
#define ORCHARD_API __attribute__((visibility("default")))
#endif

/* The ABI's version: bumped when a declaration here changes incompatibly. */
#define ORCHARD_DEVICE_ABI_VERSION 1

typedef enum orchard_status {
  ORCHARD_OK = 0,
  ORCHARD_ERR_ARGUMENT = 1,    /* a NULL handle or pointer, or a value out of range */
  ORCHARD_ERR_NOMEM = 2,       /* an allocation failed */
  ORCHARD_ERR_IO = 3,          /* a file could not be read */
  ORCHARD_ERR_BUNDLE = 4,      /* the bundle is missing a file, malformed, or of another format */
  ORCHARD_ERR_INTEGRITY = 5,   /* a file's sha256 differs from the one client.json names */
  ORCHARD_ERR_PROGRAM = 6,     /* the training program does not match the adapter */
  ORCHARD_ERR_CODEC = 7,       /* an update cannot be encoded with the run's codec */
  ORCHARD_ERR_AUTH = 8,        /* the credential is unusable, or the server refused it */
  ORCHARD_ERR_DEVICE = 9,      /* the app's device-state callback failed */
  ORCHARD_ERR_SECAGG = 10,     /* a secure-aggregation message was malformed, or the session aborted */
  ORCHARD_ERR_UNAVAILABLE = 11, /* the server cannot be reached, or stopped answering */
  ORCHARD_ERR_TLS = 12,        /* the TLS handshake failed (the server's certificate is not the bundle CA's) */
  ORCHARD_ERR_REFUSED = 13,    /* the server refused a request or an update, or the bundle's program is of a
                                  kind this client does not train; the message says why */
  ORCHARD_ERR_PROTOCOL = 14,   /* the server's answer breaks the contract (a model that fails its sha256, ...) */
  ORCHARD_ERR_CANCELLED = 15,  /* orchard_device_cancel was called */
  ORCHARD_ERR_NO_TASK = 16,    /* no task came within the time the caller allowed */
  ORCHARD_ERR_INTERNAL = 99    /* a bug in the library: the message says where */
} orchard_status;

/* A static, human-readable name of a status ("ORCHARD_ERR_BUNDLE"); "unknown status"
 * for a value not listed above. Never NULL. */
ORCHARD_API const char* orchard_status_name(int status);

/* The library's version string ("0.1.0"). Never NULL. */
ORCHARD_API const char* orchard_version(void);

typedef struct orchard_device orchard_device;

/* Open the client bundle in directory `bundle_dir` (what `orchard client bundle`
 * writes) and check it before anything else is done with it: every sha256 client.json
 * names, and the training program's manifest against the program and the adapter.
 *
 * On return *out is a handle even when the status is not ORCHARD_OK (then it holds
 * only the error, for orchard_device_errmsg), unless memory ran out, when it is NULL.
 * Close it with orchard_device_close either way. */
ORCHARD_API orchard_status orchard_device_open(const char* bundle_dir, orchard_device** out);

/* Release a handle and everything it holds. NULL is a no-op. */
ORCHARD_API void orchard_device_close(orchard_device* dev);

/* The message of the last failed call on `dev` ("" after a success). Valid until the
 * next call on `dev`. Never NULL; for a NULL handle, a static message saying so. */
ORCHARD_API const char* orchard_device_errmsg(const orchard_device* dev);

/* The status of the last call on `dev`. */
ORCHARD_API orchard_status orchard_device_errcode(const orchard_device* dev);

/* ---- Device state: the app's sensors, read through a callback ---------------------
 *
 * The library decides when the device may train (client.json's policy: charging or
 * battery above the floor, temperature under the ceiling, unmetered network, idle, the
 * daily window) and paces training (the governor), with the decisions of Orchard's
 * Python client (edge_runtime/policy.py, governor.py). The app only says how the
 * device is. Unknown values: NaN for a double, -1 for a flag. */

/* The OS's own thermal verdict, for a device that gives no temperature (Android's
 * PowerManager.getCurrentThermalStatus, iOS's ProcessInfo.thermalState). Used only
 * when temperature_c is NaN: NONE and LIGHT pass, MODERATE counts as inside the
 * governor's throttle band (it slows down), SEVERE and above as at the ceiling. */
enum {
  ORCHARD_THERMAL_UNKNOWN = -1,
  ORCHARD_THERMAL_NONE = 0,      /* Android NONE, iOS nominal */
  ORCHARD_THERMAL_LIGHT = 1,     /* Android LIGHT, iOS fair */
  ORCHARD_THERMAL_MODERATE = 2,  /* Android MODERATE, iOS serious */
  ORCHARD_THERMAL_SEVERE = 3     /* Android SEVERE and above, iOS critical */
};

typedef struct orchard_device_state {
  double battery_percent;  /* 0..100; NaN: no battery (a mains-powered device) */
  int charging;            /* 1 on external power, 0 not, -1 unknown */
  double temperature_c;    /* NaN: unknown (then thermal_status is used) */
  int thermal_status;      /* ORCHARD_THERMAL_*; -1 unknown */
  int unmetered_network;   /* 1 unmetered (Wi-Fi), 0 metered, -1 unknown */
  int idle;                /* 1 idle (screen off, not in use), 0 in use, -1 unknown */
  double energy_j;         /* a cumulative energy counter in joules; NaN: none */
} orchard_device_state;

/* Fill *state (the library set every field to "unknown" before the call) and return
 * 0; any other return fails the call that asked with ORCHARD_ERR_DEVICE. Called on the
 * thread of that call, never after orchard_device_close. */
typedef int (*orchard_state_fn)(void* user, orchard_device_state* state);

/* Set (or, with fn NULL, remove) the device-state callback. Without one, the device is
 * taken to be mains powered, idle, on an unmetered network, of unknown temperature. */
ORCHARD_API orchard_status orchard_device_set_state_source(orchard_device* dev, orchard_state_fn fn, void* user);

/* Why a device is not eligible: a bit per rule of the policy that failed. */
enum {
  ORCHARD_INELIGIBLE_POWER = 1 << 0,    /* on battery, and the policy needs external power */
  ORCHARD_INELIGIBLE_BATTERY = 1 << 1,  /* battery below the floor, not charging */
  ORCHARD_INELIGIBLE_THERMAL = 1 << 2,  /* at or above the temperature ceiling */
  ORCHARD_INELIGIBLE_NETWORK = 1 << 3,  /* metered or unknown network, unmetered required */
  ORCHARD_INELIGIBLE_IDLE = 1 << 4,     /* in use or unknown, idleness required */
  ORCHARD_INELIGIBLE_WINDOW = 1 << 5    /* outside the daily window */
};

/* Read the device state once and apply the bundle's policy: *reasons = 0 when the
 * device may train now, else the ORCHARD_INELIGIBLE_* bits; after a success,
 * orchard_device_errmsg holds the reasons in words ("" when eligible). */
ORCHARD_API orchard_status orchard_device_check_eligibility(orchard_device* dev, int* reasons);

/* ---- The federation ------------------------------------------------------------- */

/* Set an option by name; `value` is copied. Names:
 *   "server_address"  HOST:PORT to dial instead of client.json's
 *   "node_id"         this device's stable id (default: the server assigns one)
 *   "attempts"        tries of a call that fails transiently, >= 1 (default 4)
 *   "insecure"        "1": plaintext gRPC without TLS, for loopback development only;
 *                     refused unless server_address is a loopback address
 *   "data_dir"        a directory private to the app: the device's identity key and
 *                     the credential enrollment returns are kept in DATA_DIR/identity
 *                     (mode 0700, files 0600; the Python client's layout), so a
 *                     restarted app resumes the same node. Unset: kept in memory for
 *                     this handle only (a new handle needs a new enrollment token)
 * ORCHARD_ERR_ARGUMENT for an unknown name or a bad value. */
ORCHARD_API orchard_status orchard_device_set_option(orchard_device* dev, const char* name, const char* value);

/* Connect (TLS against the bundle's ca.pem) and Fleet.Join with the device's state.
 * The first Join enrolls the device: it sends its Ed25519 public key (generated on the
 * device; the private key never leaves it) and the signature proving it holds it, with
 * the bundle's enrollment token; the root answers with the device's own credential and
 * a certificate of its key, which are kept (see "data_dir") and the credential used from
 * then on. A credential the server later refuses (revoked) is replaced by enrolling
 * again with the bundle's token. A certificate that does not name this device's key, or
 * a root key other than the one the bundle names, fails with ORCHARD_ERR_AUTH. Fails with ORCHARD_ERR_TLS (the server's
 * certificate is not the CA's), ORCHARD_ERR_AUTH (token refused or revoked),
 * ORCHARD_ERR_UNAVAILABLE (nobody answers), ORCHARD_ERR_CANCELLED. */
ORCHARD_API orchard_status orchard_device_join(orchard_device* dev);

/* The node id the server knows this device by ("" before a join). Valid until the
 * next call on `dev`. */
ORCHARD_API const char* orchard_device_node_id(const orchard_device* dev);

/* The root's certificate of this device's key (orchard/identity.py's format): *data
 * and *len are set to it, or to a length of 0 before enrollment. Valid until the next
 * call on `dev`. */
ORCHARD_API orchard_status orchard_device_certificate(const orchard_device* dev, const uint8_t** data, size_t* len);

/* Bytes this handle has sent (update payloads) and received (model blobs and deltas)
 * over its connections so far. */
ORCHARD_API orchard_status orchard_device_traffic(const orchard_device* dev, int64_t* bytes_up, int64_t* bytes_down);

/* The device's own training data: UTF-8 text, encoded with the bundle's character
 * vocabulary (tokenizer.json) and cut into the program's windows as the Python client
 * cuts it (the first 80 % trains). Copied. ORCHARD_ERR_ARGUMENT for a character the
 * vocabulary lacks, or text too short for one window. */
ORCHARD_API orchard_status orchard_device_set_text(orchard_device* dev, const char* text, size_t len);

/* What one participation did. */
typedef struct orchard_round_report {
  int64_t round;          /* the round served */
  int uploaded;           /* 1: the update was sent and accepted */
  int64_t num_steps;      /* local steps run */
  int64_t num_examples;   /* distinct windows they drew */
  double weight;          /* the update's weight */
  double train_loss;      /* mean token cross-entropy over the steps run (NaN if none) */
  int stopped_early;      /* 1: the governor stopped before the planned steps */
} orchard_round_report;

/* Serve one task: wait (up to max_wait_s seconds, on the device's own clock) until the
 * device is eligible and the server hands out a task, pull the model, train through the
 * bundle's ExecuTorch program under the governor (pacing, budgets, stops) with
 * heartbeats, and push the update. *report says what happened; a round served without
 * an upload (the governor stopped before the first step, the round closed) is
 * ORCHARD_OK with uploaded = 0 and the reason in orchard_device_errmsg. Joins first if
 * orchard_device_join was not called. ORCHARD_ERR_NO_TASK when no task came in time;
 * ORCHARD_ERR_REFUSED when the server refused the update or the run asks for what this
 * client does not do (the message says which). */
ORCHARD_API orchard_status orchard_device_participate(orchard_device* dev, double max_wait_s,
                                                      orchard_round_report* report);

/* Train the bundle's own adapter on the device's text (orchard_device_set_text) for
 * `steps` SGD steps of `batch_size` windows at `learning_rate`, through the bundle's
 * ExecuTorch program, with no server and nothing sent: a check, before an app enrolls,
 * that the program runs on this device. *report says what ran (round -1, uploaded 0).
 * The adapter trained here is dropped; a participation trains the run's model. */
ORCHARD_API orchard_status orchard_device_train_local(orchard_device* dev, int64_t steps, int64_t batch_size,
                                                      double learning_rate, orchard_round_report* report);

/* End the call in flight on `dev` (join, participate) with ORCHARD_ERR_CANCELLED, and
 * every later call that talks to the server, until orchard_device_reset_cancel. Any
 * thread may call it, at any time; it returns at once. */
ORCHARD_API orchard_status orchard_device_cancel(orchard_device* dev);
ORCHARD_API orchard_status orchard_device_reset_cancel(orchard_device* dev);

#ifdef __cplusplus
}
#endif

#endif /* ORCHARD_DEVICE_H */
