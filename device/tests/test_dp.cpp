// Differential privacy under secure aggregation against orchard.aggregation.privacy
// (device_vectors.py: dp.json): the session parameters of central and distributed DP
// over 20- to 62-bit fields (every double equal, every refusal a refusal), encodings
// and discrete Gaussian draws from the same stream of 64-bit words (every word equal),
// then the law of the sampler on OS entropy, and a secure round's settings with DP.
#include <cmath>
#include <cstring>

#include "check.h"
#include "dp_encoding.h"
#include "failure.h"
#include "numpy_random.h"
#include "secure_round.h"
#include "vectors.h"

using namespace orchard;

// PCG64(seed)'s raw outputs: the words the Python vectors were drawn with.
static WordSource seeded(uint64_t seed) {
  auto rng = std::make_shared<Pcg64>(int_words(seed));
  return [rng](uint64_t* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = rng->next64();
  };
}

static DdgParams params_of(const nlohmann::json& j) {
  DdgParams p;
  p.clip = j["clip"], p.gamma = j["gamma"], p.delta2 = j["delta2"], p.sigma = j["sigma"];
  p.share_sigma = j["share_sigma"], p.participants = j["participants"], p.min_contributors = j["min_contributors"];
  p.modulus_bits = j["modulus_bits"], p.beta = j["beta"], p.tau = j["tau"];
  return p;
}

TEST(session_params_equal_python) {
  auto v = vectors::load("dp.json");
  int refused = 0;
  for (auto& c : v["params"]) {
    PrivacySettings s;
    s.noised_at_root = c["mode"] == "central";
    if (!c["noise_multiplier"].is_null()) s.noise_multiplier = c["noise_multiplier"].get<double>();
    s.clip_norm = c["clip"], s.dropout_rate = c["dropout_rate"], s.modulus_bits = c["modulus_bits"];
    const std::string what = c["mode"].get<std::string>() + " " + std::to_string(c["modulus_bits"].get<int>()) + " bits";
    try {
      const DdgParams p = session_params(s, c["participants"], c["dim"]);
      CHECK_MSG(c.contains("params"), what + ": the Python package refused it: " + c.value("error", std::string()));
      if (!c.contains("params")) continue;
      const DdgParams want = params_of(c["params"]);
      CHECK_MSG(p.clip == want.clip && p.gamma == want.gamma && p.delta2 == want.delta2, what);
      CHECK_MSG(p.sigma == want.sigma && p.share_sigma == want.share_sigma && p.tau == want.tau, what);
      CHECK_MSG(p.min_contributors == want.min_contributors && p.beta == want.beta, what);
    } catch (const Failure& f) {
      ++refused;
      CHECK_MSG(f.code() == ORCHARD_ERR_REFUSED && c.contains("error"), what + ": " + f.what());
      // The same explanation as the Python ConfigError (its first words).
      const std::string head = std::string(f.what()).substr(0, 40);
      CHECK_MSG(c.value("error", std::string()).find(head) != std::string::npos, what + ": " + f.what());
    }
  }
  CHECK(refused == 3);
}

// A field word as the signed integer it stands for (ddg_decode).
static double signed_of(uint64_t w, int bits) {
  const uint64_t half = uint64_t{1} << (bits - 1);
  return w >= half ? -static_cast<double>((uint64_t{1} << bits) - w) : static_cast<double>(w);
}

// Decoded, an encoding is the clipped input up to one field unit of rounding and the
// noise share's clamp: |decode(w) - clip(x)| <= gamma (1 + limit), and without noise its
// norm is within delta2.
static bool within_bounds(const std::vector<uint64_t>& w, const std::vector<double>& x, const DdgParams& p,
                          std::string* why) {
  double sq = 0;
  for (double v : x) sq += v * v;
  const double keep = sq > 0 ? std::min(1.0, p.clip / std::sqrt(sq)) : 1.0;
  const double limit = std::trunc(10.0 * p.share_sigma);
  double norm2 = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    const double s = signed_of(w[i], p.modulus_bits);
    norm2 += s * s;
    const double err = std::abs(s - x[i] * keep / p.gamma);
    if (err > (1.0 + limit) * (1.0 + 1e-9) + 1e-6 * std::abs(s)) {
      *why = "word " + std::to_string(i) + " is " + std::to_string(err) + " field units from its input";
      return false;
    }
  }
  if (p.share_sigma == 0 && std::sqrt(norm2) > p.delta2 * (1 + 1e-12)) {
    *why = "norm " + std::to_string(std::sqrt(norm2)) + " above delta2 " + std::to_string(p.delta2);
    return false;
  }
  return true;
}

TEST(encodings_equal_python) {
  auto v = vectors::load("dp.json");
  int noised = 0, wide = 0, bounded = 0;
  for (auto& c : v["encodes"]) {
    const DdgParams p = params_of(c["params"]);
    const std::string what = c["mode"].get<std::string>() + " " + std::to_string(p.modulus_bits) + " bits";
    const auto x = c["x"].get<std::vector<double>>();
    const auto got = ddg_encode(x, p, seeded(c["seed"]));
    const auto want = c["encoded"].get<std::vector<uint64_t>>();
    CHECK(got.size() == want.size());
    std::string why;
    CHECK_MSG(within_bounds(got, x, p, &why), what + ": " + why);
    CHECK_MSG(within_bounds(want, x, p, &why), what + " (Python's): " + why);
    if (c["exact"].get<bool>()) {
      size_t differ = 0;
      for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) differ += got[i] != want[i];
      CHECK_MSG(differ == 0, what + ": " + std::to_string(differ) + " words differ");
      noised += p.share_sigma > 0;
      wide += p.modulus_bits > 32;
    } else {
      ++bounded;
    }
  }
  CHECK(noised >= 3 && wide >= 2 && bounded >= 2);
}

TEST(discrete_gaussian_draws_equal_python) {
  auto v = vectors::load("dp.json");
  for (auto& c : v["samples"]) {
    const auto got = discrete_gaussian(c["sigma"], c["draws"].size(), seeded(c["seed"]));
    CHECK_MSG(got == c["draws"].get<std::vector<int64_t>>(), "sigma " + std::to_string(c["sigma"].get<double>()));
  }
}

TEST(discrete_gaussian_law_on_os_entropy) {
  // Mean 0 and variance close to sigma^2 (the discrete Gaussian's variance is within
  // 1e-4 of sigma^2 for sigma >= 1), over 200,000 draws: 6 standard errors.
  for (double sigma : {1.0, 4.0, 1000.0}) {
    const size_t n = 200000;
    const auto d = discrete_gaussian(sigma, n, os_words());
    double mean = 0, var = 0;
    for (int64_t k : d) mean += static_cast<double>(k);
    mean /= n;
    for (int64_t k : d) var += (k - mean) * (k - mean);
    var /= n;
    CHECK_MSG(std::abs(mean) < 6 * sigma / std::sqrt(n), "sigma " + std::to_string(sigma) + " mean " + std::to_string(mean));
    CHECK_MSG(std::abs(var / (sigma * sigma) - 1) < 6 * std::sqrt(2.0 / n), "sigma " + std::to_string(sigma) +
                                                                              " variance " + std::to_string(var));
  }
}

TEST(secure_settings_read_privacy) {
  auto cfg = nlohmann::json::parse(R"({"secure_aggregation": {"enabled": true, "modulus_bits": 48, "dropout_rate": 0.2},
    "privacy": {"mode": "distributed", "noise_multiplier": 1.2, "clip_norm": 2.0}, "robust": {"norm_bound": 0.5}})");
  SecureSettings s = SecureSettings::from_config(cfg);
  CHECK(s.modulus_bits == 48 && s.privacy && !s.privacy->noised_at_root);
  CHECK(s.privacy->clip_norm == 0.5 && *s.privacy->noise_multiplier == 1.2 && s.privacy->dropout_rate == 0.2);
  cfg["privacy"]["mode"] = "central";
  s = SecureSettings::from_config(cfg);
  CHECK(s.privacy && s.privacy->noised_at_root);
  cfg["privacy"]["mode"] = "off";
  CHECK(!SecureSettings::from_config(cfg).privacy);
  cfg["privacy"]["mode"] = "loud";
  try {
    SecureSettings::from_config(cfg);
    CHECK(false);
  } catch (const Failure& f) {
    CHECK(f.code() == ORCHARD_ERR_PROTOCOL && std::string(f.what()).find("loud") != std::string::npos);
  }
  // With DP, a masked vector is the DP encoding (here central: no noise, norm <= delta2),
  // in the session's field.
  cfg["privacy"]["mode"] = "central";
  s = SecureSettings::from_config(cfg);
  const std::vector<std::vector<float>> values{{0.3f, -0.4f}, {0.0f, 2.0f, -1.0f}};
  const auto vec = masked_vector(s, values, 10.0, 5, {1, 2, 3, 4}, seeded(5));
  CHECK(vec.size() == 5);
  for (uint64_t w : vec) CHECK(w < (uint64_t{1} << 48));
}

CHECK_MAIN()
