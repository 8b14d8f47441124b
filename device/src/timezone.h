// IANA time zones for the policy's daily window, read from the system's zoneinfo
// (TZif files, RFC 8536: version 1 to 4, the 64-bit section and the POSIX TZ footer that
// extends the table past its last transition). libstdc++ before GCC 14 has no
// std::chrono::tzdb, and the C library's zone is process-wide state (TZ, tzset) that a
// library must not touch; this reads the same files Python's zoneinfo reads, per zone,
// with no global state.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace orchard {

class TimeZone {
 public:
  // The zone `name` ("Europe/Paris") from `zoneinfo_dir` (default: $ORCHARD_ZONEINFO, else
  // /usr/share/zoneinfo). Failure(ORCHARD_ERR_BUNDLE) for a name that is not a zone there
  // or a file that is not TZif, naming the file and what to do.
  static std::shared_ptr<const TimeZone> load(const std::string& name, const std::string& zoneinfo_dir = "");

  // Seconds east of UTC in force at `unix_s` (Python's datetime.fromtimestamp(t, zone)).
  int64_t utc_offset(int64_t unix_s) const;
  // The UTC instant of local wall-clock time `local_s` (seconds since 1970-01-01 local),
  // as Python's zoneinfo resolves it with fold = 0: a time skipped by a change to
  // daylight time takes the offset before it, a repeated time its first occurrence.
  int64_t to_utc(int64_t local_s) const;

  const std::string& name() const { return name_; }

  // A POSIX TZ rule ("CET-1CEST,M3.5.0,M10.5.0/3"), for the times after the table.
  struct Rule {
    int64_t std_offset = 0, dst_offset = 0;  // seconds east of UTC
    bool has_dst = false;
    struct Date {
      char kind = 'M';  // 'M' month.week.day, 'J' Julian 1..365 without Feb 29, 'D' zero-based day of year
      int month = 0, week = 0, day = 0;
      int64_t time_s = 7200;  // local time of the change
    } start, end;
  };

 private:
  std::string name_;
  std::vector<int64_t> transitions_;  // unix seconds, ascending
  std::vector<uint8_t> types_;        // the type in force from each transition
  std::vector<int64_t> offsets_;      // each type's UTC offset
  bool has_rule_ = false;
  Rule rule_;
};

// Parse a POSIX TZ string; false when it is not one.
bool parse_posix_tz(const std::string& s, TimeZone::Rule* out);

}  // namespace orchard
