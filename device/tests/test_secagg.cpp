// SecAgg+ against orchard.secure_agg (device_vectors.py: secagg.json): Shamir shares,
// masks, the client's quantiser, and whole sessions, where every native reply must be
// the Python client's bytes for the same entropy and broadcasts. Then every broadcast
// damaged (truncated, bytes flipped, replayed into the wrong stage): each is refused with
// ORCHARD_ERR_SECAGG, never a crash (the sanitizer build runs this too).
#include <cstring>

#include "check.h"
#include "crypto.h"
#include "failure.h"
#include "secagg.h"
#include "vectors.h"

using namespace orchard;

static Bytes unhex(const nlohmann::json& j) { return vectors::unhex(j.get<std::string>()); }

TEST(shamir_shares_equal_python) {
  auto v = vectors::load("secagg.json");
  for (auto& c : v["shamir"]) {
    ByteStream rand(unhex(c["key"]));
    auto xs = c["xs"].get<std::vector<uint32_t>>();
    auto shares = shamir_share(unhex(c["secret"]), c["threshold"], xs, rand);
    CHECK(shares.size() == c["shares"].size());
    std::map<uint32_t, Bytes> by_point;
    for (size_t i = 0; i < shares.size(); ++i) {
      CHECK_MSG(shares[i] == unhex(c["shares"][i]), c["secret"].get<std::string>());
      by_point[xs[i]] = shares[i];
    }
    const Bytes secret = unhex(c["secret"]);
    CHECK(shamir_reconstruct(by_point, c["threshold"], secret.size()) == secret);
  }
}

TEST(masks_equal_python) {
  auto v = vectors::load("secagg.json");
  for (auto& c : v["masks"]) {
    std::vector<uint32_t> acc(c["length"].get<size_t>(), 0);
    add_mask(acc, unhex(c["seed"]), 1);
    Bytes got(acc.size() * 4);
    if (!acc.empty()) std::memcpy(got.data(), acc.data(), got.size());  // little-endian host
    CHECK(got == unhex(c["mask"]));
    add_mask(acc, unhex(c["seed"]), -1);
    for (uint32_t w : acc) CHECK(w == 0);
  }
}

TEST(quantiser_equals_python) {
  auto v = vectors::load("secagg.json");
  for (auto& c : v["quantize"]) {
    auto q = secure_quantize(c["x"].get<std::vector<double>>(), c["clip"], c["bits"], c["seed"]);
    CHECK(q == c["q"].get<std::vector<uint32_t>>());
  }
}

TEST(sessions_byte_for_byte) {
  auto v = vectors::load("secagg.json");
  for (auto& s : v["sessions"]) {
    for (auto& [node, steps] : s["transcripts"].items()) {
      SecAggClient client(node, unhex(s["entropy"][node]));
      int i = 0;
      for (auto& step : steps) {
        std::vector<uint32_t> vec;
        if (!step["vector"].is_null()) vec = step["vector"].get<std::vector<uint32_t>>();
        Bytes reply = client.respond(unhex(step["broadcast"]), step["vector"].is_null() ? nullptr : &vec);
        CHECK_MSG(reply == unhex(step["reply"]), node + " step " + std::to_string(i) + ": " +
                                                     vectors::first_difference(reply, unhex(step["reply"])));
        // A broadcast again (its reply was lost) gets the same reply.
        CHECK(client.respond(unhex(step["broadcast"]), step["vector"].is_null() ? nullptr : &vec) == reply);
        ++i;
      }
    }
  }
}

// Replays `steps` up to `upto` and returns the client there.
static std::unique_ptr<SecAggClient> client_at(const std::string& node, const Bytes& entropy,
                                               const nlohmann::json& steps, size_t upto) {
  auto c = std::make_unique<SecAggClient>(node, entropy);
  for (size_t i = 0; i < upto; ++i) {
    std::vector<uint32_t> vec;
    if (!steps[i]["vector"].is_null()) vec = steps[i]["vector"].get<std::vector<uint32_t>>();
    c->respond(unhex(steps[i]["broadcast"]), steps[i]["vector"].is_null() ? nullptr : &vec);
  }
  return c;
}

static bool refused(SecAggClient& c, const Bytes& b, const std::vector<uint32_t>* vec, std::string* why) {
  try {
    c.respond(b, vec);
    return false;
  } catch (const Failure& f) {
    *why = f.what();
    return f.code() == ORCHARD_ERR_SECAGG;
  }
}

TEST(malformed_broadcasts_are_refused) {
  auto v = vectors::load("secagg.json");
  auto& s = v["sessions"][0];
  const std::string node = "client-01";
  auto& steps = s["transcripts"][node];
  const Bytes entropy = unhex(s["entropy"][node]);
  int refusals = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const Bytes good = unhex(steps[i]["broadcast"]);
    std::vector<uint32_t> vec;
    if (!steps[i]["vector"].is_null()) vec = steps[i]["vector"].get<std::vector<uint32_t>>();
    const std::vector<uint32_t>* pv = steps[i]["vector"].is_null() ? nullptr : &vec;
    std::string why;
    // Every truncation, and trailing bytes.
    for (size_t cut = 0; cut < good.size(); cut += (good.size() > 400 ? 7 : 1)) {
      auto c = client_at(node, entropy, steps, i);
      CHECK_MSG(refused(*c, Bytes(good.begin(), good.begin() + static_cast<long>(cut)), pv, &why),
                "step " + std::to_string(i) + " cut " + std::to_string(cut));
      ++refusals;
    }
    auto c = client_at(node, entropy, steps, i);
    Bytes longer = good;
    longer.push_back(0);
    CHECK(refused(*c, longer, pv, &why) && why.find("trailing") != std::string::npos);
    // A flipped byte anywhere: refused, or (a changed key or value) answered; never a crash.
    for (size_t at = 0; at < good.size(); at += (good.size() > 400 ? 5 : 1)) {
      auto d = client_at(node, entropy, steps, i);
      Bytes bad = good;
      bad[at] ^= 0x41;
      try {
        d->respond(bad, pv);
      } catch (const Failure& f) {
        CHECK_MSG(f.code() == ORCHARD_ERR_SECAGG, f.what());
        ++refusals;
      }
    }
    // A broadcast of another stage, and one for another session.
    if (i + 1 < steps.size()) {
      auto e = client_at(node, entropy, steps, i);
      CHECK(refused(*e, unhex(steps[i + 1]["broadcast"]), pv, &why) && why.rfind("WrongStage", 0) == 0);
    }
    if (i > 0) {
      auto e = client_at(node, entropy, steps, i);
      Bytes other = good;
      other[6] ^= 1;  // a byte of the session id
      CHECK(refused(*e, other, pv, &why) && why.rfind("WrongSession", 0) == 0);
    }
  }
  CHECK(refusals > 100);
  // The masked-input stage needs the vector, of the session's length, below 2^bits.
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i]["vector"].is_null()) continue;
    std::string why;
    auto c = client_at(node, entropy, steps, i);
    CHECK(refused(*c, unhex(steps[i]["broadcast"]), nullptr, &why));
    std::vector<uint32_t> short_vec(3, 0);
    CHECK(refused(*c, unhex(steps[i]["broadcast"]), &short_vec, &why));
  }
}

CHECK_MAIN()
