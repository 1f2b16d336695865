// The HTTP front end of `tqkv serve` (cpp-httplib, nlohmann/json): OpenAI-style
// POST /v1/completions and /v1/chat/completions (with "stream": true as server-sent events
// ending in `data: [DONE]`), GET /v1/models, /health and /metrics (Prometheus text). Handler
// threads parse and check a request, submit it to the engine loop (engine_loop.h) and wait for
// its events or stream them; bad input gets OpenAI's error JSON with a 4xx status and never
// reaches the engine. A streaming client that goes away is noticed at its next write and its
// request cancelled (freed at the next step).
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "engine/gguf/tokenizer.h"
#include "engine_loop.h"

namespace httplib {
class Server;
}

namespace tqkv::serve {

struct HttpConfig {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port
  std::string model_name = "tqkv";
  size_t max_body_bytes = 1 << 20;
  int threads = 1024;  // most handler threads, started on demand (each open connection holds one)
};

class HttpServer {
 public:
  HttpServer(EngineLoop& loop, const engine::Tokenizer& tok, const HttpConfig& cfg);
  ~HttpServer();
  // Binds the socket; returns the port. Throws tqkv::Error(InvalidArgument) when it cannot.
  int bind();
  // Serves until stop() (from any thread, e.g. a signal watcher).
  void listen();
  void stop();

 private:
  void routes();
  EngineLoop& loop_;
  const engine::Tokenizer& tok_;
  HttpConfig cfg_;
  std::unique_ptr<httplib::Server> svr_;
};

// Prometheus text of the engine's metrics (also used by tests).
std::string prometheus_text(const EngineMetrics& m);

}  // namespace tqkv::serve
