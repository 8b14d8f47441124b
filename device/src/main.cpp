// orchard-device: a Linux command over liborchard_device's C ABI (it uses nothing
// else), the reference for how an app drives the library.
//
//   orchard-device BUNDLE [--data TEXT_FILE] [--rounds N] [--wait SECONDS]
//                         [--server HOST:PORT] [--node-id ID] [--attempts N] [--data-dir DIR] [--insecure]
//
// Without --data it joins and exits; with it, it serves N rounds (default 1), waiting
// up to --wait seconds (default 600) for each task.
//
// Exit status: 0 on success, else the orchard_status of the failed call (the message
// goes to stderr as "orchard-device: STATUS_NAME: message").
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "orchard_device.h"

static int usage() {
  std::fprintf(stderr,
               "usage: orchard-device BUNDLE [--data TEXT_FILE] [--rounds N] [--wait SECONDS] [--server HOST:PORT] "
               "[--node-id ID] [--attempts N] [--data-dir DIR] [--insecure]\n");
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
  std::string data;
  long rounds = 1;
  double wait_s = 600;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const char* option = a == "--server" ? "server_address" : a == "--node-id" ? "node_id"
                       : a == "--attempts" ? "attempts" : a == "--data-dir" ? "data_dir" : nullptr;
    if (option != nullptr && i + 1 < argc) {
      st = orchard_device_set_option(dev, option, argv[++i]);
    } else if (a == "--insecure") {
      st = orchard_device_set_option(dev, "insecure", "1");
    } else if (a == "--data" && i + 1 < argc) {
      data = argv[++i];
    } else if (a == "--rounds" && i + 1 < argc) {
      rounds = std::strtol(argv[++i], nullptr, 10);
    } else if (a == "--wait" && i + 1 < argc) {
      wait_s = std::strtod(argv[++i], nullptr);
    } else {
      orchard_device_close(dev);
      return usage();
    }
    if (st != ORCHARD_OK) return report(dev, st);
  }
  st = orchard_device_join(dev);
  if (st != ORCHARD_OK) return report(dev, st);
  std::printf("joined as %s\n", orchard_device_node_id(dev));
  if (!data.empty()) {
    std::ifstream in(data, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "orchard-device: cannot read %s\n", data.c_str());
      orchard_device_close(dev);
      return ORCHARD_ERR_IO;
    }
    std::stringstream text;
    text << in.rdbuf();
    const std::string s = text.str();
    st = orchard_device_set_text(dev, s.data(), s.size());
    if (st != ORCHARD_OK) return report(dev, st);
    for (long r = 0; r < rounds; ++r) {
      orchard_round_report rep;
      st = orchard_device_participate(dev, wait_s, &rep);
      if (st != ORCHARD_OK) return report(dev, st);
      int64_t up = 0, down = 0;
      orchard_device_traffic(dev, &up, &down);
      std::printf("round %lld: %s steps=%lld examples=%lld weight=%g loss=%.4f bytes_up=%lld bytes_down=%lld%s%s\n",
                  static_cast<long long>(rep.round), rep.uploaded ? "uploaded" : "no upload",
                  static_cast<long long>(rep.num_steps), static_cast<long long>(rep.num_examples), rep.weight,
                  rep.train_loss, static_cast<long long>(up), static_cast<long long>(down), rep.uploaded ? "" : " ",
                  rep.uploaded ? "" : orchard_device_errmsg(dev));
      std::fflush(stdout);
    }
  }
  orchard_device_close(dev);
  return 0;
}
