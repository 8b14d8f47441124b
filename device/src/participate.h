// One participation, as client/runtime.py does it for a phone-class client: wait until
// the device is eligible, long-poll for a task, pull the model, train through the
// ExecuTorch program under the governor with heartbeats, and push the update: the
// delta of every schema tensor, the run's weighting and codec, the header's counts and
// metrics (docs/mobile-contract.md section 4).
#pragma once

#include <functional>
#include <string>

#include "bundle.h"
#include "link.h"
#include "policy.h"
#include "train.h"

namespace orchard {

struct RoundReport {
  int64_t round = -1;
  bool uploaded = false;
  std::string reason;  // why nothing was uploaded
  int64_t num_steps = 0, num_examples = 0;
  double weight = 0, train_loss = 0;
  StopReason stop = StopReason::none;
};

struct Participant {
  Link& link;
  const Bundle& bundle;
  const DevicePolicy& policy;
  TrainingProgram& program;
  const DeviceData& data;
  DeviceIO io;                   // the device's state and the clock
  uint64_t trainer_seed = 0;     // et_trainer's seed (the Python client's --seed)
  int64_t partition_id = 0;      // client/update.train_seed's partition
  HeldModel* held = nullptr;     // the model kept from the last round (downlink deltas' base); may be null
};

// Serve one task. ORCHARD_ERR_NO_TASK when none came within max_wait_s (the device
// not eligible all along, or the server idle). Throws Failure for what fails the round.
RoundReport participate(Participant& p, double max_wait_s);

}  // namespace orchard
