// Every TQKV_* environment variable tqkv reads, in one registry: its name, kind (a switch, a
// count in a range, one of a few names, a path, a text), default and what it changes. Each
// reader asks here (env_bool, env_count, env_choice, env_text), so every value is parsed the
// same strict way: a malformed one is Error(InvalidArgument) naming the variable, the value and
// what is allowed, never a silent fallback ("abc" read as 0 would quietly turn a feature off).
// Unset or empty means the default. The values are read from the environment at each call (no
// caching here: the callers that read once say so), so a test's setenv takes effect at once.
// `tqkv env` prints the registry with the current values; docs/ENV.md is its table, held to it by
// a test (tests/core/test_options.cpp).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace tqkv {

enum class OptionKind {
  Bool,    // 0 or 1
  Count,   // a base-10 whole number in [min, max]
  Choice,  // one of `choices` ('|'-separated names)
  Path,    // a file or directory (any text)
  Text,    // any text
};

struct OptionInfo {
  const char* name;
  OptionKind kind;
  // The default as the docs table shows it. For a default that a reader works out at run time
  // (the CPU's threads, a kernel's own choice) a description in words, and the reader passes
  // the value (the overloads with `fallback`).
  const char* fallback;
  const char* area;  // "CPU", "GPU", "CPU and GPU", "files"
  const char* description;
  long long min = 0, max = 0;     // Count
  const char* choices = nullptr;  // Choice
};

// The registry, in the order of the docs table.
std::span<const OptionInfo> option_registry();
// The entry of `name`; Error(InvalidArgument) for a name that is not a registered variable.
const OptionInfo& option_info(std::string_view name);
// What `info` takes, in words ("0 or 1", "a whole number from 1 to 4096", "one of f32, int8", ...).
std::string option_allowed(const OptionInfo& info);

// The raw value of `name` where it is set and not empty.
std::optional<std::string> env_raw(const char* name);

// Bool: 1 -> true, 0 -> false; unset: the registry's default (or `fallback`).
bool env_bool(const char* name);
bool env_bool(const char* name, bool fallback);
// Count: the number; unset: the registry's default (or `fallback`).
long long env_count(const char* name);
long long env_count(const char* name, long long fallback);
// Choice: the name given, or the registry's default where unset; env_choice_if_set: nullopt
// where unset (for defaults a reader works out).
std::string env_choice(const char* name);
std::optional<std::string> env_choice_if_set(const char* name);
// Path / Text: the value, or "" where unset (the reader's default applies).
std::string env_text(const char* name);

// The current value of `info` as text: the environment's (checked) or the default.
// `from_env` says which. Throws as the readers do for a malformed value.
std::string option_value(const OptionInfo& info, bool* from_env = nullptr);
// Parses every registered variable that is set; throws the first malformed one's error. The
// `tqkv` tool calls it at start, so a bad value fails before any work.
void check_options();

}  // namespace tqkv
