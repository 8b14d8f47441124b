#include "numpy_random.h"

namespace orchard {

namespace {

constexpr size_t kPoolSize = 4;
constexpr uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd, kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd, kMixMultR = 0x4973f715;
constexpr unsigned kXShift = 16;

uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t result = kMixMultL * x - kMixMultR * y;
  result ^= result >> kXShift;
  return result;
}

}  // namespace

std::vector<uint32_t> int_words(uint64_t value) {
  if (value == 0) return {0};
  std::vector<uint32_t> out;
  while (value != 0) {
    out.push_back(static_cast<uint32_t>(value & 0xffffffffu));
    value >>= 32;
  }
  return out;
}

std::vector<uint32_t> seed_sequence_state(const std::vector<uint32_t>& entropy,
                                          const std::vector<uint32_t>& spawn_key, size_t n_words) {
  // get_assembled_entropy: the run entropy is zero-padded to the pool size when a
  // spawn key follows it, so the key cannot alias entropy words.
  std::vector<uint32_t> assembled = entropy;
  if (!spawn_key.empty() && assembled.size() < kPoolSize) assembled.resize(kPoolSize, 0);
  assembled.insert(assembled.end(), spawn_key.begin(), spawn_key.end());

  uint32_t pool[kPoolSize];
  uint32_t hash_const = kInitA;
  for (size_t i = 0; i < kPoolSize; ++i) pool[i] = hashmix(i < assembled.size() ? assembled[i] : 0, hash_const);
  for (size_t src = 0; src < kPoolSize; ++src)
    for (size_t dst = 0; dst < kPoolSize; ++dst)
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], hash_const));
  for (size_t src = kPoolSize; src < assembled.size(); ++src)
    for (size_t dst = 0; dst < kPoolSize; ++dst) pool[dst] = mix(pool[dst], hashmix(assembled[src], hash_const));

  std::vector<uint32_t> state(n_words);
  uint32_t hc = kInitB;
  for (size_t i = 0; i < n_words; ++i) {
    uint32_t v = pool[i % kPoolSize];
    v ^= hc;
    hc *= kMultB;
    v *= hc;
    v ^= v >> kXShift;
    state[i] = v;
  }
  return state;
}

namespace {
constexpr unsigned __int128 kMultiplier =
    (static_cast<unsigned __int128>(0x2360ED051FC65DA4ull) << 64) | 0x4385DF649FCCF645ull;
}

Pcg64::Pcg64(const std::vector<uint32_t>& entropy) {
  // generate_state(4, uint64): eight words, paired little-endian into four uint64.
  const std::vector<uint32_t> w = seed_sequence_state(entropy, {}, 8);
  uint64_t v[4];
  for (int i = 0; i < 4; ++i) v[i] = static_cast<uint64_t>(w[2 * i]) | (static_cast<uint64_t>(w[2 * i + 1]) << 32);
  const unsigned __int128 initstate = (static_cast<unsigned __int128>(v[0]) << 64) | v[1];
  const unsigned __int128 initseq = (static_cast<unsigned __int128>(v[2]) << 64) | v[3];
  state_ = 0;
  inc_ = (initseq << 1) | 1;
  step();
  state_ += initstate;
  step();
}

void Pcg64::step() { state_ = state_ * kMultiplier + inc_; }

uint64_t Pcg64::next64() {
  step();
  const uint64_t hi = static_cast<uint64_t>(state_ >> 64), lo = static_cast<uint64_t>(state_);
  const uint64_t x = hi ^ lo;
  const unsigned rot = static_cast<unsigned>(hi >> 58);
  return (x >> rot) | (x << ((64 - rot) & 63));
}

uint32_t Pcg64::next32() {
  if (has32_) {
    has32_ = false;
    return buffered_;
  }
  const uint64_t next = next64();
  has32_ = true;
  buffered_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next & 0xffffffffu);
}

float Pcg64::next_float() { return static_cast<float>(next32() >> 8) * (1.0f / 16777216.0f); }

double Pcg64::next_double() { return static_cast<double>(next64() >> 11) * (1.0 / 9007199254740992.0); }

}  // namespace orchard
