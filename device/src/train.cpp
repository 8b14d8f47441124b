#include "train.h"

#include <cmath>
#include <cstring>
#include <numeric>

#include "failure.h"
#include "numpy_random.h"

namespace orchard {

namespace {

// ---- BLAKE2b (RFC 7693), unkeyed, with a personalisation string

constexpr uint64_t kIv[8] = {0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull,
                             0xa54ff53a5f1d36f1ull, 0x510e527fade682d1ull, 0x9b05688c2b3e6c1full,
                             0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};
constexpr uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

uint64_t rotr(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

uint64_t load64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, bool last) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
  for (int i = 0; i < 8; ++i) {
    v[i] = h[i];
    v[i + 8] = kIv[i];
  }
  v[12] ^= t;
  if (last) v[14] = ~v[14];
  auto g = [&](int a, int b, int c, int d, uint64_t x, uint64_t y) {
    v[a] = v[a] + v[b] + x;
    v[d] = rotr(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y;
    v[d] = rotr(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 63);
  };
  for (int r = 0; r < 12; ++r) {
    const uint8_t* s = kSigma[r];
    g(0, 4, 8, 12, m[s[0]], m[s[1]]);
    g(1, 5, 9, 13, m[s[2]], m[s[3]]);
    g(2, 6, 10, 14, m[s[4]], m[s[5]]);
    g(3, 7, 11, 15, m[s[6]], m[s[7]]);
    g(0, 5, 10, 15, m[s[8]], m[s[9]]);
    g(1, 6, 11, 12, m[s[10]], m[s[11]]);
    g(2, 7, 8, 13, m[s[12]], m[s[13]]);
    g(3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

uint64_t blake2b64(const std::vector<uint8_t>& data, const char* person) {
  uint64_t h[8];
  std::memcpy(h, kIv, sizeof h);
  h[0] ^= 0x01010000ull | 8;  // depth 1, fanout 1, no key, an 8-byte digest
  uint8_t p[16] = {0};
  std::memcpy(p, person, std::min<size_t>(16, std::strlen(person)));
  h[6] ^= load64(p);
  h[7] ^= load64(p + 8);
  size_t at = 0;
  uint8_t block[128];
  while (data.size() - at > 128) {
    std::memcpy(block, data.data() + at, 128);
    at += 128;
    compress(h, block, at, false);
  }
  std::memset(block, 0, sizeof block);
  std::memcpy(block, data.data() + at, data.size() - at);
  compress(h, block, data.size(), true);
  return h[0];  // the first 8 digest bytes, little-endian
}

// numpy's random_interval(max), which Generator.shuffle draws with: rejection of
// uniform words masked to the smallest 2^k - 1 >= max.
uint64_t bounded(Pcg64& g, uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  for (unsigned s = 1; s <= 32; s <<= 1) mask |= mask >> s;
  uint64_t value;
  if (max <= 0xffffffffull) {
    while ((value = (g.next32() & mask)) > max) {
    }
  } else {
    while ((value = (g.next64() & mask)) > max) {
    }
  }
  return value;
}

}  // namespace

uint64_t derive_seed(const std::vector<uint64_t>& parts, int bits) {
  std::vector<uint8_t> packed;
  for (uint64_t p : parts)
    for (int i = 0; i < 8; ++i) packed.push_back(static_cast<uint8_t>(p >> (8 * i)));
  return blake2b64(packed, "orchard-seed") >> (64 - bits);
}

std::vector<int64_t> numpy_permutation(uint64_t seed, int64_t n) {
  std::vector<int64_t> out(static_cast<size_t>(n));
  std::iota(out.begin(), out.end(), 0);
  Pcg64 g(int_words(seed));
  for (int64_t i = n - 1; i >= 1; --i) std::swap(out[static_cast<size_t>(i)], out[bounded(g, static_cast<uint64_t>(i))]);
  return out;
}

DeviceData text_windows(const std::string& text, const std::vector<std::string>& vocab, size_t seq_len,
                        double test_fraction) {
  std::map<std::string, int64_t> index;
  for (size_t i = 0; i < vocab.size(); ++i) index[vocab[i]] = static_cast<int64_t>(i);
  std::vector<int64_t> ids;
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
    const std::string ch = text.substr(i, len);
    auto it = index.find(ch);
    if (it == index.end())
      throw Failure(ORCHARD_ERR_ARGUMENT, "the device's text holds '" + ch + "' (at byte " + std::to_string(i) +
                                              "), which the bundle's tokenizer does not know");
    ids.push_back(it->second);
    i += len;
  }
  const size_t cut = static_cast<size_t>(std::nearbyint(static_cast<double>(ids.size()) * (1.0 - test_fraction)));
  DeviceData d;
  d.seq_len = seq_len;
  const size_t n = cut > 0 ? (cut - 1) / seq_len : 0;
  d.rows = n;
  d.x.assign(ids.begin(), ids.begin() + static_cast<long>(n * seq_len));
  d.y.assign(ids.begin() + 1, ids.begin() + 1 + static_cast<long>(n * seq_len));
  return d;
}

TrainConfig TrainConfig::from_json(const nlohmann::json& run) {
  TrainConfig c;
  const nlohmann::json t = run.value("train", nlohmann::json::object());
  if (!t.is_object()) throw Failure(ORCHARD_ERR_REFUSED, "the run's train settings are not an object");
  c.epochs = t.value("epochs", c.epochs);
  if (t.contains("steps") && !t["steps"].is_null()) c.steps = t["steps"].get<int64_t>();
  c.batch_size = t.value("batch_size", c.batch_size);
  c.learning_rate = t.value("learning_rate", c.learning_rate);
  c.optimizer = t.value("optimizer", c.optimizer);
  c.momentum = t.value("momentum", c.momentum);
  c.weight_decay = t.value("weight_decay", c.weight_decay);
  c.proximal_mu = t.value("proximal_mu", c.proximal_mu);
  c.seed = t.value("seed", c.seed);
  return c;
}

TrainResult train(TrainingProgram& program, const DeviceData& data,
                  const std::map<std::string, std::vector<float>>& global, const TrainConfig& config,
                  uint64_t trainer_seed, StepGate* gate) {
  const Manifest& m = program.manifest();
  std::string opt = config.optimizer;
  for (auto& ch : opt) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (opt != "sgd")
    throw Failure(ORCHARD_ERR_REFUSED, "the ExecuTorch runtime steps SGD outside its program; the run asks for optimizer '" +
                                           config.optimizer + "': use optimizer = 'sgd' for runs with phone-class clients");
  if (config.batch_size < 1) throw Failure(ORCHARD_ERR_REFUSED, "batch_size must be >= 1");
  if (data.rows && data.seq_len != static_cast<size_t>(m.seq_len))
    throw Failure(ORCHARD_ERR_ARGUMENT, "the device's windows have " + std::to_string(data.seq_len) +
                                            " tokens, the training program takes " + std::to_string(m.seq_len));
  const size_t np = m.parameters.size();
  std::vector<float*> p(np);
  std::vector<size_t> sz(np);
  for (size_t j = 0; j < np; ++j) {
    const std::string& name = m.parameters[j].name;
    auto it = global.find(name);
    if (it == global.end())
      throw Failure(ORCHARD_ERR_REFUSED, "the run's model lacks '" + name + "', which the training program " +
                                             m.program_path + " trains: re-create the bundle for this run");
    p[j] = program.parameter(j);
    sz[j] = program.parameter_size(j);
    if (it->second.size() != sz[j])
      throw Failure(ORCHARD_ERR_REFUSED, "tensor '" + name + "': the training program trains " + std::to_string(sz[j]) +
                                             " values, the run sent " + std::to_string(it->second.size()));
    std::memcpy(p[j], it->second.data(), sz[j] * sizeof(float));
  }
  if (global.size() != np)
    throw Failure(ORCHARD_ERR_REFUSED, "the run's model holds " + std::to_string(global.size()) +
                                           " tensors, the training program trains " + std::to_string(np));
  TrainResult r;
  const size_t n = data.rows;
  auto collect = [&] {
    for (size_t j = 0; j < np; ++j) r.arrays[m.parameters[j].name].assign(p[j], p[j] + sz[j]);
  };
  if (n == 0) {
    collect();
    r.train_loss = r.train_accuracy = NAN;
    return r;
  }
  const float lr = static_cast<float>(config.learning_rate), mu = static_cast<float>(config.proximal_mu);
  const float wd = static_cast<float>(config.weight_decay), momentum = static_cast<float>(config.momentum);
  std::vector<std::vector<float>> anchors, bufs, grads(np);
  if (mu > 0)
    for (size_t j = 0; j < np; ++j) anchors.emplace_back(p[j], p[j] + sz[j]);
  const size_t bs = static_cast<size_t>(config.batch_size);
  const int64_t steps_per_epoch = static_cast<int64_t>((n + bs - 1) / bs);
  const int64_t total = config.steps ? *config.steps : config.epochs * steps_per_epoch;
  const uint64_t perm_seed = derive_seed({trainer_seed, config.seed}, 63);
  Pcg64 perm_rng(int_words(perm_seed));
  const size_t t = data.seq_len, mb = static_cast<size_t>(m.micro_batch);
  double loss_sum = 0;
  int64_t hits_sum = 0, seen = 0, step = 0, visited = 0;
  bool stopped = false;
  std::vector<int64_t> bx, by;
  while (step < total && !stopped) {
    std::vector<int64_t> perm;
    if (n > bs) {  // np.random.Generator.permutation(n), continuing one stream across epochs
      perm.resize(n);
      std::iota(perm.begin(), perm.end(), 0);
      for (int64_t i = static_cast<int64_t>(n) - 1; i >= 1; --i)
        std::swap(perm[static_cast<size_t>(i)], perm[bounded(perm_rng, static_cast<uint64_t>(i))]);
    }
    for (size_t start = 0; start < n; start += bs) {
      if (step >= total) break;
      if (gate != nullptr && !gate->before_step()) {
        stopped = true;
        break;
      }
      const size_t nb = std::min(bs, n - start);
      bx.resize(nb * t);
      by.resize(nb * t);
      for (size_t r_ = 0; r_ < nb; ++r_) {
        const size_t row = perm.empty() ? start + r_ : static_cast<size_t>(perm[start + r_]);
        std::memcpy(&bx[r_ * t], &data.x[row * t], t * sizeof(int64_t));
        std::memcpy(&by[r_ * t], &data.y[row * t], t * sizeof(int64_t));
      }
      const std::vector<float> w(mb, static_cast<float>(1.0 / static_cast<double>(nb * t)));
      double loss = 0;
      int64_t hits = 0;
      for (size_t s = 0; s < nb; s += mb) {
        const size_t rows = std::min(mb, nb - s);
        auto [l, h] = program.step(&bx[s * t], &by[s * t], w.data(), rows);
        loss += l;
        hits += h;
        for (size_t j = 0; j < np; ++j) {
          const float* g = program.gradient(j);
          if (s == 0) grads[j].assign(g, g + sz[j]);
          else
            for (size_t k = 0; k < sz[j]; ++k) grads[j][k] += g[k];
        }
      }
      for (size_t j = 0; j < np; ++j) {
        float* g = grads[j].data();
        float* w_ = p[j];
        if (mu > 0)
          for (size_t k = 0; k < sz[j]; ++k) g[k] += mu * (w_[k] - anchors[j][k]);
        if (wd != 0)
          for (size_t k = 0; k < sz[j]; ++k) g[k] += wd * w_[k];
        if (momentum != 0) {
          if (bufs.empty()) bufs.assign(np, {});
          if (step == 0) bufs[j].assign(g, g + sz[j]);
          else
            for (size_t k = 0; k < sz[j]; ++k) bufs[j][k] = momentum * bufs[j][k] + g[k];
          g = bufs[j].data();
        }
        for (size_t k = 0; k < sz[j]; ++k) w_[k] -= lr * g[k];
      }
      loss_sum += loss * static_cast<double>(nb * t);
      hits_sum += hits;
      seen += static_cast<int64_t>(nb * t);
      ++step;
      visited += static_cast<int64_t>(nb);
      if (gate != nullptr) gate->after_step(static_cast<double>(nb));
    }
  }
  collect();
  r.train_loss = seen ? loss_sum / static_cast<double>(seen) : NAN;
  r.train_accuracy = seen ? static_cast<double>(hits_sum) / static_cast<double>(seen) : NAN;
  r.num_steps = step;
  if (stopped) {
    r.stopped = true;
    r.weight = total > 0 ? static_cast<double>(n) * static_cast<double>(step) / static_cast<double>(total) : 0.0;
    r.num_examples = std::min<int64_t>(static_cast<int64_t>(n), visited);
    r.planned_weight = static_cast<double>(n);
  } else {
    r.weight = static_cast<double>(n);
    r.num_examples = static_cast<int64_t>(n);
  }
  return r;
}

}  // namespace orchard
