#include "timezone.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "failure.h"

namespace orchard {

namespace {

// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
int64_t days_from_civil(int64_t y, int m, int d) {
  y -= m <= 2;
  const int64_t era = (y >= 0 ? y : y - 399) / 400;
  const int64_t yoe = y - era * 400;
  const int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + doe - 719468;
}

int64_t year_of(int64_t days) {  // civil_from_days, the year only
  days += 719468;
  const int64_t era = (days >= 0 ? days : days - 146096) / 146097;
  const int64_t doe = days - era * 146097;
  const int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
  const int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
  const int64_t mp = (5 * doy + 2) / 153;
  return yoe + era * 400 + (mp >= 10 ? 1 : 0);
}

bool leap(int64_t y) { return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0; }

int days_in_month(int64_t y, int m) {
  static const int d[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  return m == 2 && leap(y) ? 29 : d[m - 1];
}

// The day (days since epoch) a rule's date falls on in year y.
int64_t rule_day(const TimeZone::Rule::Date& r, int64_t y) {
  if (r.kind == 'J') return days_from_civil(y, 1, 1) + r.day - 1 + (leap(y) && r.day >= 60 ? 1 : 0);
  if (r.kind == 'D') return days_from_civil(y, 1, 1) + r.day;
  const int64_t first = days_from_civil(y, r.month, 1);
  const int wd = static_cast<int>(((first + 4) % 7 + 7) % 7);  // 1970-01-01 was a Thursday
  int day = 1 + (r.day - wd + 7) % 7 + 7 * (r.week - 1);
  while (day > days_in_month(y, r.month)) day -= 7;
  return first + day - 1;
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

// The rule's changes in year y, as local wall-clock seconds (start in standard time,
// end in daylight time), as CPython's zoneinfo _TZStr.transitions gives them.
std::pair<int64_t, int64_t> rule_changes(const TimeZone::Rule& r, int64_t y) {
  return {rule_day(r.start, y) * 86400 + r.start.time_s, rule_day(r.end, y) * 86400 + r.end.time_s};
}

bool between(int64_t start, int64_t end, int64_t t) { return start < end ? (start <= t && t < end) : !(end <= t && t < start); }

// The offset at UTC instant t (zoneinfo's get_trans_info_fromutc: the year is t's UTC year).
int64_t rule_offset(const TimeZone::Rule& r, int64_t t) {
  if (!r.has_dst) return r.std_offset;
  auto [start, end] = rule_changes(r, year_of(floor_div(t, 86400)));
  return between(start - r.std_offset, end - r.dst_offset, t) ? r.dst_offset : r.std_offset;
}

// The offset of local wall time `local` (zoneinfo's get_trans_info with fold = 0: a time
// in a gap takes the offset before it, a repeated time its first occurrence).
int64_t rule_offset_local(const TimeZone::Rule& r, int64_t local) {
  if (!r.has_dst) return r.std_offset;
  auto [start, end] = rule_changes(r, year_of(floor_div(local, 86400)));
  const int64_t diff = r.dst_offset - r.std_offset;
  if (diff < 0) {
    end -= diff;
  } else {
    start += diff;
  }
  return between(start, end, local) ? r.dst_offset : r.std_offset;
}

// POSIX TZ pieces, consumed from the front of `s`.
bool name(const std::string& s, size_t& i) {
  if (i < s.size() && s[i] == '<') {
    const size_t close = s.find('>', i);
    if (close == std::string::npos) return false;
    i = close + 1;
    return true;
  }
  const size_t from = i;
  while (i < s.size() && std::isalpha(static_cast<unsigned char>(s[i]))) ++i;
  return i - from >= 3;
}

bool hms(const std::string& s, size_t& i, int64_t* out, bool sign_allowed) {
  int64_t sign = 1;
  if (sign_allowed && i < s.size() && (s[i] == '+' || s[i] == '-')) sign = s[i++] == '-' ? -1 : 1;
  int64_t total = 0;
  for (int part = 0; part < 3; ++part) {
    if (part > 0) {
      if (i >= s.size() || s[i] != ':') break;
      ++i;
    }
    const size_t from = i;
    int64_t v = 0;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) v = v * 10 + (s[i++] - '0');
    if (i == from || i - from > 3) return false;
    total += v * (part == 0 ? 3600 : part == 1 ? 60 : 1);
  }
  *out = sign * total;
  return true;
}

bool number(const std::string& s, size_t& i, int* out) {
  const size_t from = i;
  int v = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])) && i - from < 3) v = v * 10 + (s[i++] - '0');
  *out = v;
  return i > from;
}

bool date(const std::string& s, size_t& i, TimeZone::Rule::Date* d) {
  if (i < s.size() && s[i] == 'M') {
    ++i;
    d->kind = 'M';
    if (!number(s, i, &d->month) || i >= s.size() || s[i++] != '.' || !number(s, i, &d->week) || i >= s.size() ||
        s[i++] != '.' || !number(s, i, &d->day))
      return false;
    if (d->month < 1 || d->month > 12 || d->week < 1 || d->week > 5 || d->day > 6) return false;
  } else {
    d->kind = 'D';
    if (i < s.size() && s[i] == 'J') {
      d->kind = 'J';
      ++i;
    }
    if (!number(s, i, &d->day) || d->day > 365 || (d->kind == 'J' && d->day < 1)) return false;
  }
  d->time_s = 7200;
  if (i < s.size() && s[i] == '/') {
    ++i;
    if (!hms(s, i, &d->time_s, true)) return false;  // RFC 8536: -167..167 hours
  }
  return true;
}

uint64_t be(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int k = 0; k < n; ++k) v = (v << 8) | p[k];
  return v;
}

}  // namespace

bool parse_posix_tz(const std::string& s, TimeZone::Rule* out) {
  size_t i = 0;
  TimeZone::Rule r;
  int64_t off = 0;
  if (!name(s, i) || !hms(s, i, &off, true)) return false;
  r.std_offset = -off;  // POSIX counts west of UTC
  if (i < s.size()) {
    if (!name(s, i)) return false;
    r.has_dst = true;
    r.dst_offset = r.std_offset + 3600;
    if (i < s.size() && s[i] != ',') {
      if (!hms(s, i, &off, true)) return false;
      r.dst_offset = -off;
    }
    // A zone with daylight time and no rule: the POSIX default (the US rule since 2007).
    r.start = {'M', 3, 2, 0, 7200};
    r.end = {'M', 11, 1, 0, 7200};
    if (i < s.size()) {
      if (s[i++] != ',' || !date(s, i, &r.start) || i >= s.size() || s[i++] != ',' || !date(s, i, &r.end)) return false;
    }
  }
  if (i != s.size()) return false;
  *out = r;
  return true;
}

std::shared_ptr<const TimeZone> TimeZone::load(const std::string& zone, const std::string& zoneinfo_dir) {
  std::string dir = zoneinfo_dir;
  if (dir.empty()) {
    const char* env = std::getenv("ORCHARD_ZONEINFO");
    dir = env != nullptr && *env ? env : "/usr/share/zoneinfo";
  }
  // A zone name is a relative path of letters, digits and _+-/ with no "..": never a
  // way out of the zoneinfo directory.
  bool ok = !zone.empty() && zone.size() < 256 && zone[0] != '/' && zone.find("..") == std::string::npos;
  for (char c : zone)
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '/' || c == '_' || c == '-' || c == '+');
  const std::string path = dir + "/" + zone;
  const auto refuse = [&](const std::string& why) {
    return Failure(ORCHARD_ERR_BUNDLE, "time zone '" + zone + "': " + why +
                                           "; use an IANA name this device knows, 'UTC' or an offset like '+05:30'");
  };
  if (!ok) throw refuse("not an IANA zone name");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw refuse("no such zone in " + dir);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string raw = ss.str();
  const auto* p = reinterpret_cast<const uint8_t*>(raw.data());
  const size_t n = raw.size();
  const auto bad = [&] { return refuse(path + " is not a TZif file"); };
  if (n < 44 || raw.compare(0, 4, "TZif") != 0) throw bad();
  const char version = raw[4];
  // The counts of a header at `h`, and the size of the data block they describe.
  struct Counts {
    uint64_t isut, isstd, leap, time, type, chars;
  };
  const auto counts = [&](size_t h) {
    if (h + 44 > n) throw bad();
    return Counts{be(p + h + 20, 4), be(p + h + 24, 4), be(p + h + 28, 4), be(p + h + 32, 4), be(p + h + 36, 4),
                  be(p + h + 40, 4)};
  };
  const auto block = [](const Counts& c, int t) {
    return c.time * t + c.time + c.type * 6 + c.chars + c.leap * (t + 4) + c.isstd + c.isut;
  };
  Counts c = counts(0);
  size_t h = 0;
  int width = 4;
  if (version >= '2') {  // skip the 32-bit section for the 64-bit one
    h = 44 + block(c, 4);
    c = counts(h);
    width = 8;
  }
  const size_t data = h + 44;
  if (c.type == 0 || c.type > 256 || c.time > 1000000 || data + block(c, width) > n) throw bad();
  auto tz = std::make_shared<TimeZone>();
  tz->name_ = zone;
  for (uint64_t k = 0; k < c.time; ++k) {
    const uint64_t v = be(p + data + k * width, width);
    tz->transitions_.push_back(width == 8 ? static_cast<int64_t>(v) : static_cast<int32_t>(static_cast<uint32_t>(v)));
    const uint8_t type = p[data + c.time * width + k];
    if (type >= c.type) throw bad();
    tz->types_.push_back(type);
  }
  const size_t infos = data + c.time * width + c.time;
  for (uint64_t k = 0; k < c.type; ++k)
    tz->offsets_.push_back(static_cast<int32_t>(static_cast<uint32_t>(be(p + infos + 6 * k, 4))));
  if (width == 8) {
    const size_t foot = data + block(c, width);
    if (foot < n && raw[foot] == '\n') {
      const size_t close = raw.find('\n', foot + 1);
      if (close == std::string::npos) throw bad();
      const std::string rule = raw.substr(foot + 1, close - foot - 1);
      if (!rule.empty()) {
        if (!parse_posix_tz(rule, &tz->rule_)) throw refuse(path + " ends with a TZ rule this client does not read: " + rule);
        tz->has_rule_ = true;
      }
    }
  }
  return tz;
}

int64_t TimeZone::utc_offset(int64_t t) const {
  if (!transitions_.empty() && t < transitions_.front()) return offsets_[0];  // RFC 8536: type 0 before
  if ((transitions_.empty() || t > transitions_.back()) && has_rule_) return rule_offset(rule_, t);
  if (transitions_.empty()) return offsets_[0];
  const size_t k = static_cast<size_t>(std::upper_bound(transitions_.begin(), transitions_.end(), t) -
                                       transitions_.begin()) - 1;
  return offsets_[types_[k]];
}

int64_t TimeZone::to_utc(int64_t local) const {
  // Each transition as a wall-clock time: the UTC instant plus the larger of the offsets
  // before and after it (zoneinfo's trans_list_wall[0]).
  int64_t off = offsets_[0];
  if (transitions_.empty() || local < transitions_.front() + std::max(offsets_[0], offsets_[types_[0]])) {
    if (transitions_.empty() && has_rule_) off = rule_offset_local(rule_, local);
    return local - off;
  }
  size_t k = 0;
  for (size_t i = 0; i < transitions_.size(); ++i) {
    const int64_t before = i == 0 ? offsets_[0] : offsets_[types_[i - 1]], after = offsets_[types_[i]];
    if (transitions_[i] + std::max(before, after) > local) break;
    k = i;
  }
  const size_t last = transitions_.size() - 1;
  const int64_t last_wall =
      transitions_[last] + std::max(last == 0 ? offsets_[0] : offsets_[types_[last - 1]], offsets_[types_[last]]);
  off = (local > last_wall && has_rule_) ? rule_offset_local(rule_, local) : offsets_[types_[k]];
  return local - off;
}

}  // namespace orchard
