// Text <-> token ids, built from a GGUF file's tokenizer.ggml.* metadata.
//
// Two models:
//  - "gpt2": byte-level BPE (GPT-2 style; SmolLM2, Qwen2). Text is split by the
//    pre-tokenizer named in tokenizer.ggml.pre (GPT-2's rule, with digits isolated for
//    "smollm"; Llama 3's rule with single digits for "qwen2"), each piece's bytes are mapped to printable
//    code points, and merges are applied by rank (tokenizer.ggml.merges order).
//  - "llama": SentencePiece style BPE. Spaces become U+2581, pieces merge by highest score
//    (tokenizer.ggml.scores), and anything left out of the vocabulary falls back to <0xXX>
//    byte tokens.
// Special tokens are matched verbatim in the input, longest first, as llama.cpp and Hugging
// Face do: user-defined ones (Gemma's whitespace runs, Qwen's <tool_call>) always, control
// ones only when parse_special is set, so chat-template markers like <|im_start|> become
// single ids in prompts and stay text in a document.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tqkv::engine {

class GgufFile;

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

class Tokenizer {
 public:
  enum class Kind { BytePairGpt2, SentencePiece };

  // Throws tqkv::Error(Format) when the metadata is missing or inconsistent.
  static Tokenizer from_gguf(const GgufFile& f);

  // The pieces of a vocabulary, for tests and for models built by hand.
  // types: llama.cpp token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
  Tokenizer(Kind kind, std::vector<std::string> tokens, std::vector<int> types, std::vector<float> scores,
            const std::vector<std::string>& merges);

  std::vector<int32_t> encode(std::string_view text, bool parse_special = true, bool add_bos = false) const;
  // The bytes of one token (byte tokens give their byte, control tokens their text).
  std::string piece(int32_t id) const;
  std::string decode(std::span<const int32_t> ids, bool skip_control = false) const;

  int n_vocab() const { return static_cast<int>(tokens_.size()); }
  Kind kind() const { return kind_; }
  int32_t bos() const { return bos_; }
  int32_t eos() const { return eos_; }
  bool add_bos() const { return add_bos_; }
  bool is_control(int32_t id) const;
  // End of generation: eos, or a control token that ends a turn (<|im_end|>, <|eot_id|>, ...).
  bool is_end_of_generation(int32_t id) const;
  int32_t token_id(std::string_view text) const;  // -1 when absent
  // At least as many bytes as any one token covers in the text (a stored piece is never shorter
  // than the text it stands for), so text of n bytes encodes to at least n / max_token_bytes()
  // tokens: a server refuses an oversized prompt before tokenizing it.
  size_t max_token_bytes() const { return max_token_bytes_; }

  // The model's chat template (tokenizer.chat_template) rendered for these messages. The
  // templates are Jinja; rather than embed a Jinja engine we recognise the common families
  // (ChatML, Llama 3, Gemma, Llama 2) and render them natively, including ChatML's default
  // system prompt when the template carries one. A file without a template gets the family
  // whose turn markers its vocabulary has as control tokens (<start_of_turn>: Gemma,
  // <|im_start|>: ChatML, <|start_header_id|>: Llama 3). Throws Error(InvalidArgument) for an
  // unrecognised template.
  std::string apply_chat_template(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true) const;
  const std::string& chat_template() const { return chat_template_; }

 private:
  void build_index();
  void split_special(std::string_view text, bool control,
                     std::vector<std::pair<std::string_view, int32_t>>& parts) const;
  void encode_gpt2(std::string_view text, std::vector<int32_t>& out) const;
  void encode_spm(std::string_view text, std::vector<int32_t>& out, bool first) const;

  Kind kind_;
  std::vector<std::string> tokens_;
  std::vector<int> types_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int32_t> index_;
  std::unordered_map<std::string, int> merge_rank_;  // "left right" -> rank
  // Control and user-defined tokens by their first byte, longest first.
  std::array<std::vector<int32_t>, 256> specials_;
  std::vector<int32_t> end_of_gen_;
  int32_t bos_ = -1, eos_ = -1, unk_ = -1;
  size_t max_token_bytes_ = 1;
  bool add_bos_ = false;
  bool add_space_prefix_ = true;
  bool split_digits_ = false;  // the pre-tokenizer isolates every digit (SmolLM, StarCoder)
  bool llama3_split_ = false;  // Llama 3's split rule with single digits (tokenizer.ggml.pre "qwen2")
  std::string chat_template_;
};

}  // namespace tqkv::engine
