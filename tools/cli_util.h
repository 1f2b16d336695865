// Small helpers shared by the subcommands: comma-separated option lists and text files.
#pragma once
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tqkv/error.h"

// "a,b,,c" -> {"a", "b", "c"} (empty items dropped).
inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// This process's resident memory (VmRSS) in MiB; 0 where /proc is not there.
inline double resident_mib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // "VmRSS:  123 kB"
  return 0;
}

// The whole file; tqkv::Error(InvalidArgument) naming the path when it cannot be read.
inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "cannot read text '" + path + "' (run scripts/fetch_text.sh)");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
