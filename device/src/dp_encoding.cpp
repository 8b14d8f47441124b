#include "dp_encoding.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include <openssl/rand.h>

#include "failure.h"

namespace orchard {

namespace {

// aggregation/privacy.py's constants.
constexpr size_t kBlock = 1 << 14;       // _BLOCK: elements per step of the vector loops
constexpr double kThinBelow = 64.0;      // _THIN_BELOW
constexpr double kNoiseShareBound = 10.0;  // NOISE_SHARE_BOUND
const double kBeta = std::exp(-0.5);     // ddg_params' default beta
constexpr double kPi = 3.141592653589793;  // math.pi

[[noreturn]] void config_error(const std::string& what) { throw Failure(ORCHARD_ERR_REFUSED, what); }

// _delta2: Kairouz et al. (2021), eq. (4).
double delta2_of(double scale, int64_t dim, double beta) {
  const double d = static_cast<double>(dim);
  return std::sqrt(scale * scale + d / 4.0 + std::sqrt(2.0 * std::log(1.0 / beta)) * (scale + std::sqrt(d) / 2.0));
}

// _finest_scale: the largest power-of-two scale at which the session's sum, noise
// included, stays inside (-M/2, M/2).
double finest_scale(int participants, int64_t dim, int modulus_bits, double beta, double per_share) {
  const double limit = static_cast<double>((uint64_t{1} << (modulus_bits - 1)) - 1);
  auto worst = [&](double scale) { return participants * delta2_of(scale, dim, beta) * (1.0 + per_share); };
  double scale = std::ldexp(1.0, 52);
  while (scale >= 1.0 && worst(scale) >= limit) scale /= 2.0;
  if (scale < 1.0 || scale < std::sqrt(static_cast<double>(dim)))
    config_error("a " + std::to_string(modulus_bits) + "-bit field cannot hold the sum of " +
                 std::to_string(participants) + " clients' " + std::to_string(dim) +
                 "-dimensional updates with their noise at any useful granularity; raise "
                 "secure_aggregation.modulus_bits (up to 62) or use smaller cohorts");
  return scale;
}

void check_modulus(int modulus_bits) {
  if (modulus_bits < 2 || modulus_bits > 63)
    config_error("secure_aggregation.modulus_bits must be in 2..63 for differential privacy, got " +
                 std::to_string(modulus_bits));
}

// SecureGenerator's draws, from 64-bit words.
struct Draws {
  const WordSource& words;
  std::vector<uint64_t> buf;

  void uniform(double* out, size_t n) {
    buf.resize(n);
    if (n) words(buf.data(), n);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<double>(buf[i] >> 11) * (1.0 / 9007199254740992.0);
  }
  // Box and Muller: the first half of the uniforms give the radii, the second the angles.
  void normal(double* out, size_t n) {
    const size_t m = (n + 1) / 2;
    std::vector<double> u(2 * m);
    uniform(u.data(), u.size());
    for (size_t i = 0; i < m; ++i) {
      const double r = std::sqrt(-2.0 * std::log1p(-u[i]));
      const double theta = 2.0 * kPi * u[m + i];
      out[i] = r * std::cos(theta);
      if (m + i < n) out[m + i] = r * std::sin(theta);
    }
  }
  void exponential(double* out, size_t n) {
    uniform(out, n);
    for (size_t i = 0; i < n; ++i) out[i] = -std::log1p(-out[i]);
  }
};

// _DiscreteGaussian: rejection from a rounded continuous Gaussian (see privacy.py's
// discrete_gaussian for the law), with thinning where rejections are rare.
class DiscreteGaussian {
 public:
  explicit DiscreteGaussian(double sigma) {
    if (!(std::isfinite(sigma) && sigma > 0))
      config_error("discrete Gaussian sigma must be > 0 and finite, got " + std::to_string(sigma));
    const double d = (1.0 + std::sqrt(1.0 + 16.0 * sigma * sigma)) / 8.0;
    s2_ = sigma * sigma + d;
    s_ = std::sqrt(s2_);
    a_ = d / (2.0 * sigma * sigma * s2_);
    bound_ = 1.0 / (8.0 * d);
    rate_ = (sigma / s_) * std::exp(-bound_);
  }

  void fill(double* out, size_t size, Draws& rng) const {
    size_t filled = 0;
    std::vector<double> xs, ks, gs;
    while (filled < size) {
      const size_t need = size - filled;
      const size_t m = std::min(kBlock, static_cast<size_t>(static_cast<double>(need) / rate_ * 1.02) + 32);
      xs.resize(m), ks.resize(m), gs.resize(m);
      rng.normal(xs.data(), m);
      double kmax = 0, kmin = 0;
      for (size_t i = 0; i < m; ++i) {
        xs[i] *= s_;
        ks[i] = std::nearbyint(xs[i]);  // np.rint: half to even
        kmax = i ? std::max(kmax, ks[i]) : ks[i];
        kmin = i ? std::min(kmin, ks[i]) : ks[i];
      }
      const double big = std::max(kmax, -kmin);
      const double top = bound_ + a_ * big * big + big / (2.0 * s2_);
      std::vector<double> keep;
      keep.reserve(m);
      if (top * static_cast<double>(m) <= kThinBelow) {
        // Thinning: a Binomial(m, r) count of uniformly chosen candidates are tested,
        // each rejected with probability r_i / r.
        const double r = -std::expm1(-top);
        rng.uniform(gs.data(), m);
        size_t tested = 0;
        for (size_t i = 0; i < m; ++i) tested += gs[i] < r;
        std::vector<bool> rejected(m, false);
        if (tested) {
          // choice(m, tested, replace=False): the indices of the `tested` smallest words.
          std::vector<uint64_t> w(m);
          rng.words(w.data(), m);
          std::vector<size_t> idx(m);
          std::iota(idx.begin(), idx.end(), size_t{0});
          std::stable_sort(idx.begin(), idx.end(), [&](size_t p, size_t q) { return w[p] < w[q]; });
          std::vector<double> coin(tested);
          rng.uniform(coin.data(), tested);
          for (size_t j = 0; j < tested; ++j) {
            const size_t i = idx[j];
            const double kt = ks[i], ut = xs[i] - kt;
            const double gt = bound_ + a_ * kt * kt - (2.0 * kt + ut) * ut / (2.0 * s2_);
            if (coin[j] * r < -std::expm1(-gt)) rejected[i] = true;
          }
        }
        for (size_t i = 0; i < m; ++i)
          if (!rejected[i]) keep.push_back(ks[i]);
      } else {
        const double half = -0.5 / s2_;
        for (size_t i = 0; i < m; ++i) {
          const double u = xs[i] - ks[i];
          gs[i] = ((ks[i] * 2.0 + u) * u) * half + ks[i] * ks[i] * a_ + bound_;
        }
        rng.exponential(xs.data(), m);
        for (size_t i = 0; i < m; ++i)
          if (xs[i] >= gs[i]) keep.push_back(ks[i]);
      }
      const size_t got = std::min(need, keep.size());
      std::copy(keep.begin(), keep.begin() + static_cast<std::ptrdiff_t>(got), out + filled);
      filled += got;
    }
  }

 private:
  double s2_ = 0, s_ = 0, a_ = 0, bound_ = 0, rate_ = 0;
};

}  // namespace

DdgParams ddg_params(double clip, double noise_multiplier, int participants, int min_contributors, int64_t dim,
                     int modulus_bits) {
  std::vector<std::string> problems;
  if (!(clip > 0)) problems.push_back("clip must be > 0, got " + std::to_string(clip));
  if (!(noise_multiplier > 0)) problems.push_back("noise multiplier must be > 0, got " + std::to_string(noise_multiplier));
  if (!(1 <= min_contributors && min_contributors <= participants))
    problems.push_back("need 1 <= min_contributors (" + std::to_string(min_contributors) + ") <= participants (" +
                       std::to_string(participants) + ")");
  if (dim < 1) problems.push_back("dimension must be >= 1, got " + std::to_string(dim));
  if (!problems.empty()) {
    std::string all;
    for (auto& p : problems) all += (all.empty() ? "" : "; ") + p;
    config_error(all);
  }
  check_modulus(modulus_bits);
  const double per_share = kNoiseShareBound * noise_multiplier / std::sqrt(static_cast<double>(min_contributors));
  const double scale = finest_scale(participants, dim, modulus_bits, kBeta, per_share);
  const double delta2 = delta2_of(scale, dim, kBeta);
  const double sigma = noise_multiplier * delta2;
  const double share = sigma / std::sqrt(static_cast<double>(min_contributors));
  double tau = 0;  // Python's sum(): left to right from 0
  for (int k = 1; k < min_contributors; ++k)
    tau += std::exp(-2.0 * (kPi * kPi) * (share * share) * k / (k + 1));
  tau = 10.0 * tau;
  if (sigma * sigma * tau * static_cast<double>(dim) / 2.0 > 1e-6 * (delta2 * delta2))
    config_error("each client's noise share (stddev " + std::to_string(share) + " field units) is too small for the sum of " +
                 std::to_string(min_contributors) + " shares to be a discrete Gaussian (Kairouz et al., Theorem 1); "
                 "raise the noise multiplier or secure_aggregation.modulus_bits");
  DdgParams p;
  p.clip = clip, p.gamma = clip / scale, p.delta2 = delta2, p.sigma = sigma, p.share_sigma = share;
  p.participants = participants, p.min_contributors = min_contributors, p.modulus_bits = modulus_bits;
  p.beta = kBeta, p.tau = tau;
  return p;
}

DdgParams bounded_params(double clip, int participants, int64_t dim, int modulus_bits) {
  if (!(clip > 0)) config_error("clip must be > 0, got " + std::to_string(clip));
  if (dim < 1 || participants < 1)
    config_error("need participants >= 1 and dimension >= 1, got " + std::to_string(participants) + " and " +
                 std::to_string(dim));
  check_modulus(modulus_bits);
  const double scale = finest_scale(participants, dim, modulus_bits, kBeta, 0.0);
  const double delta2 = delta2_of(scale, dim, kBeta);
  DdgParams p;
  p.clip = clip * scale / delta2, p.gamma = clip / delta2, p.delta2 = delta2;
  p.participants = participants, p.min_contributors = 1, p.modulus_bits = modulus_bits, p.beta = kBeta;
  return p;
}

int min_contributors(int participants, double dropout_rate) {
  return std::max(1, static_cast<int>(std::ceil(participants * (1.0 - dropout_rate))));
}

DdgParams session_params(const PrivacySettings& p, int participants, int64_t dim) {
  if (p.noised_at_root) return bounded_params(p.clip_norm, participants, dim, p.modulus_bits);
  if (!p.noise_multiplier)
    throw Failure(ORCHARD_ERR_PROTOCOL, "distributed DP needs the run's noise multiplier, and the task's config has none");
  return ddg_params(p.clip_norm, *p.noise_multiplier, participants, min_contributors(participants, p.dropout_rate), dim,
                    p.modulus_bits);
}

WordSource os_words() {
  return [](uint64_t* out, size_t n) {
    for (size_t at = 0; at < n;) {
      const size_t step = std::min<size_t>(n - at, 1 << 20);
      if (RAND_bytes(reinterpret_cast<unsigned char*>(out + at), static_cast<int>(step * 8)) != 1)
        throw Failure(ORCHARD_ERR_INTERNAL, "OpenSSL: RAND_bytes failed");
      at += step;
    }
  };
}

std::vector<uint64_t> ddg_encode(const std::vector<double>& x, const DdgParams& p, const WordSource& words) {
  double sq = 0;
  for (double v : x) sq += v * v;
  const double n = std::sqrt(sq);
  const double factor = (n > 0 ? std::min(1.0, p.clip / n) : 1.0) / p.gamma;
  const size_t size = x.size();
  std::vector<uint64_t> out(size);
  const uint64_t mask = p.modulus_bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << p.modulus_bits) - 1;
  const double limit = std::trunc(kNoiseShareBound * p.share_sigma);
  std::optional<DiscreteGaussian> noise;
  if (p.share_sigma > 0) noise.emplace(p.share_sigma);
  const size_t b = std::min(kBlock, size);
  std::vector<double> r(b), e(b);
  const double bound2 = p.delta2 * p.delta2;
  Draws rng{words, {}};
  // One pass a block at a time: scale, round, add the noise share, reduce. The rounding
  // is conditioned on the whole vector's norm, so a pass whose rounded norm exceeds
  // delta2 starts over (the noise is drawn afresh: it is independent of the rounding).
  for (int tries = 0; tries < 1000; ++tries) {
    double total = 0;
    bool over = false;
    for (size_t i = 0; i < size && !over; i += kBlock) {
      const size_t len = std::min(i + kBlock, size) - i;
      rng.uniform(e.data(), len);
      double block = 0;
      for (size_t k = 0; k < len; ++k) {
        const double y = x[i + k] * factor;
        const double fl = std::floor(y);
        r[k] = fl + (e[k] < y - fl ? 1.0 : 0.0);
        block += r[k] * r[k];
      }
      total += block;
      if (total > bound2) {
        over = true;
        break;
      }
      if (noise) {
        noise->fill(e.data(), len, rng);
        for (size_t k = 0; k < len; ++k) r[k] += std::min(std::max(e[k], -limit), limit);
      }
      for (size_t k = 0; k < len; ++k) out[i + k] = static_cast<uint64_t>(static_cast<int64_t>(r[k])) & mask;
    }
    if (!over) return out;
  }
  // P(failure) <= beta^1000: never in practice.
  throw Failure(ORCHARD_ERR_INTERNAL, "conditional rounding failed to meet its norm bound; the parameters are wrong");
}

std::vector<int64_t> discrete_gaussian(double sigma, size_t n, const WordSource& words) {
  Draws rng{words, {}};
  std::vector<double> d(n);
  DiscreteGaussian(sigma).fill(d.data(), n, rng);
  return std::vector<int64_t>(d.begin(), d.end());
}

}  // namespace orchard
