// Differential privacy under secure aggregation, a client's side
// (orchard.aggregation.privacy: session_params, ddg_params, bounded_params, ddg_encode):
// the encoding a client masks when the run adds DP to SecAgg+.
//
// Central DP (the root adds the noise to the unmasked sum): the bounded rounding, the
// client's update clipped and rounded conditionally so that what the tier sums is
// bounded by the clip norm, rounding included. Distributed DP (Kairouz et al., 2021,
// "The distributed discrete Gaussian mechanism for federated learning with secure
// aggregation"): the same encoding plus the client's share of discrete Gaussian noise.
// The parameters come from the same double arithmetic as the Python package's, so a
// native client and a Python one in a session encode on the same grid; given the same
// 64-bit words, ddg_encode returns the Python function's vector (the uniforms, normals
// and exponentials drawn as orchard.randomness.SecureGenerator draws them).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace orchard {

// aggregation.privacy.DDGParams.
struct DdgParams {
  double clip = 0;         // C: the L2 bound of each client's update (float units)
  double gamma = 0;        // a field unit is gamma in float units
  double delta2 = 0;       // L2 bound of a rounded client vector, in field units (their eq. 4)
  double sigma = 0;        // noise stddev the cohort sum carries at least (field units)
  double share_sigma = 0;  // each client's share: sigma / sqrt(n_min); 0 for central DP
  int participants = 0;
  int min_contributors = 0;
  int modulus_bits = 32;
  double beta = 0;
  double tau = 0;
};

// The run's privacy settings a client needs (the task's config JSON, resolved by the root).
struct PrivacySettings {
  bool noised_at_root = true;              // central DP or DP-FTRL; else distributed
  std::optional<double> noise_multiplier;  // distributed DP's z (the root resolves it at start)
  double clip_norm = 1.0;                  // RunConfig.clip_norm: min(privacy.clip_norm, robust.norm_bound)
  double dropout_rate = 0.1;               // secure_aggregation.dropout_rate
  int modulus_bits = 32;
};

// Failure(ORCHARD_ERR_REFUSED) with the Python ConfigError's message for a field too
// small for the session, or noise shares too small to sum to a discrete Gaussian.
DdgParams ddg_params(double clip, double noise_multiplier, int participants, int min_contributors, int64_t dim,
                     int modulus_bits);
DdgParams bounded_params(double clip, int participants, int64_t dim, int modulus_bits);
int min_contributors(int participants, double dropout_rate);
DdgParams session_params(const PrivacySettings& p, int participants, int64_t dim);

// `n` 64-bit words, uniformly random: the operating system's CSPRNG on a device (noise
// nobody else can replay), a seeded stream in tests.
using WordSource = std::function<void(uint64_t* out, size_t n)>;
// OpenSSL's CSPRNG (RAND_bytes).
WordSource os_words();

// ddg_encode: clip x to p.clip, scale by 1 / gamma, round conditionally (norm <=
// delta2), add the noise share (clamped at 10 share sigmas; none when share_sigma is 0),
// reduce modulo 2^modulus_bits.
std::vector<uint64_t> ddg_encode(const std::vector<double>& x, const DdgParams& p, const WordSource& words);

// discrete_gaussian: `n` draws of N_Z(0, sigma^2) (for tests of the sampler's law).
std::vector<int64_t> discrete_gaussian(double sigma, size_t n, const WordSource& words);

}  // namespace orchard
