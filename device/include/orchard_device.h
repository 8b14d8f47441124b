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
 * (calls on different handles may run at once). orchard_status_name and
 * orchard_version may be called from any thread at any time.
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

#ifdef __cplusplus
}
#endif

#endif /* ORCHARD_DEVICE_H */
