// tqkv serve -m MODEL --kv-cache-dtype SPEC [--device cpu|cuda] [--host H] [--port P]
//            [--kv-cache-memory BYTES | --max-seqs N]: an OpenAI-compatible server with
// continuous batching over the compressed cache (src/serve/, docs/SERVE.md). One engine
// thread runs the scheduler loop; HTTP threads enqueue requests and wait or stream.
// SIGINT/SIGTERM stop it cleanly (requests in flight are cancelled).
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

#include "commands.h"
#include "engine_cli.h"
#include "engine/cache/cache_spec.h"
#include "engine/gguf/gguf.h"
#include "engine/model/model.h"
#include "engine/cache/model_recipes.h"
#include "engine/model/paths.h"
#include "engine/gguf/tokenizer.h"
#include "serve/engine_loop.h"
#include "serve/http_server.h"
#include "tqkv/error.h"
#include "tqkv/threads.h"

namespace {
std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }
}  // namespace

void register_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching over the compressed KV cache");
  struct Opts {
    std::string model, format = "turboquant_k8v4", device = "cpu", host = "127.0.0.1", name;
    int port = 8080, ctx = 2048, max_seqs = 8, block = 16, budget = 512, threads = 0, pages = 0, http_threads = 1024;
    double memory = 0, idle_timeout = 5, read_timeout = 30, write_timeout = 30;
    size_t max_body = 1 << 20;
    std::string api_key;
    bool no_prefix = false;
  };
  static Opts o;
  add_model_options(cmd, o.model, o.threads, o.device);
  cmd->add_option("--kv-cache-dtype", o.format, tqkv::engine::cache_spec_help(tqkv::engine::known_recipe_names()))
      ->capture_default_str();
  cmd->add_option("--host", o.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", o.port, "port (0: any free port, printed at start-up)")->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("-c,--ctx", o.ctx, "positions per sequence (context), capped at the model's")
      ->check(CLI::Range(16, 1 << 20))->capture_default_str();
  cmd->add_option("--max-seqs", o.max_seqs, "sequences running at once; without --kv-cache-memory the page pool holds "
                                            "max-seqs x ctx positions")
      ->check(CLI::Range(1, 4096))->capture_default_str();
  cmd->add_option("--kv-cache-memory", o.memory, "page pool size in bytes (by the spec's bytes per position)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--kv-cache-pages", o.pages, "page pool size in pages (overrides --kv-cache-memory; tests)")
      ->check(CLI::Range(1, 1 << 30));
  cmd->add_option("--block-size", o.block, "positions per page")->check(CLI::Range(1, 1024))->capture_default_str();
  cmd->add_option("--token-budget", o.budget, "tokens per step (decodes + prefill chunks)")->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--served-model-name", o.name, "model id in /v1/models and responses (default: the file name)");
  cmd->add_option("--max-body", o.max_body, "largest request body in bytes (every transfer encoding)")->capture_default_str();
  cmd->add_option("--api-key", o.api_key, "require 'Authorization: Bearer KEY' on every endpoint but /health")
      ->envname("TQKV_API_KEY");
  cmd->add_option("--idle-timeout", o.idle_timeout, "seconds a connection may wait between requests (idle handler "
                                                    "threads end after as long)")
      ->check(CLI::Range(0.05, 3600.0))->capture_default_str();
  cmd->add_option("--read-timeout", o.read_timeout, "seconds for a request's line, headers and body to arrive (408)")
      ->check(CLI::Range(0.05, 3600.0))->capture_default_str();
  cmd->add_option("--write-timeout", o.write_timeout, "seconds a response write may make no progress before the "
                                                      "connection is closed")
      ->check(CLI::Range(0.05, 3600.0))->capture_default_str();
  cmd->add_option("--http-threads", o.http_threads, "most HTTP handler threads (started on demand; each open connection holds one)")->check(CLI::Range(2, 4096))->capture_default_str();
  cmd->add_flag("--no-prefix-sharing", o.no_prefix, "do not share full prompt pages between requests");
  cmd->callback([] {
    using namespace tqkv::engine;
    using namespace tqkv::serve;
    check_cache_spec(o.format, known_recipe_names());
    std::fprintf(stderr, "tqkv serve: loading %s ...\n", o.model.empty() ? default_model_path().c_str() : o.model.c_str());
    LoadedModel lm = load_model(o.model, o.threads, o.device);
    const std::string& path = lm.path;
    const Tokenizer& tok = lm.tok;
    Model& model = lm.model;
    const ModelConfig& c = model.config();
    const int ctx = std::min(o.ctx, c.ctx_train);
    const CacheSpec spec = model.resolve(o.format);
    const double per_token = spec.bytes(ctx, ctx).per_token();  // CacheSpec::bytes: the one accounting
    SchedulerConfig sc;
    sc.block_size = o.block;
    sc.max_seqs = o.max_seqs;
    sc.max_seq_len = ctx;
    sc.token_budget = o.budget;
    sc.prefix_sharing = !o.no_prefix;
    if (o.pages > 0) sc.num_pages = o.pages;
    else if (o.memory > 0) sc.num_pages = static_cast<int>(o.memory / (per_token * o.block));
    else sc.num_pages = static_cast<int>((static_cast<int64_t>(o.max_seqs) * ctx + o.block - 1) / o.block);
    if (sc.num_pages < 1)
      throw tqkv::Error(tqkv::ErrorCode::InvalidArgument, "--kv-cache-memory holds less than one page of " +
                                                              std::to_string(o.block) + " positions (" +
                                                              std::to_string(per_token * o.block) + " bytes)");
    EngineLoop loop(model, tok, spec, sc);
    HttpConfig hc;
    hc.host = o.host;
    hc.port = o.port;
    hc.max_body_bytes = o.max_body;
    hc.threads = o.http_threads;
    hc.idle_timeout_s = o.idle_timeout;
    hc.read_timeout_s = o.read_timeout;
    hc.write_timeout_s = o.write_timeout;
    hc.api_key = o.api_key;
    hc.model_name = o.name.empty() ? path.substr(path.find_last_of('/') + 1) : o.name;
    HttpServer http(loop, tok, hc);
    const int port = http.bind();
    const double pool_bytes = per_token * o.block * sc.num_pages;
    std::fprintf(stderr,
                 "tqkv serve: model %s (%s, %d layers), device %s, kv cache %s (%.4g bits/element, %.0f bytes/position)\n"
                 "tqkv serve: capacity %d sequences x %d tokens; page pool %d pages x %d tokens = %lld tokens (%.1f MiB); "
                 "token budget %d/step\n",
                 hc.model_name.c_str(), c.arch.c_str(), c.n_layers, model.device().name().c_str(), o.format.c_str(),
                 spec.bits_at(ctx), per_token, sc.max_seqs, ctx, sc.num_pages, sc.block_size,
                 static_cast<long long>(sc.num_pages) * sc.block_size, pool_bytes / 1048576.0, sc.token_budget);
    std::fprintf(stderr, "tqkv serve: %s; body limit %zu bytes; timeouts idle %gs, read %gs, write %gs\n",
                 o.api_key.empty() ? "no API key (anyone who reaches the port can use it)" : "API key required",
                 o.max_body, o.idle_timeout, o.read_timeout, o.write_timeout);
    std::printf("tqkv serve: listening on http://%s:%d\n", o.host.c_str(), port);
    std::fflush(stdout);

    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    std::atomic<bool> done{false};
    std::thread watcher([&] {
      while (!done.load()) {
        if (g_signal.load() != 0) {
          http.shutdown();  // cancels what is in flight, lets its answers out, stops listening
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
    http.listen();
    done.store(true);
    watcher.join();
    loop.stop();
    const EngineMetrics m = loop.metrics();
    std::fprintf(stderr,
                 "tqkv serve: stopped%s; %lld requests finished, %lld cancelled, %lld prompt and %lld generated tokens, "
                 "%lld preemptions, prefix hits %lld/%lld pages\n",
                 g_signal.load() ? " by signal" : "", static_cast<long long>(m.requests_finished),
                 static_cast<long long>(m.requests_aborted), static_cast<long long>(m.prompt_tokens),
                 static_cast<long long>(m.generated_tokens), static_cast<long long>(m.preemptions),
                 static_cast<long long>(m.prefix_hit_pages), static_cast<long long>(m.prefix_query_pages));
  });
}
