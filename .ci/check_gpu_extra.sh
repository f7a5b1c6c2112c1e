#!/usr/bin/env bash
# Checks that `make install GPU=1` can resolve: pip's dry run of the CUDA build of the pinned
# torch with the gpu, dev, metrics and envs extras, in a throwaway venv (metadata and the resolver
# only, nothing is installed). No GPU is needed, so CPU-only CI catches a gpu extra that
# cannot install (as vllm 0.33.0, which pins another torch, did). One line on failure.
set -euo pipefail
cd "$(dirname "$0")/.."

# As the Makefile's GPU install: `!=2.13.0+cpu` keeps pip off a local CPU wheel of the same
# version, whose metadata (no triton, no CUDA libraries) would hide conflicts.
TORCH=${FORGE_GPU_TORCH:-'torch==2.13.0,!=2.13.0+cpu'}
EXTRAS=.[gpu,dev,metrics,envs]

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
${PYTHON:-python3} -m venv "$tmp/venv"
# A current pip resolves in about half the time of Python 3.11's bundled one (62 s vs 123 s).
"$tmp/venv/bin/pip" install --quiet --upgrade pip >"$tmp/pip.log" 2>&1 || {
    echo "check_gpu_extra: could not upgrade pip: $(tail -1 "$tmp/pip.log")" >&2
    exit 1
}
if ! "$tmp/venv/bin/pip" install --dry-run "$TORCH" "$EXTRAS" >"$tmp/pip.log" 2>&1; then
    # pip lists the clashing requirements under "The conflict is caused by:"; keep those.
    why=$(sed -n '/conflict is caused by/,/^$/p' "$tmp/pip.log" | sed '1d;/^$/d;s/^ *//' \
        | paste -sd ';' - | sed 's/;/; /g')
    [[ -n $why ]] || why=$(grep -v '^WARNING' "$tmp/pip.log" | tail -1)
    echo "check_gpu_extra: '$TORCH' '$EXTRAS' does not resolve: $why" >&2
    exit 1
fi
echo "check_gpu_extra: '$TORCH' '$EXTRAS' resolves ($((SECONDS - start)) s)"
