// numpy's default Generator, reproduced bit for bit: SeedSequence (numpy/random/
// bit_generator.pyx) feeding PCG64 (XSL-RR 128/64, numpy/random/src/pcg64), and
// Generator.random(dtype=float32). The Python encoder draws its stochastic rounding
// from np.random.default_rng([seed, 0xC0DEC]) (client/update.py upload_rng); a device
// that draws the same numbers sends the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace orchard {

// SeedSequence(entropy, spawn_key).generate_state(n_words, uint32): the words a
// BitGenerator is seeded with. `entropy` and `spawn_key` are the uint32 words numpy
// coerces its arguments to (an int: its 32-bit words, least significant first; a
// list: the concatenation of its items' words).
std::vector<uint32_t> seed_sequence_state(const std::vector<uint32_t>& entropy,
                                          const std::vector<uint32_t>& spawn_key, size_t n_words);

// numpy's coercion of one non-negative int to uint32 words (0 -> [0]).
std::vector<uint32_t> int_words(uint64_t value);

class Pcg64 {
 public:
  // PCG64(SeedSequence(entropy)).
  explicit Pcg64(const std::vector<uint32_t>& entropy);

  uint64_t next64();
  uint32_t next32();        // the low half of a 64-bit draw, then its high half
  float next_float();       // Generator.random(dtype=np.float32): 24 random bits / 2**24
  double next_double();     // Generator.random(): 53 random bits / 2**53

 private:
  unsigned __int128 state_ = 0;
  unsigned __int128 inc_ = 0;
  bool has32_ = false;
  uint32_t buffered_ = 0;
  void step();
};

}  // namespace orchard
