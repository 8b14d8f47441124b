// SecAgg+ against orchard.secure_agg (device_vectors.py: secagg.json): Shamir shares,
// masks, the client's quantiser, and whole sessions of both message versions (the
// semi-honest protocol; the active one with the clients' keys certified by a root, and
// with uncertified keys), where every native reply must be the Python client's bytes for
// the same entropy, identity key and broadcasts. Then broadcasts a lying server would
// send (a neighbour's signature, certificate or commitment altered, a view without this
// client, an unmask request under another view or without t valid signatures): the
// native client answers or refuses as the Python client does. Then every broadcast
// damaged (truncated, bytes flipped, replayed into the wrong stage): each is refused with
// ORCHARD_ERR_SECAGG, never a crash (the sanitizer build runs this too).
#include <cstring>

#include "check.h"
#include "crypto.h"
#include "failure.h"
#include "identity.h"
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

template <typename Word>
static void check_mask(const nlohmann::json& c) {
  std::vector<Word> acc(c["length"].get<size_t>(), 0);
  add_mask(acc, unhex(c["seed"]), 1);
  Bytes got(acc.size() * sizeof(Word));
  if (!acc.empty()) std::memcpy(got.data(), acc.data(), got.size());  // little-endian host
  CHECK(got == unhex(c["mask"]));
  add_mask(acc, unhex(c["seed"]), -1);
  for (Word w : acc) CHECK(w == 0);
}

TEST(masks_equal_python) {
  auto v = vectors::load("secagg.json");
  int wide = 0;
  for (auto& c : v["masks"]) {
    if (c["word"] == 8) {
      check_mask<uint64_t>(c);
      ++wide;
    } else {
      check_mask<uint32_t>(c);
    }
  }
  CHECK(wide >= 2);
}

TEST(quantiser_equals_python) {
  auto v = vectors::load("secagg.json");
  for (auto& c : v["quantize"]) {
    auto q = secure_quantize(c["x"].get<std::vector<double>>(), c["clip"], c["bits"], c["seed"].get<uint64_t>());
    CHECK(q == c["q"].get<std::vector<uint32_t>>());
  }
}

// The client a session's vectors describe: its entropy, and in a certified session its
// device key, the root's certificate of it and the root's key as its policy.
static std::unique_ptr<SecAggClient> make_client(const nlohmann::json& s, const std::string& node) {
  if (s["identity"].is_null()) return std::make_unique<SecAggClient>(node, unhex(s["entropy"][node]));
  const Bytes key = unhex(s["identity"][node]["key"]);
  SecAggIdentity id{[key](const Bytes& m) { return ed25519_sign(key, m); }, unhex(s["identity"][node]["certificate"])};
  ClientPolicy policy;
  policy.root_public_key = unhex(s["root_public_key"]);
  return std::make_unique<SecAggClient>(node, unhex(s["entropy"][node]), id, policy);
}

TEST(sessions_byte_for_byte) {
  auto v = vectors::load("secagg.json");
  int active = 0, certified = 0;
  for (auto& s : v["sessions"]) {
    active += s["active"].get<bool>();
    certified += !s["identity"].is_null();
    for (auto& [node, steps] : s["transcripts"].items()) {
      auto made = make_client(s, node);
      SecAggClient& client = *made;
      int i = 0;
      for (auto& step : steps) {
        std::vector<uint64_t> vec;
        if (!step["vector"].is_null()) vec = step["vector"].get<std::vector<uint64_t>>();
        Bytes reply = client.respond(unhex(step["broadcast"]), step["vector"].is_null() ? nullptr : &vec);
        CHECK_MSG(reply == unhex(step["reply"]), node + " step " + std::to_string(i) + ": " +
                                                     vectors::first_difference(reply, unhex(step["reply"])));
        // A broadcast again (its reply was lost) gets the same reply.
        CHECK(client.respond(unhex(step["broadcast"]), step["vector"].is_null() ? nullptr : &vec) == reply);
        ++i;
      }
      CHECK(client.stage() == (s["dropped"].get<std::vector<std::string>>().size() &&
                                       std::count(s["dropped"].begin(), s["dropped"].end(), node)
                                   ? SecAggStage::masked_input
                                   : SecAggStage::done));
    }
  }
  CHECK(active >= 2 && certified >= 1);
  int wide = 0;  // sessions over fields above 32 bits (64-bit words)
  for (auto& s : v["sessions"]) wide += s["modulus_bits"].get<int>() > 32;
  CHECK(wide >= 2);
}

// Replays `steps` up to `upto` and returns the client there.
static std::unique_ptr<SecAggClient> client_at(const nlohmann::json& s, const std::string& node,
                                               const nlohmann::json& steps, size_t upto) {
  auto c = make_client(s, node);
  for (size_t i = 0; i < upto; ++i) {
    std::vector<uint64_t> vec;
    if (!steps[i]["vector"].is_null()) vec = steps[i]["vector"].get<std::vector<uint64_t>>();
    c->respond(unhex(steps[i]["broadcast"]), steps[i]["vector"].is_null() ? nullptr : &vec);
  }
  return c;
}

static bool refused(SecAggClient& c, const Bytes& b, const std::vector<uint64_t>* vec, std::string* why) {
  try {
    c.respond(b, vec);
    return false;
  } catch (const Failure& f) {
    *why = f.what();
    return f.code() == ORCHARD_ERR_SECAGG;
  }
}

TEST(a_lying_server_gets_the_python_answer) {
  auto v = vectors::load("secagg.json");
  int cases = 0, aborts = 0;
  for (auto& s : v["sessions"]) {
    if (!s.contains("tampered")) continue;
    for (auto& t : s["tampered"]) {
      const std::string node = t["node"];
      auto c = client_at(s, node, s["transcripts"][node], t["at"].get<size_t>());
      std::string why;
      const std::string what = t["what"];
      if (t.contains("reply")) {
        Bytes got;
        try {
          got = c->respond(unhex(t["broadcast"]));
        } catch (const Failure& f) {
          CHECK_MSG(false, what + ": refused (" + f.what() + "), Python answered");
          continue;
        }
        CHECK_MSG(got == unhex(t["reply"]), what + ": " + vectors::first_difference(got, unhex(t["reply"])));
      } else {
        CHECK_MSG(refused(*c, unhex(t["broadcast"]), nullptr, &why) && why.rfind(t["error"].get<std::string>(), 0) == 0,
                  what + ": " + why);
        if (t["error"] == "SecAggAbort") {
          ++aborts;
          CHECK(c->stage() == SecAggStage::aborted);
        }
      }
      ++cases;
    }
  }
  CHECK(cases >= 16 && aborts >= 8);
}

TEST(sessions_are_held_to_the_clients_policy) {
  auto v = vectors::load("secagg.json");
  std::string why;
  // A client holding the root's key refuses a semi-honest session.
  auto& honest = v["sessions"][0];
  ClientPolicy strict;
  strict.root_public_key = Bytes(32, 7);
  const std::string node = honest["participants"][0];
  SecAggClient c(node, unhex(honest["entropy"][node]), std::nullopt, strict);
  CHECK(refused(c, unhex(honest["transcripts"][node][0]["broadcast"]), nullptr, &why) &&
        why.rfind("SecAggConfigError", 0) == 0 && why.find("semi-honest") != std::string::npos);
  CHECK(c.stage() == SecAggStage::advertise_keys);
  // Floors: more participants than the session has.
  ClientPolicy many;
  many.min_participants = 100;
  SecAggClient d(node, unhex(honest["entropy"][node]), std::nullopt, many);
  CHECK(refused(d, unhex(honest["transcripts"][node][0]["broadcast"]), nullptr, &why) &&
        why.find(">= 100") != std::string::npos);
  // A certified session's keys checked against another root: every neighbour is absent.
  for (auto& s : v["sessions"]) {
    if (s["identity"].is_null()) continue;
    const std::string n = s["participants"][0];
    const Bytes key = unhex(s["identity"][n]["key"]);
    ClientPolicy other;
    other.root_public_key = ed25519_public(Bytes(32, 9));
    SecAggClient e(n, unhex(s["entropy"][n]), SecAggIdentity{[key](const Bytes& m) { return ed25519_sign(key, m); },
                                                              unhex(s["identity"][n]["certificate"])},
                   other);
    e.respond(unhex(s["transcripts"][n][0]["broadcast"]));
    CHECK(refused(e, unhex(s["transcripts"][n][1]["broadcast"]), nullptr, &why) && why.rfind("SecAggAbort", 0) == 0);
    break;
  }
}

static void damage_every_broadcast(const nlohmann::json& s, const std::string& node) {
  auto& steps = s["transcripts"][node];
  int refusals = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const Bytes good = unhex(steps[i]["broadcast"]);
    std::vector<uint64_t> vec;
    if (!steps[i]["vector"].is_null()) vec = steps[i]["vector"].get<std::vector<uint64_t>>();
    const std::vector<uint64_t>* pv = steps[i]["vector"].is_null() ? nullptr : &vec;
    std::string why;
    // Every truncation, and trailing bytes.
    for (size_t cut = 0; cut < good.size(); cut += (good.size() > 400 ? 7 : 1)) {
      auto c = client_at(s, node, steps, i);
      CHECK_MSG(refused(*c, Bytes(good.begin(), good.begin() + static_cast<long>(cut)), pv, &why),
                "step " + std::to_string(i) + " cut " + std::to_string(cut));
      ++refusals;
    }
    auto c = client_at(s, node, steps, i);
    Bytes longer = good;
    longer.push_back(0);
    CHECK(refused(*c, longer, pv, &why) && why.find("trailing") != std::string::npos);
    // A flipped byte anywhere: refused, or (a changed key or value) answered; never a crash.
    for (size_t at = 0; at < good.size(); at += (good.size() > 400 ? 5 : 1)) {
      auto d = client_at(s, node, steps, i);
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
      auto e = client_at(s, node, steps, i);
      CHECK(refused(*e, unhex(steps[i + 1]["broadcast"]), pv, &why) && why.rfind("WrongStage", 0) == 0);
    }
    if (i > 0) {
      auto e = client_at(s, node, steps, i);
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
    auto c = client_at(s, node, steps, i);
    CHECK(refused(*c, unhex(steps[i]["broadcast"]), nullptr, &why));
    std::vector<uint64_t> short_vec(3, 0);
    CHECK(refused(*c, unhex(steps[i]["broadcast"]), &short_vec, &why));
  }
}

TEST(malformed_broadcasts_are_refused) {
  auto v = vectors::load("secagg.json");
  damage_every_broadcast(v["sessions"][0], "client-01");
}

TEST(malformed_active_broadcasts_are_refused) {
  auto v = vectors::load("secagg.json");
  for (auto& s : v["sessions"])
    if (s["active"].get<bool>() && !s["identity"].is_null()) {
      damage_every_broadcast(s, "client-01");
      return;
    }
  CHECK_MSG(false, "no certified active session in the vectors");
}

CHECK_MAIN()
