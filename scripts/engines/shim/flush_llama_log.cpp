// HARNESS WORKAROUND for a llama.cpp bug (not ours; see docs/engines.md, "llama.cpp: lost log tail").
// common/log.cpp, common_log_main(): the logger singleton is leaked on purpose (llama.cpp issue 22142),
// so entries still queued for its worker thread when a tool returns from main() are never written:
// llama-perplexity regularly loses "[4]..." and "Final estimate", llama-completion its last tokens.
// Preloaded into the tools, this destructor pauses (= drains and joins) the logger at exit.
struct common_log;
struct common_log * common_log_main();
void common_log_pause(struct common_log * log);

__attribute__((destructor)) static void mla_convert_flush_llama_log() { common_log_pause(common_log_main()); }
