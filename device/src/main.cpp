// orchard-device: a Linux command over liborchard_device's C ABI (it uses nothing
// else), the reference for how an app drives the library.
//
//   orchard-device BUNDLE [--server HOST:PORT] [--node-id ID] [--attempts N] [--insecure]
//                         [--join-only]
//
// Exit status: 0 on success, else the orchard_status of the failed call (the message
// goes to stderr as "orchard-device: STATUS_NAME: message").
#include <cstdio>
#include <cstring>
#include <string>

#include "orchard_device.h"

static int usage() {
  std::fprintf(stderr,
               "usage: orchard-device BUNDLE [--server HOST:PORT] [--node-id ID] [--attempts N] [--insecure] "
               "[--join-only]\n");
  return ORCHARD_ERR_ARGUMENT;
}

static int report(orchard_device* dev, orchard_status st) {
  std::fprintf(stderr, "orchard-device: %s: %s\n", orchard_status_name(st), orchard_device_errmsg(dev));
  orchard_device_close(dev);
  return static_cast<int>(st);
}

int main(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return usage();
  orchard_device* dev = nullptr;
  orchard_status st = orchard_device_open(argv[1], &dev);
  if (st != ORCHARD_OK) return report(dev, st);
  bool join_only = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const char* option = a == "--server" ? "server_address" : a == "--node-id" ? "node_id"
                       : a == "--attempts" ? "attempts" : nullptr;
    if (option != nullptr && i + 1 < argc) {
      st = orchard_device_set_option(dev, option, argv[++i]);
    } else if (a == "--insecure") {
      st = orchard_device_set_option(dev, "insecure", "1");
    } else if (a == "--join-only") {
      join_only = true;
    } else {
      orchard_device_close(dev);
      return usage();
    }
    if (st != ORCHARD_OK) return report(dev, st);
  }
  st = orchard_device_join(dev);
  if (st != ORCHARD_OK) return report(dev, st);
  std::printf("joined as %s\n", orchard_device_node_id(dev));
  (void)join_only;
  orchard_device_close(dev);
  return 0;
}
