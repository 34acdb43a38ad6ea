# Source this: makes sure a Python environment with shardopt (and its test/DeepSpeed extras) is active.
# Uses the active virtualenv if there is one, else creates/uses .venv in the repo root.
# torch is pinned by a constraint so pip never pulls a multi-GB CUDA build on a CPU machine;
# override with SHARDOPT_TORCH_SPEC (e.g. "torch==2.13.0" or "torch>=2.6" on a GPU box).
# SHARDOPT_SKIP_INSTALL=1 uses the environment as it is, installing nothing (the tests run the demo so).
SHARDOPT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${VIRTUAL_ENV:-}" ]; then
    if [ ! -x "$SHARDOPT_ROOT/.venv/bin/python" ]; then
        python3 -m venv "$SHARDOPT_ROOT/.venv"
    fi
    # shellcheck disable=SC1091
    source "$SHARDOPT_ROOT/.venv/bin/activate"
fi
export SHARDOPT_CACHE="${SHARDOPT_CACHE:-$SHARDOPT_ROOT/.cache}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$SHARDOPT_CACHE/torch_extensions}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
mkdir -p "$SHARDOPT_CACHE"
stamp="$SHARDOPT_CACHE/installed-$(python -c 'import sys; print(sys.prefix.replace("/", "_"))')"
checkout_pth="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/shardopt-checkout.pth"
# (re)install also when this environment was last installed from another checkout: its editable shardopt would
# be that checkout's for every process that does not start in this one
if [ "${SHARDOPT_SKIP_INSTALL:-0}" != 1 ] && { [ ! -f "$stamp" ] || [ "$SHARDOPT_ROOT/pyproject.toml" -nt "$stamp" ] ||
        [ "$(cat "$checkout_pth" 2>/dev/null)" != "$SHARDOPT_ROOT" ]; }; then
    echo "${SHARDOPT_TORCH_SPEC:-torch==2.13.0}" > "$SHARDOPT_CACHE/constraints.txt"
    python -m pip install -q --upgrade pip
    python -m pip install -q -c "$SHARDOPT_CACHE/constraints.txt" "${SHARDOPT_TORCH_SPEC:-torch==2.13.0}"
    python -m pip install -q -c "$SHARDOPT_CACHE/constraints.txt" -e "$SHARDOPT_ROOT[dev,deepspeed,train,hf,lightning,torchtitan,torchft]"
    # the checkout's examples package (integrations/) importable from every script, not shipped in the wheel
    echo "$SHARDOPT_ROOT" > "$checkout_pth"
    touch "$stamp"
fi
