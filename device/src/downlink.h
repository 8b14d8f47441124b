// Downlink deltas (server/downlink.py, client/runtime.py apply_downlink_delta): a node
// that holds model B and asks for H may be sent Q(H - B) instead of H. It rebuilds
// R = B + decode(Q(H - B)) tensor by tensor, in float32, and trains from R; the server
// states R's sha256, and the link refuses a reconstruction that does not match it (then
// pulls the full model). Next round the node offers R as its base.
#pragma once

#include <string>

#include "crypto.h"

namespace orchard {

// The model blob rebuilt from the blob held and a delta blob (safetensors of uint8
// payloads, one per tensor of the base) in `encoding` (orchard.config.CodecSpec JSON).
// The result is laid out as wire.arrays_to_blob lays it out, so equal models hash
// equally. Failure(ORCHARD_ERR_PROTOCOL) for a delta that does not decode against the base.
Bytes apply_downlink_delta(const Bytes& base_blob, const Bytes& delta_blob, const std::string& encoding);

}  // namespace orchard
