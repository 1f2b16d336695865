#include "http_server.h"

#include <httplib.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "deadline_stream.h"
#include "request_parser.h"
#include "tqkv/error.h"
#include "utf8.h"

namespace tqkv::serve {

namespace {

using json = nlohmann::json;

// Responses as JSON text. Generated text is bytes decoded token by token, so it can hold an
// invalid or unfinished UTF-8 sequence (a byte-fallback token on its own); it becomes U+FFFD
// instead of an exception (which was an HTTP 500).
std::string wire(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// cpp-httplib's ThreadPool has a fixed number of workers, and a connection holds one for as
// long as it is open (a whole stream, then the keep-alive wait for its next request): with as
// many open connections as workers, a new one waits unserved. This pool starts a worker
// whenever the queued connections outnumber the idle workers, up to `max_threads`; a worker
// idle for `retire_after` ends (joined at the next enqueue or at shutdown).
class GrowingPool final : public httplib::TaskQueue {
 public:
  GrowingPool(size_t max_threads, std::chrono::milliseconds retire_after)
      : max_(std::max<size_t>(1, max_threads)), retire_after_(retire_after) {}
  ~GrowingPool() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    std::list<std::thread> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done.swap(retired_);
      jobs_.push_back(std::move(fn));
      if (jobs_.size() > idle_ && threads_.size() < max_) {
        threads_.emplace_back();
        threads_.back() = std::thread([this, it = std::prev(threads_.end())] { work(it); });
      } else {
        cv_.notify_one();
      }
    }
    for (std::thread& t : done) t.join();
  }
  // Runs what is queued, then joins every worker (the listener has stopped enqueuing).
  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    for (;;) {  // workers retiring meanwhile move themselves to retired_
      std::list<std::thread> all;
      {
        std::lock_guard<std::mutex> lock(mu_);
        all.splice(all.end(), threads_);
        all.splice(all.end(), retired_);
      }
      if (all.empty()) return;
      for (std::thread& t : all) t.join();
    }
  }

 private:
  void work(std::list<std::thread>::iterator self) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ++idle_;
      const bool woke = cv_.wait_for(lock, retire_after_, [&] { return !jobs_.empty() || stopping_; });
      --idle_;
      if (!woke || jobs_.empty()) {  // idle too long, or shutting down with nothing queued
        if (!stopping_) retired_.splice(retired_.end(), threads_, self);
        return;
      }
      std::function<void()> fn = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
  }

  const size_t max_;
  const std::chrono::milliseconds retire_after_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::list<std::thread> threads_, retired_;
  size_t idle_ = 0;
  bool stopping_ = false;
};

using Clock = std::chrono::steady_clock;

// The connection a handler thread serves (handlers and the error handler run on it).
struct Connection {
  DeadlineStream* stream = nullptr;
  bool close_after = false;  // the request's body was left unread: no keep-alive
};
thread_local Connection* t_connection = nullptr;

// cpp-httplib's server with our own connection loop around its request parser: deadlines and
// byte limits on every read (DeadlineStream), an idle timeout between requests, a prompt close
// on stop(), and the listen backlog widened from cpp-httplib 0.11's compiled-in 5.
class Listener final : public httplib::Server {
 public:
  explicit Listener(const HttpConfig& cfg)
      : limits_{cfg.idle_timeout_s, cfg.read_timeout_s, cfg.write_timeout_s, cfg.max_body_bytes + kHeaderBytes} {}
  int fd() const { return static_cast<int>(svr_sock_); }

 private:
  bool process_and_close_socket(socket_t sock) override {
    DeadlineStream strm(sock, limits_);
    Connection conn{&strm};
    t_connection = &conn;
    auto stopping = [this] { return svr_sock_ == INVALID_SOCKET; };
    bool ok = true;
    while (ok && !conn.close_after && strm.wait_for_request(stopping)) {
      strm.begin_request();
      bool closed = false;
      ok = process_request(strm, false, closed, nullptr);
      if (!ok && strm.timed_out()) timeout_reply(strm);  // cut in the request line: no answer was written
      ok = ok && !closed && !strm.timed_out() && !strm.over_budget();
    }
    t_connection = nullptr;
    if (conn.close_after || strm.over_budget()) linger(sock);
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }
  // A request refused with its body unsent or unread: closing at once would reset the
  // connection under a client still sending, which then never reads its answer. As web
  // servers do, say we are done writing and discard what still comes, for at most 2 s and
  // 64 MiB.
  static void linger(int sock) {
    ::shutdown(sock, SHUT_WR);
    const Clock::time_point end = Clock::now() + std::chrono::seconds(2);
    char sink[16 << 10];
    for (size_t left = size_t{64} << 20; left > 0;) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
      pollfd p{sock, POLLIN, 0};
      if (ms <= 0 || ::poll(&p, 1, static_cast<int>(ms)) <= 0) return;
      const ssize_t n = ::recv(sock, sink, sizeof sink, 0);
      if (n <= 0) return;
      left -= std::min(left, static_cast<size_t>(n));
    }
  }
  void timeout_reply(DeadlineStream& strm) const {
    const std::string body = R"({"error":{"message":"the request did not arrive within the read timeout",)"
                             R"("type":"invalid_request_error","param":null,"code":null}})";
    const std::string head = "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
    strm.write((head + body).data(), head.size() + body.size());
  }
  static constexpr size_t kHeaderBytes = 64 << 10;  // request line and headers, beyond the body limit
  const StreamLimits limits_;
};

json error_json(const std::string& message, const std::string& type, const std::string& param,
                const std::string& code = "") {
  json e = {{"message", message}, {"type", type}};
  e["param"] = param.empty() ? json(nullptr) : json(param);
  e["code"] = code.empty() ? json(nullptr) : json(code);
  return json{{"error", e}};
}

void send_error(httplib::Response& res, int status, const std::string& message, const std::string& param = "",
                const std::string& code = "") {
  res.status = status;
  const std::string type = status >= 500 ? "server_error" : "invalid_request_error";
  res.set_content(wire(error_json(message, type, param, code)), "application/json");
}

// An error answered before the request's body was read: the connection closes after it.
void refuse(httplib::Response& res, int status, const std::string& message, const std::string& code = "") {
  send_error(res, status, message, "", code);
  res.set_header("Connection", "close");
  if (t_connection) t_connection->close_after = true;
}

// The method an endpoint answers; nullptr for an unknown path.
const char* allowed_method(const std::string& path) {
  if (path == "/v1/completions" || path == "/v1/chat/completions") return "POST";
  if (path == "/health" || path == "/metrics" || path == "/v1/models" || path.rfind("/v1/models/", 0) == 0) return "GET";
  return nullptr;
}

// a == b in time that does not depend on where they differ.
bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char d = 0;
  for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
  return d == 0;
}

bool all_digits(const std::string& v) {
  return !v.empty() && v.size() <= 18 && std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A tqkv::Error with the HTTP status its code maps to (http_status).
void send_error(httplib::Response& res, const Error& e, const std::string& param = "") {
  send_error(res, http_status(e.code()), e.what(), param);
}

// Events of one request, handed from the engine thread to its handler thread.
struct Channel {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<TokenEvent> events;
  void push(const TokenEvent& ev) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(ev);
    cv.notify_one();
  }
  // Waits for at least one event (or the timeout); returns what has arrived.
  std::deque<TokenEvent> take(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, timeout, [&] { return !events.empty(); });
    std::deque<TokenEvent> out;
    out.swap(events);
    return out;
  }
};

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

json model_json(const std::string& id) { return {{"id", id}, {"object", "model"}, {"created", 0}, {"owned_by", "tqkv"}}; }

json usage_json(const TokenEvent& ev) {
  return {{"prompt_tokens", ev.n_prompt},
          {"completion_tokens", ev.n_generated},
          {"total_tokens", ev.n_prompt + ev.n_generated}};
}

void metric(std::ostringstream& o, const char* name, const char* type, const char* help, double v) {
  o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n" << name << " " << v << "\n";
}

void histogram(std::ostringstream& o, const char* name, const char* help, const Histogram& h) {
  o << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
  uint64_t cum = 0;
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cum += h.counts[i];
    o << name << "_bucket{le=\"" << h.bounds[i] << "\"} " << cum << "\n";
  }
  cum += h.counts.back();
  o << name << "_bucket{le=\"+Inf\"} " << cum << "\n" << name << "_sum " << h.sum << "\n" << name << "_count " << h.count << "\n";
}

// OpenAI logprobs of the tokens of a response, or of the tokens one streamed chunk carries:
// completions {tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}, chat
// {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
class LogprobList {
 public:
  LogprobList(const engine::Tokenizer& tok, bool chat) : tok_(tok), chat_(chat) {}
  void add(const TokenEvent& ev) {
    if (ev.token < 0) return;
    const std::string piece = tok_.piece(ev.token);
    if (chat_) {
      json top = json::array();
      for (const TokenLogprob& t : ev.top) top.push_back(entry(t.token, t.logprob));
      json e = entry(ev.token, ev.logprob);
      e["top_logprobs"] = std::move(top);
      content_.push_back(std::move(e));
    } else {
      json top = json::object();
      for (const TokenLogprob& t : ev.top) top[tok_.piece(t.token)] = t.logprob;
      tokens_.push_back(piece);
      token_logprobs_.push_back(ev.logprob);
      top_logprobs_.push_back(std::move(top));
      text_offset_.push_back(offset_);
    }
    if (!tok_.is_control(ev.token)) offset_ += piece.size();  // as the runner appends text
  }
  bool empty() const { return content_.empty() && tokens_.empty(); }
  // The list so far; starts a new one (text offsets keep counting).
  json take() {
    json out = chat_ ? json{{"content", std::move(content_)}}
                     : json{{"tokens", std::move(tokens_)},
                            {"token_logprobs", std::move(token_logprobs_)},
                            {"top_logprobs", std::move(top_logprobs_)},
                            {"text_offset", std::move(text_offset_)}};
    content_ = tokens_ = token_logprobs_ = top_logprobs_ = text_offset_ = json::array();
    return out;
  }

 private:
  json entry(int32_t token, float logprob) const {
    const std::string piece = tok_.piece(token);
    json bytes = json::array();
    for (unsigned char c : piece) bytes.push_back(static_cast<int>(c));
    return {{"token", piece}, {"logprob", logprob}, {"bytes", std::move(bytes)}};
  }
  const engine::Tokenizer& tok_;
  bool chat_;
  size_t offset_ = 0;
  json content_ = json::array(), tokens_ = json::array(), token_logprobs_ = json::array(),
       top_logprobs_ = json::array(), text_offset_ = json::array();
};

const std::string kDone = "data: [DONE]\n\n";

// What every response of one request carries.
struct Reply {
  std::string id;
  int64_t created;
  std::string model;
  bool chat;
  bool logprobs;
  bool include_usage;  // streams: usage in a last chunk of its own (else on the finish chunk)
  std::string echo;    // text before the answer
};

// Why a request the client did not cancel was aborted: shutdown, or the engine failed.
std::string abort_message(const EngineLoop& loop) {
  const std::string fatal = loop.fatal_error();
  return fatal.empty() ? "the request was cancelled: the server is shutting down"
                       : "the request was cancelled: the engine failed: " + fatal;
}

// A non-streamed answer: waits for the request's last event. A client that closes its
// connection meanwhile has its request cancelled (freed at the next step).
void whole_reply(const engine::Tokenizer& tok, EngineLoop& loop, int64_t id, Channel& ch, const Reply& r,
                 httplib::Response& res) {
  std::string text = r.echo;
  TokenEvent last;
  LogprobList lps(tok, r.chat);
  for (bool done = false; !done;) {
    if (t_connection && t_connection->stream->peer_gone()) {
      loop.cancel(id);
      t_connection->close_after = true;
      return send_error(res, 499, "the client closed the connection");
    }
    for (const TokenEvent& ev : ch.take(std::chrono::milliseconds(100))) {
      text += ev.text;
      if (r.logprobs) lps.add(ev);
      if (ev.finish != FinishReason::None) {
        last = ev;
        done = true;
      }
    }
  }
  if (last.finish == FinishReason::Abort) return send_error(res, 503, abort_message(loop));
  json choice = {{"index", 0}, {"finish_reason", finish_reason_name(last.finish)}};
  if (r.chat) choice["message"] = {{"role", "assistant"}, {"content", text}};
  else choice["text"] = text;
  choice["logprobs"] = r.logprobs ? lps.take() : json(nullptr);
  json out = {{"id", r.id},
              {"object", r.chat ? "chat.completion" : "text_completion"},
              {"created", r.created},
              {"model", r.model},
              {"choices", json::array({choice})},
              {"usage", usage_json(last)}};
  res.set_content(wire(out), "application/json");
}

// A streamed answer: one SSE event per step's text; the last carries finish_reason and usage.
// A client that goes away is noticed at the next write and its request cancelled.
void stream_reply(const engine::Tokenizer& tok, EngineLoop& loop, int64_t id, std::shared_ptr<Channel> ch,
                  const Reply& r, std::shared_ptr<void> in_flight, httplib::Response& res) {
  struct StreamState {
    bool finished = false, first = true;
    std::string pending;   // bytes of a character the next token completes
    LogprobList logprobs;  // of the tokens not yet sent
  };
  auto st = std::make_shared<StreamState>(StreamState{false, true, r.echo, LogprobList(tok, r.chat)});
  EngineLoop* lp = &loop;
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [ch, st, id, r, lp](size_t, httplib::DataSink& sink) {
        auto chunk = [&](const std::string& text, const TokenEvent* end) {
          json c = {{"index", 0}};
          if (r.chat) {
            json delta = json::object();
            if (st->first) delta["role"] = "assistant";
            if (!text.empty() || st->first) delta["content"] = text;
            c["delta"] = delta;
          } else {
            c["text"] = text;
          }
          c["logprobs"] = r.logprobs && !st->logprobs.empty() ? st->logprobs.take() : json(nullptr);
          c["finish_reason"] = end ? json(finish_reason_name(end->finish)) : json(nullptr);
          json out = {{"id", r.id},
                      {"object", r.chat ? "chat.completion.chunk" : "text_completion"},
                      {"created", r.created},
                      {"model", r.model},
                      {"choices", json::array({c})}};
          if (end && !r.include_usage) out["usage"] = usage_json(*end);
          st->first = false;
          std::string line = "data: " + wire(out) + "\n\n";
          if (end && r.include_usage) {  // OpenAI's usage chunk: no choices
            out["choices"] = json::array();
            out["usage"] = usage_json(*end);
            line += "data: " + wire(out) + "\n\n";
          }
          return sink.write(line.data(), line.size());
        };
        for (const TokenEvent& ev : ch->take(std::chrono::milliseconds(500))) {
          if (ev.finish == FinishReason::Abort) {  // shutdown or a failed engine: an error event, then [DONE]
            st->finished = true;
            const std::string end = "data: " + wire(error_json(abort_message(*lp), "server_error", "")) + "\n\n" + kDone;
            if (sink.write(end.data(), end.size())) sink.done();
            return true;
          }
          bool ok = true;
          st->pending += ev.text;
          if (r.logprobs) st->logprobs.add(ev);
          if (ev.finish != FinishReason::None) {
            st->finished = true;
            const std::string rest = std::move(st->pending);
            ok = (rest.empty() || chunk(rest, nullptr)) && chunk("", &ev);
            if (ok) ok = sink.write(kDone.data(), kDone.size());
            if (ok) sink.done();
            return ok;
          }
          const size_t ready = complete_utf8_prefix(st->pending);
          if (ready > 0 || st->first) {
            ok = chunk(st->pending.substr(0, ready), nullptr);
            st->pending.erase(0, ready);
          }
          if (!ok) {  // the client went away: free its sequence at the next step
            lp->cancel(id);
            st->finished = true;
            return false;
          }
        }
        return true;
      },
      [st, id, lp, in_flight](bool) {
        if (!st->finished) lp->cancel(id);
      });
}

}  // namespace

std::string prometheus_text(const EngineMetrics& m) {
  std::ostringstream o;
  metric(o, "tqkv_requests_running", "gauge", "Requests in the running batch.", m.running);
  metric(o, "tqkv_requests_waiting", "gauge", "Requests waiting for admission (preempted ones included).", m.waiting);
  metric(o, "tqkv_kv_pages_used", "gauge", "KV cache pages in use.", m.pages_used);
  metric(o, "tqkv_kv_pages_free", "gauge", "KV cache pages free.", m.pages_free);
  metric(o, "tqkv_kv_page_tokens", "gauge", "Positions per KV cache page.", m.block_size);
  metric(o, "tqkv_prompt_tokens_total", "counter", "Prompt tokens received.", static_cast<double>(m.prompt_tokens));
  metric(o, "tqkv_generation_tokens_total", "counter", "Tokens generated.", static_cast<double>(m.generated_tokens));
  metric(o, "tqkv_requests_finished_total", "counter", "Requests finished.", static_cast<double>(m.requests_finished));
  metric(o, "tqkv_requests_aborted_total", "counter", "Requests cancelled (client gone, shutdown).",
         static_cast<double>(m.requests_aborted));
  metric(o, "tqkv_steps_total", "counter", "Engine steps run.", static_cast<double>(m.steps));
  metric(o, "tqkv_preemptions_total", "counter", "Requests preempted (recomputed later).", static_cast<double>(m.preemptions));
  metric(o, "tqkv_prefix_cache_queries_total", "counter", "Full prompt pages looked up at admission.",
         static_cast<double>(m.prefix_query_pages));
  metric(o, "tqkv_prefix_cache_hits_total", "counter", "Full prompt pages found and shared.",
         static_cast<double>(m.prefix_hit_pages));
  metric(o, "tqkv_prefix_cache_copied_tokens_total", "counter",
         "Prompt positions copied from another request's cache instead of computed.",
         static_cast<double>(m.prefix_copied_tokens));
  histogram(o, "tqkv_time_to_first_token_seconds", "Time from arrival to the first token.", m.ttft);
  histogram(o, "tqkv_time_per_output_token_seconds", "Mean time per token after the first, per request.", m.tpot);
  return o.str();
}

int http_status(ErrorCode code) {
  switch (code) {
    case ErrorCode::Ok: return 200;
    case ErrorCode::InvalidArgument:  // the request asks for what cannot be done
    case ErrorCode::NonFinite:
    case ErrorCode::OutOfRange:
    case ErrorCode::Overflow: return 400;
    case ErrorCode::Capacity:  // full now; the same request may succeed later
    case ErrorCode::Busy: return 503;
    case ErrorCode::Format:  // the server's own files or devices
    case ErrorCode::Device: return 500;
  }
  return 500;
}

HttpServer::HttpServer(EngineLoop& loop, const engine::Tokenizer& tok, const HttpConfig& cfg)
    : loop_(loop), tok_(tok), cfg_(cfg), svr_(std::make_unique<Listener>(cfg_)) {
  const size_t threads = static_cast<size_t>(cfg_.threads);
  const std::chrono::milliseconds retire = std::max(millis(cfg_.idle_timeout_s), std::chrono::milliseconds(100));
  svr_->new_task_queue = [threads, retire] { return new GrowingPool(threads, retire); };
  svr_->set_payload_max_length(cfg_.max_body_bytes);
  routes();
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() {
  const int port = cfg_.port == 0 ? svr_->bind_to_any_port(cfg_.host) : (svr_->bind_to_port(cfg_.host, cfg_.port) ? cfg_.port : -1);
  if (port < 0)
    throw Error(ErrorCode::InvalidArgument, "cannot listen on " + cfg_.host + ":" + std::to_string(cfg_.port));
  // A burst of clients overflowed the backlog of 5 (handshakes dropped, retried a second later);
  // listen() again on a listening socket only changes its backlog (Linux, BSD).
  ::listen(static_cast<Listener&>(*svr_).fd(), SOMAXCONN);
  return port;
}

void HttpServer::listen() { svr_->listen_after_bind(); }

void HttpServer::shutdown(std::chrono::milliseconds grace) {
  loop_.stop();  // every request in flight gets its Abort event; new ones are refused (Busy: 503)
  {
    std::unique_lock<std::mutex> lock(in_flight_mu_);
    in_flight_cv_.wait_for(lock, grace, [&] { return in_flight_ == 0; });
  }
  stop();
}
void HttpServer::stop() {
  if (svr_) svr_->stop();
}

void HttpServer::routes() {
  httplib::Server& s = *svr_;
  // Before the body is read: the API key, then the framing (a Content-Length that is a number
  // within --max-body, or chunked alone); a refused request's connection closes.
  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    using R = httplib::Server::HandlerResponse;
    if (!cfg_.api_key.empty() && req.path != "/health" &&
        !same_secret(req.get_header_value("Authorization"), "Bearer " + cfg_.api_key)) {
      res.set_header("WWW-Authenticate", "Bearer");
      refuse(res, 401, "a valid API key is required: send 'Authorization: Bearer KEY'", "invalid_api_key");
      return R::Handled;
    }
    const bool has_length = req.has_header("Content-Length");
    if (req.has_header("Transfer-Encoding")) {
      std::string te = req.get_header_value("Transfer-Encoding");
      std::transform(te.begin(), te.end(), te.begin(), [](unsigned char c) { return std::tolower(c); });
      if (te != "chunked" || has_length || req.get_header_value_count("Transfer-Encoding") > 1) {
        refuse(res, 400, "Transfer-Encoding must be 'chunked' alone, without Content-Length");
        return R::Handled;
      }
    }
    if (has_length) {
      const std::string v = req.get_header_value("Content-Length");
      if (!all_digits(v) || req.get_header_value_count("Content-Length") > 1) {
        refuse(res, 400, "Content-Length must be one non-negative integer");
        return R::Handled;
      }
      if (std::stoull(v) > cfg_.max_body_bytes) {
        refuse(res, 413, "the request body is larger than the limit of " + std::to_string(cfg_.max_body_bytes) + " bytes");
        return R::Handled;
      }
    }
    return R::Unhandled;
  });
  // Errors httplib answers itself (a request cut by a deadline or the byte limit, 404, a wrong
  // method) get OpenAI's error JSON too.
  s.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const DeadlineStream* strm = t_connection ? t_connection->stream : nullptr;
    if (strm && strm->over_budget())
      return refuse(res, 413, "the request body is larger than the limit of " + std::to_string(cfg_.max_body_bytes) + " bytes");
    if (strm && strm->timed_out())
      return refuse(res, 408, "the request did not arrive within " + std::to_string(cfg_.read_timeout_s) + " s");
    const char* allowed = allowed_method(req.path);
    if (allowed && req.method != allowed && !(req.method == "HEAD" && std::string(allowed) == "GET")) {
      res.set_header("Allow", allowed);
      return send_error(res, 405, "method " + req.method + " is not allowed on " + req.path + " (use " + allowed + ")");
    }
    send_error(res, res.status, res.status == 404 ? "no such endpoint" : "request failed");
  });
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    try {
      if (ep) std::rethrow_exception(ep);
      send_error(res, 500, "internal error");
    } catch (const Error& e) {
      send_error(res, e);
    } catch (const std::exception& e) {
      send_error(res, 500, e.what());
    } catch (...) {
      send_error(res, 500, "internal error");
    }
  });
  using Handler = void (HttpServer::*)(const httplib::Request&, httplib::Response&);
  auto bind = [this](Handler h) { return [this, h](const httplib::Request& req, httplib::Response& res) { (this->*h)(req, res); }; };
  s.Get("/health", bind(&HttpServer::health));
  s.Get("/metrics", bind(&HttpServer::metrics));
  s.Get("/v1/models", bind(&HttpServer::models));
  s.Get(R"(/v1/models/(.+))", bind(&HttpServer::model));
  s.Post("/v1/completions", bind(&HttpServer::completions));
  s.Post("/v1/chat/completions", bind(&HttpServer::chat_completions));
}

void HttpServer::health(const httplib::Request&, httplib::Response& res) {
  const std::string fatal = loop_.fatal_error();
  if (!fatal.empty()) return send_error(res, 503, "the engine stopped: " + fatal);
  res.set_content(R"({"status":"ok"})", "application/json");
}

void HttpServer::metrics(const httplib::Request&, httplib::Response& res) {
  res.set_content(prometheus_text(loop_.metrics()), "text/plain; version=0.0.4");
}

void HttpServer::models(const httplib::Request&, httplib::Response& res) {
  res.set_content(wire({{"object", "list"}, {"data", json::array({model_json(cfg_.model_name)})}}), "application/json");
}

void HttpServer::model(const httplib::Request& req, httplib::Response& res) {
  const std::string id = req.matches[1];
  if (id != cfg_.model_name)
    return send_error(res, 404, "the model '" + id + "' does not exist", "model", "model_not_found");
  res.set_content(wire(model_json(id)), "application/json");
}

Limits HttpServer::limits() const { return {loop_.config().max_seq_len, tok_.n_vocab(), cfg_.model_name}; }

void HttpServer::completions(const httplib::Request& req, httplib::Response& res) {
  ParsedRequest p;
  try {
    p = parse_completion_request(req.body, tok_, limits());
  } catch (const BadRequest& e) {
    return send_error(res, e.status, e.message, e.param, e.code);
  }
  generate(p, res, false);
}

void HttpServer::chat_completions(const httplib::Request& req, httplib::Response& res) {
  ParsedRequest p;
  try {
    p = parse_chat_request(req.body, tok_, limits());
  } catch (const BadRequest& e) {
    return send_error(res, e.status, e.message, e.param, e.code);
  } catch (const Error& e) {  // a model without a chat template
    return send_error(res, e);
  }
  generate(p, res, true);
}

// Submits a checked request and answers it whole or as a stream.
void HttpServer::generate(const ParsedRequest& p, httplib::Response& res, bool chat) {
  auto ch = std::make_shared<Channel>();
  int64_t id = 0;
  try {
    id = loop_.submit(p.prompt, p.opt, [ch](const TokenEvent& ev) { ch->push(ev); });
  } catch (const Error& e) {
    // Scheduler::check: the prompt alone, or the prompt with max_tokens, beyond what fits.
    const bool prompt_too_long = static_cast<int64_t>(p.prompt.size()) >= loop_.config().max_seq_len;
    return send_error(res, e, prompt_too_long ? "prompt" : "max_tokens");
  }
  const Reply r{(chat ? "chatcmpl-" : "cmpl-") + std::to_string(id), unix_now(), cfg_.model_name, chat,
                p.opt.logprobs >= 0, p.include_usage, p.echo};
  // Counted until its answer is written (a stream: until the response is released).
  auto in_flight = std::shared_ptr<void>(nullptr, [this](void*) {
    std::lock_guard<std::mutex> lock(in_flight_mu_);
    if (--in_flight_ == 0) in_flight_cv_.notify_all();
  });
  {
    std::lock_guard<std::mutex> lock(in_flight_mu_);
    ++in_flight_;
  }
  if (p.stream) stream_reply(tok_, loop_, id, ch, r, std::move(in_flight), res);
  else whole_reply(tok_, loop_, id, *ch, r, res);
}

}  // namespace tqkv::serve
