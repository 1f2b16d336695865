// tqkv bench decode -m MODEL [--depths 0,1024,4096] [--batch 1,16] [-n 64] [--formats f16,tq-k4v4] [--json]
//                   [--device cuda] [--cuda-graphs both|on|off]
//
// Decode and prefill speed of a model, as llama.cpp's `llama-bench -p 0 -n N -d DEPTHS`
// measures them: for each cache format one sequence is prefilled to each depth in turn (in
// one batched forward per step, of the tokens from the previous depth up), then N tokens are
// decoded one at a time after one untimed step. Tokens are pseudo-random ids (a fixed seed),
// so no text is needed and every format sees the same ones. Reports per format and depth:
// decode tokens/s (wall clock, and per process CPU-second, which sees less of other
// processes on a shared machine) and the prefill tokens/s of the step that reached the
// depth; a Markdown table, or JSON with --json. Process RSS after load is printed with the
// model line. With --batch B, B sequences are prefilled to each depth (one after another) and
// every decode step is one batch of B tokens, one per sequence (tokens/s counts all B); each row
// also gives the cache bytes one sequence holds at that depth and how many such sequences fit
// in --budget-gib of cache memory (CacheSpec::bytes, the accounting every command reports).
// --prefill-chunk C prefills in forwards of at most C tokens (a server's chunked prefill; 0, the
// default: one forward per depth step, split only where the cache takes fewer tokens at once).
// On the GPU, --cuda-graphs both (the default) times the decode steps replayed from CUDA graphs
// and then as many steps op by op (n + 1 positions deeper); on or off times one of them. The
// "attention %" column is the share of the decode steps' time spent in the cache's attend
// (store and attention; the rest is products, norms, RoPE, sampling's logits copy and, op by
// op, launch overhead), of the steps run op by op: a replayed graph is not split.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cli_util.h"
#include "commands.h"
#include "engine_cli.h"
#include "engine/cache/kv_cache.h"
#include "engine/model/model.h"
#include "tqkv/simd.h"

namespace {

struct DecodeBenchOptions {
  std::string model, device = "cpu", formats = "f16,tq-k4v4", depths = "0,1024,4096", batches = "1", simd,
      graphs = "both", step_output = "greedy";
  int threads = 0, n = 64, prefill_chunk = 0, capacity = 0;
  double budget_gib = 40;
  bool json = false;
};

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Row {
  std::string format;
  int depth = 0, batch = 1;
  int prefill_tokens = 0;
  double seq_bytes = 0, fit = 0;  // tokens of the step that reached `depth`
  double prefill_tps = 0, decode_tps = 0, decode_cpu_tps = 0;
  double decode_tps_op_by_op = 0;  // with --cuda-graphs both: the same steps without graphs
  // Share of the decode steps' time spent in attention (Device::attention_begin/end), of the steps
  // run op by op (on CUDA a replayed graph is not split): -1 where none were.
  double attention_share = -1;
};

}  // namespace

void register_bench_decode(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("decode", "Time a model's decode (and prefill) at several cache depths, per format");
  static DecodeBenchOptions o;
  add_model_options(cmd, o.model, o.threads, o.device);
  add_graphs_option(cmd, o.graphs, {"on", "off", "both"});
  cmd->add_option("--formats", o.formats, "comma-separated cache specs")->capture_default_str();
  cmd->add_option("--depths", o.depths, "comma-separated context depths to decode at")->capture_default_str();
  cmd->add_option("--batch", o.batches, "comma-separated decode batch sizes (sequences per step)")->capture_default_str();
  cmd->add_option("--budget-gib", o.budget_gib, "cache memory for the 'sequences that fit' column")->capture_default_str();
  cmd->add_option("-n,--n-decode", o.n, "tokens decoded at each depth")->check(CLI::Range(1, 4096))->capture_default_str();
  cmd->add_option("--prefill-chunk", o.prefill_chunk, "tokens per prefill forward (0: the whole step at once)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--simd", o.simd, "force a kernel level: scalar, avx2, avx512");
  cmd->add_option("--capacity", o.capacity,
                  "positions per sequence the caches are made for (0: the deepest depth plus the decoded steps)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--step-output", o.step_output,
                  "what a decode step returns: greedy (each sequence's argmax id, picked on the device, as generate "
                  "and serve do at temperature 0) or logits (every sequence's logits copied to the host, as "
                  "llama-batched-bench does)")
      ->check(CLI::IsMember({"greedy", "logits"}))
      ->capture_default_str();
  cmd->add_flag("--json", o.json, "print JSON");
  cmd->callback([] {
    using namespace tqkv::engine;
    if (!o.simd.empty()) tqkv::set_simd_level(tqkv::parse_simd_level(o.simd));
    std::vector<int> depths;
    for (const std::string& d : split_list(o.depths)) depths.push_back(std::stoi(d));
    std::sort(depths.begin(), depths.end());
    if (depths.empty() || depths.front() < 0) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "--depths: give depths >= 0");
    LoadedModel lm = load_model(o.model, o.threads, o.device);
    const Model& model = lm.model;
    Device& device = model.device();
    device.set_step_graphs(o.graphs != "off");
    const bool both = o.graphs == "both" && device.step_graphs();  // a device with graphs: time both
    const double rss = resident_mib();
    const int V = model.config().n_vocab;
    const int needed = depths.back() + static_cast<int>(depths.size()) * (both ? 2 : 1) * (o.n + 2) + 1;
    if (o.capacity > 0 && o.capacity < needed)
      throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "--capacity " + std::to_string(o.capacity) + ": these depths and steps need " +
                                                              std::to_string(needed) + " positions");
    const int capacity = std::max(o.capacity, needed);
    if (o.budget_gib <= 0) throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "--budget-gib: give a size > 0");
    std::mt19937 rng(1);
    std::vector<int32_t> tokens(static_cast<size_t>(capacity));
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(V));
    std::vector<float> logits(V);
    std::vector<Row> rows;
    using clock = std::chrono::steady_clock;
    std::vector<int> batches;
    for (const std::string& b : split_list(o.batches)) batches.push_back(std::stoi(b));
    if (batches.empty() || *std::min_element(batches.begin(), batches.end()) < 1)
      throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "--batch: give batch sizes >= 1");
    for (const std::string& format : split_list(o.formats)) {
      for (const int B : batches) {
        auto cache = model.make_cache(format, capacity, B);
        std::vector<int64_t> seqs;
        for (int b = 0; b < B; ++b) seqs.push_back(cache->add_sequence());
        std::vector<float> step_logits(o.step_output == "logits" ? static_cast<size_t>(B) * V : 0);
        std::vector<int32_t> step_ids(static_cast<size_t>(B));
        const LogitsOut step_out =
            o.step_output == "greedy" ? LogitsOut::greedy(step_ids.data()) : LogitsOut(step_logits.data());
        // One decode step: token `at` of the stream for every sequence, at position `at`.
        auto decode_step = [&](int at) {
          Batch step;
          for (const int64_t s : seqs) step.add(s, &tokens[at], 1, at, false);
          model.forward(step, *cache, step_out);
        };
        int len = 0;
        for (int depth : depths) {
          Row r;
          r.format = format;
          r.depth = depth;
          r.batch = B;
          if (depth > len) {  // the decoded tokens of the previous depth count towards this one
            r.prefill_tokens = depth - len;
            const auto t0 = clock::now();
            const int chunk = o.prefill_chunk > 0 ? o.prefill_chunk : depth - len;
            for (const int64_t s : seqs)
              for (int t = len; t < depth; t += chunk)
                model.forward(s, &tokens[t], std::min(chunk, depth - t), *cache, logits.data(), false);
            r.prefill_tps = static_cast<double>(r.prefill_tokens) * B /
                            std::chrono::duration<double>(clock::now() - t0).count();
            len = depth;
          }
          // One untimed step first, as llama-bench warms up: the first forward of a process
          // (or after a prefill) allocates and first-touches its buffers (and a bucket's first
          // two steps warm up and record its CUDA graph).
          decode_step(len++);
          decode_step(len++);
          const bool split = !device.step_graphs();  // steps run op by op: attention timed
          device.set_attention_timing(split);
          device.profile_range(true);  // a profiler started with collection off sees these steps only
          const auto t0 = clock::now();
          const double c0 = cpu_seconds();
          for (int i = 0; i < o.n; ++i) decode_step(len++);
          const double wall = std::chrono::duration<double>(clock::now() - t0).count();
          device.profile_range(false);
          r.decode_tps = static_cast<double>(o.n) * B / wall;
          r.decode_cpu_tps = static_cast<double>(o.n) * B / (cpu_seconds() - c0);
          if (split) r.attention_share = device.attention_seconds() / wall;
          device.set_attention_timing(false);
          if (both) {  // the next steps op by op (n + 1 positions deeper)
            device.set_step_graphs(false);
            decode_step(len++);
            device.set_attention_timing(true);
            const auto t1 = clock::now();
            for (int i = 0; i < o.n; ++i) decode_step(len++);
            const double wall1 = std::chrono::duration<double>(clock::now() - t1).count();
            r.decode_tps_op_by_op = static_cast<double>(o.n) * B / wall1;
            r.attention_share = device.attention_seconds() / wall1;
            device.set_attention_timing(false);
            device.set_step_graphs(true);
          }
          r.seq_bytes = static_cast<double>(cache->spec().bytes(depth, std::max(depth, 1)).total());
          r.fit = r.seq_bytes > 0 ? std::floor(o.budget_gib * 1073741824.0 / r.seq_bytes) : 0;
          rows.push_back(r);
        }
      }
    }
    if (o.json) {
      nlohmann::json j = {{"model", lm.path},
                          {"threads", tqkv::num_threads()},
                          {"simd", std::string(tqkv::simd_level_name(tqkv::active_simd_level()))},
                          {"weights_mib", model.weight_bytes() / 1048576.0},
                          {"rss_mib", rss},
                          {"n_decode", o.n},
                          {"prefill_chunk", o.prefill_chunk},
                          {"step_output", o.step_output},
                          {"rows", nlohmann::json::array()}};
      for (const Row& r : rows)
        j["rows"].push_back({{"format", r.format},
                             {"depth", r.depth},
                             {"batch", r.batch},
                             {"cache_bytes_per_sequence", r.seq_bytes},
                             {"sequences_in_budget", r.fit},
                             {"prefill_tokens", r.prefill_tokens},
                             {"prefill_tokens_per_s", r.prefill_tps},
                             {"decode_tokens_per_s", r.decode_tps},
                             {"decode_tokens_per_cpu_s", r.decode_cpu_tps},
                             {"attention_share", r.attention_share < 0 ? nlohmann::json(nullptr)
                                                                       : nlohmann::json(r.attention_share)}});
      if (both)
        for (size_t i = 0; i < rows.size(); ++i)
          j["rows"][i]["decode_tokens_per_s_without_graphs"] = rows[i].decode_tps_op_by_op;
      std::printf("%s\n", j.dump(2).c_str());
      return;
    }
    std::printf("model %s, %d threads, %s, weights %.0f MiB, RSS after load %.0f MiB\n\n", lm.path.c_str(),
                tqkv::num_threads(), std::string(tqkv::simd_level_name(tqkv::active_simd_level())).c_str(),
                model.weight_bytes() / 1048576.0, rss);
    std::printf("decode steps return %s\n\n", o.step_output == "greedy" ? "argmax ids (--step-output greedy)" : "logits (--step-output logits)");
    const char* graphs = !device.step_graphs() ? "" : both ? ", CUDA graphs" : ", CUDA graphs on";
    std::printf("| format | batch | depth | decode tokens/s (tg%d%s) | %sper CPU-second | prefill tokens/s (tokens) | "
                "cache MiB/seq | seqs in %.0f GiB | attention %%%s |\n", o.n, graphs, both ? "without graphs | " : "",
                o.budget_gib, both ? " (without graphs)" : "");
    std::printf("|---|---|---|---|---|---|---|---|---|%s\n", both ? "---|" : "");
    for (const Row& r : rows) {
      std::printf("| %s | %d | %d | %.2f | ", r.format.c_str(), r.batch, r.depth, r.decode_tps);
      if (both) std::printf("%.2f | ", r.decode_tps_op_by_op);
      std::printf("%.2f | ", r.decode_cpu_tps);
      if (r.prefill_tokens)
        std::printf("%.1f (%d) | ", r.prefill_tps, r.prefill_tokens);
      else
        std::printf("- | ");
      std::printf("%.2f | %.0f | ", r.seq_bytes / 1048576.0, r.fit);
      if (r.attention_share >= 0)
        std::printf("%.0f |\n", 100.0 * r.attention_share);
      else
        std::printf("- |\n");
    }
  });
}
