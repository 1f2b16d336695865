// The HTTP front end of `tqkv serve` (cpp-httplib, nlohmann/json): OpenAI-style
// POST /v1/completions and /v1/chat/completions (with "stream": true as server-sent events
// ending in `data: [DONE]`), GET /v1/models, /health and /metrics (Prometheus text). Handler
// threads parse and check a request, submit it to the engine loop (engine_loop.h) and wait for
// its events or stream them; bad input gets OpenAI's error JSON with a 4xx status and never
// reaches the engine. A streaming client that goes away is noticed at its next write and its
// request cancelled (freed at the next step).
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

#include "engine/gguf/tokenizer.h"
#include "engine_loop.h"
#include "tqkv/error.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}

namespace tqkv::serve {

struct ParsedRequest;
struct Limits;

struct HttpConfig {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port
  std::string model_name = "tqkv";
  size_t max_body_bytes = 1 << 20;  // every transfer encoding (chunked bodies included)
  int threads = 1024;  // most handler threads, started on demand (each open connection holds one)
  // Deadlines, in seconds: a connection waiting for its next request is closed after
  // idle_timeout (and a handler thread idle that long ends); a request's line, headers and
  // body must arrive within read_timeout of its first byte (else 408 and close); a write that
  // makes no progress for write_timeout ends the connection (and cancels its request).
  double idle_timeout_s = 5, read_timeout_s = 30, write_timeout_s = 30;
  std::string api_key;  // non-empty: every endpoint but /health needs "Authorization: Bearer KEY"
};

class HttpServer {
 public:
  HttpServer(EngineLoop& loop, const engine::Tokenizer& tok, const HttpConfig& cfg);
  ~HttpServer();
  // Binds the socket; returns the port. Throws tqkv::Error(InvalidArgument) when it cannot.
  int bind();
  // Serves until stop() (from any thread, e.g. a signal watcher).
  void listen();
  // Stops listening; connections close after their current request.
  void stop();
  // A graceful stop: stops the engine loop, so that every request in flight is cancelled (a
  // stream ends with an error event and `data: [DONE]`, a waiting request gets 503) and new ones
  // get 503; waits up to `grace` for those answers to be written; then stop().
  void shutdown(std::chrono::milliseconds grace = std::chrono::seconds(5));

 private:
  void routes();
  // One handler per endpoint.
  void health(const httplib::Request& req, httplib::Response& res);
  void metrics(const httplib::Request& req, httplib::Response& res);
  void models(const httplib::Request& req, httplib::Response& res);
  void model(const httplib::Request& req, httplib::Response& res);  // /v1/models/{id}
  void completions(const httplib::Request& req, httplib::Response& res);
  void chat_completions(const httplib::Request& req, httplib::Response& res);
  void generate(const ParsedRequest& p, httplib::Response& res, bool chat);
  Limits limits() const;
  EngineLoop& loop_;
  const engine::Tokenizer& tok_;
  HttpConfig cfg_;
  std::unique_ptr<httplib::Server> svr_;
  std::mutex in_flight_mu_;
  std::condition_variable in_flight_cv_;
  int in_flight_ = 0;  // requests submitted whose answers are not yet written
};

// The HTTP status of a tqkv::Error by its code: the one table (no message text is read).
// 400: the request asks for what cannot be done; 503: not now (Busy, Capacity); 500: the
// server's own files or device failed.
int http_status(ErrorCode code);

// Prometheus text of the engine's metrics (also used by tests).
std::string prometheus_text(const EngineMetrics& m);

}  // namespace tqkv::serve
