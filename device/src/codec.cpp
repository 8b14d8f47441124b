#include "codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "failure.h"
#include "numpy_random.h"

namespace orchard {

namespace {

// compression/wire.py: codec ids and raw field kinds are wire format.
constexpr uint8_t kWireVersion = 1;
constexpr uint8_t kCodecFloat32 = 1, kCodecFloat16 = 2, kCodecQsgd = 4;
constexpr uint8_t kKindPacked = 0, kKindF4 = 1, kKindF2 = 2;
constexpr uint8_t kCodecVersion = 1;
constexpr uint64_t kMaxCount = 0xffffffffull;
constexpr float kFloat16Overflow = 65520.0f;   // the smallest |x| float16 rounds to inf
const float kFlushScale = std::ldexp(1.0f, -118);  // quantize.FLUSH_SCALE
// The seed's companion word in the upload stream (client/update.py upload_rng).
constexpr uint32_t kUploadStream = 0xC0DEC;

void put_u8(std::vector<uint8_t>& out, uint8_t v) { out.push_back(v); }

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

void put_f32(std::vector<uint8_t>& out, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  put_u32(out, u);
}

void frame(std::vector<uint8_t>& out, uint8_t codec_id, const std::vector<uint32_t>& shape, uint8_t nfields) {
  out.push_back('O');
  out.push_back('Z');
  put_u8(out, kWireVersion);
  put_u8(out, codec_id);
  put_u8(out, kCodecVersion);
  put_u8(out, static_cast<uint8_t>(shape.size()));
  for (uint32_t d : shape) put_u32(out, d);
  put_u8(out, nfields);
}

void field_head(std::vector<uint8_t>& out, uint8_t kind, uint8_t bits, uint64_t count) {
  put_u8(out, kind);
  put_u8(out, bits);
  put_u32(out, static_cast<uint32_t>(count));
}

void check_finite(const TensorRef& t, uint64_t n, const char* codec) {
  for (uint64_t i = 0; i < n; ++i)
    if (!std::isfinite(t.values[i]))
      throw Failure(ORCHARD_ERR_CODEC, std::string(codec) + " cannot encode tensor '" + t.name +
                                           "': element " + std::to_string(i) + " is not finite");
}

void encode_float32(std::vector<uint8_t>& out, const TensorRef& t, uint64_t n) {
  frame(out, kCodecFloat32, t.shape, 1);
  field_head(out, kKindF4, 0, n);
  for (uint64_t i = 0; i < n; ++i) put_f32(out, t.values[i]);
}

void encode_float16(std::vector<uint8_t>& out, const TensorRef& t, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i)
    if (std::fabs(t.values[i]) >= kFloat16Overflow)
      throw Failure(ORCHARD_ERR_CODEC, "float16 holds |x| <= 65504, tensor '" + t.name + "' has |x| = " +
                                           std::to_string(std::fabs(t.values[i])) +
                                           "; use bfloat16 (float32 range) or scale the update");
  frame(out, kCodecFloat16, t.shape, 1);
  field_head(out, kKindF2, 0, n);
  for (uint64_t i = 0; i < n; ++i) {
    const uint16_t h = float_to_half(t.values[i]);
    out.push_back(static_cast<uint8_t>(h));
    out.push_back(static_cast<uint8_t>(h >> 8));
  }
}

// quantize.quantize with the QuantCodec skeleton's scales, in numpy's float32
// arithmetic and order: u = x * (half / s) + half + r, clipped to [0, 2 half], floored.
void encode_qsgd(std::vector<uint8_t>& out, const CodecSpec& spec, const TensorRef& t, uint64_t n, Pcg64& rng) {
  const uint64_t block = (spec.block == 0 || spec.fixed) ? std::max<uint64_t>(n, 1) : spec.block;
  std::vector<float> scales;
  if (spec.fixed) {
    scales.push_back(spec.scale);
  } else if (n > 0) {
    for (uint64_t b0 = 0; b0 < n; b0 += block) {
      float hi = t.values[b0], lo = t.values[b0];
      for (uint64_t i = b0; i < std::min(n, b0 + block); ++i) {
        hi = std::max(hi, t.values[i]);
        lo = std::min(lo, t.values[i]);
      }
      float s = std::max(hi, -lo);
      scales.push_back(s < kFlushScale ? 0.0f : s);
    }
  }
  const float half = static_cast<float>(((1u << spec.bits) - 1) / 2.0);
  const float top = 2 * half;
  std::vector<uint8_t> codes(n);
  for (uint64_t i = 0; i < n; ++i) {
    const float s = scales[spec.fixed ? 0 : i / block];
    const float inv = s > 0 ? half / s : 0.0f;
    float u = t.values[i] * inv;
    u += half;
    u += rng.next_float();
    u = std::min(std::max(u, 0.0f), top);
    codes[i] = static_cast<uint8_t>(u);
  }
  frame(out, kCodecQsgd, t.shape, 2);
  field_head(out, kKindF4, 0, scales.size());
  for (float s : scales) put_f32(out, s);
  field_head(out, kKindPacked, static_cast<uint8_t>(spec.bits), n);
  // compression/bits.py: value i at bits [i*w, (i+1)*w), least significant bit first.
  const unsigned w = static_cast<unsigned>(spec.bits);
  const size_t at = out.size();
  out.resize(at + (n * w + 7) / 8, 0);
  for (uint64_t i = 0; i < n; ++i) out[at + (i * w) / 8] |= static_cast<uint8_t>(codes[i] << ((i * w) % 8));
}

// A payload read front to back, every read bounds-checked.
struct Reader {
  const uint8_t* p;
  size_t n, at = 0;
  std::string what;
  const uint8_t* take(size_t k) {
    if (k > n - at) throw Failure(ORCHARD_ERR_PROTOCOL, what + " ends early (a truncated payload)");
    const uint8_t* out = p + at;
    at += k;
    return out;
  }
  uint8_t u8() { return *take(1); }
  uint32_t u32() {
    const uint8_t* b = take(4);
    return static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 | static_cast<uint32_t>(b[2]) << 16 |
           static_cast<uint32_t>(b[3]) << 24;
  }
};

struct FieldView {
  uint8_t kind, bits;
  uint32_t count;
  const uint8_t* data;
};

FieldView read_field(Reader& r) {
  FieldView f{r.u8(), r.u8(), r.u32(), nullptr};
  uint64_t bytes = 0;
  if (f.kind == kKindPacked) {
    if (f.bits < 1 || f.bits > 32) throw Failure(ORCHARD_ERR_PROTOCOL, r.what + " has a packed field of " +
                                                                           std::to_string(f.bits) + " bits");
    bytes = (static_cast<uint64_t>(f.count) * f.bits + 7) / 8;
  } else if (f.kind == kKindF4) {
    bytes = static_cast<uint64_t>(f.count) * 4;
  } else if (f.kind == kKindF2) {
    bytes = static_cast<uint64_t>(f.count) * 2;
  } else {
    throw Failure(ORCHARD_ERR_PROTOCOL, r.what + " has a field of kind " + std::to_string(f.kind) +
                                            ", which no codec this client decodes uses");
  }
  f.data = r.take(static_cast<size_t>(bytes));
  return f;
}

float f32_at(const uint8_t* b) {
  const uint32_t u = static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 |
                     static_cast<uint32_t>(b[2]) << 16 | static_cast<uint32_t>(b[3]) << 24;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // a subnormal half is a normal float
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

std::vector<float> decode_payload(const CodecSpec& spec, const uint8_t* data, size_t n,
                                  const std::vector<uint32_t>& shape, const std::string& name) {
  Reader r{data, n, 0, "the payload of tensor '" + name + "'"};
  const uint8_t* magic = r.take(2);
  if (magic[0] != 'O' || magic[1] != 'Z') throw Failure(ORCHARD_ERR_PROTOCOL, r.what + " is not an Orchard payload");
  const uint8_t wire = r.u8(), codec = r.u8(), version = r.u8();
  if (wire != kWireVersion || version != kCodecVersion)
    throw Failure(ORCHARD_ERR_PROTOCOL, r.what + " is of wire version " + std::to_string(wire) + ", codec version " +
                                            std::to_string(version) + "; this client reads 1 and 1");
  const uint8_t want = spec.name == "float32" ? kCodecFloat32 : spec.name == "float16" ? kCodecFloat16 : kCodecQsgd;
  if (codec != want)
    throw Failure(ORCHARD_ERR_PROTOCOL, r.what + " is of codec id " + std::to_string(codec) + ", not " + spec.name);
  const uint8_t ndim = r.u8();
  std::vector<uint32_t> got(ndim);
  for (uint32_t& d : got) d = r.u32();
  if (got != shape) throw Failure(ORCHARD_ERR_PROTOCOL, r.what + " has another shape than the tensor it updates");
  const uint64_t size = numel(shape);
  const uint8_t nfields = r.u8();
  std::vector<FieldView> fields;
  for (uint8_t i = 0; i < nfields; ++i) fields.push_back(read_field(r));
  if (r.at != n) throw Failure(ORCHARD_ERR_PROTOCOL, r.what + " has bytes after its last field");
  std::vector<float> out(size);
  if (codec == kCodecFloat32 || codec == kCodecFloat16) {
    const uint8_t kind = codec == kCodecFloat32 ? kKindF4 : kKindF2;
    if (fields.size() != 1 || fields[0].kind != kind || fields[0].count != size)
      throw Failure(ORCHARD_ERR_PROTOCOL, r.what + " does not hold " + std::to_string(size) + " " + spec.name + " values");
    for (uint64_t i = 0; i < size; ++i)
      out[i] = kind == kKindF4 ? f32_at(fields[0].data + 4 * i)
                               : half_to_float(static_cast<uint16_t>(fields[0].data[2 * i] | fields[0].data[2 * i + 1] << 8));
    return out;
  }
  // qsgd: scales (one per block, or the fixed one), then codes packed at `bits`.
  const uint64_t block = (spec.block == 0 || spec.fixed) ? std::max<uint64_t>(size, 1) : spec.block;
  const uint64_t blocks = spec.fixed ? 1 : (size + block - 1) / block;
  if (fields.size() != 2 || fields[0].kind != kKindF4 || fields[0].count != blocks || fields[1].kind != kKindPacked ||
      fields[1].bits != spec.bits || fields[1].count != size)
    throw Failure(ORCHARD_ERR_PROTOCOL, r.what + " is not qsgd with " + std::to_string(spec.bits) + "-bit codes and " +
                                            std::to_string(blocks) + " scales");
  const double levels = static_cast<double>((1u << spec.bits) - 1);
  const unsigned w = static_cast<unsigned>(spec.bits);
  const uint8_t mask = static_cast<uint8_t>((1u << w) - 1);
  for (uint64_t i = 0; i < size; ++i) {
    const double scale = static_cast<double>(f32_at(fields[0].data + 4 * (spec.fixed ? 0 : i / block)));
    const double step = scale * (2 / levels);
    const uint8_t code = static_cast<uint8_t>((fields[1].data[(i * w) / 8] >> ((i * w) % 8)) & mask);
    // quantize.dequantize, one summand: s * (2 J / L - 1) as J * step - s in float64.
    out[i] = static_cast<float>(static_cast<double>(code) * step - scale);
  }
  return out;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t exp = (x >> 23) & 0xffu, mant = x & 0x7fffffu;
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u | (mant >> 13) : 0u));
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {
    // A half subnormal counts units of 2**-24: (1.mant) * 2**(exp - 127) / 2**-24.
    if (e < -10) return sign;
    const uint32_t m = mant | 0x800000u;
    const unsigned shift = static_cast<unsigned>(14 - e);
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may reach inf, as it should
  return static_cast<uint16_t>(sign | h);
}

uint64_t numel(const std::vector<uint32_t>& shape) {
  uint64_t n = 1;
  for (uint32_t d : shape) n *= d;
  return n;
}

CodecSpec CodecSpec::from_json(const nlohmann::json& j) {
  CodecSpec s;
  if (!j.is_object()) throw Failure(ORCHARD_ERR_CODEC, "a codec spec is a JSON object, got " + j.dump());
  if (j.contains("name")) {
    if (!j["name"].is_string()) throw Failure(ORCHARD_ERR_CODEC, "codec.name must be a string");
    s.name = j["name"].get<std::string>();
  }
  nlohmann::json params = j.value("params", nlohmann::json::object());
  if (!params.is_object()) throw Failure(ORCHARD_ERR_CODEC, "codec.params must be an object");
  if (s.name == "float32" || s.name == "float16") {
    if (!params.empty())
      throw Failure(ORCHARD_ERR_CODEC, "codec " + s.name + " takes no params, got " + params.dump());
    return s;
  }
  if (s.name != "qsgd")
    throw Failure(ORCHARD_ERR_CODEC, "codec '" + s.name +
                                         "' is not sent by this device client; it sends float32, float16 "
                                         "and qsgd (run the federation with one of those)");
  for (auto it = params.begin(); it != params.end(); ++it) {
    const std::string& k = it.key();
    const nlohmann::json& v = it.value();
    if (k == "bits") {
      if (!v.is_number_integer() || (v != 1 && v != 2 && v != 4 && v != 8))
        throw Failure(ORCHARD_ERR_CODEC, "codec.params.bits must be one of 1, 2, 4, 8, got " + v.dump());
      s.bits = v.get<int>();
    } else if (k == "block") {
      if (v.is_null()) continue;
      if (!v.is_number_integer() || v.get<int64_t>() < 1)
        throw Failure(ORCHARD_ERR_CODEC, "codec.params.block must be an int >= 1, got " + v.dump());
      s.block = v.get<uint64_t>();
    } else if (k == "scale") {
      if (v.is_null()) continue;
      if (!v.is_number() || !(v.get<double>() > 0))
        throw Failure(ORCHARD_ERR_CODEC, "codec.params.scale must be a float > 0, got " + v.dump());
      s.fixed = true;
      s.scale = static_cast<float>(v.get<double>());
    } else {
      throw Failure(ORCHARD_ERR_CODEC, "codec qsgd has no param '" + k + "' (bits, block, scale)");
    }
  }
  return s;
}

EncodedUpdate encode_update(const CodecSpec& spec, const std::vector<TensorRef>& tensors, uint64_t seed) {
  EncodedUpdate u;
  // One stream for the whole update, created only if drawn from, as the Python one is.
  std::vector<uint32_t> entropy = int_words(seed);
  entropy.push_back(kUploadStream);
  std::unique_ptr<Pcg64> rng;
  for (const TensorRef& t : tensors) {
    if (t.shape.size() > 255) throw Failure(ORCHARD_ERR_CODEC, "tensor '" + t.name + "' has more than 255 dims");
    const uint64_t n = numel(t.shape);
    if (n > kMaxCount) throw Failure(ORCHARD_ERR_CODEC, "tensor '" + t.name + "' has more than 2**32 - 1 elements");
    if (n > 0 && t.values == nullptr) throw Failure(ORCHARD_ERR_CODEC, "tensor '" + t.name + "' has no values");
    check_finite(t, n, spec.name.c_str());
    const size_t before = u.payload.size();
    if (spec.name == "float32") {
      encode_float32(u.payload, t, n);
    } else if (spec.name == "float16") {
      encode_float16(u.payload, t, n);
    } else {
      if (!rng) rng = std::make_unique<Pcg64>(entropy);
      encode_qsgd(u.payload, spec, t, n, *rng);
    }
    u.sizes.push_back(u.payload.size() - before);
  }
  return u;
}

}  // namespace orchard
